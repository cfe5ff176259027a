"""The Ferry HTTP service: built in one place, opened and closed with the app.

Routes:
- the OpenAI API: `/v1/completions` and `/v1/chat/completions` (read, placed,
  movable), `/v1/models` (the cluster's), and every other `/v1/*`
  (`/v1/responses`, `/v1/embeddings`, `/v1/score`, `/v1/rerank`, ...) passed through;
- vLLM's routes outside `/v1` (`ENGINE_ROUTES`: `/tokenize`, `/detokenize`,
  `/pooling`, `/classify`, `/score`, `/rerank`, `/v2/rerank`, `/v2/embed`, ...),
  passed through;
- `/health`, `/livez`, `/readyz`, `/metrics` and `/admin/*`.
A pass-through call goes to an instance serving its JSON body's `model` (any
instance when it names none) and is answered as the instance answers: a stream
as it comes, byte for byte, anything else whole.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from proxy import admin, openai_request
from proxy.cluster import Cluster
from proxy.config import FerryConfig
from proxy.errors import error_response, openai_errors
from proxy.kv_migration import FullModeSettings, KVMigrator
from proxy.metrics import FerryMetrics
from proxy.migrator import Migrator
from proxy.placement import Placement
from proxy.policy import Priority, UsageSettings, make_policy
from proxy.policy.migration import MigrationSettings
from proxy.relay import Relay
from proxy.rescheduler import Rescheduler
from proxy.scraper import Scraper
from proxy.upstream import Upstreams

log = logging.getLogger("ferry")

CLUSTER = web.AppKey("cluster", Cluster)
METRICS = web.AppKey("metrics", FerryMetrics)
RELAY = web.AppKey("relay", Relay)
MIGRATOR = web.AppKey("migrator", Migrator)
SCRAPER = web.AppKey("scraper", Scraper)
SHUTTING_DOWN = web.AppKey("shutting_down", asyncio.Event)  # set on SIGTERM

# vLLM's model-routed POST routes outside /v1 (vLLM 0.32's api_server).
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


def build_app(config: FerryConfig) -> web.Application:
    app = web.Application(client_max_size=config.server.max_body_bytes, middlewares=[openai_errors])
    sched = config.scheduler
    cluster = Cluster(
        config.instances,
        UsageSettings(high_priority_headroom_blocks=sched.high_priority_headroom_blocks),
        sched.unhealthy_after_failures,
    )
    metrics = FerryMetrics(sched.scaling_settings())
    app[CLUSTER] = cluster
    app[METRICS] = metrics
    app[SHUTTING_DOWN] = asyncio.Event()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # No pool cap: every client stream holds one upstream connection.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            policy_options = {"topk": sched.topk} if sched.policy == "llumnix" else {}
            policy = make_policy(sched.policy, **policy_options)
            placement = Placement(cluster, policy, metrics, random.Random(sched.seed))
            upstreams = Upstreams(cluster, session, config.server)
            full_mode = FullModeSettings(
                max_stages=sched.migration_full_max_stages,
                last_stage_blocks=sched.migration_full_last_stage_blocks,
                bandwidth_mb_s=sched.migration_bandwidth_mb_s,
            )
            migrator = Migrator(
                cluster,
                placement,
                upstreams,
                KVMigrator(cluster, upstreams, metrics, full_mode),
                max_concurrent=sched.migration_max_concurrent,
                prewarm=sched.migration_prewarm,
            )
            app[MIGRATOR] = migrator
            app[RELAY] = Relay(
                cluster,
                placement,
                upstreams,
                migrator,
                metrics,
                time.monotonic,
                retry_after_s=config.server.retry_after_s,
                max_resumes=sched.migration_max_resumes,
            )
            scraper = Scraper(
                cluster,
                session,
                metrics,
                interval_s=sched.scrape_interval_s,
                timeout_s=sched.scrape_timeout_s,
                models_refresh_s=sched.models_refresh_s,
            )
            app[SCRAPER] = scraper
            # One round before serving, so the first requests find healthy instances.
            await asyncio.gather(*(_first_look(scraper, n) for n in cluster.instances))
            scraper.start()
            rescheduler = None
            if sched.rebalance_interval_s > 0:
                settings = MigrationSettings(
                    source_below=sched.migration_source_below,
                    dest_above=sched.migration_dest_above,
                    # Only lite moves recompute: all-full clusters move the KV.
                    count_recompute=any(i.migration == "lite" for i in config.instances),
                    prefill_tokens_per_s=sched.migration_prefill_tokens_per_s,
                    preemption_stall_s=sched.migration_preemption_stall_s,
                    dest_ttft_slack_s=sched.migration_dest_ttft_slack_s,
                )
                rescheduler = Rescheduler(
                    cluster, migrator, settings, interval_s=sched.rebalance_interval_s
                )
                rescheduler.start()
            yield
            if rescheduler is not None:
                await rescheduler.stop()
            await migrator.stop()
            await scraper.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", _openai_handler("completions"))
    app.router.add_post("/v1/chat/completions", _openai_handler("chat"))
    app.router.add_get("/v1/models", _models)
    app.router.add_route("*", "/v1/{tail:.*}", _passthrough)
    for path in ENGINE_ROUTES:
        app.router.add_post(path, _passthrough)
    app.router.add_get("/health", _health)
    app.router.add_get("/livez", _livez)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    admin.add_routes(app, cluster, config.admin_token, lambda name: app[MIGRATOR].drain(name))
    return app


async def _first_look(scraper: Scraper, name: str) -> None:
    await scraper.refresh_models(name)
    if scraper.cluster.instances[name].config.migration == "full":
        await scraper.refresh_shim(name)
    await scraper.scrape_once(name)


def _openai_handler(endpoint: str) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        raw = await request.read()
        try:
            parsed = openai_request.parse(
                raw,
                endpoint,
                request.headers.get(openai_request.PRIORITY_HEADER),
                request.content_type,
            )
        except openai_request.BadRequest as exc:
            return error_response(exc.status, exc.message, param=exc.param)
        return await request.app[RELAY].forward(
            request,
            request.path,
            parsed.body,
            raw,
            model=parsed.model,
            priority=parsed.priority,
            prompt_estimate=parsed.prompt_estimate,
            arrived=arrived,
        )

    return handler


async def _passthrough(request: web.Request) -> web.StreamResponse:
    """Any other call goes to an instance serving its `model`, if it names one."""
    arrived = time.monotonic()
    raw = await request.read()
    try:
        body = openai_request.parse_passthrough(raw, request.content_type)
    except openai_request.BadRequest as exc:
        return error_response(exc.status, exc.message, param=exc.param)
    return await request.app[RELAY].forward(
        request,
        request.path,
        None,
        raw,
        model=body.model,
        priority=Priority.NORMAL,
        prompt_estimate=0,
        arrived=arrived,
        stream=body.stream,
    )


async def _models(request: web.Request) -> web.Response:
    cards: dict[str, dict[str, Any]] = {}
    for state in request.app[CLUSTER].instances.values():
        if state.healthy:
            for card in state.model_cards:
                cards.setdefault(str(card["id"]), card)
    return web.json_response({"object": "list", "data": list(cards.values())})


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
    return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4"})


async def serve(config: FerryConfig) -> None:
    """Run until SIGINT/SIGTERM (or cancellation), then shut down gracefully:
    not ready at once, still serving for `shutdown_delay_s`, then no new
    connections while in-flight requests get `shutdown_grace_s` to finish."""
    app = build_app(config)
    # handler_cancellation: a client that hangs up cancels its handler, which
    # closes the upstream connection, which makes vLLM abort the request.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=config.server.shutdown_grace_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port, backlog=1024)
    await site.start()
    log.info(
        "ferry listening on http://%s:%d (%d instances, policy %s)",
        config.server.host,
        config.server.port,
        len(config.instances),
        config.scheduler.policy,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
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
        await runner.cleanup()
