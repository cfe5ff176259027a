"""The simulator's autoscaling mode: the scaling rule sizes the fleet over a day."""

from __future__ import annotations

import dataclasses

from loadtest.sim.profile import LLAMA7B_A10
from loadtest.sim.run import simulate
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.trace import TraceRequest, TraceSpec, generate
from proxy.policy.scaling import ScalingSettings

SMALL = dataclasses.replace(LLAMA7B_A10, name="small", kv_blocks=200)
DAY_S = 300.0  # the trough at 0 and 300 s, the peak at 150 s


def day_trace() -> list[TraceRequest]:
    # 1.2 days at 12 requests/s on average (5..19 over the day): one small
    # instance holds the trough, the peak wants three.
    spec = TraceSpec(
        requests=4320,
        rate=12,
        seed=2,
        day_s=DAY_S,
        input_mean=128,
        output_mean=128,
        max_len=512,
    )
    return generate(spec)


def autoscaled(migration: str = "lite") -> SimSettings:
    return SimSettings(
        1,
        "llumnix",
        migration,
        scaling=ScalingSettings(min_instances=1, max_instances=4),
        scaling_interval_s=5,
        startup_s=10,
        scale_in_window_s=15,
    )


def fleet_between(sim: Simulator, start: float, end: float) -> list[int]:
    before = [f for t, f, _ in sim.fleet_log if t <= start][-1:]
    return before + [f for t, f, _ in sim.fleet_log if start < t <= end]


def test_the_fleet_follows_the_day_within_its_bounds() -> None:
    trace = day_trace()
    sim = Simulator(trace, SMALL, autoscaled())
    done = sim.run()
    assert all(r.finish is not None and r.generated == r.output for r in done)
    assert all(1 <= d <= 4 for _, d, _ in sim.scaling_log)
    assert all(1 <= f <= 4 for _, f, _ in sim.fleet_log)
    morning = max(fleet_between(sim, 0, 30))
    peak = max(fleet_between(sim, 120, 180))
    night = min(fleet_between(sim, 280, 330))
    assert morning == 1 and peak >= 3 and night < peak
    # Retired instances left nothing behind; the fleet cost less than 4 all day.
    assert sim.retired and all(sim.by_name[n].empty for n in sim.retired)
    assert sim.instance_seconds() < 4 * sim.now * 0.9


def test_a_fixed_fleet_costs_its_size_times_the_run() -> None:
    trace = day_trace()[:600]
    summary = simulate(trace, SMALL, SimSettings(3, "llumnix"))
    end = summary["instance_seconds"] / 3
    assert (summary["instances_min"], summary["instances_max"]) == (3, 3)
    assert end >= max(r.arrival_s for r in trace)


def long_requests() -> list[TraceRequest]:
    return [TraceRequest(i, 0.0, 10, 2000) for i in range(4)]


def scale_in_at_once(migration: str) -> Simulator:
    """Two idle-ish instances of 1000 blocks, four long streams: the rule wants one
    instance at its first look (1 s), so one instance drains."""
    settings = SimSettings(
        2,
        "round_robin",
        migration,
        scaling=ScalingSettings(),
        scaling_interval_s=1,
        startup_s=10,
        scale_in_window_s=0,
    )
    sim = Simulator(long_requests(), LLAMA7B_A10, settings)
    done = sim.run()
    assert all(r.generated == r.output for r in done)
    assert len(sim.retired) == 1 and len(sim.instances) == 1
    return sim


def test_scale_in_drains_by_migration_when_migration_is_on() -> None:
    for mode in ("lite", "full"):
        sim = scale_in_at_once(mode)
        (gone,) = sim.retired.values()
        assert gone < 2.0, mode  # its streams moved at once: retired long before they end
        assert sim.migrations["done"] == 2, mode


def test_without_migration_a_draining_instance_waits_for_its_streams() -> None:
    sim = scale_in_at_once("off")
    (gone,) = sim.retired.values()
    assert gone > 10.0  # 2000 tokens each: the streams ran to their end there
    assert sim.migrations["done"] == 0


def test_a_new_instance_serves_only_after_its_startup() -> None:
    # One instance, load far beyond its memory for 20 s: the rule asks for more
    # at 1 s, and nothing is dispatched to them before 1 + startup_s.
    trace = [TraceRequest(i, 0.1 * i, 400, 1000) for i in range(200)]
    settings = SimSettings(
        1, "llumnix", scaling=ScalingSettings(max_instances=3), scaling_interval_s=1, startup_s=5
    )
    sim = Simulator(trace, LLAMA7B_A10, settings)
    placed: list[tuple[float, str]] = []
    original = sim._arrival

    def spy(r):  # type: ignore[no-untyped-def]
        original(r)
        placed.append((sim.now, r.instance.name))

    sim._arrival = spy  # type: ignore[method-assign]
    sim.run()
    assert max(f for _, f, _ in sim.fleet_log) == 3
    elsewhere = [t for t, name in placed if name != "i0"]
    assert elsewhere and min(elsewhere) >= 6.0
