"""Ferry's KV event subscriber (proxy/kv_events.py) against vLLM's own publisher.

No model runs here: vLLM's `ZmqEventPublisher` (the class a server uses, PUB
plus its replay ROUTER) publishes batches whose block hashes vLLM's own
`hash_block_tokens` computes, so what is tested is Ferry against vLLM's code
for the wire, the replay, the sequence numbers and the hashes. Restarts and
lost batches are made by restarting the publisher and by moving its counter.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.cluster import Cluster
from proxy.config import parse_instance
from proxy.engine_blocks import EngineBlocks
from proxy.kv_events import KVEvents
from proxy.policy import UsageSettings
from tests.helpers import LoopThread, free_port, wait_until

kv_events = pytest.importorskip("vllm.distributed.kv_events")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")

SIZE = 16


def vllm_hashes(ids: list[int]) -> list[int]:
    """The hashes a vLLM engine publishes for these ids (its own functions)."""
    kv_cache_utils.init_none_hash(hashing.sha256)
    out, parent = [], None
    for start in range(0, len(ids) - SIZE + 1, SIZE):
        parent = kv_cache_utils.hash_block_tokens(hashing.sha256, parent, ids[start : start + SIZE])
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


def stored(ids: list[int]) -> Any:
    hashes = vllm_hashes(ids)
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=ids[: len(hashes) * SIZE],
        block_size=SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def batch(*events: Any) -> Any:
    return kv_events.KVEventBatch(ts=0.0, events=list(events))


# Three full blocks and one token more: vLLM always computes a prompt's last token.
PROMPTS = [[p * 100 + i for i in range(3 * SIZE + 1)] for p in range(1, 5)]


class Follower:
    """A cluster of one vLLM instance whose events a `KVEvents` follows."""

    def __init__(self, loop: LoopThread, events: int, replay: int | None) -> None:
        raw = {"name": "a", "url": "http://127.0.0.1:9", "kv_events": f"tcp://127.0.0.1:{events}"}
        if replay is not None:
            raw["kv_events_replay"] = f"tcp://127.0.0.1:{replay}"
        self.loop = loop
        self.cluster = Cluster((parse_instance(raw, "instance", {}),), UsageSettings(), 3)
        self.cluster.prefixes.enabled = True
        self.events = KVEvents(self.cluster, replay_timeout_s=2.0)
        loop.call(self.events.sync)

    @property
    def blocks(self) -> EngineBlocks:
        return self.cluster.prefixes.engines["a"]

    def cached(self, ids: list[int]) -> int:
        return int(self.loop.call(self.blocks.cached_tokens, ids, {}))

    def state(self) -> dict[str, Any]:
        return dict(self.loop.call(self.blocks.describe))

    def close(self) -> None:
        self.loop.run(self.events.stop())


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture
def publisher(ports: tuple[int, int]) -> Iterator[Callable[..., Any]]:
    started: list[Any] = []

    def start(replay: bool = True) -> Any:
        events, rep = ports
        pub = kv_events.ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{events}",
            replay_endpoint=f"tcp://*:{rep}" if replay else None,
        )
        started.append(pub)
        return pub

    yield start
    for pub in started:
        pub.shutdown()


@pytest.fixture
def follower(loop_thread: LoopThread) -> Iterator[Callable[..., Follower]]:
    started: list[Follower] = []

    def make(events: int, replay: int | None) -> Follower:
        f = Follower(loop_thread, events, replay)
        started.append(f)
        return f

    yield make
    for f in started:
        f.close()


def test_joining_late_replays_then_follows_live(
    publisher: Callable[..., Any], follower: Callable[..., Follower], ports: tuple[int, int]
) -> None:
    pub = publisher()
    pub.publish(batch(stored(PROMPTS[0])))
    pub.publish(batch(stored(PROMPTS[1])))
    f = follower(*ports)
    wait_until(lambda: f.state()["synced"], 10)
    assert f.cached(PROMPTS[0]) == f.cached(PROMPTS[1]) == 3 * SIZE
    state = f.state()
    assert state["complete"] and state["hashing"] == "engine" and state["next_seq"] == 2
    second = vllm_hashes(PROMPTS[0])[1]
    pub.publish(batch(kv_events.BlockRemoved(block_hashes=[second], medium="GPU")))
    wait_until(lambda: f.cached(PROMPTS[0]) == SIZE)
    pub.publish(batch(kv_events.AllBlocksCleared()))
    wait_until(lambda: len(f.blocks) == 0)
    assert f.loop.call(f.cluster.prefixes.mode, "a") == "precise"


def test_a_store_of_no_blocks_is_taken_in_stride(
    publisher: Callable[..., Any], follower: Callable[..., Follower], ports: tuple[int, int]
) -> None:
    """A first store that names no block (no parent, no hashes: vLLM's shape
    allows it) once ended the follower (IndexError): the index then froze."""
    pub = publisher()
    f = follower(*ports)
    wait_until(lambda: f.state()["synced"], 10)
    empty = kv_events.BlockStored(
        block_hashes=[],
        parent_block_hash=None,
        token_ids=[],
        block_size=SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    pub.publish(batch(empty))
    pub.publish(batch(stored(PROMPTS[0])))
    wait_until(lambda: f.cached(PROMPTS[0]) == 3 * SIZE)
    assert f.state()["hashing"] == "engine"


def test_a_restarted_engine_is_followed_from_its_new_start(
    publisher: Callable[..., Any], follower: Callable[..., Follower], ports: tuple[int, int]
) -> None:
    old = publisher()
    f = follower(*ports)
    wait_until(lambda: f.state()["synced"], 10)
    for ids in PROMPTS[:3]:
        old.publish(batch(stored(ids)))
    wait_until(lambda: f.cached(PROMPTS[2]) == 3 * SIZE)
    old.shutdown()
    # Disconnected: the instance falls back to the approximate index.
    wait_until(lambda: f.loop.call(f.cluster.prefixes.mode, "a") == "approximate", 10)
    new = publisher()  # the same ports, its counter back at 0
    new.publish(batch(stored(PROMPTS[3])))
    wait_until(lambda: f.cached(PROMPTS[3]) == 3 * SIZE, 15)
    assert f.cached(PROMPTS[0]) == 0  # the old process's cache died with it
    state = f.state()
    assert state["restarts"] == 1 and state["complete"] and state["blocks"] == 3


def test_a_gap_the_engine_no_longer_buffers_clears_and_goes_on(
    publisher: Callable[..., Any], follower: Callable[..., Follower], ports: tuple[int, int]
) -> None:
    pub = publisher()
    f = follower(*ports)
    wait_until(lambda: f.state()["synced"], 10)
    pub.publish(batch(stored(PROMPTS[0])))
    wait_until(lambda: f.cached(PROMPTS[0]) == 3 * SIZE)
    pub._seq_gen = itertools.count(10)  # batches 1..9 were lost, and never buffered
    pub.publish(batch(stored(PROMPTS[1])))
    wait_until(lambda: f.cached(PROMPTS[1]) == 3 * SIZE)
    state = f.state()
    assert state["lost_gaps"] == 1 and not state["complete"] and state["next_seq"] == 11
    assert f.cached(PROMPTS[0]) == 0  # cleared: it may have been evicted in the gap


def test_without_a_replay_endpoint_it_follows_what_comes(
    publisher: Callable[..., Any], follower: Callable[..., Follower], ports: tuple[int, int]
) -> None:
    pub = publisher(replay=False)
    pub.publish(batch(stored(PROMPTS[0])))  # before Ferry listens: never seen
    # publish() only queues it for the publisher's thread: wait until it is sent
    # (to no subscriber, so dropped), or a thread slow to start sends it to Ferry.
    wait_until(lambda: pub._event_queue.unfinished_tasks == 0, 10)
    f = follower(ports[0], None)
    wait_until(lambda: f.state()["synced"], 10)
    # A subscription takes a moment to reach the publisher: publish until one lands.
    for ids in itertools.islice(itertools.cycle(PROMPTS[1:]), 200):
        pub.publish(batch(stored(ids)))
        time.sleep(0.05)
        if f.state()["blocks"]:
            break
    wait_until(lambda: f.cached(PROMPTS[1]) == 3 * SIZE or f.cached(PROMPTS[2]) == 3 * SIZE)
    assert f.cached(PROMPTS[0]) == 0 and not f.state()["complete"]


def test_sync_follows_the_fleet(
    publisher: Callable[..., Any], follower: Callable[..., Follower], ports: tuple[int, int]
) -> None:
    pub = publisher()
    pub.publish(batch(stored(PROMPTS[0])))
    f = follower(*ports)
    wait_until(lambda: f.state()["synced"], 10)
    # An instance added at runtime with the same engine's events is followed too.
    raw = {"name": "b", "url": "http://127.0.0.1:9", "kv_events": f"tcp://127.0.0.1:{ports[0]}"}
    f.loop.call(f.cluster.add, parse_instance(raw, "instance", {}))
    f.loop.call(f.events.sync)
    # Precise once it hears from the engine (a subscription takes a moment to land).
    deadline = time.monotonic() + 10
    while f.loop.call(f.cluster.prefixes.mode, "b") != "precise":
        assert time.monotonic() < deadline, "b never became precise"
        pub.publish(batch(stored(PROMPTS[1])))
        time.sleep(0.05)
    # Removed: no longer followed, and its record is gone.
    f.loop.call(f.cluster.remove, "a")
    f.loop.call(f.events.sync)
    assert set(f.cluster.prefixes.engines) == {"b"}
    pub.publish(batch(stored(PROMPTS[2])))
    wait_until(lambda: f.loop.call(f.cluster.prefixes.engines["b"].describe)["blocks"] == 6)


def test_a_publisher_that_is_not_vllms_leaves_the_instance_approximate(
    follower: Callable[..., Follower], ports: tuple[int, int]
) -> None:
    """A `kv_events` endpoint where some other ZMQ publisher sends (three frames,
    but no KVEventBatch in them) was taken for an engine that has nothing
    cached: the instance showed as precise, and its requests lost the credit
    of the text index. It stays approximate until a batch of vLLM's decodes."""
    import msgspec
    import zmq

    events, _ = ports
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{events}")
    f = follower(events, None)  # no replay: followed from the connection on
    try:
        seq = itertools.count()
        deadline = time.monotonic() + 10
        while f.state()["lost_gaps"] < 3 and time.monotonic() < deadline:
            pub.send_multipart([b"", next(seq).to_bytes(8, "big"), b"\x93not a batch"])
            time.sleep(0.05)
        assert f.state()["lost_gaps"] >= 3  # it read them, and could not decode them
        assert f.loop.call(f.cluster.prefixes.mode, "a") == "approximate"
        payload = msgspec.msgpack.encode(batch(stored(PROMPTS[0])))
        pub.send_multipart([b"", next(seq).to_bytes(8, "big"), payload])
        wait_until(lambda: f.loop.call(f.cluster.prefixes.mode, "a") == "precise")
    finally:
        pub.close(linger=0)
        context.term()
