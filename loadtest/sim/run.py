"""`ferry sim`: simulate one trace on N instances under one policy, or on a fleet
that the scaling rule sizes (`--autoscale`, starting from N instances)."""

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
from proxy.policy.scaling import ScalingSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help="JSONL from `ferry trace`")
    parser.add_argument("--instances", type=_at_least_one, required=True)
    parser.add_argument("--policy", choices=sorted(POLICIES), required=True)
    parser.add_argument("--migration", choices=MODES, default="off")
    parser.add_argument("--profile", type=Path, help="profile JSON (default: llama7b-a10)")
    parser.add_argument(
        "--no-priorities", action="store_true", help="treat every request as normal"
    )
    parser.add_argument(
        "--headroom-blocks",
        type=float,
        default=None,
        help="KV blocks reserved where high-priority requests run (virtual usage);"
        " default: 10%% of each instance's capacity, as the proxy",
    )
    parser.add_argument(
        "--prefill-aware",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llumnix: prefer an instance with no prefill queued among those nearly as free"
        " (scheduler.prefill_aware; on by default, as the proxy)",
    )
    parser.add_argument(
        "--free-moves",
        action="store_true",
        help="plan lite moves as if the destination's recompute cost nothing",
    )
    scaling = parser.add_argument_group("autoscaling (the scaling rule of ferry_desired_instances)")
    scaling.add_argument(
        "--autoscale", action="store_true", help="size the fleet by the rule; starts at --instances"
    )
    defaults = ScalingSettings()
    scaling.add_argument("--scale-out-below", type=float, default=defaults.scale_out_freeness_below)
    scaling.add_argument("--scale-in-above", type=float, default=defaults.scale_in_freeness_above)
    scaling.add_argument("--min-instances", type=int, default=defaults.min_instances)
    scaling.add_argument("--max-instances", type=int, default=None)
    scaling.add_argument(
        "--scale-interval", type=float, default=10.0, help="seconds between two applications"
    )
    scaling.add_argument(
        "--startup-s", type=float, default=40.0, help="from asking for an instance to serving"
    )
    scaling.add_argument(
        "--scale-in-window", type=float, default=60.0, help="scale-in stabilization, seconds"
    )
    parser.add_argument(
        "--prefix-caching", action="store_true", help="engines cache prefixes (prefill what's new)"
    )
    parser.add_argument(
        "--prefix-credit",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="llumnix: credit cached blocks (README); on with --prefix-caching, as the proxy's"
        " default is",
    )
    parser.add_argument("--slo-ttft", type=float, default=SLO_TTFT_S)
    parser.add_argument("--slo-decode", type=float, default=SLO_DECODE_S)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _at_least_one(text: str) -> int:
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {count})")
    return count


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
    fleet = [f for _, f, _ in sim.fleet_log]
    summary["instance_seconds"] = round(sim.instance_seconds(), 1)
    summary["instances_min"], summary["instances_max"] = min(fleet), max(fleet)
    summary["wall_s"] = round(time.perf_counter() - started, 2)
    return summary


def settings_of(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        instances=args.instances,
        policy=args.policy,
        migration=args.migration,
        priorities=not args.no_priorities,
        high_priority_headroom_blocks=args.headroom_blocks,
        migration_settings=MigrationSettings(count_recompute=not args.free_moves),
        seed=args.seed,
        scaling=scaling_settings(args) if args.autoscale else None,
        scaling_interval_s=args.scale_interval,
        startup_s=args.startup_s,
        scale_in_window_s=args.scale_in_window,
        prefix_caching=args.prefix_caching,
        prefill_aware=args.prefill_aware,
        # The proxy credits by default; simulated engines cache only with --prefix-caching.
        prefix_credit=args.prefix_caching if args.prefix_credit is None else args.prefix_credit,
    )


def run(args: argparse.Namespace) -> int:
    requests = trace.read(args.trace)
    if not requests:
        raise ValueError(f"{args.trace}: no requests to simulate")
    profile = profiles.load(args.profile)
    room = profile.kv_blocks * profile.block_size
    too_long = next((r for r in requests if r.prompt_tokens + r.output_tokens > room), None)
    if too_long is not None:  # it would wait for room forever
        raise ValueError(
            f"{args.trace}: request {too_long.id} needs {too_long.prompt_tokens}"
            f" + {too_long.output_tokens} tokens of KV; an instance of {profile.name}"
            f" holds {room}"
        )
    # A tick is an event: at 1e-9 s a simulated second is a billion of them.
    if args.autoscale and not (
        0.01 <= args.scale_interval < float("inf") and args.scale_in_window >= 0
    ):
        raise ValueError("--scale-interval must be 0.01 s or more, --scale-in-window not negative")
    headroom = args.headroom_blocks
    if headroom is not None and not 0 <= headroom < float("inf"):
        raise ValueError("--headroom-blocks must be blocks, 0 or more")
    if not (0 < args.slo_ttft < float("inf") and 0 < args.slo_decode < float("inf")):
        raise ValueError("--slo-ttft and --slo-decode must be positive seconds")
    settings = settings_of(args)
    summary = simulate(
        requests,
        profile,
        settings,
        Slo(args.slo_ttft, args.slo_decode),
        show_progress=not args.json,
    )
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
    return 0


def scaling_settings(args: argparse.Namespace) -> ScalingSettings:
    try:
        return ScalingSettings(
            scale_out_freeness_below=args.scale_out_below,
            scale_in_freeness_above=args.scale_in_above,
            min_instances=args.min_instances,
            max_instances=args.max_instances,
        )
    except ValueError as exc:
        raise SystemExit(f"ferry sim: {exc}") from None


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
    lines.append(
        f"instances {s['instances_min']}..{s['instances_max']}, "
        f"{s['instance_seconds']:.0f} instance-seconds"
    )
    return "\n".join(lines)
