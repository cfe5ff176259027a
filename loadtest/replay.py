"""Replay a request trace against a live OpenAI-compatible server (Ferry or vLLM).

Each trace request is sent at its `arrival_s` after the start as a streaming
`/v1/completions` call: a prompt of `prompt_tokens` token ids (cycling 10..299),
`max_tokens = output_tokens` with `ignore_eos`, greedy, its priority in the
`x-ferry-priority` header. What the client saw (send time, first token, finish,
tokens received, the worst gap between two token chunks; seconds since the
start) comes back as `SimRequest`s, so the simulator's
`loadtest.sim.stats.summarize` reports real and simulated runs alike.

    from loadtest.replay import replay
    done = asyncio.run(replay("http://127.0.0.1:8000", trace.read(path), "tiny"))
    print(summarize(done, {}))

`client="lean"` sends the same requests with aiohttp and reads the SSE bytes
directly, for token rates the official client cannot keep up with. It can take
its prompts from a `PromptSource` instead, which also hears each answer's token
ids (a multi-turn conversation whose next turn carries the answer: see
loadtest/bench_prefix_real.py), and can give up on a request after `timeout_s`.

Tokens are counted from the `token_ids` vLLM streams when asked
(`return_token_ids`; Ferry passes them through to a client that asks), or one per
chunk when a server does not send them. A request that fails keeps `finish`
unset, so it counts as not finished; the errors are logged.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from itertools import cycle, islice
from typing import Protocol

import aiohttp
import openai

from loadtest.sim.instance import SimRequest
from loadtest.trace import TraceRequest
from proxy.policy import Priority
from proxy.upstream import ENGINE_PRIORITY

log = logging.getLogger(__name__)

PROMPT_IDS = range(10, 300)


class PromptSource(Protocol):
    """Where the lean client gets a request's prompt, and where it reports the answer."""

    async def prompt(self, t: TraceRequest) -> list[int]:
        """`t`'s prompt as token ids; may wait (for an earlier turn's answer)."""
        ...

    def answered(self, t: TraceRequest, generated: list[int], finished: bool) -> None:
        """`t` ended: the ids it generated, and whether it finished."""
        ...


def prompt_ids(length: int, start: int = 0) -> list[int]:
    """`length` ids cycling through PROMPT_IDS from `start`: requests with different
    starts share no prefix, so the prefix cache does not shortcut them."""
    ids = cycle(PROMPT_IDS)
    return list(islice(ids, start % len(PROMPT_IDS), start % len(PROMPT_IDS) + length))


def chunk_tokens(choice: object) -> int:
    """Tokens in one streamed choice: its `token_ids` when present, else 1."""
    extra = getattr(choice, "model_extra", None) or {}
    ids = extra.get("token_ids")
    return len(ids) if isinstance(ids, list) else 1


def _received(r: SimRequest, n: int, start: float) -> None:
    """Credit `n` tokens that arrived now: first token, worst gap, count."""
    if n:
        now = time.perf_counter() - start
        if r.first_token is None:
            r.first_token = now
        elif r.last_token is not None:
            r.worst_gap = max(r.worst_gap, now - r.last_token)
        r.last_token = now
    r.generated += n


async def _scheduled(t: TraceRequest, start: float) -> SimRequest:
    await asyncio.sleep(max(0.0, start + t.arrival_s - time.perf_counter()))
    sent = time.perf_counter() - start
    return SimRequest(t.id, sent, t.prompt_tokens, t.output_tokens, Priority.parse(t.priority))


