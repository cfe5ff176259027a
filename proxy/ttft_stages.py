"""Where a stream's time to first token goes: five consecutive stages.

From the moment the handler starts (the `arrived` TTFT counts from) to the
moment the bytes of the first token are written to the client:
- `parse`: reading the body and validating it;
- `dispatch`: placing the request (the policy core, the ledger, the upstream
  body), and any attempt that failed before this one (a retry);
- `upstream_connect`: getting a connection to the instance, a pooled one or a
  new TCP connection (aiohttp's tracing signals say when it is ready);
- `upstream_first_byte`: from the connection to reading the upstream bytes that
  carry the first token: the request on the wire, the engine's queueing and
  prefill, and the wait for Ferry's event loop to get to those bytes;
- `relay`: from reading those bytes to having written them to the client.
The stages are consecutive, so they add up to the TTFT as the client sees it
(the write included). `parse`, `dispatch`, `upstream_connect` and `relay` are
Ferry's own cost; `upstream_first_byte` is mostly the engine's. A stream that
moves before its first token counts the move in `upstream_first_byte`.
Whole (non-streamed) answers have no first token and get no breakdown.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import aiohttp

STAGES = ("parse", "dispatch", "upstream_connect", "upstream_first_byte", "relay")


class TTFTStages:
    """The timestamps (monotonic seconds, from `clock`) that bound the stages."""

    __slots__ = ("clock", "arrived", "parsed", "sending", "connected", "read_at", "first_read")

    def __init__(self, clock: Callable[[], float], arrived: float, parsed: float) -> None:
        self.clock = clock
        self.arrived, self.parsed = arrived, parsed
        self.sending: float | None = None  # the current attempt's upstream call starts
        self.connected: float | None = None  # ... and has its connection
        self.read_at: float | None = None  # upstream bytes were last read
        self.first_read: float | None = None  # the bytes with the first token were read

    def send(self) -> None:
        """An upstream call starts (a retry or a move restarts the later stages)."""
        self.sending, self.connected = self.clock(), None

    def connect(self) -> None:
        if self.connected is None:
            self.connected = self.clock()

    def read(self) -> None:
        self.read_at = self.clock()

    def first_token(self) -> None:
        self.first_read = self.read_at

    def seconds(self, written: float) -> dict[str, float] | None:
        """Each stage's seconds, once the first token was written at `written`;
        None while any bound is missing."""
        sending, connected, first = self.sending, self.connected, self.first_read
        if sending is None or connected is None or first is None:
            return None
        bounds = (self.arrived, self.parsed, sending, connected, first, written)
        return {stage: bounds[i + 1] - bounds[i] for i, stage in enumerate(STAGES)}


def trace_config() -> aiohttp.TraceConfig:
    """Marks `connect()` on the `TTFTStages` a request is sent with
    (`trace_request_ctx=`), when aiohttp has its connection; any other call's
    context is left alone."""

    async def connected(_session: Any, context: SimpleNamespace, _params: Any) -> None:
        stages = context.trace_request_ctx
        if isinstance(stages, TTFTStages):
            stages.connect()

    config = aiohttp.TraceConfig()
    config.on_connection_create_end.append(connected)
    config.on_connection_reuseconn.append(connected)
    return config
