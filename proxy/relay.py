"""Forwarding one OpenAI request: place it, call the instance, relay the answer.

The request is billed in the ledger before the upstream call starts (a `Call`)
and released when the call closes, whatever happens: finish, upstream error, or
client disconnect (aiohttp cancels the handler; closing the upstream connection
makes vLLM abort the request). Before anything reaches the client, a connect
failure, an upstream 5xx (or a stream that opens with a server error event),
any other answer that is not one (a redirect, a 2xx other than 200, a 401/403
to the credentials Ferry sent) or a 429 with Retry-After is retried on another
instance, up to `retries` times; a connect failure also marks the instance
unreachable until a scrape succeeds, and failed calls in a row eject it for a
while (proxy/ejection.py). A stream on a migration-enabled instance is handed to a
`LiveStream`, which can go on elsewhere (failover, drain, rebalance, priority).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from migration_shim import wire
from proxy import access_log, client_auth, continuation, sse, tap, token_ids
from proxy.cluster import Cluster
from proxy.errors import anthropic_route, error_response
from proxy.live_stream import LiveStream, Request
from proxy.metrics import INSTANCE_FAILURES, FerryMetrics
from proxy.migrator import Migrator
from proxy.openai_request import OFF_LOOP_BYTES, PRIORITY_HEADER
from proxy.placement import Placement
from proxy.policy import DispatchRequest, NoCandidate, Priority
from proxy.policy.view import shown
from proxy.policy.virtual_usage import request_blocks
from proxy.splicer import Splicer, only_ids, server_fault
from proxy.ttft_stages import TTFTStages
from proxy.upstream import (
    Call,
    InstanceStopped,
    OutOfFiles,
    Upstreams,
    answer_headers,
    encoded_against_ask,
    writable,
)

log = logging.getLogger("ferry.relay")

SESSION_HEADER = "x-session-id"  # a soft affinity (the body's `user` stands in without it)
# A client's headers go on as it sent them (vLLM reads some: X-Vllm-Priority,
# X-Session-ID, X-data-parallel-rank), but for these: hop-by-hop ones (RFC 9110
# 7.6.1), those of the body and its encoding (Ferry sends its own body and asks
# for identity), and Ferry's own. Its request id and trace context
# (access_log.TRACE_HEADERS) go on every call, continuations included.
_NOT_FORWARDED = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "expect",
        "content-length", "content-type", "content-encoding", "accept-encoding", "via",
        access_log.REQUEST_ID, *access_log.TRACE_HEADERS, PRIORITY_HEADER,
    }
)  # fmt: skip
_INSTANCE_FAILURES = frozenset(INSTANCE_FAILURES)


class Relay:
    def __init__(
        self,
        cluster: Cluster,
        placement: Placement,
        upstreams: Upstreams,
        migrator: Migrator,
        metrics: FerryMetrics,
        clock: Callable[[], float],
        *,
        retry_after_s: int,
        max_resumes: int,
        retries: int = 1,
    ) -> None:
        self.cluster = cluster
        self.placement = placement
        self.upstreams = upstreams
        self.migrator = migrator
        self.metrics = metrics
        self.clock = clock
        # Instances that could not count a prompt (`_counted`), until when they are not asked.
        self._uncounted: dict[str, float] = {}
        # The bodies (their hashes) of streams an engine gave up mid-way with its
        # error event, the latest GIVEN_UP_KEPT (see `_given_up_before`).
        self._given_up: OrderedDict[int, None] = OrderedDict()
        self.retry_after = str(retry_after_s)
        self.retries = retries
        self.max_resumes = max_resumes
        # This process, in the `Via` of what it sends on: a request that comes
        # back with it went round (an instance's URL that leads to Ferry).
        self.hop = f"ferry-{uuid.uuid4().hex[:12]}"

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any] | None,
        raw: bytes,
        *,
        model: str | None,
        priority: Priority,
        prompt_estimate: int,
        arrived: float,
        parsed: float | None = None,
        stream: bool = False,
        endpoint: str = "completions",
    ) -> web.StreamResponse:
        """Relay a request to the instance the policy picks. `body` is None for a
        pass-through call, sent as it came and answered as the instance answers;
        `stream` says whether its body asked for a stream (an idle timeout applies);
        `endpoint` how a body Ferry read reads ("chat" or "completions").
        `arrived` and `parsed` (monotonic seconds) bound the TTFT's first stage."""
        stream = stream if body is None else bool(body.get("stream"))
        record = access_log.record_of(request)
        record.model, record.priority = model and shown(model), priority.name.lower()
        via = request.headers.getall("Via", [])
        if any(self.hop in hop for hop in via):
            message = "the request came back to Ferry: an instance's URL leads to Ferry itself"
            return error_response(508, message, code="loop_detected")
        headers = forwarded_headers(request)
        headers.update(record.upstream_headers)
        headers["Via"] = ", ".join([*via, f"1.1 {self.hop}"])
        # A body Ferry read goes on as the JSON it re-encodes; any other as it
        # came, Content-Type and all (a charset, a multipart boundary).
        content_type = (
            "application/json" if body is not None else request.headers.get("Content-Type")
        )
        if content_type:
            headers["Content-Type"] = content_type
        tried: set[str] = set()
        failed: web.StreamResponse | None = None  # the last failure, answered if none is left
        retried: list[str] = []  # instances whose 5xx was tried again elsewhere (see _judge)
        key = self.placement.prefix_key(body, prompt_estimate, request.headers.get(SESSION_HEADER))
        asked = continuation.asked_budget(body, endpoint) if body is not None else None
        reach = None
        if asked is not None and body is not None:
            reach = prompt_estimate + asked
            bound = len(raw) + asked + (CHAT_TEMPLATE_TOKENS if endpoint == "chat" else 0)
            if model is not None and self._may_outreach(model, asked + 1, bound):
                counted = await self._counted(model, body, endpoint)
                reach = (prompt_estimate if counted is None else counted) + asked
        stages = None
        if stream and body is not None and parsed is not None:
            stages = TTFTStages(self.clock, arrived, parsed)
        # A failed call to try again (instance, why): a retry once another
        # instance is found for it; else the failure is the answer, and no retry.
        again: tuple[str, str] | None = None
        for attempt in range(self.retries + 1):
            try:
                chosen, cached = self.placement.choose(
                    DispatchRequest(model, prompt_estimate, priority, frozenset(tried), panic=True),
                    key,
                    reach,
                )
            except NoCandidate as exc:
                # A request an instance failed is answered by a draining one
                # where no other is left, as a broken stream is resumed there.
                rescue = None if failed is None else self.placement.rescue(model, frozenset(tried))
                if rescue is None:
                    if failed is not None:
                        self._judge(retried, "no_instance")
                        return failed
                    record.outcome = "model_not_found" if exc.model_unknown else "no_instance"
                    if exc.model_unknown:
                        return error_response(
                            404, exc.reason, code="model_not_found", param="model"
                        )
                    return error_response(
                        503,
                        exc.reason,
                        code="no_instance",
                        headers={"Retry-After": self.retry_after},
                    )
                chosen, cached = rescue, 0
            if again is not None:
                self._retrying(record, *again)
                again = None
            name = chosen.name
            record.instances.append(name)
            record.model_label = self.metrics.model_label(
                model, self.cluster.instances[name].models
            )
            timing = sse.TokenTiming(self.metrics, self.clock, arrived, record.model_label, stages)
            if priority is Priority.HIGH:
                blocks = request_blocks(prompt_estimate, self.cluster.block_size(name))
                self.migrator.make_room(chosen, blocks)
            upstream_body, wants_ids = self._upstream_body(name, body, priority)
            tag = None
            if stream and upstream_body and self.cluster.instances[name].migration_mode == "full":
                # Full mode: the tag lets the instance's shim find this request later.
                tag = uuid.uuid4().hex
                params = {**(upstream_body.get("kv_transfer_params") or {}), wire.TAG: tag}
                upstream_body = {**upstream_body, "kv_transfer_params": params}
            # Billed before the first await: an instance with nothing billed can
            # be removed meanwhile (a large body is encoded in a thread), and
            # the call then went to a name no longer there.
            call = self.upstreams.begin(
                name,
                model or "",
                priority,
                prompt_estimate,
                arrived,
                cached,
                watched=stream and body is not None,
            )
            try:
                data = raw if upstream_body is None else await _encoded(upstream_body, len(raw))
            except BaseException:
                call.close()
                raise
            try:
                upstream = await self.upstreams.send(
                    call,
                    request.method,
                    path,
                    data,
                    stream=stream,
                    headers=headers,
                    params=request.query,
                    stages=stages,
                )
            except OutOfFiles as exc:  # Ferry's own shortage: another instance fares no better
                record.outcome = "out_of_files"
                self._judge(retried, record.outcome)
                self._count(name, record.outcome, str(exc))
                return error_response(
                    503,
                    str(exc),
                    code="ferry_overloaded",
                    headers={"Retry-After": self.retry_after},
                )
            except aiohttp.ClientError as exc:  # nothing reached the client: try another
                outcome = (
                    "connect_error" if isinstance(exc, sse.CONNECT_ERRORS) else "upstream_error"
                )
                self._count(name, outcome, _describe(exc))
                if attempt < self.retries:
                    again = (name, outcome)
                record.outcome = outcome
                failed = error_response(
                    503,
                    f"instance {name} failed before answering: {_describe(exc)}",
                    code="no_instance",
                    headers={"Retry-After": self.retry_after},
                )
                tried.add(name)
                continue
            except asyncio.CancelledError:  # before the instance answered
                outcome = sse.cancelled(request)
                self._judge(retried, outcome)
                self._count(name, outcome, outcome)
                raise
            outcome = "error"
            error: str | None = None  # what broke, where it says more than the outcome
            live: LiveStream | None = None
            ending: StreamEnd | None = None
            try:
                if upstream.status != 200:
                    ours = _sends_credentials(self.cluster.instances[name].config)
                    response, outcome = await self._whole(
                        upstream, call, wants_ids, body is None, ours=ours
                    )
                    shorter = self._no_longer_context(name, model, upstream.status, response)
                    unserved = (
                        upstream.status == 404 and body is not None and _model_unknown(response)
                    )
                    state = self.cluster.instances.get(name)
                    if unserved and state is not None:  # a route it has: it lacks the model
                        state.models_stale = True
                    if (_retryable(upstream, outcome) or shorter or unserved) and (
                        attempt < self.retries
                    ):
                        again = (name, str(upstream.status))
                        failed = response
                        tried.add(name)
                        tried.update(shorter)
                        continue
                    return response
                # A server that answers a stream request whole (it ignored
                # `stream`) is answered whole; anything but JSON is taken as a
                # stream, as it came.
                answered_whole = upstream.content_type == "application/json"
                if answered_whole:
                    call.entry.watched = False  # its tokens come only at its end
                elif body is not None and stream and (encoding := encoded_against_ask(upstream)):
                    # Ferry reads each event of a stream (its tokens, its end, a
                    # move), and does not inflate a server's gzip on the event loop.
                    raise NothingRelayed(
                        f"its stream came with Content-Encoding {encoding}, though Ferry asks"
                        " for identity"
                    )
                live = (
                    None
                    if answered_whole
                    else self._live(
                        call, body, path, endpoint, priority, wants_ids, tag, timing, headers
                    )
                )
                if live is not None:
                    self.migrator.register(live)
                    try:
                        response, outcome = await live.run(request)
                    finally:
                        self.migrator.unregister(live)
                        name = live.instance
                        record.instances.extend(m["to"] for m in live.moves)
                        record.migrations = live.moves
                elif body is None and upstream.content_type == "text/event-stream":
                    # A pass-through event stream (a streamed /v1/responses): byte for byte.
                    if self.cluster.instances[name].config.migration != "off":
                        # Not OpenAI's chunks: nothing to continue from (a drain waits for it).
                        self.metrics.non_migratable.labels("passed through").inc()
                        log.info("request on %s not migratable: passed through", name)
                    response, outcome = await self._pipe(request, upstream, call, _as_is)
                elif body is not None and stream and not answered_whole:
                    ending = StreamEnd.of(body, endpoint)
                    response, outcome = await self._stream(
                        request,
                        upstream,
                        call,
                        wants_ids,
                        timing,
                        ending,
                        token_ids.PromptCount(body),
                    )
                else:
                    try:
                        answer = await self.upstreams.read_whole(call)
                    except sse.STREAM_ERRORS as exc:
                        raise NothingRelayed(_describe(exc)) from exc
                    encoded = "Content-Encoding" in upstream.headers  # passed on as it is
                    if body is not None and not encoded and not _json_object(answer):
                        # Not an answer (a gateway's page, a body cut short):
                        # another instance can give one.
                        raise NothingRelayed("answered 200 with a body that is not a JSON object")
                    if body is not None and not encoded and len(answer) <= PARSED_ANSWER_BYTES:
                        # A server error sent with a 200: a 5xx answer, as
                        # when a stream opens with one (ErrorFirst).
                        if (fault := _server_error(answer)) is not None:
                            raise ErrorFirst(fault)
                    response, outcome = await self._whole(
                        upstream,
                        call,
                        wants_ids,
                        passthrough=body is None,
                        raw=answer,
                        prompts=token_ids.PromptCount(body),
                    )
                    if isinstance(response, web.Response):
                        call.close()  # the instance is done: its load leaves the ledger
                        response, taken = await sse.send_whole(request, response)
                        outcome = outcome if taken else "client_disconnect"
                return response
            except ErrorFirst as exc:
                # A stream that opened with a server error event (vLLM's when its
                # engine has died) is a 5xx answer sent as a stream: tried
                # elsewhere, and judged as one (a request that fails every
                # instance it tries is held against none of them).
                outcome, error = "upstream_5xx", str(exc)
                failed = error_response(
                    502, f"instance {name} answered with an error: {exc}", code="upstream_error"
                )
                if attempt == self.retries:
                    return failed
                again = (name, "error_event")
                tried.add(name)
                continue
            except NothingRelayed as exc:
                # Headers came, the body broke before any of it reached the
                # client: another instance can answer, as when the call breaks
                # before its headers.
                outcome, error = "upstream_error", str(exc)
                failed = _upstream_failed(name, exc.__cause__ or exc)
                if attempt == self.retries:
                    return failed
                again = (name, outcome)
                tried.add(name)
                continue
            except asyncio.CancelledError:
                # A client that hung up once its stream was whole (at its
                # [DONE], before the body's end) had its answer.
                outcome = "ok" if ending is not None and ending.done else sse.cancelled(request)
                raise
            finally:
                call.close()
                if outcome == "upstream_5xx" and name in tried:  # the next attempt judges it
                    retried.append(name)
                else:
                    poison = self._judge(retried, outcome) or (live is not None and live.poison)
                    # A stream that cannot move, given up by its engine's error
                    # event, whose body was given up so before: the request is
                    # what the engines fail on (vLLM fails some sampling options
                    # mid-stream), and one client repeating it must not eject
                    # instances. An instance that gives up other requests so is
                    # held to each.
                    repeated = (
                        outcome == "stream_broken"
                        and ending is not None
                        and ending.fault is not None
                        and self._given_up_before(raw)
                    )
                    self._count(name, outcome, error or outcome, blame=not (poison or repeated))
                _note_end(record, outcome, timing, call, live)
        assert failed is not None  # every attempt that does not return sets it
        self._judge(retried, "no_instance")
        return failed

    def _no_longer_context(
        self, name: str, model: str | None, status: int, response: web.StreamResponse
    ) -> set[str]:
        """Where the request went too long for `name`'s context (its engine's
        400 says so) and another instance serves the model with a longer one:
        the instances to pass over for it, `name`'s context or shorter. Empty
        otherwise: the 400 is the client's answer."""
        if status != 400 or model is None or not isinstance(response, web.Response):
            return set()
        context = self.cluster.context_length(name, model)
        if context is None or not _too_long(response.body):
            return set()
        lengths = {
            v.name: self.cluster.context_length(v.name, model)
            for v in self.cluster.view().instances
            if v.dispatchable and model in v.models
        }
        if not any(length is not None and length > context for length in lengths.values()):
            return set()
        return {n for n, length in lengths.items() if length is None or length <= context}

    def _given_up_before(self, raw: bytes) -> bool:
        """Whether a stream of this very body was given up by an engine before
        (among the latest GIVEN_UP_KEPT); it is remembered now."""
        key = hash(raw)
        seen = key in self._given_up
        self._given_up[key] = None
        self._given_up.move_to_end(key)
        if len(self._given_up) > GIVEN_UP_KEPT:
            self._given_up.popitem(last=False)
        return seen

    def _retrying(self, record: access_log.AccessRecord, name: str, reason: str) -> None:
        """Count a call to `name` that failed before any byte reached the client
        and is tried again elsewhere."""
        self.metrics.retries.labels(reason).inc()
        record.retries.append({"instance": name, "reason": reason})

    def _judge(self, retried: list[str], outcome: str) -> bool:
        """Count the 5xx answers a request was retried after, now that its next
        call ended with `outcome`; whether the request is poison: a 5xx there too
        means every instance it tried failed it, which is the request's doing (a
        body the engine chokes on), so none of them is held to it. Otherwise one
        client could eject every instance."""
        poison = bool(retried) and outcome == "upstream_5xx"
        for name in retried:
            self._count(name, "upstream_5xx", "upstream_5xx", blame=not poison)
        retried.clear()
        return poison

    def _count(self, name: str, outcome: str, error: str, *, blame: bool = True) -> None:
        """Count a finished call, and hold failures against its instance (unless
        not to `blame`)."""
        self.metrics.requests.labels(name, outcome).inc()
        if outcome in _INSTANCE_FAILURES:
            # (Without an access log, the one word of it but the counter.)
            log.info("call to %s failed (%s): %s", name, outcome, error)
        if outcome in _INSTANCE_FAILURES and blame:
            self._blame(name, error)
        elif outcome in ("ok", "upstream_4xx"):
            self.cluster.record_call_success(name)

    def _blame(self, name: str, error: str) -> None:
        """Hold a failed call against its instance: enough in a row eject it."""
        if self.cluster.record_call_failure(name, error):
            self.metrics.ejections.labels(name).inc()
            log.warning("instance %s ejected after failed calls: %s", name, error)

    def _upstream_body(
        self, name: str, body: dict[str, Any] | None, priority: Priority
    ) -> tuple[dict[str, Any] | None, bool]:
        """The body for `name` (None: a pass-through, sent as it came) and whether
        its answer goes to the client as it comes: its engine's adapter says what
        makes it report token ids, and an engine without them is sent nothing
        extra; an engine that schedules by priority is sent `priority`."""
        if body is None:
            return None, True
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and (wire.TAG in params or wire.LOAD in params):
            # Ferry's own names there: the shim takes them as Ferry's word.
            mine = (wire.TAG, wire.LOAD)
            body = {
                **body,
                "kv_transfer_params": {k: v for k, v in params.items() if k not in mine},
            }
        fields = self.cluster.instances[name].adapter.token_id_request_fields
        upstream_body, wants_ids = token_ids.upstream_body(body, fields)
        return self.upstreams.with_priority(name, upstream_body, priority), wants_ids

    def _live(
        self,
        call: Call,
        body: dict[str, Any] | None,
        path: str,
        endpoint: str,
        priority: Priority,
        wants_ids: bool,
        tag: str | None,
        timing: sse.TokenTiming,
        headers: dict[str, str],
    ) -> LiveStream | None:
        """A movable stream, or None where migration does not apply (a move
        continues from the token ids, so the engine must report them)."""
        name = call.instance
        state = self.cluster.instances[name]
        if body is None or state.config.migration == "off" or not state.adapter.returns_token_ids:
            return None
        model = str(body.get("model", ""))
        context = self.cluster.context_length(name, model)
        why = continuation.not_migratable(body, endpoint)
        if why is None and continuation.budget(body, endpoint, 0, context) is None:
            # A chat without a budget runs to the end of the context; a
            # continuation (a completion) needs it said, and no card says it.
            why = "budget unknown"
        if why is not None:
            if body.get("stream"):
                # The reason's detail, after a colon, is the client's (a field's
                # name): not a label value.
                self.metrics.non_migratable.labels(why.partition(":")[0]).inc()
                log.info("request on %s not migratable: %s", name, why)
            return None
        request = Request(
            self.migrator.next_id(),
            body,
            endpoint,
            path,
            priority,
            model,
            # The client's (its key included) on every continuation; a rank is
            # the first instance's (vLLM refuses one past its own ranks).
            headers={k: v for k, v in headers.items() if k.lower() != "x-data-parallel-rank"},
            context=context,
        )
        return LiveStream(
            request,
            call,
            Splicer(body, endpoint, wants_ids),
            upstreams=self.upstreams,
            placement=self.placement,
            metrics=self.metrics,
            timing=timing,
            clock=self.clock,
            max_resumes=self.max_resumes,
            tag=tag,
            blame=self._blame,
        )

    async def _whole(
        self,
        upstream: aiohttp.ClientResponse,
        call: Call,
        wants_ids: bool,
        passthrough: bool,
        raw: bytes | None = None,
        *,
        ours: bool = False,
        prompts: token_ids.PromptCount | None = None,
    ) -> tuple[web.StreamResponse, str]:
        """The instance's whole answer (`raw`, if read already) for the client;
        `prompts` counts its prompt tokens from the ids it reports.
        An answer that is not one (a redirect, an interim status, a 2xx other
        than 200 to a request Ferry read, a 401/403 to the credentials Ferry
        sent: `ours`) is the instance's failure, a 502; a 4xx that is not JSON
        (a gateway's page; not one compressed, passed on as it is) is put in
        the OpenAI error shape."""
        if raw is None:
            try:
                raw = await self.upstreams.read_whole(call)
            except sse.STREAM_ERRORS as exc:
                return _upstream_failed(call.instance, exc), "upstream_error"
        status = upstream.status
        if status >= 500:
            message = f"instance {call.instance} answered HTTP {status}: {_message_of(raw)}"
            return error_response(502, message, code="upstream_error"), "upstream_5xx"
        if 300 <= status < 400:  # not followed: to where, past the proxy?
            where = upstream.headers.get("Location", "nowhere")
            message = f"instance {call.instance} answered HTTP {status}, a redirect to {where}"
            return error_response(502, message, code="upstream_error"), "upstream_error"
        if status < 200:  # an interim status (101 Switching Protocols) is no answer
            message = f"instance {call.instance} answered HTTP {status}, not a final status"
            return error_response(502, message, code="upstream_error"), "upstream_error"
        if status != 200 and status < 300 and not passthrough:  # a 204 to a completion
            message = f"instance {call.instance} answered HTTP {status}, not an answer"
            return error_response(502, message, code="upstream_error"), "upstream_error"
        if status in (401, 403) and ours:
            # The credentials were Ferry's (the instance's `api_key`): the
            # instance's configuration is wrong, not the client's key.
            message = (
                f"instance {call.instance} refused Ferry's credentials (HTTP {status}): "
                f"{_message_of(raw)}; check its api_key"
            )
            return error_response(502, message, code="upstream_error"), "upstream_error"
        if status >= 400 and "Content-Encoding" not in upstream.headers and not _json_object(raw):
            message = f"instance {call.instance} answered HTTP {status}: {_message_of(raw)}"
            outcome = "upstream_429" if status == 429 else "upstream_4xx"
            headers = answer_headers(upstream)
            headers["x-ferry-instance"] = call.instance
            answer = error_response(status, message, code="upstream_error", headers=headers)
            return answer, outcome
        outcome = "ok" if status < 400 else "upstream_429" if status == 429 else "upstream_4xx"
        if status == 200 and not passthrough:
            raw = self._account_whole(raw, call, wants_ids, prompts or token_ids.PromptCount(None))
        headers = answer_headers(upstream)
        kind = upstream.headers.get("Content-Type", "application/json")
        headers["Content-Type"] = kind if writable(kind) else "application/json"
        headers["x-ferry-instance"] = call.instance
        encoding = upstream.headers.get("Content-Encoding")
        if encoding is not None and writable(encoding):  # compressed though asked not to be
            headers["Content-Encoding"] = encoding
        response = web.Response(status=status, body=raw, headers=headers)
        return response, outcome

    def _account_whole(
        self, raw: bytes, call: Call, wants_ids: bool, prompts: token_ids.PromptCount
    ) -> bytes:
        prompt, longest, generated, seen = token_ids.scan(raw)
        if prompt is not None:
            prompt = prompts.add(prompt, longest)
        if not seen:  # an engine that reports no token ids: estimate them
            prompt, generated, _ = token_ids.estimate(raw, call.entry.generated_tokens)
        if prompt is not None:
            self.cluster.ledger.set_prompt_tokens(call.entry, prompt)
            self._index_prompt(call.instance, raw, seen)
        self.cluster.ledger.add_generated(call.entry, generated)
        return raw if wants_ids else token_ids.hide(raw)

    def _index_prompt(self, name: str, data: bytes, seen: bool) -> None:
        """Index the prompt ids the engine reported (the approximate prefix index)."""
        if seen and self.cluster.prefixes.enabled:
            ids = token_ids.prompt_ids(data)
            if ids:
                self.placement.record_prompt_ids(name, ids)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        call: Call,
        wants_ids: bool,
        timing: sse.TokenTiming,
        ending: StreamEnd,
        prompts: token_ids.PromptCount,
    ) -> tuple[web.StreamResponse, str]:
        """A stream that cannot move: relay its events as they come."""
        events = sse.Events(self.upstreams.max_answer_bytes)
        keep_alive = self._keep_alive()
        chat = ending.chat

        def relay(data: bytes) -> bytes:
            """The whole events received so far, accounted for, as the client gets them.
            The bytes go on as they came (the ids nulled in one pass over them), not
            split and framed again event by event: this runs for every chunk."""
            whole = events.take(data)
            if not whole:
                return b""
            seen = False
            for event in whole.split(b"\n\n")[:-1]:
                if self._account_event(event, call, timing, prompts):
                    seen = True
                elif ending.fault is None:  # no ids: an error event is one such
                    ending.fault = _error_in(event)
            if not ending.said_done:
                ending.read(whole)
            if not seen or wants_ids:
                return whole
            if chat and _EMPTY_DELTA in whole:
                whole = _without_id_only_chunks(whole)
                if not whole:  # tokens, though none the client sees: progress
                    keep_alive.progressed()
            return token_ids.hide(whole)

        return await self._pipe(
            request,
            upstream,
            call,
            relay,
            timing,
            lambda: ending.done,
            lambda: ending.fault,
            keep_alive,
            lambda: b"" if ending.said_done else sse.DONE,
        )

    async def _pipe(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        call: Call,
        relay: Callable[[bytes], bytes],
        timing: sse.TokenTiming | None = None,
        complete: Callable[[], bool] | None = None,
        fault: Callable[[], str | None] | None = None,
        keep_alive: sse.KeepAliveWatch | None = None,
        owed: Callable[[], bytes] | None = None,
    ) -> tuple[web.StreamResponse, str]:
        """Write what `relay` makes of the upstream's bytes to the client as they
        come. A body that ends before `complete()` says it may (an instance that
        closed a stream it had not finished) ends with an error event. The client's
        headers wait for the first bytes it is sent: until then the stream has
        sent nothing, so a failure (`NothingRelayed`) can go to another instance
        as a whole answer's can. On an instance that stops answering, a stream
        quiet since its last bytes is given up (proxy/upstream.py's `Waits`):
        before its first it goes elsewhere, after it ends with the error event,
        not `upstream_idle_timeout_s` later. Where `fault()`
        names a server error in what was read (an error event, an abort), the
        call failed: before any byte went out it is tried elsewhere
        (`ErrorFirst`); after, its bytes go on as they came and its outcome is
        `stream_broken`. A stream whole by `complete()` is ended with what
        `owed()` says its client lacks (its [DONE]), however its body ended."""
        response: web.StreamResponse | None = None
        whole = True  # what the client has ends with a whole event
        content = upstream.content
        keep_alive = keep_alive or self._keep_alive()

        waiting = self.upstreams.waits(call.instance, call.entry.model)

        def read(data: bytes) -> bytes:
            waiting.heard()
            if timing is not None:
                timing.read()
            return relay(data)

        def wrote(out: bytes) -> None:
            nonlocal whole
            if not out:  # a read that ended no event: bytes, but no progress
                keep_alive.saw(out)
                return
            whole = out.endswith(b"\n\n")
            if timing is not None:
                timing.written()
            keep_alive.saw(out)
            if complete is not None and complete():
                waiting.whole_in(sse.BODY_END_GRACE_S)

        try:
            async with waiting:
                data = await content.readany()
                # readany() itself, not iter_any(): one coroutine layer less per chunk.
                while data:
                    out = read(data)
                    if out:
                        if response is None:
                            failed = fault() if fault is not None else None
                            if failed is not None:
                                raise ErrorFirst(failed)
                            events = relay is not _as_is  # a pass-through's are as they come
                            passed = answer_headers(upstream)
                            encoding = upstream.headers.get("Content-Encoding")
                            if not events and encoding is not None and writable(encoding):
                                passed["Content-Encoding"] = encoding  # its bytes go as they came
                            response = await sse.open_response(
                                request, call.instance, events, passed
                            )
                            # From here chunks go out from the connection's callback
                            # while the client keeps up (proxy/tap.py), and come here otherwise.
                            transport = sse.client_transport(response)
                            tap.attach_to(content, response, transport, read, wrote, upstream)
                        await sse.write(response, out)
                    wrote(out)
                    data = await content.readany()
            if complete is not None and not complete():
                raise aiohttp.ClientPayloadError("the stream ended before its [DONE]")
        except sse.STREAM_ERRORS as exc:
            if response is None:
                raise NothingRelayed(_describe(exc)) from exc
            if complete is not None and complete():  # it broke after the end: no matter
                return response, await _ended(response, owed)
            message = f"instance {call.instance} broke the stream: {_describe(exc)}"
            cut = b"" if whole else b"\n\n"  # end the event the break cut in half
            end = cut + (
                sse.anthropic_error_event(502, message)
                if anthropic_route(request.path)
                else sse.error_event(502, message, "upstream_error")
            )
            # Then [DONE], as vLLM ends a stream it fails (a passed-through stream,
            # such as a Responses one, is not OpenAI's chunks: none there).
            await sse.finish(response, end + sse.DONE if complete is not None else end)
            return response, "stream_broken"
        except ConnectionResetError:  # sse.ClientGone: the client left
            return response or web.Response(status=499), "client_disconnect"
        finally:
            tap.detach(content)
        if response is None:  # an empty body, and nothing said it was short
            response = await sse.open_response(
                request, call.instance, True, answer_headers(upstream)
            )
        finished = complete is not None and complete()
        outcome = await _ended(response, owed if finished else None)
        return response, "stream_broken" if fault is not None and fault() else outcome

    def _may_outreach(self, model: str, least: int, bound: int) -> bool:
        """Whether a request of `least` to `bound` tokens (its budget and one
        token of prompt; its body's bytes, a chat's template and its budget: a
        token is a byte or more) may or may not fit the context of an instance
        of `model`, so that its count decides. The estimate of its prompt (a
        token every 3 bytes of its text) undercounts a small vocabulary and a
        chat's template: placed on it alone, a request went where vLLM cut its
        budget short, with no error."""
        lengths, shortest = self.cluster.contexts(model)
        if bound <= shortest:  # (the common case: it fits every one)
            return False
        if shortest == max(lengths.values(), default=0):  # one context: no choice to make
            return False
        return any(least <= length < bound for length in lengths.values())

    async def _counted(self, model: str, body: dict[str, Any], endpoint: str) -> int | None:
        """The prompt's tokens as an instance of `model` counts them (vLLM's
        `/tokenize`, chat template included); None where none can say."""
        if endpoint == "chat":
            ask = {k: body[k] for k in _TOKENIZE_CHAT_KEYS if k in body}
        elif isinstance(body.get("prompt"), str):
            ask = {"prompt": body["prompt"]}
        else:
            return None  # token ids are counted exactly already; a batch is not one prompt
        cluster, now = self.cluster, self.clock()
        counters = [
            name
            for name, state in cluster.instances.items()
            if state.healthy
            and not state.draining
            and state.config.engine == "vllm"  # (the engine with /tokenize)
            and model in state.models
            and not cluster.ejected_for(name)
            and self._uncounted.get(name, 0.0) <= now
        ]
        if not counters:
            return None
        counter = min(counters, key=cluster.ledger.count)  # the least busy
        answer = await self.upstreams.post_bytes(
            counter, "/tokenize", {"model": model, **ask}, timeout_s=TOKENIZE_TIMEOUT_S
        )
        count = _count_in(answer) if answer is not None else None
        if count is None:  # it cannot count: not asked again for a while
            self._uncounted[counter] = now + UNCOUNTED_S
        return count

    def _keep_alive(self) -> sse.KeepAliveWatch:
        return sse.KeepAliveWatch(self.upstreams.stream_timeout.sock_read or 0.0, self.clock)

    def _account_event(
        self, event: bytes, call: Call, timing: sse.TokenTiming, prompts: token_ids.PromptCount
    ) -> bool:
        """Credit one event's tokens to the ledger and the timing; whether it
        carried token-id fields (the engine reports them)."""
        data = sse.data_of(event)
        if data is None or not data.startswith(b"{"):  # [DONE], comments, other fields
            return False
        prompt, longest, generated, seen = token_ids.scan(data)
        if prompt is not None:
            prompt = prompts.add(prompt, longest, data)
        token = generated > 0
        if not seen:  # an engine that reports no token ids: estimate them
            prompt, generated, token = token_ids.estimate(data, call.entry.generated_tokens)
        if prompt is not None:
            self.cluster.ledger.set_prompt_tokens(call.entry, prompt)
            self._index_prompt(call.instance, data, seen)
        if generated:
            self.cluster.ledger.add_generated(call.entry, generated)
        if token:
            timing.token(call.instance)
        return seen


