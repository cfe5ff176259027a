"""Validate the cluster simulator against reality: one trace, real and simulated.

Starts two real vLLM CPU servers of the tiny model (both pinned to core 0, KV
tight enough for queueing), measures one server's profile
(`loadtest.measure_profile`), puts Ferry (`--policy llumnix`, core 1) in front,
replays a seeded trace through it (`loadtest.replay`), simulates the same trace
with the measured profile on two instances under the same policy, and prints
both summaries side by side with the ratio sim/real. It is a report, not a
test: it exits 0 whatever the numbers, and always stops what it started.

    python -m loadtest.validate_sim [--requests 60] [--rate 3] [--seed 1]

Prefix caching is off on the servers unless `--prefix-caching`: the replayed
prompts all start with the same token ids, so with it on every prompt of 128+
tokens would hit a cached block. `--prefix-groups G` validates the simulator's
prefix cache instead: the servers cache prefixes, the trace gets shared system
prompts and multi-turn sessions (`--prefix-len`, `--turns`), the prompts go out
as token ids with that structure (each turn carries its session's earlier turns
and the answers the engine really gave: loadtest/bench_prefix_real.py's
`Conversations`), and the simulated engines cache prefixes too, placed with
the prefix credit Ferry uses by default.

    python -m loadtest.validate_sim --prefix-groups 4 --prefix-len 384 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from adapters.vllm import parse_metrics
from loadtest.bench_prefix_real import Conversations
from loadtest.ferry_process import wait_healthy
from loadtest.measure_profile import format_report, hop_overhead, measure
from loadtest.replay import replay
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.sim.stats import summarize
from loadtest.tiny_model import build
from loadtest.trace import TraceRequest, TraceSpec, generate
from loadtest.vllm_servers import (
    DEFAULT_MODEL_NAME,
    VLLMServer,
    start_vllm,
    stop_on_sigterm,
    wait_ready,
)

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".ferry"
MAX_MODEL_LEN = 1024
# One core per server, as the simulator assumes independent instances; the light
# client and ferry float. (Two servers on one core measured 1.9x slower steps.)
SERVER_CORES = ("0", "1")
TOLERANCE = 0.25
ROWS = (
    ("TTFT p50", "ttft_p50", "s"),
    ("TTFT p99", "ttft_p99", "s"),
    ("decode p50", "decode_p50", "ms"),
    ("decode p99", "decode_p99", "ms"),
    ("e2e p99", "e2e_p99", "s"),
)


def make_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace, with outputs clamped so that prompt + output fits max_model_len."""
    spec = TraceSpec(
        requests=args.requests,
        rate=args.rate,
        seed=args.seed,
        input_mean=200,
        output_mean=150,
        max_len=700,
    )
    if args.prefix_groups:  # turns carry their session's history: keep each part short
        spec = dataclasses.replace(
            spec,
            input_mean=48,
            output_mean=48,
            max_len=128,
            prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len,
            turns=args.turns,
            sessions_at_once=args.sessions_at_once,
        )
    return [
        dataclasses.replace(t, output_tokens=min(t.output_tokens, MAX_MODEL_LEN - t.prompt_tokens))
        for t in generate(spec)
    ]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def pinnable() -> bool:
    return len(os.sched_getaffinity(0)) > 1


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def start_ferry(backends: list[str], port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "proxy.cli", "serve"]
    for url in backends:
        cmd += ["--backend", url]
    cmd += ["--port", str(port), "--policy", "llumnix", "--log-level", "WARNING"]
    return subprocess.Popen(cmd, cwd=ROOT)


def preemptions(servers: list[VLLMServer]) -> int:
    return sum(parse_metrics(get(s.url + "/metrics")).preemptions_total for s in servers)


async def warm_up(servers: list[VLLMServer]) -> None:
    """A few requests per server, so no first-request cost lands in the replay."""
    warm = [TraceRequest(i, 0.05 * i, 64 + 200 * i, 16) for i in range(3)]
    for s in servers:
        await replay(s.url, warm, DEFAULT_MODEL_NAME)


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{1e3 * value:.1f} ms" if unit == "ms" else f"{value:.3f} s"


def ratio(sim: float, real: float) -> float:
    return sim / real if real and not math.isnan(real) else float("nan")


def format_table(real: dict[str, Any], sim: dict[str, Any], real_preempt: int) -> str:
    lines = [f"{'':<12}{'real':>12}{'simulated':>12}{'sim/real':>10}"]
    for label, key, unit in ROWS:
        lines.append(
            f"{label:<12}{_fmt(real[key], unit):>12}{_fmt(sim[key], unit):>12}"
            f"{ratio(sim[key], real[key]):>10.2f}"
        )
    lines.append(f"{'finished':<12}{real['finished']:>12}{sim['finished']:>12}")
    lines.append(f"{'preemptions':<12}{real_preempt:>12}{sim['preemptions']:>12}")
    lines.append(
        f"{'SLO attained':<12}{real['slo_attainment']:>12.1%}{sim['slo_attainment']:>12.1%}"
    )
    return "\n".join(lines)


