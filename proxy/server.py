"""The Ferry HTTP service: built in one place, opened and closed with the app.

Routes:
- the OpenAI API: `/v1/completions` and `/v1/chat/completions` (read, placed,
  movable), `/v1/models` (the cluster's), and every other `/v1/*`
  (`/v1/responses`, `/v1/embeddings`, `/v1/score`, `/v1/rerank`, ...) passed through;
- vLLM's routes outside `/v1` (`ENGINE_ROUTES`: `/tokenize`, `/detokenize`,
  `/pooling`, `/classify`, `/score`, `/rerank`, `/v2/rerank`, `/v2/embed`, ...),
  passed through, and `GET /version`;
- SageMaker's `POST /invocations`, read as the chat or completion its body is;
- `/health`, `/livez`, `/readyz` (and vLLM's `/ping`), `/metrics` and `/admin/*`.
A pass-through call goes to an instance serving its JSON body's `model` (one
that names none, to the model vLLM would answer it with: `_implied_model`) and
is answered as the instance answers: a stream as it comes, byte for byte,
anything else whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import resource
import signal
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import HttpVersion11, hdrs, web
from aiohttp.helpers import parse_mimetype
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler

from proxy import (
    access_log,
    admin,
    client_auth,
    openai_request,
    request_body,
    sse,
    tracing,
    ttft_stages,
)
from proxy.cluster import Cluster
from proxy.config import FerryConfig, SchedulerConfig, ServerConfig, redacted
from proxy.discovery import Discovery
from proxy.errors import (
    MAX_HEADER_LINE_BYTES,
    MAX_REQUEST_LINE_BYTES,
    OpenAIErrorsRunner,
    anthropic_errors,
    error_response,
    openai_errors,
)
from proxy.fleet import Fleet, FleetError
from proxy.kv_events import KVEvents
from proxy.kv_migration import FullModeSettings, KVMigrator
from proxy.metrics import FerryMetrics
from proxy.migrator import Migrator
from proxy.placement import Placement
from proxy.policy import UsageSettings, make_policy
from proxy.policy.migration import MigrationSettings
from proxy.policy.policies import DispatchPolicy
from proxy.policy.view import shown
from proxy.relay import Relay
from proxy.rescheduler import Rescheduler
from proxy.scraper import Scraper
from proxy.shutdown import InFlight
from proxy.upstream import Upstreams, connector
from proxy.workers import FLEET_SNAPSHOT, HEARTBEAT, RESTARTED_WORKER

log = logging.getLogger("ferry")

CLUSTER = web.AppKey("cluster", Cluster)
METRICS = web.AppKey("metrics", FerryMetrics)
RELAY = web.AppKey("relay", Relay)
MIGRATOR = web.AppKey("migrator", Migrator)
SCRAPER = web.AppKey("scraper", Scraper)
SHUTTING_DOWN = web.AppKey("shutting_down", asyncio.Event)  # set on SIGTERM
IN_FLIGHT = web.AppKey("in_flight", InFlight)

# vLLM's model-routed POST routes outside /v1 (vLLM 0.32's api_server).
ORPHAN_CHECK_S = 1.0  # how often a worker checks that its supervisor lives
HEARTBEAT_S = 1.0  # how often a worker tells its supervisor that it runs

# How long an idle upstream connection is kept for reuse: under the 5 s after
# which vLLM's uvicorn closes one (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so that Ferry
# does not send a request on a connection the engine is closing.
UPSTREAM_KEEPALIVE_S = 4.0
MAX_HEADER_BYTES = 64 * 1024  # all of a request's headers (Envoy's 60 KiB, about)
SHUTDOWN_CUT_S = 1.0  # aiohttp's shutdown timeout, once Ferry's grace is over
# Each stream holds two file descriptors (the client's connection and the
# instance's): a shell's default soft limit of 1,024 runs out near 500 streams.
# Raised at start as far as the hard limit allows, as vLLM's server does.
OPEN_FILES_WANTED = 65536

ENGINE_ROUTES = (
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/v2/rerank",
    "/v2/embed",
    "/generative_scoring",
)
FLEET = web.AppKey("fleet", Fleet)
DISCOVERY = web.AppKey("discovery", Discovery)
SHARING = web.AppKey("sharing", admin.SharingStatus)


def build_app(
    config: FerryConfig, load: Callable[[], FerryConfig] | None = None
) -> web.Application:
    """The app for `config`; `load()` re-reads the configuration file on a reload."""
    sched = config.scheduler
    metrics = FerryMetrics(sched.scaling_settings())
    # The access log's middleware comes first: every answer carries the request id,
    # and every request (a 404 too) gets its line.
    spans = tracing.Spans() if config.server.otel else None
    observe = access_log.middleware(metrics, config.server.access_log, spans)

    # Client keys are read from the running configuration (a reload rotates them);
    # until the fleet exists (start-up), from the one the app was built with.
    def client_keys() -> tuple[str, ...]:
        return app[FLEET].config.api_keys if FLEET in app else config.api_keys

    keyed = client_auth.middleware(client_keys)
    in_flight = InFlight()
    app = web.Application(
        client_max_size=config.server.max_body_bytes,
        middlewares=[
            observe,
            anthropic_errors,
            _request_limits(config.server.max_body_bytes),
            openai_errors,
            keyed,
            in_flight.middleware,
        ],
    )
    app[IN_FLIGHT] = in_flight
    app.on_response_prepare.append(access_log.echo_request_id)
    cluster = Cluster(
        config.instances,
        _usage(sched),
        sched.unhealthy_after_failures,
        sched.ejection_settings(),
    )
    cluster.prefixes.enabled = _prefix_index_on(sched)
    app[CLUSTER] = cluster
    app[METRICS] = metrics
    app[sse.SEND_TIMEOUT] = config.server.client_send_timeout_s
    app[SHUTTING_DOWN] = asyncio.Event()
    app[request_body.BODIES] = request_body.Bodies(
        config.server.max_body_bytes,
        config.server.client_body_timeout_s,
        config.server.max_pending_body_bytes,
        config.server.retry_after_s,
    )

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # No pool cap: every client stream holds one upstream connection.
        pool = connector(limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        # The tracing signal marks when each call has its connection (the TTFT breakdown).
        # Bodies are relayed and read as they come, never decompressed (a cost per
        # chunk), so instances are asked for none: a gateway in front of one that
        # compresses would otherwise send bytes Ferry passes on unlabelled. A
        # cookie an instance (or a gateway before it) sets is no one's to keep:
        # a session's jar would send it on with every client's calls.
        async with aiohttp.ClientSession(
            connector=pool,
            auto_decompress=False,
            headers={"Accept-Encoding": "identity"},
            cookie_jar=aiohttp.DummyCookieJar(),
            trace_configs=[ttft_stages.trace_config()],
        ) as session:
            placement = Placement(cluster, _policy(sched), metrics, random.Random(sched.seed))
            upstreams = Upstreams(cluster, session, config.server, time.monotonic)
            kv = KVMigrator(cluster, upstreams, metrics, _full_mode(sched))
            migrator = Migrator(
                cluster,
                placement,
                upstreams,
                kv,
                max_concurrent=sched.migration_max_concurrent,
                prewarm=sched.migration_prewarm,
            )
            app[MIGRATOR] = migrator
            relay = app[RELAY] = Relay(
                cluster,
                placement,
                upstreams,
                migrator,
                metrics,
                time.monotonic,
                retry_after_s=config.server.retry_after_s,
                max_resumes=sched.migration_max_resumes,
                retries=sched.retries,
            )
            scraper = Scraper(
                cluster,
                session,
                metrics,
                interval_s=sched.scrape_interval_s,
                timeout_s=sched.scrape_timeout_s,
                models_refresh_s=sched.models_refresh_s,
            )
            scraper.on_down = migrator.leave_hung
            app[SCRAPER] = scraper
            events = KVEvents(cluster)
            rescheduler = Rescheduler(
                cluster,
                migrator,
                _migration_settings(config),
                interval_s=sched.rebalance_interval_s,
                metrics=metrics,
            )
            applied = sched

            def retune(new: FerryConfig) -> None:
                """Swap scheduler settings between two requests (the loop runs one at a time)."""
                nonlocal applied
                s = new.scheduler
                cluster.retune(_usage(s), s.unhealthy_after_failures, s.ejection_settings())
                if _policy_changed(s, applied):
                    placement.policy = _policy(s)
                    cluster.prefixes.enabled = _prefix_index_on(s)
                if s.seed != applied.seed:
                    placement.rng = random.Random(s.seed)
                scraper.retune(s.scrape_interval_s, s.scrape_timeout_s, s.models_refresh_s)
                relay.max_resumes, relay.retries = s.migration_max_resumes, s.retries
                migrator.retune(
                    max_concurrent=s.migration_max_concurrent, prewarm=s.migration_prewarm
                )
                kv.settings = _full_mode(s)
                rescheduler.retune(_migration_settings(new), s.rebalance_interval_s)
                metrics.scaling = s.scaling_settings()
                events.sync()  # instances added, removed or given new endpoints
                applied = s

            app[FLEET] = Fleet(
                config, cluster, scraper, migrator, metrics, retune=retune, load=load
            )
            discovery = app[DISCOVERY] = Discovery(app[FLEET], config.discovery)
            await discovery.refresh_all()
            async with _shared_view(config, app, migrator, rescheduler):
                # One round before serving, so the first requests find healthy instances.
                await asyncio.gather(*(scraper.look(n) for n in cluster.instances))
                scraper.start()
                events.sync()
                rescheduler.start()
                discovery.start()
                yield
                await discovery.stop()
            await app[FLEET].stop()
            await rescheduler.stop()
            await migrator.stop()
            await scraper.stop()
            await events.stop()
            app[request_body.BODIES].close()

    app[SHARING] = admin.SharingStatus()
    app.cleanup_ctx.append(lifecycle)
    # The same with a trailing slash: sent on as it came, vLLM would answer
    # with a redirect to itself, past the proxy.
    expect = _expect_continue(config.server.max_body_bytes, client_keys)
    for slash in ("", "/"):
        for path, read in _READ_ROUTES.items():
            app.router.add_post(path + slash, read, expect_handler=expect)
        app.router.add_get("/v1/models" + slash, _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_route("*", "/v1/{tail:.*}", _passthrough, expect_handler=expect)
    for path in ENGINE_ROUTES:
        app.router.add_post(path, _passthrough, expect_handler=expect)
    app.router.add_get("/version", _passthrough)  # the engine's version, as vLLM answers it
    app.router.add_get("/health", _health)
    # vLLM's SageMaker-style health check, GET or POST: Ferry's readiness here;
    # and SageMaker's one inference route.
    app.router.add_get("/ping", _readyz)
    app.router.add_post("/ping", _readyz)
    app.router.add_post("/invocations", _invocations, expect_handler=expect)
    app.router.add_get("/livez", _livez)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    admin.add_routes(app, lambda: app[FLEET], app[SHARING])
    return app


class _ClientFaultsQuiet(logging.Filter):
    """aiohttp logs each request its parser refuses (a malformed header line, a
    body encoding it cannot decode) at ERROR with a traceback: any client could
    flood the log. They are the client's faults, answered 400: debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def _request_limits(max_body_bytes: int) -> Any:
    """Refuse, before reading a body, a request whose headers in all pass
    MAX_HEADER_BYTES (aiohttp bounds each line and their count: 128 of 64 KiB
    each, 8 MiB a request, held while its body comes and sent on upstream) or
    that declares a body past `max_body_bytes` (aiohttp reads it up to the
    limit first). Its connection closes: the body is not read."""

    @web.middleware
    async def limits(request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = _over_limits(request, max_body_bytes)
        if refused is None:
            return await handler(request)
        # The connection ends with the answer. (aiohttp reads on in the body,
        # for up to 10 s, and drops it: closed at once, a client still sending
        # would get a reset instead of this answer.)
        refused.force_close()
        return refused

    return limits


def _over_limits(request: web.Request, max_body_bytes: int) -> web.Response | None:
    """The answer to a request `_request_limits` refuses; None where it passes."""
    length = request.content_length
    if length is not None and length > max_body_bytes:
        message = f"request body is {length} bytes; at most {max_body_bytes} are taken"
        return error_response(413, message)
    if sum(len(k) + len(v) for k, v in request.raw_headers) > MAX_HEADER_BYTES:
        message = f"request headers are over {MAX_HEADER_BYTES // 1024} KiB in all"
        return error_response(431, message)
    return None


def _expect_continue(max_body_bytes: int, client_keys: Callable[[], tuple[str, ...]]) -> Any:
    """An `Expect: 100-continue` handler that says continue only to a request
    `_request_limits` and the client key pass: a client told to continue sends
    the body that the 413 or the 401 then refuses. (aiohttp's says it to all,
    before any middleware.)"""

    async def expect(request: web.Request) -> web.Response | None:
        if request.version != HttpVersion11 or _over_limits(request, max_body_bytes):
            return None  # the middleware answers, the body unread
        allowed = client_keys()
        if client_auth.needs_key(request, allowed) and not client_auth.authorized(
            request.headers.get(hdrs.AUTHORIZATION, ""), allowed
        ):
            return None  # as above: the key's middleware answers 401
        expected = request.headers.get(hdrs.EXPECT, "")
        if expected.lower() != "100-continue":
            return error_response(417, f"unknown Expect: {expected!r}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (as aiohttp's: the answer has not begun)
        return None

    return expect


def listen_host(host: str) -> str | None:
    """Where `server.host` has Ferry listen: `*` is every interface, IPv4 and
    IPv6 (a socket for each); `0.0.0.0` is IPv4's alone and `::` IPv6's alone
    (asyncio sets IPV6_V6ONLY), so neither serves a dual-stack cluster whole."""
    return None if host == "*" else host


def app_runner(app: web.Application, server: ServerConfig) -> web.AppRunner:
    """How `serve` runs the app (tests run it so too)."""
    aiohttp_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientFaultsQuiet) for f in aiohttp_log.filters):
        aiohttp_log.addFilter(_ClientFaultsQuiet())
    return OpenAIErrorsRunner(
        app,
        # A client that hangs up cancels its handler, which closes the upstream
        # connection, which makes vLLM abort the request.
        handler_cancellation=True,
        access_log=None,
        # Ferry gives in-flight requests their grace itself (proxy/shutdown.py):
        # aiohttp's shutdown finds none left, or a test's in-flight streams.
        shutdown_timeout=SHUTDOWN_CUT_S,
        keepalive_timeout=server.client_keepalive_s,
        # Bodies as they came: Ferry inflates them off the event loop, bounded
        # (proxy/request_body.py).
        auto_decompress=False,
        # (Envoy allows 60 KiB of headers in all.)
        max_line_size=MAX_REQUEST_LINE_BYTES,
        max_field_size=MAX_HEADER_LINE_BYTES,
    )


