from __future__ import annotations

import dataclasses

from proxy.policy import ClusterView, InstanceView, Priority, instance_freeness
from proxy.policy.migration import (
    MigrationSettings,
    RequestLoad,
    plan_drain,
    plan_migrations,
    sources,
)
from proxy.policy.priority import make_room_victims

BS = 16


def inst(name: str, capacity: int, virtual: float, batch: int, **kw: object) -> InstanceView:
    return InstanceView(  # type: ignore[arg-type]
        name=name,
        freeness=instance_freeness(capacity, virtual, batch),
        capacity_blocks=capacity,
        virtual_blocks=virtual,
        batch=batch,
        **kw,
    )


def plan(view: ClusterView, requests: dict[str, list[RequestLoad]], **settings: object) -> list:
    ms = MigrationSettings(**settings)  # type: ignore[arg-type]
    return plan_migrations(view, requests, {n: BS for n in requests}, ms)


def test_overloaded_source_sends_its_queued_request_first() -> None:
    hot = inst("hot", 100, 130, 6)  # demand beyond capacity: F < 0
    cold = inst("cold", 100, 10, 1)
    view = ClusterView((hot, cold))
    assert sources(view, MigrationSettings()) == ["hot"]
    reqs = [
        RequestLoad(1, 40, Priority.LOW, running=True),
        RequestLoad(2, 300, Priority.NORMAL, running=False),
        RequestLoad(3, 200, Priority.NORMAL, running=False),
    ]
    [move] = plan(view, {"hot": reqs})
    assert (move.request_id, move.source, move.destination) == (2, "hot", "cold")
    assert "queued" in move.reason


def test_running_requests_move_lowest_priority_then_shortest() -> None:
    view = ClusterView((inst("hot", 100, 130, 4), inst("cold", 100, 10, 1)))
    reqs = [
        RequestLoad(1, 40, Priority.NORMAL, running=True),
        RequestLoad(2, 900, Priority.LOW, running=True),
        RequestLoad(3, 100, Priority.LOW, running=True),
        RequestLoad(4, 10, Priority.HIGH, running=True),
    ]
    assert plan(view, {"hot": reqs})[0].request_id == 3
    assert plan(view, {"hot": reqs}, move_running=False) == []


def test_no_move_without_room_or_when_it_would_invert_the_imbalance() -> None:
    view = ClusterView((inst("hot", 100, 130, 4), inst("cold", 100, 90, 1)))
    big = [RequestLoad(1, 16 * 20, Priority.NORMAL, running=True)]
    assert plan(view, {"hot": big}) == []  # 21 blocks do not fit in the 10 left
    # Both tight: moving would leave the destination less free than the source.
    view = ClusterView((inst("a", 100, 101, 2), inst("b", 100, 80, 2)))
    assert plan(view, {"a": [RequestLoad(1, 16 * 15, Priority.NORMAL, running=True)]}) == []


def test_balanced_cluster_plans_nothing() -> None:
    view = ClusterView((inst("a", 100, 50, 5), inst("b", 100, 40, 4)))
    assert sources(view, MigrationSettings()) == []
    assert plan(view, {}) == []


def test_pairs_least_free_with_freest() -> None:
    view = ClusterView(
        (
            inst("hot1", 100, 120, 4),
            inst("hot2", 100, 150, 4),
            inst("cold1", 100, 0, 0),
            inst("cold2", 100, 30, 2),
        )
    )
    one = [RequestLoad(1, 30, Priority.NORMAL, running=False)]
    two = [RequestLoad(2, 30, Priority.NORMAL, running=False)]
    moves = plan(view, {"hot1": one, "hot2": two})
    assert {(m.source, m.destination) for m in moves} == {("hot2", "cold1"), ("hot1", "cold2")}


# Lite mode's cost model: the destination recomputes P + G of a moved running request.
# At 1,000 prefill tokens/s a request of T tokens costs T ms of destination prefill.
COST = {"prefill_tokens_per_s": 1000.0, "preemption_stall_s": 1.0, "dest_ttft_slack_s": 0.5}


def running(id: int, tokens: int) -> RequestLoad:
    return RequestLoad(id, tokens, Priority.NORMAL, running=True)


