"""Proxy overhead: the same streaming load direct, through Ferry, through vllm-router.

Three scenarios: one stream at a time (the proxy's own cost per request), then
200 streams at 4k and at 20k tokens/s (on two cores the client's core and the
proxy's core both saturate at 20k, so that row measures throughput). A fourth,
`--scenarios requests`, runs 50 streams of 2 tokens each: nearly all of the
proxy's CPU there is what a request costs apart from its tokens, so its
"CPU ms/request" column splits a proxy's cost into per request and per token.

Two STAND-IN servers (loadtest/standin_server.py, not vLLM: a fixed 10 ms
between tokens, so the backend is never the bottleneck) on core 0 with the load
generator; the proxy under test alone on core 1. `concurrency` client streams
run closed-loop, each request 64 tokens; the client records TTFT per request
and tokens received per second, and the proxy's CPU time (its processes', from
/proc) per 1,000 tokens, which the machine's other load disturbs least, split
into the kernel's part (the sockets' reads and writes, the same work for any
proxy relaying the same chunks) and the proxy's own, in user space. One run
measures all three paths side by side, `--repeat` times in turn (on a shared
machine the spread between repeats is the noise); the table gives each figure's
median and its range over the repeats. `--profile DIR` records Ferry under
py-spy (the `bench` extra) in each scenario's last repeat, as py-spy's
collapsed stacks (`ferry-<streams>x<itl>ms.txt`; flamegraph.pl or speedscope
draw them).

    python -m loadtest.bench_overhead [--concurrency 200] [--requests 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from itertools import cycle

import aiohttp

from migration_shim.launcher import free_port

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
    cpu_s: float = 0.0  # the proxy's processes' CPU time during the run (0: direct)
    kernel_s: float = 0.0  # the part of it spent in the kernel (system time)

    def p(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_ms_per_1k_tokens(self) -> float:
        return 1e6 * self.cpu_s / max(self.tokens, 1)

    @property
    def cpu_ms_per_request(self) -> float:
        return 1e3 * self.cpu_s / max(len(self.ttfts), 1)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of `pid` and its descendants, from Linux's /proc."""
    return sum(cpu_times(pid))


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system (kernel) CPU seconds of `pid` and its descendants."""
    user = kernel = 0.0
    pids = [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            user += int(fields[11]) / tick
            kernel += int(fields[12]) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    pids += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
    return user, kernel


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
    name: str,
    urls: list[str],
    concurrency: int,
    requests: int,
    max_tokens: int,
    seconds: float | None = None,
) -> Result:
    """`concurrency` closed-loop streams until `requests` are done (or `seconds`
    have passed, if given)."""
    deadline = None if seconds is None else time.perf_counter() + seconds
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
            while remaining > 0 and (deadline is None or time.perf_counter() < deadline):
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
                except (TimeoutError, aiohttp.ClientError):
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
        "--repeat", type=int, default=1, help="measure the three paths this many times in turn"
    )
    parser.add_argument("--profile", metavar="DIR", help="record Ferry with py-spy into DIR")
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        help="also run the Ferry of source tree SRC (e.g. `git archive` of an older"
        " commit) as path `ferry-base`, side by side in the same runs",
    )
    parser.add_argument(
        "--scenarios",
        default="single,loaded",
        help="single (one stream), loaded (--concurrency streams per --itl-ms), requests"
        " (50 streams of 2 tokens: the proxy's CPU per request, apart from per token)",
    )
    parser.add_argument(
        "--itl-ms",
        type=float,
        nargs="+",
        default=[50.0, 10.0],
        help="stand-in gaps between tokens; 50 ms = 4k tokens/s at 200 streams, 10 ms = 20k",
    )
    parser.add_argument(
        "--migration",
        choices=("off", "lite"),
        default="off",
        help="Ferry's migration mode (lite: every stream movable, proxy/live_stream.py)",
    )
    args = parser.parse_args()
    if MULTI_CORE:
        os.sched_setaffinity(0, {int(CORE_BACKENDS)})  # the load generator shares core 0
    # The one-stream run measures TTFT only, so its requests are 4 tokens long.
    wanted = args.scenarios.split(",")
    scenarios = [(1, args.single_requests, 4, args.itl_ms[0])] if "single" in wanted else []
    if "loaded" in wanted:
        scenarios += [
            (args.concurrency, args.requests, args.max_tokens, itl) for itl in args.itl_ms
        ]
    if "requests" in wanted:
        scenarios.append((50, 3000, 2, 1.0))
    for concurrency, requests, max_tokens, itl_ms in scenarios:
        profile = None
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            profile = os.path.join(args.profile, f"ferry-{concurrency}x{itl_ms:g}ms.txt")
        runs = measure(
            concurrency,
            requests,
            max_tokens,
            itl_ms,
            args.repeat,
            profile,
            args.baseline,
            args.migration,
        )
        report(runs, concurrency, requests, max_tokens, itl_ms)
        sys.stdout.flush()
    return 0


def measure(
    concurrency: int,
    requests: int,
    max_tokens: int,
    itl_ms: float,
    repeat: int = 1,
    profile: str | None = None,
    baseline: str | None = None,
    migration: str = "off",
) -> list[dict[str, Result]]:
    """`repeat` runs of the three paths in turn, on the same servers."""
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

        def ferry_cmd(port: int) -> list[str]:
            cmd = [py, "-m", "proxy.cli", "serve", *backend_args, "--port", str(port)]
            return [*cmd, "--policy", "llumnix", "--migration", migration, "--log-level", "WARNING"]

        ferry = subprocess.Popen(pinned(ferry_cmd(ferry_port), CORE_PROXY))
        procs.append(ferry)
        base = None
        if baseline:
            base_port = free_port()
            env = {**os.environ, "PYTHONPATH": os.path.abspath(baseline)}
            base = subprocess.Popen(pinned(ferry_cmd(base_port), CORE_PROXY), env=env, cwd=baseline)
            procs.append(base)
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
        router_proc = subprocess.Popen(
            pinned(router_cmd, CORE_PROXY), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        procs.append(router_proc)
        wait_http(f"http://127.0.0.1:{ferry_port}/health")
        wait_http(f"http://127.0.0.1:{router_port}/health")
        paths = {
            "direct": backends,
            "ferry": [f"http://127.0.0.1:{ferry_port}"],
            "vllm-router": [f"http://127.0.0.1:{router_port}"],
        }
        pids = {"ferry": ferry.pid, "vllm-router": router_proc.pid}
        if base is not None:
            wait_http(f"http://127.0.0.1:{base_port}/health")
            paths["ferry-base"] = [f"http://127.0.0.1:{base_port}"]
            pids["ferry-base"] = base.pid
        for name, urls in paths.items():
            asyncio.run(run_load(name, urls, 20, 100, max_tokens))  # warm-up
        runs = []
        for n in range(repeat):
            results = {}
            for name, urls in paths.items():
                spy = None
                if profile and name == "ferry" and n == repeat - 1:
                    spy = start_profile(ferry.pid, profile)
                pid = pids.get(name)
                user, kernel = cpu_times(pid) if pid else (0.0, 0.0)
                result = asyncio.run(run_load(name, urls, concurrency, requests, max_tokens))
                if pid:
                    user_after, kernel_after = cpu_times(pid)
                    result.kernel_s = kernel_after - kernel
                    result.cpu_s = user_after - user + result.kernel_s
                if spy is not None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its file and exits
                    spy.wait(60)
                results[name] = result
            runs.append(results)
        stages = ttft_stages(f"http://127.0.0.1:{ferry_port}/metrics")
        print(f"ferry TTFT by stage, mean ms: {stages}")
        return runs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def ttft_stages(metrics_url: str) -> str:
    """Where Ferry's TTFT went, stage by stage (proxy/ttft_stages.py): the mean
    over every stream Ferry served so far, warm-up included."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for suffix, into in (("_sum", sums), ("_count", counts)):
            prefix = f'ferry_time_to_first_token_stage_seconds{suffix}{{stage="'
            if line.startswith(prefix):
                stage = line[len(prefix) :].split('"', 1)[0]
                into[stage] = float(line.rsplit(" ", 1)[1])
    means = [f"{stage} {1e3 * sums[stage] / counts[stage]:.3f}" for stage in sums if counts[stage]]
    return ", ".join(means)


