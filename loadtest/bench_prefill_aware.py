"""Prefill awareness in the simulator: llumnix ranking by memory alone against
llumnix preferring an instance with no prefill queued (`scheduler.prefill_aware`).

One trace shape (Poisson arrivals, lognormal lengths around 512/128 tokens, 20%
high priority) at three loads, several seeds each, on 16 simulated instances
whose prefill is dear (`PROFILE`: the shipped llama7b-a10 profile with a prefill
token at 0.3 ms, as a CPU server or a small GPU with long prompts), with moves
off and with lite moves. round_robin is the baseline a plain router gives.
Printed per load and mode: P50 and P99 TTFT pooled over the seeds' requests,
and each as a ratio of memory alone's to prefill awareness's (above 1: prefill
awareness is better).

    python -m loadtest.bench_prefill_aware            # 3 seeds, 3,000 requests each
    python -m loadtest.bench_prefill_aware --seeds 1 --requests 1000   # quick

Live, on real vLLM: `python -m loadtest.bench_workloads --workloads heavy
--paths vllm-router:round_robin,ferry,ferry+queue-blind`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from loadtest import trace
from loadtest.sim.instance import SimRequest
from loadtest.sim.profile import LLAMA7B_A10
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.sim.stats import percentile

PROFILE = replace(LLAMA7B_A10, name="llama7b-a10, 0.3 ms a prefill token", step_per_token_s=3e-4)
# The shipped profile prices a decoding request as one prefill token; here a
# prefill token costs 22x more, so keep a decoding request at the shipped price.
PROFILE = replace(PROFILE, step_per_seq_s=LLAMA7B_A10.step_per_token_s)
RATES = (40.0, 60.0, 80.0)  # requests/s on 16 instances: moderate to saturated
PATHS = (
    ("round_robin", "round_robin", True),
    ("memory alone", "llumnix", False),
    ("prefill-aware", "llumnix", True),
)


def ttfts(
    policy: str, aware: bool, migration: str, requests: list[trace.TraceRequest]
) -> list[float]:
    settings = SimSettings(
        instances=16, policy=policy, migration=migration, prefill_aware=aware, seed=1
    )
    done: list[SimRequest] = Simulator(requests, PROFILE, settings).run()
    return [r.first_token - r.arrival for r in done if r.first_token is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args(argv)
    print(
        f"16 simulated instances ({PROFILE.name}); {args.requests} requests per seed,"
        f" {args.seeds} seeds pooled; lognormal 512/128 tokens, 20% high priority"
    )
    print(
        f"{'rate/s':>7}  {'moves':<6}{'path':<15}{'TTFT p50 s':>11}{'p99 s':>8}"
        f"{'p50 blind/aware':>17}{'p99 blind/aware':>17}"
    )
    for rate in RATES:
        traces = [
            trace.generate(
                trace.TraceSpec(
                    requests=args.requests,
                    rate=rate,
                    seed=seed,
                    input_mean=512,
                    output_mean=128,
                    max_len=4000,
                    high_priority=0.2,
                )
            )
            for seed in range(1, args.seeds + 1)
        ]
        for migration in ("off", "lite"):
            pooled = {
                name: [t for r in traces for t in ttfts(policy, aware, migration, r)]
                for name, policy, aware in PATHS
            }
            blind, aware = pooled["memory alone"], pooled["prefill-aware"]
            for name, _, _ in PATHS:
                row = pooled[name]
                ratios = ""
                if name == "prefill-aware":
                    p50 = percentile(blind, 50) / percentile(aware, 50)
                    p99 = percentile(blind, 99) / percentile(aware, 99)
                    ratios = f"{p50:>16.2f}x{p99:>16.2f}x"
                print(
                    f"{rate:>7g}  {migration:<6}{name:<15}{percentile(row, 50):>11.3f}"
                    f"{percentile(row, 99):>8.3f}{ratios}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
