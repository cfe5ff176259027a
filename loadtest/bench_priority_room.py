"""Making room for a high-priority request, in the simulator: the policy core's
rule (`make_room_victims`: move what frees the blocks the request needs, lowest
priority first, a queued request first, else the one that frees the most)
against the rule before
it (move the one shortest lower-priority stream, whether or not that frees
enough) and against no moves for priority at all.

One trace shape (Poisson arrivals, lognormal lengths, 20% high priority) on a
few simulated instances with little KV (`PROFILE`: 200 blocks of 16 tokens),
lite moves, several seeds pooled. Printed per load: TTFT P50 and P99 of the
high-priority requests and P99 of the others, the moves made for priority,
and each high-priority figure as a ratio of the rule before to the rule now
(above 1: now is better).

    python -m loadtest.bench_priority_room              # 5 seeds, 600 requests each
    python -m loadtest.bench_priority_room --seeds 2    # quick
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from loadtest import trace
from loadtest.sim.profile import LLAMA7B_A10
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.sim.stats import percentile
from proxy.policy.migration import RequestLoad
from proxy.policy.priority import lacks_room, make_room_victims
from proxy.policy.view import InstanceView, Priority

PROFILE = replace(LLAMA7B_A10, name="llama7b-a10, 200 KV blocks", kv_blocks=200)
LOADS = ((4, 12.0), (4, 16.0), (8, 30.0))  # (instances, requests/s)


def shortest_one(
    chosen: InstanceView,
    blocks_needed: int,
    candidates: Sequence[RequestLoad],
    elsewhere: Sequence[InstanceView],
) -> list[int]:
    """The rule before: the lowest-priority, then shortest, movable stream that
    another instance serves, however little it frees."""
    if not lacks_room(chosen, blocks_needed):
        return []
    others = [d for d in elsewhere if d.name != chosen.name and d.dispatchable]
    victims = [
        r
        for r in candidates
        if r.priority < Priority.HIGH and r.migratable and any(r.served_by(d) for d in others)
    ]
    return [min(victims, key=lambda r: (r.priority, r.tokens, r.id)).id] if victims else []


def no_moves(*_: object) -> list[int]:
    return []


RULES: dict[str, Callable[..., list[int]]] = {
    "no moves": no_moves,
    "one shortest (before)": shortest_one,
    "enough (now)": make_room_victims,
}


def run(instances: int, rate: float, seeds: int, requests: int) -> dict[str, tuple[list, ...]]:
    """Per rule: (high-priority TTFTs, the others' TTFTs, moves for priority)."""
    out: dict[str, tuple[list, ...]] = {}
    for name, rule in RULES.items():
        high: list[float] = []
        rest: list[float] = []
        moves: list[int] = []
        for seed in range(1, seeds + 1):
            spec = trace.TraceSpec(
                requests=requests, rate=rate, seed=seed, max_len=1000, high_priority=0.2
            )
            settings = SimSettings(instances, "llumnix", "lite", make_room=rule)
            sim = Simulator(trace.generate(spec), PROFILE, settings)
            for r in sim.run():
                if r.first_token is not None:
                    ttft = r.first_token - r.arrival
                    (high if r.priority is Priority.HIGH else rest).append(ttft)
            moves.append(sim.migrations["for_priority"])
        out[name] = (high, rest, moves)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=600)
    args = parser.parse_args(argv)
    print(f"{PROFILE.name}; lite moves; {args.requests} requests a seed, {args.seeds} pooled")
    print(
        f"{'load':<10}{'rule':<23}{'moves':>6}{'high p50 s':>11}{'p99 s':>8}{'others p99':>11}"
        f"{'high p50 before/now':>21}{'p99':>7}"
    )
    for instances, rate in LOADS:
        results = run(instances, rate, args.seeds, args.requests)
        before, _, _ = results["one shortest (before)"]
        for name, (high, rest, moves) in results.items():
            ratios = ""
            if name == "enough (now)":
                p50 = percentile(before, 50) / percentile(high, 50)
                p99 = percentile(before, 99) / percentile(high, 99)
                ratios = f"{p50:>20.2f}x{p99:>6.2f}x"
            print(
                f"{f'{instances} x {rate:g}/s':<10}{name:<23}{sum(moves):>6}"
                f"{percentile(high, 50):>11.3f}{percentile(high, 99):>8.3f}"
                f"{percentile(rest, 99):>11.3f}{ratios}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
