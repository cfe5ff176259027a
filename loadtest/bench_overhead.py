"""Proxy overhead: the same streaming load direct, through Ferry, through vllm-router.

Three scenarios: one stream at a time (the proxy's own cost per request), then
200 streams at 4k and at 20k tokens/s (on two cores the client's core and the
proxy's core both saturate at 20k, so that row measures throughput).

Two STAND-IN servers (loadtest/standin_server.py, not vLLM: a fixed 10 ms
between tokens, so the backend is never the bottleneck) on core 0 with the load
generator; the proxy under test alone on core 1. `concurrency` client streams
run closed-loop, each request 64 tokens; the client records TTFT per request
and tokens received per second. One run measures all three paths side by side.

    python -m loadtest.bench_overhead [--concurrency 200] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from itertools import cycle

import aiohttp

from tests.helpers import free_port

CORE_BACKENDS, CORE_PROXY = "0", "1"
# Read once, before main() pins this process (and so its children) to one core.
MULTI_CORE = len(os.sched_getaffinity(0)) > 1


@dataclass
class Result:
    name: str
    ttfts: list[float]
    tokens: int
    seconds: float
    errors: int

    def p(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def pinned(cmd: list[str], cores: str) -> list[str]:
    if shutil.which("taskset") and MULTI_CORE:
        return ["taskset", "-c", cores, *cmd]
    return cmd


def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


async def run_load(
    name: str, urls: list[str], concurrency: int, requests: int, max_tokens: int
) -> Result:
    body = json.dumps(
        {"model": "standin", "prompt": "hello", "max_tokens": max_tokens, "stream": True}
    ).encode()
    targets = cycle(urls)
    remaining = requests
    ttfts: list[float] = []
    tokens = errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal remaining, tokens, errors
            while remaining > 0:
                remaining -= 1
                started = time.perf_counter()
                first = None
                try:
                    async with session.post(
                        next(targets) + "/v1/completions",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        if resp.status != 200:
                            errors += 1
                            await resp.read()
                            continue
                        async for data in resp.content.iter_any():
                            n = data.count(b'"text":')
                            if n and first is None:
                                first = time.perf_counter() - started
                            tokens += n
                except aiohttp.ClientError:
                    errors += 1
                    continue
                if first is not None:
                    ttfts.append(first)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return Result(name, ttfts, tokens, seconds, errors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--single-requests",
        type=int,
        default=200,
        help="requests of the one-stream run that shows the unloaded overhead",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--itl-ms",
        type=float,
        nargs="+",
        default=[50.0, 10.0],
        help="stand-in gaps between tokens; 50 ms = 4k tokens/s at 200 streams, 10 ms = 20k",
    )
    args = parser.parse_args()
    if MULTI_CORE:
        os.sched_setaffinity(0, {int(CORE_BACKENDS)})  # the load generator shares core 0
    # The one-stream run measures TTFT only, so its requests are 4 tokens long.
    scenarios = [(1, args.single_requests, 4, args.itl_ms[0])]
    scenarios += [(args.concurrency, args.requests, args.max_tokens, itl) for itl in args.itl_ms]
    for concurrency, requests, max_tokens, itl_ms in scenarios:
        results = measure(concurrency, requests, max_tokens, itl_ms)
        report(results, concurrency, requests, max_tokens, itl_ms)
        sys.stdout.flush()
    return 0


def measure(concurrency: int, requests: int, max_tokens: int, itl_ms: float) -> dict[str, Result]:
    procs: list[subprocess.Popen[bytes]] = []
    py = sys.executable
    try:
        backends = []
        for _ in range(2):
            port = free_port()
            cmd = [
                py,
                "-m",
                "loadtest.standin_server",
                "--port",
                str(port),
                "--itl-ms",
                str(itl_ms),
            ]
            # Its stderr would fill with client-hung-up tracebacks as each run ends.
            procs.append(subprocess.Popen(pinned(cmd, CORE_BACKENDS), stderr=subprocess.DEVNULL))
            backends.append(f"http://127.0.0.1:{port}")
        for url in backends:
            wait_http(url + "/health")
        ferry_port, router_port = free_port(), free_port()
        backend_args = [a for url in backends for a in ("--backend", url)]
        ferry_cmd = [
            py,
            "-m",
            "proxy.cli",
            "serve",
            *backend_args,
            "--port",
            str(ferry_port),
            "--policy",
            "llumnix",
            "--log-level",
            "WARNING",
        ]
        procs.append(subprocess.Popen(pinned(ferry_cmd, CORE_PROXY)))
        router = shutil.which("vllm-router") or os.path.join(os.path.dirname(py), "vllm-router")
        router_cmd = [
            router,
            "--worker-urls",
            *backends,
            "--port",
            str(router_port),
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
        ]
        procs.append(
            subprocess.Popen(
                pinned(router_cmd, CORE_PROXY), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
        wait_http(f"http://127.0.0.1:{ferry_port}/health")
        wait_http(f"http://127.0.0.1:{router_port}/health")
        paths = {
            "direct": backends,
            "ferry": [f"http://127.0.0.1:{ferry_port}"],
            "vllm-router": [f"http://127.0.0.1:{router_port}"],
        }
        results = {}
        for name, urls in paths.items():
            asyncio.run(run_load(name, urls, 20, 100, max_tokens))  # warm-up
            results[name] = asyncio.run(run_load(name, urls, concurrency, requests, max_tokens))
        return results
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def report(
    results: dict[str, Result], concurrency: int, requests: int, max_tokens: int, itl_ms: float
) -> None:
    direct, ferry, router = results["direct"], results["ferry"], results["vllm-router"]
    print(
        f"\n{concurrency} concurrent streams, {requests} requests x {max_tokens} tokens,"
        f" stand-in ITL {itl_ms:g} ms; proxy alone on core {CORE_PROXY}"
    )
    print(
        f"{'path':<12} {'TTFT p50 ms':>11} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}"
        f" {'tokens/s':>9} {'errors':>6}"
    )
    for r in results.values():
        print(
            f"{r.name:<12} {1e3 * r.p(50):>11.2f} {1e3 * r.p(99):>8.2f}"
            f" {1e3 * (r.p(50) - direct.p(50)):>8.2f} {1e3 * (r.p(99) - direct.p(99)):>8.2f}"
            f" {r.tokens_per_s:>9.0f} {r.errors:>6}"
        )
    print(
        f"ferry / vllm-router tokens/s: {ferry.tokens_per_s / router.tokens_per_s:.2f}x;"
        f" ferry / direct: {ferry.tokens_per_s / direct.tokens_per_s:.2f}x"
    )
    print(
        f"added TTFT p50: ferry {1e3 * (ferry.p(50) - direct.p(50)):.2f} ms, vllm-router"
        f" {1e3 * (router.p(50) - direct.p(50)):.2f} ms; p99: ferry"
        f" {1e3 * (ferry.p(99) - direct.p(99)):.2f} ms, vllm-router"
        f" {1e3 * (router.p(99) - direct.p(99)):.2f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
