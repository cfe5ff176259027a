"""Failover that never loses a stream: a real vLLM server killed at random moments.

Twenty streams start at random times over 1.5 s; at a random moment the doomed
server is drained with migration and, a few milliseconds later, killed (SIGKILL).
So at the kill some streams have not been placed yet, some wait for their first
token, some are mid-stream, and some are being moved. Every stream must end with
all its tokens, exactly the unmoved run's.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
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


class Streams:
    """Greedy streams through Ferry, each checked against the unmoved run on the
    survivor: what each received so far, and how each ended."""

    def __init__(self, proxy_url: str, survivor: VLLMServer) -> None:
        self.proxy_url = proxy_url
        self.reference = {
            p: stream_ids(api(survivor.url), False, MAX_TOKENS, lambda n: None, prompt=p)[0]
            for p in PROMPTS
        }
        self.received: dict[int, int] = {}  # stream -> tokens so far
        self.results: dict[int, tuple[list[int], str | None]] = {}
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.prompts: dict[int, str] = {}

    def start(self, n: int, prompt: str, delay: float = 0.0) -> None:
        self.prompts[n] = prompt
        thread = threading.Thread(target=self._one, args=(n, prompt, delay))
        self.threads.append(thread)
        thread.start()

    def under_way(self, n: int) -> dict[int, int]:
        """Start `n` streams at once (round robin: half of them on each server) and
        wait until each has its first tokens; what each has received by then."""
        for i in range(n):
            self.start(i, PROMPTS[i % len(PROMPTS)])
        deadline = time.monotonic() + 60
        while sum(1 for c in self.received.values() if c) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return dict(self.received)

    def _one(self, n: int, prompt: str, delay: float) -> None:
        time.sleep(delay)
        self.received[n] = 0

        def seen(count: int) -> None:
            self.received[n] = count

        try:
            ids, _, last = stream_ids(api(self.proxy_url), False, MAX_TOKENS, seen, prompt=prompt)
            self.results[n] = (ids, last.choices[0].finish_reason if last else None)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            self.errors.append(exc)

    def check(self, at_cut: dict[int, int]) -> None:
        """Every stream ended with all its tokens, exactly the unmoved run's."""
        for t in self.threads:
            t.join(300)
        assert not self.errors, self.errors
        for n, prompt in self.prompts.items():
            expected = (self.reference[prompt], "length")
            assert self.results.get(n) == expected, f"stream {n}, {at_cut.get(n)} at the cut"


def ferry_over(ferry: Any, doomed: VLLMServer, survivor: VLLMServer) -> Any:
    return ferry(
        [doomed.url, survivor.url],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
        admin_token=TOKEN,
    )


@pytest.mark.parametrize("trial", range(2))
def test_every_stream_survives_a_kill_at_a_random_moment(
    trial: int, ferry: Any, doomed: VLLMServer, vllm_pair: list[VLLMServer]
) -> None:
    rng = random.Random(f"kill-{trial}")
    proxy = ferry_over(ferry, doomed, vllm_pair[1])
    streams = Streams(proxy.url, vllm_pair[1])
    for n in range(20):
        streams.start(n, rng.choice(PROMPTS), rng.uniform(0, 1.5))
    time.sleep(rng.uniform(0.3, 1.5))
    post(f"{proxy.url}/admin/instances/i0/drain?migrate=true")
    time.sleep(rng.uniform(0.0, 0.05))  # moves under way
    doomed.kill()
    at_kill = dict(streams.received)  # stream -> tokens it had when the server died
    streams.check(at_kill)
    phases = {
        "not started": sum(1 for n in streams.prompts if n not in at_kill),
        "no token yet": sum(1 for c in at_kill.values() if c == 0),
        "streaming": sum(1 for c in at_kill.values() if c > 0),
    }
    print(f"trial {trial}: all 20 streams exact; at the kill: {phases}")


def test_every_stream_survives_a_graceful_restart(
    ferry: Any, doomed: VLLMServer, vllm_pair: list[VLLMServer]
) -> None:
    """A rolling restart: SIGTERM to a real vLLM server with streams in flight.
    vLLM 0.32 closes them as it shuts down (an engine's "abort" would do as well:
    tests/integration/test_migration_standin.py); each must go on on the other
    server and end exactly as unmoved."""
    proxy = ferry_over(ferry, doomed, vllm_pair[1])
    streams = Streams(proxy.url, vllm_pair[1])
    at_stop = streams.under_way(8)
    doomed.stop()
    streams.check(at_stop)


def test_every_stream_survives_its_engine_core_dying(
    ferry: Any, doomed: VLLMServer, vllm_pair: list[VLLMServer]
) -> None:
    """A real vLLM server's engine core dies (kill -9, as a GPU fault ends it)
    while its API server lives on and sends each stream a 500 error event: each
    must go on on the other server and end exactly as unmoved."""
    proxy = ferry_over(ferry, doomed, vllm_pair[1])
    streams = Streams(proxy.url, vllm_pair[1])
    at_kill = streams.under_way(8)
    [core] = engine_cores(doomed)
    os.kill(core, signal.SIGKILL)
    # The API server outlives its engine long enough to send each stream the
    # error event (without the error handling this test fails with the engine's
    # APIError), then may exit by itself: whether it is still up says nothing.
    streams.check(at_kill)


def engine_cores(server: VLLMServer) -> list[int]:
    """The pids of the server's engine core processes (in its process group)."""
    ps = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True)
    cores = []
    for line in ps.stdout.splitlines():
        pid, pgid, args = line.split(None, 2)
        if int(pgid) == server.process.pid and "EngineCore" in args:
            cores.append(int(pid))
    return cores
