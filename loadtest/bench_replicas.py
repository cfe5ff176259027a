"""Several Ferry processes in front of one cluster: sharing the view through Redis or not.

Sixteen paged-KV STAND-IN engines (`loadtest.paged_standin`, not vLLM: bench_scale's
cluster, 64 KV blocks of 16 tokens each, preemption by recompute) run in one process
on core 0. One bursty trace (Gamma arrivals, CV 3, lognormal lengths, near the
cluster's KV capacity) is replayed, engines restarted cold each time, through:
- `1 process`: one `ferry serve` (no Redis), every request to it: the baseline;
- `4 shared`: four `ferry serve --redis` processes (replicas, one port each),
  the trace's requests dealt to them in turn: each places its requests knowing
  the others' in-flight load (50 ms old at most);
- `4 apart`: the same four without Redis: each knows only its own requests, so
  between scrapes (250 ms) the four pile onto the instances that look free;
- `4 shared, kill -9`: as `4 shared`, and halfway through the trace the process
  holding the rescheduler lease is killed with SIGKILL. Reported: the requests
  that failed (its streams, and those sent to it after), the survivors' view
  before and after (no phantom load once its totals expire), and how long its
  totals and its lease took to go.
After the trace of each setup but the kill, placement alone: a burst of 64 long streams in
0.3 s on the idle engines, dealt to the processes in turn, and how many each
engine got (4 each if evenly placed): the CPU-starved P99s above swing by
several times between runs, this much less.
Then throughput: `concurrency` closed-loop streams through `ferry serve --workers N
--redis` (one port, SO_REUSEPORT) for N = 1, 2, 4, on two fast stand-in servers
(`loadtest.standin_server`, 10 ms between tokens), tokens/s side by side.

Ferry runs with its defaults (llumnix, no rebalancing) and `--log-level WARNING`;
redis-server is Debian's (`make setup`). The Ferry processes, Redis and the
client share core 1: four processes get no more CPU than one here, so the
replica rows measure what sharing costs and what not sharing costs, not a gain
from more cores, and the throughput rows say what N workers on one core give.
Where more cores are free, pin one worker per core (`taskset`) to see the gain.

    python -m loadtest.bench_replicas [--requests 400] [--rate 18] [--seed 1] [--repeat 1]

About 4 minutes a round. It is a report, not a test; a P99 over 400 requests is their
4th worst, and the machine's other tenants move it by tens of percent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench_overhead import run_load, wait_http
from loadtest.bench_scale import Engines, make_trace
from loadtest.paged_standin import DEFAULT_PROFILE
from loadtest.redis_server import start_redis
from loadtest.replay import prompt_ids, replay
from loadtest.sim.instance import SimRequest
from loadtest.sim.profile import save
from loadtest.sim.stats import summarize
from loadtest.trace import TraceRequest
from migration_shim.launcher import free_port

ENGINE_CORE, FERRY_CORE = 0, 1
TOKEN = "bench"
TTL_S, LEASE_TTL_S = 1.0, 2.0  # Ferry's defaults (sharing.ttl_s, sharing.lease_ttl_s)
SETUPS = ("1 process", "4 shared", "4 apart", "4 shared, kill -9")
MODEL = "standin"


class Ferries:
    """`count` `ferry serve` processes on ports of their own, or one with `--workers`."""

    def __init__(
        self,
        backends: list[str],
        count: int,
        workdir: Path,
        *,
        redis_url: str | None,
        prefix: str,
        workers: int = 1,
    ) -> None:
        config = {
            "instances": [{"name": f"e{i}", "url": u} for i, u in enumerate(backends)],
            "admin_token": TOKEN,
            "sharing": {"key_prefix": prefix},
            # Rebalancing on (its engines do not migrate: it plans nothing), so
            # that a process holds the lease the kill run watches move.
            "scheduler": {"rebalance_interval_s": 0.5},
        }
        if redis_url is not None:
            config["redis_url"] = redis_url
        path = workdir / f"{prefix}.yaml"
        path.write_text(json.dumps(config))
        self.urls: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = workdir / f"{prefix}.log"
        with self.logs.open("ab") as log:
            for _ in range(count):
                port = free_port()
                cmd = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)]
                cmd += ["--port", str(port), "--log-level", "WARNING"]
                if workers > 1:
                    cmd += ["--workers", str(workers)]
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log))
                self.urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(self.urls, self.procs, strict=True):
            wait_ready(url, proc, self.logs)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ferry exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"ferry at {url} was not ready in {timeout_s}s")


async def admin(session: aiohttp.ClientSession, url: str, path: str) -> Any:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with session.get(url + path, headers=headers) as resp:
        return await resp.json()


async def spread(urls: list[str], trace: list[TraceRequest]) -> list[SimRequest]:
    """The trace's requests dealt to `urls` in turn, all replayed at once."""
    parts = [trace[i :: len(urls)] for i in range(len(urls))]
    replays = (replay(u, p, MODEL, client="lean") for u, p in zip(urls, parts, strict=True))
    done = await asyncio.gather(*replays)
    return [r for part in done for r in part]


async def killed_midway(
    ferries: Ferries, trace: list[TraceRequest]
) -> tuple[list[SimRequest], dict[str, Any]]:
    """Replay as `spread` does; halfway, kill -9 the lease holder and watch a survivor."""
    async with aiohttp.ClientSession() as session:
        states = [await admin(session, u, "/admin/sharing") for u in ferries.urls]
        victim = next(i for i, s in enumerate(states) if s["holds_lease"])
        dead_name = states[victim]["process"]
        survivors = [u for i, u in enumerate(ferries.urls) if i != victim]
        watcher = survivors[0]
        replaying = asyncio.ensure_future(spread(ferries.urls, trace))
        await asyncio.sleep(trace[len(trace) // 2].arrival_s)
        before = await view(session, watcher, survivors, dead_name)
        ferries.procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        gone_s = lease_s = None
        while (gone_s is None or lease_s is None) and time.monotonic() - killed < 10:
            state = await admin(session, watcher, "/admin/sharing")
            now = time.monotonic() - killed
            if gone_s is None and dead_name not in state["peers"]:
                gone_s = now
            holder = state["lease_holder"]
            if lease_s is None and holder is not None and holder != dead_name:
                lease_s = now
            await asyncio.sleep(0.02)
        after = await view(session, watcher, survivors, dead_name)
        done = await replaying
    sent_to_dead = {t.id for t in trace[victim :: len(ferries.urls)]}
    facts = {
        "dead_ids": sent_to_dead,
        "before": before,
        "after": after,
        "gone_s": gone_s,
        "lease_s": lease_s,
        "failed_dead": sum(1 for r in done if r.finish is None and r.id in sent_to_dead),
        "failed_survivors": sum(1 for r in done if r.finish is None and r.id not in sent_to_dead),
        "sent_dead": len(sent_to_dead),
    }
    return done, facts


async def view(
    session: aiohttp.ClientSession, watcher: str, survivors: list[str], dead: str
) -> dict[str, int]:
    """What a survivor's view holds in flight, the dead process's share of it, and
    what the survivors have in flight themselves (their ledgers)."""
    rows = await admin(session, watcher, "/admin/instances")
    sharing = await admin(session, watcher, "/admin/sharing")
    own = 0
    for url in survivors:
        own += sum(r["local_inflight"] for r in await admin(session, url, "/admin/instances"))
    dead_share = sum(t["inflight"] for t in sharing["peers"].get(dead, {}).values())
    return {"view": sum(r["inflight"] for r in rows), "dead": dead_share, "survivors": own}


async def burst(urls: list[str], engines: int, per_engine: int = 4) -> list[int]:
    """Placement alone, on idle engines: `per_engine` x `engines` long streams in
    0.3 s, dealt to `urls` in turn; each engine's count of them (by the processes'
    own ledgers) 0.8 s after the first. Evenly placed, each engine has `per_engine`."""
    count, window_s = per_engine * engines, 0.3
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            await asyncio.sleep(window_s * i / count)
            body = {"model": MODEL, "prompt": prompt_ids(64, start=i * 37), "max_tokens": 300}
            body |= {"stream": True, "ignore_eos": True}
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(urls[i % len(urls)] + "/v1/completions", json=body) as r:
                    async for _ in r.content:
                        pass

        streams = [asyncio.create_task(one(i)) for i in range(count)]
        await asyncio.sleep(window_s + 0.5)
        placed: dict[str, int] = {}
        for url in urls:
            for row in await admin(session, url, "/admin/instances"):
                placed[row["name"]] = placed.get(row["name"], 0) + row["local_inflight"]
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    return sorted(placed.values(), reverse=True)


def run_setup(
    setup: str, trace: list[TraceRequest], profile_path: Path, redis_url: str, workdir: Path
) -> dict[str, Any]:
    engines = Engines(16, profile_path, stream_interval=2)
    count = 1 if setup == "1 process" else 4
    shared = setup.startswith("4 shared")
    prefix = "bench-" + setup.replace(" ", "").replace(",", "-")
    ferries = None
    try:
        ferries = Ferries(
            engines.urls, count, workdir, redis_url=redis_url if shared else None, prefix=prefix
        )
        time.sleep(1.5)  # first scrapes, and the peers' first records
        facts: dict[str, Any] = {}
        if setup.endswith("kill -9"):
            done, facts = asyncio.run(killed_midway(ferries, trace))
        else:
            done = asyncio.run(spread(ferries.urls, trace))
            facts["burst"] = asyncio.run(burst(ferries.urls, len(engines.urls)))
        summary = summarize(done, {})
        summary["preemptions"] = engines.preemptions()
        summary.update(facts)
        if "dead_ids" in facts:  # the survivors' requests alone, for their TTFT
            kept = [r for r in done if r.id not in facts["dead_ids"]]
            summary["survivors_ttft_p99"] = summarize(kept, {})["ttft_p99"]
        return summary
    finally:
        if ferries is not None:
            ferries.stop()
        engines.stop()


def throughput(redis_url: str, workdir: Path, concurrency: int, requests: int) -> dict[int, float]:
    """Tokens/s through `ferry serve --workers N` for N = 1, 2, 4 (N = 1 shares through
    Redis too, so only the worker count changes)."""
    backends, procs = [], []
    try:
        for _ in range(2):
            port = free_port()
            cmd = [sys.executable, "-m", "loadtest.standin_server", "--port", str(port)]
            cmd += ["--itl-ms", "10"]
            procs.append(subprocess.Popen(_pinned(cmd, ENGINE_CORE), stderr=subprocess.DEVNULL))
            backends.append(f"http://127.0.0.1:{port}")
        for url in backends:
            wait_http(url + "/health", timeout_s=30)
        rates: dict[int, float] = {}
        for workers in (1, 2, 4):
            ferries = Ferries(
                backends, 1, workdir, redis_url=redis_url, prefix=f"tput{workers}", workers=workers
            )
            try:
                time.sleep(1.0)
                result = asyncio.run(
                    run_load(f"{workers} workers", ferries.urls, concurrency, requests, 64)
                )
                rates[workers] = result.tokens_per_s
                print(f"  {workers} workers: {result.tokens_per_s:,.0f} tokens/s", file=sys.stderr)
            finally:
                ferries.stop()
        return rates
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose P99 TTFT is the median (the lower middle one of an even count)."""
    return sorted(runs, key=lambda s: s["ttft_p99"])[(len(runs) - 1) // 2]


def report(
    results: dict[str, dict[str, Any]],
    runs: dict[str, list[dict[str, Any]]],
    rates: dict[int, float],
    what: str,
) -> str:
    lines = [
        what,
        f"{'setup':<20}{'TTFT p50':>9}{'p99':>9}{'vs 1':>7}{'preempt':>9}{'finished':>10}"
        "  p99 of each run",
    ]
    base = results.get("1 process", {}).get("ttft_p99")
    for setup, s in results.items():
        ratio = f"{s['ttft_p99'] / base:.2f}x" if base else "-"
        each = " ".join(f"{r['ttft_p99']:.2f}" for r in runs[setup])
        lines.append(
            f"{setup:<20}{s['ttft_p50']:>8.3f}s{s['ttft_p99']:>8.3f}s{ratio:>7}"
            f"{s['preemptions']:>9}{s['finished']:>6}/{s['requests']:<3}  {each}"
        )
    bursts = {k: s["burst"] for k, s in results.items() if "burst" in s}
    if bursts:
        lines.append(
            "placement alone: 64 streams in 0.3 s on the 16 idle engines (4 each if even);"
            " per engine, most to least (stdev):"
        )
        lines += [f"  {k:<18}{v} ({statistics.pstdev(v):.2f})" for k, v in bursts.items()]
    if base and "4 shared" in results:
        ratio = results["4 shared"]["ttft_p99"] / base
        lines.append(
            f"4 shared: P99 TTFT {ratio:.2f}x the one process's (target <= 1.25x:"
            f" {'met' if ratio <= 1.25 else 'NOT met'})"
        )
    if "4 shared" in results and "4 apart" in results:
        apart = results["4 apart"]["ttft_p99"] / results["4 shared"]["ttft_p99"]
        lines.append(f"not sharing costs: P99 TTFT {apart:.2f}x that of sharing")
    kill = results.get("4 shared, kill -9")
    if kill:
        b, a = kill["before"], kill["after"]
        lines += [
            f"kill -9 of the lease holder at half the trace: {kill['failed_dead']} of the"
            f" {kill['sent_dead']} requests dealt to it failed (its streams, and those sent"
            f" after); the survivors' failed: {kill['failed_survivors']}; their P99 TTFT"
            f" {kill['survivors_ttft_p99']:.3f}s",
            f"  a survivor's view before: {b['view']} in flight, {b['dead']} of them the"
            f" holder's; the survivors' own: {b['survivors']} (read one after another, under load)",
            f"  after: {a['view']} in flight, {a['dead']} the dead process's; the survivors'"
            f" own: {a['survivors']} ("
            + ("no phantom load" if a["dead"] == 0 else "PHANTOM LOAD: the dead one's still counts")
            + ")",
            f"  its totals gone after {_s(kill['gone_s'])} (TTL {TTL_S:g}s); the lease moved"
            f" after {_s(kill['lease_s'])} (lease TTL {LEASE_TTL_S:g}s)",
        ]
    if rates:
        one = rates[1]
        cells = ", ".join(f"{n}: {r:,.0f} tokens/s ({r / one:.2f}x)" for n, r in rates.items())
        lines.append(f"throughput by --workers N on core {FERRY_CORE} with the client: {cells}")
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "never (>10s)" if value is None else f"{value:.2f}s"


def _pinned(cmd: list[str], core: int) -> list[str]:
    return ["taskset", "-c", str(core), *cmd] if _two_cores() else cmd


def _two_cores() -> bool:
    return len(os.sched_getaffinity(0)) >= 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=18.0, help="requests/s, on average")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--input-mean", type=float, default=64)
    parser.add_argument("--output-mean", type=float, default=128)
    parser.add_argument("--max-len", type=int, default=384, help="clamp of each length")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--concurrency", type=int, default=100, help="throughput streams")
    parser.add_argument("--tput-requests", type=int, default=1000, help="throughput requests")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every setup")
    args = parser.parse_args()
    # One warning per request the kill breaks would bury the report.
    logging.getLogger("loadtest.replay").setLevel(logging.ERROR)
    if _two_cores():
        os.sched_setaffinity(0, {FERRY_CORE})  # the client; Ferry and Redis inherit it
    else:
        print("warning: fewer than 2 cores: nothing is pinned", file=sys.stderr)
    profile = DEFAULT_PROFILE
    trace = make_trace(args, profile.kv_blocks * profile.block_size - 1)
    span = trace[-1].arrival_s if trace else 0.0
    runs: dict[str, list[dict[str, Any]]] = {}
    rates: dict[int, float] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        port = free_port()
        redis = start_redis(port, workdir)
        redis_url = f"redis://127.0.0.1:{port}/0"
        try:
            profile_path = workdir / "profile.json"
            save(profile, profile_path)
            # Rounds of every setup in turn, so that a noisy minute on this shared
            # machine hits each setup alike; each setup's median run is reported.
            for _ in range(args.repeat):
                for setup in args.setups:
                    started = time.monotonic()
                    s = run_setup(setup, trace, profile_path, redis_url, workdir)
                    runs.setdefault(setup, []).append(s)
                    print(
                        f"  {setup}: P99 TTFT {s['ttft_p99']:.3f}s, {s['finished']}/"
                        f"{s['requests']} finished ({time.monotonic() - started:.0f}s)",
                        file=sys.stderr,
                    )
            if not args.no_throughput:
                rates = throughput(redis_url, workdir, args.concurrency, args.tput_requests)
        finally:
            redis.terminate()
            redis.wait(10)
    results = {setup: median_run(r) for setup, r in runs.items()}
    what = (
        f"\n{args.requests} requests over {span:.0f}s (gamma CV 3, {args.rate}/s, lognormal"
        f" lengths: prompt mean {args.input_mean:g}, output mean {args.output_mean:g}), 16"
        f" paged stand-in engines (not vLLM) on core {ENGINE_CORE}; Ferry, Redis and the"
        f" client on core {FERRY_CORE} ({os.cpu_count()} cores in all, shared with whatever"
        f" else runs here: load average {load_before:.1f} before, {os.getloadavg()[0]:.1f}"
        f" after); the median of {args.repeat} run(s) per setup:"
    )
    print(report(results, runs, rates, what))
    return 0


if __name__ == "__main__":
    sys.exit(main())
