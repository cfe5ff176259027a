"""Failover that never loses a stream: a real vLLM server killed at random moments.

Twenty streams start at random times over 1.5 s; at a random moment the doomed
server is drained with migration and, a few milliseconds later, killed (SIGKILL).
So at the kill some streams have not been placed yet, some wait for their first
token, some are mid-stream, and some are being moved. Every stream must end with
all its tokens, exactly the unmoved run's.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from loadtest.vllm_servers import VLLMServer
from tests.e2e.test_migration import TOKEN, api, post, stream_ids

PROMPTS = (
    "The quick brown fox",
    "Operators run several inference servers and put a load balancer in front of them.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9",
)
MAX_TOKENS = 150


@pytest.mark.parametrize("trial", range(2))
def test_every_stream_survives_a_kill_at_a_random_moment(
    trial: int, ferry: Any, doomed: VLLMServer, vllm_pair: list[VLLMServer]
) -> None:
    rng = random.Random(f"kill-{trial}")
    survivor = vllm_pair[1]
    proxy = ferry(
        [doomed.url, survivor.url],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
        admin_token=TOKEN,
    )
    reference = {
        p: stream_ids(api(survivor.url), False, MAX_TOKENS, lambda n: None, prompt=p)[0]
        for p in PROMPTS
    }
    at_kill: dict[int, int] = {}  # stream -> tokens it had when the server died
    received: dict[int, int] = {}
    results: dict[int, tuple[list[int], str | None]] = {}
    errors: list[BaseException] = []

    def one(n: int, prompt: str, delay: float) -> None:
        time.sleep(delay)
        received[n] = 0

        def seen(count: int) -> None:
            received[n] = count

        try:
            ids, _, last = stream_ids(api(proxy.url), False, MAX_TOKENS, seen, prompt=prompt)
            results[n] = (ids, last.choices[0].finish_reason if last else None)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    plan = [(n, rng.choice(PROMPTS), rng.uniform(0, 1.5)) for n in range(20)]
    threads = [threading.Thread(target=one, args=args) for args in plan]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.3, 1.5))
    post(f"{proxy.url}/admin/instances/i0/drain?migrate=true")
    time.sleep(rng.uniform(0.0, 0.05))  # moves under way
    doomed.kill()
    at_kill.update(received)
    for t in threads:
        t.join(300)
    assert not errors, errors
    for n, prompt, _ in plan:
        assert results[n] == (reference[prompt], "length"), f"stream {n}, {at_kill.get(n)} at kill"
    phases = {
        "not started": sum(1 for n, _, _ in plan if n not in at_kill),
        "no token yet": sum(1 for c in at_kill.values() if c == 0),
        "streaming": sum(1 for c in at_kill.values() if c > 0),
    }
    print(f"trial {trial}: all 20 streams exact; at the kill: {phases}")


def test_every_stream_survives_a_graceful_restart(
    ferry: Any, doomed: VLLMServer, vllm_pair: list[VLLMServer]
) -> None:
    """A rolling restart: SIGTERM to a real vLLM server with streams in flight.
    vLLM ends each of its streams with finish_reason "abort" (or drops it) as it
    shuts down; each must go on on the other server and end exactly as unmoved."""
    survivor = vllm_pair[1]
    proxy = ferry(
        [doomed.url, survivor.url],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
        admin_token=TOKEN,
    )
    reference = {
        p: stream_ids(api(survivor.url), False, MAX_TOKENS, lambda n: None, prompt=p)[0]
        for p in PROMPTS
    }
    received: dict[int, int] = {}
    results: dict[int, tuple[list[int], str | None]] = {}
    errors: list[BaseException] = []

    def one(n: int, prompt: str) -> None:
        def seen(count: int) -> None:
            received[n] = count

        try:
            ids, _, last = stream_ids(api(proxy.url), False, MAX_TOKENS, seen, prompt=prompt)
            results[n] = (ids, last.choices[0].finish_reason if last else None)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    plan = [(n, PROMPTS[n % len(PROMPTS)]) for n in range(8)]
    threads = [threading.Thread(target=one, args=args) for args in plan]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(received) < len(plan) and time.monotonic() < deadline:
        time.sleep(0.02)  # every stream has its first tokens, half of them on doomed
    doomed.stop()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for n, prompt in plan:
        assert results[n] == (reference[prompt], "length"), f"stream {n}"
