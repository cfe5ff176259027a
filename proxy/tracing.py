"""OpenTelemetry spans, optional: `pip install 'llm-ferry[otel]'` and `server.otel: true`.

Each request gets one SERVER span, a child of the client's `traceparent` when it
sent one. Its context is what Ferry sends upstream (on continuations too), so an
engine that traces (vLLM's `--otlp-traces-endpoint`) nests its spans under
Ferry's. The span carries the request id, model, priority, final instance,
status, outcome, tokens and TTFT; each migration is an event on it. `ferry serve`
exports spans with the SDK's batch processor over OTLP/HTTP, from a thread of
its own (the event loop never waits); the standard `OTEL_*` variables
(`OTEL_EXPORTER_OTLP_ENDPOINT`, ...) configure it. Nothing here is imported
unless `server.otel` is on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.access_log import AccessRecord

MISSING = "server.otel needs OpenTelemetry: pip install 'llm-ferry[otel]'"


def install() -> None:
    """Set the process's tracer provider: OTLP over HTTP, batched off the loop."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(MISSING) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": "ferry"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


class Spans:
    """Starts and ends the span of each request (see the module docstring)."""

    def __init__(self) -> None:
        try:
            from opentelemetry import propagate, trace
        except ImportError as exc:
            raise RuntimeError(MISSING) from exc
        self._trace, self._propagate = trace, propagate
        self._tracer = trace.get_tracer("ferry")

    def start(self, record: AccessRecord, headers: Mapping[str, str]) -> Any:
        """Open the request's span; what goes upstream now carries its context."""
        trace = self._trace
        span = self._tracer.start_span(
            f"{record.method} {record.path}",
            context=self._propagate.extract(dict(headers)),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": record.method, "url.path": record.path},
        )
        carrier: dict[str, str] = {}
        self._propagate.inject(carrier, context=trace.set_span_in_context(span))
        record.upstream_headers.update(carrier)
        return span

    def end(self, span: Any, record: AccessRecord) -> None:
        attributes = {
            "ferry.request_id": record.id,
            "ferry.model": record.model,
            "ferry.priority": record.priority,
            "ferry.instance": record.instances[-1] if record.instances else None,
            "ferry.instances": record.instances,
            "ferry.outcome": record.outcome,
            "http.response.status_code": record.status,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "ferry.ttft_s": record.ttft_s,
        }
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        for move in record.migrations:
            span.add_event("migration", {k: v for k, v in move.items() if v is not None})
        if record.status is not None and record.status >= 500:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        span.end()
