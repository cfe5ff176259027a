"""`make demo`: two real vLLM CPU servers behind Ferry, a short mixed workload.

Builds the tiny local model, starts the two servers of `configs/demo.yaml`
(pinned to core 0), starts `ferry serve --config configs/demo.yaml`, sends a
seeded mix of completions and chat, streaming and not, short and long, some at
high priority, then prints what each instance got and the TTFT the client saw.
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai

from loadtest.tiny_model import build
from loadtest.vllm_servers import VLLMServer, start_vllm, wait_ready
from proxy.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo.yaml"
WORK = ROOT / ".ferry"
REQUESTS = 40
RATE_PER_S = 6.0
WORDS = ["load", "balance", "cache", "token", "quick", "brown", "fox", "scheduler"]


async def one(client: openai.AsyncOpenAI, rng: random.Random) -> float | None:
    """Send one request of a random kind; return the client's TTFT if it streamed."""
    long = rng.random() < 0.25
    max_tokens = rng.randint(200, 600) if long else rng.randint(8, 64)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120)))
    priority = "high" if rng.random() < 0.1 else "normal"
    chat, stream = rng.random() < 0.5, rng.random() < 0.7
    args: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "extra_headers": {"x-ferry-priority": priority},
        "extra_body": {"ignore_eos": True},
    }
    create = client.chat.completions.create if chat else client.completions.create
    if chat:
        args["messages"] = [{"role": "user", "content": prompt}]
    else:
        args["prompt"] = prompt
    started = time.perf_counter()
    if not stream:
        await create(**args)
        return None
    ttft = None
    async for chunk in await create(stream=True, **args):
        if ttft is None and chunk.choices:
            choice = chunk.choices[0]
            text = choice.delta.content if chat else choice.text
            if text or choice.finish_reason:
                ttft = time.perf_counter() - started
    return ttft


async def workload(url: str) -> list[float]:
    rng = random.Random(7)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="demo", max_retries=0, timeout=300)
    tasks = []
    for _ in range(REQUESTS):
        tasks.append(asyncio.create_task(one(client, random.Random(rng.random()))))
        await asyncio.sleep(rng.expovariate(RATE_PER_S))
    ttfts = [t for t in await asyncio.gather(*tasks) if t is not None]
    await client.close()
    return ttfts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def dispatch_counts(metrics_text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, outcome, value in re.findall(
        r'ferry_requests_total\{instance="([^"]+)",outcome="([^"]+)"\} ([0-9.e+]+)', metrics_text
    ):
        counts[f"{name} ({outcome})"] = int(float(value))
    return counts


def get(url: str, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
        return resp.read().decode()


def wait_healthy(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            get(url + "/health")
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"ferry at {url} did not become healthy")


def main() -> int:
    config = load_config(CONFIG)
    model = build(WORK / "tiny-llama")
    servers: list[VLLMServer] = []
    ferry: subprocess.Popen[bytes] | None = None
    try:
        print(f"starting {len(config.instances)} vLLM CPU servers (about a minute)...", flush=True)
        for inst in config.instances:
            port = urlsplit(inst.url).port or 80
            servers.append(start_vllm(model, port, WORK / "logs", kv_cache_bytes=8_000_000))
        wait_ready(servers)
        url = f"http://{config.server.host}:{config.server.port}"
        ferry = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy.cli",
                "serve",
                "--config",
                str(CONFIG),
                "--log-level",
                "WARNING",
            ]
        )
        wait_healthy(url)
        print(f"ferry is up at {url}; sending {REQUESTS} requests at {RATE_PER_S}/s...", flush=True)
        started = time.perf_counter()
        ttfts = asyncio.run(workload(url))
        elapsed = time.perf_counter() - started
        print(f"\ndone in {elapsed:.1f}s\n\nrequests per instance (outcome):")
        for key, count in sorted(dispatch_counts(get(url + "/metrics")).items()):
            print(f"  {key:<24} {count}")
        p50, p99 = 1000 * percentile(ttfts, 50), 1000 * percentile(ttfts, 99)
        print(f"\nclient TTFT over {len(ttfts)} streams: P50 {p50:.0f} ms, P99 {p99:.0f} ms\n")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "proxy.cli",
                "status",
                "--url",
                url,
                "--admin-token",
                config.admin_token or "",
            ],
            check=False,
        )
        return 0
    finally:
        if ferry is not None:
            ferry.terminate()
            ferry.wait(10)
        for server in servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
