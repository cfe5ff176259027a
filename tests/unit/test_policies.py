from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.policy import (
    POLICIES,
    ClusterView,
    DispatchRequest,
    InstanceView,
    NoCandidate,
    Priority,
    UsageSettings,
    dispatch,
    instance_freeness,
    instance_virtual_usage,
    make_policy,
    virtual_usage,
)
from proxy.policy.policies import CROWD_FACTOR, CROWD_GRACE, prefill_cost
from proxy.policy.virtual_usage import freeness_after, prefill_ahead

M = "m"


def inst(name: str, **fields: object) -> InstanceView:
    fields.setdefault("freeness", 10.0)
    fields.setdefault("models", frozenset({M}))
    return InstanceView(name=name, **fields)  # type: ignore[arg-type]


def pick(policy: str, *instances: InstanceView, seq: int = 0, seed: int = 0, **req: object) -> str:
    request = DispatchRequest(model=M, **req)  # type: ignore[arg-type]
    view = ClusterView(tuple(instances), seq)
    return dispatch(make_policy(policy), request, view, random.Random(seed)).name


def test_llumnix_picks_the_freest() -> None:
    assert (
        pick("llumnix", inst("a", freeness=3.0), inst("b", freeness=7.5), inst("c", freeness=5.0))
        == "b"
    )


def test_freeness_is_free_blocks_per_request() -> None:
    # M=100 blocks, 40 used by 4 requests -> 15 blocks per request.
    assert instance_freeness(100, 40.0, 4) == 15.0
    # An idle instance counts as one request so bigger idle instances rank first.
    assert instance_freeness(100, 0.0, 0) == 100.0
    assert instance_freeness(100, 0.0, 0, draining=True) == float("-inf")
    # Unknown capacity: fewest requests first.
    assert instance_freeness(0, 0.0, 3) == -3.0
    # Over capacity: the blocks a new request queues behind, not divided by the batch
    # (seen on real vLLM: 35 blocks by 12 requests looked freer than 28 by 7).
    assert instance_freeness(15, 35.0, 12) == -20.0
    assert instance_freeness(15, 35.0, 12) < instance_freeness(15, 28.0, 7)


@given(
    capacity=st.integers(1, 10_000),
    used=st.floats(0, 20_000),
    batch=st.integers(0, 500),
    blocks=st.integers(1, 100),
)
def test_one_more_request_never_makes_an_instance_freer(
    capacity: int, used: float, batch: int, blocks: int
) -> None:
    before = instance_freeness(capacity, used, batch)
    assert instance_freeness(capacity, used + blocks, batch + 1) <= before
    assert instance_freeness(capacity, used + blocks, batch) <= before


def test_virtual_usage_counts_blocks_and_priority_headroom() -> None:
    assert virtual_usage(100, 29, 128) == 2  # 129 tokens -> 2 blocks
    assert virtual_usage(100, 28, 128) == 1
    settings = UsageSettings(high_priority_headroom_blocks=4)
    # Headroom once per instance running high-priority requests, for the others only.
    assert instance_virtual_usage(10, 3, settings, for_high=False) == 14
    assert instance_virtual_usage(10, 3, settings, for_high=True) == 10
    assert instance_virtual_usage(10, 0, settings, for_high=False) == 10


def test_high_priority_requests_see_their_headroom_as_free() -> None:
    # a runs high-priority work and reserves headroom; b is busier in real terms.
    a = inst("a", freeness=2.0, freeness_high=9.0)
    b = inst("b", freeness=5.0)
    assert pick("llumnix", a, b) == "b"
    assert pick("llumnix", a, b, priority=Priority.HIGH) == "a"


def test_long_request_moves_new_work_away_though_request_counts_are_equal() -> None:
    # Both run one request; a's is long (40 of 50 blocks). least_requests cannot tell.
    a = inst("a", inflight=1, freeness=instance_freeness(50, 40, 1))
    b = inst("b", inflight=1, freeness=instance_freeness(50, 2, 1))
    assert {pick("llumnix", a, b, seed=s) for s in range(20)} == {"b"}
    assert {pick("least_requests", a, b, seed=s) for s in range(20)} == {"a", "b"}


