"""Background scrape loop: one task per instance, polling its engine's metrics
and `/v1/models`.

The instance's adapter (`engine:`) says where its metrics are and parses them;
an engine without metrics is healthy while `GET /v1/models` answers, and its
load is Ferry's ledger alone.

Contract: `start()` launches the tasks and returns at once; `stop()` cancels and
awaits them. The HTTP session, the clock and all intervals are passed in, so
tests control time. Parsing runs on the event loop but on a pre-filtered text
of a few lines (see `adapters.vllm`), a few hundred microseconds per scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp

from adapters import EngineSnapshot, MetricsParseError
from migration_shim import wire
from proxy.cluster import Cluster, InstanceState
from proxy.config import InstanceConfig
from proxy.metrics import FerryMetrics
from proxy.upstream import OutOfFiles, ShortageLog, out_of_files, read_whole, tls_of

log = logging.getLogger("ferry.scraper")

# An engine's page past this many bytes fails its scrape: vLLM's /metrics is
# about 100 KB, and a page of gigabytes would fill Ferry's memory.
MAX_PAGE_BYTES = 16 * 1024 * 1024
# A look at an engine's queue speaks for the requests sent at least this long
# before it began: a request reaches the queue a little after Ferry sends it
# (the API server reads and tokenizes it first), and vLLM's gauges change once
# per engine step, so a look can be answered before the queue shows it.
QUEUE_SHOWS_AFTER_S = 0.5


class Scraper:
    def __init__(
        self,
        cluster: Cluster,
        session: aiohttp.ClientSession,
        metrics: FerryMetrics,
        *,
        interval_s: float,
        timeout_s: float,
        models_refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.session = session
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.models_refresh_s = models_refresh_s
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._unexpected: dict[str, str] = {}  # each instance's last unforeseen failure
        # Told after each look that leaves an instance unhealthy and answering
        # nothing: no token for this process's requests since the look before, and
        # no answer to `GET /health` either (Migrator.leave_hung).
        self.on_down: Callable[[str], object] | None = None
        self._produced: dict[str, int] = {}  # ledger.produced() at each instance's last look
        # (when, the ledger's last dispatch id) as each recent look began; the
        # first is the newest at least QUEUE_SHOWS_AFTER_S old (see `_reached_id`).
        self._marks: dict[str, deque[tuple[float, int]]] = {}
        self._short_of_files = ShortageLog(log, clock)
        self._retuned = asyncio.Event()  # set (and replaced) by each `retune`

    def retune(self, interval_s: float, timeout_s: float, models_refresh_s: float) -> None:
        """New intervals (a reload, or any fleet change), in effect at once: a
        new scrape interval ends each loop's pause under way, and it looks
        again (a pause of the old, longer interval held a shorter one off
        until it was over)."""
        changed = interval_s != self.interval_s
        self.interval_s, self.models_refresh_s = interval_s, models_refresh_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        if changed:  # (not otherwise: every loop would look at once, in step from then on)
            self._retuned.set()
            self._retuned = asyncio.Event()

    def start(self) -> None:
        for name in self.cluster.instances:
            self.watch(name)

    def watch(self, name: str) -> None:
        """Start scraping an instance (one added at runtime, too)."""
        if name not in self._tasks:
            self._tasks[name] = asyncio.create_task(self._run(name), name=f"scrape-{name}")

    async def unwatch(self, name: str) -> None:
        """Stop scraping an instance before it is removed."""
        task = self._tasks.pop(name, None)
        self._unexpected.pop(name, None)  # an instance added again under the name logs anew
        self._produced.pop(name, None)
        self._marks.pop(name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop(self) -> None:
        for name in list(self._tasks):
            await self.unwatch(name)

    async def scrape_once(self, name: str) -> None:
        """One look at the instance: its engine's metrics, parsed by its adapter;
        for an engine without metrics, `GET /v1/models` (success is health)."""
        state = self.cluster.instances[name]
        asked = state.config  # (a reload replaces `state.config` during the awaits)
        path, parse = state.adapter.metrics_path, state.adapter.parse_metrics
        if path is None or parse is None:
            error = await self._models(name)
            if not self._still(name, asked):
                return
            if error is not None:
                self.metrics.scrape_errors.labels(name).inc()
                self.cluster.record_scrape_failure(name, error)
            else:
                self.cluster.record_alive(name, self.clock())
            return
        reached_id = self._reached_id(name)
        try:
            snapshot = await self._snapshot(state, path, parse)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            # ValueError: MetricsParseError, a body that is not UTF-8, a header
            # value aiohttp refuses to send.
            if out_of_files(exc):
                raise OutOfFiles(str(exc)) from exc
            if self._still(name, asked):
                self.metrics.scrape_errors.labels(name).inc()
                self.cluster.record_scrape_failure(name, _describe(exc))
            return
        if self._still(name, asked):
            self.cluster.record_scrape(name, snapshot, self.clock(), reached_id)

    def _still(self, name: str, asked: InstanceConfig) -> bool:
        """Whether `name` is still the server a look asked (`asked`, its config
        then): a reload that gave it another URL meanwhile made the look one of
        the old server, which says nothing of the new one."""
        state = self.cluster.instances.get(name)
        return state is not None and state.config.engine_at == asked.engine_at

    def _reached_id(self, name: str) -> int:
        """The ledger's last dispatch id as of the newest earlier look that
        began at least QUEUE_SHOWS_AFTER_S before this one (a whole interval
        before, where looks are further apart): the engine's queue, as this look
        reads it, shows the requests up to it (0: none yet)."""
        now, marks = self.clock(), self._marks.setdefault(name, deque())
        shown = now - QUEUE_SHOWS_AFTER_S
        while len(marks) > 1 and marks[1][0] <= shown:
            marks.popleft()
        reached_id = marks[0][1] if marks and marks[0][0] <= shown else 0
        marks.append((now, self.cluster.ledger.last_id()))
        return reached_id

    async def _snapshot(
        self, state: InstanceState, path: str, parse: Callable[[str], EngineSnapshot]
    ) -> EngineSnapshot:
        """The engine's load, from the adapter's narrow path where that works.

        `state.metrics_path` is None until a narrow look has been checked
        against a whole page: the same cache size (a series the parser needs
        filtered out would read 0 from then on). An engine that answers the
        narrow path with an error while its whole page reads is read whole
        from then on, until a look fails outright (a restart, perhaps into
        another version: it is asked by name again). A checked narrow path that
        fails once is checked again."""
        name = state.name
        narrow = state.adapter.metrics_narrow_path
        if narrow is None or state.metrics_path == path:
            try:
                return await self._read(state, path, parse)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                if narrow is not None:
                    state.metrics_path = None
                raise
        try:
            snapshot = await self._read(state, narrow, parse)
        except MetricsParseError as exc:
            full = await self._read(state, path, parse)  # its failure is the engine's
            if state.metrics_path is None:
                log.info("%s: reading its whole %s (asking by name: %s)", name, path, exc)
                state.metrics_path = path
            else:
                state.metrics_path = None
            return full
        if state.metrics_path is None:
            try:
                full = await self._read(state, path, parse)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                return snapshot  # the check waits for a look that reads both
            same = (full.kv_blocks_total, full.block_size) == (
                snapshot.kv_blocks_total,
                snapshot.block_size,
            )
            state.metrics_path = narrow if same else path
            if not same:
                why = "by name it reads another cache size"
                log.info("%s: reading its whole %s (%s)", name, path, why)
                return full
        return snapshot

    async def _read(
        self, state: InstanceState, path: str, parse: Callable[[str], EngineSnapshot]
    ) -> EngineSnapshot:
        async with self.session.get(
            state.url + path,
            headers=state.config.auth_headers(),
            **(await tls_of(state.config)),
            timeout=self.timeout,
        ) as resp:
            if resp.status != 200:
                raise MetricsParseError(f"GET {path.split('?')[0]} returned HTTP {resp.status}")
            text = (await read_whole(resp, MAX_PAGE_BYTES)).decode()
        return parse(text)

    async def refresh_models(self, name: str) -> bool:
        """Read the instance's models; a failure is shown (`models_error` in
        /admin/instances) and logged once per cause, since an instance whose
        load reads fine but whose models do not takes no traffic."""
        asked = self.cluster.instances[name].config
        error = await self._models(name)
        state = self.cluster.instances.get(name)
        if state is not None and self._still(name, asked):
            if error is not None and error != state.models_error:
                log.warning("cannot read the models of %s: %s", name, error)
            state.models_error = error
        return error is None

    async def _models(self, name: str) -> str | None:
        """Read the instance's `/v1/models` into the cluster; None, or what failed."""
        state = self.cluster.instances[name]
        asked = state.config
        try:
            async with self.session.get(
                state.url + "/v1/models",
                headers=state.config.auth_headers(),
                **(await tls_of(state.config)),
                timeout=self.timeout,
            ) as resp:
                if resp.status != 200:
                    return f"GET /v1/models returned HTTP {resp.status}"
                body = json.loads(await read_whole(resp, MAX_PAGE_BYTES))
            data = body.get("data", [])
            if not isinstance(data, list):
                return f"GET /v1/models: its data is {type(data).__name__}, not a list"
            cards = [c for c in data if isinstance(c, dict) and "id" in c]
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
            if out_of_files(exc):
                raise OutOfFiles(str(exc)) from exc
            return f"GET /v1/models: {_describe(exc)}"
        if self._still(name, asked):
            self.cluster.record_models(name, cards)
        return None

    async def refresh_shim(self, name: str) -> None:
        """Full mode needs migration_shim on the instance: ask it, and say why not."""
        state = self.cluster.instances[name]
        if not state.adapter.runs_shim:
            state.shim, state.shim_error = None, f"engine {state.config.engine} runs no shim"
            return
        info: Any = None
        try:
            async with self.session.get(
                state.url + wire.INFO,
                headers=state.config.auth_headers(),
                **(await tls_of(state.config)),
                timeout=self.timeout,
            ) as resp:
                if resp.status == 200:
                    info = json.loads(await read_whole(resp, MAX_PAGE_BYTES))
                why = f"GET {wire.INFO}: HTTP {resp.status} (shim not loaded)"
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            if out_of_files(exc):  # Ferry's shortage: what it knew of the shim stands
                return
            why = _describe(exc)
        if isinstance(info, dict) and info.get("shim_version") == wire.SHIM_VERSION:
            state.shim, state.shim_error = info, None
        else:
            if isinstance(info, dict):
                why = f"shim version {info.get('shim_version')}, need {wire.SHIM_VERSION}"
            state.shim, state.shim_error = None, why

    async def look(self, name: str, with_models: bool = True) -> bool:
        """One look at the instance: its models (`with_models`), then its load.
        Whatever it answers, a failure is a failed scrape, never an exception: a
        loop that died would leave the instance's last look standing for good
        (healthy while dead, or never healthy again). Whether the models were read."""
        state = self.cluster.instances[name]
        read = False
        try:
            if with_models and await self.refresh_models(name):
                read = True
                if state.config.migration == "full":
                    await self.refresh_shim(name)
            await self.scrape_once(name)
        except OutOfFiles as exc:
            # Ferry's own shortage says nothing of the instance: it keeps its
            # last look, rather than every instance going down at once.
            self._short_of_files.warn(
                "cannot look at %s: %s (raise the open files limit)", name, exc
            )
            return read
        except Exception as exc:  # noqa: BLE001
            why = _describe(exc)
            if why != self._unexpected.get(name):  # once per new cause, not per scrape
                log.exception("scraping %s failed", name)
            self._unexpected[name] = why
            self.metrics.scrape_errors.labels(name).inc()
            self.cluster.record_scrape_failure(name, why)
        if name in self.cluster.instances:
            produced = self.cluster.ledger.produced(name)
            moved = produced != self._produced.get(name, produced)
            self._produced[name] = produced
            if not self.cluster.instances[name].healthy and not moved:
                await self._down(name)
        return read

    async def _down(self, name: str) -> None:
        """An unhealthy instance that produced nothing since its last look: tell
        `on_down` if it does not answer `GET /health` either. A slow `/metrics`
        (a busy engine's) fails scrapes too, and the instance's whole answers
        and first tokens show no progress until they come: a live process
        answers something, a frozen one nothing."""
        if self.on_down is None:
            return
        state = self.cluster.instances[name]
        try:
            async with self.session.get(
                state.url + "/health",
                headers=state.config.auth_headers(),
                **(await tls_of(state.config)),
                timeout=self.timeout,
            ):
                return  # any status: the process answers
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            if out_of_files(exc):  # not an answer either way
                return
        if name not in self.cluster.instances:  # removed meanwhile
            return
        try:
            self.on_down(name)
        except Exception:  # noqa: BLE001 - the look loop must outlive it
            log.exception("handling unhealthy %s failed", name)

    async def _run(self, name: str) -> None:
        models_read: float | None = None  # when its models were last read (None: due)
        config = None
        while True:
            started = self.clock()
            state = self.cluster.instances[name]
            if state.config is not config:  # changed at runtime: look again now
                if config is not None:  # perhaps another engine: ask it by name again
                    state.metrics_path = None
                models_read, config = None, state.config
            stale, state.models_stale = state.models_stale, False
            due = models_read is None or started >= models_read + self.models_refresh_s
            if await self.look(name, with_models=stale or due):
                models_read = started
            elif not state.healthy:
                # Down, perhaps restarting: what comes back may serve other models.
                models_read = None
            elapsed = self.clock() - started
            retuned = self._retuned
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self.interval_s - elapsed)):
                    await retuned.wait()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "scrape timed out"
    return f"{type(exc).__name__}: {exc}"