@contextlib.asynccontextmanager
async def _shared_view(
    config: FerryConfig, app: web.Application, migrator: Migrator, rescheduler: Rescheduler
) -> AsyncIterator[None]:
    """Share the cluster view through Redis while the app runs, when configured
    (proxy/sharing.py); alone, nothing. Imported only then: `redis` is optional."""
    if config.redis_url is None:
        yield
        return
    import redis.asyncio as aioredis

    from proxy.sharing import Sharing

    # Timeouts well under the TTL: a hung Redis must not stall the rounds for longer.
    timeout = max(0.1, config.sharing.ttl_s / 2)
    client = aioredis.from_url(
        config.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    sharing = Sharing(client, config.sharing, app[CLUSTER], app[FLEET], migrator, rescheduler)
    sharing.exposition = lambda: app[METRICS].prepare(app[CLUSTER])
    sharing.metrics_group = f"{socket.gethostname()}:{config.server.port}"
    sharing.snapshot_path = os.environ.get(FLEET_SNAPSHOT)  # set by `--workers`' parent
    try:
        await sharing.start(alone_ok=os.environ.get(RESTARTED_WORKER) == "1")
    except BaseException:  # (nothing to withdraw: it never joined)
        await client.aclose()
        raise
    try:
        app[SHARING].describe = sharing.describe
        app[SHARING].merged_metrics = sharing.merged_metrics
        app[SHARING].unshared = sharing.unshared
        app[SHARING].settle = sharing.settle
        app[METRICS].share(sharing.health)
        shown = redacted(config.redis_url)
        log.info("sharing the cluster view through %s as %s", shown, sharing.name)
        yield
    finally:
        await sharing.stop()
        await client.aclose()


def _usage(s: SchedulerConfig) -> UsageSettings:
    return UsageSettings(high_priority_headroom_blocks=s.high_priority_headroom_blocks)


def _policy(s: SchedulerConfig) -> DispatchPolicy:
    options: dict[str, float | bool] = {}
    if s.policy == "llumnix":
        options = {
            "topk": s.topk,
            "prefill_aware": s.prefill_aware,
            "prefix_credit": s.prefix_credit,
            "affinity_margin": s.affinity_margin_blocks,
            "safe_freeness": s.prefix_safe_freeness,
            "crowd_factor": s.prefix_crowd_factor,
            "crowd_grace": s.prefix_crowd_grace,
        }
    elif s.policy == "cache_aware":
        options = {
            "cache_threshold": s.cache_threshold,
            "balance_abs_threshold": s.balance_abs_threshold,
            "balance_rel_threshold": s.balance_rel_threshold,
        }
    return make_policy(s.policy, **options)


def _policy_changed(new: SchedulerConfig, old: SchedulerConfig) -> bool:
    keys: tuple[str, ...] = ("policy", "topk", "prefill_aware", "prefix_credit")
    keys += ("prefix_safe_freeness",)
    keys += ("affinity_margin_blocks", "cache_threshold", "balance_abs_threshold")
    keys += ("balance_rel_threshold", "prefix_crowd_factor", "prefix_crowd_grace")
    return any(getattr(new, k) != getattr(old, k) for k in keys)


def _prefix_index_on(s: SchedulerConfig) -> bool:
    """The prefix index runs only where a policy reads it."""
    return s.policy == "cache_aware" or (s.policy == "llumnix" and s.prefix_credit)


def _full_mode(s: SchedulerConfig) -> FullModeSettings:
    return FullModeSettings(
        max_stages=s.migration_full_max_stages,
        last_stage_blocks=s.migration_full_last_stage_blocks,
        bandwidth_mb_s=s.migration_bandwidth_mb_s,
    )


def _migration_settings(config: FerryConfig) -> MigrationSettings:
    s = config.scheduler
    return MigrationSettings(
        source_below=s.migration_source_below,
        dest_above=s.migration_dest_above,
        # Only lite moves recompute: all-full clusters move the KV.
        count_recompute=any(i.migration == "lite" for i in config.instances),
        prefill_tokens_per_s=s.migration_prefill_tokens_per_s,
        preemption_stall_s=s.migration_preemption_stall_s,
        dest_ttft_slack_s=s.migration_dest_ttft_slack_s,
        stalled_after_s=s.migration_stalled_after_s,
        prewarm_min_recompute_s=s.migration_prewarm_min_recompute_s,
    )


def _openai_handler(endpoint: str) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            raw = await _body(request)
            parsed = await _read(
                raw,
                openai_request.parse,
                raw,
                endpoint,
                _joined(request.headers.getall(openai_request.PRIORITY_HEADER, [])),
                request.headers.get("Content-Type", ""),
            )
            model = parsed.model or _implied_model(request.app[CLUSTER])
        except openai_request.BadRequest as exc:
            return error_response(exc.status, exc.message, param=exc.param, headers=exc.headers)
        if model is not None:
            parsed.body["model"] = model
        return await request.app[RELAY].forward(
            request,
            _engine_path(request),
            parsed.body,
            raw,
            model=model,
            priority=parsed.priority,
            prompt_estimate=parsed.prompt_estimate,
            arrived=arrived,
            parsed=time.monotonic(),
            endpoint=endpoint,
        )

    return handler


_CHAT, _COMPLETIONS = _openai_handler("chat"), _openai_handler("completions")
# The routes Ferry reads, by their path unescaped. The engine unescapes a path
# before it routes it, so `/v1/chat%2Fcompletions` (or `/v1/%63ompletions`) is
# its chat route too; aiohttp's router matches the path as it came, and would
# pass such a call through unseen by the ledger and the priorities.
_READ_ROUTES = {"/v1/completions": _COMPLETIONS, "/v1/chat/completions": _CHAT}


async def _invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's `POST /invocations`, which vLLM serves as the request its body
    is: a chat (it has `messages`) or a completion (`prompt`) is read and placed
    as on its own route (and sent to the instance's `/invocations`); anything
    else (an embedding, a score) passes through."""
    try:
        raw = await _body(request)
    except openai_request.BadRequest as exc:
        return error_response(exc.status, exc.message, param=exc.param, headers=exc.headers)
    kind = await _read(raw, openai_request.invocation_kind, raw)
    if kind == "chat":
        return await _CHAT(request)
    if kind == "completions":
        return await _COMPLETIONS(request)
    return await _passthrough(request)


async def _passthrough(request: web.Request) -> web.StreamResponse:
    """Any other call goes to an instance serving its `model`, if it names one."""
    read = _READ_ROUTES.get(request.path.rstrip("/")) if request.method == "POST" else None
    if read is not None:
        return await read(request)
    arrived = time.monotonic()
    if any(urllib.parse.unquote(s) in (".", "..") for s in request.path.split("/")):
        # The URL sent on would resolve them: `/v1/../sleep` (or `/v1/%2e%2e/sleep`)
        # is the engine's `/sleep`, a route not passed through, sent with the
        # instance's credentials. (`/v1/%252e%252e/` is refused too: the path sent
        # on keeps its escapes, so no engine would resolve it, but nothing does
        # that but a probe.)
        return error_response(404, "a path with . or .. segments is not passed through")
    if request.path.startswith(_ENGINE_ADMIN):
        return error_response(404, "the engine's administration routes are not passed through")
    try:
        # (A Responses call generates as a chat does: its priority counts too.)
        priority = openai_request.priority_of(
            _joined(request.headers.getall(openai_request.PRIORITY_HEADER, []))
        )
        raw = await _body(request)
        boundary = None
        if request.content_type == openai_request.MULTIPART:
            boundary = parse_mimetype(request.headers["Content-Type"]).parameters.get("boundary")
        body = await _read(
            raw, openai_request.parse_passthrough, raw, request.content_type, boundary
        )
        model = body.model or None  # vLLM reads `"model": ""` as none named
        if model is None and request.method == "POST":
            # The engine answers a call that names no model with its first one:
            # where the instances' first models differ, that is a draw.
            model = _implied_model(request.app[CLUSTER])
    except openai_request.BadRequest as exc:
        return error_response(exc.status, exc.message, param=exc.param, headers=exc.headers)
    return await request.app[RELAY].forward(
        request,
        _engine_path(request),
        None,
        raw,
        model=model,
        priority=priority,
        prompt_estimate=0,
        arrived=arrived,
        stream=body.stream,
    )


_T = TypeVar("_T")


async def _read(raw: bytes, read: Callable[..., _T], *args: Any) -> _T:
    """`read(*args)`, of the body `raw`: off the event loop when it is large."""
    if len(raw) <= openai_request.OFF_LOOP_BYTES:
        return read(*args)
    return await asyncio.to_thread(read, *args)


async def _body(request: web.Request) -> bytes:
    """The request's body, whole and decoded (proxy/request_body.py)."""
    return await request.app[request_body.BODIES].read(request)


# vLLM's routes that change what an engine serves (with
# VLLM_ALLOW_RUNTIME_LORA_UPDATING): sent to one instance, chosen by load, with
# its credentials, they would change one instance of the fleet at random.
_ENGINE_ADMIN = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")

# What a path segment may hold unescaped (RFC 3986's pchar).
_PATH_SAFE = "/:@!$&'()*+,;="


def _engine_path(request: web.Request) -> str:
    """The path an engine is sent, escaped again (aiohttp's `path` is unescaped
    once: sent as it is, a `%3F` in it would start a query there, and `%2e` be a
    dot the URL resolves); without a trailing slash, which vLLM would answer
    with a redirect to its own address."""
    path = urllib.parse.quote(request.path, safe=_PATH_SAFE)
    return path.rstrip("/") if path.endswith("/") and path != "/" else path


async def _models(request: web.Request) -> web.Response:
    cards = list(_model_cards(request.app[CLUSTER]).values())
    return web.json_response({"object": "list", "data": cards})


async def _model(request: web.Request) -> web.Response:
    """One model's card (OpenAI's `GET /v1/models/{model}`; vLLM has none)."""
    model = request.match_info["model"]
    card = _model_cards(request.app[CLUSTER]).get(model)
    if card is None:
        return error_response(
            404, f"model {shown(model)!r} is not served here", code="model_not_found", param="model"
        )
    return web.json_response(card)


def _joined(values: list[str]) -> str | None:
    """A header's values as one (RFC 9110 5.3: joined by commas); None when absent."""
    return ", ".join(values) if values else None


def _model_cards(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The models healthy instances serve, by id, each as the instance with its
    longest context reports it (else the first): a client sizing its prompt by
    `max_model_len` may use all of it, since Ferry places a request where its
    prompt and budget fit."""
    cards: dict[str, dict[str, Any]] = {}
    for state in cluster.instances.values():
        if state.healthy:
            for card in state.model_cards:
                known = cards.setdefault(str(card["id"]), card)
                if _context(card) > _context(known):
                    cards[str(card["id"])] = card
    return cards


def _context(card: dict[str, Any]) -> int:
    length = card.get("max_model_len")
    return length if type(length) is int else 0


def _implied_model(cluster: Cluster) -> str | None:
    """The model of a request that names none. vLLM serves its first model
    name then (not an alias after it, nor a LoRA adapter, whose card names a
    `parent`); where every healthy instance has the same first model, the
    request names it and goes where it is served. None where no healthy
    instance has said what it serves (any instance will do); a 400 where their
    first models differ."""
    firsts = {
        str(bases[0]["id"])
        for state in cluster.instances.values()
        if state.healthy
        and (bases := [c for c in state.model_cards if not c.get("parent")] or state.model_cards)
    }
    if len(firsts) > 1:
        message = f"'model' is required: the instances serve different models ({sorted(firsts)})"
        raise openai_request.BadRequest(message, param="model")
    return firsts.pop() if firsts else None


async def _health(request: web.Request) -> web.Response:
    views = request.app[CLUSTER].view().instances
    ready = sum(1 for v in views if v.dispatchable)
    body = {"status": "ok" if ready else "unavailable", "instances": len(views), "ready": ready}
    return web.json_response(body, status=200 if ready else 503)


async def _livez(request: web.Request) -> web.Response:
    """Liveness: the process serves. Backends being down is no reason to restart it."""
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """Readiness: an instance can take traffic and Ferry is not shutting down."""
    if request.app[SHUTTING_DOWN].is_set():
        return web.json_response({"status": "shutting down"}, status=503)
    ready = sum(1 for v in request.app[CLUSTER].view().instances if v.dispatchable)
    status = 200 if ready else 503
    return web.json_response({"status": "ok" if ready else "unavailable"}, status=status)


async def _metrics(request: web.Request) -> web.Response:
    text = request.app[METRICS].render(request.app[CLUSTER])
    merged = request.app[SHARING].merged_metrics
    if merged is not None:  # sharing: this process answers for its peers too
        text = await merged(text)
    return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4"})


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files to `wanted`, or to the hard
    limit where that is lower; the soft limit it has now. Never lowers it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
            soft = ceiling
        except (ValueError, OSError) as exc:  # a sandbox that refuses it
            log.warning("cannot raise the open files limit from %d: %s", soft, exc)
    return soft


async def serve(
    config: FerryConfig,
    load: Callable[[], FerryConfig] | None = None,
    reload_asked: Callable[[], bool] = lambda: False,
) -> None:
    """Run until SIGINT/SIGTERM (or cancellation), then shut down gracefully:
    not ready at once, still serving for `shutdown_delay_s`, then no new
    connections while in-flight requests get `shutdown_grace_s` to finish.
    SIGHUP reloads the configuration file (`load()`); one that comes while it
    starts (here, or before: `reload_asked()`) is reloaded once it runs."""
    loop = asyncio.get_running_loop()
    held_reload = asyncio.Event()
    _on_signal(loop, signal.SIGHUP, held_reload.set)
    if reload_asked():
        held_reload.set()
    open_files = raise_open_files_limit()
    app = build_app(config, load)
    if config.server.access_log:
        access_log.install_handler()
    if config.server.otel:
        tracing.install()
    runner = app_runner(app, config.server)
    await runner.setup()
    # Workers share the port (proxy/workers.py): the kernel spreads connections.
    site = web.TCPSite(
        runner,
        listen_host(config.server.host),
        config.server.port,
        backlog=1024,
        reuse_port=config.server.workers > 1,
    )
    try:
        await site.start()
    except OSError:  # the address taken, say: the app's parts stop as they started
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else config.server.port  # (port 0)
    log.info(
        "ferry listening on http://%s:%d (%d instances, policy %s, %s, %d open files)",
        f"[{config.server.host}]" if ":" in config.server.host else config.server.host,
        bound,
        len(app[CLUSTER].instances),  # (the shared view may have changed the file's)
        config.scheduler.policy,
        client_auth.describe(config),
        open_files,
    )
    if not config.api_keys and any(i.api_key for i in config.instances):
        log.warning(
            "instances have an api_key but clients need none: anyone who reaches"
            " this port uses them (set api_keys or FERRY_API_KEYS)"
        )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        _on_signal(loop, sig, stop.set)

    async def reload() -> None:
        try:
            await app[FLEET].reload()
        except FleetError as exc:
            log.error("reload refused, nothing changed: %s", exc)
        except Exception:  # noqa: BLE001 - a signal's task: said here or nowhere
            log.exception("reload failed")

    reloads: set[asyncio.Task[None]] = set()

    def on_sighup() -> None:
        task = asyncio.create_task(reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    _on_signal(loop, signal.SIGHUP, on_sighup)
    if held_reload.is_set():
        on_sighup()
    orphan_watch = (
        asyncio.create_task(_stop_when_orphaned(stop, os.getppid()))
        if config.server.workers > 1
        else None
    )
    beat = os.environ.get(HEARTBEAT)  # set by `--workers`' parent
    beating = asyncio.create_task(_beat(beat)) if beat else None
    try:
        await stop.wait()
        app[SHUTTING_DOWN].set()
        log.info(
            "shutting down: not ready; serving %.1f s more, then up to %.1f s for %d requests",
            config.server.shutdown_delay_s,
            config.server.shutdown_grace_s,
            sum(app[CLUSTER].ledger.count(n) for n in app[CLUSTER].instances),
        )
        await asyncio.sleep(config.server.shutdown_delay_s)
    finally:
        if orphan_watch is not None:
            orphan_watch.cancel()
        await site.stop()  # no new connections
        await asyncio.sleep(0)  # those just accepted start their requests (as aiohttp does)
        if runner.server is not None:
            runner.server.pre_shutdown()  # nor requests: keep-alive ends with each one
        await app[IN_FLIGHT].finish(config.server.shutdown_grace_s)
        await runner.cleanup()
        if beating is not None:  # (through the stop too: it is no silent worker)
            beating.cancel()


def _on_signal(loop: asyncio.AbstractEventLoop, sig: int, handler: Callable[[], object]) -> None:
    try:
        loop.add_signal_handler(sig, handler)
    except (NotImplementedError, RuntimeError):  # not the main thread (the tests' Ferry)
        pass


async def _beat(path: str) -> None:
    """Tell `--workers`' parent that this event loop runs: its heartbeat file's
    time, every second (proxy/workers.py kills a worker that stops)."""
    while True:
        try:
            os.utime(path)  # (a local file's inode: no wait worth a thread)
        except OSError as exc:
            log.warning("cannot beat the worker's heartbeat (%s): beats stop", exc)
            return
        await asyncio.sleep(HEARTBEAT_S)


async def _stop_when_orphaned(stop: asyncio.Event, parent: int) -> None:
    """A worker whose supervisor died (kill -9: no signal reached the workers)
    shuts down as on SIGTERM: nobody would stop or restart it any more."""
    while os.getppid() == parent:
        await asyncio.sleep(ORPHAN_CHECK_S)
    log.warning("the supervisor (pid %d) is gone: shutting down", parent)
    stop.set()
