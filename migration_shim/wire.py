"""What Ferry and the shim say to each other: HTTP routes, request tags, block frames.

This module imports neither vLLM nor torch, so the proxy can import it too and
both sides speak one protocol.

HTTP control routes (on each vLLM API server with the shim):
- `GET  INFO`: the shim's version, block size, KV layout and transport address.
- `POST RESERVE {"mig_id", "num_blocks", "lease_s"}`: the destination sets blocks aside.
- `POST RELEASE {"mig_id"}`: the destination frees a reservation and staged blocks.
- `POST MIGRATE {"mig_id", "tag", "dest_addr", "max_stages", "last_stage_blocks",
  "bandwidth_mb_s", "timeout_s"}`: the source pre-copies in stages, stops the
  request, sends the rest and answers with the engine's token ids.

Requests Ferry sends to a shim instance carry `kv_transfer_params`:
- `{TAG: "<id>"}` on every request, so the source can find it later;
- `{LOAD: {"mig_id", "num_tokens"}}` on a continuation whose KV was moved.

Block frames on the TCP channel between two shim workers: a 4-byte big-endian
header length, a JSON header, then `header["size"]` payload bytes.
"""

from __future__ import annotations

import json
import socket
import struct
import zlib
from typing import Any

SHIM_VERSION = "1"
SUPPORTED_VLLM = ("0.32.0",)  # the private engine APIs the shim hooks are pinned to

PREFIX = "/ferry/shim/"
INFO = PREFIX + "info"
RESERVE = PREFIX + "reserve"
RELEASE = PREFIX + "release"
MIGRATE = PREFIX + "migrate"

TAG = "ferry_tag"
LOAD = "ferry_load"

# Migration outcomes, as MIGRATE reports them.
STOPPED = "stopped"  # the KV is at the destination; continue there with LOAD
FAILED_BEFORE_STOP = "failed"  # rolled back: the request runs on at the source
SOURCE_FINISHED = "source_finished"  # the request ended at the source meanwhile
FAILED_AFTER_STOP = "failed_after_stop"  # source stopped, KV incomplete: recompute

_HEADER = struct.Struct(">I")
_MAX_HEADER = 1 << 20


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(payload)


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps({**header, "size": len(payload)}, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(head)) + head)
    if payload:
        sock.sendall(payload)


def recv_frame(
    sock: socket.socket, max_payload: int | None = None
) -> tuple[dict[str, Any], bytearray]:
    """One frame; ConnectionError for one no sender of this protocol would send
    (the size is checked before any room is made for the payload: the port
    takes any peer)."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > _MAX_HEADER:
        raise ConnectionError(f"frame header of {length} bytes")
    header = json.loads(_recv_exact(sock, length))
    size = header.get("size", 0) if isinstance(header, dict) else None
    if type(size) is not int or size < 0 or (max_payload is not None and size > max_payload):
        raise ConnectionError(f"a frame of {size!r} bytes")
    return header, _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes, in a writable buffer (torch can wrap it without a copy)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


LAYOUT_KEYS = ("model", "block_size", "dtype", "shapes", "isa")
INFO_LAYOUT_KEYS = ("model", "block_size", "dtype")  # the part INFO shows


def layout_mismatch(
    mine: dict[str, Any], theirs: dict[str, Any], keys: tuple[str, ...] = LAYOUT_KEYS
) -> str | None:
    """Why two instances cannot exchange KV blocks, or None if they can."""
    for key in keys:
        if mine.get(key) != theirs.get(key):
            return f"{key} differs: {mine.get(key)!r} here, {theirs.get(key)!r} there"
    return None