def verdict(real: dict[str, Any], sim: dict[str, Any]) -> str:
    out = []
    for label, key in (("P50 TTFT", "ttft_p50"), ("P99 TTFT", "ttft_p99")):
        r = ratio(sim[key], real[key])
        ok = not math.isnan(r) and abs(r - 1) <= TOLERANCE
        word = "within" if ok else "NOT within"
        out.append(f"{label}: sim/real {r:.2f}, {word} {TOLERANCE:.0%}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> None:
    trace = make_trace(args)
    prefixes = args.prefix_groups > 0
    span = trace[-1].arrival_s if trace else 0.0
    print(
        f"trace: {len(trace)} requests over {span:.1f}s (rate {args.rate}/s, seed {args.seed}), "
        f"prompt mean {sum(t.prompt_tokens for t in trace) / max(1, len(trace)):.0f}, "
        f"output mean {sum(t.output_tokens for t in trace) / max(1, len(trace)):.0f} tokens"
    )
    model = build(WORK / "tiny-llama")
    caching = args.prefix_caching or prefixes
    extra = () if caching else ("--no-enable-prefix-caching",)
    servers: list[VLLMServer] = []
    ferry: subprocess.Popen[bytes] | None = None
    try:
        *vllm_ports, ferry_port = free_ports(3)
        print("starting 2 vLLM CPU servers, one per core (about a minute)...", flush=True)
        for port, cores in zip(vllm_ports, SERVER_CORES, strict=True):
            servers.append(
                start_vllm(
                    model,
                    port,
                    WORK / "logs",
                    kv_cache_bytes=args.kv_bytes,
                    max_model_len=MAX_MODEL_LEN,
                    cpus=cores,
                    extra_args=extra,
                )
            )
        wait_ready(servers)

        print(f"measuring the profile of {servers[0].url}...", flush=True)
        profile, points, overhead = asyncio.run(measure(servers[0].url, DEFAULT_MODEL_NAME))
        print(format_report(profile, points, overhead))
        asyncio.run(warm_up(servers))

        ferry = start_ferry([s.url for s in servers], ferry_port)
        ferry_url = f"http://127.0.0.1:{ferry_port}"
        wait_healthy(ferry_url, ferry)
        # The replay's requests go through Ferry; the profile was measured without it.
        hop = asyncio.run(hop_overhead(servers[0].url, ferry_url, DEFAULT_MODEL_NAME))
        print(f"Ferry's hop adds {1e3 * hop:.2f} ms to a short request's TTFT")
        profile = dataclasses.replace(profile, request_overhead_s=profile.request_overhead_s + hop)
        before = preemptions(servers)
        print(f"replaying through ferry at {ferry_url}...", flush=True)
        started = time.perf_counter()
        # The lean client: the official one costs about 0.5 ms of CPU per chunk, and
        # that CPU comes from the servers' cores, slowing what is measured.
        conversations = Conversations(trace, args.seed) if prefixes else None
        done = asyncio.run(
            replay(ferry_url, trace, DEFAULT_MODEL_NAME, client="lean", prompts=conversations)
        )
        print(f"replayed in {time.perf_counter() - started:.1f}s")
        real_preempt = preemptions(servers) - before
    finally:
        if ferry is not None:
            ferry.terminate()
            try:
                ferry.wait(10)
            except subprocess.TimeoutExpired:
                ferry.kill()
        for server in servers:
            server.stop()

    real = summarize(done, {})
    # Ferry ran with its defaults, the prefix credit on: simulate the same.
    settings = SimSettings(
        instances=2, policy="llumnix", prefix_caching=prefixes, prefix_credit=prefixes
    )
    simulated = Simulator(trace, profile, settings).run()
    sim = summarize(simulated, {})
    print()
    print(format_table(real, sim, real_preempt))
    print(verdict(real, sim))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--kv-bytes", type=int, default=4_000_000, help="KV cache per server (4 MB: 15 blocks)"
    )
    parser.add_argument(
        "--prefix-caching", action="store_true", help="keep vLLM's prefix caching on"
    )
    parser.add_argument(
        "--prefix-groups", type=int, default=0, help="shared system prompts (0: none)"
    )
    parser.add_argument("--prefix-len", type=int, default=384, help="tokens of each")
    parser.add_argument("--turns", type=int, default=3, help="turns per session")
    parser.add_argument("--sessions-at-once", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        run(args)
    except Exception:  # a report, not a test: say what went wrong, exit 0
        traceback.print_exc()
        print("validate_sim: failed (see above)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
