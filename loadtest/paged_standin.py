"""A STAND-IN engine with paged KV and recompute preemption: not vLLM.

It schedules like vLLM's engine core, so that a cluster of them shows what a
router's choices do to queueing, preemption and stalls, at a scale (16 at once)
that real vLLM servers cannot reach on one machine:
- continuous batching: each step, every running request gets one token;
- a fixed number of KV blocks of `block_size` tokens; a running request holds
  blocks for its tokens + 1 (its next token);
- preemption by recompute when a running request needs a block and none is
  free: the most recently admitted request loses its blocks and goes back to
  the head of the queue (vLLM's default);
- first come first served admission while blocks and the step's token budget
  allow (a head that does not fit blocks the queue, as in vLLM);
- prefix caching: a freed block keeps its content hash until it is evicted
  (least recently freed first), so a request whose leading blocks are cached
  prefills only the rest, as after Ferry's pre-warm or a preemption;
- step time from `loadtest.sim.profile.Profile` (the simulator's model):
  base + per_token * prefill tokens + per_seq * decoding requests.

Tokens are deterministic from the context (`next_token`), so a request resumed
from its prompt + generated ids (Ferry's lite migration) continues exactly as it
would have. It serves streaming and whole `/v1/completions` and
`/v1/chat/completions` with `return_token_ids` (the first chunk carries
`prompt_token_ids`, every chunk's choice its `token_ids`), a prompt given as
text or as a list of token ids, `/tokenize`, `/detokenize`, `/v1/models`,
`/health`, and `/metrics` in vLLM 0.32's format. Like vLLM's `--stream-interval
n`, it can send the first token at once, then n tokens per chunk. Many engines
share one process and one event loop:

    python -m loadtest.paged_standin --count 16 [--profile p.json]

prints one line `ports: 40001 40002 ...` once every engine listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from loadtest.sim.profile import Profile

VOCAB = range(10, 300)  # ids the engine emits (and `loadtest.replay` prompts with)
DEFAULT_PROFILE = Profile(
    name="paged-standin",
    step_base_s=0.030,
    step_per_token_s=0.0001,  # prefill: 10,000 tokens/s
    step_per_seq_s=0.001,
    kv_blocks=64,
    block_size=16,
    max_num_seqs=64,
    max_batched_tokens=2048,
)


def next_token(ids: list[int]) -> int:
    """The token after `ids`: a function of the last id and the length only, so a
    continuation from any cut produces the same sequence."""
    return VOCAB[(ids[-1] * 7919 + len(ids) * 104_729) % len(VOCAB)]


def token_text(token: int) -> str:
    return f" w{token}"


def tokenize(text: str) -> list[int]:
    """One id per byte: a stand-in has no vocabulary."""
    return [VOCAB[b % len(VOCAB)] for b in text.encode()] or [VOCAB[0]]


class Seq:
    """One request inside the engine."""

    __slots__ = ("ids", "prompt_len", "max_tokens", "blocks", "running", "out", "_hashes")

    def __init__(self, ids: list[int], max_tokens: int) -> None:
        self.ids = list(ids)
        self.prompt_len = len(ids)
        self.max_tokens = max_tokens
        self.blocks = 0
        self.running = False
        self.out: asyncio.Queue[int | None] = asyncio.Queue()  # token ids; None: finished
        self._hashes: list[int] = []

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_len

    def block_hashes(self, n: int, block_size: int) -> list[int]:
        """Hashes of the first n full blocks; each covers its block and all before it."""
        while len(self._hashes) < n:
            i = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else 0
            self._hashes.append(hash((parent, *self.ids[i * block_size : (i + 1) * block_size])))
        return self._hashes[:n]


class BlockPool:
    """KV blocks: plain free ones, free ones that still hold a known prefix (reusable
    until evicted, least recently freed first), and the rest in use."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.plain = total
        self.cached: OrderedDict[int, None] = OrderedDict()

    @property
    def free(self) -> int:
        return self.plain + len(self.cached)

    def hits(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def take(self, n: int, reuse: Sequence[int] = ()) -> None:
        """Claim the cached blocks `reuse`, then `n` more (evicting cached ones if need be)."""
        for h in reuse:
            del self.cached[h]
        plain = min(n, self.plain)
        self.plain -= plain
        for _ in range(n - plain):
            self.cached.popitem(last=False)

    def give_back(self, blocks: int, hashes: list[int]) -> None:
        for h in hashes:
            if h in self.cached:
                self.plain += 1  # the same prefix is cached already
            else:
                self.cached[h] = None
        self.plain += blocks - len(hashes)


class PagedEngine:
    """The scheduler and its step loop (no HTTP). `start()` launches one task on the
    running loop; `stop()` cancels it."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.bs = profile.block_size
        self.pool = BlockPool(profile.kv_blocks)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.preemptions = 0
        self.steps = 0
        self.prefilled_tokens = 0  # tokens computed by prefill (cache hits excluded)
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def max_model_len(self) -> int:
        return self.profile.kv_blocks * self.bs - 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="paged-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self._wake.set()

    def abort(self, seq: Seq) -> None:
        """Forget a request (finished, or its client went away), freeing its blocks."""
        if seq.running:
            self.running.remove(seq)
            self._free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def usage(self) -> float:
        return (self.pool.total - self.pool.free) / self.pool.total

    async def _loop(self) -> None:
        while True:
            dt = self._schedule()
            if dt is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(dt)
            self._finish_step()

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def _free(self, seq: Seq) -> None:
        # Blocks whose every token has its KV computed (all but the last sampled token).
        full = min(seq.blocks, (len(seq.ids) - 1) // self.bs)
        self.pool.give_back(seq.blocks, seq.block_hashes(full, self.bs))
        seq.blocks, seq.running = 0, False

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._free(seq)
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule(self) -> float | None:
        """Form the next batch; return its duration, or None when there is nothing to run."""
        # 1. Room for every running request's next token; preempt the newest if needed.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            need = self._blocks_for(len(seq.ids) + 1) - seq.blocks
            while need > self.pool.free and seq.running:
                self._preempt(self.running[-1])
            if seq.running:
                if need > 0:
                    self.pool.take(need)
                    seq.blocks += need
                i += 1
        # 2. Admit queued requests, first come first served.
        decoding, prefill, cached = len(self.running), 0, 0
        budget = self.profile.max_batched_tokens
        while self.waiting and len(self.running) < self.profile.max_num_seqs:
            seq = self.waiting[0]
            # At least the last token is computed, even when everything is cached.
            hashes = seq.block_hashes((len(seq.ids) - 1) // self.bs, self.bs)
            reuse = hashes[: self.pool.hits(hashes)]
            need = self._blocks_for(len(seq.ids) + 1) - len(reuse)
            tokens = len(seq.ids) - len(reuse) * self.bs
            if need > self.pool.free - len(reuse):
                break
            if prefill and decoding + prefill + tokens > budget:
                break
            self.waiting.popleft()
            self.pool.take(need, reuse)
            seq.blocks, seq.running = len(reuse) + need, True
            self.running.append(seq)
            prefill += tokens
            self.prefilled_tokens += tokens
            cached += len(reuse) * self.bs
        self.cached_tokens += cached
        if not self.running:
            return None
        return self.profile.step_time(prefill, decoding, cached)

    def _finish_step(self) -> None:
        self.steps += 1
        for seq in list(self.running):
            token = next_token(seq.ids)
            seq.ids.append(token)
            seq.out.put_nowait(token)
            if seq.generated >= seq.max_tokens:
                self.running.remove(seq)
                self._free(seq)
                seq.out.put_nowait(None)


class BadRequest(ValueError):
    """The client's request is invalid (HTTP 400, OpenAI error shape)."""


class PagedStandIn:
    """The OpenAI-compatible HTTP face of one `PagedEngine` (routes as `StandIn`'s)."""

    def __init__(
        self,
        profile: Profile = DEFAULT_PROFILE,
        *,
        model: str = "standin",
        stream_interval: int = 1,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 (got {stream_interval})")
        self.model = model
        self.stream_interval = stream_interval
        self.engine = PagedEngine(profile)
        self.served = 0
        self.seen_bodies: list[dict[str, Any]] = []
        self.detokenize_calls = 0
        self.detokenize_delay_s = 0.0  # tests: a busy server answers /detokenize late

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.engine.start()

    async def _stop(self, app: web.Application) -> None:
        await self.engine.stop()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            ids = self._prompt(body, "messages" in body)
        except BadRequest as exc:
            error = {"message": str(exc), "type": "BadRequestError", "code": 400}
            return web.json_response({"error": error}, status=400)
        limit = self.engine.max_model_len
        return web.json_response({"count": len(ids), "max_model_len": limit, "tokens": ids})

    async def _detokenize(self, request: web.Request) -> web.Response:
        tokens = (await request.json()).get("tokens") or []
        self.detokenize_calls += 1
        await asyncio.sleep(self.detokenize_delay_s)
        return web.json_response({"prompt": "".join(token_text(t) for t in tokens)})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "owned_by": "paged-standin",
            "max_model_len": self.engine.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        e = self.engine
        labels = f'engine="0",model_name="{self.model}"'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(len(e.running))}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(len(e.waiting))}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {e.usage()}",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} {float(e.preemptions)}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(e.prefilled_tokens)}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(e.cached_tokens)}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{e.bs}",enable_prefix_caching="True",'
            f'engine="0",num_cpu_blocks="None",num_gpu_blocks="{e.pool.total}"}} 1.0',
        ]
        return web.Response(text="\n".join(lines) + "\n")

    def _prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages: must be a non-empty list")
            text = "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages)
            return tokenize(text)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenize(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise BadRequest("prompt: must be a string or a non-empty list of token ids")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            chat = request.path.endswith("/chat/completions")
            prompt = self._prompt(body, chat)
            n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
            if not isinstance(n, int) or n < 1:
                raise BadRequest("max_tokens: must be a positive integer")
            if len(prompt) + n > self.engine.max_model_len:
                raise BadRequest(
                    f"prompt ({len(prompt)} tokens) + max_tokens ({n}) exceeds "
                    f"max_model_len {self.engine.max_model_len}"
                )
        except (BadRequest, ValueError) as exc:
            error = {"message": str(exc), "type": "BadRequestError", "code": 400}
            return web.json_response({"error": error}, status=400)
        self.seen_bodies.append(body)
        self.served += 1
        seq = Seq(prompt, n)
        reply = _Reply(self.model, f"{'chatcmpl' if chat else 'cmpl'}-paged-{self.served}", chat)
        reply.ids = bool(body.get("return_token_ids"))
        self.engine.submit(seq)
        try:
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, seq, reply, usage)
            while await seq.out.get() is not None:
                pass
            return web.json_response(reply.whole(seq))
        finally:
            self.engine.abort(seq)

    async def _stream(
        self, request: web.Request, seq: Seq, reply: _Reply, usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent, pending = 0, []
        while (token := await seq.out.get()) is not None:
            pending.append(token)
            last = sent + len(pending) == seq.max_tokens
            # vLLM's --stream-interval: the first token at once, then every n tokens.
            if sent and len(pending) < self.stream_interval and not last:
                continue
            await resp.write(_event(reply.chunk(seq, pending, first=not sent, last=last)))
            sent, pending = sent + len(pending), []
        if usage:
            await resp.write(_event(reply.usage_chunk(seq)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class _Reply:
    """The OpenAI wire shapes of one response, as vLLM 0.32 writes them."""

    def __init__(self, model: str, rid: str, chat: bool) -> None:
        self.model, self.rid, self.chat = model, rid, chat
        self.created = int(time.time())
        self.ids = False

    def chunk(self, seq: Seq, tokens: list[int], *, first: bool, last: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": "length" if last else None,
            "stop_reason": None,
        }
        out: dict[str, Any] = {"id": self.rid, "created": self.created, "model": self.model}
        prompt_ids = seq.ids[: seq.prompt_len] if self.ids and first else None
        if self.chat:
            out["object"] = "chat.completion.chunk"
            delta: dict[str, Any] = {"content": "".join(map(token_text, tokens))}
            if first:
                delta["role"] = "assistant"
                out["prompt_token_ids"] = prompt_ids
            choice["delta"] = delta
        else:
            out["object"] = "text_completion"
            choice["text"] = "".join(map(token_text, tokens))
            choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = tokens if self.ids else None
        out["choices"] = [choice]
        return out

    def usage_chunk(self, seq: Seq) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.rid,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": _usage(seq),
        }

    def whole(self, seq: Seq) -> dict[str, Any]:
        generated = seq.ids[seq.prompt_len :]
        text = "".join(token_text(t) for t in generated)
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": generated if self.ids else None,
        }
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(seq),
        }
        prompt_ids = seq.ids[: seq.prompt_len] if self.ids else None
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            out["prompt_token_ids"] = prompt_ids
        else:
            choice["text"] = text
            choice["prompt_token_ids"] = prompt_ids
        return out


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage(seq: Seq) -> dict[str, int]:
    return {
        "prompt_tokens": seq.prompt_len,
        "completion_tokens": seq.generated,
        "total_tokens": len(seq.ids),
    }


async def serve(
    count: int, profile: Profile, host: str, model: str, stream_interval: int = 1
) -> None:
    """Run `count` engines on this loop, each on its own free port, until cancelled."""
    runners = []
    ports = []
    for _ in range(count):
        app = PagedStandIn(profile, model=model, stream_interval=stream_interval).app()
        # A client that goes away aborts its request at once, as in vLLM.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        runners.append(runner)
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    print("ports:", *ports, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description="paged-KV stand-in engines (not vLLM)")
    parser.add_argument("--count", type=int, default=1, help="engines, one port each")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default="standin")
    parser.add_argument("--profile", help="a loadtest.sim profile JSON (default: built in)")
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per streamed chunk, as vLLM's"
    )
    args = parser.parse_args()
    import uvloop

    from loadtest.sim.profile import load

    profile = load(args.profile) if args.profile else DEFAULT_PROFILE
    try:
        uvloop.run(serve(args.count, profile, args.host, args.model, args.stream_interval))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