# A chat template's tokens, at most, beyond its messages' bytes (Llama 3's adds a
# system block of about 30).
CHAT_TEMPLATE_TOKENS = 64
# What of a chat request `/tokenize` counts (vLLM's TokenizeChatRequest).
_TOKENIZE_CHAT_KEYS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
GIVEN_UP_KEPT = 1024  # bodies of streams given up by an engine, remembered (Relay._given_up)
TOKENIZE_TIMEOUT_S = 2.0  # past it, the estimate places the request
UNCOUNTED_S = 30.0  # an instance that could not count is not asked for so long
# `/tokenize`'s answer begins with its count (vLLM's field order); the token ids
# after it (a megabyte for a long prompt) are not parsed on the event loop.
_COUNT = re.compile(rb'^\s*\{\s*"count"\s*:\s*(\d+)\s*[,}]')


def _count_in(answer: bytes) -> int | None:
    found = _COUNT.match(answer[:64])
    return int(found.group(1)) if found else None


class NothingRelayed(Exception):
    """An answer that failed before any of it reached the client."""


class ErrorFirst(Exception):
    """A stream whose first events say the server failed it (its message)."""


def _sends_credentials(instance: Any) -> bool:
    """Whether Ferry sends the instance credentials of its own (its `api_key`,
    or an Authorization in its `headers`): a 401 is then the configuration's
    doing. Otherwise it is the client's, whose own Authorization (or none)
    went on as it came: a client must not get instances ejected by sending no key."""
    return any(k.lower() == "authorization" for k in instance.auth_headers())


