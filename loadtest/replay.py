"""Replay a request trace against a live OpenAI-compatible server (Ferry or vLLM).

Each trace request is sent at its `arrival_s` after the start as a streaming
`/v1/completions` call: a prompt of `prompt_tokens` token ids (cycling 10..299),
`max_tokens = output_tokens` with `ignore_eos`, greedy, its priority in the
`x-ferry-priority` header. What the client saw (send time, first token, finish,
tokens received; seconds since the start) comes back as `SimRequest`s, so the
simulator's `loadtest.sim.stats.summarize` reports real and simulated runs alike.

    from loadtest.replay import replay
    done = asyncio.run(replay("http://127.0.0.1:8000", trace.read(path), "tiny"))
    print(summarize(done, {}))

Tokens are counted from the `token_ids` vLLM streams when asked
(`return_token_ids`; Ferry passes them through to a client that asks), or one per
chunk when a server does not send them. A request that fails keeps `finish`
unset, so it counts as not finished; the errors are logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from itertools import cycle, islice

import openai

from loadtest.sim.instance import SimRequest
from loadtest.trace import TraceRequest
from proxy.policy import Priority

log = logging.getLogger(__name__)

PROMPT_IDS = range(10, 300)


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


async def _one(client: openai.AsyncOpenAI, model: str, t: TraceRequest, start: float) -> SimRequest:
    await asyncio.sleep(max(0.0, start + t.arrival_s - time.perf_counter()))
    sent = time.perf_counter() - start
    r = SimRequest(t.id, sent, t.prompt_tokens, t.output_tokens, Priority.parse(t.priority))
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
            if not chunk.choices:
                continue
            n = chunk_tokens(chunk.choices[0])
            if n and r.first_token is None:
                r.first_token = time.perf_counter() - start
            r.generated += n
        r.finish = time.perf_counter() - start
    except (openai.OpenAIError, OSError) as exc:
        log.warning("request %d failed after %d tokens: %s", t.id, r.generated, exc)
        r.finish = None
    return r


async def replay(url: str, requests: Sequence[TraceRequest], model: str) -> list[SimRequest]:
    """Send `requests` to `url` on the trace's schedule; return what the client saw."""
    client = openai.AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1", api_key="replay", max_retries=0, timeout=600
    )
    try:
        start = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, model, t, start)) for t in requests]
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()
