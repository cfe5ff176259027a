"""The scaling rule behind `ferry_desired_instances` (proxy/policy/scaling.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.config import ConfigError, parse_config
from proxy.policy import ClusterView, InstanceView, UsageSettings
from proxy.policy.scaling import ScalingSettings, ScalingSignal, scaling_signal
from proxy.policy.virtual_usage import instance_view

DEFAULT = ScalingSettings()  # out below 10, in above 60 (with one instance fewer)


def inst(
    name: str,
    *,
    capacity: int = 1000,
    blocks: float = 0.0,
    batch: int = 0,
    healthy: bool = True,
    draining: bool = False,
) -> InstanceView:
    return instance_view(
        name,
        capacity_blocks=capacity,
        real_blocks=blocks,
        high_priority_requests=0,
        batch=batch,
        inflight=batch,
        settings=UsageSettings(),
        healthy=healthy,
        draining=draining,
    )


def signal(*instances: InstanceView, settings: ScalingSettings = DEFAULT) -> ScalingSignal:
    return scaling_signal(ClusterView(tuple(instances)), settings)


def test_freeness_pools_the_serving_instances() -> None:
    # (2000 - 1100) / 30 = 30: one idle instance does not hide a full one.
    s = signal(inst("a", blocks=1000, batch=20), inst("b", blocks=100, batch=10))
    assert s.freeness == pytest.approx(30.0)
    assert (s.fleet, s.pending, s.desired) == (2, 0, 2)


def test_scale_out_asks_for_enough_instances_to_reach_the_threshold() -> None:
    # free = 2000 - 1900 = 100 for 50 requests: F = 2 < 10. Reaching 10 needs
    # 500 free blocks: 400 more, one instance of 1000.
    s = signal(inst("a", blocks=950, batch=25), inst("b", blocks=950, batch=25))
    assert s.freeness == pytest.approx(2.0)
    assert s.desired == 3
    # A queue of 3000 blocks more (defragmentation counts queued prompts): F < 0,
    # and the rule asks for the memory: (10 * 60 - (2000 - 4900)) / 1000 -> 4 more.
    s = signal(inst("a", blocks=2450, batch=30), inst("b", blocks=2450, batch=30))
    assert s.desired == 2 + math.ceil((10 * 60 + 2900) / 1000)


def test_scale_in_only_when_the_freeness_stays_high_with_one_instance_fewer() -> None:
    idle = [inst(n) for n in "abc"]
    assert signal(*idle).desired == 2
    # F = (3000 - 300) / 20 = 135 > 60, but without one instance (2700 - 1000) / 20 = 85.
    lightly = [inst("a", blocks=100, batch=8), inst("b", blocks=100, batch=6)]
    assert signal(*lightly, inst("c", blocks=100, batch=6)).desired == 2
    # F = (3000 - 900) / 30 = 70 > 60, yet with one fewer (2100 - 1000) / 30 = 37: hold.
    assert signal(*[inst(n, blocks=300, batch=10) for n in "abc"]).desired == 3


def test_in_the_band_the_fleet_holds() -> None:
    s = signal(inst("a", blocks=500, batch=20), inst("b", blocks=500, batch=20))
    assert 10 <= (s.freeness or 0) <= 60
    assert s.desired == 2


def test_draining_instances_leave_the_fleet_and_the_freeness() -> None:
    busy = inst("a", blocks=950, batch=25)
    leaving = inst("b", blocks=0, batch=0, draining=True)
    s = signal(busy, leaving)
    assert (s.fleet, s.freeness) == (1, pytest.approx(2.0))
    assert s.desired == 2


def test_starting_instances_count_as_empty_capacity_and_block_scale_in() -> None:
    # Without the starting one, F = (1000 - 950) / 25 = 2: scale out. With it,
    # F = (2000 - 950) / 25 = 42: it is already coming, so the fleet of 2 holds.
    busy = inst("a", blocks=950, batch=25)
    starting = inst("b", healthy=False)
    s = signal(busy, starting)
    assert (s.fleet, s.pending, s.desired) == (2, 1, 2)
    assert s.freeness == pytest.approx(42.0)
    # An idle fleet with one instance still starting does not scale in yet.
    assert signal(inst("a"), inst("b"), inst("c", healthy=False)).desired == 3


def test_no_measurable_instance_holds_the_fleet() -> None:
    outage = signal(inst("a", healthy=False), inst("b", healthy=False))
    assert (outage.freeness, outage.desired) == (None, 2)
    # Engines that publish no cache size give no memory signal (freeness -B there).
    blind = signal(inst("a", capacity=0, batch=40), inst("b", capacity=0, batch=40))
    assert (blind.freeness, blind.desired) == (None, 2)
    # ... and do not drag the pooled freeness of the others down.
    mixed = signal(inst("a", capacity=0, batch=40), inst("b", blocks=500, batch=20))
    assert mixed.freeness == pytest.approx(25.0)
    assert mixed.desired == 2


def test_the_count_is_clamped() -> None:
    bounded = ScalingSettings(min_instances=2, max_instances=3)
    assert signal(inst("a"), settings=bounded).desired == 2
    overloaded = [inst(n, blocks=2000, batch=50) for n in "ab"]
    assert signal(*overloaded, settings=bounded).desired == 3
    assert signal(*overloaded).desired > 3


@pytest.mark.parametrize(
    "options",
    [
        {"scale_out_freeness_below": 60.0},
        {"scale_in_freeness_above": math.inf},
        {"min_instances": 0},
        {"min_instances": 3, "max_instances": 2},
    ],
)
def test_settings_are_validated(options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ScalingSettings(**options)  # type: ignore[arg-type]


# Property tests: random fleets, random thresholds.

instances = st.lists(
    st.builds(
        lambda i, capacity, blocks, batch, healthy, draining: inst(
            f"i{i}",
            capacity=capacity,
            blocks=blocks,
            batch=batch,
            healthy=healthy,
            draining=draining,
        ),
        st.integers(0, 10**6),
        st.sampled_from([0, 64, 1000, 4096]),
        st.floats(0, 20_000),
        st.integers(0, 300),
        st.booleans(),
        st.booleans(),
    ),
    max_size=12,
    unique_by=lambda v: v.name,
)


@st.composite
def settings(draw: st.DrawFn, nonnegative: bool = False) -> ScalingSettings:
    low = 0.0 if nonnegative else -50.0
    out = draw(st.floats(low, 100))
    into = draw(st.floats(out + 0.5, 200))
    low_n = draw(st.integers(1, 6))
    high_n = draw(st.one_of(st.none(), st.integers(low_n, 20)))
    return ScalingSettings(out, into, low_n, high_n)


@given(instances, settings())
def test_desired_always_within_bounds(views: list[InstanceView], s: ScalingSettings) -> None:
    desired = signal(*views, settings=s).desired
    assert desired >= s.min_instances
    assert s.max_instances is None or desired <= s.max_instances


@given(instances, settings(), st.data())
def test_monotone_in_virtual_usage(
    views: list[InstanceView], s: ScalingSettings, data: st.DataObject
) -> None:
    if not views:
        return
    i = data.draw(st.integers(0, len(views) - 1))
    more = data.draw(st.floats(0, 5000))
    heavier = list(views)
    v = views[i]
    heavier[i] = inst(
        v.name,
        capacity=v.capacity_blocks,
        blocks=v.virtual_blocks + more,
        batch=v.batch,
        healthy=v.healthy,
        draining=v.draining,
    )
    assert signal(*heavier, settings=s).desired >= signal(*views, settings=s).desired


@given(instances, settings(nonnegative=True), st.data())
def test_monotone_in_requests(
    views: list[InstanceView], s: ScalingSettings, data: st.DataObject
) -> None:
    """One more request (of any size) never asks for fewer instances, with
    thresholds >= 0 (freeness is blocks per request: below zero, a request with
    no blocks would dilute the deficit)."""
    if not views:
        return
    i = data.draw(st.integers(0, len(views) - 1))
    blocks = data.draw(st.integers(0, 200))
    v = views[i]
    busier = dataclasses.replace(
        v,
        virtual_blocks=v.virtual_blocks + blocks,
        batch=v.batch + 1,
        freeness=v.freeness,  # not read by the rule
    )
    heavier = [busier if w is v else w for w in views]
    assert signal(*heavier, settings=s).desired >= signal(*views, settings=s).desired


# The YAML keys (scheduler.*) that feed the rule.


def test_yaml_settings_reach_the_rule() -> None:
    raw = {
        "instances": [{"name": "a", "url": "http://127.0.0.1:8001"}],
        "scheduler": {"scale_out_freeness_below": 5, "min_instances": 2, "max_instances": 8},
    }
    settings = parse_config(raw).scheduler.scaling_settings()
    assert settings == ScalingSettings(5.0, 60.0, 2, 8)
    assert parse_config({"instances": raw["instances"]}).scheduler.scaling_settings() == DEFAULT


@pytest.mark.parametrize(
    ("scheduler", "message"),
    [
        ({"scale_out_freeness_below": 60}, r"scheduler.scale_out_freeness_below: must be below"),
        (
            {"scale_in_freeness_above": 5},
            r"scale_out_freeness_below: must be below scale_in_freeness_above",
        ),
        ({"scale_in_freeness_above": math.inf}, r"scale_in_freeness_above: must be a finite"),
        ({"min_instances": 0}, r"scheduler.min_instances: must be at least 1"),
        ({"min_instances": 4, "max_instances": 2}, r"scheduler.max_instances: must be at least"),
        ({"max_instances": "many"}, r"scheduler.max_instances: must be int \| None"),
    ],
)
def test_yaml_settings_are_validated_with_their_path(
    scheduler: dict[str, object], message: str
) -> None:
    raw = {"instances": [{"name": "a", "url": "http://127.0.0.1:8001"}], "scheduler": scheduler}
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)
