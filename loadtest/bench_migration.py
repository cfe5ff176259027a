"""Lite-migration downtime: the gap in the client's stream at the cut-over.

Two real vLLM CPU servers (one per core, float32 tiny model, max length 2048)
behind Ferry with `migration: lite`. For each prompt length, a greedy stream
starts; after 16 tokens its instance is drained with `migrate=true`; the client
records the longest gap between two tokens after the drain call, next to the
stream's median inter-token gap. Runs with and without pre-warm, side by side.

    python -m loadtest.bench_migration [--lengths 128,512,1024,1900] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from loadtest.demo import wait_healthy
from loadtest.tiny_model import build
from loadtest.vllm_servers import start_vllm, wait_ready
from proxy.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench"
MAX_LEN = 2048
AFTER = 64  # tokens generated after the prompt
_fresh = random.Random(0)


def ferry_yaml(urls: list[str], port: int, prewarm: bool) -> str:
    lines = ["instances:"]
    for i, url in enumerate(urls):
        lines += [f"  - name: v{i}", f"    url: {url}", "    migration: lite"]
    lines += [
        "scheduler:",
        f"  migration_prewarm: {str(prewarm).lower()}",
        "  seed: 1",
        "server:",
        f"  port: {port}",
        f"admin_token: {TOKEN}",
    ]
    return "\n".join(lines) + "\n"


def admin(url: str, path: str, method: str = "GET") -> bytes:
    request = urllib.request.Request(
        url + path,
        method=method,
        data=b"" if method == "POST" else None,
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return resp.read()


def one_move(url: str, length: int) -> tuple[float, float]:
    """(cut-over gap, median gap before it) in seconds for one moved stream.

    Gaps are between chunks that carry tokens (counted by id: a slow reader may
    get two tokens in one chunk)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    # A prompt never seen before: a prefix-cache hit would hide the recompute.
    prompt = [_fresh.randrange(10, 300) for _ in range(length)]
    stamps: list[float] = []
    tokens = 0
    drained_at = 0
    source = None
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=AFTER,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        ids = (chunk.choices[0].model_extra or {}).get("token_ids") if chunk.choices else None
        if not ids:
            continue
        stamps.append(time.perf_counter())
        tokens += len(ids)
        if tokens >= 16 and source is None:
            rows = json.loads(admin(url, "/admin/instances"))
            source = next(r["name"] for r in rows if r["inflight"])
            drained_at = len(stamps)
            admin(url, f"/admin/instances/{source}/drain?migrate=true", "POST")
    client.close()
    assert source is not None and tokens == AFTER, tokens
    admin(url, f"/admin/instances/{source}/undrain", "POST")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return max(gaps[drained_at - 1 :]), statistics.median(gaps[: drained_at - 1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,1024,1900")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    work = ROOT / ".ferry"
    model = build(work / "tiny-llama")
    from tests.helpers import free_port  # the one place that picks free ports

    servers = [
        start_vllm(
            model,
            free_port(),
            work / "logs",
            kv_cache_bytes=64_000_000,
            max_model_len=MAX_LEN,
            cpus=str(i),
        )
        for i in range(2)
    ]
    results: dict[bool, dict[int, tuple[float, float]]] = {}
    try:
        wait_ready(servers)
        for prewarm in (False, True):
            port = free_port()
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                f.write(ferry_yaml([s.url for s in servers], port, prewarm))
            load_config(f.name)  # fail early on a bad file
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "proxy.cli",
                    "serve",
                    "--config",
                    f.name,
                    "--log-level",
                    "WARNING",
                ]
            )
            url = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(url)
                one_move(url, 64)  # warm-up
                results[prewarm] = {}
                for length in lengths:
                    runs = [one_move(url, length) for _ in range(args.trials)]
                    results[prewarm][length] = (
                        statistics.median(r[0] for r in runs),
                        statistics.median(r[1] for r in runs),
                    )
                    print(
                        f"  prewarm={prewarm} length={length}: gap "
                        f"{1e3 * results[prewarm][length][0]:.1f} ms",
                        file=sys.stderr,
                    )
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        for s in servers:
            s.stop()
    print(f"\nlite migration downtime (median of {args.trials}), tiny model on vLLM CPU:")
    print(f"{'prompt':>7} {'normal ITL':>11} {'no pre-warm':>12} {'pre-warm':>10} {'ratio':>7}")
    for length in lengths:
        cold, itl = results[False][length]
        warm, _ = results[True][length]
        print(
            f"{length:>7} {1e3 * itl:>9.1f}ms {1e3 * cold:>10.1f}ms {1e3 * warm:>8.1f}ms"
            f" {cold / warm:>6.2f}x"
        )
    warm_first, warm_last = results[True][lengths[0]][0], results[True][lengths[-1]][0]
    print(
        f"\nwith pre-warm, longest / shortest downtime: {warm_last / warm_first:.2f}x"
        " (target: within 2x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