def forwarded_headers(request: web.Request) -> dict[str, str]:
    """The client's headers an instance is sent (`_NOT_FORWARDED`)."""
    dropped = _NOT_FORWARDED
    if "Connection" in request.headers:  # and the headers it names, hop-by-hop too
        named = request.headers.getall("Connection")
        dropped = dropped | {t.strip().lower() for v in named for t in v.split(",")}
    if request.get(client_auth.CHECKED):  # a client key Ferry checked is its own
        dropped = dropped | {"authorization"}
    return {k: v for k, v in request.headers.items() if k.lower() not in dropped}


async def _encoded(body: dict[str, Any], size: int) -> bytes:
    """`body` as JSON, written in a worker thread where the client's was large
    (`size` bytes): a chat of a million content parts took the event loop
    a tenth of a second."""
    if size <= OFF_LOOP_BYTES:
        return sse.dumps(body)
    return await asyncio.to_thread(sse.dumps, body)


class StreamEnd:
    """Whether a stream has ended, so that a body that stops before is known to
    be cut short: its [DONE] came, or else a finish reason for every choice it
    has (n per prompt) and, if the client asked for it, the usage chunk (no
    choices) that follows them. Some OpenAI-compatible servers send no [DONE].
    Substring searches on the bytes: half a regex's cost per chunk."""

    __slots__ = (
        "chat", "choices", "done", "fault", "finishes", "said_done", "wants_usage", "_usage"
    )  # fmt: skip

    def __init__(
        self, choices: int, wants_usage: bool, chat: bool = False, continuous: bool = False
    ) -> None:
        self.choices, self.wants_usage, self.chat = choices, wants_usage, chat
        # What says the usage came: with `continuous_usage_stats` every chunk has
        # one, and the last comes with no choices.
        self._usage = _USAGE_ALONE if continuous else _USAGE
        self.finishes = 0
        self.done = False
        self.said_done = False  # its [DONE] came (some servers end without one)
        # A server error the stream reported (an error event, which the relay
        # looks for among events without ids, or an abort): the instance
        # failed it, whatever came after.
        self.fault: str | None = None

    @classmethod
    def of(cls, body: dict[str, Any], endpoint: str) -> StreamEnd:
        n = body.get("n")
        choices = n if type(n) is int and n > 0 else 1
        if endpoint == "completions":  # n choices for each prompt, and each prompt_embeds
            choices *= max(_prompts(body.get("prompt")) + _prompts(body.get("prompt_embeds")), 1)
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        wants_usage = options.get("include_usage") is True
        continuous = wants_usage and options.get("continuous_usage_stats") is True
        return cls(choices, wants_usage, chat=endpoint == "chat", continuous=continuous)

    def read(self, events: bytes) -> None:
        """Take in whole events (each one's blank line included)."""
        if self.done:  # (a finish reason for every choice): only its [DONE] is looked for
            self.said_done = _done_in(events)
            return
        # An abort first: vLLM's [DONE] follows it, often in the same read.
        finishes = events.count(b'"finish_reason":"') + events.count(b'"finish_reason": "')
        if finishes and self.fault is None and any(a in events for a in _ABORTS):
            self.fault = 'the engine gave the request up (finish_reason "abort")'
        if _done_in(events):
            self.done = self.said_done = True
            return
        self.finishes += finishes
        if self.finishes >= self.choices:
            # vLLM sends the usage in a chunk of its own, with no choices; other
            # servers with the last choice's, or with `"choices": null`.
            if self.wants_usage and not any(u in events for u in self._usage):
                return
            self.done = True


