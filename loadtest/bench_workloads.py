"""Ferry against vllm-router on a small REAL cluster, three workloads (issue 12 A).

Two real vLLM CPU servers share core 0 (their OpenMP threads bound there too;
prefix caching on, 64 KV blocks of 128 tokens each, the 8-layer test model of
`loadtest.bench_prefix_real`, so prefill costs something); every router and the
load generator (`loadtest.replay`'s lean client) run on core 1. Three seeded
workloads at moderate load, each through every path, one after another:

- `heavy`: heavy-tailed lengths (lognormal around 128/128 tokens), Poisson
  arrivals at 1.5/s;
- `priority`: the same with 20% of requests `x-ferry-priority: high`; its row
  is those requests' TTFT (vllm-router ignores the header);
- `prefix`: 16 shared system prompts of 768 tokens at 1.2/s (the 16 x 6 blocks
  do not all fit one server's cache).

Paths: vllm-router `round_robin`, `power_of_two` and `cache_aware`, and Ferry
with its defaults (`llumnix` with `prefix_credit`); on `prefix` also
`ferry-plain`, Ferry without the credit. `--paths` runs any of them on any
workload (e.g. `ferry,ferry-plain` on `heavy`: the credit where nothing is
shared), and any Ferry spelled `ferry[:POLICY][+VARIANT...]`: `ferry:round_robin`
places as the router's `round_robin` does, and the variants (`VARIANTS`) loosen
the crowd bound (`+loose`), rank by memory alone (`+queue-blind`), scrape every
2 s (`+scrape2s`) or treat the servers as plain OpenAI-compatible engines
(`+openai`: no scrapes, no token ids).
`--engine-priority` starts the
servers with vLLM's `--scheduling-policy priority`: Ferry's instances get
`engine_priority: true`, and the routers' client sets the body's `priority`
field itself, the best a router's user can do.
Each path starts cold (prefix caches reset, a fresh router). Ferry writes its
access log, and for the slowest tenth of its requests (all of them, on
`priority` too) the table gives the mean of each TTFT stage
(proxy/ttft_stages.py): the tail is Ferry's own (parse, dispatch, connect,
relay) or the engine's (upstream_first_byte).

    python -m loadtest.bench_workloads [--requests 100] [--repeat 1] [--workloads heavy,prefix]

About 4 minutes per workload and round, plus 2 to start the servers. A report,
not a test: a P99 over 100 requests is their worst but one, over the 15 or so
high-priority ones their worst, so expect tens of percent between runs.
`--repeat N` runs N rounds, the paths interleaved, and pools each path's
requests: the verdict is a P99 over all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest import bench_prefix_real as real
from loadtest.bench_cluster import start as start_router
from loadtest.ferry_process import wait_healthy
from loadtest.replay import replay
from loadtest.sim.stats import percentile
from loadtest.trace import TraceRequest, TraceSpec, generate
from loadtest.ttft_breakdown import read_stages
from loadtest.vllm_servers import VLLMServer, stop_on_sigterm, wait_ready
from migration_shim.launcher import free_port
from proxy.policy import POLICIES, Priority
from proxy.ttft_stages import STAGES

ROUTERS = ("vllm-router:round_robin", "vllm-router:power_of_two", "vllm-router:cache_aware")
FERRY, PLAIN = "ferry", "ferry-plain"  # defaults; without prefix_credit
# A Ferry path may name a policy and variants, `ferry[:POLICY][+VARIANT...]`
# (`ferry:round_robin` places as the router's round_robin does, so what differs
# is the proxy, not the placement). Each variant changes Ferry's config:
VARIANTS = {
    # Scraping every 2 s instead of 0.25 s: what the scrapes cost the engines.
    "scrape2s": {"scheduler": {"scrape_interval_s": 2.0}},
    # The prefix credit's crowd bound loosened, as the README advises where
    # prefill is dear (as on these CPU servers).
    "loose": {"scheduler": {"prefix_crowd_factor": 3.0, "prefix_crowd_grace": 8.0}},
    # Ranking by memory alone (scheduler.prefill_aware off): what placing beside
    # decodes rather than behind a queued prefill buys.
    "queue-blind": {"scheduler": {"prefill_aware": False}},
    # The servers as any OpenAI-compatible engine: no scrapes, no token ids asked
    # for (the ledger estimates them), no moves; what Ferry's asks cost the engines.
    "openai": {
        "instance": {
            "engine": "openai",
            "migration": "off",
            "kv_events": None,
            "kv_events_replay": None,
        }
    },
}
# Heavy-tailed lengths (lognormal around 128/128 tokens); requests and seed are
# the command line's.
HEAVY = TraceSpec(requests=0, rate=1.5, seed=0, input_mean=128, output_mean=128, max_len=480)
WORKLOADS = {
    "heavy": HEAVY,
    "priority": replace(HEAVY, high_priority=0.2),
    "prefix": replace(HEAVY, rate=1.2, prefix_groups=16, prefix_len=768),
}


@dataclass(frozen=True, slots=True)
class Run:
    """What one path gave: one round, or several pooled (`pool`)."""

    path: str
    ttfts: list[float]  # of the requests the row is about
    finished: int
    requests: int
    hits: float  # the engines' prefix cache counters' deltas
    queries: float
    stages: list[dict[str, float]]  # Ferry's TTFT stages, from its access log

    @property
    def p50(self) -> float:
        return percentile(self.ttfts, 50)

    @property
    def p99(self) -> float:
        return percentile(self.ttfts, 99)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def tail_stages(self) -> dict[str, float] | None:
        """Mean of each TTFT stage over the slowest tenth of Ferry's requests."""
        if not self.stages:
            return None
        by_total = sorted(self.stages, key=lambda s: sum(s.values()))
        tail = by_total[int(0.9 * len(by_total)) :]
        return {k: statistics.mean(s.get(k, 0.0) for s in tail) for k in STAGES}


