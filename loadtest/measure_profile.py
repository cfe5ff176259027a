"""Measure a real vLLM server's performance profile for the cluster simulator.

The simulator models an engine step as `step_base_s + step_per_token_s * prefill tokens
+ step_per_seq_s * decoding requests`,
tokens = prefill tokens + decoding requests in the step (`loadtest/sim/profile.py`).
This module measures points of that line on a live, otherwise idle server and
fits it by least squares:

- decode: b concurrent streams of short prompts decode in lockstep, so the time
  per token in the middle of the streams is the step time at b tokens;
- prefill: single requests with `max_tokens=1`: TTFT minus the fixed request
  overhead (TTFT of an 8-token prompt minus one decode step) is the step time
  at P tokens;
- cached prefill (when the server caches prefixes): a prompt of C tokens is sent
  once, then again with CACHED_NEW fresh tokens after it; what the second
  request's step takes beyond computing those is the cost of C cached tokens.

Every prompt is a fresh random list of token ids so that prefix caching never
turns a prefill into a cache hit. KV capacity and block size come from the
server's `/metrics`; the batch limits are vLLM's CPU defaults (override them
with the flags if the server was started with others).

    python -m loadtest.measure_profile --url http://127.0.0.1:8001 --out profile.json [--model tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import openai

from adapters import MetricsParseError
from adapters.vllm import parse_metrics
from loadtest.replay import chunk_tokens
from loadtest.sim import profile as profiles
from loadtest.sim.profile import Profile
from loadtest.vllm_servers import metric, stop_on_sigterm

PREFIX_HITS = "vllm:prefix_cache_hits_total"

DECODE_BATCHES = (1, 2, 4, 8)
DECODE_PROMPT = 32
DECODE_TOKENS = 90  # prompt + output fit one 128-token CPU block: no KV pressure
PREFILL_LENGTHS = (64, 256, 512, 900)
CACHED_BLOCKS = (3, 6)  # cached prefixes, in KV blocks (whole blocks are what vLLM caches)
CACHED_NEW = 64  # fresh tokens after a cached prefix
OVERHEAD_PROMPT = 8
REPEATS = 3
# vLLM 0.32 defaults on CPU for the OpenAI server (engine/arg_utils.py,
# `get_batch_defaults`): max_num_batched_tokens 2048, max_num_seqs 128.
CPU_MAX_BATCHED_TOKENS = 2048
CPU_MAX_NUM_SEQS = 128
# The tiny test model in float32: 2 layers x 2 KV heads x 64 x (K, V) x 4 bytes.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2 * 4


@dataclass(frozen=True, slots=True)
class Point:
    kind: str  # "decode" | "prefill" | "cached"
    tokens: int  # tokens the step processed (cached: found in the prefix cache)
    seconds: float  # its duration


@dataclass(frozen=True, slots=True)
class Stream:
    sent: float  # perf_counter when the request was sent
    chunks: list[tuple[float, int]]  # (perf_counter, tokens in the chunk)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent


def random_prompt(rng: random.Random, length: int) -> list[int]:
    """Token ids 10..299: inside the tiny model's vocabulary, no special tokens."""
    return [rng.randrange(10, 300) for _ in range(length)]


async def stream(
    client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int
) -> Stream:
    sent = time.perf_counter()
    chunks: list[tuple[float, int]] = []
    response = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in response:
        if chunk.choices:
            n = chunk_tokens(chunk.choices[0])
            if n:
                chunks.append((time.perf_counter(), n))
    if not chunks:
        raise RuntimeError("the server streamed no tokens")
    return Stream(sent, chunks)


def middle_step_time(s: Stream) -> float:
    """Seconds per token between 25% and 75% of the stream's tokens.

    Robust to the API server merging several tokens into one chunk."""
    total = sum(n for _, n in s.chunks)
    lo, hi = total // 4, 3 * total // 4
    seen, t_lo, n_lo = 0, None, 0
    t_hi, n_hi = s.chunks[-1][0], total
    for t, n in s.chunks:
        seen += n
        if t_lo is None and seen >= lo:
            t_lo, n_lo = t, seen
        if seen >= hi:
            t_hi, n_hi = t, seen
            break
    if t_lo is None or n_hi <= n_lo:
        raise RuntimeError(f"stream too short to time ({total} tokens)")
    return (t_hi - t_lo) / (n_hi - n_lo)


async def measure_decode(
    client: openai.AsyncOpenAI, model: str, batches: tuple[int, ...], rng: random.Random
) -> list[Point]:
    points = []
    for b in batches:
        runs = []
        for _ in range(REPEATS):
            streams = await asyncio.gather(
                *(
                    stream(client, model, random_prompt(rng, DECODE_PROMPT), DECODE_TOKENS)
                    for _ in range(b)
                )
            )
            runs.append(statistics.median(middle_step_time(s) for s in streams))
        points.append(Point("decode", b, statistics.median(runs)))
    return points


