"""What the scaling signal buys: a fixed fleet against the fleet the rule sizes, in the simulator.

One day-shaped trace (Poisson arrivals whose rate swings +-60% around `--rate`
over one day compressed into `--day-s` seconds: a trough at the start and end,
the peak at midday; lognormal lengths) is simulated twice with the same policy
core (`llumnix` dispatch, lite migration):
- a fixed fleet of `--instances`, sized for the peak;
- an autoscaled fleet: every `--interval` seconds the scaling rule behind
  `ferry_desired_instances` (proxy/policy/scaling.py, default thresholds: scale
  out below freeness 10, in above 60 with one instance fewer) sets the fleet, within
  [1, `--instances`], starting from one instance. A new instance serves `--startup-s`
  after it is asked for (and costs from then); scale-in waits out a 60 s
  stabilization window (the HPA's, compressed) and drains the instance by migration.

Printed side by side: instance-seconds (what the fleet costs), P99 TTFT, the P99
over streams of their worst gap between two tokens (a preemption shows there),
preemptions and the time requests lost to them, the fleet's range; then the
ratios autoscaled / fixed, and the fleet over the day next to the arrival rate.
The simulator is deterministic: the same arguments print the same figures.

    python -m loadtest.bench_autoscale [--instances 4] [--rate 20] [--day-s 1200]

The default run takes about half a minute. It is a report, not a test.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from loadtest.sim.profile import LLAMA7B_A10
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.sim.stats import summarize
from loadtest.trace import TraceRequest, TraceSpec, day_rate, generate
from proxy.policy.scaling import ScalingSettings


def run_one(trace: list[TraceRequest], settings: SimSettings) -> tuple[dict[str, Any], Simulator]:
    started = time.perf_counter()
    sim = Simulator(trace, LLAMA7B_A10, settings)
    summary = summarize(sim.run(), sim.migrations)
    fleet = [f for _, f, _ in sim.fleet_log]
    summary["instance_seconds"] = sim.instance_seconds()
    summary["instances_min"], summary["instances_max"] = min(fleet), max(fleet)
    summary["wall_s"] = time.perf_counter() - started
    return summary, sim


def fleet_at(sim: Simulator, t: float) -> int:
    """Instances not draining (the autoscaler's replicas) at time t."""
    count = sim.fleet_log[0][1]
    for at, fleet, _ in sim.fleet_log:
        if at > t:
            break
        count = fleet
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=4, help="the fixed fleet; the cap")
    parser.add_argument("--rate", type=float, default=20.0, help="mean requests per second")
    parser.add_argument("--day-s", type=float, default=1200.0, help="one day, compressed")
    parser.add_argument("--startup-s", type=float, default=40.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between scalings")
    parser.add_argument("--migration", choices=("off", "lite", "full"), default="lite")
    defaults = ScalingSettings()
    parser.add_argument("--scale-out-below", type=float, default=defaults.scale_out_freeness_below)
    parser.add_argument("--scale-in-above", type=float, default=defaults.scale_in_freeness_above)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    spec = TraceSpec(
        requests=round(args.rate * args.day_s), rate=args.rate, seed=args.seed, day_s=args.day_s
    )
    trace = generate(spec)
    fixed, _ = run_one(trace, SimSettings(args.instances, "llumnix", args.migration))
    scaled, sim = run_one(
        trace,
        SimSettings(
            1,
            "llumnix",
            args.migration,
            scaling=ScalingSettings(
                scale_out_freeness_below=args.scale_out_below,
                scale_in_freeness_above=args.scale_in_above,
                min_instances=1,
                max_instances=args.instances,
            ),
            scaling_interval_s=args.interval,
            startup_s=args.startup_s,
        ),
    )
    peak = day_rate(args.day_s / 2, args.rate, args.day_s, spec.day_amplitude)
    trough = day_rate(0, args.rate, args.day_s, spec.day_amplitude)
    print(
        f"{len(trace)} requests over a {args.day_s:.0f} s day, {trough:.0f}..{peak:.0f} req/s;"
        f" llumnix dispatch, migration {args.migration}; startup {args.startup_s:.0f} s,"
        f" scaling every {args.interval:.0f} s, out below freeness {args.scale_out_below:g},"
        f" in above {args.scale_in_above:g}"
    )
    print(
        f"{'fleet':<16}{'inst-s':>9}{'TTFT p99':>10}{'stall p99':>11}{'preempt':>9}"
        f"{'lost s':>8}{'inst':>7}{'moves':>7}{'sim s':>7}"
    )
    for name, s in ((f"fixed {args.instances}", fixed), ("autoscaled", scaled)):
        print(
            f"{name:<16}{s['instance_seconds']:>9.0f}{s['ttft_p99']:>9.3f}s{s['stall_p99']:>10.3f}s"
            f"{s['preemptions']:>9}{s['preemption_loss_s']:>8.1f}"
            f"{s['instances_min']:>4}..{s['instances_max']:<2}{s['migrations']:>6}{s['wall_s']:>7.1f}"
        )
    print("autoscaled / fixed:")
    for key, label in (
        ("instance_seconds", "instance-seconds"),
        ("ttft_p99", "P99 TTFT"),
        ("stall_p99", "P99 worst stall"),
    ):
        print(f"  {label:<17}{scaled[key] / fixed[key]:.2f}x")
    print("over the day (time: arrival rate -> autoscaled fleet):")
    marks = [args.day_s * k / 12 for k in range(13)]
    print(
        "  "
        + "  ".join(
            f"{t:.0f}s:{day_rate(t, args.rate, args.day_s, spec.day_amplitude):.0f}"
            f"->{fleet_at(sim, t)}"
            for t in marks
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
