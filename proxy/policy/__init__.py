"""The policy core: pure functions from frozen views to decisions.

Nothing here does I/O, reads a clock or uses a global random generator; the live
proxy and the simulator build the views, pass `rng`, and apply the decisions.
This subpackage imports nothing from the rest of `proxy/`.
"""

from proxy.policy.dispatch import POLICIES, NoCandidate, dispatch, make_policy
from proxy.policy.view import ClusterView, DispatchRequest, InstanceView, Priority
from proxy.policy.virtual_usage import (
    UsageSettings,
    instance_freeness,
    instance_virtual_usage,
    virtual_usage,
)

__all__ = [
    "POLICIES",
    "ClusterView",
    "DispatchRequest",
    "InstanceView",
    "NoCandidate",
    "Priority",
    "UsageSettings",
    "dispatch",
    "instance_freeness",
    "instance_virtual_usage",
    "make_policy",
    "virtual_usage",
]