_ABORTS = (b'"finish_reason":"abort"', b'"finish_reason": "abort"')  # as finishes are counted
# A usage that is one (not null): a stream that asked for it has it.
_USAGE = (b'"usage":{', b'"usage": {')
_USAGE_ALONE = (b'"choices":[]', b'"choices": []', b'"choices":null', b'"choices": null')


def _error_in(events: bytes) -> str | None:
    """The message of a server error event among these, if there is one (an
    error the request caused, a 4xx code, is the client's answer)."""
    for event in events.split(b"\n\n"):
        data = sse.data_of(event)
        if data is not None and (fault := _server_error(data)) is not None:
            return fault
    return None


def _server_error(data: bytes) -> str | None:
    """The message of the server error that an event's data, or a whole answer,
    is (`{"error": ...}` with a 5xx code, or none), if it is one."""
    if b'"error"' not in data:
        return None
    try:
        answer = sse.loads(data)
    except (ValueError, RecursionError):
        return None
    if isinstance(answer, dict) and "error" in answer and server_fault(answer["error"]):
        error = answer["error"]
        message = error.get("message") if isinstance(error, dict) else error
        return str(message)[:500]
    return None


def _prompts(value: Any) -> int:
    """Prompts in a completion's `prompt` (or `prompt_embeds`): a list of them, one, or none."""
    if value is None:
        return 0
    return (
        len(value) if isinstance(value, list) and value and isinstance(value[0], str | list) else 1
    )


