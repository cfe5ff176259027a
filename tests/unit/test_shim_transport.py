"""The shim's block channel (plain sockets and threads; no vLLM needed)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import warnings

import pytest

from migration_shim import wire
from migration_shim.transport import BlockCopy, BlockReceiver, BlockSender, Commit
from tests.helpers import free_port, wait_until

LAYOUT = {"model": "m", "block_size": 128, "dtype": "float32", "shapes": [[2, 128, 8]], "isa": "x"}


def receiver(**options: object) -> BlockReceiver:
    settings = {"lease_s": 60.0, "max_bytes": 1 << 24, **options}
    return BlockReceiver("127.0.0.1", free_port(), LAYOUT, **settings)  # type: ignore[arg-type]


def collect(sender: BlockSender, until: object, timeout: float = 10) -> dict[str, object]:
    """Progress gathered until `until(progress)` holds."""
    seen: dict[str, object] = {"acked": {}, "errors": {}, "committed": set(), "finished": set()}

    def step() -> bool:
        p = sender.take_progress()
        seen["acked"].update(p.acked)  # type: ignore[attr-defined]
        seen["errors"].update(p.errors)  # type: ignore[attr-defined]
        seen["committed"] |= p.committed  # type: ignore[operator]
        seen["finished"] |= p.finished_sending  # type: ignore[operator]
        return bool(until(seen))  # type: ignore[operator]

    wait_until(step, timeout=timeout, poll=0.01)
    return seen


def test_blocks_arrive_whole_and_the_commit_follows_them() -> None:
    rx = receiver()
    tx = BlockSender(LAYOUT)
    blocks = {i: bytes([i]) * 4096 for i in range(3)}
    for i, payload in blocks.items():
        tx.submit(BlockCopy("m1", rx.address, i, payload, 0))
    tx.submit(Commit("m1", "req-1"))
    seen = collect(tx, lambda s: "m1" in s["committed"])
    assert seen["acked"] == {"m1": 3} and seen["finished"] == {"req-1"} and not seen["errors"]
    assert rx.take("m1") == blocks
    assert rx.take("m1") == {} and rx.staged_bytes() == 0  # handed over once


def test_an_incompatible_destination_is_refused() -> None:
    rx = receiver()
    tx = BlockSender({**LAYOUT, "dtype": "bfloat16"})
    tx.submit(BlockCopy("m1", rx.address, 0, b"x" * 10, 0))
    seen = collect(tx, lambda s: s["errors"])
    assert "dtype differs" in seen["errors"]["m1"]  # type: ignore[index]
    assert rx.take("m1") == {}


def test_a_corrupted_block_is_not_acked() -> None:
    rx = receiver()
    host, port = rx.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        wire.send_frame(sock, {"type": "hello", "layout": LAYOUT})
        assert wire.recv_frame(sock)[0]["ok"]
        payload = b"y" * 100
        wire.send_frame(sock, {"type": "block", "mig": "m", "index": 0, "crc": 1}, payload)
        reply, _ = wire.recv_frame(sock)
    assert not reply["ok"] and reply["error"] == "checksum mismatch"
    assert rx.take("m") == {}


def test_a_dead_destination_fails_the_migration_but_still_frees_the_source() -> None:
    tx = BlockSender(LAYOUT)
    tx.submit(BlockCopy("m1", f"127.0.0.1:{free_port()}", 0, b"z" * 10, 0))
    tx.submit(Commit("m1", "req-1"))
    seen = collect(tx, lambda s: "m1" in s["committed"])
    assert "m1" in seen["errors"] and seen["finished"] == {"req-1"}


def test_the_bandwidth_cap_paces_sends() -> None:
    rx = receiver()
    tx = BlockSender(LAYOUT)
    started = time.monotonic()
    for i in range(4):  # 400 kB at 1 MB/s: at least 0.3 s after the first block
        tx.submit(BlockCopy("m1", rx.address, i, b"b" * 100_000, 1e6))
    collect(tx, lambda s: s["acked"].get("m1") == 4)  # type: ignore[attr-defined]
    assert time.monotonic() - started >= 0.3


def test_a_cancelled_migration_sends_nothing_more() -> None:
    rx = receiver()
    tx = BlockSender(LAYOUT)
    for i in range(5):  # 5 s of sending at this cap
        tx.submit(BlockCopy("m1", rx.address, i, b"c" * 100_000, 1e5))
    collect(tx, lambda s: s["acked"].get("m1") == 1)  # type: ignore[attr-defined]
    tx.cancel("m1")
    tx.submit(BlockCopy("m2", rx.address, 0, b"d" * 10, 0))
    seen = collect(tx, lambda s: s["acked"].get("m2") == 1, timeout=3)  # type: ignore[attr-defined]
    assert seen["acked"].get("m1", 1) <= 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("reason", ["lease", "capacity"])
def test_staging_is_bounded(reason: str) -> None:
    rx = receiver(lease_s=0.1) if reason == "lease" else receiver(max_bytes=150_000)
    tx = BlockSender(LAYOUT)
    tx.submit(BlockCopy("old", rx.address, 0, b"o" * 100_000, 0))
    collect(tx, lambda s: s["acked"].get("old") == 1)  # type: ignore[attr-defined]
    time.sleep(0.2)
    tx.submit(BlockCopy("new", rx.address, 0, b"n" * 100_000, 0))
    seen = collect(tx, lambda s: s["acked"].get("new") or s["errors"])  # type: ignore[attr-defined]
    if reason == "lease":  # unclaimed blocks age out and make room
        assert seen["acked"].get("new") == 1 and rx.take("old") == {}  # type: ignore[attr-defined]
        time.sleep(0.2)  # and without another arrival: an engine step's look ages them out
        rx.take_arrivals()
        assert rx.staged_bytes() == 0
    else:
        assert "staging full" in seen["errors"]["new"]  # type: ignore[index]


def test_layout_mismatch_names_the_difference() -> None:
    assert wire.layout_mismatch(LAYOUT, dict(LAYOUT)) is None
    assert "block_size differs" in str(wire.layout_mismatch(LAYOUT, {**LAYOUT, "block_size": 16}))


def test_the_worker_keeps_no_record_of_requests_that_never_migrate() -> None:
    """vLLM lists every request that finishes; the worker kept each id for good
    (a leak on every shim instance). Only a stopped request whose last blocks
    are on their way is kept, until vLLM may free its blocks."""
    with warnings.catch_warnings():  # vLLM's and torch's imports warn of deprecations
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm")
        from migration_shim.orders import CopyOrder, StepOrders
        from migration_shim.transport import SenderProgress
        from migration_shim.worker_side import MigrationWorker

    class Sender:
        def __init__(self) -> None:
            self.sent: list[object] = []
            self.done: set[str] = set()

        def submit(self, job: object) -> None:
            self.sent.append(job)

        def take_progress(self) -> SenderProgress:
            progress = SenderProgress()
            progress.finished_sending |= self.done
            self.done = set()
            return progress

    worker = MigrationWorker("m", 16, 8, {})
    sender = worker.sender = Sender()  # type: ignore[assignment]
    worker.receiver = object()  # type: ignore[assignment]
    for step in range(100):  # requests that finish without ever migrating
        assert worker.get_finished({f"other-{step}"}) == (None, None)
    stop = CopyOrder("mig", "dest:1", [], 0.0, final_req_id="moved")
    worker.wait_for_save(StepOrders(copies=[stop]))
    assert worker.get_finished({"moved", "other"}) == (None, None)  # its blocks still go
    sender.done = {"moved"}
    assert worker.get_finished(set()) == ({"moved"}, None)
    assert worker.seen_finished == worker.unreported == set()
    assert worker.awaiting == set()


@pytest.mark.parametrize(
    "frame",
    [
        {"type": "hello", "layout": LAYOUT, "size": 1 << 40},  # room made before any check
        [1, 2],  # not an object: KeyError, TypeError in the receiver's thread
        {"type": "hello", "layout": LAYOUT, "size": "many"},
    ],
    ids=["huge", "list", "size-text"],
)
def test_a_hostile_peer_is_dropped_and_the_receiver_goes_on(frame: object) -> None:
    """The block port takes any peer: a frame no sender would send closes that
    connection, makes no room for a payload it announces, and leaves the
    receiver serving the next source."""
    import json
    import struct

    rx = receiver()
    host, port = rx.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as peer:
        head = json.dumps(frame).encode()
        peer.sendall(struct.pack(">I", len(head)) + head)
        peer.settimeout(5)
        assert peer.recv(1) == b""  # closed on it
    tx = BlockSender(LAYOUT)
    tx.submit(BlockCopy("m", rx.address, 0, b"b" * 1000, 0))
    collect(tx, lambda s: s["acked"].get("m") == 1)  # type: ignore[attr-defined]


def _receiver_process(port: int) -> subprocess.Popen[bytes]:
    code = (
        "import sys, time\n"
        "from migration_shim.transport import BlockReceiver\n"
        f"BlockReceiver('127.0.0.1', {port}, {LAYOUT!r}, lease_s=60.0, max_bytes=1 << 24)\n"
        "print('up', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
    return proc


def test_a_destination_restarted_on_its_port_takes_the_next_migration() -> None:
    """A destination instance that died and came back on the same KV port (a crash
    and restart, a rolling update) must take the next migration sent to it. The
    sender kept its connection to the dead process and sent the next migration's
    first block into it: that migration failed (BrokenPipe / reset), so the move
    was rolled back and recomputed."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    tx = BlockSender(LAYOUT)
    first = _receiver_process(port)
    try:
        tx.submit(BlockCopy("m1", address, 0, b"a" * 4096, 0))
        seen = collect(tx, lambda s: s["acked"].get("m1") == 1 or s["errors"])
        assert seen["acked"] == {"m1": 1} and not seen["errors"]
    finally:
        first.kill()
        first.wait(10)
    second = _receiver_process(port)
    try:
        tx.submit(BlockCopy("m2", address, 0, b"b" * 4096, 0))
        seen = collect(tx, lambda s: s["acked"].get("m2") == 1 or s["errors"])
        assert seen["errors"] == {} and seen["acked"] == {"m2": 1}
    finally:
        second.kill()
        second.wait(10)