async def median_ttft(
    client: openai.AsyncOpenAI, model: str, length: int, rng: random.Random
) -> float:
    ttfts = []
    for _ in range(REPEATS):
        s = await stream(client, model, random_prompt(rng, length), 1)
        ttfts.append(s.ttft)
    return statistics.median(ttfts)


async def measure_prefill(
    client: openai.AsyncOpenAI,
    model: str,
    lengths: tuple[int, ...],
    step_at_1: float,
    rng: random.Random,
) -> tuple[float, list[Point]]:
    """Returns (request overhead, points)."""
    overhead = max(0.0, await median_ttft(client, model, OVERHEAD_PROMPT, rng) - step_at_1)
    points = []
    for length in lengths:
        ttft = await median_ttft(client, model, length, rng)
        points.append(Point("prefill", length, max(ttft - overhead, 0.0)))
    return overhead, points


async def measure_cached(
    client: openai.AsyncOpenAI,
    url: str,
    model: str,
    prefixes: tuple[int, ...],
    compute: Callable[[int], float],
    overhead: float,
    rng: random.Random,
) -> list[Point]:
    """Cached-prefill points: (C, the step time of C cached tokens beyond
    `compute(CACHED_NEW)`); none when the server does not cache prefixes (its
    hit counter did not move)."""
    hits = await asyncio.to_thread(metric, url.rstrip("/"), PREFIX_HITS)
    points = []
    for cached in prefixes:
        runs = []
        for _ in range(REPEATS):
            prefix = random_prompt(rng, cached)
            await stream(client, model, prefix + random_prompt(rng, OVERHEAD_PROMPT), 1)
            s = await stream(client, model, prefix + random_prompt(rng, CACHED_NEW), 1)
            runs.append(s.ttft - overhead - compute(CACHED_NEW))
        points.append(Point("cached", cached, statistics.median(runs)))
    if await asyncio.to_thread(metric, url.rstrip("/"), PREFIX_HITS) == hits:
        return []
    return points


async def hop_overhead(direct: str, via: str, model: str, seed: int = 0) -> float:
    """What a proxy at `via` adds to a short request's TTFT against `direct`, one
    of the servers behind it (medians of interleaved requests; at least 0)."""
    rng = random.Random(seed)
    clients = [
        openai.AsyncOpenAI(base_url=u.rstrip("/") + "/v1", api_key="hop", max_retries=0, timeout=60)
        for u in (direct, via)
    ]
    ttfts: list[list[float]] = [[], []]
    try:
        for _ in range(3 * REPEATS):
            for client, out in zip(clients, ttfts, strict=True):
                s = await stream(client, model, random_prompt(rng, OVERHEAD_PROMPT), 1)
                out.append(s.ttft)
    finally:
        for client in clients:
            await client.close()
    return max(0.0, statistics.median(ttfts[1]) - statistics.median(ttfts[0]))


def fit(points: list[Point]) -> tuple[float, float]:
    """Least-squares (base, per_token) of seconds = base + per_token * tokens."""
    n = len(points)
    if n < 2:
        raise ValueError("need at least two points to fit a line")
    mx = sum(p.tokens for p in points) / n
    my = sum(p.seconds for p in points) / n
    sxx = sum((p.tokens - mx) ** 2 for p in points)
    if sxx == 0:
        raise ValueError("need points at two different token counts")
    slope = sum((p.tokens - mx) * (p.seconds - my) for p in points) / sxx
    return my - slope * mx, slope


def fit_slope(points: list[Point], base: float = 0.0) -> float:
    """Least-squares slope of seconds - base = slope * tokens (line through base)."""
    sxx = sum(p.tokens * p.tokens for p in points)
    if sxx == 0:
        raise ValueError("need points at a nonzero token count")
    return sum(p.tokens * (p.seconds - base) for p in points) / sxx