_EMPTY_DELTA = b'"delta":{}'


def _without_id_only_chunks(events: bytes) -> bytes:
    """These events less the chat chunks there only for the token ids Ferry
    asked for (`splicer.only_ids`): the client did not ask, and vLLM sends
    it none."""
    kept = []
    for event in events.split(b"\n\n")[:-1]:
        data = sse.data_of(event)
        if data is not None and _EMPTY_DELTA in data:
            try:
                chunk = sse.loads(data)
            except (ValueError, RecursionError):
                chunk = None
            if isinstance(chunk, dict) and isinstance(chunk.get("choices"), list):
                if only_ids(chunk["choices"]):
                    continue
        kept.append(event + b"\n\n")
    return b"".join(kept)


def _done_in(events: bytes) -> bool:
    """A [DONE] event among these (not the words in some text)."""
    return (
        events.startswith((b"data: [DONE]", b"data:[DONE]"))
        or b"\n\ndata: [DONE]" in events
        or b"\n\ndata:[DONE]" in events
    )


def _note_end(
    record: access_log.AccessRecord,
    outcome: str,
    timing: sse.TokenTiming,
    call: Call,
    live: LiveStream | None,
) -> None:
    """What the access log and the token counters say of the call that ended: the
    tokens as the client got them (a moved stream's whole prompt and generation)."""
    record.outcome, record.ttft_s = outcome, timing.ttft
    record.ttft_stages_s = timing.stage_seconds
    entry = call.entry
    # The engine's count; else Ferry's estimate, for what the engine prefilled
    # without saying (it answered, or sent tokens; not what it refused).
    served = entry.prompt_exact or outcome == "ok" or entry.generated_tokens > 0
    prompt = entry.prompt_tokens if served else None
    completion = entry.generated_tokens
    if live is not None:
        ids = live.splicer.prompt_ids
        prompt = len(ids) if ids is not None else prompt
        completion = len(live.splicer.generated)
    record.prompt_tokens, record.completion_tokens = prompt, completion