def start_profile(pid: int, path: str) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` (Python frames, 200 Hz, without pausing it) into `path`."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    cmd = [spy, "record", "-p", str(pid), "-f", "raw", "-o", path, "-r", "200", "--nonblocking"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # attached before the load starts
    return process


def report(
    runs: list[dict[str, Result]],
    concurrency: int,
    requests: int,
    max_tokens: int,
    itl_ms: float,
) -> None:
    print(
        f"\n{concurrency} concurrent streams, {requests} requests x {max_tokens} tokens,"
        f" stand-in ITL {itl_ms:g} ms; proxy alone on core {CORE_PROXY};"
        f" median [min-max] of {len(runs)} run(s)"
    )
    print(
        f"{'path':<12} {'TTFT p50 ms':>18} {'+p50 ms':>18} {'+p99 ms':>18}"
        f" {'tokens/s':>18} {'CPU ms/1k tok':>18} {'CPU ms/request':>18} {'errors':>6}"
    )

    def added(r: Result, direct: Result, q: float) -> float:
        return 1e3 * (r.p(q) - direct.p(q))

    figures: dict[str, dict[str, list[float]]] = {}
    for name in runs[0]:
        per_run = [(run[name], run["direct"]) for run in runs]
        figures[name] = {
            "p50": [1e3 * r.p(50) for r, _ in per_run],
            "+p50": [added(r, d, 50) for r, d in per_run],
            "+p99": [added(r, d, 99) for r, d in per_run],
            "tokens/s": [r.tokens_per_s for r, _ in per_run],
            "cpu": [r.cpu_ms_per_1k_tokens for r, _ in per_run],
            "cpu/req": [r.cpu_ms_per_request for r, _ in per_run],
            "kernel": [1e6 * r.kernel_s / max(r.tokens, 1) for r, _ in per_run],
        }
        f = figures[name]
        errors = sum(r.errors for r, _ in per_run)
        print(
            f"{name:<12} {spread(f['p50'])} {spread(f['+p50'])} {spread(f['+p99'])}"
            f" {spread(f['tokens/s'], '.0f')} {spread(f['cpu'])} {spread(f['cpu/req'], '.3f')}"
            f" {errors:>6}"
        )
    ferry, router = figures["ferry"], figures["vllm-router"]
    ratios = [a / b for a, b in zip(ferry["tokens/s"], router["tokens/s"], strict=True)]
    wins = sum(
        a <= b and c >= d
        for a, b, c, d in zip(
            ferry["+p50"], router["+p50"], ferry["tokens/s"], router["tokens/s"], strict=True
        )
    )
    if "ferry-base" in figures:
        base = figures["ferry-base"]
        cpu = [a / b for a, b in zip(ferry["cpu"], base["cpu"], strict=True)]
        req = [a / b for a, b in zip(ferry["cpu/req"], base["cpu/req"], strict=True)]
        print(
            f"ferry / ferry-base: CPU per token {spread(cpu, '.2f').strip()}x, per request"
            f" {spread(req, '.2f').strip()}x, added TTFT p50"
            f" {statistics.median(ferry['+p50']):.2f} vs {statistics.median(base['+p50']):.2f} ms"
        )
    cpu_req = [a / b for a, b in zip(ferry["cpu/req"], router["cpu/req"], strict=True)]
    cpu_tok = [a / b for a, b in zip(ferry["cpu"], router["cpu"], strict=True)]
    print(
        f"ferry / vllm-router CPU per request: {spread(cpu_req, '.2f').strip()}x,"
        f" per 1k tokens: {spread(cpu_tok, '.2f').strip()}x"
    )
    print(
        f"ferry / vllm-router tokens/s: {spread(ratios, '.2f')}x; added TTFT p50: ferry"
        f" {statistics.median(ferry['+p50']):.2f} ms, vllm-router"
        f" {statistics.median(router['+p50']):.2f} ms; runs where ferry's added p50 <="
        f" vllm-router's and its tokens/s >=: {wins}/{len(runs)}"
    )
    # The kernel's part (the sockets' reads and writes) is the same work for any
    # proxy that relays the same chunks; the rest is the proxy's own code.
    user = {
        name: [a - b for a, b in zip(f["cpu"], f["kernel"], strict=True)]  # both us/token
        for name, f in (("ferry", ferry), ("vllm-router", router))
    }
    print(
        f"CPU us/token in the kernel: ferry {spread(ferry['kernel'], '.1f').strip()},"
        f" vllm-router {spread(router['kernel'], '.1f').strip()}; in user space: ferry"
        f" {spread(user['ferry'], '.1f').strip()}, vllm-router"
        f" {spread(user['vllm-router'], '.1f').strip()}"
    )


def spread(values: list[float], fmt: str = ".2f") -> str:
    """median [min-max], 18 characters wide."""
    if len(values) == 1:
        return f"{values[0]:>18{fmt}}"
    text = f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"
    return f"{text:>18}"


if __name__ == "__main__":
    sys.exit(main())
