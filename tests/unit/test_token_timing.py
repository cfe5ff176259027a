"""A stream's timing: when it has stopped producing (`TokenTiming.stopped`), and
when a moved one is under way again (`TokenTiming.resuming`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from proxy.metrics import FerryMetrics
from proxy.migrator import Migrator
from proxy.policy import Priority
from proxy.sse import STOPPED_FLOOR_S, STOPPED_GAPS, TokenTiming


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def timing_with_gaps(clock: Clock, gaps: list[float]) -> TokenTiming:
    timing = TokenTiming(FerryMetrics(), clock, arrived=clock.now, model="m")
    timing.token("a")
    for gap in gaps:
        clock.now += gap
        timing.token("a")
    return timing


def test_a_stream_has_stopped_after_several_of_its_own_gaps() -> None:
    clock = Clock()
    slow = timing_with_gaps(clock, [0.2] * 10)  # 200 ms per chunk
    clock.now += 0.5
    assert not slow.stopped()  # a slow step, not a stop
    clock.now += STOPPED_GAPS * 0.2 - 0.5 + 0.01
    assert slow.stopped()


def test_a_fast_stream_is_judged_by_the_floor_and_a_move_s_downtime_is_not_its_pace() -> None:
    clock = Clock()
    fast = timing_with_gaps(clock, [0.01] * 10)
    clock.now += STOPPED_FLOOR_S * 0.9
    assert not fast.stopped()
    clock.now += STOPPED_FLOOR_S * 0.2
    assert fast.stopped()
    usual = fast.gap_s
    fast.cut()  # a move: the gap it ends is downtime
    clock.now += 2.0
    fast.token("b")
    assert fast.gap_s == usual


def test_a_move_before_the_first_token_is_no_downtime_but_a_later_one_is() -> None:
    clock = Clock()
    metrics = FerryMetrics()
    timing = TokenTiming(metrics, clock, arrived=clock.now, model="m")
    timing.cut()  # a queued request moved: it waits on, for its first token
    assert timing.resuming
    clock.now += 3.0
    assert timing.token("b") is None and timing.ttft is None  # until it is written
    clock.now += 0.01  # the answer's headers, and the write
    timing.written()
    assert timing.ttft == pytest.approx(3.01)
    assert not timing.resuming
    clock.now += 0.1
    timing.token("b")
    timing.cut()  # a streaming one moved
    clock.now += 0.4
    assert timing.token("c") == pytest.approx(0.4)
    samples = {s.name: s.value for s in metrics.migration_downtime.collect()[0].samples}
    assert samples["ferry_migration_downtime_seconds_count"] == 1  # the second move only


def test_no_stop_before_the_first_token() -> None:
    clock = Clock()
    timing = TokenTiming(FerryMetrics(), clock, arrived=clock.now, model="m")
    clock.now += 60
    assert not timing.stopped()


def test_a_continuation_not_yet_under_way_is_a_queued_candidate() -> None:
    """After a cut-over, until the destination sends the continuation's first token,
    its engine queues it: the rescheduler must not see a running stream gone silent
    (a preemption) there and move it on again."""
    clock = Clock()
    timing = timing_with_gaps(clock, [0.05] * 4)
    stream = SimpleNamespace(
        instance="b",
        movable=True,
        request=SimpleNamespace(id=7, priority=Priority.NORMAL, model="m"),
        splicer=SimpleNamespace(
            continuation_tokens=lambda: 40, generated=[1, 2, 3, 4, 5], prompt_ids=None
        ),
        call=SimpleNamespace(entry=SimpleNamespace(prompt_tokens=35)),
        timing=timing,
        reach=lambda: None,
    )
    migrator = Migrator(None, None, None, None, max_concurrent=2, prewarm=True)  # type: ignore[arg-type]
    migrator.placement = SimpleNamespace(short_contexts=lambda model, reach: frozenset())  # type: ignore[assignment]
    migrator.streams[7] = stream  # type: ignore[assignment]
    assert migrator.candidates("b")[0].running
    timing.cut()
    clock.now += 0.5
    [waiting] = migrator.candidates("b")
    assert not waiting.running and waiting.tokens == 40
    timing.token("b")  # the continuation is under way
    assert migrator.candidates("b")[0].running


def test_stops_in_counts_down_to_the_stop() -> None:
    clock = Clock()
    timing = timing_with_gaps(clock, [0.2] * 10)
    assert abs(timing.stops_in() - STOPPED_GAPS * 0.2) < 1e-9
    clock.now += 0.3
    assert abs(timing.stops_in() - (STOPPED_GAPS * 0.2 - 0.3)) < 1e-9
    clock.now += STOPPED_GAPS * 0.2
    assert timing.stops_in() == 0 and timing.stopped()
