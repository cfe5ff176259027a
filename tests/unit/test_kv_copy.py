"""A full-mode copy whose stream went on without it gives up at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from migration_shim import wire
from proxy.kv_migration import FullModeSettings, KVMigrator
from proxy.metrics import FerryMetrics


class Shims:
    """Stand-in for `Upstreams.post_json` against two shims (not the shim): the
    destination reserves, the source's migrate call hangs as a stopped source's does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.migrating = asyncio.Event()

    async def post_json(
        self, instance: str, path: str, body: dict[str, Any], timeout_s: float = 10.0
    ) -> Any:
        self.calls.append((instance, path))
        if path == wire.MIGRATE:
            self.migrating.set()
            await asyncio.sleep(3600)
        return {"ok": True}


def migrator(shims: Shims) -> KVMigrator:
    shim = {"block_size": 16, "kv_addr": "127.0.0.1:1"}
    cluster: Any = SimpleNamespace(instances={"dest": SimpleNamespace(shim=shim)})
    return KVMigrator(cluster, shims, FerryMetrics(), FullModeSettings())  # type: ignore[arg-type]


def test_a_copy_whose_stream_failed_over_frees_its_reservation_at_once() -> None:
    async def scenario() -> tuple[Any, list[bool], list[tuple[str, str]]]:
        shims, moot, expected = Shims(), asyncio.Event(), list[bool]()
        copy = asyncio.create_task(
            migrator(shims).copy("src", "dest", "tag", 100, "drain", expected.append, moot)
        )
        await shims.migrating.wait()
        moot.set()  # the stream failed over while the source hung
        outcome = await asyncio.wait_for(copy, 1)
        return outcome, expected, shims.calls

    outcome, expected, calls = asyncio.run(scenario())
    assert outcome.abandoned and not outcome.stopped and outcome.load is None
    assert calls == [("dest", wire.RESERVE), ("src", wire.MIGRATE), ("dest", wire.RELEASE)]
    assert expected == [True, False]  # the source's stop is no longer looked for


def test_a_copy_whose_source_never_answers_is_counted_as_such() -> None:
    """A source killed mid-copy breaks the call: counted `rolled_back` (the
    request going on at its source), though its source was dead."""

    class Dead(Shims):
        async def post_json(
            self, instance: str, path: str, body: dict[str, Any], timeout_s: float = 10.0
        ) -> Any:
            self.calls.append((instance, path))
            return None if path == wire.MIGRATE else {"ok": True}

    shims = Dead()
    kv = migrator(shims)
    outcome = asyncio.run(kv.copy("src", "dest", "tag", 100, "drain", lambda _: None))
    assert not outcome.stopped and not outcome.finished
    assert shims.calls[-1] == ("dest", wire.RELEASE)
    page = kv.metrics.text().decode()
    assert 'ferry_kv_migrations_total{outcome="no_answer",reason="drain"} 1.0' in page
    assert 'outcome="rolled_back"' not in page
