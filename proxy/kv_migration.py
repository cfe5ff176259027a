"""Full-mode migration: move a live stream *with its KV cache* between shim instances.

Ferry only conducts; the instances' migration_shim does the copying (see
`migration_shim.control`). One move:
1. the destination reserves blocks for the request (refused: the request stays);
2. the source pre-copies the request's full KV blocks in stages while it keeps
   decoding, then stops it between two engine steps and sends the rest;
3. the stream cuts over exactly as in lite mode, while the last blocks travel;
   the continuation carries a `LOAD` marker, so the destination waits for them
   and loads P + G's KV instead of recomputing it.
A failure before the stop rolls back: the request never left the source. After
it, blocks that never land are recomputed by the destination, and a destination
that died fails the continuation, which resumes elsewhere by recompute (lite):
no request is lost either way.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from migration_shim import wire

if TYPE_CHECKING:
    from proxy.cluster import Cluster
    from proxy.metrics import FerryMetrics
    from proxy.resumable import ResumableStream

log = logging.getLogger("ferry.migration")


@dataclass(frozen=True, slots=True)
class FullModeSettings:
    max_stages: int = 3
    last_stage_blocks: int = 1
    bandwidth_mb_s: float = 0.0
    reserve_lease_s: float = 30.0
    timeout_s: float = 120.0


class KVMigrator:
    def __init__(
        self,
        cluster: Cluster,
        session: aiohttp.ClientSession,
        metrics: FerryMetrics,
        settings: FullModeSettings,
    ) -> None:
        self.cluster = cluster
        self.session = session
        self.metrics = metrics
        self.settings = settings

    def applies(self, stream: ResumableStream, destination: str) -> bool:
        """Full mode needs the shim on both ends, compatible KV, and a running request."""
        source = self.cluster.instances[stream.instance]
        dest = self.cluster.instances.get(destination)
        if dest is None or source.migration_mode != "full" or dest.migration_mode != "full":
            return False
        if stream.state.tag is None or stream.state.prompt_ids is None:
            return False  # not tagged on the source, or nothing generated yet
        assert source.shim is not None and dest.shim is not None
        # Shapes and instruction set are checked by the shims when their channel opens.
        mismatch = wire.layout_mismatch(source.shim, dest.shim, wire.INFO_LAYOUT_KEYS)
        if mismatch is not None:
            log.info("full migration %s -> %s impossible: %s", source.name, dest.name, mismatch)
        return mismatch is None

    async def move(self, stream: ResumableStream, destination: str, reason: str) -> bool:
        """Move one stream; False when it stays where it is."""
        stream.kv_moving = True
        try:
            return await self._move(stream, destination, reason)
        finally:
            stream.kv_moving = False

    async def _move(self, stream: ResumableStream, destination: str, reason: str) -> bool:
        state = stream.state
        source = self.cluster.instances[stream.instance]
        dest = self.cluster.instances[destination]
        assert dest.shim is not None and state.prompt_ids is not None
        mig_id = uuid.uuid4().hex
        tokens = len(state.prompt_ids) + len(state.generated)
        blocks = -(-tokens // int(dest.shim["block_size"])) + 1  # and room to go on
        reserved = await self._post(
            dest.url + wire.RESERVE,
            {"mig_id": mig_id, "num_blocks": blocks, "lease_s": self.settings.reserve_lease_s},
        )
        if reserved is None or "error" in reserved:
            self._count(reason, "destination_full")
            log.info("full migration to %s refused: %s", destination, _why(reserved))
            return False
        stream.expect_source_stop()
        result = await self._post(
            source.url + wire.MIGRATE,
            {
                "mig_id": mig_id,
                "tag": state.tag,
                "dest_addr": dest.shim["kv_addr"],
                "max_stages": self.settings.max_stages,
                "last_stage_blocks": self.settings.last_stage_blocks,
                "bandwidth_mb_s": self.settings.bandwidth_mb_s,
                "timeout_s": self.settings.timeout_s,
            },
            timeout=self.settings.timeout_s + 10,
        )
        outcome = (result or {}).get("outcome")
        if outcome == wire.STOPPED:
            assert result is not None
            self._count(reason, "ok")
            self.metrics.kv_migrated_blocks.inc(int(result.get("blocks", 0)))
            self.metrics.kv_precopy_stages.inc(int(result.get("stages", 0)))
            log.info(
                "request %s: KV moving %s -> %s (%s): %s blocks, %s pre-copy stages, stop %.1f ms",
                state.id,
                source.name,
                destination,
                reason,
                result.get("blocks"),
                result.get("stages"),
                1000 * float(result.get("stop_s", 0)),
            )
            load = {"mig_id": mig_id, "num_tokens": int(result["num_computed"])}
            return stream.move(destination, reason, load=load)
        await self.release(dest.url, mig_id)
        if outcome == wire.FAILED_AFTER_STOP:
            # The source has stopped the request: it must continue somewhere.
            self._count(reason, "fell_back_to_lite")
            log.warning("full migration of %s failed after the stop: %s", state.id, _why(result))
            return stream.move(destination, reason)
        if outcome is not None:
            # Known not stopped. With no answer at all it may have been: then an
            # abort from the source still counts as a stop, and the stream resumes.
            stream.expect_source_stop(False)
        self._count(reason, "source_finished" if outcome == wire.SOURCE_FINISHED else "rolled_back")
        log.info("full migration of %s did not happen: %s", state.id, _why(result))
        return False

    async def release(self, url: str, mig_id: str) -> None:
        """Free a destination's reservation and staged blocks (best effort: both
        also expire on their own)."""
        await self._post(url + wire.RELEASE, {"mig_id": mig_id})

    def _count(self, reason: str, outcome: str) -> None:
        self.metrics.kv_migrations.labels(reason, outcome).inc()

    async def _post(
        self, url: str, body: dict[str, Any], timeout: float = 10.0
    ) -> dict[str, Any] | None:
        try:
            async with self.session.post(
                url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("POST %s failed: %s: %s", url, type(exc).__name__, exc)
            return None
        return answer if isinstance(answer, dict) else None


def _why(answer: dict[str, Any] | None) -> str:
    if answer is None:
        return "no answer"
    error = answer.get("error")
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(error or answer.get("outcome"))
