"""The simulator: conservation, determinism, real KV pressure, the shared policy core."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.sim.profile import LLAMA7B_A10, Profile, load, save
from loadtest.sim.run import simulate
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.trace import TraceRequest, TraceSpec, generate, write
from proxy.policy.migration import MigrationSettings

SMALL = dataclasses.replace(LLAMA7B_A10, name="small", kv_blocks=60)  # 960 tokens


def test_a_full_mode_copy_in_flight_is_not_planned_again() -> None:
    """A stream whose KV copy is under way was offered for another move: the
    destination reserved its blocks twice (and kept one reservation for good),
    and a second copy moved it to where it already was."""
    spec = TraceSpec(requests=300, rate=40, seed=3, prefix_groups=4, prefix_len=384, turns=3)
    settings = SimSettings(2, "random", "full", prefix_caching=True)
    sim = Simulator(generate(spec), LLAMA7B_A10, settings)
    done = sim.run()
    assert all(r.finish is not None for r in done)
    assert all(i.used == 0 and not i.reserved for i in sim.instances)
    assert sim.migrations["started"] == sim.migrations["done"] + sim.migrations["aborted"]


def test_every_request_finishes_with_exactly_its_tokens() -> None:
    trace = generate(TraceSpec(requests=300, rate=40, seed=1, max_len=400))
    sim = Simulator(trace, SMALL, SimSettings(3, "round_robin"))
    done = sim.run()
    assert all(r.finish is not None and r.generated == r.output for r in done)
    assert all(r.first_token is not None and r.first_token >= r.arrival for r in done)
    assert all(i.used == 0 and i.count == 0 and i.demand == 0 for i in sim.instances)
    # Tight memory: real preemptions happened, and were recovered from.
    assert sum(r.preemptions for r in done) > 0


def test_same_seed_same_result() -> None:
    trace = generate(TraceSpec(requests=300, rate=40, seed=1, max_len=400))
    runs = [simulate(trace, SMALL, SimSettings(3, "llumnix", "lite", seed=5)) for _ in range(2)]
    for run in runs:
        run.pop("wall_s")
    assert runs[0] == runs[1]


def test_dispatch_goes_through_the_policy_core() -> None:
    trace = [TraceRequest(i, i * 10.0, 10, 5) for i in range(6)]
    sim = Simulator(trace, LLAMA7B_A10, SimSettings(3, "round_robin"))
    placed: list[str] = []
    original = sim._arrival

    def spy(r):  # type: ignore[no-untyped-def]
        original(r)
        placed.append(r.instance.name)

    sim._arrival = spy  # type: ignore[method-assign]
    sim.run()
    assert placed == ["i0", "i1", "i2", "i0", "i1", "i2"]


def test_step_time_grows_with_batch_tokens() -> None:
    one = [TraceRequest(0, 0.0, 10, 100)]
    many = [TraceRequest(i, 0.0, 10, 100) for i in range(50)]
    solo = Simulator(one, LLAMA7B_A10, SimSettings(1)).run()[0]
    crowded = Simulator(many, LLAMA7B_A10, SimSettings(1)).run()[0]
    assert crowded.finish - crowded.first_token > solo.finish - solo.first_token  # type: ignore[operator]


def imbalanced_trace() -> list[TraceRequest]:
    # Round-robin sends every long request to i0 and every short one to i1.
    out = []
    for i in range(40):
        long = i % 2 == 0
        out.append(TraceRequest(i, i * 0.01, 300 if long else 20, 400 if long else 5))
    return out


def test_rescheduling_relieves_an_overloaded_instance() -> None:
    trace = imbalanced_trace()
    base = simulate(trace, SMALL, SimSettings(2, "round_robin", "off"))
    for mode in ("lite", "full"):
        moved = simulate(trace, SMALL, SimSettings(2, "round_robin", mode))
        assert moved["migrations"] > 0, mode
        assert moved["ttft_p99"] < base["ttft_p99"], mode
        assert moved["finished"] == len(trace)


def test_full_migration_moves_running_requests_without_recompute() -> None:
    sim = Simulator(imbalanced_trace(), SMALL, SimSettings(2, "round_robin", "full"))
    done = sim.run()
    moved_running = [r for r in done if r.migrations and r.first_token is not None]
    assert sim.migrations["done"] > 0 and moved_running
    assert all(r.generated == r.output for r in done)


def test_a_preemption_shows_as_a_stream_stall() -> None:
    trace = generate(TraceSpec(requests=300, rate=40, seed=1, max_len=400))
    done = Simulator(trace, SMALL, SimSettings(3, "round_robin")).run()
    preempted = [r for r in done if r.preemptions and r.generated > 1]
    calm = [r for r in done if not r.preemptions and r.generated > 1]
    assert preempted and calm
    # A stream preempted after its first token waits for memory and its recompute.
    assert max(r.worst_gap for r in preempted) > 10 * max(r.worst_gap for r in calm)
    summary = simulate(trace, SMALL, SimSettings(3, "round_robin"))
    assert summary["stall_p99"] > 5 * summary["decode_p99"]


def running_moves(migration: str, settings: MigrationSettings) -> list[int]:
    """Ids of requests moved after their first token: round-robin sends four long
    requests to i0, which outgrow its memory, and four short ones to i1."""
    trace = [
        TraceRequest(i, i * 0.001, 100 if i % 2 == 0 else 10, 400 if i % 2 == 0 else 2)
        for i in range(8)
    ]
    sim = Simulator(
        trace, SMALL, SimSettings(2, "round_robin", migration, migration_settings=settings)
    )
    moved: list[int] = []
    start = sim._start_migration

    def spy(request_id: int, source: str, destination: str) -> None:
        if sim.by_id[request_id].generated:
            moved.append(request_id)
        start(request_id, source, destination)

    sim._start_migration = spy  # type: ignore[method-assign]
    sim.run()
    return moved


def test_lite_moves_pay_for_the_destination_recompute_and_full_moves_do_not() -> None:
    assert running_moves("lite", MigrationSettings())
    # At 20 prefill tokens/s a request of 240+ tokens costs 12+ s of destination
    # prefill, far more than the preemption stall it would save.
    slow = MigrationSettings(prefill_tokens_per_s=20.0)
    assert running_moves("lite", slow) == []
    assert running_moves(
        "lite", MigrationSettings(prefill_tokens_per_s=20.0, count_recompute=False)
    )
    # The KV moves along in full mode: nothing to recompute, nothing to charge.
    assert running_moves("full", slow) == running_moves("full", MigrationSettings())


def test_priorities_are_reported_by_class() -> None:
    trace = generate(TraceSpec(requests=200, rate=40, seed=1, max_len=300, high_priority=0.2))
    summary = simulate(
        trace, SMALL, SimSettings(3, "llumnix", "lite", high_priority_headroom_blocks=10)
    )
    assert set(summary["by_priority"]) == {"high", "normal"}
    assert (
        summary["by_priority"]["high"]["requests"] + summary["by_priority"]["normal"]["requests"]
        == 200
    )


def test_profile_files_round_trip(tmp_path: Path) -> None:
    save(SMALL, tmp_path / "p.json")
    assert load(tmp_path / "p.json") == SMALL
    assert isinstance(load(None), Profile)
    for field, value in (("kv_blocks", 0), ("block_size", "16"), ("step_base_s", -1.0)):
        save(dataclasses.replace(SMALL, **{field: value}), tmp_path / "bad.json")
        with pytest.raises(ValueError, match="bad.json"):  # no run that never ends
            load(tmp_path / "bad.json")


def test_cli_trace_and_sim_json(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write(path, generate(TraceSpec(requests=200, rate=30, seed=1, high_priority=0.1)))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "sim",
            "--trace",
            str(path),
            "--instances",
            "2",
            "--policy",
            "llumnix",
            "--migration",
            "lite",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    for key in (
        "ttft_p50",
        "ttft_p99",
        "decode_p50",
        "decode_p99",
        "e2e_p99",
        "preemptions",
        "migrations",
    ):
        assert key in result and key in result["by_priority"]["high"], key
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "trace",
            "--out",
            str(tmp_path / "u.jsonl"),
            "--requests",
            "50",
            "--rate",
            "5",
            "--arrival",
            "gamma",
            "--cv",
            "2",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote 50 requests" in made.stdout


def test_high_priority_arrivals_make_room_as_the_proxy_does() -> None:
    """The simulator runs the policy core's make-room choice (`make_room_victim`):
    with migration on, a high-priority request placed where it does not fit moves
    a lower-priority one away; with migration off, nothing moves."""
    trace = generate(TraceSpec(requests=200, rate=40, seed=1, max_len=300, high_priority=0.2))
    moved = Simulator(trace, SMALL, SimSettings(2, "llumnix", "lite"))
    moved.run()
    still = Simulator(trace, SMALL, SimSettings(2, "llumnix", "off"))
    still.run()
    assert moved.migrations["for_priority"] > 0
    assert still.migrations["for_priority"] == 0
