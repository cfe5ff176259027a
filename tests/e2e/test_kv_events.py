"""The precise prefix index against a real vLLM CPU server publishing KV events.

`events_vllm` publishes its KV cache events (zmq, with a replay endpoint;
prefix caching is on by default). Prompts are sent as token ids so that Ferry
can hash them the way the engine does. Prefixes are cached *behind Ferry's
back* (straight to the server), so only the engine's own events can tell Ferry
where they are: the approximate index never saw them.

The second instance is a stand-in server (loadtest/standin_server.py, not
vLLM) with more KV room than the real one, so that without prefix credit
llumnix prefers it: a request that lands on the real server got there by the
credit.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from loadtest.standin_server import StandIn
from loadtest.vllm_servers import VLLMServer, metric
from proxy.config import parse_config
from tests.helpers import Ferry, LoopThread, Site, call_json, wait_until

BLOCK = 128  # vLLM's block size on CPU
TOKEN = "kv-test-token"
HITS = "vllm:prefix_cache_hits_total"


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(url: str, ids: list[int]) -> str:
    """One greedy token for a token-id prompt; returns the instance that served it."""
    raw = api(url).completions.with_raw_response.create(
        model="tiny", prompt=ids, max_tokens=1, temperature=0
    )
    return raw.headers.get("x-ferry-instance", "")


def fresh_ids(rng: random.Random, n: int) -> list[int]:
    """Token ids no other test sends (the tiny model's vocabulary is ~350)."""
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.fixture
def precise(
    loop_thread: LoopThread,
    events_vllm: VLLMServer,
    standins: Callable[..., list[tuple[StandIn, Site]]],
) -> Iterator[Callable[[], Ferry]]:
    """Start a Ferry (llumnix with prefix credit) in front of a stand-in (`roomy`)
    and the real server (`real`), following the real one's KV events."""
    ((_, roomy),) = standins(1, model="tiny", kv_blocks=60, block_size=BLOCK)
    started: list[Ferry] = []

    def make() -> Ferry:
        real = {
            "name": "real",
            "url": events_vllm.url,
            "kv_events": events_vllm.kv_events,
            "kv_events_replay": events_vllm.kv_events_replay,
        }
        raw = {
            "instances": [{"name": "roomy", "url": roomy.url}, real],
            # Both stay free enough after taking a request (1 block a request),
            # so the prefill a cached prefix saves decides between them.
            "scheduler": {"scrape_interval_s": 0.1, "seed": 1, "prefix_credit": True},
            "admin_token": TOKEN,
        }
        proxy = Ferry(loop_thread, parse_config(raw, env={}))
        started.append(proxy)
        wait_until(lambda: modes(proxy) == {"roomy": "approximate", "real": "precise"}, 30)
        return proxy

    yield make
    for proxy in started:
        proxy.close()


def rows(proxy: Ferry) -> dict[str, dict[str, Any]]:
    status, body = call_json(
        proxy.url + "/admin/instances", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert status == 200, body
    return {row["name"]: row["prefix_index"] for row in body}


def modes(proxy: Ferry) -> dict[str, str]:
    return {name: row["mode"] for name, row in rows(proxy).items()}


def cached(proxy: Ferry, ids: list[int]) -> dict[str, int]:
    """What Ferry's prefix index says each instance holds of `ids` (as a move reads it)."""
    prefixes = proxy.cluster.prefixes
    names = ["roomy", "real"]
    return dict(proxy.loop.call(prefixes.cached_token_blocks, ids, BLOCK, names))


def test_the_index_follows_the_engines_cache_and_credit_reaches_the_policy(
    precise: Callable[[], Ferry], events_vllm: VLLMServer
) -> None:
    proxy = precise()
    rng = random.Random(13)
    prompts = [fresh_ids(rng, 2 * BLOCK + 40) for _ in range(3)]
    # Without credit llumnix picks the roomier stand-in.
    assert complete(proxy.url, fresh_ids(rng, 2 * BLOCK + 40)) == "roomy"

    # Cache each prompt's two full blocks on the real server, behind Ferry's back.
    for ids in prompts:
        complete(events_vllm.url, ids)
    for ids in prompts:
        wait_until(lambda ids=ids: cached(proxy, ids) == {"real": 2 * BLOCK})

    # Through Ferry they go where the engine holds them, and hit there.
    hits = metric(events_vllm.url, HITS)
    for ids in prompts:
        assert complete(proxy.url, ids) == "real"
    assert metric(events_vllm.url, HITS) - hits == 3 * 2 * BLOCK

    row = rows(proxy)["real"]
    assert row["mode"] == "precise" and row["blocks"] >= 6
    assert row["kv_events"]["hashing"] == "engine" and row["kv_events"]["synced"]
    assert metric(proxy.url, 'ferry_prefix_index_precise{instance="real"}') == 1
    assert metric(proxy.url, 'ferry_prefix_index_precise{instance="roomy"}') == 0
    assert metric(proxy.url, 'ferry_prefix_index_blocks{instance="real"}') >= 6

    # Long prompts straight to the server fill its ~15-block cache: LRU evicts
    # the primed prompts' free blocks, and the engine's events say so.
    for _ in range(3):
        complete(events_vllm.url, fresh_ids(rng, 900))
    wait_until(lambda: all(cached(proxy, ids) == {} for ids in prompts))
    before = metric(events_vllm.url, HITS)
    complete(events_vllm.url, prompts[0])  # the engine agrees: a miss
    assert metric(events_vllm.url, HITS) == before
    # And the credit is gone: the next one goes to the roomier stand-in again.
    assert complete(proxy.url, prompts[1]) == "roomy"


def test_a_ferry_started_later_catches_up_from_the_replay(
    precise: Callable[[], Ferry], events_vllm: VLLMServer
) -> None:
    first = precise()
    ids = fresh_ids(random.Random(14), 3 * BLOCK + 10)
    complete(events_vllm.url, ids)
    wait_until(lambda: cached(first, ids) == {"real": 3 * BLOCK})
    # A second Ferry sees no live event for this prompt: only the replay has it.
    second = precise()
    wait_until(lambda: cached(second, ids) == {"real": 3 * BLOCK})
    # Both follow the same engine: they agree on every block it holds.
    wait_until(lambda: rows(first)["real"]["blocks"] == rows(second)["real"]["blocks"])
    assert rows(second)["real"]["kv_events"]["complete"]