def pool(runs: list[Run]) -> Run:
    """One path's rounds as one run: a P99 over all their requests."""
    return Run(
        runs[0].path,
        [t for r in runs for t in r.ttfts],
        sum(r.finished for r in runs),
        sum(r.requests for r in runs),
        sum(r.hits for r in runs),
        sum(r.queries for r in runs),
        [s for r in runs for s in r.stages],
    )


def paths(workload: str) -> tuple[str, ...]:
    return (*ROUTERS, FERRY, PLAIN) if workload == "prefix" else (*ROUTERS, FERRY)


def ferry_path(path: str) -> tuple[str | None, list[str]] | None:
    """`ferry[:POLICY][+VARIANT...]` as (policy or None, variants); None if
    `path` is not one (`ferry-plain` is spelled out)."""
    head, *variants = path.split("+")
    name, _, policy = head.partition(":")
    if name != FERRY or (policy and policy not in POLICIES):
        return None
    if any(v not in VARIANTS for v in variants):
        return None
    return policy or None, variants


def start_ferry(
    servers: list[VLLMServer], port: int, path: str, log: Path, engine_priority: bool
) -> subprocess.Popen[bytes]:
    config = json.loads(real.ferry_config(servers, port, path != PLAIN))
    config["server"]["access_log"] = True
    for instance in config["instances"]:
        instance["engine_priority"] = engine_priority
    policy, variants = ferry_path(path) or (None, [])
    if policy is not None:
        config["scheduler"]["policy"] = policy
    for variant in variants:
        changes = VARIANTS[variant]
        config["scheduler"].update(changes.get("scheduler", {}))
        for instance in config["instances"]:
            instance.update(changes.get("instance", {}))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config, f)  # JSON is YAML
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--config", f.name]
    with open(log, "wb") as out:
        return subprocess.Popen([*cmd, "--log-level", "WARNING"], stdout=out)


def run_path(
    path: str,
    servers: list[VLLMServer],
    trace: list[TraceRequest],
    workload: str,
    seed: int,
    engine_priority: bool = False,
) -> Run:
    """One path through `trace`. `engine_priority`: the servers schedule by
    priority; Ferry sets the field, and a router's client sets it in the body."""
    real.reset_caches(servers)
    hits, queries = real.counters(servers)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp()) / "access.jsonl"
    if path.startswith("ferry"):
        proc = start_ferry(servers, port, path, log, engine_priority)
    else:
        proc = start_router(path, [s.url for s in servers], port)
    try:
        wait_healthy(url, proc)
        time.sleep(1.5)  # the routers' first health checks and scrapes
        prompts = real.Conversations(trace, seed)
        done = asyncio.run(
            replay(
                url,
                trace,
                real.MODEL,
                client="lean",
                prompts=prompts,
                timeout_s=120,
                body_priority=engine_priority and not path.startswith("ferry"),
            )
        )
    finally:
        proc.terminate()
        proc.wait(15)
    hits_after, queries_after = real.counters(servers)
    if workload == "priority":  # the row is the high-priority requests'
        done = [r for r in done if r.klass is Priority.HIGH]
    return Run(
        path,
        [r.first_token - r.arrival for r in done if r.first_token is not None],
        sum(1 for r in done if r.finish is not None),
        len(done),
        hits_after - hits,
        queries_after - queries,
        read_stages(log) if path.startswith("ferry") else [],
    )


def table(workload: str, runs: list[Run], title: str) -> str:
    """The paths side by side, each P99 against vllm-router's best (against
    plain Ferry's when no router ran)."""
    routers = [r for r in runs if r.path in ROUTERS]
    if routers:
        best, against = min(routers, key=lambda r: r.p99), "best router"
    else:
        best, against = next(r for r in runs if r.path == FERRY), FERRY
    who = "high-priority requests" if workload == "priority" else "all requests"
    lines = [
        f"{workload} ({who}), {title}:",
        f"  {'path':<26}{'TTFT p50':>9}{'p99':>9}{'hit rate':>9}{'finished':>10}"
        f"{against + ' p99 / p99':>23}",
    ]
    for r in runs:
        lines.append(
            f"  {r.path:<26}{r.p50:>8.3f}s{r.p99:>8.3f}s{r.hit_rate:>9.3f}"
            f"{r.finished:>6}/{r.requests:<3}{best.p99 / r.p99:>23.2f}"
        )
    for r in runs:
        if stages := r.tail_stages():
            means = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in stages.items())
            lines.append(f"  {r.path}: its slowest tenth (all requests), mean ms by stage: {means}")
    for r in runs:
        if routers and r.path.startswith("ferry"):
            ratio = best.p99 / r.p99
            verdict = "met" if ratio >= 1.0 else "NOT met"
            low, high = best_router_interval(routers, r)
            lines.append(
                f"  {r.path}: P99 TTFT {ratio:.2f}x better than vllm-router's best "
                f"({best.path.split(':')[1]}), target >= 1.0: {verdict};"
                f" 90% bootstrap interval {low:.2f}-{high:.2f}"
            )
    return "\n".join(lines)


