"""The block channel between two shim workers: TCP, one frame per KV block, acked.

Both ends run in the vLLM worker process on plain threads, so a slow network
never stalls an engine step: the step only snapshots blocks into bytes and
queues them. The sender paces itself to a bandwidth cap so that a migration
cannot starve the instance's decoding of CPU or network; the receiver checks
each block's checksum before it acks, and keeps staged blocks under a lease so
that blocks nobody claims are dropped.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from migration_shim import wire

log = logging.getLogger("ferry.shim.transport")

CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 30.0
# TCP keepalive on received connections (Linux names): probe after a minute idle.
_KEEPALIVE = [
    (getattr(socket, name), value)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)
]


@dataclass(frozen=True, slots=True)
class BlockCopy:
    mig_id: str
    dest: str  # "host:port" of the destination's receiver
    index: int  # the block's position in the request
    payload: bytes
    bandwidth: float  # bytes per second; 0 means unlimited


@dataclass(frozen=True, slots=True)
class Commit:
    """Queued after a migration's last block: once the blocks before it are
    through (or failed), the source may free the request's blocks."""

    mig_id: str
    req_id: str


@dataclass
class SenderProgress:
    acked: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    committed: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)


class BlockSender:
    def __init__(self, layout: dict[str, Any]) -> None:
        self.layout = layout
        self._jobs: queue.Queue[BlockCopy | Commit] = queue.Queue()
        self._lock = threading.Lock()
        self._progress = SenderProgress()
        self._acked: dict[str, int] = defaultdict(int)
        self._failed: dict[str, str] = {}
        self._sockets: dict[str, socket.socket] = {}
        self._next_send_at = 0.0
        threading.Thread(target=self._run, name="ferry-shim-sender", daemon=True).start()

    def submit(self, job: BlockCopy | Commit) -> None:
        self._jobs.put(job)

    def cancel(self, mig_id: str) -> None:
        """Send nothing more of a migration that was rolled back or ended."""
        with self._lock:
            self._failed.setdefault(mig_id, "cancelled")

    def take_progress(self) -> SenderProgress:
        """What changed since the last call (called once per engine step)."""
        with self._lock:
            progress, self._progress = self._progress, SenderProgress()
        return progress

    def _run(self) -> None:
        while True:
            if self._failed and self._jobs.empty():
                # No job of a cancelled or broken migration is left: forget them.
                with self._lock:
                    for mig_id in self._failed:
                        self._acked.pop(mig_id, None)
                    self._failed.clear()
            job = self._jobs.get()
            if isinstance(job, Commit):
                with self._lock:
                    self._progress.committed.add(job.mig_id)
                    self._progress.finished_sending.add(job.req_id)
                    self._acked.pop(job.mig_id, None)
                    self._failed.pop(job.mig_id, None)
                continue
            if job.mig_id in self._failed:
                continue  # cancelled, or its channel broke: it sends nothing more
            try:
                if not self._pace(job):
                    continue
                self._send(job)
            except (OSError, ConnectionError, ValueError) as exc:
                self._drop_socket(job.dest)
                why = f"{type(exc).__name__}: {exc}"
                log.warning("migration %s: sending block %d failed: %s", job.mig_id, job.index, why)
                with self._lock:
                    self._failed[job.mig_id] = why
                    self._progress.errors[job.mig_id] = why
                continue
            with self._lock:
                self._acked[job.mig_id] += 1
                self._progress.acked[job.mig_id] = self._acked[job.mig_id]

    def _pace(self, job: BlockCopy) -> bool:
        """Wait for the job's turn under its bandwidth cap; False if it was cancelled."""
        if job.bandwidth <= 0:
            return True
        start = max(time.monotonic(), self._next_send_at)
        self._next_send_at = start + len(job.payload) / job.bandwidth
        while (wait := start - time.monotonic()) > 0:
            time.sleep(min(wait, 0.05))
            if job.mig_id in self._failed:
                self._next_send_at = time.monotonic()
                return False
        return True

    def _send(self, job: BlockCopy) -> None:
        header = {"type": "block", "mig": job.mig_id, "index": job.index}
        while True:
            reused = job.dest in self._sockets
            sock = self._socket(job.dest)
            try:
                wire.send_frame(sock, {**header, "crc": wire.checksum(job.payload)}, job.payload)
                reply, _ = wire.recv_frame(sock)
                break
            except TimeoutError:
                raise
            except (OSError, ConnectionError):
                # A connection kept from an earlier migration may lead to a
                # process that is gone (the destination restarted on its port):
                # try once more on a new one. (A block sent again replaces itself.)
                self._drop_socket(job.dest)
                if not reused:
                    raise
        if not reply.get("ok"):
            raise ValueError(f"destination refused block {job.index}: {reply.get('error')}")

    def _socket(self, dest: str) -> socket.socket:
        sock = self._sockets.get(dest)
        if sock is not None:
            return sock
        host, port = dest.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            wire.send_frame(sock, {"type": "hello", "layout": self.layout})
            reply, _ = wire.recv_frame(sock)
        except BaseException:
            sock.close()
            raise
        if not reply.get("ok"):
            sock.close()
            raise ValueError(f"incompatible destination: {reply.get('error')}")
        self._sockets[dest] = sock
        return sock

    def _drop_socket(self, dest: str) -> None:
        sock = self._sockets.pop(dest, None)
        if sock is not None:
            sock.close()