async def _ended(response: web.StreamResponse, owed: Callable[[], bytes] | None = None) -> str:
    """End a whole stream, with what `owed()` says its client lacks (a [DONE] its
    instance did not send): its outcome, "ok" unless the client missed its end."""
    return "ok" if await sse.finish(response, owed() if owed else None) else "client_disconnect"


def _retryable(upstream: aiohttp.ClientResponse, outcome: str) -> bool:
    """An answer worth trying elsewhere: the instance failed (a 5xx, or no
    answer: `_whole`'s outcome says) or is busy and says when to come back
    (429 with Retry-After)."""
    if outcome in _INSTANCE_FAILURES:
        return True
    return upstream.status == 429 and "Retry-After" in upstream.headers


def _model_unknown(response: web.StreamResponse) -> bool:
    """Whether an engine's 404 says the model is unknown (vLLM: "The model `m`
    does not exist.", param "model"), not the route."""
    if not isinstance(response, web.Response) or not isinstance(response.body, bytes):
        return False
    text = response.body[:4096].lower()
    return b"model" in text and (b"does not exist" in text or b"not found" in text)


def _too_long(body: Any) -> bool:
    """Whether an engine's 400 says the request exceeds its context: vLLM's
    "maximum context length", "max_model_len"; OpenAI's code for it."""
    if not isinstance(body, bytes):
        return False
    text = body[:4096].lower()
    return any(sign in text for sign in (b"context length", b"max_model_len", b"context_length"))