async def _one(client: openai.AsyncOpenAI, model: str, t: TraceRequest, start: float) -> SimRequest:
    r = await _scheduled(t, start)
    try:
        response = await client.completions.create(
            model=model,
            prompt=prompt_ids(t.prompt_tokens, start=t.id * 37),
            max_tokens=t.output_tokens,
            temperature=0,
            stream=True,
            extra_headers={"x-ferry-priority": t.priority},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in response:
            if chunk.choices:
                _received(r, chunk_tokens(chunk.choices[0]), start)
        r.finish = time.perf_counter() - start
    except (openai.OpenAIError, OSError) as exc:
        log.warning("request %d failed after %d tokens: %s", t.id, r.generated, exc)
        r.finish = None
    return r


_TOKEN_IDS = re.compile(rb'"token_ids":\[([^\]]*)\]')


def raw_chunk_ids(data: bytes) -> list[int]:
    """The ids in one SSE chunk's `token_ids` (none if it has none)."""
    match = _TOKEN_IDS.search(data)
    return [int(i) for i in match.group(1).split(b",") if i.strip()] if match else []


def raw_chunk_tokens(data: bytes) -> int:
    """Tokens in one SSE chunk's JSON, read from the bytes: the ids in its
    `token_ids`, else 1 for a chunk with a choice, 0 for one without (usage)."""
    match = _TOKEN_IDS.search(data)
    if match:
        ids = match.group(1).strip()
        return ids.count(b",") + 1 if ids else 0
    return 0 if b'"choices":[]' in data else 1


async def _one_lean(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    t: TraceRequest,
    start: float,
    source: PromptSource | None = None,
    body_priority: bool = False,
) -> SimRequest:
    r = await _scheduled(t, start)
    if source is None:
        prompt = prompt_ids(t.prompt_tokens, start=t.id * 37)
    else:
        prompt = await source.prompt(t)
        r.arrival = time.perf_counter() - start  # sent now, if it waited for an answer
    generated: list[int] = []
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": t.output_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    value = ENGINE_PRIORITY.get(Priority.parse(t.priority)) if body_priority else None
    if value is not None:  # vLLM's own field (--scheduling-policy priority); normal: none
        body["priority"] = value
    try:
        async with session.post(
            url + "/v1/completions",
            json=body,
            headers={"x-ferry-priority": t.priority, "x-request-id": f"trace-{t.id}"},
        ) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                data = line[6:].strip() if line.startswith(b"data: ") else b""
                if data == b"[DONE]":
                    break
                if data.startswith(b'{"error"'):
                    raise ValueError(data[:300].decode(errors="replace"))
                if data:
                    _received(r, raw_chunk_tokens(data), start)
                    if source is not None:
                        generated += raw_chunk_ids(data)
        r.finish = time.perf_counter() - start
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        log.warning("request %d failed after %d tokens: %r", t.id, r.generated, exc)
        r.finish = None
    if source is not None:
        source.answered(t, generated, r.finish is not None)
    return r


async def replay(
    url: str,
    requests: Sequence[TraceRequest],
    model: str,
    *,
    client: str = "openai",
    prompts: PromptSource | None = None,
    timeout_s: float = 600,
    body_priority: bool = False,
) -> list[SimRequest]:
    """Send `requests` to `url` on the trace's schedule; return what the client saw.

    `client="openai"` streams with the official client, as users do; it costs about
    0.5 ms of CPU per chunk, so one core keeps up with about 1,000 chunks/s at
    most. `client="lean"` reads the SSE bytes with aiohttp and one regular
    expression per chunk (tens of microseconds), for benchmarks whose token rate
    the official client could not keep up with; only it takes `prompts`. A request
    not done `timeout_s` after it was sent counts as not finished. `body_priority`
    (lean only) also puts each request's priority in the body, in vLLM's own
    `priority` field, as a client of a priority-scheduling vLLM would."""
    url = url.rstrip("/")
    start = time.perf_counter()
    if client == "lean":
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            lean = [
                asyncio.create_task(
                    _one_lean(session, url, model, t, start, prompts, body_priority)
                )
                for t in requests
            ]
            return list(await asyncio.gather(*lean))
    if client != "openai":
        raise ValueError(f"client must be openai or lean (got {client!r})")
    if prompts is not None or body_priority:
        raise ValueError("only the lean client takes prompts and body_priority")
    official = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="replay", max_retries=0, timeout=timeout_s
    )
    try:
        tasks = [asyncio.create_task(_one(official, model, t, start)) for t in requests]
        return list(await asyncio.gather(*tasks))
    finally:
        await official.close()
