"""The paged-KV stand-in engine (not vLLM): preemption by recompute, prefix
caching, token-exact continuation from a token-id prompt, and a lite move
through Ferry between two of them."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import openai

from adapters.vllm import parse_metrics

# Small and fast: 12 blocks of 4 tokens (47 tokens of context), 2 ms steps.
TINY = {"kv_blocks": 12, "block_size": 4, "step_base_s": 0.002, "step_per_seq_s": 0.0}


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def stream_ids(
    url: str, prompt: Any, max_tokens: int, sizes: list[int] | None = None
) -> tuple[list[int], list[int], str]:
    """(prompt ids the engine reported, generated ids, text) of one streamed
    completion; `sizes` collects the tokens of each chunk."""
    prompt_ids: list[int] = []
    ids: list[int] = []
    text = ""
    for chunk in api(url).completions.create(
        model="standin",
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        extra_body={"return_token_ids": True},
    ):
        choice = chunk.choices[0]
        extra = choice.model_extra or {}
        prompt_ids = prompt_ids or extra.get("prompt_token_ids") or []
        ids += extra["token_ids"]
        text += choice.text
        if sizes is not None:
            sizes.append(len(extra["token_ids"]))
    return prompt_ids, ids, text


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_preempts_when_blocks_run_out_and_every_stream_still_ends_exact(
    paged_standins: Any,
) -> None:
    # Slower steps, so that the three requests below surely run at once.
    [(_, site)] = paged_standins(1, **{**TINY, "step_base_s": 0.02})
    alone = stream_ids(site.url, [11, 12, 13, 14, 15, 16, 17, 18], 12)
    assert len(alone[1]) == 12 and alone[0] == [11, 12, 13, 14, 15, 16, 17, 18]
    # Three requests of up to 20 tokens = 5 blocks each: 15 blocks wanted, 12 exist.
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18], [21] * 8, [31] * 8]
    results: dict[int, Any] = {}
    together = threading.Barrier(3)

    def run(i: int) -> None:
        together.wait()
        results[i] = stream_ids(site.url, prompts[i], 12)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    snap = parse_metrics(scrape(site.url))
    assert snap.preemptions_total > 0
    assert (snap.block_size, snap.kv_blocks_total, snap.running, snap.waiting) == (4, 12, 0, 0)
    assert results[0] == alone  # recomputed after its preemption, token for token
    assert all(len(results[i][1]) == 12 for i in range(3))


def test_a_token_id_prompt_continues_exactly_and_reuses_cached_blocks(
    paged_standins: Any,
) -> None:
    [(standin, site)] = paged_standins(1, **TINY)
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    _, generated, text = stream_ids(site.url, prompt, 14)
    # Ferry's lite move: the prompt + the first 6 generated ids, 8 tokens to go.
    shown, rest, rest_text = stream_ids(site.url, prompt + generated[:6], 8)
    assert shown == prompt + generated[:6]
    assert rest == generated[6:]
    assert text.endswith(rest_text) and rest_text
    # The first request's blocks were still cached: only the tail was prefilled.
    assert standin.engine.cached_tokens >= 12
    detokenized = urllib.request.Request(
        site.url + "/detokenize",
        data=json.dumps({"model": "standin", "tokens": generated[:6]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(detokenized, timeout=5) as resp:
        assert text == json.load(resp)["prompt"] + rest_text
    # Chat takes the same engine; a prompt the engine cannot hold is a 400, not a hang.
    chat = api(site.url).chat.completions.create(
        model="standin", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens == 3
    try:
        api(site.url).completions.create(model="standin", prompt=[1] * 40, max_tokens=10)
    except openai.BadRequestError as exc:
        assert "max_model_len" in str(exc)
    else:
        raise AssertionError("an oversized request was accepted")


def test_ferry_moves_a_stream_between_paged_engines_token_exactly(
    paged_standins: Any, ferry: Any
) -> None:
    slow = {"step_base_s": 0.02, "kv_blocks": 64, "block_size": 4}
    # Two tokens per chunk after the first, as vLLM's --stream-interval 2 sends them.
    (source, a), (dest, b) = paged_standins(2, stream_interval=2, **slow)
    prompt = list(range(100, 120))
    sizes: list[int] = []
    _, unmoved, _ = stream_ids(a.url, prompt, 40, sizes)
    assert sizes[:3] == [1, 2, 2] and sum(sizes) == 40
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin"},
    )
    got: list[Any] = []
    client = threading.Thread(target=lambda: got.append(stream_ids(proxy.url, prompt, 40)))
    client.start()
    deadline = time.monotonic() + 10
    while not source.engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # some tokens streamed from the source
    request = urllib.request.Request(
        proxy.url + "/admin/instances/i0/drain?migrate=true",
        data=b"",
        method="POST",
        headers={"Authorization": "Bearer t"},
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert json.load(resp)["migrating"] == 1
    client.join(20)
    [(_, ids, _)] = got
    assert ids == unmoved
    # The destination was pre-warmed, then continued from prompt + generated ids.
    # (Whether the pre-warm's blocks were cached by then is timing: a pre-warm
    # is given up when the stream stalls, as it may on a busy machine.)
    prewarm, continuation = dest.seen_bodies[-2:]
    assert prewarm["max_tokens"] == 1 and prewarm["prompt"][: len(prompt)] == prompt
    assert continuation["prompt"][: len(prompt)] == prompt and len(continuation["prompt"]) > 20


def test_a_move_whose_destination_is_removed_midway_goes_to_another(
    paged_standins: Any, ferry: Any
) -> None:
    """The destination is removed while the move asks it where to join (its
    `/detokenize`, taken when the engine merged so many tokens per chunk that no
    flush is near the cut): the move goes on to the other one, token-exactly."""
    slow = {"step_base_s": 0.02, "kv_blocks": 64, "block_size": 4}
    engines = paged_standins(3, stream_interval=40, **slow)
    (_, a), dests = engines[0], engines[1:]
    prompt = list(range(100, 120))
    _, unmoved, _ = stream_ids(a.url, prompt, 120)
    for dest, _ in dests:
        dest.detokenize_delay_s = 1.0
    proxy = ferry(
        [site.url for _, site in engines],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin", "migration_prewarm": False},
    )
    ids: list[int] = []
    chunks = api(proxy.url).completions.create(
        model="standin",
        prompt=prompt,
        max_tokens=120,
        stream=True,
        temperature=0,  # greedy: the join may step back (sampled, it moves only in step)
        extra_body={"return_token_ids": True},
    )
    for n, chunk in enumerate(chunks):
        ids += (chunk.choices[0].model_extra or {})["token_ids"]
        if n == 1:  # 41 tokens out, the next 40 a chunk away: the join needs /detokenize
            admin(proxy.url, "/admin/instances/i0/drain?migrate=true")
            wait_for(lambda: any(dest.detokenize_calls for dest, _ in dests))
            gone = next(n for n, (dest, _) in enumerate(dests, 1) if dest.detokenize_calls)
            remove = urllib.request.Request(
                f"{proxy.url}/admin/instances/i{gone}",
                method="DELETE",
                headers={"Authorization": "Bearer t"},
            )
            with urllib.request.urlopen(remove, timeout=5) as resp:
                assert resp.status == 202
    assert ids == unmoved
    assert f"i{gone}" not in proxy.loop.call(lambda: set(proxy.cluster.instances))
    kept = dests[2 - gone][0]  # the other destination
    assert kept.seen_bodies[-1]["prompt"][: len(prompt)] == prompt
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 1.0' in scrape(proxy.url)


def test_a_drain_moves_a_stream_only_once_another_engine_has_room_for_it(
    paged_standins: Any, ferry: Any
) -> None:
    # 40 blocks of 4 tokens each. While i1 runs the filler (80 + 40 tokens), it has
    # too little room for the stream on i0 (80 + 70): the drain of i0 leaves that
    # stream decoding there, and moves it once the filler is done.
    # Steps of 50 ms: the filler runs 2 s, long enough to be seen still running.
    engine = {"kv_blocks": 40, "block_size": 4, "step_base_s": 0.05, "step_per_seq_s": 0.0}
    (source, a), (dest, b) = paged_standins(2, **engine)
    prompt, filler_prompt = [7] * 80, [9] * 80
    unmoved = stream_ids(a.url, prompt, 70)[1]
    proxy = ferry(  # no pre-warm: it too would wait for room on i1
        [a.url, b.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={"migration_prewarm": False},
    )
    admin(proxy.url, "/admin/instances/i1/drain")  # the stream starts on i0
    got: list[list[int]] = []
    moved = threading.Thread(target=lambda: got.append(stream_ids(proxy.url, prompt, 70)[1]))
    moved.start()
    wait_for(lambda: source.engine.running)
    admin(proxy.url, "/admin/instances/i1/undrain")
    filler = threading.Thread(target=lambda: stream_ids(proxy.url, filler_prompt, 40))
    filler.start()
    wait_for(lambda: dest.engine.running)
    time.sleep(0.1)  # a few tokens in: i1 holds 21+ blocks, the stream 23+
    admin(proxy.url, "/admin/instances/i0/drain?migrate=true")
    time.sleep(0.3)
    assert (proxy.view("i0").inflight, proxy.view("i1").inflight) == (1, 1)
    filler.join(20)
    wait_for(lambda: proxy.view("i0").inflight == 0)  # room on i1 now: it moved
    moved.join(20)
    assert got == [unmoved]
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 1.0' in scrape(proxy.url)


def wait_for(done: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_ferry_rescues_a_stream_its_engine_preempted(paged_standins: Any, ferry: Any) -> None:
    # 16 blocks of 4 tokens; three 8 + 24 token streams want 24 blocks on one engine,
    # so it preempts the newest. Ferry sees that engine queue a request the ledger
    # has streamed tokens of, and that stream go silent: it moves it to the idle
    # engine at once, where it goes on token-exactly. Plain load-shedding is off
    # (source_below far below any freeness): only the rescue can move it.
    engine = {**TINY, "kv_blocks": 16, "step_base_s": 0.03}
    (source, a), (dest, b) = paged_standins(2, **engine)
    prompts = [[11 + i] * 8 for i in range(3)]
    alone = [stream_ids(b.url, p, 24)[1] for p in prompts]  # the unmoved runs
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={
            "rebalance_interval_s": 0.05,
            "migration_source_below": -1000,
            "migration_stalled_after_s": 0.2,
            "migration_prewarm": False,
        },
    )
    admin(proxy.url, "/admin/instances/i1/drain")  # every stream starts on i0
    bodies_before = len(dest.seen_bodies)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = stream_ids(proxy.url, prompts[i], 24)[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not source.engine.preemptions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.engine.preemptions, "the engine never preempted"
    admin(proxy.url, "/admin/instances/i1/undrain")
    for t in threads:
        t.join(20)
    assert [results[i] for i in range(3)] == alone
    moved = [body for body in dest.seen_bodies[bodies_before:] if len(body["prompt"]) > 8]
    assert len(moved) == 1  # one continuation: the preempted stream's prompt + its tokens
    assert 'outcome="ok"' in scrape(proxy.url).split("ferry_migrations_total{", 1)[1]


def admin(url: str, path: str) -> None:
    request = urllib.request.Request(
        url + path, data=b"", method="POST", headers={"Authorization": "Bearer t"}
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 200