def test_ties_are_broken_at_random_not_by_order() -> None:
    views = [inst(n, freeness=5.0) for n in "abcd"]
    for policy in ("llumnix", "least_requests", "least_kv", "queue_kv_scorer", "power_of_two"):
        chosen = Counter(pick(policy, *views, seed=s) for s in range(200))
        assert set(chosen) == set("abcd"), policy


def test_unhealthy_and_draining_instances_get_nothing() -> None:
    views = [
        inst("sick", healthy=False, freeness=99.0, kv_usage=0.0),
        inst("leaving", draining=True, freeness=99.0, kv_usage=0.0),
        inst("ok", freeness=1.0, kv_usage=0.9, inflight=9, engine_waiting=9),
    ]
    for policy in POLICIES:
        assert {pick(policy, *views, seq=s, seed=s) for s in range(10)} == {"ok"}, policy


def test_an_ejected_instance_is_chosen_only_when_no_other_can_be() -> None:
    ejected = inst("ejected", healthy=False, ejected=True, freeness=99.0)
    for policy in POLICIES:
        assert pick(policy, ejected, inst("ok", freeness=1.0), panic=True) == "ok", policy
        assert pick(policy, ejected, inst("sick", healthy=False), panic=True) == "ejected"
        out = frozenset({"ok"})
        assert pick(policy, ejected, inst("ok"), exclude=out, panic=True) == "ejected"
    # Never one that is draining or was tried already, nor for a move by choice.
    with pytest.raises(NoCandidate):
        pick("llumnix", inst("e", healthy=False, ejected=True, draining=True), panic=True)
    with pytest.raises(NoCandidate):
        pick("llumnix", ejected, exclude=frozenset({"ejected"}), panic=True)
    with pytest.raises(NoCandidate):
        pick("llumnix", ejected, inst("sick", healthy=False))


def test_no_candidate_says_why() -> None:
    with pytest.raises(NoCandidate, match="not served here") as unknown:
        pick("llumnix", inst("a", models=frozenset({"other"})))
    assert unknown.value.model_unknown
    with pytest.raises(NoCandidate, match="no healthy instance") as sick:
        pick("llumnix", inst("a", healthy=False))
    assert not sick.value.model_unknown
    with pytest.raises(NoCandidate, match="draining"):
        pick("round_robin", inst("a", draining=True), inst("b", healthy=False))
    with pytest.raises(NoCandidate, match="tried"):
        pick("random", inst("a"), exclude=frozenset({"a"}))
    # Not reached yet (no models read: starting up): it may serve the model.
    starting = inst("b", healthy=False, models=frozenset())
    with pytest.raises(NoCandidate, match="1 not reached yet \\(b\\)") as early:
        pick("llumnix", inst("a", models=frozenset({"other"})), starting)
    assert not early.value.model_unknown


def test_excluded_instances_are_skipped() -> None:
    assert (
        pick("llumnix", inst("a", freeness=9.0), inst("b", freeness=1.0), exclude=frozenset({"a"}))
        == "b"
    )


def test_round_robin_cycles_by_decision_count() -> None:
    views = [inst(n) for n in "abc"]
    assert [pick("round_robin", *views, seq=s) for s in range(6)] == list("abcabc")


def test_least_kv_and_queue_kv_scorer_read_the_scrape() -> None:
    a = inst("a", kv_usage=0.8, engine_waiting=0)
    b = inst("b", kv_usage=0.3, engine_waiting=0)
    assert pick("least_kv", a, b) == "b"
    # Queue dominates when the KV terms are close: 2*(1-0)+2*(0.5) vs 2*(0)+2*(0.6).
    c = inst("c", kv_usage=0.5, engine_waiting=0)
    d = inst("d", kv_usage=0.4, engine_waiting=8)
    assert pick("queue_kv_scorer", c, d) == "c"