def best_router_interval(
    routers: list[Run], ferry: Run, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """The 5th and 95th percentiles of (best router's P99 / Ferry's P99) over
    bootstrap resamples, each path's requests drawn again with replacement and
    the best router picked anew each time. A P99 of a few hundred requests is
    one of their slowest few, and the best of three such draws beats a fourth
    identical one more often than not: an interval that holds 1.0 is a tie."""
    rng = random.Random(seed)

    def p99_again(ttfts: list[float]) -> float:
        return percentile(rng.choices(ttfts, k=len(ttfts)), 99)

    ratios = sorted(
        min(p99_again(r.ttfts) for r in routers) / p99_again(ferry.ttfts) for _ in range(resamples)
    )
    return ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]


def make_trace(workload: str, requests: int, seed: int) -> list[TraceRequest]:
    return generate(replace(WORKLOADS[workload], requests=requests, seed=seed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100, help="per workload")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds per path, pooled (a P99 over all)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--kv-bytes", type=int, default=128 << 20, help="KV cache per server")
    parser.add_argument("--paths", default="", help="comma-separated subset (default: all)")
    parser.add_argument(
        "--apart", action="store_true", help="server i on core i; routers and client unpinned"
    )
    parser.add_argument(
        "--ttfts", type=Path, help="write each workload's and path's TTFTs here (JSON)"
    )
    parser.add_argument(
        "--engine-priority",
        action="store_true",
        help="servers run --scheduling-policy priority: Ferry sets the request's priority"
        " field (engine_priority), the routers' client sets it itself",
    )
    args = parser.parse_args(argv)
    chosen = args.workloads.split(",")
    if unknown := sorted(set(chosen) - set(WORKLOADS)):
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    only_order = [p for p in args.paths.split(",") if p]
    only = set(only_order)
    known = (*ROUTERS, PLAIN)
    if unknown := sorted(p for p in only if p not in known and ferry_path(p) is None):
        parser.error(
            f"unknown paths {unknown}; choose from {', '.join(known)}"
            f" or ferry[:POLICY][+VARIANT...], VARIANT one of {', '.join(VARIANTS)}"
        )
    flags = ("--scheduling-policy", "priority") if args.engine_priority else ()
    if args.apart:  # each server its own core, as GPUs are; routers and client float
        servers = real.start_servers(args, ("0", "1"), flags)
    else:  # first: start_vllm pins only from an unpinned process
        servers = real.start_servers(args, extra_args=flags)
        if len(os.sched_getaffinity(0)) >= 2:
            os.sched_setaffinity(0, {int(real.ROUTER_CORE)})  # the client; routers inherit it
        else:
            print("warning: fewer than 2 cores: nothing is pinned", file=sys.stderr)
    tables = []
    kept: dict[str, dict[str, list[float]]] = {}  # --ttfts: workload -> path -> TTFTs
    try:
        wait_ready(servers)
        real.warm_up(servers, args.seed)
        for workload in chosen:
            trace = make_trace(workload, args.requests, args.seed)
            # Named in --paths, any path runs on any workload: ferry-plain on
            # `heavy` shows what the credit costs where no prefix is shared.
            chosen_paths = list(dict.fromkeys(only_order)) if only else list(paths(workload))
            rounds: dict[str, list[Run]] = {p: [] for p in chosen_paths}
            for n in range(1, args.repeat + 1):
                for path in chosen_paths:  # the paths interleave, round by round
                    print(f"{workload}, round {n}: {path}...", flush=True)
                    run = run_path(path, servers, trace, workload, args.seed, args.engine_priority)
                    rounds[path].append(run)
                    print(f"  P99 TTFT {run.p99:.3f}s", flush=True)
                    if args.ttfts:
                        kept.setdefault(workload, {}).setdefault(path, []).extend(run.ttfts)
                        args.ttfts.write_text(json.dumps(kept))
            if not any(p in ROUTERS or p == FERRY for p in chosen_paths):
                continue  # nothing to compare with
            title = f"{args.repeat} rounds pooled" if args.repeat > 1 else "1 round"
            tables.append(table(workload, [pool(rounds[p]) for p in chosen_paths], title))
            print(tables[-1], flush=True)
    finally:
        for server in servers:
            server.stop()
    where = "on cores 0 and 1" if args.apart else "sharing core 0"
    print(f"\n{args.requests} requests per workload, seed {args.seed}; 2 vLLM servers {where}")
    print("\n".join(tables))
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
