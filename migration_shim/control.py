"""The shim's HTTP control routes, added to vLLM's API server with
`--middleware migration_shim.control.middleware`.

The API server holds no KV and runs no scheduler; each route turns into
`ferry_shim` utility calls on the engine core (see `connector`). `MIGRATE`
drives one migration out of this instance, the paper's pre-copy:
1. stage 1 orders a copy of every full block; each later stage, the blocks that
   filled since; stages stop at `max_stages`, or when at most
   `last_stage_blocks` full blocks wait;
2. stop-and-copy: the request is stopped between steps and the rest, partial
   last block included, goes out in the next step;
3. the answer carries the engine's token ids at once, so Ferry starts the
   request on the destination while the last blocks travel; the destination
   holds it until they land, then loads the KV instead of recomputing it.
Any failure before the stop rolls back (the request runs on here, untouched).
After it, blocks that never land are computed by the destination itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from migration_shim import wire


class middleware:  # noqa: N801 - the name `--middleware` has always been given
    """A plain ASGI middleware: the shim's routes are answered here, every other
    request goes to vLLM untouched. Not Starlette's `BaseHTTPMiddleware` (what a
    function given to `--middleware` becomes): that one relays each streamed
    chunk through a memory stream, and hands its `receive` to two listeners,
    one hop and one race more on every token of every stream the server sends."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(wire.PREFIX):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        response = await route(request, request.app.state.engine_client)
        await response(scope, receive, send)


async def route(request: Request, engine: Any) -> Response:
    path = request.url.path
    try:
        if path == wire.INFO and request.method == "GET":
            return JSONResponse(await _info(engine))
        body = await request.json() if request.method == "POST" else None
        if not isinstance(body, dict):
            return _error(404 if body is None else 400, f"no route {request.method} {path}")
        if path == wire.RESERVE:
            args = {
                "mig_id": str(body["mig_id"]),
                "num_blocks": int(body["num_blocks"]),
                "lease_s": float(body.get("lease_s", 30)),
            }
            result = await _call(engine, "reserve", args)
            return JSONResponse(result) if result["ok"] else _error(409, result["error"])
        if path == wire.RELEASE:
            return JSONResponse(await _call(engine, "release", {"mig_id": str(body["mig_id"])}))
        if path == wire.MIGRATE:
            return JSONResponse(await migrate(engine, body))
    except (KeyError, TypeError, ValueError) as exc:
        return _error(400, f"bad shim request: {type(exc).__name__}: {exc}")
    return _error(404, f"no route {request.method} {path}")


async def migrate(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    mig_id = str(body["mig_id"])
    max_stages = int(body.get("max_stages", 3))
    last_stage_blocks = int(body.get("last_stage_blocks", 1))
    deadline = time.monotonic() + float(body.get("timeout_s", 60))
    begun = await _call(
        engine,
        "begin",
        {
            "mig_id": mig_id,
            "tag": str(body["tag"]),
            "dest": str(body["dest_addr"]),
            "bandwidth": float(body.get("bandwidth_mb_s", 0)) * 1e6,
        },
    )
    if not begun["ok"]:
        outcome = wire.FAILED_BEFORE_STOP if begun.get("running") else wire.SOURCE_FINISHED
        return {"outcome": outcome, "error": begun["error"]}
    started = time.monotonic()
    stop_at: float | None = None
    try:
        for _ in range(max_stages):
            pending = await _call(engine, "pending", {"mig_id": mig_id})
            if pending.get("state") != "copying":
                return _ended(pending)
            if pending["pending"] <= last_stage_blocks and pending["stages"] > 0:
                break
            staged = await _call(engine, "stage", {"mig_id": mig_id})
            status = await _until(deadline, _call(engine, "wait", {"mig_id": mig_id}))
            if status["state"] != "copying":
                return _ended(status)
            if staged.get("ordered", 0) == 0:
                break
        precopy_s = time.monotonic() - started
        stop_at = time.monotonic()
        stopped = await _until(deadline, _call(engine, "stop", {"mig_id": mig_id}))
        if not stopped["ok"]:
            return _ended(stopped)
        # The last blocks are on their way; the destination holds the continuation
        # until they land, and computes them itself if they never do.
        return {
            "outcome": wire.STOPPED,
            "token_ids": stopped["token_ids"],
            "num_computed": stopped["num_computed"],
            "blocks": stopped["scheduled"],
            "stages": stopped["stages"],
            "precopy_s": round(precopy_s, 6),
            "stop_s": round(time.monotonic() - stop_at, 6),
        }
    except TimeoutError:
        # Once a stop was asked for, the request may be stopped: Ferry resumes it.
        after = stop_at is not None
        return {
            "outcome": wire.FAILED_AFTER_STOP if after else wire.FAILED_BEFORE_STOP,
            "error": "timed out",
        }
    finally:
        # A migration still copying is rolled back; a stopped one is freed by its commit.
        await _call(engine, "forget", {"mig_id": mig_id})


def _ended(status: dict[str, Any]) -> dict[str, Any]:
    if status.get("state") == "source_finished":
        return {"outcome": wire.SOURCE_FINISHED, "error": "the request finished at the source"}
    return {"outcome": wire.FAILED_BEFORE_STOP, "error": status.get("error") or status.get("state")}


async def _until(deadline: float, call: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Await an engine-core answer (`wait` comes when the copies are through: no
    polling), but never past the migration's deadline."""
    return await asyncio.wait_for(call, max(0.0, deadline - time.monotonic()))


async def _info(engine: Any) -> dict[str, Any]:
    config = engine.vllm_config
    kv = config.kv_transfer_config
    extra = kv.kv_connector_extra_config or {}
    served = config.model_config.served_model_name
    engine_state = await _call(engine, "info", {})
    return {
        "shim_version": wire.SHIM_VERSION,
        "vllm_version": _vllm_version(),
        "model": served[0] if isinstance(served, list) else served,
        "block_size": config.cache_config.block_size,
        "dtype": str(config.model_config.dtype),
        "kv_addr": f"{extra.get('host', '127.0.0.1')}:{kv.kv_port}",
        **{k: v for k, v in engine_state.items() if k != "ok"},
    }


async def _call(engine: Any, command: str, args: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = await engine.engine_core.call_utility_async(
        "ferry_shim", command, args
    )
    return result


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )
