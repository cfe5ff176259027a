"""`make demo`: what sets Ferry apart, on two real vLLM CPU servers.

The same seeded, bursty, heavy-tailed workload runs twice through Ferry: once
with `round_robin` (what nginx and vllm-router do by default), once with
`llumnix` and lite migration, rebalancing as it goes (a stream whose engine
preempted it, or that is about to be, moves to the other). At the same point of each run the busiest
instance is drained with `ferry drain` while streams run on it, as an operator
taking it out for maintenance would: with round_robin (no migration, like nginx
or vllm-router) the drain waits until its streams end; with llumnix each moves
to the other instance as soon as that has room for it, and every stream finishes
with every token. The demo prints both runs
side by side (TTFT, worst stall, the engines' own preemption counters, how long
the drain took), what the drain moved, and draws TTFT over time for both runs
with the drains marked.

`python -m loadtest.demo --short` runs a smaller workload (the test does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import yaml

from adapters.vllm import parse_metrics
from loadtest.ferry_process import ferry_command, wait_healthy
from loadtest.tiny_model import build
from loadtest.vllm_servers import VLLMServer, start_vllm, stop_on_sigterm, wait_ready
from proxy.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo.yaml"
WORK = ROOT / ".ferry"
KV_CACHE_BYTES = 4_000_000  # ~2,000 tokens of the tiny model per server: KV pressure is real
MAX_MODEL_LEN = 1024  # the servers' context: a longer prompt leaves fewer tokens to generate
WORDS = ["load", "balance", "cache", "token", "quick", "brown", "fox", "scheduler"]


@dataclass(frozen=True)
class Workload:
    requests: int = 45
    rate_per_s: float = 1.5
    burstiness_cv: float = 3.0  # Gamma inter-arrivals: bursts, then quiet
    # Fraction of the requests sent when the drain starts (in both runs): late,
    # so that the comparison is mostly of placement, with streams still running.
    drain_at: float = 0.8
    seed: int = 7
    min_tokens: int = 8  # the shortest answer


# Fewer streams, each long enough to outlast a move's pre-warm (up to a second):
# a drain then has streams to move, not streams that end before their turn.
SHORT = Workload(requests=16, rate_per_s=3.0, drain_at=0.5, min_tokens=300)


@dataclass
class Stream:
    sent_at: float  # seconds since the run started
    max_tokens: int
    prompt_tokens: int = 0  # as the engine counted them, in the first chunk
    ttft: float | None = None
    worst_stall: float = 0.0  # the longest gap between two tokens
    tokens: int = 0

    @property
    def expected(self) -> int:
        """max_tokens, or fewer when the prompt leaves less of the context."""
        return min(self.max_tokens, MAX_MODEL_LEN - self.prompt_tokens)


@dataclass
class Run:
    policy: str
    streams: list[Stream] = field(default_factory=list)
    preemptions: int = 0
    drained_at: float | None = None
    drain: dict[str, Any] = field(default_factory=dict)  # instance, inflight, took_s, moves

    @property
    def ttfts(self) -> list[float]:
        return [s.ttft for s in self.streams if s.ttft is not None]

    @property
    def complete(self) -> int:
        return sum(1 for s in self.streams if s.tokens == s.expected)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def request_specs(workload: Workload) -> list[tuple[float, int, int]]:
    """(gap before it, prompt words, max tokens) per request: the same every run."""
    rng = random.Random(workload.seed)
    shape = 1.0 / workload.burstiness_cv**2
    specs = []
    for _ in range(workload.requests):
        gap = rng.gammavariate(shape, 1.0 / (workload.rate_per_s * shape))
        # Heavy tails: most answers are short, a few are long and hold KV for long.
        max_tokens = min(800, max(workload.min_tokens, int(rng.lognormvariate(4.3, 1.0))))
        specs.append((gap, rng.randint(10, 300), max_tokens))
    return specs


async def one(
    client: openai.AsyncOpenAI, words: int, max_tokens: int, stream: Stream, salt: str
) -> None:
    rng = random.Random(words * 1000 + max_tokens)
    # The salt keeps one run's prompts out of the prefix cache the other left.
    prompt = salt + " " + " ".join(rng.choice(WORDS) for _ in range(words))
    started = last = time.perf_counter()
    chunks = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in chunks:
        if not chunk.choices:
            continue
        prompt_ids = getattr(chunk.choices[0], "prompt_token_ids", None)
        if prompt_ids and not stream.prompt_tokens:  # the first chunk's, not a later one's
            stream.prompt_tokens = len(prompt_ids)
        ids = getattr(chunk.choices[0], "token_ids", None) or []
        if not ids:
            continue
        now = time.perf_counter()
        if stream.ttft is None:
            stream.ttft = now - started
        else:
            stream.worst_stall = max(stream.worst_stall, now - last)
        last = now
        stream.tokens += len(ids)


async def workload_run(
    url: str, workload: Workload, run: Run, salt: str, drain: Any | None = None
) -> None:
    """Send the workload, its prompts led by `salt`; call `drain(run)` in a thread
    once `drain_at` of it is sent."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="demo", max_retries=0, timeout=600)
    started = time.perf_counter()
    tasks, drainer = [], None
    for i, (gap, words, max_tokens) in enumerate(request_specs(workload)):
        await asyncio.sleep(gap)
        if drain is not None and drainer is None and i >= workload.drain_at * workload.requests:
            run.drained_at = time.perf_counter() - started
            drainer = asyncio.create_task(asyncio.to_thread(drain, run))
        stream = Stream(time.perf_counter() - started, max_tokens)
        run.streams.append(stream)
        tasks.append(asyncio.create_task(one(client, words, max_tokens, stream, salt)))
    await asyncio.gather(*tasks)
    if drainer is not None:
        await drainer
    await client.close()