def test_power_of_two_takes_the_lighter_of_its_two_samples() -> None:
    heavy = [inst(f"h{i}", inflight=10) for i in range(3)]
    light = inst("light", inflight=0)
    picks = Counter(pick("power_of_two", *heavy, light, seed=s) for s in range(400))
    # light is in the sample half the time and then always wins.
    assert 150 < picks["light"] < 260


def test_llumnix_topk_spreads_over_the_k_freest() -> None:
    views = [inst("a", freeness=9.0), inst("b", freeness=8.0), inst("c", freeness=1.0)]
    policy = make_policy("llumnix", topk=2)
    chosen = {
        dispatch(policy, DispatchRequest(M), ClusterView(tuple(views)), random.Random(s)).name
        for s in range(50)
    }
    assert chosen == {"a", "b"}


def test_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="choose one of .*llumnix.*round_robin"):
        make_policy("fastest")


def test_pass_through_without_model_may_use_any_instance() -> None:
    request = DispatchRequest(model=None)
    view = ClusterView((inst("a", models=frozenset()),))
    assert dispatch(make_policy("llumnix"), request, view, random.Random(0)).name == "a"


# -- prefill awareness: beside decodes, not behind a queued prefill ----------------


def test_a_request_goes_beside_decodes_rather_than_behind_a_queued_prefill() -> None:
    # a is freer but has a prompt waiting for its prefill; b only decodes.
    a = inst("a", freeness=40.0, batch=2, capacity_blocks=100, queued_tokens=600)
    b = inst("b", freeness=30.0, batch=3, capacity_blocks=100)
    assert {pick("llumnix", a, b, seed=s) for s in range(20)} == {"b"}
    blind = make_policy("llumnix", prefill_aware=False)
    request = DispatchRequest(M, prompt_tokens=100)
    assert dispatch(blind, request, ClusterView((a, b)), random.Random(0)).name == "a"


def test_memory_still_rules_out_an_instance_far_less_free_with_an_empty_queue() -> None:
    # b has no queue and room (15 free blocks, one request), but after taking a
    # one-block prompt it has 7 blocks per request against a's 26: memory decides.
    a = inst("a", freeness=40.0, batch=2, capacity_blocks=100, queued_tokens=600)
    b = inst("b", freeness=15.0, batch=1, capacity_blocks=100)
    assert pick("llumnix", a, b, prompt_tokens=16) == "a"
    # With 30 free blocks b keeps 14.5 per request, over half a's: b.
    b = inst("b", freeness=30.0, batch=1, capacity_blocks=100)
    assert pick("llumnix", a, b, prompt_tokens=16) == "b"


def test_an_instance_of_unknown_capacity_does_not_lower_the_bar_for_the_others() -> None:
    # c publishes no cache size (freeness_after is +inf there); b is still
    # measured against a, and c, unqueued, takes the request instead of b.
    a = inst("a", freeness=40.0, batch=2, capacity_blocks=100, queued_tokens=600)
    b = inst("b", freeness=15.0, batch=1, capacity_blocks=100)
    c = inst("c", freeness=-3.0, batch=3, capacity_blocks=0)
    assert pick("llumnix", a, b, c, prompt_tokens=16) == "c"
    assert pick("llumnix", a, b, inst("c", freeness=-3.0, batch=3, queued_tokens=9)) == "a"


def test_a_high_priority_request_weighs_queues_by_its_own_freeness() -> None:
    # b reserves headroom for the high-priority requests it runs: normal
    # requests see it far less free than a, high-priority ones as free.
    a = inst(
        "a", freeness=40.0, freeness_high=40.0, batch=2, capacity_blocks=100, queued_tokens=600
    )
    b = inst("b", freeness=5.0, freeness_high=30.0, batch=2, capacity_blocks=100)
    assert pick("llumnix", a, b, prompt_tokens=16) == "a"
    assert pick("llumnix", a, b, prompt_tokens=16, priority=Priority.HIGH) == "b"


