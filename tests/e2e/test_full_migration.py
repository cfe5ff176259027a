"""Full-mode migration on real vLLM CPU servers running migration_shim.

The servers of `vllm_pair` (and `doomed`) run with the shim on. A moved stream
must be token-exact, the destination must load the KV instead of computing it,
and every failure (destination killed, destination full, the request ending or
the client leaving during the copy) must lose no request and leak no block.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from loadtest.vllm_servers import VLLMServer, metric
from migration_shim import wire
from proxy.server import RELAY
from tests.e2e.test_migration import AUTH, PROMPT, TOKEN, api, once_at, post, stream_ids
from tests.helpers import call_json, wait_until

SOURCE = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="%s"}'
BLOCK = 128
KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2 * 4  # layers, KV heads, head dim, K and V, float32


def by_source(server: VLLMServer) -> dict[str, float]:
    kinds = ("local_compute", "local_cache_hit", "external_kv_transfer")
    return {k: metric(server.url, SOURCE % k) for k in kinds}


def shim_info(server: VLLMServer) -> dict[str, Any]:
    with urllib.request.urlopen(server.url + wire.INFO, timeout=5) as resp:
        info: dict[str, Any] = json.load(resp)
    return info


def assert_idle(*servers: VLLMServer) -> None:
    """No leaked blocks: nothing reserved, nothing held, KV usage back to 0."""

    def idle() -> bool:
        for server in servers:
            info = shim_info(server)
            usage = metric(server.url, 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}')
            if info["reserved_blocks"] or info["migrations_out"] or usage != 0.0:
                return False
            if info["free_blocks"] != info["num_blocks"] - 1:  # vLLM keeps one null block
                return False
        return True

    wait_until(idle, timeout=30, poll=0.2)


def shim_post(server: VLLMServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return call_json(server.url + path, "POST", body)


@pytest.fixture
def full(ferry: Any) -> Callable[..., Any]:
    def make(servers: list[VLLMServer], **scheduler: Any) -> Any:
        proxy = ferry(
            [s.url for s in servers],
            instances_migration="full",
            scheduler={"migration_prewarm": False, **scheduler},
            admin_token=TOKEN,
        )
        for name in ("i0", "i1"):
            assert proxy.cluster.instances[name].migration_mode == "full"
        return proxy

    return make


def drain_source(proxy: Any) -> Callable[[], None]:
    def drain() -> None:
        source = next(name for name in ("i0", "i1") if proxy.view(name).inflight)
        post(f"{proxy.url}/admin/instances/{source}/drain?migrate=true")

    return drain


def on_i0_then(proxy: Any, tokens: int, action: Callable[[], None]) -> Callable[[int], None]:
    """Start the stream on i0 (i1 drained until its first token), then run
    `action` once `tokens` have streamed."""
    post(f"{proxy.url}/admin/instances/i1/drain")
    first = once_at(1, lambda: post(f"{proxy.url}/admin/instances/i1/undrain"))
    later = once_at(tokens, action)

    def on_chunk(n: int) -> None:
        first(n)
        later(n)

    return on_chunk


def undrain(proxy: Any) -> None:
    for name in ("i0", "i1"):
        post(f"{proxy.url}/admin/instances/{name}/undrain")


def kv_outcome(proxy: Any, outcome: str, reason: str = "drain") -> float:
    return metric(proxy.url, f'ferry_kv_migrations_total{{outcome="{outcome}",reason="{reason}"}}')


@pytest.mark.parametrize(
    ("chat", "max_tokens", "cut"),
    [(False, 300, 100), (False, 800, 520), (True, 300, 150)],
    ids=["short", "long", "chat"],
)
def test_full_move_is_token_exact_and_loads_the_kv(
    full: Any, vllm_pair: list[VLLMServer], chat: bool, max_tokens: int, cut: int
) -> None:
    a, b = vllm_pair
    proxy = full(vllm_pair)
    # A prompt b has never seen: nothing of it can come from b's prefix cache.
    prompt = f"{PROMPT} {uuid.uuid4().hex}"
    reference, ref_text, _ = stream_ids(api(a.url), chat, max_tokens, lambda n: None, prompt)
    before = by_source(b)
    ids, text, last = stream_ids(
        api(proxy.url), chat, max_tokens, on_i0_then(proxy, cut, drain_source(proxy)), prompt
    )
    undrain(proxy)
    assert ids == reference and text == ref_text
    assert last.choices[0].finish_reason == "length"
    assert kv_outcome(proxy, "ok") == 1
    assert metric(proxy.url, "ferry_kv_migrated_blocks_total") >= 1
    # b got P + G as its prompt and computed only the last token: the KV of all
    # the others was moved, not recomputed.
    # The join may sit a little before the cut: it steps back to where vLLM had
    # flushed whole characters (this random model emits runs of lone bytes that
    # vLLM holds back), and the destination regenerates the tokens after it.
    gained = {k: v - before[k] for k, v in by_source(b).items()}
    assert gained["local_compute"] == 1
    assert gained["local_cache_hit"] == 0
    assert gained["external_kv_transfer"] > 0
    assert_idle(*vllm_pair)


def test_precopy_runs_in_several_stages(full: Any, vllm_pair: list[VLLMServer]) -> None:
    # A slow channel: new blocks fill while a stage is on the wire. Moved at 300
    # of 980 tokens, the first stage sends two full blocks; the channel is paced
    # so that the second takes as long as decoding `factor` blocks' worth of
    # tokens at the speed measured on the reference run. Decode speed on this
    # shared 2-core machine varies 60-250 tokens/s and drops during a copy, so a
    # pace that lets no block fill is tried again slower (a second stage is what
    # is tested, not one speed).
    started = time.monotonic()
    reference, _, _ = stream_ids(api(vllm_pair[0].url), False, 980, on_chunk=lambda n: None)
    tokens_per_s = 980 / (time.monotonic() - started)
    stages = 0.0
    for factor in (1.0, 2.0, 3.0):
        proxy = full(
            vllm_pair,
            migration_bandwidth_mb_s=KV_BYTES_PER_TOKEN * tokens_per_s / factor / 1e6,
            migration_full_last_stage_blocks=0,
            migration_full_max_stages=2,
        )
        ids, _, _ = stream_ids(
            api(proxy.url), False, 980, on_chunk=once_at(300, drain_source(proxy))
        )
        undrain(proxy)
        assert ids == reference
        assert_idle(*vllm_pair)
        stages = metric(proxy.url, "ferry_kv_precopy_stages_total")
        if kv_outcome(proxy, "ok") == 1 and stages >= 2:
            break
    assert stages >= 2


def test_destination_killed_mid_copy_rolls_back(
    full: Any, vllm_pair: list[VLLMServer], doomed: VLLMServer
) -> None:
    # A block of this model's KV is 256 KiB (128 tokens of 2 KiB): at 0.5 MB/s
    # the copy of 3 blocks takes about 1.5 s, so it meets the destination killed
    # once reserved, well before the source decodes the 700 tokens left. (At
    # 0.1 MB/s, on a quiet machine the request finished at the source first.)
    proxy = full([vllm_pair[0], doomed], migration_bandwidth_mb_s=0.5)
    # Long after the cut, so the copy meets the dead destination before the
    # request ends at the source (on a quiet machine 400 tokens were too few).
    reference, _, _ = stream_ids(api(vllm_pair[0].url), False, 1000, on_chunk=lambda n: None)

    def kill_once_reserved() -> None:
        # Killed once it holds the reservation, so the copy meets a dead
        # destination (killed before its RESERVE answers, the move is refused
        # as destination_full instead: no copy to roll back).
        wait_until(lambda: shim_info(doomed)["reserved_blocks"] > 0, timeout=30, poll=0.01)
        doomed.kill()

    def drain_then_kill() -> None:
        post(f"{proxy.url}/admin/instances/i0/drain?migrate=true")
        threading.Thread(target=kill_once_reserved).start()

    ids, _, last = stream_ids(
        api(proxy.url), False, 1000, on_chunk=on_i0_then(proxy, 300, drain_then_kill)
    )
    assert ids == reference and last.choices[0].finish_reason == "length"
    wait_until(lambda: kv_outcome(proxy, "rolled_back") == 1, timeout=30)
    post(f"{proxy.url}/admin/instances/i0/undrain")
    assert_idle(vllm_pair[0])


def test_a_frozen_source_fails_over_without_being_asked_for_its_kv(
    full: Any, vllm_pair: list[VLLMServer]
) -> None:
    """A full-mode stream whose server freezes (SIGSTOP) fails over by
    recompute once the freeze shows, as a lite one does. It used to ask the
    frozen server for its KV first and wait out that call (20 s) with its
    client given nothing."""
    frozen = vllm_pair[0]
    proxy = full(vllm_pair, scrape_interval_s=0.1, scrape_timeout_s=0.5, unhealthy_after_failures=2)
    reference, _, _ = stream_ids(api(frozen.url), False, 600, on_chunk=lambda n: None)
    arrived: list[float] = []
    freeze_at_300 = on_i0_then(proxy, 300, frozen.freeze)

    def on_chunk(n: int) -> None:
        arrived.append(time.monotonic())
        freeze_at_300(n)

    try:
        ids, _, last = stream_ids(api(proxy.url), False, 600, on_chunk=on_chunk)
    finally:
        frozen.thaw()
    assert ids == reference and last.choices[0].finish_reason == "length"
    longest = max(b - a for a, b in zip(arrived, arrived[1:], strict=False))
    assert longest < 10, longest
    assert metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="failover"}') == 1
    outcomes = ("ok", "abandoned", "rolled_back", "destination_full")
    assert [kv_outcome(proxy, o, "failover") for o in outcomes] == [0, 0, 0, 0]
    wait_until(lambda: proxy.view("i0").healthy, timeout=30)  # thawed, as the next tests need it
    assert_idle(*vllm_pair)


def test_a_destination_drained_during_the_copy_still_takes_the_kv(
    full: Any, vllm_pair: list[VLLMServer]
) -> None:
    """The copy's destination began a drain while the KV travelled: its
    cut-over refused it as a new destination, and the stream went on by
    recompute, the copy thrown away. A move half done goes where its KV waits."""
    a, b = vllm_pair
    proxy = full(vllm_pair, migration_bandwidth_mb_s=2.0)  # (a copy of some 0.4 s)
    reference, _, _ = stream_ids(api(a.url), False, 1000, on_chunk=lambda n: None)

    drained: list[object] = []  # True once the destination's drain began, or what failed

    def drain_the_destination_once_reserved() -> None:
        # What fails here is this test's to report, not a stray thread
        # exception raised in whichever test runs later.
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not shim_info(b)["reserved_blocks"]:
                time.sleep(0.01)
            post(f"{proxy.url}/admin/instances/i1/drain")
            drained.append(True)
        except Exception as exc:  # noqa: BLE001
            drained.append(exc)

    drainer = threading.Thread(target=drain_the_destination_once_reserved)

    def drain_both() -> None:
        post(f"{proxy.url}/admin/instances/i0/drain?migrate=true")
        drainer.start()

    before = by_source(b)
    ids, _, last = stream_ids(
        api(proxy.url), False, 1000, on_chunk=on_i0_then(proxy, 300, drain_both)
    )
    drainer.join(60)
    undrain(proxy)
    assert drained == [True], drained
    assert ids == reference and last.choices[0].finish_reason == "length"
    assert kv_outcome(proxy, "ok") == 1
    assert metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="failover"}') == 0
    assert by_source(b)["external_kv_transfer"] > before["external_kv_transfer"]
    assert_idle(*vllm_pair)


def test_a_destination_frozen_as_the_stream_is_handed_over_gives_it_back_to_its_source(
    full: Any, vllm_pair: list[VLLMServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full mode stops the request at its source before the destination takes
    it on. The one destination freezing just then (SIGSTOP as the continuation
    is sent) lost the stream: the failover left out the source, where it had
    not broken, and tried the frozen destination again. It goes back to its
    source (draining, but healthy) by recompute."""
    a, b = vllm_pair
    proxy = full(vllm_pair, scrape_interval_s=0.1, scrape_timeout_s=0.5, unhealthy_after_failures=2)
    reference, _, _ = stream_ids(api(a.url), False, 600, on_chunk=lambda n: None)
    upstreams = proxy.site.app[RELAY].upstreams
    send = upstreams.send
    froze: list[str] = []

    async def freeze_then_send(call: Any, method: str, path: str, *args: Any, **kw: Any) -> Any:
        body = args[0] if args else kw.get("body") or b""
        if call.instance == "i1" and wire.LOAD.encode() in body and not froze:
            b.freeze()  # the copy is done, the source stopped: the hand-over
            froze.append(path)
        return await send(call, method, path, *args, **kw)

    monkeypatch.setattr(upstreams, "send", freeze_then_send)
    try:
        ids, _, last = stream_ids(
            api(proxy.url), False, 600, on_chunk=on_i0_then(proxy, 300, drain_source(proxy))
        )
    finally:
        b.thaw()
    assert froze == ["/v1/completions"]
    assert ids == reference and last.choices[0].finish_reason == "length"
    assert kv_outcome(proxy, "ok") == 1  # the copy itself went through
    assert metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="failover"}') == 1
    wait_until(lambda: proxy.view("i1").healthy, timeout=30)  # thawed, as the next tests need it
    undrain(proxy)
    assert_idle(*vllm_pair)


