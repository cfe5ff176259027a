"""Ferry against vllm-router per core, on a machine with cores to spare.

bench_overhead and bench_replicas run on two cores, where the load generator,
the stand-ins and the proxies share them, so neither can say what one Ferry
core or N Ferry workers give. This one wants 12 or more cores (the device
machine lent to some sessions has 16; its GPU is not used) and gives each part
cores of its own:
- STAND-IN servers (`loadtest.standin_server`, not vLLM: a fixed gap between
  tokens, one token per event), one per core of `--backend-cores`;
- the client: one process per core of `--client-cores`, each running its share
  of the streams closed-loop on uvloop, so the client is not what saturates;
- the proxy under test alone on `--proxy-cores`: its first core for one process,
  its first N cores for N workers; vllm-router gets the same cores (its tokio
  runtime starts one thread per core it may run on);
- redis-server (Debian's, or REDIS_SERVER) on `--redis-core`.

Part 1, one core: one stream at a time (the proxy's own cost per request), then
`--concurrency` streams: TTFT p50/p99 added to direct's, tokens/s, and the proxy's CPU
time per 1,000 tokens. Part 2, N cores: `ferry serve --workers N --redis` against
vllm-router on the same N cores, under `--tput-concurrency` streams for
`--seconds` each: tokens/s, per core, and CPU per 1,000 tokens. `direct` rows are
the ceiling the stand-ins and the client allow; a proxy near it is not the
bottleneck there.

    python -m loadtest.bench_cores [--workers 1 2 4 8] [--seconds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.bench_overhead import Result, cpu_seconds, run_load, ttft_stages, wait_http
from loadtest.redis_server import start_redis
from migration_shim.launcher import free_port


def cores(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]"""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out += range(int(low), int(high or low) + 1)
    return out


def pinned(cmd: list[str], on: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, on)), *cmd]


def _client(core: int, args: tuple[Any, ...], results: Any) -> None:
    os.sched_setaffinity(0, {core})
    import uvloop

    results.put(uvloop.run(run_load(*args)))


def load(
    urls: list[str],
    client_cores: list[int],
    streams: int,
    *,
    requests: int | None = None,
    seconds: float = 10.0,
    max_tokens: int = 64,
    proxy_pid: int | None = None,
) -> Result:
    """`streams` split over one client process per core, until `requests` are
    done, or for `seconds` when None; what they saw, summed."""
    clients = client_cores[: max(1, min(len(client_cores), streams))]
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    procs = []
    cpu = cpu_seconds(proxy_pid) if proxy_pid else 0.0
    for i, core in enumerate(clients):
        share = streams // len(clients) + (i < streams % len(clients))
        args: tuple[Any, ...] = ("load", urls, share, 1 << 62, max_tokens, seconds)
        if requests is not None:
            quota = requests // len(clients) + (i < requests % len(clients))
            args = ("load", urls, share, quota, max_tokens)
        procs.append(context.Process(target=_client, args=(core, args, results)))
    for proc in procs:
        proc.start()
    parts: list[Result] = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    total = Result("load", [], 0, 0.0, 0)
    total.cpu_s = cpu_seconds(proxy_pid) - cpu if proxy_pid else 0.0
    for part in parts:
        total.tokens += part.tokens
        total.errors += part.errors
        total.ttfts += part.ttfts
        total.seconds = max(total.seconds, part.seconds)
    return total


class Cluster:
    """The stand-ins, Redis, and whichever proxy runs now; stopped together."""

    def __init__(self, backend_cores: list[int], redis_core: int, itl_ms: float) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.backends: list[str] = []
        self.workdir = tempfile.TemporaryDirectory(prefix="bench-cores-")
        try:
            self._start_all(backend_cores, redis_core, itl_ms)
        except BaseException:
            self.close()
            raise

    def _start_all(self, backend_cores: list[int], redis_core: int, itl_ms: float) -> None:
        py = sys.executable
        for core in backend_cores:
            port = free_port()
            cmd = [py, "-m", "loadtest.standin_server", "--port", str(port)]
            cmd += ["--itl-ms", str(itl_ms)]
            # Its stderr would fill with client-hung-up tracebacks as each run ends.
            self.procs.append(subprocess.Popen(pinned(cmd, [core]), stderr=subprocess.DEVNULL))
            self.backends.append(f"http://127.0.0.1:{port}")
        for url in self.backends:
            wait_http(url + "/health")
        redis_port = free_port()
        self.procs.append(start_redis(redis_port, Path(self.workdir.name)))
        os.sched_setaffinity(self.procs[-1].pid, {redis_core})
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"

    def ferry(self, on: list[int], workers: int = 1) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        cmd = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)]
        cmd += [a for url in self.backends for a in ("--backend", url)]
        cmd += ["--policy", "llumnix", "--log-level", "WARNING"]
        if workers > 1:
            cmd += ["--workers", str(workers), "--redis", self.redis_url]
        return self._start(pinned(cmd, on), port, stdout=None)

    def router(self, on: list[int]) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        router = shutil.which("vllm-router") or os.path.join(
            os.path.dirname(sys.executable), "vllm-router"
        )
        cmd = [router, "--worker-urls", *self.backends, "--port", str(port)]
        cmd += ["--policy", "round_robin", "--log-level", "warning"]
        return self._start(pinned(cmd, on), port, stdout=subprocess.DEVNULL)

    def _start(self, cmd: list[str], port: int, stdout: Any) -> tuple[str, subprocess.Popen[bytes]]:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stdout)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        time.sleep(1.0)  # every worker up and its first scrape done
        return url, proc

    @staticmethod
    def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        for proc in self.procs:
            self.stop(proc)
        self.workdir.cleanup()