def test_a_recompute_that_costs_more_than_the_stall_it_saves_is_not_planned() -> None:
    hot = inst("hot", 1000, 1100, 4)
    idle = inst("cold", 1000, 0, 0)
    # 0.4 s of prefill for the moved stream alone: under the 1 s stall it saves.
    [move] = plan(ClusterView((hot, idle)), {"hot": [running(1, 400)]}, **COST)
    assert move.request_id == 1 and "recompute 0.400s x 1 streams" in move.reason
    # 0.6 s exceeds the 0.5 s slack; with more slack it still moves.
    assert plan(ClusterView((hot, idle)), {"hot": [running(1, 600)]}, **COST) == []
    roomy = {**COST, "dest_ttft_slack_s": 5.0}
    assert len(plan(ClusterView((hot, idle)), {"hot": [running(1, 600)]}, **roomy)) == 1
    # 1.2 s of prefill is more than the preemption it spares: never worth it...
    assert plan(ClusterView((hot, idle)), {"hot": [running(1, 1200)]}, **roomy) == []
    # ...unless the KV moves along (full mode), when nothing is recomputed.
    full = {**roomy, "count_recompute": False}
    assert len(plan(ClusterView((hot, idle)), {"hot": [running(1, 1200)]}, **full)) == 1


def test_the_recompute_is_charged_to_every_stream_on_the_destination() -> None:
    hot = inst("hot", 1000, 1100, 4)
    # 0.3 s x (1 + 1) streams fits in the 1 s stall; 0.3 s x (1 + 4) does not.
    light = inst("cold", 1000, 40, 1)
    busy = inst("cold", 1000, 160, 4)
    assert len(plan(ClusterView((hot, light)), {"hot": [running(1, 300)]}, **COST)) == 1
    assert plan(ClusterView((hot, busy)), {"hot": [running(1, 300)]}, **COST) == []
    # The cheaper candidate is still taken where the dearer one would not pay.
    [move] = plan(ClusterView((hot, busy)), {"hot": [running(1, 300), running(2, 150)]}, **COST)
    assert move.request_id == 2


def test_no_recompute_pushes_the_destination_queue_past_its_ttft() -> None:
    hot = inst("hot", 1000, 1100, 4)
    # 300 queued tokens + 100 recomputed = 0.4 s of prefill: within the 0.5 s slack.
    short_queue = inst("cold", 1000, 20, 1, engine_waiting=1, queued_tokens=300)
    long_queue = inst("cold", 1000, 30, 1, engine_waiting=1, queued_tokens=450)
    assert len(plan(ClusterView((hot, short_queue)), {"hot": [running(1, 100)]}, **COST)) == 1
    assert plan(ClusterView((hot, long_queue)), {"hot": [running(1, 100)]}, **COST) == []
    # A queued request (no KV yet) is prefilled wherever it runs: it still moves.
    queued = RequestLoad(2, 100, Priority.NORMAL, running=False)
    [move] = plan(ClusterView((hot, long_queue)), {"hot": [running(1, 100), queued]}, **COST)
    assert move.request_id == 2


def test_a_destination_queue_the_ledger_cannot_size_takes_no_recompute() -> None:
    hot = inst("hot", 1000, 1100, 4)
    unknown = inst("cold", 1000, 20, 1, engine_waiting=2)  # e.g. traffic bypassing Ferry
    assert plan(ClusterView((hot, unknown)), {"hot": [running(1, 10)]}, **COST) == []