def test_queues_alike_leave_the_choice_to_freeness() -> None:
    for queued in (0, 500):
        a = inst("a", freeness=40.0, batch=2, capacity_blocks=100, queued_tokens=queued)
        b = inst("b", freeness=30.0, batch=3, capacity_blocks=100, queued_tokens=queued)
        assert pick("llumnix", a, b) == "a"


def unqueued_choice(
    views: list[InstanceView], prompt: int, cached: dict[str, int], seed: int
) -> InstanceView:
    """What llumnix without a prefix difference picks, written out: the freest
    with no prefill queued among those left at least half as free as the freest
    (and 1 block per request), where the queues differ and one qualifies; else the
    freest. Ties go the policy's random way, so compare against its pick."""
    request = DispatchRequest(model=M, prompt_tokens=prompt, cached_tokens=cached)
    view = ClusterView(tuple(views))
    chosen = dispatch(make_policy("llumnix"), request, view, random.Random(seed))

    def after(v: InstanceView) -> float:
        blocks = -(-max(0, prompt - cached.get(v.name, 0)) // v.block_size)
        return freeness_after(v.freeness, v, blocks)

    top = max((after(v) for v in views if v.capacity_blocks > 0), default=-math.inf)
    enough = max(1.0, 0.5 * top)
    queued = {v.queued_tokens > 0 for v in views}
    eligible = [v for v in views if not v.queued_tokens and after(v) >= enough]
    pool = eligible if len(queued) == 2 and eligible else views
    assert chosen in pool
    assert chosen.freeness == max(v.freeness for v in pool)
    return chosen


@given(
    st.lists(
        st.tuples(
            st.floats(-50, 50),
            st.integers(0, 12),
            st.sampled_from([0, 0, 300]),
            st.sampled_from([400, 400, 0]),  # 0: capacity unknown
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 2000),
    st.integers(0, 2**31),
)
def test_an_empty_queue_wins_only_among_instances_nearly_as_free(
    shapes: list[tuple[float, int, int, int]], prompt: int, seed: int
) -> None:
    views = [
        inst(f"i{n}", freeness=f, batch=b, queued_tokens=q, block_size=16, capacity_blocks=m)
        for n, (f, b, q, m) in enumerate(shapes)
    ]
    unqueued_choice(views, prompt, {}, seed)


# -- prefix credit and cache_aware (issue 13) ---------------------------------------


def credit_pick(*instances: InstanceView, seed: int = 0, **options: object) -> str:
    request_fields = {
        k: options.pop(k) for k in ("cached_tokens", "affinity", "prompt_tokens") if k in options
    }
    request = DispatchRequest(model=M, **request_fields)  # type: ignore[arg-type]
    policy = make_policy(options.pop("policy", "llumnix"), **options)  # type: ignore[arg-type]
    return dispatch(policy, request, ClusterView(tuple(instances)), random.Random(seed)).name


def test_prefix_goes_where_its_prefill_costs_least() -> None:
    a = inst("a", freeness=20.0, batch=4, block_size=16, capacity_blocks=200)
    b = inst("b", freeness=30.0, batch=4, block_size=16, capacity_blocks=200)
    cached = {"a": 640}
    options = {"cached_tokens": cached, "prompt_tokens": 800}
    assert credit_pick(a, b, **options) == "b"  # type: ignore[arg-type]  # credit off: plain
    # 160 tokens to prefill on a against 800 on b: a, though b is freer.
    assert credit_pick(a, b, prefix_credit=True, **options) == "a"  # type: ignore[arg-type]
    # A queue on a weighs against b's cold prefill, counted twice (COLD_PREFILL_WEIGHT):
    # 1,200 + 2 x 160 against 2 x 800 keeps a; 1,400 + 2 x 160 goes to b.
    for queued_tokens, where in ((1200, "a"), (1400, "b")):
        queued = inst(
            "a",
            freeness=20.0,
            batch=4,
            block_size=16,
            capacity_blocks=200,
            queued_tokens=queued_tokens,
        )
        assert credit_pick(queued, b, prefix_credit=True, **options) == where  # type: ignore[arg-type]


def test_prefix_never_crowds_memory() -> None:
    # a holds the prefix, but its 160 uncached tokens (10 blocks) are more than its
    # 8 free ones: it would fall below 1 free block a request. b has room for all
    # 50 blocks of the prompt: b.
    a = inst("a", freeness=2.0, batch=4, block_size=16, capacity_blocks=40)
    b = inst("b", freeness=40.0, batch=4, block_size=16, capacity_blocks=300)
    options = {"cached_tokens": {"a": 640}, "prompt_tokens": 800}
    assert credit_pick(a, b, prefix_credit=True, **options) == "b"  # type: ignore[arg-type]
    # With a guard it meets, locality decides again.
    picked = credit_pick(a, b, prefix_credit=True, safe_freeness=-5.0, **options)  # type: ignore[arg-type]
    assert picked == "a"


def test_where_memory_is_short_everywhere_the_cache_counts_as_room() -> None:
    # Neither has room: a is 2 blocks short after its 10 uncached ones, b 18
    # short after all 50. Plain F sees only b's 8 free blocks a request against
    # a's 2 and sends the whole prompt there; with the credit, a.
    a = inst("a", freeness=2.0, batch=4, block_size=16, capacity_blocks=40)
    b = inst("b", freeness=8.0, batch=4, block_size=16, capacity_blocks=80)
    options = {"cached_tokens": {"a": 640}, "prompt_tokens": 800}
    assert credit_pick(a, b, **options) == "b"  # type: ignore[arg-type]
    assert credit_pick(a, b, prefix_credit=True, **options) == "a"  # type: ignore[arg-type]
    # Still never onto a crowded holder: a with 9 in flight beside b's 2.
    crowded = inst("a", freeness=1.0, batch=9, block_size=16, capacity_blocks=40)
    light = inst("b", freeness=8.0, batch=2, block_size=16, capacity_blocks=80)
    assert credit_pick(crowded, light, prefix_credit=True, **options) == "b"  # type: ignore[arg-type]


def test_the_crowd_bound_is_the_operators_to_set() -> None:
    # a holds the prompt with 9 in flight; b has 2. The default bound (2 x 2 +
    # 4 = 8) calls a crowded: b. A looser one (3 x 2 + 8 = 14) keeps locality: a.
    a = inst("a", freeness=20.0, batch=9, block_size=16, capacity_blocks=200)
    b = inst("b", freeness=30.0, batch=2, block_size=16, capacity_blocks=200)
    options = {"cached_tokens": {"a": 640}, "prompt_tokens": 800}
    assert credit_pick(a, b, prefix_credit=True, **options) == "b"  # type: ignore[arg-type]
    loose = {"crowd_factor": 3.0, "crowd_grace": 8.0}
    assert credit_pick(a, b, prefix_credit=True, **loose, **options) == "a"  # type: ignore[arg-type]
    # A tighter one (1.5 x 2 + 2 = 5) gives up locality sooner: 6 in flight is b's.
    busy = inst("a", freeness=20.0, batch=6, block_size=16, capacity_blocks=200)
    tight = {"crowd_factor": 1.5, "crowd_grace": 2.0}
    assert credit_pick(busy, b, prefix_credit=True, **options) == "a"  # type: ignore[arg-type]
    assert credit_pick(busy, b, prefix_credit=True, **tight, **options) == "b"  # type: ignore[arg-type]
    # Even loose, a holder past the bound loses: 15 in flight against 2.
    packed = inst("a", freeness=20.0, batch=15, block_size=16, capacity_blocks=200)
    assert credit_pick(packed, b, prefix_credit=True, **loose, **options) == "b"  # type: ignore[arg-type]


def test_a_hot_prefix_does_not_pile_onto_its_holder() -> None:
    """Ten requests for one cached prompt: the holder takes them while it has
    at most 2x + 4 the other's in flight, then the rest balance."""
    options = {"cached_tokens": {"a": 640}, "prompt_tokens": 800}
    batch = {"a": 0, "b": 0}
    for _ in range(10):
        views = [
            inst(n, freeness=100.0 / (k + 1), batch=k, block_size=16, capacity_blocks=400)
            for n, k in batch.items()
        ]
        batch[credit_pick(*views, prefix_credit=True, **options)] += 1  # type: ignore[arg-type]
    assert batch == {"a": 8, "b": 2}
    # Memory to spare does not lift the bound: a holds 5 beside an empty b.
    a = inst("a", freeness=1000.0, batch=5, block_size=16, capacity_blocks=4000)
    b = inst("b", freeness=90.0, batch=0, block_size=16, capacity_blocks=90)
    assert credit_pick(a, b, prefix_credit=True, **options) == "b"  # type: ignore[arg-type]
    # Nor does a small engine lose its own prompts to a roomy neighbour.
    small = inst("a", freeness=20.0, batch=2, block_size=16, capacity_blocks=80)
    roomy = inst("b", freeness=1000.0, batch=0, block_size=16, capacity_blocks=4000)
    assert credit_pick(small, roomy, prefix_credit=True, **options) == "a"  # type: ignore[arg-type]


@given(
    st.lists(
        st.tuples(
            st.floats(-50, 200), st.integers(0, 16), st.integers(0, 4000), st.integers(0, 2000)
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 3000),
    st.integers(0, 2**31),
)
def test_prefix_choice_is_free_enough_and_cheapest(
    shapes: list[tuple[float, int, int, int]], prompt: int, seed: int
) -> None:
    views, cached = [], {}
    for n, (free, batch, queued, hit) in enumerate(shapes):
        views.append(
            inst(
                f"i{n}",
                freeness=free,
                batch=batch,
                queued_tokens=queued,
                block_size=16,
                capacity_blocks=400,
            )
        )
        if hit:
            cached[f"i{n}"] = hit
    policy = make_policy("llumnix", prefix_credit=True)
    request = DispatchRequest(model=M, prompt_tokens=prompt, cached_tokens=cached)
    chosen = dispatch(policy, request, ClusterView(tuple(views)), random.Random(seed))

    def after(v: InstanceView) -> float:
        blocks = -(-max(0, prompt - cached.get(v.name, 0)) // 16)
        return freeness_after(v.freeness, v, blocks)

    def ahead(v: InstanceView) -> int:  # its own uncached tokens weighed twice
        uncached = max(0, prompt - cached.get(v.name, 0))
        cost = prefill_ahead(prompt, cached.get(v.name, 0), v) + uncached
        assert cost == prefill_cost(prompt, cached.get(v.name, 0), v)
        return cost

    crowded = CROWD_FACTOR * min(v.batch for v in views) + CROWD_GRACE
    uncrowded = [v for v in views if v.batch <= crowded]
    safe = [v for v in uncrowded if after(v) >= 1.0]
    alike = len({cached.get(v.name, 0) for v in views}) == 1
    if alike:  # plain llumnix, with its preference for an empty queue
        assert chosen is unqueued_choice(views, prompt, cached, seed)
    elif not safe:  # memory decides, the cached blocks not counted as demand
        assert chosen in uncrowded
        assert after(chosen) == max(after(v) for v in uncrowded)
    else:
        assert chosen in safe
        assert ahead(chosen) == min(ahead(v) for v in safe)


@pytest.mark.parametrize(("queued", "stays"), [(1000, True), (1600, False)])
def test_a_cold_prefill_weighs_twice_against_the_queue_it_skips(queued: int, stays: bool) -> None:
    """A prompt that leaves its cache for a shorter queue is prefilled cold, and
    the next request queued there waits for that too: the holder keeps a
    request while its queue is longer by less than twice the tokens the cache
    saves (768 here: up to 1,536), not once (768)."""
    holder = inst(
        "holder", freeness=150.0, batch=2, queued_tokens=queued, block_size=16, capacity_blocks=400
    )
    other = inst(
        "other", freeness=150.0, batch=2, queued_tokens=0, block_size=16, capacity_blocks=400
    )
    cached = {"holder": 768}
    assert prefill_cost(1024, 768, holder) == queued + 2 * 256
    assert prefill_cost(1024, 0, other) == 2 * 1024
    chosen = credit_pick(
        holder, other, prefix_credit=True, prompt_tokens=1024, cached_tokens=cached
    )
    assert (chosen == "holder") is stays


@given(
    st.lists(st.floats(-100, 100), min_size=1, max_size=8),
    st.integers(0, 2**31),
)
def test_no_cache_no_affinity_is_plain_llumnix(free: list[float], seed: int) -> None:
    views = [inst(f"i{n}", freeness=f) for n, f in enumerate(free)]
    plain = credit_pick(*views, seed=seed)
    assert credit_pick(*views, seed=seed, prefix_credit=True) == plain


@given(
    st.lists(st.tuples(st.floats(-100, 100), st.integers(0, 4000)), min_size=1, max_size=8),
    st.integers(1, 3000),
    st.integers(0, 2**31),
)
def test_a_prefix_cached_alike_everywhere_is_plain_llumnix(
    shapes: list[tuple[float, int]], cached: int, seed: int
) -> None:
    """A chat template's first block is cached on every instance: it tells
    none apart, so the credit leaves the choice to plain F, queues and all."""
    views = [inst(f"i{n}", freeness=f, queued_tokens=q) for n, (f, q) in enumerate(shapes)]
    request = {"cached_tokens": {v.name: cached for v in views}, "prompt_tokens": 4000}
    plain = credit_pick(*views, seed=seed)
    assert credit_pick(*views, seed=seed, prefix_credit=True, **request) == plain  # type: ignore[arg-type]


def test_affinity_is_kept_within_the_margin() -> None:
    a = inst("a", freeness=20.0)
    b = inst("b", freeness=25.0)
    assert credit_pick(a, b, affinity="a", prefix_credit=True, affinity_margin=8.0) == "a"
    assert credit_pick(a, b, affinity="a", prefix_credit=True, affinity_margin=4.0) == "b"
    # Not onto an instance that would be short of memory, margin or not.
    full = inst("a", freeness=20.0, batch=4, capacity_blocks=82)
    roomy = inst("b", freeness=25.0, batch=4, capacity_blocks=200)
    request = {"affinity": "a", "prompt_tokens": 16 * 76}  # 4 blocks left for 5
    assert credit_pick(full, roomy, prefix_credit=True, **request) == "b"  # type: ignore[arg-type]
    # An affinity to an instance not among the candidates is ignored.
    assert credit_pick(a, b, affinity="gone", prefix_credit=True) == "b"


def test_cache_aware_follows_the_match_unless_imbalanced() -> None:
    a = inst("a", inflight=10)
    b = inst("b", inflight=2)
    follow = {"cached_tokens": {"a": 50}, "prompt_tokens": 100}
    assert credit_pick(a, b, policy="cache_aware", **follow) == "a"  # type: ignore[arg-type]
    # Below cache_threshold: fewest in flight.
    low = {"cached_tokens": {"a": 20}, "prompt_tokens": 100}
    assert credit_pick(a, b, policy="cache_aware", **low) == "b"  # type: ignore[arg-type]
    # Imbalanced (100 - 2 > 64 and 100 > 1.5 * 2): fewest in flight, match or not.
    busy = inst("a", inflight=100)
    assert credit_pick(busy, b, policy="cache_aware", **follow) == "b"  # type: ignore[arg-type]
