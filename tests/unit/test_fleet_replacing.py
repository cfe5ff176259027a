"""An instance a peer removed and added again under its name, while the old one
is still being removed here (its streams not done): proxy/sharing.py `_hold`.
A real Cluster and Fleet; a Sharing whose Redis is never called (the changes are
fed to it as the fleet log's listener would)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from proxy.cluster import Cluster
from proxy.config import SharingConfig, parse_config
from proxy.fleet import Fleet, FleetError
from proxy.server import _usage
from proxy.sharing import Sharing

REMOVE = {"op": "remove", "name": "i1", "migrate": True}
ADD = {"op": "add", "instance": {"name": "i1", "url": "http://new:1"}}
PATCH = {"op": "patch", "name": "i1", "changes": {"labels": {"zone": "b"}}}
DRAIN = {"op": "drain", "name": "i1", "migrate": True}


class _Parts:  # what a removal touches besides the cluster
    streams: dict[int, Any] = {}

    def watch(self, name: str) -> None:
        pass

    async def unwatch(self, name: str) -> None:
        pass

    def drain(self, name: str) -> int:
        return 0

    def stop_draining(self, name: str) -> None:
        pass

    def forget(self, name: str) -> None:
        pass


def _process() -> tuple[Sharing, Fleet, dict[str, int]]:
    """A process whose file names i1 at http://old:1, and its own streams by instance."""
    config = parse_config(
        {"instances": [{"name": "i1", "url": "http://old:1"}, {"name": "i0", "url": "http://i0:1"}]}
    )
    cluster = Cluster(config.instances, _usage(config.scheduler), 3)
    own: dict[str, int] = {}
    cluster.ledger.count = lambda name: own.get(name, 0)  # type: ignore[method-assign]
    parts = _Parts()
    fleet = Fleet(config, cluster, parts, parts, parts, retune=lambda c: None, poll_s=0.01)  # type: ignore[arg-type]
    sharing = Sharing(None, SharingConfig(), cluster, fleet, parts, None, name="here")  # type: ignore[arg-type]
    return sharing, fleet, own


def _logged(sharing: Sharing, op: dict[str, Any], at: int) -> None:
    sharing._apply_change({"origin": "peer", "op": json.dumps(op), "at": repr(float(at))}, (at, 0))


def _instance(fleet: Fleet) -> tuple[str, dict[str, str], bool] | None:
    state = fleet.cluster.instances.get("i1")
    return None if state is None else (state.config.url, dict(state.config.labels), state.draining)


def test_changes_after_a_held_add_go_to_the_new_instance_and_admin_waits() -> None:
    """Applied at once, the add was refused (the name taken) and the changes after
    it went to the old instance; an admin change through this process meanwhile
    would too, so it is refused until the new one is in."""

    async def scenario() -> None:
        sharing, fleet, own = _process()
        own["i1"] = 1  # a stream of this process's on the old server
        for at, op in enumerate((REMOVE, ADD, PATCH, DRAIN), 1):
            _logged(sharing, op, at)
        await asyncio.sleep(0.05)
        assert _instance(fleet) == ("http://old:1", {}, True)  # still the old, leaving
        with pytest.raises(FleetError) as refused:
            fleet.check_changeable("i1")
        assert (refused.value.status, refused.value.code) == (409, "instance_replacing")
        own["i1"] = 0  # its stream ends (the peers' on the new server do not count)
        await asyncio.sleep(0.05)
        assert _instance(fleet) == ("http://new:1", {"zone": "b"}, True)
        fleet.check_changeable("i1")

    asyncio.run(scenario())


def test_a_resync_while_an_add_is_held_takes_the_newer_account_in_its_place() -> None:
    """The compacted state read again meanwhile (Redis lost its data, the log was
    trimmed) was queued behind the held add: add, remove, add, the new instance
    dropped and made again."""

    async def scenario() -> None:
        sharing, fleet, own = _process()
        own["i1"] = 1
        _logged(sharing, REMOVE, 1)
        _logged(sharing, ADD, 2)
        history = [
            {"origin": "peer", "op": op, "at": float(at)}
            for at, op in ((1, REMOVE), (2, ADD), (3, PATCH))
        ]
        sharing._apply_history("i1", history)
        removals = []
        remove = fleet.remove
        fleet.remove = lambda *a, **k: removals.append(a) or remove(*a, **k)  # type: ignore[method-assign]
        own["i1"] = 0
        await asyncio.sleep(0.05)
        assert _instance(fleet) == ("http://new:1", {"zone": "b"}, False)
        assert removals == []

    asyncio.run(scenario())
