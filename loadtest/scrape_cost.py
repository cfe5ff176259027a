"""What Ferry's polling costs a real vLLM server: CPU per call of the endpoints it reads.

One real vLLM CPU server (the 8-layer test model of `loadtest.bench_prefix_real`)
pinned to core 0, idle; 100 calls of each endpoint Ferry's scraper reads
(`/metrics` every `scrape_interval_s`, asked by name or whole; `/v1/models`
and `/health` now and then),
with the server's CPU time (API process and engine core, from /proc) before and
after. vLLM renders hundreds of histogram lines per `/metrics`, on the CPU its
engine shares.

    python -m loadtest.scrape_cost
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

import psutil

from adapters.vllm import METRICS_NARROW_PATH
from loadtest import bench_prefix_real as real
from loadtest.tiny_model import build
from loadtest.vllm_servers import VLLMServer, start_vllm, stop_on_sigterm, wait_ready
from migration_shim.launcher import free_port

CALLS = 100


def server_cpu_s(server: VLLMServer) -> float:
    root = psutil.Process(server.process.pid)
    total = 0.0
    for p in (root, *root.children(recursive=True)):
        times = p.cpu_times()
        total += times.user + times.system
    return total


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return len(resp.read())


def main() -> int:
    # No options: it parses them so that `--help` says what it does rather than run.
    argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0]).parse_args()
    model = build(real.MODEL_DIR, hidden=real.HIDDEN, layers=real.LAYERS)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    server = start_vllm(
        model,
        free_port(),
        real.ROOT / ".ferry" / "logs",
        kv_cache_bytes=128 << 20,
        max_model_len=real.MAX_MODEL_LEN,
        cpus="0",
    )
    try:
        wait_ready([server])
        real.warm_up([server], 1)
        for path in ("/metrics", METRICS_NARROW_PATH, "/v1/models", "/health"):
            size = get(server.url + path)
            cpu, wall = server_cpu_s(server), time.perf_counter()
            for _ in range(CALLS):
                get(server.url + path)
            cpu, wall = server_cpu_s(server) - cpu, time.perf_counter() - wall
            print(
                f"{path[:40]:<40} {size:>6} bytes: {1e3 * wall / CALLS:.2f} ms a call, "
                f"server CPU {1e3 * cpu / CALLS:.2f} ms a call"
            )
        cpu = server_cpu_s(server)
        time.sleep(5)
        print(f"idle: the server uses {1e3 * (server_cpu_s(server) - cpu) / 5:.0f} ms CPU a second")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
