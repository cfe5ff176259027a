"""A STAND-IN for a generic OpenAI-compatible server: not vLLM, not any real engine.

It speaks the OpenAI API and nothing more: `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, streamed and whole. It publishes no `/metrics` and
returns no token ids, and like a strict server it answers a body field it does
not know with a 400, so a vLLM-only field such as `return_token_ids` would
fail the request. Ferry's `engine: openai` adapter runs against it.

Each reply is `max_tokens` words " tok", one every `itl_s` seconds; a whole
reply carries a `usage` block, a stream one when `stream_options.include_usage`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

# The request fields of the OpenAI API this stand-in accepts; anything else is a 400.
# The blank line that ends an event, by `framing`: SSE allows CRLF, LF and a lone CR.
_BLANK_LINE = {"crlf": b"\r\n\r\n", "cr": b"\r\r"}

KNOWN_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "user",
    }
)


class OpenAIStandIn:
    def __init__(self, *, model: str = "generic", itl_s: float = 0.01) -> None:
        self.model, self.itl_s = model, itl_s
        self.running = 0  # requests being answered right now
        self.served = 0
        self.seen_bodies: list[dict[str, Any]] = []
        self.models_status = 200  # tests: `/v1/models` answers this status
        # tests: event framing, "lf", "crlf" (sse-starlette's), "cr" or "nospace" (`data:{`)
        self.framing = "lf"
        self.ignore_stream = False  # tests: answer a stream request whole, as JSON
        self.send_done = True  # tests: False ends a stream without `data: [DONE]`
        self.hold_open_s = 0.0  # tests: keep a finished stream's body open this long
        self.error_with_200 = False  # tests: answer whole with a server error, status 200

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return _error(self.models_status, "stand-in told to fail")
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "standin"}
        return web.json_response({"object": "list", "data": [card]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen_bodies.append(body)
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if unknown:
            return _error(400, f"unknown fields: {', '.join(unknown)}")
        chat = request.path.endswith("/chat/completions")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        self.running += 1
        self.served += 1
        try:
            if body.get("stream") and not self.ignore_stream:
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, chat, n, usage)
            await asyncio.sleep(self.itl_s * n)
            if self.error_with_200:
                error = {"message": "stand-in engine failed", "type": "InternalServerError"}
                return web.json_response({"error": {**error, "code": 500}})
            return web.json_response(self._whole(chat, n))
        finally:
            self.running -= 1

    async def _stream(
        self, request: web.Request, chat: bool, n: int, usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-generic-{self.served}"
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": "length" if i == n - 1 else None,
            }
            if chat:
                choice["delta"] = {"content": " tok"}
            else:
                choice["text"] = " tok"
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [choice],
            }
            await resp.write(self._frame(chunk))
        if usage:
            tail = {"id": rid, "model": self.model, "choices": [], "usage": _usage(n)}
            await resp.write(self._frame(tail))
        if self.send_done:
            await resp.write(self._frame("[DONE]"))
        await asyncio.sleep(self.hold_open_s)
        await resp.write_eof()
        return resp

    def _frame(self, obj: Any) -> bytes:
        data = (
            obj.encode()
            if isinstance(obj, str)
            else json.dumps(obj, separators=(",", ":")).encode()
        )
        head = b"data:" if self.framing == "nospace" else b"data: "
        return head + data + _BLANK_LINE.get(self.framing, b"\n\n")

    def _whole(self, chat: bool, n: int) -> dict[str, Any]:
        text = " tok" * n
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"generic-{self.served}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": _usage(n),
        }


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}


def _error(status: int, message: str) -> web.Response:
    error = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(error, status=status)