def test_cost_settings_are_validated() -> None:
    for bad in (
        {"prefill_tokens_per_s": 0.0},
        {"dest_ttft_slack_s": -1.0},
        {"prewarm_min_recompute_s": -0.1},
    ):
        try:
            MigrationSettings(**bad)  # type: ignore[arg-type]
        except ValueError as exc:
            assert next(iter(bad)) in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_running_requests_stay_when_only_queued_work_overloads_the_source() -> None:
    cold = inst("cold", 100, 0, 0)
    queue = RequestLoad(3, 320, Priority.NORMAL, running=False)
    # 130 blocks of demand on 100, but 64 of them are queued prompts (1,024 tokens):
    # the two running requests hold 66 blocks and will not be preempted.
    waiting = inst("hot", 100, 130, 4, queued_tokens=1024)
    reqs = [running(1, 40), running(2, 60), queue]
    [move] = plan(ClusterView((waiting, cold)), {"hot": reqs})
    assert move.request_id == 3  # the queued one moves (free)...
    assert plan(ClusterView((waiting, cold)), {"hot": reqs[:2]}) == []  # ...running ones stay
    # With the same demand all running, one of them is about to be preempted: it moves.
    full = inst("hot", 100, 130, 4)
    assert plan(ClusterView((full, cold)), {"hot": reqs[:2]})[0].request_id == 1
    # Full mode moves carry their KV: they are not held to the recompute test.
    assert len(plan(ClusterView((waiting, cold)), {"hot": reqs[:2]}, count_recompute=False)) == 1


# -- prefix credit (issue 13) -----------------------------------------------------------


def test_a_move_costs_only_the_tail_the_destination_lacks() -> None:
    hot = inst("hot", 1000, 1100, 4)
    idle = inst("cold", 1000, 0, 0)
    long = RequestLoad(1, 1200, Priority.NORMAL, running=True)
    assert plan(ClusterView((hot, idle)), {"hot": [long]}, **COST) == []  # 1.2 s recompute
    cached = RequestLoad(1, 1200, Priority.NORMAL, running=True, cached={"cold": 1000})
    [move] = plan(ClusterView((hot, idle)), {"hot": [cached]}, **COST)
    assert "recompute 0.200s" in move.reason and "1000 tokens cached there" in move.reason


def test_the_source_pairs_with_the_destination_holding_its_prefix() -> None:
    hot = inst("hot", 1000, 1100, 4)
    freest = inst("a", 1000, 100, 2)  # F = 450
    holder = inst("b", 1000, 150, 2)  # F = 425, but holds 100 cached blocks: +50
    reqs = [RequestLoad(1, 16 * 120, Priority.NORMAL, running=False, cached={"b": 16 * 100})]
    [move] = plan(ClusterView((hot, freest, holder)), {"hot": reqs})
    assert move.destination == "b"
    # Without the prefix there, the freest wins.
    plain = [RequestLoad(1, 16 * 120, Priority.NORMAL, running=False)]
    assert plan(ClusterView((hot, freest, holder)), {"hot": plain})[0].destination == "a"


def test_running_requests_with_a_cached_tail_go_first() -> None:
    view = ClusterView((inst("hot", 100, 130, 4), inst("cold", 100, 10, 1)))
    reqs = [
        RequestLoad(1, 40, Priority.LOW, running=True),
        RequestLoad(2, 300, Priority.LOW, running=True, cached={"cold": 288}),  # 12 to go
    ]
    assert plan(view, {"hot": reqs})[0].request_id == 2


def test_a_move_pre_warms_only_where_the_recompute_it_saves_is_long() -> None:
    hot = inst("hot", 1000, 1100, 4)
    idle = inst("cold", 1000, 0, 0)
    view = ClusterView((hot, idle))
    # At 1,000 tokens/s, 40 tokens recompute in 0.04 s: less than a decode step,
    # not worth a trip through the destination's queue first; 400 take 0.4 s.
    [short] = plan(view, {"hot": [running(1, 40)]}, **COST)
    [long] = plan(view, {"hot": [running(1, 400)]}, **COST)
    assert (short.prewarm, long.prewarm) == (False, True)
    assert "pre-warmed" in long.reason and "pre-warmed" not in short.reason
    [short] = plan(view, {"hot": [running(1, 40)]}, **COST, prewarm_min_recompute_s=0.0)
    assert short.prewarm
    # A queued request has nothing to warm.
    [queued] = plan(view, {"hot": [RequestLoad(2, 400, Priority.NORMAL, running=False)]}, **COST)
    assert not queued.prewarm