def test_destination_out_of_blocks_refuses_and_the_request_stays(
    full: Any, vllm_pair: list[VLLMServer]
) -> None:
    a, b = vllm_pair
    proxy = full([a, b])
    # Take every free block of b, as a burst of other work would.
    free = shim_info(b)["free_blocks"]
    status, answer = shim_post(b, wire.RESERVE, {"mig_id": "hog", "num_blocks": free + 1})
    assert status == 409 and "error" in answer  # the OpenAI error shape
    status, _ = shim_post(b, wire.RESERVE, {"mig_id": "hog", "num_blocks": free, "lease_s": 120})
    assert status == 200
    try:
        reference, _, _ = stream_ids(api(a.url), False, 400, on_chunk=lambda n: None)
        ids, _, _ = stream_ids(
            api(proxy.url), False, 400, on_chunk=on_i0_then(proxy, 150, drain_source(proxy))
        )
        assert ids == reference
        assert kv_outcome(proxy, "destination_full") == 1
    finally:
        shim_post(b, wire.RELEASE, {"mig_id": "hog"})
        undrain(proxy)
    assert_idle(a, b)


def test_request_finishing_during_the_copy(full: Any, vllm_pair: list[VLLMServer]) -> None:
    # At 0.05 MB/s one block takes 5 s; the request has 0.4 s of decoding left.
    proxy = full(vllm_pair, migration_bandwidth_mb_s=0.05)
    reference, _, _ = stream_ids(api(proxy.url), False, 330, on_chunk=lambda n: None)
    ids, _, last = stream_ids(
        api(proxy.url), False, 330, on_chunk=once_at(270, drain_source(proxy))
    )
    assert ids == reference and last.choices[0].finish_reason == "length"
    wait_until(lambda: kv_outcome(proxy, "source_finished") == 1, timeout=30)
    undrain(proxy)
    assert_idle(*vllm_pair)


def test_client_disconnect_during_the_copy(full: Any, vllm_pair: list[VLLMServer]) -> None:
    proxy = full(vllm_pair, migration_bandwidth_mb_s=0.05)
    client = api(proxy.url)
    stream = client.completions.create(
        model="tiny",
        prompt="The client will leave before this migration ends",
        max_tokens=800,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for _ in stream:
        seen += 1
        if seen == 300:
            drain_source(proxy)()
        if seen == 320:
            break
    time.sleep(0.3)  # the copy is under way (one block takes 5 s at this rate)
    stream.close()
    wait_until(lambda: kv_outcome(proxy, "source_finished") == 1, timeout=30)
    undrain(proxy)
    assert_idle(*vllm_pair)


def test_status_names_the_mode_in_effect(full: Any, vllm_pair: list[VLLMServer]) -> None:
    proxy = full(vllm_pair)
    request = urllib.request.Request(proxy.url + "/admin/instances", headers=AUTH)
    with urllib.request.urlopen(request, timeout=5) as resp:
        rows = json.load(resp)
    assert {r["migration"] for r in rows} == {"full"}
    assert all(r["shim"]["block_size"] == BLOCK for r in rows)


def test_drain_empties_a_full_mode_instance_of_ten_streams_promptly(
    full: Any, vllm_pair: list[VLLMServer]
) -> None:
    """Ten streams, most of them still inside their first 128-token block: the
    drain moves every one off (KV copied, or recomputed where the copy cannot
    happen) within the bound, and each stream is token-exact."""
    proxy = full(vllm_pair)
    reference, _, _ = stream_ids(api(vllm_pair[0].url), False, 300, on_chunk=lambda n: None)
    results: list[list[int]] = []
    started = threading.Barrier(11)

    def one() -> None:
        ids, _, _ = stream_ids(api(proxy.url), False, 300, on_chunk=once_at(5, started.wait))
        results.append(ids)

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    busiest = max(("i0", "i1"), key=lambda n: proxy.view(n).inflight)
    moving = proxy.view(busiest).inflight
    began = time.monotonic()
    post(f"{proxy.url}/admin/instances/{busiest}/drain?migrate=true")
    wait_until(lambda: proxy.view(busiest).inflight == 0, timeout=60, poll=0.01)
    emptied = time.monotonic() - began
    for t in threads:
        t.join(300)
    undrain(proxy)
    print(f"drain of {moving} full-mode streams: empty after {emptied * 1000:.0f} ms")
    assert len(results) == 10 and all(r == reference for r in results)
    assert kv_outcome(proxy, "ok") >= 1
    # A handful of engine steps plus the copy, per move, 2 at a time (about 1 s
    # here); streams left to finish in place would take their 300 tokens' ~10 s.
    assert emptied < 6.0
    assert_idle(*vllm_pair)