def get(url: str, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
        return str(resp.read().decode())


def preemptions(urls: list[str]) -> int:
    return sum(parse_metrics(get(u + "/metrics")).preemptions_total for u in urls)


def write_config(path: Path, urls: list[str], policy: str, port: int) -> str:
    """configs/demo.yaml (the llumnix run, as we would run Ferry: rebalancing by
    lite moves) for servers `urls` on `port`; for round_robin, as nginx or
    vllm-router would run: no moves. Returns the admin token."""
    config = yaml.safe_load(CONFIG.read_text())
    named = config["instances"]
    config["instances"] = [
        {**named[i % len(named)], "name": f"vllm-{chr(ord('a') + i)}", "url": url}
        for i, url in enumerate(urls)
    ]
    config["server"]["port"] = port
    if policy == "round_robin":
        config["scheduler"]["policy"] = policy
        config["scheduler"].pop("rebalance_interval_s", None)
        for instance in config["instances"]:
            instance["migration"] = "off"
    path.write_text(json.dumps(config, indent=2))
    return str(config["admin_token"])


def run_once(
    urls: list[str], policy: str, workload: Workload, work: Path, port: int, salt: str
) -> Run:
    """One run of the workload through a fresh `ferry serve` with `policy`, with a
    drain of the busiest instance once `workload.drain_at` of it is sent."""
    config = work / f"demo-{policy}.yaml"
    token = write_config(config, urls, policy, port)
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        ferry_command("serve", "--config", str(config), "--log-level", "WARNING")
    )
    run = Run(policy)
    try:
        wait_healthy(url, proc, path="/readyz")
        before = preemptions(urls)
        admin = ["--url", url, "--admin-token", token]

        def drain_busiest(run: Run) -> None:
            deadline = time.monotonic() + 10
            while True:  # the drain is worth showing with streams to move
                rows = json.loads(get(url + "/admin/instances", token))
                busiest = max(rows, key=lambda r: r["inflight"])
                if busiest["inflight"] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            run.drain = {"instance": busiest["name"], "inflight": busiest["inflight"]}
            started = time.perf_counter()
            done = subprocess.run(  # returns once the instance is empty
                ferry_command("drain", busiest["name"], *admin), capture_output=True, text=True
            )
            run.drain["took_s"] = time.perf_counter() - started
            run.drain["output"] = done.stdout.strip()
            subprocess.run(ferry_command("undrain", busiest["name"], *admin), capture_output=True)

        asyncio.run(workload_run(url, workload, run, salt, drain_busiest))
        run.preemptions = preemptions(urls) - before
        run.drain.update(migration_figures(get(url + "/metrics")))
        return run
    finally:
        proc.terminate()
        proc.wait(15)


