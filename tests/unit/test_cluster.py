"""The cluster view: the ledger credits dispatches between scrapes."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters import EngineSnapshot
from proxy.cluster import Cluster
from proxy.config import InstanceConfig
from proxy.policy import DispatchRequest, Priority, UsageSettings, dispatch, make_policy


def snapshot(running: int = 0, waiting: int = 0, kv_usage: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(
        running, waiting, kv_usage, kv_blocks_total=100, block_size=16, preemptions_total=0
    )


def make_cluster(*names: str, headroom: float | None = 0.0) -> Cluster:
    cluster = Cluster(
        tuple(InstanceConfig(n, f"http://{n}") for n in names),
        UsageSettings(high_priority_headroom_blocks=headroom),
        unhealthy_after_failures=3,
    )
    for n in names:
        cluster.record_models(n, [{"id": "m"}])
        cluster.record_scrape(n, snapshot(), now=0.0)
    return cluster


def placed(cluster: Cluster, n: int, prompt_tokens: int) -> list[str]:
    """Where `llumnix` places n requests in a row, each billed as it goes."""
    policy, rng = make_policy("llumnix"), random.Random(0)
    names = []
    for _ in range(n):
        request = DispatchRequest("m", prompt_tokens=prompt_tokens)
        chosen = dispatch(policy, request, cluster.view(), rng)
        cluster.ledger.add(chosen.name, "m", Priority.NORMAL, prompt_tokens, now=0.0)
        names.append(chosen.name)
    return names


def test_a_burst_between_scrapes_spreads_evenly() -> None:
    cluster = make_cluster("a", "b", "c", "d")
    spread = placed(cluster, 12, 64)  # no scrape in between: only the ledger knows
    assert sorted(spread.count(n) for n in "abcd") == [3, 3, 3, 3]


def test_engine_load_that_bypassed_the_proxy_counts() -> None:
    cluster = make_cluster("a", "b")
    cluster.record_scrape("a", snapshot(running=4, kv_usage=0.6), now=1.0)
    view = cluster.instance_view("a")
    assert view.virtual_blocks == 60 and view.batch == 4
    assert view.freeness == (100 - 60) / 4
    chosen = dispatch(
        make_policy("llumnix"), DispatchRequest("m"), cluster.view(), random.Random(0)
    )
    assert chosen.name == "b"


def test_ledger_tokens_move_freeness_at_block_boundaries() -> None:
    cluster = make_cluster("a")
    entry = cluster.ledger.add("a", "m", Priority.NORMAL, 10, now=0.0)
    assert cluster.instance_view("a").virtual_blocks == 1
    cluster.ledger.set_prompt_tokens(entry, 16)
    cluster.ledger.add_generated(entry, 1)  # 17 tokens -> 2 blocks
    assert cluster.instance_view("a").virtual_blocks == 2
    cluster.ledger.release(entry)
    assert cluster.instance_view("a").inflight == 0


def test_queued_tokens_count_prompts_until_their_first_token() -> None:
    cluster = make_cluster("a")
    first = cluster.ledger.add("a", "m", Priority.NORMAL, 10, now=0.0)
    second = cluster.ledger.add("a", "m", Priority.NORMAL, 30, now=0.0)
    assert cluster.instance_view("a").queued_tokens == 40
    cluster.ledger.set_prompt_tokens(first, 12)  # the engine's exact count
    assert cluster.instance_view("a").queued_tokens == 42
    cluster.ledger.add_generated(first, 1)  # prefilled: no longer ahead of the engine
    cluster.ledger.add_generated(first, 1)
    assert cluster.instance_view("a").queued_tokens == 30
    cluster.ledger.release(first)
    cluster.ledger.release(second)  # gave up before its first token
    assert cluster.instance_view("a").queued_tokens == 0


def test_an_unwatched_answer_counts_as_queued_until_the_engine_s_queue_says_it_started() -> None:
    cluster = make_cluster("a")
    ledger = cluster.ledger
    whole = [ledger.add("a", "m", Priority.NORMAL, 100, now=0.0, watched=False) for _ in range(3)]
    stream = ledger.add("a", "m", Priority.NORMAL, 10, now=0.0)  # watched: its token says
    reached_id = ledger.last_id()
    late = ledger.add("a", "m", Priority.NORMAL, 1000, now=0.0, watched=False)
    assert cluster.instance_view("a").queued_tokens == 3 * 100 + 10 + 1000
    # Two of the four sent before the look still wait: the newest two, first
    # come first served, so the oldest two answers have started.
    cluster.record_scrape("a", snapshot(running=2, waiting=2), now=1.0, reached_id=reached_id)
    assert cluster.instance_view("a").queued_tokens == 100 + 10 + 1000
    assert ledger.waiting("a") == 3
    assert (whole[0].started, whole[1].started, whole[2].started) == (True, True, False)
    # An empty queue: all sent before the look have started but the watched
    # stream, which has not shown its first token; the one sent after the look
    # might not have reached the engine.
    cluster.record_scrape("a", snapshot(running=4, waiting=0), now=1.25, reached_id=reached_id)
    assert cluster.instance_view("a").queued_tokens == 10 + 1000
    assert not stream.started and not late.started
    ledger.add_generated(whole[0], 5)  # its answer came whole: no second start
    assert cluster.instance_view("a").queued_tokens == 10 + 1000
    for entry in [*whole, stream, late]:
        ledger.release(entry)
    assert cluster.instance_view("a").queued_tokens == 0 and ledger.waiting("a") == 0


def test_out_of_order_engines_settle_only_an_empty_queue() -> None:
    """Several engine cores (data parallel) or priority scheduling: an old
    request may wait while newer ones run, so only an empty queue says it started."""
    cluster = make_cluster("a")
    ledger = cluster.ledger
    old = ledger.add("a", "m", Priority.NORMAL, 100, now=0.0, watched=False)
    ledger.add("a", "m", Priority.NORMAL, 100, now=0.0, watched=False)
    two_engines = dataclasses.replace(snapshot(running=1, waiting=1), engines=2)
    cluster.record_scrape("a", two_engines, now=1.0, reached_id=ledger.last_id())
    assert not old.started
    ledger.settle_unwatched("a", 1, ledger.last_id(), in_order=False)
    assert not old.started
    ledger.settle_unwatched("a", 0, ledger.last_id(), in_order=False)
    assert ledger.waiting("a") == 0 and cluster.instance_view("a").queued_tokens == 0


def test_a_call_with_nothing_to_prefill_takes_no_place_in_the_engine_s_queue() -> None:
    """A pass-through call with no prompt (`GET /version`) never reaches the
    engine's queue: it must not stand in for an older request still there."""
    cluster = make_cluster("a")
    ledger = cluster.ledger
    old = ledger.add("a", "m", Priority.NORMAL, 100, now=0.0, watched=False)
    ledger.add("a", "", Priority.NORMAL, 0, now=0.0, watched=False)
    cluster.record_scrape("a", snapshot(waiting=1), now=1.0, reached_id=ledger.last_id())
    assert not old.started and cluster.instance_view("a").queued_tokens == 100