def test_a_preempted_stream_is_rescued_at_once_most_silent_first() -> None:
    # "src" is full but not over (F >= 0): no load is shed. Its engine queued 2
    # requests at the last scrape while the ledger had 1 waiting for a first
    # token: one stream was preempted, the one silent longest; it moves even to a
    # destination that is not free enough for a plain move, and without the
    # recompute test.
    src = inst("src", 64, 64, 4, engine_waiting=2, engine_preempted=1)
    tight = inst("tight", 64, 40, 8)  # F = 3.0: below dest_above (4)
    reqs = [
        RequestLoad(1, 30, Priority.NORMAL, running=False),
        RequestLoad(2, 200, Priority.NORMAL, running=True, silent_s=0.5),
        RequestLoad(3, 100, Priority.NORMAL, running=True, silent_s=0.9),
        RequestLoad(4, 80, Priority.NORMAL, running=True, silent_s=0.1),
    ]
    view = ClusterView((src, tight))
    assert sources(view, MigrationSettings()) == ["src"]
    # Recomputing 100 tokens at 10 tok/s on a batch of 8 costs 90 s: still moved.
    [move] = plan(view, {"src": reqs}, prefill_tokens_per_s=10.0, dest_ttft_slack_s=100.0)
    assert (move.request_id, move.destination, move.preempted) == (3, "tight", True)
    assert "preempted" in move.reason
    assert not move.prewarm  # its source is not decoding it: nothing to overlap
    # Nothing silent enough, or no sign of preemption in the engine's queue: no move.
    assert plan(view, {"src": reqs}, stalled_after_s=1.0) == []
    assert plan(view, {"src": reqs}, stalled_after_s=0) == []
    quiet = ClusterView((inst("src", 64, 64, 4, engine_waiting=1, engine_preempted=0), tight))
    assert plan(quiet, {"src": reqs}) == []
    # Without moves of running requests (migration off), no rescue either.
    assert plan(view, {"src": reqs}, move_running=False) == []


def test_a_rescue_still_respects_the_destination_s_queue_and_room() -> None:
    src = inst("src", 64, 64, 4, engine_waiting=1, engine_preempted=1)
    stalled = [RequestLoad(3, 100, Priority.NORMAL, running=True, silent_s=2.0)]
    # The destination's queue would wait 1.2 s for its prefill plus the recompute.
    busy = inst("busy", 64, 20, 4, queued_tokens=11_900)
    assert plan(ClusterView((src, busy)), {"src": stalled}) == []
    # 7 blocks do not fit in the 6 left (after the 2 reserved).
    full = inst("full", 64, 56, 4)
    assert plan(ClusterView((src, full)), {"src": stalled}) == []


def test_a_rescue_refused_by_the_freest_destination_goes_to_the_next() -> None:
    src = inst("src", 64, 64, 4, engine_waiting=1, engine_preempted=1)
    stalled = [RequestLoad(3, 100, Priority.NORMAL, running=True, silent_s=0.5)]
    # The freest queues requests the ledger cannot size: no recompute goes there.
    unknown = inst("unknown", 64, 4, 1, engine_waiting=2)
    roomy = inst("roomy", 64, 30, 4)
    [move] = plan(ClusterView((src, unknown, roomy)), {"src": stalled})
    assert (move.request_id, move.destination, move.preempted) == (3, "roomy", True)
    # A plain move is not retried elsewhere: the pair's destination was the one to ask.
    hot = inst("hot", 64, 80, 4)
    running = [RequestLoad(5, 40, Priority.NORMAL, running=True)]
    assert plan(ClusterView((hot, unknown, roomy)), {"hot": running}) == []


# -- draining -------------------------------------------------------------------------


def drained(name: str = "d") -> InstanceView:
    return inst(name, 100, 60, 3, draining=True)


def test_a_drain_moves_only_what_fits_and_leaves_the_rest_decoding() -> None:
    # 10 blocks free on "a", 2 of them kept in reserve: 8 for the drain.
    view = ClusterView((drained(), inst("a", 100, 90, 2)))
    reqs = [running(1, 16 * 5 - 1), running(2, 16 * 3 - 1), running(3, 16 * 2 - 1)]
    moves = plan_drain(view, {"d": reqs})
    # Shortest first: 2 + 3 blocks fit, the 5-block one would overfill "a".
    assert [(m.request_id, m.destination) for m in moves] == [(3, "a"), (2, "a")]
    assert all(m.prewarm and "draining" in m.reason for m in moves)
    full = ClusterView((drained(), inst("a", 100, 99, 2)))
    assert plan_drain(full, {"d": reqs}) == []


