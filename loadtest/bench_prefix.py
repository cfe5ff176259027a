"""Prefix locality in the simulator: four policies side by side, over several traces.

round_robin, cache_aware (vllm-router's default, over Ferry's approximate index),
llumnix, and llumnix with prefix credit run on the same multi-turn,
shared-system-prompt traces (`ferry trace --prefix-groups G --prefix-len L
--turns T`, seeds --seed to --seed + --seeds - 1) against simulated engines
with prefix caching on, then llumnix with and without credit on traces of the
same shape with nothing shared. Printed, pooled over the traces: the engines'
prefix hit rate (hit / queried prompt tokens, as vLLM's prefix_cache_hits /
queries), P50 and P99 TTFT and throughput (output tokens per second of
makespan), each also as a ratio to plain llumnix; and each trace's hit rate,
which moves by points from one trace to the next.

    python -m loadtest.bench_prefix                    # 16 instances, 5 x 3,000 requests
    python -m loadtest.bench_prefix --seeds 1          # one trace (seed 1)
    python -m loadtest.bench_prefix --requests 800 --instances 4   # quick

The same comparison on real vLLM CPU servers, with vllm-router's own
`cache_aware` and `round_robin`: loadtest/bench_prefix_real.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from loadtest import trace
from loadtest.sim.profile import LLAMA7B_A10
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.sim.stats import percentile, request_times

COMPARED = (
    ("round_robin", "round_robin", False),
    ("cache_aware", "cache_aware", False),
    ("llumnix", "llumnix", False),
    ("llumnix+prefix", "llumnix", True),
)


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class TraceRun:
    """One policy on one trace: what pools across seeds."""

    hits: int
    queried: int
    ttfts: list[float]
    generated: int
    span_s: float


def run_one(
    policy: str, credit: bool, requests: list[trace.TraceRequest], instances: int
) -> TraceRun:
    settings = SimSettings(
        instances=instances,
        policy=policy,
        prefix_caching=True,
        prefix_credit=credit,
        seed=1,
    )
    sim = Simulator(requests, LLAMA7B_A10, settings)
    done = sim.run()
    queried = sum(i.cache.queried_tokens for i in sim.instances if i.cache is not None)
    hits = sum(i.cache.hit_tokens for i in sim.instances if i.cache is not None)
    finished = [r for r in done if r.finish is not None]
    span = max(r.finish for r in finished if r.finish is not None) - min(r.arrival for r in done)
    ttfts = [t[0] for t in map(request_times, done) if t is not None]
    return TraceRun(hits, queried, ttfts, sum(r.generated for r in finished), span)


def pooled(name: str, runs: list[TraceRun]) -> Result:
    """One row over every seed's run: hits over queries, percentiles over all
    requests, tokens over the summed makespans."""
    hits, queried = sum(r.hits for r in runs), sum(r.queried for r in runs)
    ttfts = [t for r in runs for t in r.ttfts]
    span = sum(r.span_s for r in runs)
    return Result(
        name,
        hits / queried if queried else 0.0,
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        sum(r.generated for r in runs) / span if span > 0 else 0.0,
    )


def table(title: str, results: list[Result]) -> None:
    base = next(r for r in results if r.name == "llumnix")
    print(f"\n{title}")
    print(
        f"{'policy':<16}{'hit rate':>10}{'TTFT p50 s':>12}{'p99 s':>10}{'tok/s':>10}"
        f"{'p50 / llumnix':>15}{'p99 / llumnix':>15}{'tok/s / llumnix':>17}"
    )
    for r in results:
        print(
            f"{r.name:<16}{r.hit_rate:>10.3f}{r.ttft_p50:>12.3f}{r.ttft_p99:>10.3f}"
            f"{r.tokens_per_s:>10.0f}{r.ttft_p50 / base.ttft_p50:>15.2f}"
            f"{r.ttft_p99 / base.ttft_p99:>15.2f}{r.tokens_per_s / base.tokens_per_s:>17.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=0.0, help="req/s (0: 10 per instance)")
    parser.add_argument("--prefix-groups", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--sessions-at-once", type=int, default=0, help="0: 8 per instance")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--seeds", type=int, default=5, help="traces --seed, --seed + 1, ...: pooled rows"
    )
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds: at least 1")
    rate = args.rate or 10.0 * args.instances
    seeds = range(args.seed, args.seed + args.seeds)
    shared_runs: dict[str, list[TraceRun]] = {name: [] for name, _, _ in COMPARED}
    alone_runs: dict[str, list[TraceRun]] = {name: [] for name, _, _ in COMPARED[2:]}
    for seed in seeds:
        spec = trace.TraceSpec(
            requests=args.requests,
            rate=rate,
            seed=seed,
            input_mean=128,
            output_mean=128,
            max_len=1024,
            prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len,
            turns=args.turns,
            sessions_at_once=args.sessions_at_once or 8 * args.instances,
        )
        shared = trace.generate(spec)
        for name, policy, credit in COMPARED:
            shared_runs[name].append(run_one(policy, credit, shared, args.instances))
        # Nothing shared: the same lengths and arrivals, every block a request's own.
        alone = [
            trace.TraceRequest(r.id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.priority)
            for r in shared
        ]
        for name, policy, credit in COMPARED[2:]:
            alone_runs[name].append(run_one(policy, credit, alone, args.instances))
    print(
        f"{args.instances} simulated instances ({LLAMA7B_A10.name}, prefix caching on), "
        f"{args.requests} requests at {rate:g}/s: {args.prefix_groups} system prompts of "
        f"{args.prefix_len} tokens, {args.turns} turns per session; "
        f"seeds {seeds.start}..{seeds.stop - 1} pooled"
    )
    table("shared prefixes", [pooled(name, runs) for name, runs in shared_runs.items()])
    if len(seeds) > 1:
        # A hit rate moves by a point or two from one trace to the next.
        print("\nhit rate by seed")
        for name, runs in shared_runs.items():
            rates = " ".join(f"{r.hits / r.queried:.3f}" if r.queried else "-" for r in runs)
            print(f"{name:<16}{rates}")
    table(
        "nothing shared (same lengths and arrivals)",
        [pooled(name, runs) for name, runs in alone_runs.items()],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
