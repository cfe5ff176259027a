"""Cluster scale on STAND-IN engines: vllm-router against Ferry, without and with rebalancing.

Sixteen paged-KV stand-in engines (`loadtest.paged_standin`: not vLLM; continuous
batching, 64 KV blocks of 16 tokens each, preemption by recompute, prefix caching)
run in one process, one event loop, pinned to core 0. Their steps are slowed
(30 ms + 1 ms per running request + 0.1 ms per prefill token) and, like vLLM's
`--stream-interval 2`, they stream the first token at once and then two per chunk,
so that the router under test and the load generator (`loadtest.replay`'s lean
aiohttp client), which share core 1, are never the bottleneck. One bursty trace
(Gamma arrivals, CV 3, lognormal lengths, near the cluster's KV capacity) is
replayed four times: through vllm-router `round_robin` and `power_of_two`, through
Ferry `llumnix` without rebalancing, and through Ferry with lite rebalancing every
0.2 s (otherwise Ferry's defaults, pre-warm on). The engines restart for every
run, so each starts cold (no cached prefixes, counters at zero).

Reported side by side: P50/P99 TTFT, the P99 over streams of each stream's worst
gap between two tokens (a preemption or a move shows there), the engines'
preemptions, Ferry's completed moves, and the ratios the issue sets targets for:
rebalancing keeps P99 TTFT within 1.1x of Ferry without it while its P99 worst
stall is at least 5x lower, and Ferry's P99 TTFT is at least 10x lower than
vllm-router's best. `client lag` is how late the load generator sent its
requests (P99): well under a step (30 ms) means it kept up. A P99 over 600
streams is their 7th worst: one run's ratios move by 10-15% from run to run.
So the trace is replayed `--repeat` rounds per path (3), the paths interleaved
in each round; each round's ratios are printed, and the verdict pools every
round's streams (a P99 over 1,800 streams is their 18th worst).

`--sim` first prints what the cluster simulator (`loadtest.sim`: the same policy
core, the engines' own profile, the same trace; the router baselines as Ferry's
`round_robin` and `power_of_two` policies; no pre-warm or prefix cache) predicts
for the same four paths.

    python -m loadtest.bench_scale [--requests 600] [--rate 18] [--seed 1] [--repeat 3] [--sim]

A round takes 3-4 minutes; the default run, 10. It is a report, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from adapters.vllm import parse_metrics
from loadtest.bench_cluster import start
from loadtest.ferry_process import wait_healthy
from loadtest.paged_standin import DEFAULT_PROFILE
from loadtest.replay import replay
from loadtest.sim.instance import SimRequest
from loadtest.sim.profile import Profile, save
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.sim.stats import lower, percentile, summarize
from loadtest.trace import TraceRequest, TraceSpec, generate

KINDS = ("vllm-router:round_robin", "vllm-router:power_of_two", "ferry", "ferry+lite")
ROUTERS = KINDS[:2]
REBALANCE_INTERVAL_S = 0.2  # what `bench_cluster.start` configures for ferry+lite
ENGINE_CORE, ROUTER_CORE = 0, 1
MODEL = "standin"
_MIGRATED = re.compile(r'^ferry_migrations_total\{outcome="ok",[^}]*\} (\S+)$', re.M)


def make_trace(args: argparse.Namespace, max_model_len: int) -> list[TraceRequest]:
    """The trace, with outputs clamped so that prompt + output fits an engine."""
    spec = TraceSpec(
        requests=args.requests,
        rate=args.rate,
        seed=args.seed,
        arrival="gamma",
        cv=3.0,
        input_mean=args.input_mean,
        output_mean=args.output_mean,
        max_len=args.max_len,
    )
    return [
        dataclasses.replace(r, output_tokens=min(r.output_tokens, max_model_len - r.prompt_tokens))
        for r in generate(spec)
    ]


class Engines:
    """The stand-in engines: one process, one event loop, one port each, on core 0."""

    def __init__(self, count: int, profile_path: Path, stream_interval: int = 1) -> None:
        cmd = [sys.executable, "-m", "loadtest.paged_standin", "--count", str(count)]
        cmd += ["--profile", str(profile_path), "--model", MODEL]
        cmd += ["--stream-interval", str(stream_interval)]
        if _two_cores():
            cmd = ["taskset", "-c", str(ENGINE_CORE), *cmd]
        # Its stderr would fill with the tracebacks of streams whose client went away.
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ports:"):
            self.stop()
            raise RuntimeError(f"stand-in engines did not start: {line!r}")
        self.urls = [f"http://127.0.0.1:{p}" for p in line.split()[1:]]

    def preemptions(self) -> int:
        total = 0
        for url in self.urls:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
                total += parse_metrics(resp.read().decode()).preemptions_total
        return total

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def migrations(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return int(sum(float(v) for v in _MIGRATED.findall(text)))


@dataclasses.dataclass
class Run:
    """One replay of the trace through one path."""

    done: list[SimRequest]
    preemptions: int
    migrations: int | None
    client_lag_p99: float


def run_one(
    kind: str, trace: list[TraceRequest], profile_path: Path, args: argparse.Namespace
) -> Run:
    cluster = Engines(args.engines, profile_path, args.stream_interval)
    try:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(kind, cluster.urls, port)
        try:
            wait_healthy(url)
            time.sleep(1.5)  # routers' first health checks and scrapes
            done = asyncio.run(replay(url, trace, MODEL, client="lean"))
            moves = migrations(url) if kind.startswith("ferry") else None
            return Run(done, cluster.preemptions(), moves, _client_lag(done, trace))
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        cluster.stop()


def pooled(runs: list[Run]) -> dict[str, Any]:
    """One path's summary over all its rounds: percentiles over every stream of
    every round (a P99 over 3 x 600 streams is their 18th worst, not the 7th, so
    one unlucky stream moves it less), counts summed, the client lag of its worst round."""
    summary = summarize([r for run in runs for r in run.done], {})
    summary["preemptions"] = sum(run.preemptions for run in runs)
    moves = [run.migrations for run in runs if run.migrations is not None]
    summary["migrations"] = sum(moves) if moves else None  # None: a router's path
    summary["client_lag_p99"] = max(run.client_lag_p99 for run in runs)
    return summary


def simulate(
    kind: str, trace: list[TraceRequest], profile: Profile, engines: int
) -> dict[str, Any]:
    """The simulator's prediction for one path (Ferry's scrape and rebalance periods)."""
    policy = kind.split(":")[1] if kind in ROUTERS else "llumnix"
    settings = SimSettings(
        engines,
        policy,
        migration="lite" if kind == "ferry+lite" else "off",
        scrape_interval_s=0.25,
        reschedule_interval_s=REBALANCE_INTERVAL_S,
        seed=1,
    )
    sim = Simulator(trace, profile, settings)
    summary = summarize(sim.run(), sim.migrations)
    summary["migrations"] = summary["migrations"] if kind.startswith("ferry") else None
    summary["client_lag_p99"] = 0.0
    return summary


def _client_lag(done: list[SimRequest], trace: list[TraceRequest]) -> float:
    arrival = {t.id: t.arrival_s for t in trace}
    return percentile([r.arrival - arrival[r.id] for r in done], 99)


def report(results: dict[str, dict[str, Any]], title: str) -> str:
    lines = [
        title,
        f"{'path':<26}{'TTFT p50':>9}{'p99':>9}{'stall p99':>10}{'preempt':>9}{'moves':>7}"
        f"{'finished':>9}{'client lag':>11}",
    ]
    for kind, s in results.items():
        moves = "-" if s["migrations"] is None else str(s["migrations"])
        lines.append(
            f"{kind:<26}{s['ttft_p50']:>8.3f}s{s['ttft_p99']:>8.3f}s{s['stall_p99']:>9.3f}s"
            f"{s['preemptions']:>9}{moves:>7}{s['finished']:>5}/{s['requests']:<3}"
            f"{1e3 * s['client_lag_p99']:>9.1f}ms"
        )
    lines += ratios(results)
    return "\n".join(lines)


def ratios(results: dict[str, dict[str, Any]], prefix: str = "") -> list[str]:
    """The ratios the issue sets targets for, from the paths in `results`."""
    lines = []
    routers = [k for k in ROUTERS if k in results]
    if "ferry" in results and "ferry+lite" in results:
        off, lite = results["ferry"], results["ferry+lite"]
        ttft = lite["ttft_p99"] / off["ttft_p99"]
        stall = off["stall_p99"] / lite["stall_p99"]
        lines.append(
            f"{prefix}rebalancing: P99 TTFT {ttft:.2f}x that without (target <= 1.1x: "
            f"{_met(ttft <= 1.1)}), P99 worst stall {lower(stall)} (target >= 5x lower: "
            f"{_met(stall >= 5)})"
        )
    if routers:
        best = min(routers, key=lambda k: results[k]["ttft_p99"])
        for kind in ("ferry", "ferry+lite"):
            if kind in results:
                ratio = results[best]["ttft_p99"] / results[kind]["ttft_p99"]
                stall = results[best]["stall_p99"] / results[kind]["stall_p99"]
                lines.append(
                    f"{prefix}{kind} vs {best}: P99 TTFT {lower(ratio)} (target >= 10x lower:"
                    f" {_met(ratio >= 10)}), P99 worst stall {lower(stall)}"
                )
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _two_cores() -> bool:
    return len(os.sched_getaffinity(0)) >= 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=18.0, help="requests/s, on average")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--input-mean", type=float, default=64)
    parser.add_argument("--output-mean", type=float, default=128)
    parser.add_argument("--max-len", type=int, default=384, help="clamp of each length")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=2,
        help="tokens per chunk after the first (vLLM's --stream-interval)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="replay the trace this many rounds per path and pool the streams",
    )
    parser.add_argument("--sim", action="store_true", help="also print the simulator's view")
    args = parser.parse_args()
    if _two_cores():
        os.sched_setaffinity(0, {ROUTER_CORE})  # the client; routers inherit it
    else:
        print("warning: fewer than 2 cores: nothing is pinned", file=sys.stderr)
    profile = DEFAULT_PROFILE
    trace = make_trace(args, profile.kv_blocks * profile.block_size - 1)
    span = trace[-1].arrival_s if trace else 0.0
    what = (
        f"{args.requests} requests over {span:.0f}s (gamma CV 3, {args.rate}/s, lognormal "
        f"lengths: prompt mean {args.input_mean:g}, output mean {args.output_mean:g}, max "
        f"{args.max_len}), {args.engines} paged stand-in engines (not vLLM)"
    )
    if args.sim:
        predicted = {k: simulate(k, trace, profile, args.engines) for k in args.kinds}
        print(report(predicted, f"\nsimulated: {what}:"), flush=True)
    runs: dict[str, list[Run]] = {kind: [] for kind in args.kinds}
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(tmp) / "profile.json"
        save(profile, profile_path)
        # Rounds interleave the paths, so that a slow spell of the machine does not
        # land on one path only.
        for round_ in range(1, args.repeat + 1):
            this_round: dict[str, dict[str, Any]] = {}
            for kind in args.kinds:
                started = time.monotonic()
                runs[kind].append(run_one(kind, trace, profile_path, args))
                s = this_round[kind] = pooled(runs[kind][-1:])
                print(
                    f"  round {round_} {kind}: P99 TTFT {s['ttft_p99']:.3f}s, P99 worst stall"
                    f" {s['stall_p99']:.3f}s ({time.monotonic() - started:.0f}s)",
                    file=sys.stderr,
                )
            if args.repeat > 1:
                print("\n".join(ratios(this_round, f"round {round_}: ")), file=sys.stderr)
    results = {kind: pooled(runs[kind]) for kind in args.kinds}
    where = f"on core {ENGINE_CORE}, router and client on core {ROUTER_CORE}"
    rounds = f", {args.repeat} rounds pooled" if args.repeat > 1 else ""
    print(report(results, f"\nmeasured: {what} {where}{rounds}:"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