def test_a_look_from_before_a_dispatch_settles_nothing() -> None:
    cluster = make_cluster("a")
    reached_id = cluster.ledger.last_id()
    whole = cluster.ledger.add("a", "m", Priority.NORMAL, 100, now=0.0, watched=False)
    cluster.record_scrape("a", snapshot(waiting=0), now=1.0, reached_id=reached_id)
    assert not whole.started and cluster.instance_view("a").queued_tokens == 100


def test_what_was_cached_at_dispatch_is_neither_demand_nor_prefill() -> None:
    cluster = make_cluster("a")
    entry = cluster.ledger.add("a", "m", Priority.NORMAL, 100, now=0.0, cached_tokens=64)
    assert cluster.instance_view("a").queued_tokens == 36  # only the tail is prefilled
    assert cluster.instance_view("a").virtual_blocks == 7 - 4  # 4 of its 7 blocks are shared
    cluster.ledger.set_prompt_tokens(entry, 60)  # fewer than the guess: nothing ahead
    assert cluster.instance_view("a").queued_tokens == 0
    cluster.ledger.set_prompt_tokens(entry, 70)
    assert cluster.instance_view("a").queued_tokens == 6
    cluster.ledger.release(entry)
    assert cluster.instance_view("a").queued_tokens == 0