def test_a_drain_spreads_by_freeness_counting_its_own_moves() -> None:
    view = ClusterView((drained(), inst("a", 100, 40, 2), inst("b", 100, 50, 2)))
    reqs = [running(i, 16 * 10 - 1) for i in range(1, 5)]
    moves = plan_drain(view, {"d": reqs})
    # a (F 30) takes the first; then a (F 16.7) and b (F 25): b; then a and b alternate.
    assert [m.destination for m in moves] == ["a", "b", "a", "b"]


def test_a_queued_request_leaves_a_drain_even_for_a_full_instance() -> None:
    view = ClusterView((drained(), inst("a", 100, 130, 5)))
    queued = RequestLoad(1, 500, Priority.NORMAL, running=False)
    [move] = plan_drain(view, {"d": [queued, running(2, 40)]})
    assert (move.request_id, move.destination, move.prewarm) == (1, "a", False)


def test_a_drain_goes_first_for_high_priority_and_only_where_the_model_is() -> None:
    view = ClusterView(
        (
            drained(),
            inst("a", 100, 92, 1, models=frozenset({"m"})),
            inst("b", 100, 0, 0, models=frozenset({"other"})),
        )
    )
    low = RequestLoad(1, 40, Priority.LOW, running=True, model="m")
    high = RequestLoad(2, 16 * 4 - 1, Priority.HIGH, running=True, model="m")
    # Room for 6 blocks on "a": the high-priority one (4) first, then the low (3) does not fit.
    [move] = plan_drain(view, {"d": [low, high]})
    assert (move.request_id, move.destination) == (2, "a")
    anywhere = RequestLoad(3, 40, Priority.NORMAL, running=True)  # no model: any instance
    assert plan_drain(view, {"d": [anywhere]})[0].destination == "b"


def test_a_rebalance_never_sends_a_request_where_its_model_is_not_served() -> None:
    view = ClusterView(
        (
            inst("hot", 100, 130, 6, models=frozenset({"m"})),
            inst("cold", 100, 10, 1, models=frozenset({"other"})),
        )
    )
    queued = RequestLoad(1, 300, Priority.NORMAL, running=False, model="m")
    assert plan(view, {"hot": [queued]}) == []
    assert plan(view, {"hot": [dataclasses.replace(queued, model="other")]}) != []


def test_a_rebalance_pairs_with_the_freest_instance_of_its_model() -> None:
    """Another model's idle instance, the freest, does not stand in the way."""
    llama = frozenset({"llama"})
    view = ClusterView(
        (
            inst("hot", 100, 130, 6, models=llama),
            inst("free", 100, 40, 2, models=llama),
            inst("idle", 100, 0, 0, models=frozenset({"mistral"})),
        )
    )
    queued = RequestLoad(1, 300, Priority.NORMAL, running=False, model="llama")
    [move] = plan(view, {"hot": [queued]})
    assert (move.request_id, move.destination) == (1, "free")


def test_a_stream_goes_nowhere_its_context_is_too_short() -> None:
    view = ClusterView((inst("hot", 100, 130, 6), inst("small", 100, 10, 1)))
    queued = RequestLoad(1, 300, Priority.NORMAL, running=False)
    assert plan(view, {"hot": [queued]}) != []
    short = dataclasses.replace(queued, short_context=frozenset({"small"}))
    assert plan(view, {"hot": [short]}) == []
    drain = ClusterView((drained(), inst("small", 100, 10, 1), inst("big", 100, 60, 3)))
    assert plan_drain(drain, {"d": [queued]})[0].destination == "small"
    assert plan_drain(drain, {"d": [short]})[0].destination == "big"