def overhead(cluster: Cluster, proxy_core: int, args: argparse.Namespace) -> list[str]:
    """Part 1: each proxy on one core."""
    lines: list[str] = []
    for streams, requests, max_tokens in ((1, args.single_requests, 4), (args.concurrency, 0, 64)):
        seen: dict[str, Result] = {}
        stages = ""
        for name in ("direct", "ferry", "vllm-router"):
            proc = None
            if name == "direct":
                urls = cluster.backends
            else:
                url, proc = (cluster.ferry if name == "ferry" else cluster.router)([proxy_core])
                urls = [url]
            try:
                load(urls, args.client_cores, 20, requests=200, max_tokens=max_tokens)  # warm-up
                seen[name] = load(
                    urls,
                    args.client_cores,
                    streams,
                    requests=requests or None,
                    seconds=args.seconds,
                    max_tokens=max_tokens,
                    proxy_pid=proc.pid if proc else None,
                )
                if name == "ferry":
                    stages = ttft_stages(urls[0] + "/metrics")
            finally:
                if proc is not None:
                    cluster.stop(proc)
        direct = seen["direct"]
        section = [
            f"\n{streams} stream(s), {max_tokens} tokens each, stand-in ITL {args.itl_ms:g} ms;"
            f" proxy alone on core {proxy_core}",
            f"{'path':<12} {'TTFT p50 ms':>12} {'+p50 ms':>9} {'+p99 ms':>9} {'tokens/s':>10}"
            f" {'CPU ms/1k tok':>14} {'errors':>7}",
        ]
        for name, r in seen.items():
            section.append(
                f"{name:<12} {1e3 * r.p(50):>12.2f} {1e3 * (r.p(50) - direct.p(50)):>9.2f}"
                f" {1e3 * (r.p(99) - direct.p(99)):>9.2f} {r.tokens_per_s:>10,.0f}"
                f" {r.cpu_ms_per_1k_tokens:>14.1f} {r.errors:>7}"
            )
        ferry, router = seen["ferry"], seen["vllm-router"]
        # CPU time comes in 10 ms ticks: too few for a ratio on the one-stream run.
        cpu = (
            f"{ferry.cpu_ms_per_1k_tokens / router.cpu_ms_per_1k_tokens:.2f}x"
            if router.cpu_s > 0.1
            else "n/a"
        )
        section.append(
            f"ferry / vllm-router: tokens/s {ferry.tokens_per_s / router.tokens_per_s:.2f}x,"
            f" CPU per token {cpu}"
        )
        section.append(f"ferry TTFT by stage, mean ms (warm-up included): {stages}")
        print("\n".join(section), flush=True)
        lines += section
    return lines


def scaling(cluster: Cluster, args: argparse.Namespace) -> list[str]:
    """Part 2: N workers against vllm-router on N cores."""
    streams = args.tput_concurrency
    direct = load(cluster.backends, args.client_cores, streams, seconds=args.seconds)
    lines = [
        f"\n{streams} streams for {args.seconds:g} s each, 64 tokens a request; direct (no"
        f" proxy): {direct.tokens_per_s:,.0f} tokens/s, the ceiling here",
        f"{'cores':>5} {'path':<12} {'tokens/s':>10} {'per core':>9} {'CPU ms/1k tok':>14}"
        f" {'TTFT p50 ms':>12} {'p99 ms':>8} {'errors':>7}",
    ]
    print("\n".join(lines), flush=True)
    for n in args.workers:
        on = args.proxy_cores[:n]
        for name in ("ferry", "vllm-router"):
            url, proc = cluster.ferry(on, workers=n) if name == "ferry" else cluster.router(on)
            try:
                r = load(
                    [url], args.client_cores, streams, seconds=args.seconds, proxy_pid=proc.pid
                )
            finally:
                cluster.stop(proc)
            line = (
                f"{n:>5} {name:<12} {r.tokens_per_s:>10,.0f} {r.tokens_per_s / n:>9,.0f}"
                f" {r.cpu_ms_per_1k_tokens:>14.1f} {1e3 * r.p(50):>12.1f} {1e3 * r.p(99):>8.1f}"
                f" {r.errors:>7}"
            )
            lines.append(line)
            print(line, flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend-cores", type=cores, default=cores("0-3"))
    parser.add_argument("--client-cores", type=cores, default=cores("4-6"))
    parser.add_argument("--redis-core", type=int, default=7)
    parser.add_argument("--proxy-cores", type=cores, default=cores("8-15"))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--itl-ms", type=float, default=10.0, help="stand-in gap between tokens")
    parser.add_argument("--concurrency", type=int, default=200, help="part 1's loaded streams")
    parser.add_argument("--single-requests", type=int, default=300)
    parser.add_argument("--tput-concurrency", type=int, default=800, help="part 2's streams")
    parser.add_argument("--seconds", type=float, default=10.0, help="each loaded run's length")
    parser.add_argument("--parts", default="overhead,scaling")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    if max(args.workers) > len(args.proxy_cores):
        parser.error("--workers asks for more cores than --proxy-cores has")
    print(
        f"{os.cpu_count()} cores: stand-ins on {args.backend_cores}, clients on"
        f" {args.client_cores}, redis on {args.redis_core}, proxies on {args.proxy_cores}",
        flush=True,
    )
    cluster = Cluster(args.backend_cores, args.redis_core, args.itl_ms)
    lines: list[str] = []
    try:
        if "overhead" in args.parts:
            lines += overhead(cluster, args.proxy_cores[0], args)
        if "scaling" in args.parts:
            lines += scaling(cluster, args)
    finally:
        cluster.close()
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