def test_preempted_requests_are_the_engine_s_queue_beyond_the_ledger_s_waiting() -> None:
    cluster = make_cluster("a")
    ledger = cluster.ledger
    started = ledger.add("a", "m", Priority.NORMAL, 10, now=0.0)
    ledger.add_generated(started, 1)
    queued = ledger.add("a", "m", Priority.NORMAL, 10, now=0.0)
    ledger.add("a", "m", Priority.NORMAL, 10, now=0.0)  # not movable, queued too: counted
    assert ledger.waiting("a") == 2
    # The engine queues the 2 the ledger has waiting and one more: preempted.
    cluster.record_scrape("a", snapshot(running=0, waiting=3), now=1.0)
    assert cluster.instance_view("a").engine_preempted == 1
    cluster.record_scrape("a", snapshot(running=1, waiting=2), now=1.25)
    assert cluster.instance_view("a").engine_preempted == 0
    ledger.add_generated(queued, 1)
    ledger.release(queued)
    ledger.release(started)
    assert ledger.waiting("a") == 1  # released after its first token: counted once


def test_high_priority_reserves_headroom() -> None:
    cluster = make_cluster("a", "b", headroom=20)
    cluster.ledger.add("a", "m", Priority.HIGH, 16, now=0.0)
    cluster.ledger.add("b", "m", Priority.NORMAL, 16, now=0.0)
    assert cluster.instance_view("a").virtual_blocks == 21
    chosen = dispatch(
        make_policy("llumnix"), DispatchRequest("m"), cluster.view(), random.Random(0)
    )
    assert chosen.name == "b"


@pytest.mark.parametrize(("headroom", "normal_goes_to"), [(None, "b"), (0.0, "a")])
def test_by_default_high_priority_reserves_a_tenth_of_the_capacity(
    headroom: float | None, normal_goes_to: str
) -> None:
    cluster = make_cluster("a", "b", headroom=headroom)  # None: the default
    cluster.ledger.add("a", "m", Priority.HIGH, 16, now=0.0)  # 1 block of 100
    cluster.ledger.add("b", "m", Priority.NORMAL, 16 * 5, now=0.0)  # 5 blocks: freeness 95
    view = cluster.instance_view("a")
    reserved = 10 if headroom is None else 0  # 10% of 100 blocks
    assert view.virtual_blocks == 1 + reserved and view.freeness == 99 - reserved
    assert view.freeness_high == 99  # its own class sees the headroom as free
    # Normal work keeps off the instance running high-priority work (89 < 95),
    # which it would take without the reservation (99 > 95); high-priority work
    # goes there either way.
    policy = make_policy("llumnix")
    normal = dispatch(policy, DispatchRequest("m"), cluster.view(), random.Random(0))
    assert normal.name == normal_goes_to
    high = DispatchRequest("m", priority=Priority.HIGH)
    assert dispatch(policy, high, cluster.view(), random.Random(0)).name == "a"


def test_repeated_scrape_failures_make_an_instance_unhealthy_until_it_recovers() -> None:
    cluster = make_cluster("a")
    for _ in range(2):
        cluster.record_scrape_failure("a", "refused")
    assert cluster.instance_view("a").healthy
    cluster.record_scrape_failure("a", "refused")
    assert not cluster.instance_view("a").healthy
    cluster.record_scrape("a", snapshot(), now=2.0)
    assert cluster.instance_view("a").healthy