def migration_figures(metrics_text: str) -> dict[str, float]:
    """Moves the drain and the rebalancing made, and the downtime of those that
    paused a stream (one that had streamed), from Ferry's own metrics."""
    figures = {"moved": 0.0, "rebalanced": 0.0, "downtime_sum": 0.0, "downtime_count": 0.0}
    for line in metrics_text.splitlines():
        if line.startswith('ferry_migrations_total{outcome="ok",reason="drain"}'):
            figures["moved"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith('ferry_migrations_total{outcome="ok",reason="rebalance"}'):
            figures["rebalanced"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("ferry_migration_downtime_seconds_sum"):
            figures["downtime_sum"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("ferry_migration_downtime_seconds_count"):
            figures["downtime_count"] = float(line.rsplit(" ", 1)[1])
    return figures


def report(runs: list[Run]) -> str:
    """Both runs side by side, one line per figure saying what it means."""
    ms = 1000.0
    rows = [
        ("P50 TTFT (ms)", lambda r: quantile(r.ttfts, 0.5) * ms, "half the streams waited less"),
        ("P99 TTFT (ms)", lambda r: quantile(r.ttfts, 0.99) * ms, "the tail a user feels"),
        (
            "P99 worst stall (ms)",
            lambda r: quantile([s.worst_stall for s in r.streams], 0.99) * ms,
            "longest pause inside a stream",
        ),
        ("preemptions", lambda r: r.preemptions, "the engines' own count of evicted KV"),
        (
            "drain took (ms)",
            lambda r: r.drain.get("took_s", 0.0) * ms,
            "until the drained instance was empty: streams moved, or waited out",
        ),
    ]
    names = [r.policy for r in runs]
    lines = [f"{'':<22}" + "".join(f"{n:>14}" for n in names)]
    for label, value, meaning in rows:
        lines.append(f"{label:<22}" + "".join(f"{value(r):>14.0f}" for r in runs) + f"   {meaning}")
    lines.append(
        f"{'streams complete':<22}"
        + "".join(f"{f'{r.complete}/{len(r.streams)}':>14}" for r in runs)
        + "   every token of every stream arrived"
    )
    return "\n".join(lines)


def drain_report(run: Run) -> str:
    d = run.drain
    count = d.get("downtime_count", 0.0)
    # Downtime is a pause inside a stream: moves of requests still waiting for
    # their first token have none (their wait is TTFT).
    pause = (
        f"{count:.0f} of them streaming, mean downtime "
        f"{1000 * d.get('downtime_sum', 0.0) / count:.0f} ms"
        if count
        else "none of them streaming yet"
    )
    return (
        f"drain of {d.get('instance')} at t={run.drained_at:.1f}s with {d.get('inflight')} in "
        f"flight: {d.get('moved', 0):.0f} streams moved; rebalancing moved "
        f"{d.get('rebalanced', 0):.0f} more ({pause}); "
        f"{run.complete}/{len(run.streams)} streams of this run finished with all their tokens"
    )


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (run, marker) in enumerate(zip(runs, ("o", "s"), strict=True)):
        points = sorted((s.sent_at, s.ttft) for s in run.streams if s.ttft is not None)
        [line] = ax.plot(
            [p[0] for p in points], [p[1] for p in points], marker, label=run.policy, ms=4
        )
        if run.drained_at is not None:
            ax.axvline(run.drained_at, color=line.get_color(), ls="--")
            ax.annotate(
                f" drain ({run.policy})",
                (run.drained_at, ax.get_ylim()[1] * 0.5**i),  # one under the other
                va="top",
                color=line.get_color(),
            )
    ax.set_xlabel("request sent at (s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("TTFT over time, same workload: round_robin vs llumnix (drains marked)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def demo(urls: list[str], workload: Workload, work: Path, port: int) -> tuple[list[Run], Path]:
    """Run both policies on servers at `urls`; print the comparison; return runs and the PNG."""
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for index, policy in enumerate(("round_robin", "llumnix")):
        print(f"running {workload.requests} streams through ferry ({policy})...", flush=True)
        runs.append(run_once(urls, policy, workload, work, port, f"run {index + 1}:"))
    png = work / "demo-ttft.png"
    plot(runs, png)
    print()
    print(report(runs))
    print()
    print(drain_report(runs[1]))
    print(f"\nTTFT over time: {png}")
    return runs, png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--short", action="store_true", help="a smaller workload")
    args = parser.parse_args(argv)
    config = load_config(CONFIG)
    model = build(WORK / "tiny-llama")
    servers: list[VLLMServer] = []
    try:
        print(f"starting {len(config.instances)} vLLM CPU servers (about a minute)...", flush=True)
        for inst in config.instances:
            port = urlsplit(inst.url).port or 80
            servers.append(
                start_vllm(
                    model,
                    port,
                    WORK / "logs",
                    kv_cache_bytes=KV_CACHE_BYTES,
                    max_model_len=MAX_MODEL_LEN,
                )
            )
        wait_ready(servers)
        demo(
            [s.url for s in servers],
            SHORT if args.short else Workload(),
            WORK,
            config.server.port,
        )
        return 0
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
