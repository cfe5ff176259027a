"""Full-mode migration on a GPU: the correctness check and the downtime table, in one go.

For a machine with an NVIDIA GPU and the GPU build of vLLM 0.32.0 installed (the
device machine lent to some sessions; it has no network, so nothing is
installed here). Two vLLM servers share the GPU, both with migration_shim on,
behind Ferry with `migration: full`:
1. a greedy stream moved mid-way must give exactly the tokens of an unmoved run,
   and the destination must count the moved tokens as `external_kv_transfer`;
2. downtime and total migration time against sequence length, lite vs full
   (the same measurement as `loadtest.bench_migration`).
It stays under 8 minutes (two server starts, ~2 minutes of measuring) and
writes its figures to $OUT/gpu_check.json when OUT is set.

    python -m loadtest.gpu_check [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from loadtest import bench_migration
from loadtest.ferry_process import wait_healthy
from loadtest.tiny_model import build
from loadtest.vllm_servers import metric, start_vllm, wait_ready
from migration_shim import wire
from migration_shim.launcher import free_port

ROOT = Path(__file__).resolve().parent.parent
EXTERNAL = (
    'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"}'
)


def preflight() -> str | None:
    """Why this machine cannot run the check, or None."""
    try:
        import torch
        import vllm
    except ImportError as exc:
        return f"vLLM is not installed: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if vllm.__version__.split("+")[0] not in wire.SUPPORTED_VLLM:
        return f"vLLM {vllm.__version__}; the shim supports {', '.join(wire.SUPPORTED_VLLM)}"
    return None


def greedy(
    url: str, prompt: list[int], max_tokens: int, at: int = 0, then: Any = None
) -> list[int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    ids: list[int] = []
    for chunk in client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ):
        before = len(ids)
        ids.extend(
            (chunk.choices[0].model_extra or {}).get("token_ids") or [] if chunk.choices else []
        )
        if then is not None and before < at <= len(ids):
            then()
    client.close()
    return ids


def correctness(urls: list[str]) -> dict[str, Any]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(bench_migration.ferry_yaml(urls, port, "full pre-copy"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", f.name, "--log-level", "INFO"]
    )
    ferry = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(ferry)
        prompt = [(7 * i) % 300 + 10 for i in range(300)]
        reference = greedy(urls[0], prompt, 600)
        bench_migration.admin(ferry, "/admin/instances/v1/drain", "POST")  # start on v0

        def undrain_v1() -> None:
            bench_migration.admin(ferry, "/admin/instances/v1/undrain", "POST")
            bench_migration.admin(ferry, "/admin/instances/v0/drain?migrate=true", "POST")

        before = metric(urls[1], EXTERNAL)
        moved = greedy(ferry, prompt, 600, at=200, then=undrain_v1)
        loaded = metric(urls[1], EXTERNAL) - before
        bench_migration.admin(ferry, "/admin/instances/v0/undrain", "POST")
    finally:
        proc.terminate()
        proc.wait(10)
    first_diff = next(
        (i for i, (a, b) in enumerate(zip(moved, reference, strict=False)) if a != b), None
    )
    return {
        "token_exact": moved == reference,
        "first_difference": first_diff,
        "tokens": len(moved),
        "destination_external_kv_transfer_tokens": loaded,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--lengths", default="128,512,1024,1900")
    args = parser.parse_args()
    why = preflight()
    if why is not None:
        print(f"gpu_check: cannot run here: {why}", file=sys.stderr)
        return 2
    started = time.monotonic()
    model = build(ROOT / ".ferry" / "tiny-llama")
    servers = [
        start_vllm(
            model,
            free_port(),
            ROOT / ".ferry" / "logs",
            kv_cache_bytes=256_000_000,
            max_model_len=bench_migration.MAX_LEN,
            dtype="float16",  # GPU attention kernels do not all take float32
            cpus=None,
            extra_args=("--gpu-memory-utilization", "0.3", "--enforce-eager"),
            shim_kv_port=free_port(),
        )
        for _ in range(2)
    ]
    lengths = [int(x) for x in args.lengths.split(",")]
    try:
        wait_ready(servers, timeout_s=300)
        urls = [s.url for s in servers]
        check = correctness(urls)
        print(f"correctness: {json.dumps(check)}")
        ways = ["lite", "lite+prewarm", "full pre-copy"]
        results = bench_migration.measure(urls, ways, lengths, args.trials)
    finally:
        for s in servers:
            s.stop()
    bench_migration.report(results, lengths, args.trials, "tiny model on vLLM GPU")
    summary = {
        "correctness": check,
        "downtime_ms": {w: {n: 1e3 * r[n][0] for n in lengths} for w, r in results.items()},
        "total_ms": {w: {n: 1e3 * r[n][1] for n in lengths} for w, r in results.items()},
        "seconds": round(time.monotonic() - started, 1),
    }
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(summary, indent=2))
    return 0 if check["token_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