@pytest.mark.parametrize("how", ["scrapes", "connect"])
def test_an_instance_that_goes_down_drops_the_load_its_last_look_saw(how: str) -> None:
    """Engine load from outside Ferry, seen at the last good look, is no longer
    there once the engine is gone: `/admin/instances` showed it for good."""
    cluster = make_cluster("a")
    cluster.record_scrape("a", snapshot(running=4, kv_usage=0.6), now=1.0)
    assert cluster.instance_view("a").virtual_blocks == 60
    if how == "scrapes":
        for _ in range(3):
            cluster.record_scrape_failure("a", "refused")
    else:
        cluster.mark_unreachable("a", "refused")
    view = cluster.instance_view("a")
    assert not view.healthy and view.virtual_blocks == 0 and view.batch == 0


def test_draining_instance_is_never_chosen() -> None:
    cluster = make_cluster("a", "b")
    cluster.set_draining("a", True)
    policy = make_policy("llumnix")
    assert {
        dispatch(policy, DispatchRequest("m"), cluster.view(), random.Random(s)).name
        for s in range(20)
    } == {"b"}


def test_an_outage_and_its_end_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    """An operator sees an instance go down (its looks fail, or a connect to it
    does) and come back in the log, one line each, not one per look."""
    cluster = make_cluster("a")
    caplog.set_level("INFO", logger="ferry.cluster")
    for _ in range(5):
        cluster.record_scrape_failure("a", "refused")
    cluster.record_scrape("a", snapshot(), now=1.0)
    cluster.record_scrape("a", snapshot(), now=2.0)
    cluster.mark_unreachable("a", "ClientConnectorError: refused")
    cluster.mark_unreachable("a", "ClientConnectorError: refused")
    cluster.record_scrape("a", snapshot(), now=3.0)
    cluster.mark_unreachable("a", "ClientConnectorError: refused")  # then its looks fail too
    for _ in range(5):
        cluster.record_scrape_failure("a", "refused")
    cluster.record_scrape("a", snapshot(), now=4.0)
    assert [r.getMessage() for r in caplog.records] == [
        "instance a is unhealthy after 3 failed looks: refused",
        "instance a is healthy",
        "instance a is unreachable, no traffic until it answers: ClientConnectorError: refused",
        "instance a is healthy",
        "instance a is unreachable, no traffic until it answers: ClientConnectorError: refused",
        "instance a is healthy",
    ]


def test_a_lora_adapter_s_context_is_its_base_model_s() -> None:
    """vLLM lists an adapter's card without `max_model_len`, naming its base as
    `parent`; a card that says neither gives no length."""
    cluster = make_cluster("i0")
    cluster.record_models(
        "i0",
        [
            {"id": "base", "max_model_len": 4096},
            {"id": "adapter", "parent": "base", "max_model_len": None},  # as vLLM lists it
            {"id": "keyless", "parent": "base"},
            {"id": "orphan", "parent": "gone"},
            {"id": "bare"},
            {"id": ["not", "a", "name"], "parent": None},
            {"id": "flag", "max_model_len": True},  # JSON's true is no length
        ],
    )
    assert cluster.context_length("i0", "flag") is None
    assert cluster.context_length("i0", "base") == 4096
    assert cluster.context_length("i0", "adapter") == 4096
    assert cluster.context_length("i0", "keyless") == 4096
    assert cluster.context_length("i0", "orphan") is None
    assert cluster.context_length("i0", "bare") is None
    assert cluster.context_length("i0", "unknown") is None


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=40))
def test_views_follow_instances_added_and_removed_one_by_one(ops: list[tuple[bool, int]]) -> None:
    """Adding or removing one instance builds its view alone (the others' stand);
    each name still finds its own view, in the fleet's order, state as its own."""
    cluster = make_cluster("a")
    for add, n in ops:
        name = f"i{n}"
        if add and name not in cluster.instances:
            cluster.add(InstanceConfig(name, f"http://{name}"))
            cluster.record_models(name, [{"id": "m"}])
        elif not add and name in cluster.instances:
            cluster.remove(name)
        cluster.set_draining("a", n % 2 == 0)  # a change to a view that stands
        names = [v.name for v in cluster.view().instances]
        assert names == list(cluster.instances)
        assert all(cluster.instance_view(name).name == name for name in names)
        assert cluster.instance_view("a").draining == (n % 2 == 0)