def test_a_move_counts_its_blocks_in_each_engines_block_size() -> None:
    """1,000 tokens are 63 blocks of 16 on the source, 8 of 128 on the
    destination: the drain sees that they fit there, and not the other way."""
    stream = running(1, 1000)
    roomy = ClusterView((drained(), inst("gpu", 40, 0, 0, block_size=128)))
    assert [m.destination for m in plan_drain(roomy, {"d": [stream]})] == ["gpu"]
    tight = ClusterView((drained(), inst("small", 30, 0, 0, block_size=16)))
    assert plan_drain(tight, {"d": [stream]}) == []
    hot = inst("hot", 100, 130, 6)
    assert plan(ClusterView((hot, inst("gpu", 40, 0, 0, block_size=128))), {"hot": [stream]})
    assert not plan(ClusterView((hot, inst("small", 30, 0, 0))), {"hot": [stream]})


def test_room_is_made_by_moving_a_stream_that_has_somewhere_to_go() -> None:
    """The low-priority stream that would free enough is an adapter's that no
    other instance serves: the one moved is the next, which one does."""
    both = frozenset({"base", "lora"})
    chosen = inst("hot", 100, 99, 2, models=both)
    other = inst("other", 100, 10, 1, models=frozenset({"base"}))
    adapter = RequestLoad(1, 400, Priority.LOW, running=True, model="lora")
    base = RequestLoad(2, 800, Priority.LOW, running=True, model="base")
    assert make_room_victims(chosen, 8, [adapter, base], [chosen, other]) == [2]
    assert make_room_victims(chosen, 8, [adapter], [chosen, other]) == []
    draining = dataclasses.replace(other, draining=True)
    assert make_room_victims(chosen, 8, [adapter, base], [chosen, draining]) == []


# `hot` has 1 block free (100 of 101, one request); a request of 8 lacks 7.
HOT = inst("hot", 101, 100, 1)
ROOMY = inst("roomy", 1000, 0, 0)


def low(
    id_: int, blocks: int, running: bool = True, priority: Priority = Priority.LOW
) -> RequestLoad:
    return RequestLoad(id_, blocks * BS, priority, running=running)


def test_room_is_made_with_the_smallest_stream_that_frees_enough() -> None:
    """The shortest stream (the old choice) frees 3 of the 7 blocks lacking: the
    request would still not fit. The one moved is the smallest that does."""
    streams = [low(1, 3), low(2, 13), low(3, 25)]
    assert make_room_victims(HOT, 8, streams, [HOT, ROOMY]) == [2]


def test_room_no_one_stream_frees_is_made_by_several_largest_first() -> None:
    streams = [low(1, 2), low(2, 4), low(3, 4), low(4, 3)]
    assert make_room_victims(HOT, 8, streams, [HOT, ROOMY]) == [2, 3]


def test_where_nothing_frees_enough_the_one_that_frees_most_moves() -> None:
    """Ferry may undercount what a stream holds (an engine that reports no
    token ids): the largest of the lowest priority moves, not the shortest."""
    normal = low(3, 1, priority=Priority.NORMAL)
    assert make_room_victims(HOT, 8, [low(1, 2), low(2, 3), normal], [HOT, ROOMY]) == [2]


def test_room_is_made_from_low_priority_streams_before_a_normal_one() -> None:
    normal = low(1, 20, priority=Priority.NORMAL)
    lows = [low(2, 4), low(3, 4)]
    assert make_room_victims(HOT, 8, [normal, *lows], [HOT, ROOMY]) == [2, 3]
    assert make_room_victims(HOT, 8, [normal, lows[0]], [HOT, ROOMY]) == [1]
    high = low(4, 20, priority=Priority.HIGH)
    assert make_room_victims(HOT, 8, [high], [HOT, ROOMY]) == []


def test_a_queued_request_moves_before_a_running_one() -> None:
    """A queued request holds its blocks in virtual usage but has no KV to
    recompute: it moves first."""
    queued, running = low(1, 10, running=False), low(2, 10)
    assert make_room_victims(HOT, 8, [running, queued], [HOT, ROOMY]) == [1]


def test_enough_is_at_most_the_blocks_the_request_needs() -> None:
    """Virtual usage counts the queue's demand too: an instance 200 blocks past
    its capacity lacks 200, but the request starts once its own 8 are free."""
    swamped = inst("swamped", 100, 300, 10)
    streams = [low(1, 5), low(2, 9), low(3, 50)]
    assert make_room_victims(swamped, 8, streams, [swamped, ROOMY]) == [2]
