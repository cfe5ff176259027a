"""Dispatch decision time at 16, 256 and 1024 instances, every policy.

Two figures per cell: the policy alone on a prebuilt `ClusterView`, and the
proxy's real per-request path (`Cluster`: the previous dispatch invalidated one
instance's view, which is rebuilt, then the policy runs). Printed in
microseconds and as a ratio of the 50 us budget at 256 instances.

`llumnix+prefix` is llumnix with prefix credit and a session: its per-request
path adds the prefix index's lookup over every instance and its record on the
chosen one, for a 2,000-character prompt of which 1,600 are a shared prefix
already cached on a tenth of the instances.

    python -m loadtest.bench_dispatch
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from adapters import EngineSnapshot
from proxy.cluster import Cluster
from proxy.config import InstanceConfig
from proxy.policy import POLICIES, DispatchRequest, Priority, UsageSettings, dispatch, make_policy
from proxy.prefix_index import PrefixKey

SIZES = (16, 256, 1024)
BUDGET_US = 50.0


def build_cluster(n: int, rng: random.Random) -> Cluster:
    cluster = Cluster(
        tuple(
            InstanceConfig(f"gpu{i}", f"http://10.0.{i // 250}.{i % 250}:8000") for i in range(n)
        ),
        UsageSettings(high_priority_headroom_blocks=8),
        unhealthy_after_failures=3,
    )
    for i, name in enumerate(cluster.instances):
        cluster.record_models(name, [{"id": "llama"}])
        snap = EngineSnapshot(
            running=rng.randint(0, 64),
            waiting=rng.randint(0, 8),
            kv_usage=rng.random(),
            kv_blocks_total=2000,
            block_size=16,
            preemptions_total=0,
        )
        cluster.record_scrape(name, snap, now=0.0)
        for _ in range(rng.randint(0, 16)):
            cluster.ledger.add(
                name, "llama", Priority(rng.randint(0, 2)), rng.randint(10, 2000), 0.0
            )
        if i % 50 == 7:
            cluster.set_draining(name, True)
    return cluster


PREFIX = "llumnix+prefix"


def time_policy(policy_name: str, n: int, rounds: int) -> tuple[float, float]:
    rng = random.Random(n)
    cluster = build_cluster(n, rng)
    request = DispatchRequest("llama", prompt_tokens=300)
    key = None
    if policy_name == PREFIX:
        policy = make_policy("llumnix", prefix_credit=True)
        key, request = _with_prefix(cluster, request)
    else:
        policy = make_policy(policy_name)
    view = cluster.view()
    started = time.perf_counter()
    for _ in range(rounds):
        dispatch(policy, request, view, rng)
    alone = (time.perf_counter() - started) / rounds
    entries = []
    prefixes = cluster.prefixes
    started = time.perf_counter()
    for _ in range(rounds):
        view = cluster.view()
        req = request
        if key is not None:  # what Placement.choose adds with the index on
            cached = prefixes.cached_tokens(key)
            req = DispatchRequest("llama", 300, cached_tokens=cached, affinity=request.affinity)
        chosen = dispatch(policy, req, view, rng)
        cluster.note_dispatch()
        if key is not None:
            prefixes.record(chosen.name, key, chosen.capacity_blocks)
        entries.append(cluster.ledger.add(chosen.name, "llama", Priority.NORMAL, 300, 0.0))
    with_view = (time.perf_counter() - started) / rounds
    return alone * 1e6, with_view * 1e6


def _with_prefix(cluster: Cluster, request: DispatchRequest) -> tuple[PrefixKey, DispatchRequest]:
    prefixes = cluster.prefixes
    prefixes.enabled = True
    shared = "s" * 1600
    key = prefixes.key({"prompt": shared + "q" * 400}, 500, "session-1")
    names = list(cluster.instances)
    for name in names[::10]:
        prefixes.record(name, prefixes.key({"prompt": shared}, 400), 2000)
    cached = prefixes.cached_tokens(key)
    return key, DispatchRequest("llama", 500, cached_tokens=cached, affinity=names[0])


def main() -> int:
    # No options: it parses them so that `--help` says what it does rather than run.
    argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0]).parse_args()
    print(f"{'policy':<16}" + "".join(f"{f'{n} inst':>22}" for n in SIZES))
    print(f"{'':<16}" + "".join(f"{'alone / +view us':>22}" for _ in SIZES))
    at_256 = {}
    for name in [*sorted(POLICIES), PREFIX]:
        cells = []
        for n in SIZES:
            alone, with_view = time_policy(name, n, rounds=2000 if n < 1024 else 500)
            cells.append(f"{alone:>10.1f} / {with_view:>8.1f}")
            if n == 256:
                at_256[name] = with_view
        print(f"{name:<16}" + "".join(f"{c:>22}" for c in cells))
    print(f"\nat 256 instances, per-request path as a share of the {BUDGET_US:.0f} us budget:")
    for name, us in at_256.items():
        print(f"  {name:<16} {us / BUDGET_US:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
