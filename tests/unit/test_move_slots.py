"""The migrator's bounded set of moves (proxy/migrator.py `MoveSlots`)."""

from __future__ import annotations

import asyncio

from proxy.migrator import MOVE_RANKS, MoveSlots


def test_a_drain_waiting_for_a_slot_goes_before_rebalancing() -> None:
    async def scenario() -> list[str]:
        slots = MoveSlots(1)
        served: list[str] = []

        async def move(name: str, reason: str) -> None:
            await slots.acquire(MOVE_RANKS[reason])
            served.append(name)
            await asyncio.sleep(0)
            slots.release()

        await slots.acquire(MOVE_RANKS["rebalance"])  # one move under way
        waiting = [
            asyncio.create_task(move("rebalance 1", "rebalance")),
            asyncio.create_task(move("rebalance 2", "rebalance")),
            asyncio.create_task(move("drain", "drain")),
        ]
        await asyncio.sleep(0)  # all three wait
        slots.release()
        await asyncio.gather(*waiting)
        assert slots.held == 0
        return served

    assert asyncio.run(scenario()) == ["drain", "rebalance 1", "rebalance 2"]


def test_a_cancelled_waiter_passes_its_turn_on() -> None:
    async def scenario() -> None:
        slots = MoveSlots(1)
        await slots.acquire(0)
        gone = asyncio.create_task(slots.acquire(0))
        kept = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        slots.release()
        await asyncio.wait_for(kept, 1)  # the slot skipped the cancelled waiter
        assert slots.held == 1
        slots.release()
        assert slots.held == 0

    asyncio.run(scenario())


def test_a_rescue_in_flight_leaves_the_slots_free() -> None:
    """A rescue or a failover takes no slot; every submitted stream stays
    claimed (out of the planners' sight) until its move is over."""
    from types import SimpleNamespace
    from typing import Any

    from proxy.migrator import Migrator

    async def scenario() -> list[Any]:
        migrator = Migrator(None, None, None, None, max_concurrent=2, prewarm=False)  # type: ignore[arg-type]
        release = asyncio.Event()

        async def move(*_: Any) -> bool:
            await release.wait()
            return True

        migrator.move = move  # type: ignore[method-assign]
        rescued, failed, rebalanced = (
            SimpleNamespace(claimed=False, instance="a") for _ in range(3)
        )
        seen: list[Any] = [migrator.free_slots]
        migrator.submit(rescued, "b", "rescue", prewarm=False)  # type: ignore[arg-type]
        migrator.submit(failed, None, "failover", prewarm=False)  # type: ignore[arg-type]
        seen.append(migrator.free_slots)
        migrator.submit(rebalanced, "b", "rebalance")  # type: ignore[arg-type]
        claimed = [s.claimed for s in (rescued, failed, rebalanced)]
        seen += [migrator.free_slots, all(claimed)]
        release.set()
        await asyncio.sleep(0.01)
        seen += [migrator.free_slots, any(s.claimed for s in (rescued, failed, rebalanced))]
        return seen

    assert asyncio.run(scenario()) == [2, 2, 1, True, 2, False]


def test_a_sampled_stream_is_moved_by_recompute_not_by_a_kv_copy() -> None:
    """A full-mode copy stops the source wherever its text is (held back, for a
    character's bytes cut between tokens), past going back; a sampled stream
    moves only in step, so its move goes by recompute, where the cut is Ferry's
    and one out of step stays. A greedy one's KV is copied."""
    from types import SimpleNamespace
    from typing import Any

    from proxy.migrator import Migrator

    class KV:
        def __init__(self) -> None:
            self.copied: list[str] = []

        def applies(self, source: str, destination: str) -> bool:
            return True

        async def copy(self, source: str, destination: str, tag: str, *_: Any) -> Any:
            self.copied.append(tag)
            return SimpleNamespace(
                finished=False, refused=False, abandoned=False, load=None, stopped=False
            )

    def stream(sampled: bool) -> Any:
        ordered: list[Any] = []

        async def order_move(destination: str, reason: str, *_: Any, **__: Any) -> bool:
            ordered.append(destination)
            return True

        splicer = SimpleNamespace(
            unmovable=None,
            sampled=sampled,
            starts_over=lambda: False,
            continuation_tokens=lambda: 40,
        )
        return SimpleNamespace(
            accepts_orders=True,
            splicer=splicer,
            instance="a",
            failed_on=set(),
            tag="sampled" if sampled else "greedy",
            order_move=order_move,
            ordered=ordered,
            expect_source_stop=lambda expected: None,
            copy_moot=None,
        )

    on = SimpleNamespace(config=SimpleNamespace(migration="full"))
    cluster = SimpleNamespace(instances={"a": on, "b": on})
    placement = SimpleNamespace(takes_moves=lambda name: True)
    kv = KV()
    migrator = Migrator(cluster, placement, None, kv, max_concurrent=2, prewarm=False)  # type: ignore[arg-type]

    async def scenario() -> None:
        sampled, greedy = stream(True), stream(False)
        assert await migrator.move(sampled, "b", "rebalance")
        assert await migrator.move(greedy, "b", "rebalance")
        assert kv.copied == ["greedy"]
        assert sampled.ordered == greedy.ordered == ["b"]

    asyncio.run(scenario())
