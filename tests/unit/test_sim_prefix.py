"""Prefix caching in the simulator (loadtest/sim/prefix_cache.py) and traces with
shared structure (`ferry trace --prefix-groups --prefix-len --turns`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from loadtest.sim import run as sim_run
from loadtest.sim.instance import SimRequest
from loadtest.sim.prefix_cache import EngineCache, block_keys
from loadtest.sim.profile import LLAMA7B_A10
from loadtest.sim.simulator import SimSettings, Simulator
from loadtest.trace import TraceRequest, TraceSpec, generate, read, write
from proxy.policy import Priority

SHARED = TraceSpec(
    requests=400,
    rate=20,
    seed=3,
    input_mean=64,
    output_mean=32,
    max_len=256,
    prefix_groups=4,
    prefix_len=512,
    turns=4,
    sessions_at_once=10,
)


def req(id: int, group: int = -1, prefix: int = 0, session: int = -1) -> SimRequest:
    return SimRequest(id, 0.0, 100, 1, Priority.NORMAL, None, group, prefix, session)


def test_sessions_grow_turn_by_turn_under_one_system_prompt(tmp_path: Path) -> None:
    trace = generate(SHARED)
    assert trace == generate(SHARED)
    by_session: dict[int, list[TraceRequest]] = {}
    for r in trace:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert len({r.prefix_group for r in turns}) == 1
        assert all(r.prefix_tokens == 512 for r in turns)
        # Each turn's prompt holds the whole conversation before it.
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.output_tokens
    assert max(len(t) for t in by_session.values()) == 4
    write(tmp_path / "t.jsonl", trace)
    assert read(tmp_path / "t.jsonl") == trace
    # A plain trace is unchanged: no group, no session.
    plain = generate(dataclasses.replace(SHARED, prefix_groups=0, turns=1))
    assert {(r.prefix_group, r.session) for r in plain} == {(-1, -1)}


def test_block_keys_nest_group_then_session_then_own() -> None:
    keys = block_keys(req(7, group=2, prefix=32, session=5), 64, 16)
    assert keys == [(0, 2, 0), (0, 2, 1), (1, 5, 2), (1, 5, 3)]
    assert block_keys(req(7), 40, 16) == [(2, 7, 0), (2, 7, 1)]


def test_engine_cache_hits_the_shared_head_and_evicts_lru() -> None:
    cache = EngineCache(capacity_blocks=8, block_size=16)
    first, second = req(1, group=0, prefix=64, session=1), req(2, group=0, prefix=64, session=2)
    assert cache.admit(first, 100) == 0
    assert cache.admit(second, 100) == 64  # the 4 system-prompt blocks
    assert cache.admit(first, 100) == 96  # its own 6 full blocks
    assert cache.admit(first, 96) == 95  # one token is always computed
    assert len(cache) <= 8
    assert (cache.hit_tokens, cache.queried_tokens) == (64 + 96 + 95, 396)


def run(policy: str, credit: bool = False, caching: bool = True) -> Simulator:
    settings = SimSettings(4, policy, prefix_caching=caching, prefix_credit=credit, seed=1)
    sim = Simulator(generate(SHARED), LLAMA7B_A10, settings)
    done = sim.run()
    assert all(r.finish is not None and r.generated == r.output for r in done)
    return sim


def hit_rate(sim: Simulator) -> float:
    caches = [i.cache for i in sim.instances if i.cache is not None]
    return sum(c.hit_tokens for c in caches) / sum(c.queried_tokens for c in caches)


def test_prefix_credit_and_cache_aware_raise_the_hit_rate() -> None:
    plain, credit, aware = run("llumnix"), run("llumnix", credit=True), run("cache_aware")
    assert hit_rate(credit) > hit_rate(plain) + 0.1
    assert hit_rate(aware) > hit_rate(plain) + 0.1
    # A cached prefix is not prefilled again: first tokens come sooner.
    uncached = run("llumnix", credit=True, caching=False)
    ttft = [r.first_token - r.arrival for r in credit.requests if r.first_token is not None]
    slow = [r.first_token - r.arrival for r in uncached.requests if r.first_token is not None]
    assert sum(ttft) < sum(slow)


def test_a_cached_prompt_token_costs_what_the_profile_says() -> None:
    """A hit saves the compute of its tokens, not all of their cost: the step
    that admits it pays `step_per_cached_token_s` per cached token."""
    # Two requests under one system prompt, far apart: the second finds it cached.
    trace = [TraceRequest(i, 10.0 * i, 200, 1, prefix_group=0, prefix_tokens=128) for i in range(2)]

    def ttfts(per_cached: float) -> list[float]:
        profile = dataclasses.replace(LLAMA7B_A10, step_per_cached_token_s=per_cached)
        done = Simulator(trace, profile, SimSettings(1, prefix_caching=True)).run()
        return [r.first_token - r.arrival for r in done]  # type: ignore[operator]

    free, paid = ttfts(0.0), ttfts(1e-3)
    assert paid[0] == free[0]  # nothing cached yet
    assert paid[1] - free[1] == pytest.approx(128 * 1e-3)
    assert free[1] < free[0]  # the hit still saves its prefill


@pytest.mark.parametrize(
    ("flags", "credit"),
    [
        ((), False),  # engines without a prefix cache: nothing to credit
        (("--prefix-caching",), True),  # the proxy's default
        (("--prefix-caching", "--no-prefix-credit"), False),
        (("--prefix-credit",), True),
    ],
)
def test_sim_cli_credits_prefixes_as_the_proxy_does(flags: tuple[str, ...], credit: bool) -> None:
    parser = argparse.ArgumentParser()
    sim_run.add_arguments(parser)
    args = parser.parse_args(
        ["--trace", "t.jsonl", "--instances", "2", "--policy", "llumnix", *flags]
    )
    assert sim_run.settings_of(args).prefix_credit is credit