def read_cache_info(url: str) -> tuple[int, int]:
    """(KV blocks, block size) from the server's /metrics."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
        snapshot = parse_metrics(resp.read().decode())
    if not snapshot.kv_blocks_total or not snapshot.block_size:
        raise RuntimeError(f"{url}/metrics does not publish vllm:cache_config_info")
    return snapshot.kv_blocks_total, snapshot.block_size


def fitting(
    batches: tuple[int, ...], lengths: tuple[int, ...], blocks: int, block_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Drop measurements that would not fit the KV cache (they would measure preemption)."""

    def need(tokens: int) -> int:
        return -(-(tokens + 1) // block_size)

    ok_b = tuple(b for b in batches if b * need(DECODE_PROMPT + DECODE_TOKENS) <= blocks)
    ok_p = tuple(p for p in lengths if need(p) <= blocks)
    for skipped in sorted(set(batches) - set(ok_b)):
        print(f"  skipping decode batch {skipped}: exceeds {blocks} KV blocks", file=sys.stderr)
    for skipped in sorted(set(lengths) - set(ok_p)):
        print(f"  skipping prefill {skipped}: exceeds {blocks} KV blocks", file=sys.stderr)
    return ok_b, ok_p


async def measure(
    url: str,
    model: str = "tiny",
    *,
    name: str = "measured",
    batches: tuple[int, ...] = DECODE_BATCHES,
    lengths: tuple[int, ...] = PREFILL_LENGTHS,
    max_num_seqs: int = CPU_MAX_NUM_SEQS,
    max_batched_tokens: int = CPU_MAX_BATCHED_TOKENS,
    kv_bytes_per_token: int = TINY_KV_BYTES_PER_TOKEN,
    seed: int = 0,
) -> tuple[Profile, list[Point], float]:
    """Measure the server at `url`; returns (profile, points, request overhead in s)."""
    blocks, block_size = read_cache_info(url)
    batches, lengths = fitting(batches, lengths, blocks, block_size)
    if 1 not in batches:
        raise ValueError("decode batch size 1 is needed to estimate the request overhead")
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1", api_key="measure", max_retries=0, timeout=300
    )
    try:
        await stream(client, model, random_prompt(rng, 64), 8)  # warm-up
        decode = await measure_decode(client, model, batches, rng)
        step_at_1 = next(p.seconds for p in decode if p.tokens == 1)
        overhead, prefill = await measure_prefill(client, model, lengths, step_at_1, rng)
        # Two lines with one base: decoding requests and prefill tokens cost differently here.
        base, per_seq = fit(decode)
        per_token = max(0.0, fit_slope(prefill, base))
        prefixes = tuple(k * block_size for k in CACHED_BLOCKS if k + 1 < blocks)
        cached = await measure_cached(
            client, url, model, prefixes, lambda n: base + per_token * n, overhead, rng
        )
    finally:
        await client.close()
    points = decode + prefill + cached
    per_cached = max(0.0, fit_slope(cached)) if cached else 0.0
    profile = Profile(
        name=name,
        step_base_s=base,
        step_per_token_s=per_token,
        step_per_seq_s=per_seq,
        request_overhead_s=overhead,
        step_per_cached_token_s=per_cached,
        kv_blocks=blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    return profile, points, overhead


def format_report(profile: Profile, points: list[Point], overhead: float) -> str:
    lines = [f"{'kind':<9}{'tokens':>7}{'measured':>11}{'fitted':>10}"]
    for p in points:
        lines.append(
            f"{p.kind:<9}{p.tokens:>7}{1e3 * p.seconds:>9.2f}ms{1e3 * _fitted(profile, p):>8.2f}ms"
        )
    lines.append(f"request overhead (subtracted from prefill TTFTs): {1e3 * overhead:.2f} ms")
    lines.append(
        f"profile {profile.name}: step = {1e3 * profile.step_base_s:.3f} ms"
        f" + {1e6 * (profile.step_per_seq_s or 0):.2f} us x decoding requests"
        f" + {1e6 * profile.step_per_token_s:.2f} us x prefill tokens"
        f" + {1e6 * profile.step_per_cached_token_s:.2f} us x cached prompt tokens; "
        f"{profile.kv_blocks} blocks x {profile.block_size} tokens, "
        f"max_num_seqs {profile.max_num_seqs}, max_batched_tokens {profile.max_batched_tokens}"
    )
    return "\n".join(lines)


def _fitted(profile: Profile, p: Point) -> float:
    if p.kind == "decode":
        return profile.step_time(0, p.tokens)
    if p.kind == "cached":  # the step beyond computing CACHED_NEW tokens
        return profile.step_time(CACHED_NEW, 0, p.tokens) - profile.step_time(CACHED_NEW, 0)
    return profile.step_time(p.tokens, 0)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the vLLM server, e.g. http://127.0.0.1:8001")
    parser.add_argument("--out", type=Path, help="profile JSON to write (default: print it)")
    parser.add_argument("--model", default="tiny", help="served model name")
    parser.add_argument("--name", default="measured", help="the profile's name")
    parser.add_argument("--batches", type=_ints, default=DECODE_BATCHES, help="e.g. 1,2,4,8")
    parser.add_argument("--prompts", type=_ints, default=PREFILL_LENGTHS, help="e.g. 64,256")
    parser.add_argument("--max-num-seqs", type=int, default=CPU_MAX_NUM_SEQS)
    parser.add_argument("--max-batched-tokens", type=int, default=CPU_MAX_BATCHED_TOKENS)
    parser.add_argument("--kv-bytes-per-token", type=int, default=TINY_KV_BYTES_PER_TOKEN)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        profile, points, overhead = asyncio.run(
            measure(
                args.url,
                args.model,
                name=args.name,
                batches=args.batches,
                lengths=args.prompts,
                max_num_seqs=args.max_num_seqs,
                max_batched_tokens=args.max_batched_tokens,
                kv_bytes_per_token=args.kv_bytes_per_token,
                seed=args.seed,
            )
        )
    except MetricsParseError as exc:  # (Ferry's own /metrics, say: no vLLM there)
        print(f"measure_profile: {args.url} is not a vLLM server: {exc}", file=sys.stderr)
        return 2
    print(format_report(profile, points, overhead))
    if args.out is None:
        print(json.dumps(dataclasses.asdict(profile), indent=2))
    else:
        profiles.save(profile, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