@dataclass
class _Staged:
    blocks: dict[int, bytearray] = field(default_factory=dict)
    touched: float = 0.0
    prefix: int = 0  # blocks 0 .. prefix-1 are all here


class BlockReceiver:
    """Accepts blocks from other instances' senders into host staging memory."""

    def __init__(
        self, host: str, port: int, layout: dict[str, Any], *, lease_s: float, max_bytes: int
    ) -> None:
        self.layout = layout
        self.lease_s = lease_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._staged: dict[str, _Staged] = {}
        self._arrivals: dict[str, int] = {}  # prefixes grown since take_arrivals()
        self._bytes = 0
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="ferry-shim-receiver", daemon=True).start()

    def take(self, mig_id: str) -> dict[int, bytearray]:
        """The staged blocks of one migration, handed over once."""
        with self._lock:
            staged = self._staged.pop(mig_id, None)
            if staged is None:
                return {}
            self._bytes -= sum(len(b) for b in staged.blocks.values())
            return staged.blocks

    def take_arrivals(self) -> dict[str, int]:
        """Migrations whose gap-free prefix of staged blocks grew, and its length.
        Called every engine step, it also lets staged blocks no continuation
        came for age out (not only when other blocks arrive)."""
        with self._lock:
            self._expire(time.monotonic())
            arrivals, self._arrivals = self._arrivals, {}
        return arrivals

    def drop(self, mig_id: str) -> None:
        self.take(mig_id)

    def staged_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:  # out of files, say: the next one may do
                log.warning("ferry shim: accepting a block connection failed: %s", exc)
                time.sleep(0.1)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A source that vanished without a word (its host gone) is found out
            # and its thread ends; an idle one stays (it sends the next migration).
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in _KEEPALIVE:
                conn.setsockopt(socket.IPPROTO_TCP, option, value)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                header, _ = wire.recv_frame(conn, max_payload=0)
                why = wire.layout_mismatch(self.layout, header.get("layout") or {})
                wire.send_frame(conn, {"type": "hello", "ok": why is None, "error": why})
                if why is not None:
                    return
                while True:
                    header, payload = wire.recv_frame(conn, max_payload=self.max_bytes)
                    error = self._store(header, payload)
                    wire.send_frame(conn, {"type": "ack", "ok": error is None, "error": error})
            except (OSError, ConnectionError, ValueError):
                return  # the sender went away; its staged blocks age out under the lease
            except Exception as exc:  # noqa: BLE001 - a peer's frame must not end the worker
                log.warning("ferry shim: dropped a block connection: %r", exc)

    def _store(self, header: dict[str, Any], payload: bytearray) -> str | None:
        if wire.checksum(payload) != header.get("crc"):
            return "checksum mismatch"
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            if self._bytes + len(payload) > self.max_bytes:
                return f"staging full ({self._bytes} of {self.max_bytes} bytes)"
            staged = self._staged.setdefault(str(header["mig"]), _Staged())
            old = staged.blocks.get(int(header["index"]))
            self._bytes += len(payload) - (len(old) if old else 0)
            staged.blocks[int(header["index"])] = payload
            staged.touched = now
            if staged.prefix in staged.blocks:
                while staged.prefix in staged.blocks:
                    staged.prefix += 1
                self._arrivals[str(header["mig"])] = staged.prefix
        return None

    def _expire(self, now: float) -> None:
        for mig_id, staged in list(self._staged.items()):
            if now - staged.touched > self.lease_s:
                log.warning("migration %s: staged blocks unclaimed, dropped", mig_id)
                self._bytes -= sum(len(b) for b in staged.blocks.values())
                del self._staged[mig_id]
