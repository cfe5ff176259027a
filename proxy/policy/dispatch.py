"""Runs a dispatch policy: the shared rules live here, once.

The runner filters candidates (healthy, not draining, serving the model, not
already tried), raises `NoCandidate` with the reason when none is left, and
hands the rest to the policy. Where only ejected instances are left, they are
the candidates of a request that may `panic` (Envoy's panic threshold, applied
when routing: the fleet may have lost every other instance since the
ejection, which lasts up to minutes). The registry maps config names to factories.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from proxy.policy.policies import (
    CacheAware,
    DispatchPolicy,
    LeastKV,
    LeastRequests,
    Llumnix,
    PowerOfTwo,
    QueueKVScorer,
    Random,
    RoundRobin,
)
from proxy.policy.view import ClusterView, DispatchRequest, InstanceView, shown


class NoCandidate(LookupError):
    """No instance can take the request; `reason` says why, for the client."""

    def __init__(self, reason: str, *, model_unknown: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.model_unknown = model_unknown


POLICIES: dict[str, Callable[..., DispatchPolicy]] = {}


def register(name: str, factory: Callable[..., DispatchPolicy]) -> None:
    if name in POLICIES:
        raise ValueError(f"dispatch policy {name!r} is registered twice")
    POLICIES[name] = factory


for _factory in (
    Llumnix,
    RoundRobin,
    Random,
    LeastRequests,
    LeastKV,
    PowerOfTwo,
    QueueKVScorer,
    CacheAware,
):
    register(_factory.name, _factory)


def make_policy(name: str, **options: float | bool) -> DispatchPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
    return factory(**options)


def dispatch(
    policy: DispatchPolicy, request: DispatchRequest, view: ClusterView, rng: random.Random
) -> InstanceView:
    """Choose the instance for `request`. Raises NoCandidate when none can take it."""
    model, exclude = request.model, request.exclude
    # The common case (a model, nothing excluded) gets the tightest comprehension.
    if model is not None and not exclude:
        candidates = [v for v in view.instances if v.dispatchable and model in v.models]
    else:
        candidates = [
            v
            for v in view.instances
            if v.dispatchable and (model is None or model in v.models) and v.name not in exclude
        ]
    if not candidates and request.panic:
        candidates = [
            v
            for v in view.instances
            if v.ejected
            and not v.draining
            and (model is None or model in v.models)
            and v.name not in exclude
        ]
    if not candidates:
        reason, model_unknown = _why_none(request, view)
        raise NoCandidate(reason, model_unknown=model_unknown)
    return policy.choose(request, candidates, rng, view.dispatch_seq)


def _why_none(request: DispatchRequest, view: ClusterView) -> tuple[str, bool]:
    model = request.model
    serving = [v for v in view.instances if model is None or model in v.models]
    named = None if model is None else shown(model)
    if not serving and model is not None:
        # An instance Ferry has not read the models of yet (starting up, or never
        # reached) may serve it: not known yet is not unknown (a 503, not a 404).
        unread = [v.name for v in view.instances if not v.models]
        if unread:
            listed = ", ".join(unread[:5]) + (", ..." if len(unread) > 5 else "")
            return (
                f"model {named!r} is not served by the instances seen so far; "
                f"{len(unread)} not reached yet ({listed})",
                False,
            )
        known = sorted({m for v in view.instances for m in v.models})
        return f"model {named!r} is not served here; available: {known}", True
    what = "any model" if model is None else f"model {named!r}"
    if all(not v.healthy for v in serving):
        return f"no healthy instance serves {what}", False
    if all(v.draining or not v.healthy for v in serving):
        return f"every instance serving {what} is draining or unhealthy", False
    return f"every instance serving {what} was tried and failed", False
