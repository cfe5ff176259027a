"""`ferry sim`: simulate one trace on N instances under one policy."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from loadtest import trace
from loadtest.sim import profile as profiles
from loadtest.sim.simulator import MODES, SimSettings, Simulator
from loadtest.sim.stats import DEFAULT_SLO, SLO_DECODE_S, SLO_TTFT_S, Slo, summarize
from proxy.policy import POLICIES
from proxy.policy.migration import MigrationSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help="JSONL from `ferry trace`")
    parser.add_argument("--instances", type=int, required=True)
    parser.add_argument("--policy", choices=sorted(POLICIES), required=True)
    parser.add_argument("--migration", choices=MODES, default="off")
    parser.add_argument("--profile", type=Path, help="profile JSON (default: llama7b-a10)")
    parser.add_argument(
        "--no-priorities", action="store_true", help="treat every request as normal"
    )
    parser.add_argument(
        "--headroom-blocks",
        type=float,
        default=0.0,
        help="KV blocks a high-priority request reserves (virtual usage)",
    )
    parser.add_argument(
        "--free-moves",
        action="store_true",
        help="plan lite moves as if the destination's recompute cost nothing",
    )
    parser.add_argument("--slo-ttft", type=float, default=SLO_TTFT_S)
    parser.add_argument("--slo-decode", type=float, default=SLO_DECODE_S)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def simulate(
    requests: list[trace.TraceRequest],
    profile: profiles.Profile,
    settings: SimSettings,
    slo: Slo = DEFAULT_SLO,
    show_progress: bool = False,
) -> dict[str, Any]:
    started = time.perf_counter()
    sim = Simulator(requests, profile, settings)

    def progress(done: int, total: int) -> None:
        print(f"\r  simulated {done}/{total} requests", end="", file=sys.stderr, flush=True)

    result = sim.run(progress if show_progress else None)
    if show_progress:
        print(file=sys.stderr)
    summary = summarize(result, sim.migrations, slo)
    summary["wall_s"] = round(time.perf_counter() - started, 2)
    return summary


def run(args: argparse.Namespace) -> int:
    requests = trace.read(args.trace)
    settings = SimSettings(
        instances=args.instances,
        policy=args.policy,
        migration=args.migration,
        priorities=not args.no_priorities,
        high_priority_headroom_blocks=args.headroom_blocks,
        migration_settings=MigrationSettings(count_recompute=not args.free_moves),
        seed=args.seed,
    )
    summary = simulate(
        requests,
        profiles.load(args.profile),
        settings,
        Slo(args.slo_ttft, args.slo_decode),
        show_progress=not args.json,
    )
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
    return 0


def format_summary(s: dict[str, Any]) -> str:
    rows = [("all", s)] + list(s["by_priority"].items())
    lines = [
        f"{'class':<8}{'n':>7}{'TTFT p50':>10}{'p99':>9}{'decode p50':>12}{'p99':>9}"
        f"{'stall p99':>10}{'e2e p99':>9}{'SLO':>7}"
    ]
    for name, m in rows:
        lines.append(
            f"{name:<8}{m['requests']:>7}{m['ttft_p50']:>9.3f}s{m['ttft_p99']:>8.3f}s"
            f"{1e3 * m['decode_p50']:>10.1f}ms{1e3 * m['decode_p99']:>7.1f}ms"
            f"{m['stall_p99']:>9.3f}s{m['e2e_p99']:>8.1f}s{100 * m['slo_attainment']:>6.1f}%"
        )
    lines.append(
        f"preemptions {s['preemptions']} (lost {s['preemption_loss_s']:.1f}s waiting), "
        f"migrations {s['migrations']} (+{s['migrations_aborted']} aborted), "
        f"simulated in {s['wall_s']}s"
    )
    return "\n".join(lines)