def _as_is(data: bytes) -> bytes:
    return data


def _describe(exc: BaseException) -> str:
    if isinstance(exc, InstanceStopped):
        return str(exc)
    if isinstance(exc, sse.KeptAliveOnly):
        return f"{exc} (server.upstream_idle_timeout_s)"
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return (
            "no data within the upstream timeout (server.upstream_idle_timeout_s for"
            " a stream, upstream_read_timeout_s for a whole answer)"
        )
    return f"{type(exc).__name__}: {exc}"


def _upstream_failed(instance: str, exc: BaseException) -> web.Response:
    return error_response(
        502, f"instance {instance} failed: {_describe(exc)}", code="upstream_error"
    )


# A whole answer up to this size is parsed to tell whether it is JSON (orjson:
# a few microseconds for a chat answer); a larger one (embeddings, tens of MB)
# only by its ends, because a parse holds the GIL, and so the event loop, for
# as long as it takes (tenths of a second at 48 MB).
PARSED_ANSWER_BYTES = 1 << 20


def _json_object(raw: bytes) -> bool:
    """Whether `raw` is a JSON object (past `PARSED_ANSWER_BYTES`, only whether
    it looks like one, by its ends)."""
    stripped = raw.strip()
    if not (stripped.startswith(b"{") and stripped.endswith(b"}")):
        return False
    if len(raw) > PARSED_ANSWER_BYTES:
        return True
    try:
        return isinstance(sse.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def _message_of(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return raw[:200].decode(errors="replace")
