"""Following one request: its id, its trace context, and its line in the access log.

Every request gets an id: the client's `x-request-id` when it sent a usable one
(1 to 128 visible ASCII characters), else a fresh one. The id is returned on
every answer (errors and streams included: it is set as the headers go out) and
sent upstream with the W3C `traceparent`/`tracestate`, on the first call and on
every continuation of a moved stream, so an engine's logs and a tracing backend
join what Ferry did.

With `server.access_log: true`, each request ends with one JSON line on the
`ferry.access` logger (`ferry serve` writes it to stdout, message only):

    {"ts": "...", "request_id": "...", "method": "POST", "path": "/v1/chat/completions",
     "status": 200, "outcome": "ok", "model": "m", "priority": "normal",
     "instance": "b", "instances": ["a", "b"], "retries": [{"instance": ..., "reason": ...}],
     "prompt_tokens": 12, "completion_tokens": 40, "ttft_s": 0.041,
     "ttft_stages_s": {"parse": 0.00004, "dispatch": 0.00003, "upstream_connect": 0.0002,
                       "upstream_first_byte": 0.0405, "relay": 0.0001},
     "duration_s": 0.52,
     "migrations": [{"from": "a", "to": "b", "reason": "drain", "after_tokens": 17,
                     "downtime_s": 0.012}]}

`instances` is every instance the request was sent to, in order (retries and
moves); `instance` the one that finished it. `ttft_stages_s` is where a
stream's TTFT went, stage by stage (proxy/ttft_stages.py). Fields Ferry does not know for a
request (no tokens for a 404) are null. Probes and scrapes (`QUIET_PATHS`) get an
id but no line. Writing a line is one `logging` call to
a stream handler; nothing else touches a file on the request path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy import sse
from proxy.metrics import FerryMetrics


class Spans(Protocol):
    """What the middleware needs of tracing (proxy/tracing.py implements it)."""

    def start(self, record: AccessRecord, headers: Any) -> Any: ...

    def end(self, span: Any, record: AccessRecord) -> None: ...


log = logging.getLogger("ferry.access")

REQUEST_ID = "x-request-id"
TRACE_HEADERS = ("traceparent", "tracestate")
_MAX_ID = 128
QUIET_PATHS = frozenset({"/metrics", "/health", "/livez", "/readyz", "/ping"})


@dataclass(slots=True)
class AccessRecord:
    """What one request did; the relay fills it in as it goes."""

    id: str
    method: str
    path: str
    arrived: float  # monotonic seconds
    model: str | None = None
    model_label: str = "none"  # the bounded `model` metric label
    priority: str | None = None
    instances: list[str] = field(default_factory=list)
    retries: list[dict[str, str]] = field(default_factory=list)
    migrations: list[dict[str, Any]] = field(default_factory=list)
    status: int | None = None
    outcome: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    ttft_stages_s: dict[str, float] | None = None  # proxy/ttft_stages.py, streams only
    duration_s: float | None = None
    upstream_headers: dict[str, str] = field(default_factory=dict)  # id and trace context

    def line(self) -> str:
        return json.dumps(
            {
                "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "request_id": self.id,
                "method": self.method,
                "path": self.path,
                "status": self.status,
                "outcome": self.outcome,
                "model": self.model,
                "priority": self.priority,
                "instance": self.instances[-1] if self.instances else None,
                "instances": self.instances,
                "retries": self.retries,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "ttft_s": _round(self.ttft_s),
                "ttft_stages_s": _stages(self.ttft_stages_s),
                "duration_s": _round(self.duration_s),
                "migrations": self.migrations,
            },
            separators=(",", ":"),
        )


RECORD = web.RequestKey("ferry_access_record", AccessRecord)


def record_of(request: web.Request) -> AccessRecord:
    """The request's record (a detached one where the middleware did not run)."""
    record = request.get(RECORD)
    if record is None:
        record = request[RECORD] = _new_record(request)
    return record


def middleware(metrics: FerryMetrics, enabled: bool, spans: Spans | None = None) -> Any:
    """Give each request its id and record (and span, with `spans`); at its end,
    observe its duration and tokens and, when `enabled`, write its line."""

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        record = request[RECORD] = _new_record(request)
        span = spans.start(record, request.headers) if spans is not None else None
        try:
            response = await handler(request)
            if record.status is None:  # a stream has its status once prepared
                record.status = response.status
            return response
        except web.HTTPException as exc:
            record.status = exc.status
            raise
        except asyncio.CancelledError:  # the client hung up, or a shutdown cut it
            record.outcome = sse.cancelled(request)
            raise
        except Exception:
            record.status = 500
            raise
        finally:
            if record.outcome == "client_disconnect":
                record.status = 499  # nginx's code for it
            elif record.outcome == "shutdown":
                record.status = 503
            _finish(record, metrics, enabled)
            if span is not None:
                assert spans is not None
                spans.end(span, record)

    return observe


def _finish(record: AccessRecord, metrics: FerryMetrics, enabled: bool) -> None:
    record.duration_s = time.monotonic() - record.arrived
    if record.instances and record.outcome is not None:
        labels = (record.model_label, record.instances[-1])
        metrics.duration.labels(*labels).observe(record.duration_s)
        if record.prompt_tokens:
            metrics.prompt_tokens.labels(*labels).inc(record.prompt_tokens)
        if record.completion_tokens:
            metrics.generation_tokens.labels(*labels).inc(record.completion_tokens)
    if record.path in QUIET_PATHS:
        return
    if record.status is not None:
        metrics.answered(record.status)
    if enabled and log.isEnabledFor(logging.INFO):
        log.info(record.line())


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every answer carries the request's id."""
    record = request.get(RECORD)
    if record is not None:
        response.headers[REQUEST_ID] = record.id
        if record.status is None:
            record.status = response.status


def install_handler(stream: Any = None) -> None:
    """Write access lines to `stream` (stdout), message only, apart from other logs.
    They were asked for by name: the process's log level (`--log-level WARNING`)
    does not silence them."""
    handler = logging.StreamHandler(sys.stdout if stream is None else stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _new_record(request: web.Request) -> AccessRecord:
    rid = request.headers.get(REQUEST_ID, "")
    if not (0 < len(rid) <= _MAX_ID and all("!" <= c <= "~" for c in rid)):
        rid = uuid.uuid4().hex
    upstream = {REQUEST_ID: rid}
    for name in TRACE_HEADERS:
        value = request.headers.get(name)
        if value:
            upstream[name] = value
    return AccessRecord(
        rid, request.method, request.path, time.monotonic(), upstream_headers=upstream
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _stages(seconds: dict[str, float] | None) -> dict[str, float] | None:
    return None if seconds is None else {k: round(v, 6) for k, v in seconds.items()}
