"""Real cluster effect: Ferry (without migration, lite, full) vs vllm-router.

Two real vLLM CPU servers (one per core, tight KV caches: 4 MB = 15 blocks of
128 tokens each) take one bursty, heavy-tailed trace (Gamma arrivals, CV 3,
lognormal lengths) five times: through vllm-router with `round_robin` and with
`power_of_two` (its best is taken), through Ferry `llumnix` without migration,
and through Ferry `llumnix` with rebalancing by lite migration and by full
(migration_shim) migration. Same trace, same servers (shim on), one run; P99
TTFT and decode printed side by side, as ratios.

    python -m loadtest.bench_cluster [--requests 80] [--rate 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.ferry_process import wait_healthy
from loadtest.replay import replay
from loadtest.sim.stats import lower, summarize
from loadtest.tiny_model import build
from loadtest.trace import TraceSpec, generate
from loadtest.vllm_servers import start_vllm, stop_on_sigterm, wait_ready
from migration_shim.launcher import free_port

ROOT = Path(__file__).resolve().parent.parent
KINDS = (
    "vllm-router:round_robin",
    "vllm-router:power_of_two",
    "ferry",
    "ferry+lite",
    "ferry+full",
)


def ferry_config(urls: list[str], port: int, migration: str) -> str:
    lines = ["instances:"]
    for i, url in enumerate(urls):
        lines += [f"  - name: v{i}", f"    url: {url}", f'    migration: "{migration}"']
    lines += ["scheduler:", "  policy: llumnix", "  seed: 1"]
    if migration != "off":
        lines += ["  rebalance_interval_s: 0.2"]
    lines += ["server:", f"  port: {port}"]
    return "\n".join(lines) + "\n"


def start(kind: str, urls: list[str], port: int) -> subprocess.Popen[bytes]:
    py = sys.executable
    if kind.startswith("vllm-router"):
        policy = kind.split(":")[1]
        router = os.path.join(os.path.dirname(py), "vllm-router")
        cmd = [
            router,
            "--worker-urls",
            *urls,
            "--port",
            str(port),
            "--policy",
            policy,
            "--log-level",
            "warning",
        ]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(ferry_config(urls, port, migration=kind.partition("+")[2] or "off"))
    return subprocess.Popen(
        [py, "-m", "proxy.cli", "serve", "--config", f.name, "--log-level", "WARNING"]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    trace = generate(
        TraceSpec(
            requests=args.requests,
            rate=args.rate,
            seed=args.seed,
            arrival="gamma",
            cv=3.0,
            input_mean=150,
            output_mean=200,
            max_len=480,
        )
    )
    model = build(ROOT / ".ferry" / "tiny-llama")
    servers = [
        start_vllm(
            model, free_port(), ROOT / ".ferry" / "logs", cpus=str(i), shim_kv_port=free_port()
        )
        for i in range(2)
    ]
    results: dict[str, dict[str, Any]] = {}
    try:
        wait_ready(servers)
        urls = [s.url for s in servers]
        for kind in KINDS:
            port = free_port()
            proc = start(kind, urls, port)
            try:
                wait_healthy(f"http://127.0.0.1:{port}")
                time.sleep(1.0)
                done = asyncio.run(replay(f"http://127.0.0.1:{port}", trace, "tiny"))
                results[kind] = summarize(done, {})
                print(f"  {kind}: P99 TTFT {results[kind]['ttft_p99']:.3f}s", file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        for s in servers:
            s.stop()
    print(
        f"\n{args.requests} requests, gamma CV 3 at {args.rate}/s, 2 vLLM CPU servers"
        " with 15 KV blocks each:"
    )
    print(f"{'path':<26}{'TTFT p50':>9}{'p99':>9}{'decode p50':>11}{'p99':>9}{'finished':>9}")
    for kind, s in results.items():
        print(
            f"{kind:<26}{s['ttft_p50']:>8.3f}s{s['ttft_p99']:>8.3f}s"
            f"{1e3 * s['decode_p50']:>9.1f}ms{1e3 * s['decode_p99']:>7.1f}ms{s['finished']:>9}"
        )
    best = min(
        ("vllm-router:round_robin", "vllm-router:power_of_two"),
        key=lambda k: results[k]["ttft_p99"],
    )
    for kind in KINDS[2:]:
        ttft = results[best]["ttft_p99"] / results[kind]["ttft_p99"]
        decode = results[best]["decode_p99"] / results[kind]["decode_p99"]
        print(f"{kind} vs {best}: P99 TTFT {lower(ttft)}, P99 decode {lower(decode)}")
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
