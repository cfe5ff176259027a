"""Where Ferry's tail TTFT goes on a real vLLM server, next to vllm-router's.

One real vLLM CPU server (the tiny model, 15 KV blocks of 128 tokens) pinned
to core 0 with its OpenMP threads; each proxy and the load generator on core 1.
One heavy-tailed trace (lognormal lengths around 128/128 tokens, Poisson
arrivals) goes through vllm-router (round_robin), then through Ferry with its
default 0.25 s scrape interval and with 2 s. Ferry writes its access log, whose
`ttft_stages_s` splits each request's TTFT (proxy/ttft_stages.py); for the
requests at or above Ferry's P90 TTFT it prints the mean of each stage, so the
tail is either Ferry's own (parse, dispatch, upstream_connect, relay) or the
engine's (upstream_first_byte).

    python -m loadtest.ttft_breakdown [--requests 80] [--rate 0.75]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.bench_overhead import wait_http
from loadtest.replay import replay
from loadtest.sim.instance import SimRequest
from loadtest.tiny_model import build
from loadtest.trace import TraceRequest, TraceSpec, generate
from loadtest.vllm_servers import start_vllm, stop_on_sigterm, wait_ready
from migration_shim.launcher import free_port
from proxy.ttft_stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
CORE_SERVER, CORE_PROXY = "0", "1"


def pinned(cmd: list[str]) -> list[str]:
    return ["taskset", "-c", CORE_PROXY, *cmd]


def run_router(url: str, trace: list[TraceRequest], port: int) -> list[float]:
    router = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    cmd = [router, "--worker-urls", url, "--port", str(port), "--policy", "round_robin"]
    proc = subprocess.Popen(
        pinned([*cmd, "--log-level", "warning"]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return ttfts(replay_through(proc, port, trace))


def replay_through(
    proc: subprocess.Popen[bytes], port: int, trace: list[TraceRequest]
) -> list[SimRequest]:
    """Replay `trace` through the router `proc` started on `port`, then stop it."""
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        time.sleep(1.0)
        return asyncio.run(replay(f"http://127.0.0.1:{port}", trace, "tiny", client="lean"))
    finally:
        proc.terminate()
        proc.wait(10)


def run_ferry(
    url: str, trace: list[TraceRequest], port: int, scrape_s: float, log: Path
) -> tuple[list[float], list[dict[str, float]]]:
    config = (
        f"instances:\n  - name: v0\n    url: {url}\n"
        f"scheduler:\n  scrape_interval_s: {scrape_s}\n  seed: 1\n"
        f"server:\n  port: {port}\n  access_log: true\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config)
    with open(log, "wb") as out:
        cmd = [sys.executable, "-m", "proxy.cli", "serve", "--config", f.name]
        proc = subprocess.Popen(pinned([*cmd, "--log-level", "INFO"]), stdout=out)
        done = replay_through(proc, port, trace)
    return ttfts(done), read_stages(log)


def read_stages(log: Path) -> list[dict[str, float]]:
    """Each request's TTFT stages, from Ferry's access log."""
    stages = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("ttft_stages_s"):
                stages.append(record["ttft_stages_s"])
    return stages


def ttfts(done: list[SimRequest]) -> list[float]:
    return [r.first_token - r.arrival for r in done if r.first_token is not None]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=0.75)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    os.sched_setaffinity(0, {int(CORE_PROXY)})  # the load generator
    spec = TraceSpec(
        requests=args.requests,
        rate=args.rate,
        seed=args.seed,
        input_mean=128,
        output_mean=128,
        max_len=480,
    )
    trace = generate(spec)
    model = build(ROOT / ".ferry" / "tiny-llama")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = CORE_SERVER  # its threads stay on its core
    server = start_vllm(model, free_port(), ROOT / ".ferry" / "logs", cpus=CORE_SERVER)
    rows: dict[str, list[float]] = {}
    tails: dict[str, dict[str, float]] = {}
    try:
        wait_ready([server])
        rows["vllm-router"] = run_router(server.url, trace, free_port())
        for scrape_s in (0.25, 2.0):
            name = f"ferry scrape {scrape_s:g}s"
            log = Path(tempfile.mkdtemp()) / "access.jsonl"
            ttfts, stages = run_ferry(server.url, trace, free_port(), scrape_s, log)
            rows[name] = ttfts
            by_total = sorted(stages, key=lambda s: sum(s.values()))
            tail = by_total[int(0.9 * len(by_total)) :]
            tails[name] = {k: statistics.mean(s[k] for s in tail) for k in STAGES}
    finally:
        server.stop()
    print(f"\n{args.requests} requests at {args.rate}/s, 1 vLLM CPU server on core {CORE_SERVER}")
    print(f"{'path':<20}{'TTFT p50':>10}{'p90':>10}{'p99':>10}")
    for name, ttfts in rows.items():
        print(f"{name:<20}{pct(ttfts, 50):>9.3f}s{pct(ttfts, 90):>9.3f}s{pct(ttfts, 99):>9.3f}s")
    for name, means in tails.items():
        split = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in means.items())
        print(f"{name}: its slowest 10% by stage, mean ms: {split}")
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
