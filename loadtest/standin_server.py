"""A STAND-IN OpenAI/vLLM server: fast, fake, for benchmarks and integration tests.

It is not vLLM. It streams `max_tokens` tokens of the word "tok" with a fixed
gap and answers `/v1/models` and `/metrics` in vLLM 0.32's format (its running
count is real: the requests it is serving right now), so the proxy's whole path
(dispatch, ledger, SSE relay, scraping) runs against it. Use it where real vLLM
cannot run or would be the bottleneck: measuring the proxy's own overhead, or
many instances at once. It also answers the rest of vLLM's surface in outline
(`/v1/responses` and Anthropic's `/v1/messages`, streamed or whole;
`/v1/embeddings`; `/tokenize`,
`/detokenize`; pooling and scoring routes, which say which route and model
answered), and refuses bad bodies with a 4xx as vLLM does.

    python -m loadtest.standin_server --port 9001 --itl-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from aiohttp import web

# vLLM 0.32's error event for every stream when its engine core has died.
# The blank line that ends an event, by `framing`: SSE allows CRLF, LF and a lone CR.
_BLANK_LINE = {"crlf": b"\r\n\r\n", "cr": b"\r\r"}

ENGINE_DEAD = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above)'
    b' for the root cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
)


class StandIn:
    def __init__(
        self,
        *,
        model: str = "standin",
        itl_s: float = 0.01,
        ttft_s: float = 0.0,
        kv_blocks: int = 1000,
        block_size: int = 16,
    ) -> None:
        self.model, self.itl_s, self.ttft_s = model, itl_s, ttft_s
        self.kv_blocks, self.block_size = kv_blocks, block_size
        self.running = 0
        self.served = 0
        self.fail_status: int | None = None  # tests: answer every request with this status
        self.break_after: int | None = None  # tests: drop the connection after n tokens
        # tests: a whole (non-streamed) answer's headers go out, then the
        # connection drops mid-body (a server that sends its headers early)
        self.break_whole = False
        # tests: end the body cleanly after n tokens, with no finish reason and no
        # [DONE] (a server that closed a stream it had not finished)
        self.end_after: int | None = None
        # tests: False ends a finished stream without `data: [DONE]`, as some
        # OpenAI-compatible servers do
        self.send_done = True
        # tests: how events are framed: "lf" as vLLM, "crlf" as sse-starlette
        # (llama-cpp-python and others), "cr" (a lone CR), "nospace": `data:` with no space after it
        self.framing = "lf"
        self.gzip_whole = False  # tests: compress a whole answer though asked for identity
        self.stall_after: int | None = None  # tests: go silent (socket open) after n tokens
        self.stall_s = 3.0  # ... for this long
        self.stall_pings_s: float | None = None  # ... with an SSE comment this often
        self.metrics_delay_s = 0.0  # tests: `/metrics` answers this late (a busy engine)
        self.health_delay_s = 0.0  # tests: `/health` too (with the above: a frozen process)
        # tests: give the stream up after n tokens as vLLM does when it shuts down
        # or pauses: a chunk with finish_reason "abort" and no token, then [DONE]
        self.abort_after: int | None = None
        # tests: after n tokens, send what vLLM's API server sends each stream when
        # its engine core dies: a 500 error event, then [DONE]
        self.error_after: int | None = None
        # tests: cut this many requests before reading them, as an engine closing
        # an idle keep-alive connection just as the proxy reuses it
        self.drop_next = 0
        self.headers_delay_s = 0.0  # tests: a busy server sends a stream's headers late
        # tests: take a request, then cut its connection this long after without
        # an answer (an engine that dies while it generates a whole answer)
        self.drop_after_s: float | None = None
        # tests: a stream's usage chunk (`stream_options.include_usage`) comes this
        # long after its last token, as a separate write (vLLM's are, too)
        self.usage_delay_s = 0.0
        # tests: where that usage comes: "own_chunk" (vLLM's, with `"choices": []`),
        # "last_choice" (with the finish reason) or "null_choices" (`"choices": null`),
        # as other OpenAI-compatible servers send it
        self.usage_with = "own_chunk"
        self.hold_open_s = 0.0  # tests: keep a finished stream's body open this long
        self.gzip_stream = False  # tests: compress a stream though asked for identity
        # tests: a chat stream's first n tokens are thoughts, as from a vLLM with a
        # reasoning parser (`delta.reasoning`, not `delta.content`)
        self.reasoning_tokens = 0
        # tests: ... after its first n tokens, which make no text at all (a
        # reasoning parser's `<think>`: vLLM sends an empty delta with its ids)
        self.silent_tokens = 0
        # tests: the bodies `/metrics` and `/v1/models` answer instead of the real
        # ones (a broken engine, or something else on its port)
        self.metrics_body: bytes | None = None
        # tests: `/metrics/` filters by `name[]`, as vLLM's prometheus mount does;
        # False: a 404 there (an engine that cannot be asked by name), and
        # these series are left out though asked for
        self.metrics_by_name = True
        self.metrics_by_name_drops: frozenset[str] = frozenset()
        self.metrics_reads: list[str] = []  # "by name" or "whole", each look in order
        self.metrics_whole_fails = False  # tests: `/metrics` answers 500 (a busy route)
        self.models_body: bytes | None = None
        # tests: the model's context length, as vLLM lists it; once set, a chat
        # without a budget runs to its end, as in vLLM (else it gets 16 tokens)
        self.max_model_len: int | None = None
        # tests: a text prompt is as many tokens as it has words (a chat: its
        # messages' words), in its context and at /tokenize; else 3 (PROMPT_IDS)
        self.words_are_tokens = False
        self.seen_bodies: list[dict[str, Any]] = []
        self.seen_headers: list[dict[str, str]] = []  # of each POST, in order
        self.tokenized: list[dict[str, Any]] = []  # each /tokenize body, in order
        self.dead = False  # tests: `kill()` was called
        self.api_key: str | None = None  # tests: refuse calls without this bearer key
        # tests: a streamed /v1/responses waits for this after its first delta
        self.responses_gate: asyncio.Event | None = None
        self.answers: list[tuple[str, int]] = []  # (path, status) of each POST answered
        self.cookie: str | None = None  # tests: set as a cookie on every answer (a gateway's)
        # tests: a whole answer carries this many bytes more (a field "pad")
        self.pad_whole_bytes = 0
        # tests: a whole answer is this instead, with 200 (a gateway's page)
        self.whole_body: bytes | None = None
        # tests: after n tokens, an event that never ends: bytes with no line end
        # for as long as the client reads them
        self.endless_after: int | None = None
        self._live: set[asyncio.BaseTransport] = set()
        self.extra_headers: dict[str, str] = {}  # tests: on every answer (CORS, rate limits)
        # tests: the next answer is these pieces of bytes, written raw 0.05 s
        # apart (what no HTTP server would send: a bad chunk size, a control
        # character in a header), then the connection closes
        self.raw_answer: list[bytes] | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.on_response_prepare.append(self._note_answer)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/invocations", self._generate)  # SageMaker's, as vLLM serves it
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        for path in POOLING_ROUTES:
            app.router.add_post(path, self._pooling)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/metrics/", self._metrics_by_name)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key", "type": "auth"}}, status=401)
        try:
            response: web.StreamResponse = await handler(request)
        except _Refused as refused:
            return refused.response
        return response

    async def _note_answer(self, request: web.Request, response: web.StreamResponse) -> None:
        if request.method == "POST":  # recorded before the client can see the answer
            self.answers.append((request.path, response.status))
            self.seen_headers.append(dict(request.headers))
        response.headers.extend(self.extra_headers)
        if self.cookie is not None:  # (headers are made before this hook: not set_cookie)
            response.headers.add("Set-Cookie", f"session={self.cookie}; Path=/")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON object a route takes, or a 4xx as vLLM answers it (it checks
        the media type, then the JSON, then the model)."""
        if request.content_type != "application/json":
            _refuse(400, "Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError):
            _refuse(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            _refuse(400, "request body must be a JSON object")
        model = body.get("model")
        if model and model != self.model:  # (vLLM takes "" for its own, as none named)
            _refuse(404, f"The model `{model}` does not exist.", param="model")
        return body

    def _refuse_if_told(self) -> None:
        if self.fail_status is not None:
            # A busy server says when to come back.
            retry = {"Retry-After": "1"} if self.fail_status == 429 else None
            _refuse(self.fail_status, "stand-in told to fail", headers=retry)

    async def _health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        return web.Response(text="ok")

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"standin-{self.model}"})

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_body is not None:
            return web.Response(body=self.models_body, content_type="application/json")
        card = {
            "id": self.model,
            "object": "model",
            "owned_by": "standin",
            "max_model_len": self.max_model_len or 4096,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics_by_name(self, request: web.Request) -> web.Response:
        """vLLM's `/metrics/` mount: only the series `name[]` asks for."""
        if not self.metrics_by_name:
            raise web.HTTPNotFound()
        self.metrics_reads.append("by name")
        page = await self._page()
        names = set(request.query.getall("name[]", [])) - self.metrics_by_name_drops
        if self.metrics_body is not None or page.text is None:
            return page
        kept = [ln for ln in page.text.splitlines() if ln.split("{")[0].split(" ")[0] in names]
        return web.Response(text="".join(ln + "\n" for ln in kept))

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_reads.append("whole")
        if self.metrics_whole_fails:
            raise web.HTTPInternalServerError()
        return await self._page()

    async def _page(self) -> web.Response:
        await asyncio.sleep(self.metrics_delay_s)
        if self.metrics_body is not None:
            return web.Response(body=self.metrics_body, content_type="text/plain")
        used = min(1.0, self.running * 4 / self.kv_blocks)
        labels = f'engine="0",model_name="{self.model}"'
        text = (
            f"vllm:num_requests_running{{{labels}}} {self.running}.0\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {used}\n"
            f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
            f'num_gpu_blocks="{self.kv_blocks}"}} 1.0\n'
            f"vllm:e2e_request_latency_seconds_count{{{labels}}} {self.served}.0\n"
        )
        return web.Response(text=text)

    async def _transcribe(self, request: web.Request) -> web.Response:
        """A Whisper server's route: a multipart form with the audio file."""
        form = await request.post()
        self.served += 1
        audio = form.get("file")
        size = len(audio.file.read()) if isinstance(audio, web.FileField) else 0
        return web.json_response(
            {"text": f"{self.model} heard {size} bytes for {form.get('model')}"}
        )

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        await self._body(request)
        self._refuse_if_told()
        self.served += 1
        answer = {
            "object": "list",
            "model": self.model,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}],
        }
        if self.break_whole and request.transport is not None:
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(json.dumps(answer).encode()[:20])
            request.transport.abort()
            return resp
        return web.json_response(answer)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._refuse_if_told()
        self.tokenized.append(body)
        if isinstance(body.get("messages"), list):
            text = _words_of(body)
        else:
            text = body.get("prompt")
        if not isinstance(text, str):
            _refuse(400, "'prompt' must be a string", param="prompt")
        tokens = [TOKEN_ID] * len(text.split())  # one " tok" per word
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._refuse_if_told()
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            _refuse(400, "'tokens' must be a list of integers", param="tokens")
        return web.json_response({"prompt": "".join(TOKEN_TEXT for t in tokens if t == TOKEN_ID)})

    async def _pooling(self, request: web.Request) -> web.Response:
        """Pooling and scoring routes in outline: which route and model answered."""
        await self._body(request)
        self._refuse_if_told()
        route = request.path
        return web.json_response(
            {"object": "standin" + route.replace("/", "."), "model": self.model, "route": route}
        )

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API in outline: `max_output_tokens` tokens of " tok"."""
        body = await self._body(request)
        self._refuse_if_told()
        n = _tokens(body, "max_output_tokens")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            _refuse(400, "'stream' must be a boolean", param="stream")
        self.served += 1
        self.running += 1
        try:
            return await self._respond(request, f"resp_standin{self.served}", n, bool(stream))
        finally:
            self.running -= 1

    async def _respond(
        self, request: web.Request, rid: str, n: int, stream: bool
    ) -> web.StreamResponse:
        if not stream:
            await asyncio.sleep(self.ttft_s + self.itl_s * n)
            return web.json_response(self._response(rid, "completed", TOKEN_TEXT * n, n))
        resp = self._event_stream()
        await asyncio.sleep(self.headers_delay_s)
        await resp.prepare(request)
        events = 0

        async def send(kind: str, **fields: Any) -> None:
            nonlocal events
            data = json.dumps({"type": kind, "sequence_number": events, **fields})
            events += 1
            await resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

        await send("response.created", response=self._response(rid, "in_progress", "", 0))
        await asyncio.sleep(self.ttft_s)
        item = {"item_id": f"msg_{rid}", "output_index": 0, "content_index": 0, "logprobs": []}

        async def delta(i: int) -> None:
            await send("response.output_text.delta", delta=TOKEN_TEXT, **item)
            if i == 0 and self.responses_gate is not None:
                await self.responses_gate.wait()

        if not await self._deltas(request, n, delta):
            return resp
        await send("response.output_text.done", text=TOKEN_TEXT * n, **item)
        await send(
            "response.completed", response=self._response(rid, "completed", TOKEN_TEXT * n, n)
        )
        await resp.write_eof()
        return resp

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API in outline, as vLLM serves it: `max_tokens`
        tokens of " tok", streamed in its named events or whole."""
        body = await self._body(request)
        self._refuse_if_told()
        n = _tokens(body, "max_tokens")
        self.served += 1
        message = {
            "id": f"msg_standin{self.served}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(PROMPT_IDS), "output_tokens": 0},
        }
        if not body.get("stream"):
            await asyncio.sleep(self.ttft_s + self.itl_s * n)
            message["content"] = [{"type": "text", "text": TOKEN_TEXT * n}]
            message["stop_reason"] = "max_tokens"
            message["usage"] = {"input_tokens": len(PROMPT_IDS), "output_tokens": n}
            return web.json_response(message)
        resp = self._event_stream()
        await resp.prepare(request)

        async def send(kind: str, **fields: Any) -> None:
            data = json.dumps({"type": kind, **fields})
            await resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

        await send("message_start", message=message)
        await send("content_block_start", index=0, content_block={"type": "text", "text": ""})
        await asyncio.sleep(self.ttft_s)
        text = {"type": "text_delta", "text": TOKEN_TEXT}

        async def delta(i: int) -> None:
            await send("content_block_delta", index=0, delta=text)

        if not await self._deltas(request, n, delta):
            return resp
        await send("content_block_stop", index=0)
        usage = {"output_tokens": n}
        await send("message_delta", delta={"stop_reason": "max_tokens"}, usage=usage)
        await send("message_stop")
        await resp.write_eof()
        return resp

    async def _deltas(
        self, request: web.Request, n: int, delta: Callable[[int], Awaitable[None]]
    ) -> bool:
        """Send n deltas (`delta(i)`), `itl_s` apart; False where the stand-in was
        told to die mid-stream (`break_after`): its connection is cut."""
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            if self.break_after is not None and i == self.break_after:
                assert request.transport is not None
                request.transport.abort()  # an instance dying mid-stream
                return False
            await delta(i)
        return True

    def _response(self, rid: str, status: str, text: str, n: int) -> dict[str, Any]:
        message = {
            "type": "message",
            "id": f"msg_{rid}",
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": self.model,
            "status": status,
            "output": [message] if text else [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 3,
                "output_tokens": n,
                "total_tokens": n + 3,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    def kill(self) -> None:
        """Tests: die like a process under kill -9: every connection in flight is
        cut, and every later request is cut before it gets an answer."""
        self.dead = True
        for transport in self._live:
            transport.abort()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if self.drop_next and request.transport is not None:
            self.drop_next -= 1
            request.transport.abort()
            return web.Response()  # never sent: the connection is gone
        if self.dead and request.transport is not None:
            request.transport.abort()
        body = await self._body(request)
        self.seen_bodies.append(body)
        if self.raw_answer is not None and request.transport is not None:
            pieces, self.raw_answer, raw = self.raw_answer, None, request.transport
            for piece in pieces:
                raw.write(piece)
                await asyncio.sleep(0.05)
            raw.close()
            return web.Response()  # never sent: the connection is gone
        if self.drop_after_s is not None and request.transport is not None:
            await asyncio.sleep(self.drop_after_s)
            request.transport.abort()
            return web.Response()  # never sent: the connection is gone
        self._refuse_if_told()
        chat = request.path.endswith("/chat/completions") or "messages" in body
        n = _tokens(body, "max_tokens")
        if self.max_model_len:  # as vLLM: no prompt past the context, no budget either
            prompt = body.get("prompt")
            ids_given = isinstance(prompt, list) and all(type(i) is int for i in prompt)
            prompt_len = len(prompt) if ids_given else len(PROMPT_IDS)
            if self.words_are_tokens and not ids_given:
                prompt_len = len(_words_of(body).split())
            if prompt_len > self.max_model_len:
                message = (
                    f"This model's maximum context length is {self.max_model_len} tokens."
                    f" However, your request has {prompt_len} input tokens."
                )
                _refuse(400, message, param="input_tokens")
            room = self.max_model_len - prompt_len
            n = room if chat and body.get("max_tokens") is None else min(n, room)
        ids = bool(body.get("return_token_ids"))
        self.running += 1
        self.served += 1
        transport = request.transport
        if transport is not None:
            self._live.add(transport)
        try:
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                choices = body.get("n") if type(body.get("n")) is int else 1
                return await self._stream(request, chat, n, ids, usage, choices)
            await asyncio.sleep(self.ttft_s + self.itl_s * n)
            if self.break_whole and transport is not None:
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                await resp.prepare(request)
                await resp.write(json.dumps(self._whole(chat, n, ids)).encode()[:20])
                transport.abort()
                return resp
            if self.whole_body is not None:
                return web.Response(body=self.whole_body, content_type="text/html")
            if self.gzip_whole:
                data = gzip.compress(json.dumps(self._whole(chat, n, ids)).encode())
                headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
                return web.Response(body=data, headers=headers)
            whole = self._whole(chat, n, ids)
            if self.pad_whole_bytes:
                whole["pad"] = "x" * self.pad_whole_bytes
            return web.json_response(whole)
        finally:
            self.running -= 1
            self._live.discard(transport)  # type: ignore[arg-type]

    def _event_stream(self) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream"}
        if not self.gzip_stream:
            return web.StreamResponse(headers=headers)
        return _GzipStream(headers={**headers, "Content-Encoding": "gzip"})

    async def _stream(
        self, request: web.Request, chat: bool, n: int, ids: bool, usage: bool, choices: int = 1
    ) -> web.StreamResponse:
        resp = self._event_stream()
        await asyncio.sleep(self.headers_delay_s)
        await resp.prepare(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-standin-{self.served}"
        await asyncio.sleep(self.ttft_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            last = i == n - 1
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": "length" if last else None,
            }
            chunk: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": self.model}
            if chat:
                chunk["object"] = "chat.completion.chunk"
                thought = i < self.silent_tokens + self.reasoning_tokens
                choice["delta"] = {"reasoning" if thought else "content": " tok"}
                if i < self.silent_tokens:
                    choice["delta"] = {}
                if i == 0:
                    chunk["prompt_token_ids"] = PROMPT_IDS if ids else None
            else:
                chunk["object"] = "text_completion"
                choice["text"] = " tok"
                choice["prompt_token_ids"] = PROMPT_IDS if ids and i == 0 else None
            choice["token_ids"] = [7] if ids else None
            chunk["choices"] = [choice]
            if usage and last and self.usage_with == "last_choice":
                chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            if self.stall_after is not None and i == self.stall_after:
                await self._stall(resp)  # a hung engine: the socket stays open
            if self.break_after is not None and i == self.break_after:
                assert request.transport is not None
                request.transport.abort()  # an instance dying mid-stream
                return resp
            if self.endless_after is not None and i == self.endless_after:
                await resp.write(b'data: {"choices":[{"text":"')
                while True:
                    await resp.write(b"x" * 65536)
            if self.end_after is not None and i == self.end_after:
                await resp.write(b'data: {"choices":[{"ind')  # and half an event
                await resp.write_eof()
                return resp
            if self.error_after is not None and i == self.error_after:
                await resp.write(ENGINE_DEAD + b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            if self.abort_after is not None and i == self.abort_after:
                # The engine gives the request up: no token, then the end.
                choice.update(finish_reason="abort", token_ids=[] if ids else None)
                choice["delta" if chat else "text"] = {"content": ""} if chat else ""
                n = i  # nothing follows this chunk
            for c in range(1, choices):  # n > 1: choice c is c tokens shorter
                if i < n - c:
                    last_c = "length" if i == n - c - 1 else None
                    other = {**choice, "index": c, "finish_reason": last_c}
                    data = json.dumps({**chunk, "choices": [other]}, separators=(",", ":"))
                    await resp.write(self._frame(data.encode()))
            await resp.write(self._frame(json.dumps(chunk, separators=(",", ":")).encode()))
            if i + 1 >= n:
                break
        if self.break_after is not None and self.break_after >= n:
            await asyncio.sleep(self.usage_delay_s)
            assert request.transport is not None
            request.transport.abort()  # dead after its last token, before the end
            return resp
        if usage and self.usage_with != "last_choice":
            await asyncio.sleep(self.usage_delay_s)
            chunk = {"id": rid, "created": int(time.time()), "model": self.model, "choices": []}
            if self.usage_with == "null_choices":
                chunk["choices"] = None
            chunk["object"] = "chat.completion.chunk" if chat else "text_completion"
            chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            await resp.write(self._frame(json.dumps(chunk).encode()))
        if self.send_done:
            await resp.write(self._frame(b"[DONE]"))
        await asyncio.sleep(self.hold_open_s)
        await resp.write_eof()
        return resp

    async def _stall(self, resp: web.StreamResponse) -> None:
        if self.stall_pings_s is None:
            await asyncio.sleep(self.stall_s)
            return
        until = asyncio.get_running_loop().time() + self.stall_s
        while asyncio.get_running_loop().time() < until:  # as sse-starlette keeps a stream alive
            await asyncio.sleep(self.stall_pings_s)
            await resp.write(b": ping\n\n")

    def _frame(self, data: bytes) -> bytes:
        """One event as this server frames it (`framing`)."""
        head = b"data:" if self.framing == "nospace" else b"data: "
        return head + data + _BLANK_LINE.get(self.framing, b"\n\n")

    def _whole(self, chat: bool, n: int, ids: bool) -> dict[str, Any]:
        text = " tok" * n
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": "length",
            "token_ids": [7] * n if ids else None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            choice["prompt_token_ids"] = PROMPT_IDS if ids else None
        out: dict[str, Any] = {
            "id": f"standin-{self.served}",
            "object": "chat.completion" if chat else "text_completion",
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
        }
        if chat:
            out["prompt_token_ids"] = PROMPT_IDS if ids else None
        return out


TOKEN_ID, TOKEN_TEXT = 7, " tok"  # the one token the stand-in generates
PROMPT_IDS = [1, 2, 3]  # every prompt's ids, as the stand-in reports them


def _words_of(body: dict[str, Any]) -> str:
    """A prompt's text, or a chat's messages' text, one space between them."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


# vLLM 0.32's pooling and scoring routes, answered in outline.
POOLING_ROUTES = (
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v2/embed",
)


class _Refused(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


def _refuse(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> NoReturn:
    """Answer with an error in vLLM's shape (the OpenAI shape, `code` the status)."""
    error = {"message": message, "type": "BadRequestError", "param": param, "code": status}
    raise _Refused(web.json_response({"error": error}, status=status, headers=headers))


def _tokens(body: dict[str, Any], key: str) -> int:
    """The token budget `body[key]` (16 when absent), or a 400 as vLLM gives."""
    value = body.get(key)
    if value is None:
        return 16
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 10_000_000:
        _refuse(400, f"'{key}' must be an integer from 1 to 10000000", param=key)
    return value


class _GzipStream(web.StreamResponse):
    """A stream whose writes go out gzipped, each flushed at once (tests: a
    server that compresses an event stream though asked for identity)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._packer = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        packed = self._packer.compress(bytes(data)) + self._packer.flush(zlib.Z_SYNC_FLUSH)
        await super().write(packed)

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write(self._packer.compress(data) + self._packer.flush())
        await super().write_eof()


def main() -> None:
    parser = argparse.ArgumentParser(description="stand-in OpenAI server (not vLLM)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--model", default="standin")
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    args = parser.parse_args()
    import uvloop

    standin = StandIn(model=args.model, itl_s=args.itl_ms / 1000, ttft_s=args.ttft_ms / 1000)
    web.run_app(
        standin.app(),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
