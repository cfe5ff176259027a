"""The admin API under `/admin`, behind a bearer token.

Without a configured token (config `admin_token` or `FERRY_ADMIN_TOKEN`) the admin
API refuses every call: an open drain button is worse than none.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from proxy.cluster import Cluster
from proxy.errors import error_response


def instances_json(cluster: Cluster, now: float) -> list[dict[str, Any]]:
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
                "labels": state.config.labels,
                "healthy": view.healthy,
                "draining": view.draining,
                "freeness": view.freeness if view.freeness > -1e300 else None,
                "inflight": view.inflight,
                "virtual_blocks": round(view.virtual_blocks, 2),
                "batch": view.batch,
                "models": sorted(view.models),
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
                "last_error": state.last_error,
            }
        )
    return rows


def add_routes(
    app: web.Application,
    cluster: Cluster,
    token: str | None,
    migrate_off: Callable[[str], int] = lambda _: 0,
) -> None:
    """`migrate_off(name)` starts moving the instance's live streams away and says how many."""

    def authorized(request: web.Request) -> web.Response | None:
        if token is None:
            return error_response(
                403,
                "admin API is disabled: set admin_token in the config or FERRY_ADMIN_TOKEN",
                code="admin_disabled",
            )
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return error_response(401, "missing or wrong admin bearer token", code="invalid_token")
        return None

    async def list_instances(request: web.Request) -> web.Response:
        if (denied := authorized(request)) is not None:
            return denied
        return web.json_response(instances_json(cluster, time.monotonic()))

    def set_draining(draining: bool) -> Any:
        async def handler(request: web.Request) -> web.Response:
            if (denied := authorized(request)) is not None:
                return denied
            name = request.match_info["name"]
            if name not in cluster.instances:
                return error_response(404, f"no instance named {name!r}", code="instance_not_found")
            cluster.set_draining(name, draining)
            row = next(r for r in instances_json(cluster, time.monotonic()) if r["name"] == name)
            if draining and request.query.get("migrate") in ("1", "true", "yes"):
                row["migrating"] = migrate_off(name)
            return web.json_response(row)

        return handler

    app.router.add_get("/admin/instances", list_instances)
    app.router.add_post("/admin/instances/{name}/drain", set_draining(True))
    app.router.add_post("/admin/instances/{name}/undrain", set_draining(False))