def test_an_instance_back_from_an_outage_has_nothing_credited() -> None:
    """Down, it may have restarted with an empty cache (engines without KV events
    say nothing of it): the prefixes Ferry recorded there were credited still."""
    cluster = make_cluster("a")
    cluster.prefixes.enabled = True
    key = cluster.prefixes.key({"prompt": "".join(f"{i:04d}" for i in range(64))}, 65)
    cluster.prefixes.record("a", key, 100)
    assert cluster.prefixes.cached_tokens(key) == {"a": 64}
    for _ in range(3):
        cluster.record_scrape_failure("a", "refused")
    assert cluster.prefixes.cached_tokens(key) == {"a": 64}  # (no traffic while down)
    cluster.record_scrape("a", snapshot(), now=2.0)
    assert cluster.prefixes.cached_tokens(key) == {}


def test_an_engine_that_publishes_no_cache_size_takes_its_share_beside_one_that_does() -> None:
    """An `engine: openai` server (no cache size: ranked by its requests alone,
    -B) beside a vLLM one (free blocks per request) took nothing while the vLLM
    one had a block free. It is ranked as if its cache were the mean of those
    that publish one; with none published, by requests alone."""
    cluster = make_cluster("vllm", "other")
    cluster.record_scrape("other", dataclasses.replace(snapshot(), kv_blocks_total=0), now=0.0)
    assert cluster.instance_view("other").capacity_blocks == 0  # still unknown
    assert placed(cluster, 20, 64).count("other") == 10
    cluster.remove("vllm")  # none publishes one: fewest requests first
    assert cluster.instance_view("other").freeness == -10.0


def test_an_engine_that_says_no_block_size_is_billed_in_the_fleets() -> None:
    """Beside a CPU vLLM (15 blocks of 128 tokens), an `engine: openai` instance
    (no block size) was assumed 1,920 // 16 = 120 blocks and billed in 16-token
    blocks: with the same tokens in flight it ranked 8x freer, and took 26 of
    40 streams on two identical real vLLM servers (TTFT p50 7 s there, 0.7 s on
    the other; a helper's probe)."""
    cluster = make_cluster("vllm", "other")
    cpu = dataclasses.replace(snapshot(), kv_blocks_total=15, block_size=128)
    cluster.record_scrape("vllm", cpu, now=0.0)
    unknown = dataclasses.replace(snapshot(), kv_blocks_total=0, block_size=0)
    cluster.record_scrape("other", unknown, now=0.0)
    assert cluster.block_size("other") == 128
    for name in ("vllm", "other"):  # the same 3 requests of 384 tokens each
        for _ in range(3):
            cluster.ledger.add(name, "m", Priority.NORMAL, 384, now=0.0)
    v, o = cluster.instance_view("vllm"), cluster.instance_view("other")
    assert o.freeness == pytest.approx(v.freeness)
    for entry in list(cluster.ledger.entries("vllm")) + list(cluster.ledger.entries("other")):
        cluster.release(entry)
    assert placed(cluster, 12, 200).count("other") == 6
    cluster.add(InstanceConfig("new", "http://new"))  # billed so from its start
    assert cluster.block_size("new") == 128
