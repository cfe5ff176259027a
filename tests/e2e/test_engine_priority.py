"""A high-priority request overtakes the engine's own queue on a real vLLM CPU
server run with `--scheduling-policy priority`, when its instance says so
(`engine_priority: true`); without it, vLLM serves its queue in arrival order.

The server runs 2 sequences at most: two long streams fill it, three short
normal ones queue in vLLM, then one short high-priority one arrives."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.vllm_servers import VLLMServer, metric, start_vllm, wait_ready
from proxy.config import parse_config
from tests.e2e.test_migration import PROMPT, api
from tests.helpers import Ferry, free_port, wait_until

LONG_TOKENS = 1200  # seconds of decoding here: the queue forms behind them
WAITING = "vllm:num_requests_waiting{"


@pytest.fixture(scope="module")
def ranked(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    logs = tmp_path_factory.mktemp("vllm-ranked")
    server = start_vllm(
        tiny_model,
        free_port(),
        logs,
        kv_cache_bytes=16_000_000,  # two long streams fit without preemption
        max_model_len=2048,
        extra_args=("--scheduling-policy", "priority", "--max-num-seqs", "2"),
    )
    try:
        wait_ready([server])
        yield server
    finally:
        server.stop()


def first_tokens(url: str, engine: VLLMServer) -> tuple[float, list[float]]:
    """When the high-priority stream and each queued normal one got a first token."""
    firsts: dict[str, float] = {}
    errors: list[BaseException] = []

    def one(key: str, priority: str, max_tokens: int) -> None:
        try:
            stream = api(url).completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"x-ferry-priority": priority},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text and key not in firsts:
                    firsts[key] = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    def start(key: str, priority: str, max_tokens: int) -> threading.Thread:
        thread = threading.Thread(target=one, args=(key, priority, max_tokens))
        thread.start()
        return thread

    threads = [start(f"long{i}", "normal", LONG_TOKENS) for i in range(2)]
    wait_until(lambda: {"long0", "long1"} <= firsts.keys(), timeout=60)
    threads += [start(f"queued{i}", "normal", 4) for i in range(3)]
    wait_until(lambda: metric(engine.url, WAITING) == 3, timeout=30)
    threads.append(start("high", "high", 4))
    wait_until(lambda: metric(engine.url, WAITING) == 4, timeout=30)
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    return firsts["high"], [firsts[f"queued{i}"] for i in range(3)]


def ferry(loop_thread: Any, engine: VLLMServer, engine_priority: bool) -> Ferry:
    instance = {"name": "ranked", "url": engine.url, "engine_priority": engine_priority}
    config = {"instances": [instance], "scheduler": {"scrape_interval_s": 0.05}}
    return Ferry(loop_thread, parse_config(config, env={}))


@pytest.mark.parametrize("engine_priority", [True, False], ids=["engine_priority", "fcfs"])
def test_a_high_priority_request_overtakes_the_engines_queue(
    ranked: VLLMServer, loop_thread: Any, engine_priority: bool
) -> None:
    """With the setting, the high-priority request is served before the three
    queued ahead of it; without it (the contrast: no field sent), after them."""
    proxy = ferry(loop_thread, ranked, engine_priority)
    try:
        high, queued = first_tokens(proxy.url, ranked)
    finally:
        proxy.close()
    # Two sequences at most: when the long streams end, the engine may admit
    # two waiting requests in one step, and which of two first tokens from one
    # step a client thread sees first is chance. So the orders compared are
    # "at most one queued request ahead" against "two ahead".
    if engine_priority:
        # Priority order admits the high one first: alone, or in the same
        # step as the first queued one.
        assert high < sorted(queued)[1], "the high-priority request waited behind the queue"
    else:
        # Arrival order admits two of the queued first, then the third and
        # the high-priority one.
        assert high > sorted(queued)[1]
