"""Migration downtime against sequence length, every way Ferry can move a request.

Two real vLLM CPU servers with migration_shim (one per core, float32 tiny model,
max length 2048) behind Ferry, run once per way of moving:
- lite: recompute P + G on the destination;
- lite + pre-warm: the destination's prefix cache is filled first;
- full, stop-and-copy: the KV moves in one stage after the source stops;
- full, pre-copy: the KV moves in stages while the source decodes, then the rest.
For each prompt length a greedy stream starts; after 16 tokens its instance is
drained with `migrate=true`. The client records the downtime (the longest gap
between two tokens after the drain call), the total migration time (from the
drain call to the end of that gap) and the stream's median inter-token gap.

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

from loadtest.ferry_process import wait_healthy
from loadtest.tiny_model import build
from loadtest.vllm_servers import start_vllm, stop_on_sigterm, wait_ready
from migration_shim.launcher import free_port
from proxy.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench"
MAX_LEN = 2048
AFTER = 64  # tokens generated after the prompt
_fresh = random.Random(0)


# name -> (instance migration mode, pre-warm, pre-copy stages)
WAYS = {
    "lite": ("lite", False, 0),
    "lite+prewarm": ("lite", True, 0),
    "full stop&copy": ("full", False, 0),
    "full pre-copy": ("full", False, 3),
}


def ferry_yaml(urls: list[str], port: int, way: str) -> str:
    mode, prewarm, stages = WAYS[way]
    lines = ["instances:"]
    for i, url in enumerate(urls):
        lines += [f"  - name: v{i}", f"    url: {url}", f"    migration: {mode}"]
    lines += [
        "scheduler:",
        f"  migration_prewarm: {str(prewarm).lower()}",
        f"  migration_full_max_stages: {stages}",
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


def one_move(url: str, length: int) -> tuple[float, float, float]:
    """(cut-over gap, total migration time, median gap before the drain) in
    seconds for one moved stream.

    Gaps are between chunks that carry tokens (counted by id: a slow reader may
    get two tokens in one chunk)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    # A prompt never seen before: a prefix-cache hit would hide the recompute.
    prompt = [_fresh.randrange(10, 300) for _ in range(length)]
    stamps: list[float] = []
    tokens = 0
    drained_at = 0
    drain_called = 0.0
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
            drain_called = time.perf_counter()
            admin(url, f"/admin/instances/{source}/drain?migrate=true", "POST")
    client.close()
    assert source is not None and tokens == AFTER, tokens
    admin(url, f"/admin/instances/{source}/undrain", "POST")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    after = gaps[drained_at - 1 :]
    worst = max(range(len(after)), key=after.__getitem__)
    resumed_at = stamps[drained_at + worst]  # the first token after the longest gap
    return after[worst], resumed_at - drain_called, statistics.median(gaps[: drained_at - 1])


Results = dict[str, dict[int, tuple[float, float, float]]]


def measure(urls: list[str], ways: list[str], lengths: list[int], trials: int) -> Results:
    """Run Ferry once per way in front of `urls`; the medians of `one_move`."""
    results: Results = {}
    for way in ways:
        port = free_port()
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(ferry_yaml(urls, port, way))
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
            results[way] = {}
            for length in lengths:
                runs = [one_move(url, length) for _ in range(trials)]
                results[way][length] = (
                    statistics.median(r[0] for r in runs),
                    statistics.median(r[1] for r in runs),
                    statistics.median(r[2] for r in runs),
                )
                print(
                    f"  {way} length={length}: gap {1e3 * results[way][length][0]:.1f} ms",
                    file=sys.stderr,
                )
        finally:
            proc.terminate()
            proc.wait(10)
    return results


def report(results: Results, lengths: list[int], trials: int, where: str) -> None:
    ways = list(results)
    print(f"\nmigration downtime / total migration time, ms (median of {trials}), {where}:")
    print(f"{'prompt':>7} {'ITL':>6} " + " ".join(f"{w:>18}" for w in ways))
    for length in lengths:
        itl = results[ways[0]][length][2]
        cells = [
            f"{1e3 * results[w][length][0]:>7.1f} / {1e3 * results[w][length][1]:>7.1f}"
            for w in ways
        ]
        print(f"{length:>7} {1e3 * itl:>6.1f} " + " ".join(f"{c:>18}" for c in cells))
    for way in ways:
        gaps = [results[way][n][0] for n in lengths]
        print(f"{way}: longest / shortest downtime {max(gaps) / min(gaps):.2f}x")
    if "full pre-copy" in results and "lite" in results:
        itl = statistics.median(results[w][n][2] for w in ways for n in lengths)
        full = max(results["full pre-copy"][n][0] for n in lengths)
        lite = [results["lite"][n][0] / results["full pre-copy"][n][0] for n in lengths]
        print(
            f"full pre-copy: worst downtime {full / itl:.1f} decode steps (target: below 2);"
            f" lite / full downtime {min(lite):.2f}x to {max(lite):.2f}x"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,1024,1900")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    work = ROOT / ".ferry"
    model = build(work / "tiny-llama")
    servers = [
        start_vllm(
            model,
            free_port(),
            work / "logs",
            kv_cache_bytes=64_000_000,
            max_model_len=MAX_LEN,
            cpus=str(i),
            shim_kv_port=free_port(),
        )
        for i in range(2)
    ]
    try:
        wait_ready(servers)
        results = measure([s.url for s in servers], list(WAYS), lengths, args.trials)
    finally:
        for s in servers:
            s.stop()
    report(results, lengths, args.trials, "tiny model on vLLM CPU")
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
