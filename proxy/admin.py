"""The admin API under `/admin`, behind a bearer token.

    GET    /admin/instances                     the instances, as `ferry status` shows them
    POST   /admin/instances                     add one (JSON like a YAML instance): 201, 409
    PATCH  /admin/instances/{name}              change migration, labels, api_key, headers,
                                                engine_priority
    DELETE /admin/instances/{name}[?migrate=1]  drain, then remove once empty: 202
    POST   /admin/instances/{name}/drain[?migrate=1], /undrain
    POST   /admin/reload                        re-read the config file (as SIGHUP does)
    GET    /admin/sharing                       the shared view: this process, the lease
                                                holder, each peer's totals (proxy/sharing.py)

With a shared view, a change through any process applies on every process; a
reload re-reads this process's file only. While that process cannot reach Redis
a change is refused (503, `sharing_unavailable`): made here alone it would not
reach the others, and would be lost with this process.

Without a configured token (config `admin_token` or `FERRY_ADMIN_TOKEN`) the admin
API refuses every call: an open drain button is worse than none.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy import client_auth, request_body, workers
from proxy.cluster import Cluster
from proxy.errors import error_response
from proxy.fleet import Fleet, FleetError
from proxy.openai_request import BadRequest, read_object


def _alone() -> dict[str, Any]:
    return {"enabled": False}


@dataclass
class SharingStatus:
    """What `/admin/sharing` shows: filled in once the shared view runs."""

    describe: Callable[[], dict[str, Any]] = _alone
    # Why a fleet change made here now would not reach the other processes; None: it would.
    unshared: Callable[[], str | None] = lambda: None
    # A round with the others now: the changes made here sent, theirs applied here.
    settle: Callable[[], Awaitable[None]] | None = None
    # This process's /metrics with its peers' merged in; None: alone.
    merged_metrics: Callable[[bytes], Awaitable[bytes]] | None = None


def instances_json(
    cluster: Cluster, now: float, removing: frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    rows = []
    for view in cluster.view().instances:
        state = cluster.instances[view.name]
        snap = state.snapshot
        rows.append(
            {
                "name": view.name,
                "url": state.url,
                "engine": state.config.engine,
                "migration": state.migration_mode,
                "migration_configured": state.config.migration,
                "shim": state.shim,
                "shim_error": state.shim_error,
                "metrics_path": state.metrics_path,
                "labels": state.config.labels,
                "engine_priority": state.config.engine_priority,
                "healthy": view.healthy,
                "draining": view.draining,
                "removing": view.name in removing,
                "freeness": view.freeness + 0.0 if view.freeness > -1e300 else None,  # (not -0.0)
                "inflight": view.inflight,  # with a shared view: every process's
                "local_inflight": cluster.ledger.count(view.name),
                "virtual_blocks": round(view.virtual_blocks, 2),
                "batch": view.batch,
                "models": sorted(view.models),
                "prefix_index": cluster.prefixes.describe(view.name),
                "snapshot": None
                if snap is None
                else {
                    "running": snap.running,
                    "waiting": snap.waiting,
                    "kv_usage": snap.kv_usage,
                    "kv_blocks_total": snap.kv_blocks_total,
                    "block_size": snap.block_size,
                    "preemptions_total": snap.preemptions_total,
                    "age_s": None
                    if state.snapshot_at is None
                    else round(now - state.snapshot_at, 3),
                },
                "ejected_for_s": round(cluster.ejected_for(view.name), 3) or None,
                "call_failures": state.ejection.failures,
                "last_error": state.last_error,
                "models_error": state.models_error,
            }
        )
    return rows


def add_routes(
    app: web.Application, fleet: Callable[[], Fleet], sharing: SharingStatus | None = None
) -> None:
    """`fleet()` is the running fleet (built when the app starts)."""
    status = sharing or SharingStatus()

    def authorized(request: web.Request) -> web.Response | None:
        token = fleet().config.admin_token  # a reload may change it
        if token is None:
            return error_response(
                403,
                "admin API is disabled: set admin_token in the config or FERRY_ADMIN_TOKEN",
                code="admin_disabled",
            )
        if not client_auth.authorized(request.headers.get("Authorization", ""), (token,)):
            return error_response(
                401,
                "missing or wrong admin bearer token",
                code="invalid_token",
                headers={"WWW-Authenticate": "Bearer"},  # (RFC 9110: a 401 names its scheme)
            )
        return None

    def guarded(
        change: Callable[[web.Request], Awaitable[web.Response]], shared: bool = False
    ) -> Any:
        """Check the token; turn a refused change into its OpenAI-shaped error. A
        `shared` change (one every process makes) waits for the shared view."""

        async def handler(request: web.Request) -> web.Response:
            if (denied := authorized(request)) is not None:
                return denied
            if shared and (why := status.unshared()) is not None:
                message = (
                    f"not changed: {why}, and a change made here alone would not reach the others"
                )
                return error_response(
                    503, message, code="sharing_unavailable", headers={"Retry-After": "1"}
                )
            settle = status.settle if shared else None
            try:
                try:
                    answer = await change(request)
                except FleetError as exc:
                    if exc.status not in (404, 409) or settle is None:
                        raise
                    # Added (or removed) through another process a moment ago,
                    # perhaps, and not heard of here yet: asked again once the
                    # fleet log is read. (Neither refusal changed anything.)
                    await settle()
                    answer = await change(request)
            except FleetError as exc:
                return error_response(exc.status, str(exc), code=exc.code, headers=exc.headers)
            if settle is not None:
                await settle()  # answered once every process can see it
            return answer

        return handler

    def row(name: str) -> dict[str, Any]:
        rows = instances_json(fleet().cluster, time.monotonic(), fleet().removing)
        return next(r for r in rows if r["name"] == name)

    async def list_instances(request: web.Request) -> web.Response:
        f = fleet()
        return web.json_response(instances_json(f.cluster, time.monotonic(), f.removing))

    # Each change is made here, then announced: with a shared view the peers
    # make it too (proxy/sharing.py); alone, the announcement goes nowhere.
    async def add_instance(request: web.Request) -> web.Response:
        raw = await _json_body(request)
        instance = fleet().add_raw(raw)
        fleet().announce({"op": "add", "instance": raw})
        return web.json_response(row(instance.name), status=201)

    async def patch_instance(request: web.Request) -> web.Response:
        name, changes = request.match_info["name"], await _json_body(request)
        fleet().check_changeable(name)
        instance = fleet().patch(name, changes)
        fleet().announce({"op": "patch", "name": name, "changes": changes})
        return web.json_response(row(instance.name))

    async def delete_instance(request: web.Request) -> web.Response:
        name, migrate = request.match_info["name"], _flag(request, "migrate")
        fleet().check_changeable(name)
        moving = fleet().remove(name, migrate=migrate, everywhere=True)
        fleet().announce({"op": "remove", "name": name, "migrate": migrate})
        return web.json_response({**row(name), "migrating": moving}, status=202)

    async def drain(request: web.Request) -> web.Response:
        name, migrate = request.match_info["name"], _flag(request, "migrate")
        fleet().check_changeable(name)
        moving = fleet().drain(name, migrate=migrate)
        fleet().announce({"op": "drain", "name": name, "migrate": migrate})
        return web.json_response({**row(name), "migrating": moving})

    async def undrain(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        fleet().check_changeable(name)
        fleet().undrain(name)
        fleet().announce({"op": "undrain", "name": name})
        return web.json_response(row(name))

    async def reload(request: web.Request) -> web.Response:
        applied = await fleet().reload()
        # With `--workers` this one applied it, and every worker reads the file
        # again after it (this one too, finding nothing more to change).
        applied["every_worker"] = workers.reload_every_worker()
        return web.json_response(applied)

    async def shared_view(request: web.Request) -> web.Response:
        return web.json_response(status.describe())

    app.router.add_get("/admin/instances", guarded(list_instances))
    app.router.add_post("/admin/instances", guarded(add_instance, shared=True))
    app.router.add_patch("/admin/instances/{name}", guarded(patch_instance, shared=True))
    app.router.add_delete("/admin/instances/{name}", guarded(delete_instance, shared=True))
    app.router.add_post("/admin/instances/{name}/drain", guarded(drain, shared=True))
    app.router.add_post("/admin/instances/{name}/undrain", guarded(undrain, shared=True))
    app.router.add_post("/admin/reload", guarded(reload))
    app.router.add_get("/admin/sharing", guarded(shared_view))


def _flag(request: web.Request, name: str) -> bool:
    """A yes-or-no query parameter (absent: no). Any other word is refused: read
    as no, `?migrate=maybe` removed an instance at once, its streams cut."""
    value = request.query.get(name, "").lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("", "0", "false", "no"):
        return False
    raise FleetError(400, f"{name}: must be true or false", "invalid_request")


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The body as a client's is read: decoded, and a JSON object read strictly
    (a key given twice is refused: which one would apply?)."""
    try:
        raw = await request.app[request_body.BODIES].read(request)
        return read_object(raw)
    except BadRequest as exc:  # (400, 408, 413, 415; 503 with its Retry-After)
        code = "invalid_request" if exc.status < 500 else "busy"
        raise FleetError(exc.status, exc.message, code, exc.headers) from None
