"""Follow each engine's KV cache events: the I/O half of the precise prefix index.

One task per instance with a `kv_events:` endpoint subscribes (zmq SUB, on the
asyncio loop: pyzmq's sockets never block it) and feeds every batch to that
instance's `EngineBlocks` (proxy/engine_blocks.py), which keeps the set of
blocks the engine holds and says when to resync:

- On every (re)connection, seen on the socket's monitor, the record is reset
  and the engine's replay endpoint is asked for everything it buffers from seq
  0 (vLLM keeps the last 10,000 batches): a Ferry that starts after the engine,
  or an engine that restarts, is caught up at once. While disconnected the
  instance falls back to the approximate index.
- A gap in the sequence is replayed from the first missed batch; a gap the
  replay cannot fill (or with no replay endpoint) clears the record, which then
  fills again from what follows.
- A reconnection whose replay ends below the seq reached before is an engine
  restart: its cache is empty, and so is Ferry's text index of it.

Contract: `sync()` starts and stops tasks to match the instances' config (call
it after the fleet changes); `stop()` cancels and awaits them all and closes
the zmq context. The replay timeout is passed in, so tests control it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from adapters.kv_events import KVEvent, KVEventsDecodeError, KVEventsFormat
from proxy.cluster import Cluster
from proxy.engine_blocks import EngineBlocks
from proxy.faults import Faults

log = logging.getLogger("ferry.kv_events")


class UnreadableBatch(Exception):
    """A batch the engine's format does not decode: followed on from the next."""


@dataclass(frozen=True, slots=True)
class _Endpoints:
    events: str
    replay: str | None


class KVEvents:
    def __init__(self, cluster: Cluster, *, replay_timeout_s: float = 2.0) -> None:
        self.cluster = cluster
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self._context = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[_Endpoints, asyncio.Task[None]]] = {}

    def sync(self) -> None:
        """Follow every instance that has a `kv_events:` endpoint, as configured now."""
        wanted: dict[str, _Endpoints] = {}
        for name, state in self.cluster.instances.items():
            config = state.config
            if config.kv_events and state.adapter.kv_events is not None:
                wanted[name] = _Endpoints(config.kv_events, config.kv_events_replay)
        for name, (endpoints, task) in list(self._tasks.items()):
            if wanted.get(name) != endpoints:
                task.cancel()
                del self._tasks[name]
                self.cluster.prefixes.forget_engine(name)
        for name, endpoints in wanted.items():
            if name not in self._tasks:
                fmt = self.cluster.instances[name].adapter.kv_events
                assert fmt is not None  # as checked above
                self.cluster.prefixes.engine(name, fmt)  # shown (unsynced) from now on
                task = asyncio.create_task(self._follow(name, endpoints), name=f"kv-events-{name}")
                self._tasks[name] = (endpoints, task)

    async def stop(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._context.destroy(linger=0)

    # -- one instance ----------------------------------------------------------------
    async def _follow(self, name: str, endpoints: _Endpoints) -> None:
        fmt = self.cluster.instances[name].adapter.kv_events
        assert fmt is not None  # sync() follows only engines that publish
        prefixes = self.cluster.prefixes
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        faults = Faults(log, f"a kv events batch of {name}")
        unreadable = Faults(log, f"reading kv events of {name}")
        try:
            try:
                sub.connect(endpoints.events)
            except zmq.ZMQError as exc:
                log.error(
                    "kv events of %s: cannot subscribe to %s: %s; its prefix index"
                    " stays approximate",
                    name,
                    endpoints.events,
                    exc,
                )
                return
            while True:
                ready = dict(await poller.poll())
                # Looked up each time: a reconfigured instance's record is a new one.
                engine = prefixes.engine(name, fmt)
                try:
                    if monitor in ready:
                        event = parse_monitor_message(await monitor.recv_multipart())
                        await self._connection(name, engine, fmt, endpoints, event["event"])
                    if sub in ready:
                        frames = await sub.recv_multipart()
                        if len(frames) != 3:  # (topic, seq, payload)
                            raise KVEventsDecodeError(f"{len(frames)} frames, not 3")
                        seq = int.from_bytes(frames[1], "big")
                        await self._batch(name, engine, fmt, endpoints, seq, frames[2])
                except UnreadableBatch as exc:
                    unreadable.failed(exc)
                except (KVEventsDecodeError, zmq.ZMQError) as exc:
                    # Start over: the next batch replays everything from seq 0.
                    unreadable.failed(exc)
                    engine.reset()
                except Exception as exc:  # noqa: BLE001 - the follower must outlive any batch
                    # Events no check foresaw (another publisher's, a bug): what the
                    # index holds may be wrong now, so it starts over, as after a gap.
                    faults.failed(exc)
                    engine.reset()
                else:
                    faults.ok()
                    unreadable.ok()
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _connection(
        self, name: str, engine: EngineBlocks, fmt: KVEventsFormat, ends: _Endpoints, event: int
    ) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            log.info("kv events of %s: disconnected", name)
            engine.reset()
            return
        reached, clears = engine.reached, engine.clears
        engine.reset()
        if ends.replay is None:
            engine.follow()
        else:
            await self._replay(engine, fmt, ends.replay, engine.begin_replay(0))
            if not engine.synced:
                engine.follow()  # no answer: follow what comes, incomplete
        engine.restarted_while_away(reached)
        self._cleared(name, engine, clears)
        log.info("kv events of %s: connected, %s", name, engine.describe())

    async def _batch(
        self,
        name: str,
        engine: EngineBlocks,
        fmt: KVEventsFormat,
        ends: _Endpoints,
        seq: int,
        payload: bytes,
    ) -> None:
        clears = engine.clears
        try:
            events: list[KVEvent] = fmt.decode(payload)
        except KVEventsDecodeError as exc:
            engine.lost(seq + 1)  # followed on from the next one, incomplete
            # (The same words each time: another publisher's messages are logged
            # once a minute, the decoder's reason in the traceback.)
            raise UnreadableBatch(f"a batch of {name} is unreadable") from exc
        start = engine.receive(seq, events)
        if start is not None:
            log.info("kv events of %s: gap before %d, replaying from %d", name, seq, start)
            if ends.replay is not None:
                await self._replay(engine, fmt, ends.replay, start)
            if engine.next_seq is None or engine.next_seq < seq:
                engine.lost(seq)
            engine.receive(seq, events)
        self._cleared(name, engine, clears)

    async def _replay(
        self, engine: EngineBlocks, fmt: KVEventsFormat, endpoint: str, start: int
    ) -> None:
        """Ask for every buffered batch from `start` and apply them; returns at the
        end marker (the engine is caught up) or after a silent `replay_timeout`."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(self.replay_timeout_ms):
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                _empty, _topic, seq_frame, payload = frames
                if seq_frame == fmt.replay_end:
                    engine.replay_done()
                    return
                seq = int.from_bytes(seq_frame, "big")
                try:
                    events = fmt.decode(payload)
                except KVEventsDecodeError:
                    engine.lost(seq + 1)
                    continue
                if not engine.replayed(seq, events):  # the engine no longer has the gap
                    engine.lost(seq)
                    engine.replayed(seq, events)
            log.warning("kv events: no replay from %s in %d ms", endpoint, self.replay_timeout_ms)
        finally:
            dealer.close(linger=0)

    def _cleared(self, name: str, engine: EngineBlocks, clears_before: int) -> None:
        if engine.clears != clears_before:
            self.cluster.prefixes.engine_cleared(name)
