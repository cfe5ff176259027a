"""The scheduling-quality report: every policy on the same traces, from one seed.

    python -m loadtest.report --out report --seed 1     # ~3 minutes on one core

1. Rate sweep on `--instances` simulated instances (LLaMA-7B profile, Poisson
   arrivals, lognormal lengths with mean 256 in / 256 out): P99 TTFT and decode
   per policy, printed and plotted (PNG, one line per policy, like the paper's figures).
2. Ratios at each rate: Llumnix (virtual usage + lite migration) against
   round-robin, least-KV (INFaaS) and the llm-d style queue+KV scorer.
3. Priorities at the highest rate: 10% high-priority traffic with headroom vs the
   same trace with priorities ignored.
4. Cost, at each rate: the fewest instances with which Llumnix matches
   round-robin's P99 TTFT on the full cluster.
5. Scale: wall time of one full-size simulation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loadtest.sim.profile import LLAMA7B_A10
from loadtest.sim.run import simulate
from loadtest.sim.simulator import SimSettings
from loadtest.trace import TraceSpec, generate

CONFIGS = [  # (label, policy, migration)
    ("round_robin", "round_robin", "off"),
    ("least_kv", "least_kv", "off"),
    ("queue_kv_scorer", "queue_kv_scorer", "off"),
    ("llumnix", "llumnix", "off"),
    ("llumnix+lite", "llumnix", "lite"),
    ("llumnix+full", "llumnix", "full"),
]
BEST = "llumnix+lite"
OTHERS = ("round_robin", "least_kv", "queue_kv_scorer")


def sweep(rates: list[float], n: int, requests: int, seed: int) -> dict[float, dict[str, Any]]:
    results: dict[float, dict[str, Any]] = {}
    for rate in rates:
        trace = generate(TraceSpec(requests=requests, rate=rate, seed=seed))
        results[rate] = {}
        for label, policy, migration in CONFIGS:
            print(f"  rate {rate:g}/s, {label} ...", file=sys.stderr, flush=True)
            results[rate][label] = simulate(trace, LLAMA7B_A10, SimSettings(n, policy, migration))
    return results


def print_sweep(results: dict[float, dict[str, Any]]) -> None:
    print(
        f"\n{'rate/s':>7} {'policy':<16}{'TTFT p50':>9}{'p99':>9}{'decode p50':>11}{'p99':>8}"
        f"{'e2e p99':>9}{'preempt':>8}{'migr':>6}{'SLO':>7}"
    )
    for rate, by_policy in results.items():
        for label, s in by_policy.items():
            print(
                f"{rate:>7g} {label:<16}{s['ttft_p50']:>8.3f}s{s['ttft_p99']:>8.3f}s"
                f"{1e3 * s['decode_p50']:>9.1f}ms{1e3 * s['decode_p99']:>6.1f}ms"
                f"{s['e2e_p99']:>8.1f}s{s['preemptions']:>8}{s['migrations']:>6}"
                f"{100 * s['slo_attainment']:>6.1f}%"
            )


def plot(results: dict[float, dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(results)
    paths = []
    for key, title, unit in (("ttft_p99", "P99 TTFT", 1.0), ("decode_p99", "P99 decode", 1e3)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, _, _ in CONFIGS:
            ax.plot(rates, [results[r][label][key] * unit for r in rates], marker="o", label=label)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} ({'s' if unit == 1.0 else 'ms'})")
        ax.set_yscale("log")
        ax.set_title(f"{title} vs rate, simulated cluster")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def priorities(rate: float, n: int, requests: int, seed: int, headroom: float) -> dict[str, Any]:
    trace = generate(TraceSpec(requests=requests, rate=rate, seed=seed, high_priority=0.1))
    with_p = simulate(
        trace,
        LLAMA7B_A10,
        SimSettings(n, "llumnix", "lite", priorities=True, high_priority_headroom_blocks=headroom),
    )
    without = simulate(trace, LLAMA7B_A10, SimSettings(n, "llumnix", "lite", priorities=False))
    return {"with": with_p["by_priority"], "without": without["by_priority"]}


def cost(
    rate: float, n: int, requests: int, seed: int
) -> tuple[float, int | None, dict[int, float]]:
    trace = generate(TraceSpec(requests=requests, rate=rate, seed=seed))
    target = simulate(trace, LLAMA7B_A10, SimSettings(n, "round_robin"))["ttft_p99"]
    seen: dict[int, float] = {}
    fewest = None
    for k in range(n, 0, -1):
        print(f"  cost: llumnix+lite on {k} instances ...", file=sys.stderr, flush=True)
        p99 = simulate(trace, LLAMA7B_A10, SimSettings(k, "llumnix", "lite"))["ttft_p99"]
        seen[k] = p99
        if p99 > target:
            break
        fewest = k
    return target, fewest, seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("report"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument(
        "--rates", default="160,180,200,220,230", help="requests/s, comma-separated"
    )
    parser.add_argument(
        "--headroom-blocks",
        type=float,
        default=200.0,
        help="reserved where high-priority requests run (20%% of the profile's KV)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    n, requests, seed = args.instances, args.requests, args.seed

    results = sweep(rates, n, requests, seed)
    print_sweep(results)
    print(f"\n{BEST} better by (P99 TTFT / P99 decode), same trace:")
    print(f"{'rate/s':>7}" + "".join(f"{'vs ' + o:>26}" for o in OTHERS))
    for rate, by_policy in results.items():
        best = by_policy[BEST]
        cells = [
            f"{by_policy[o]['ttft_p99'] / best['ttft_p99']:>12.1f}x /"
            f"{by_policy[o]['decode_p99'] / best['decode_p99']:>6.2f}x"
            for o in OTHERS
        ]
        print(f"{rate:>7g}" + "".join(f"{c:>26}" for c in cells))
    for path in plot(results, args.out):
        print(f"plot: {path}")

    prio_rate = rates[-1]
    prio = priorities(prio_rate, n, requests, seed, args.headroom_blocks)
    print(
        f"\npriorities at {prio_rate:g} req/s, 10% high, headroom {args.headroom_blocks:g}"
        " blocks (with / without priorities):"
    )
    for klass in ("high", "normal"):
        w, wo = prio["with"][klass], prio["without"][klass]
        print(
            f"  {klass:<7} P99 TTFT {w['ttft_p99']:.3f}s / {wo['ttft_p99']:.3f}s"
            f" = {wo['ttft_p99'] / w['ttft_p99']:.2f}x better;"
            f" P99 decode {1e3 * w['decode_p99']:.1f}ms / {1e3 * wo['decode_p99']:.1f}ms"
            f" = {wo['decode_p99'] / w['decode_p99']:.2f}x better"
        )

    print(f"\ncost: fewest instances with which {BEST} matches round_robin's P99 TTFT on {n}:")
    costs = {}
    for rate in rates:
        target, fewest, seen = cost(rate, n, requests, seed)
        costs[str(rate)] = {"target": target, "fewest": fewest, "seen": seen}
        tried = ", ".join(f"{k}: {v:.3f}s" for k, v in seen.items())
        saved = "-" if fewest is None else f"{fewest} ({100 * (1 - fewest / n):.0f}% fewer)"
        print(f"  {rate:>5g} req/s: round_robin P99 {target:.3f}s -> {saved}   [{tried}]")
    wall = results[rates[-1]][BEST]["wall_s"]
    print(f"\nscale: {n} instances x {requests} requests simulated in {wall:.1f}s ({BEST})")
    summary = {
        "sweep": {str(r): v for r, v in results.items()},
        "priorities": prio,
        "cost": costs,
    }
    (args.out / "report.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
