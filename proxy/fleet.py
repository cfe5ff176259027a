"""Changing the fleet while it serves: instances added, changed and removed, and a
new configuration applied, with no client stream cut.

- An added instance takes traffic after its first good scrape.
- A changed instance keeps its streams; new settings apply to the next call
  (a new URL or engine is a new server: no traffic until it answers a scrape).
- A removed instance is drained first (its streams moved off when asked) and
  forgotten once nothing of it is in flight; `undrain` before then keeps it.
- A reload applies the difference between the running configuration and the
  file's: scheduler settings are swapped between two requests (`retune`), and
  server settings that need a new socket are reported, not applied.

With a shared view (proxy/sharing.py) an admin change is one `FleetOp`: the
process that takes the call applies it and `announce`s it; every peer applies
the same op (`apply_op`), so a drain reaches the cluster whichever process the
operator called. A reload is applied where it is made (each process reads its
own file), and announced as one `file` op per instance it decides: peers apply
nothing, but the shared state forgets the runtime changes it undid, so a
process that starts later from the same file does not make them again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Container
from typing import Any

from proxy import blocking_io, tls
from proxy.cluster import Cluster
from proxy.config import (
    ConfigError,
    FerryConfig,
    InstanceConfig,
    parse_instance,
    start_only_changes,
)
from proxy.metrics import FerryMetrics
from proxy.migrator import Migrator
from proxy.peer_load import NO_LOAD
from proxy.scraper import Scraper

log = logging.getLogger("ferry.fleet")

PATCHABLE = ("migration", "labels", "api_key", "headers", "engine_priority")
# The fleet changes announced to peers (admin changes, which they apply too, and
# a reload's `file`), and the fields each carries.
FLEET_OPS: dict[str, tuple[str, ...]] = {
    "add": ("instance",),
    "patch": ("name", "changes"),
    "remove": ("name", "migrate"),
    "drain": ("name", "migrate"),
    "undrain": ("name",),
    # A reload decided the instance: what the file says of it (`listed`) is its
    # story from then on, with the drain it was under (`draining`, which is not
    # the file's). Nothing to apply where it runs: each process reads its own file.
    "file": ("name", "listed"),
}


def op_instance(op: Any) -> str | None:
    """The instance a fleet op is about (an `add` names it in its body)."""
    if not isinstance(op, dict):
        return None
    name = op.get("name")
    if name is None and isinstance(op.get("instance"), dict):
        name = op["instance"].get("name")
    return name if isinstance(name, str) else None


def compact(history: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """An instance's fleet ops, shortest form, once `entry` ({"origin", "op", "at"}) is
    added: what a process that starts later applies instead of the whole log.
    An add, a remove or a reload (`file`, which says whether the instance was
    draining) starts the instance's story over, an add after a remove keeping
    the remove (a process whose file names the instance must drop that server
    first; proxy/sharing.py `_replayed`); drain and undrain keep only the last;
    patches merge into one (later changes win). Applying the result leaves the
    instance as applying every op in order would."""
    kind = entry["op"]["op"]
    if kind == "add" and history and history[0]["op"]["op"] == "remove":
        return [history[0], entry]
    if kind in ("add", "remove", "file"):
        return [entry]
    if kind in ("drain", "undrain"):
        return [e for e in history if e["op"]["op"] not in ("drain", "undrain")] + [entry]
    if kind != "patch" or not isinstance(entry["op"].get("changes"), dict):
        return [*history, entry]
    merged = dict(entry["op"]["changes"])
    changed_at = dict.fromkeys(merged, entry.get("at"))
    out = []
    for e in history:
        if e["op"]["op"] == "patch" and isinstance(e["op"].get("changes"), dict):
            earlier = patch_times(e)
            for key, value in e["op"]["changes"].items():
                if key not in merged:
                    merged[key], changed_at[key] = value, earlier.get(key)
        else:
            out.append(e)
    # Its origin, its time, and when each key was changed: an account merged with
    # another (proxy/sharing.py `_merged`) must not apply a key's change after
    # an add it came before.
    patch = {**entry, "op": {**entry["op"], "changes": merged}, "changed_at": changed_at}
    return out + [patch]


def patch_times(entry: dict[str, Any]) -> dict[str, Any]:
    """When each key of a (compacted) patch was changed: its own record, else
    the patch's time (an older Ferry's)."""
    times = entry.get("changed_at")
    times = times if isinstance(times, dict) else {}
    at = entry.get("at")
    return {k: at if times.get(k) is None else times[k] for k in entry["op"]["changes"]}


class FleetError(Exception):
    """A change that cannot be made; `status` and `code` are the API's answer."""

    def __init__(
        self, status: int, message: str, code: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.headers = status, code, headers  # (a 503's Retry-After)


class Fleet:
    def __init__(
        self,
        config: FerryConfig,
        cluster: Cluster,
        scraper: Scraper,
        migrator: Migrator,
        metrics: FerryMetrics,
        *,
        retune: Callable[[FerryConfig], None],
        load: Callable[[], FerryConfig] | None = None,
        poll_s: float = 0.05,
    ) -> None:
        """`retune(config)` applies scheduler settings to the running parts;
        `load()` reads the configuration file again (None: there is none)."""
        self.config = config
        # What was read at start: the settings read only then (the server's,
        # discovery, sharing) run as they were, whatever a reload read since.
        self.started = config
        self.cluster = cluster
        self.scraper = scraper
        self.migrator = migrator
        self.metrics = metrics
        self.retune = retune
        self.load = load
        self.poll_s = poll_s
        self._removals: dict[str, asyncio.Task[None]] = {}
        self._removed_everywhere: set[str] = set()  # removals that wait for every process
        # Names a peer removed and added again, whose old instance is still being
        # removed here (proxy/sharing.py `_hold`): no admin change through this
        # process until the new one is in (it would change the old one).
        self._replaced: set[str] = set()
        self._reloading = asyncio.Lock()
        # Instances that DNS discovery owns (proxy/discovery.py): a reload of the
        # file neither removes them nor reports them.
        self.discovered: frozenset[str] = frozenset()
        # Tells the peers of a change made here (proxy/sharing.py); alone: nobody.
        self.announce: Callable[[dict[str, Any]], None] = lambda op: None

    def apply_op(self, op: Any) -> None:
        """A peer's admin change, made here too; raises FleetError if it cannot be
        (a malformed op is one: 400)."""
        kind = op.get("op") if isinstance(op, dict) else None
        fields = FLEET_OPS.get(kind) if isinstance(kind, str) else None
        if fields is None or not all(f in op for f in fields):
            raise FleetError(400, f"not a fleet change (op {kind!r})", "invalid_request")
        if "name" in fields and not isinstance(op["name"], str):
            raise FleetError(
                400, f"not a fleet change ({kind}: name {op['name']!r})", "invalid_request"
            )
        if kind == "add":
            self.add_raw(op["instance"])
        elif kind == "patch":
            self.patch(op["name"], op["changes"])
        elif kind == "remove":
            self.remove(op["name"], migrate=bool(op["migrate"]), everywhere=True)
        elif kind == "drain":
            self.drain(op["name"], migrate=bool(op["migrate"]))
        elif kind == "undrain":
            self.undrain(op["name"])

    @property
    def removing(self) -> frozenset[str]:
        return frozenset(self._removals)

    async def removed(self, name: str) -> bool:
        """Wait for the removal of `name` under way, if any; whether it is gone
        (not if the removal was called off)."""
        task = self._removals.get(name)
        if task is not None:
            await asyncio.wait({task})  # (not raising if it was cancelled)
        return name not in self.cluster.instances

    def add(self, instance: InstanceConfig, replacing: Container[str] = ()) -> None:
        """Add `instance`; `replacing`: instances on their way out (a reload that
        renames one), which may name the same server meanwhile."""
        if instance.name in self.cluster.instances:
            raise FleetError(409, f"an instance named {instance.name!r} exists", "instance_exists")
        server = instance.server
        for name, state in self.cluster.instances.items():
            if state.server == server and not (state.leaving or name in replacing):
                raise FleetError(409, f"instance {name!r} is that server", "instance_exists")
        self.cluster.add(instance)
        self.scraper.watch(instance.name)
        self._changed()
        log.info("instance %s added (%s)", instance.name, instance.url)

    def add_raw(self, raw: Any) -> InstanceConfig:
        """`POST /admin/instances`: a JSON object like one YAML instance."""
        defaults = self.config.instance_defaults
        instance = _parse(lambda: parse_instance(raw, "instance", defaults=defaults, runtime=True))
        self.add(instance)
        return instance

    def patch(self, name: str, changes: Any) -> InstanceConfig:
        """`PATCH /admin/instances/{name}`: change what can change under load."""
        old = self._get(name).config
        if not isinstance(changes, dict):
            raise FleetError(400, "body: must be a JSON object", "invalid_request")
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(InstanceConfig)})
        if unknown:
            raise FleetError(
                400,
                f"instance.{unknown[0]}: no such field (those that can change at runtime:"
                f" {', '.join(PATCHABLE)})",
                "invalid_request",
            )
        fixed = sorted(set(changes) - set(PATCHABLE))
        if fixed:
            raise FleetError(
                400,
                f"instance.{fixed[0]}: cannot be changed at runtime (allowed: "
                f"{', '.join(PATCHABLE)}); remove the instance and add it again",
                "invalid_request",
            )
        raw = {"name": name, "url": old.url, "engine": old.engine, **changes}
        parsed = _parse(lambda: parse_instance(raw, "instance", runtime=True))
        new = dataclasses.replace(old, **{key: getattr(parsed, key) for key in changes})
        server = new.server
        for other, state in self.cluster.instances.items():  # headers tell servers apart
            if other != name and not state.leaving and state.server == server:
                raise FleetError(409, f"instance {other!r} is that server", "instance_exists")
        self.cluster.reconfigure(new)
        self._changed()
        log.info("instance %s changed: %s", name, ", ".join(sorted(changes)) or "nothing")
        return new

    def remove(self, name: str, *, migrate: bool, everywhere: bool = False) -> int:
        """Drain `name` and forget it once empty; returns how many streams move.
        `everywhere`: the fleet's removal (the admin API's, made in every
        process), which waits for the other processes' streams on it too; a
        removal of this process's alone (a reload, giving way to a peer's add
        of the name) waits for its own: the others still use the instance."""
        moving = self.drain(name, migrate=migrate)
        self.cluster.instances[name].leaving = True
        if everywhere:
            self._removed_everywhere.add(name)
        if name not in self._removals:
            task = asyncio.create_task(self._remove_when_empty(name), name=f"remove-{name}")
            self._removals[name] = task
        log.info(
            "instance %s removing: %d in flight, %d moving",
            name,
            self._inflight(name, everywhere),
            moving,
        )
        return moving

    def drain(self, name: str, *, migrate: bool) -> int:
        """No new requests for `name`; returns how many streams move off it."""
        self._get(name)
        self.cluster.set_draining(name, True)
        return self.migrator.drain(name) if migrate else 0

    def undrain(self, name: str) -> None:
        """Take traffic again; a removal not yet done is called off, unless its
        server was added again meanwhile under another name (it would be billed
        twice)."""
        state = self._get(name)
        if state.leaving:
            for other, them in self.cluster.instances.items():
                if other != name and not them.leaving and them.server == state.server:
                    raise FleetError(
                        409, f"instance {other!r} is that server now", "instance_exists"
                    )
        self._take_back(name)

    def _take_back(self, name: str) -> None:
        state = self._get(name)
        state.leaving = False
        self._removed_everywhere.discard(name)
        task = self._removals.pop(name, None)
        if task is not None:
            task.cancel()
            # It may have stopped the instance's scrapes already (the removal's
            # last step but one); an instance nobody scrapes keeps its last health.
            self.scraper.watch(name)
            log.info("instance %s: removal called off", name)
        self.cluster.set_draining(name, False)
        self.migrator.stop_draining(name)

    async def reload(self) -> dict[str, Any]:
        """Read the configuration file again and apply the difference. The file
        is read and checked in a thread: a long one takes the loop no time."""
        if self.load is None:
            raise FleetError(
                409, "ferry was started without a configuration file", "no_config_file"
            )
        async with self._reloading:  # one at a time: the file read last is applied last
            applied = self.apply(await blocking_io.call(_parse, self.load))
            serving = [s.config.tls_settings for s in self.cluster.instances.values()]
            # (Rotated certificates, from now on.)
            await blocking_io.call(tls.reread, [s for s in serving if s is not None])
            return applied

    def apply(self, new: FerryConfig) -> dict[str, Any]:
        """Make the running fleet match `new`; returns what changed."""
        old, started = self.config, self.started
        if new.discovery != started.discovery:
            # The file's instances are the fleet with the discovery it names: one
            # without the other would leave a fleet neither describes (with none
            # listed, no instance at all).
            raise FleetError(
                409,
                "discovery changed: it is read at start, so restart ferry to apply"
                " this file (nothing was applied)",
                "restart_required",
            )
        current = {
            n: s.config for n, s in self.cluster.instances.items() if n not in self.discovered
        }
        wanted = {i.name: i for i in new.instances}
        clash = sorted(set(wanted) & self.discovered)
        if clash:  # refused before anything changes
            raise FleetError(
                409,
                f"instances: {clash[0]!r} is an instance DNS discovery found",
                "instance_exists",
            )
        going = set(current) - set(wanted)
        # The file cannot list a server twice (parse_config); an instance it does
        # not list that stays (discovered, not leaving) must not be one of its
        # servers either. Checked before anything changes: a reload is all or nothing.
        staying = [
            (n, s.config)
            for n, s in self.cluster.instances.items()
            if n not in current and n not in wanted and not s.leaving
        ]
        servers = {c.server: n for n, c in staying}
        for i, instance in enumerate(new.instances):
            twin = servers.get(instance.server)
            if twin is not None:
                message = f"instances[{i}].url: the server of instance {twin!r} (discovered)"
                raise FleetError(409, message, "instance_exists")
        changed = []
        for name, instance in wanted.items():  # first, so an added one may take an old URL
            if name not in current:
                continue
            if name in self._removals:  # back in the file before it was gone
                # (A twin of its server the file does not list is removed below.)
                self._take_back(name)
            if instance != current[name]:
                self.cluster.reconfigure(instance)
                changed.append(name)
        added = [name for name in wanted if name not in current]
        for name in added:
            self.add(wanted[name], replacing=going)
        # Removed last, so their streams can move to instances added or changed above.
        removed = [n for n in current if n not in wanted and n not in self._removals]
        for name in removed:
            self.remove(name, migrate=True)
        self.config = new
        self._changed()
        # With a shared view, the changes made at runtime to the instances the
        # file decides are history: a process that starts later, reading the
        # same file, must not make them again (proxy/sharing.py).
        for name in sorted(set(current) | set(wanted)):
            state = self.cluster.instances.get(name)
            draining = name in wanted and state is not None and state.draining
            self.announce({"op": "file", "name": name, "listed": name in wanted,
                           "draining": draining})  # fmt: skip
        summary = {
            "added": added,
            "removed": removed,
            "changed": changed,
            "scheduler_changed": new.scheduler != old.scheduler,
            "restart_required": start_only_changes(new, started),
        }
        log.info("configuration reloaded: %s", summary)
        return summary

    async def stop(self) -> None:
        for task in self._removals.values():
            task.cancel()
        await asyncio.gather(*self._removals.values(), return_exceptions=True)

    def _get(self, name: str) -> Any:
        state = self.cluster.instances.get(name)
        if state is None:
            raise FleetError(404, f"no instance named {name!r}", "instance_not_found")
        return state

    def _inflight(self, name: str, everywhere: bool) -> int:
        """Streams on `name`: this process's, and with `everywhere` the other
        processes' too (as the shared view has them)."""
        mine = self.cluster.ledger.count(name)
        return mine + (self.cluster.peer_load.get(name, NO_LOAD).inflight if everywhere else 0)

    def _changed(self) -> None:
        """Keep `config.instances` true to the running fleet, and retune."""
        instances = tuple(s.config for s in self.cluster.instances.values())
        self.config = dataclasses.replace(self.config, instances=instances)
        self.retune(self.config)

    def begin_replacement(self, name: str) -> None:
        """A peer removed `name` and added it again (another server) while its
        removal here is under way: that removal waits for this process's streams
        alone (its maker waited for every process's, and the peers' streams under
        the name are now the new server's), and admin changes to it wait
        (`check_changeable`) until `end_replacement`."""
        self._removed_everywhere.discard(name)
        self._replaced.add(name)

    def end_replacement(self, name: str) -> None:
        self._replaced.discard(name)

    def check_changeable(self, name: str) -> None:
        """Refuse an admin change to `name` while a peer's add of it waits here
        for the old instance's removal (`begin_replacement`)."""
        if name in self._replaced:
            raise FleetError(
                409,
                f"instance {name!r} is being replaced: it was removed and added again"
                " through another process, and this one still ends the old server's"
                " streams; try again shortly",
                "instance_replacing",
                {"Retry-After": "1"},
            )

    def added_here(self, name: str, raw: Any) -> dict[str, Any] | None:
        """Where the instance `name` here is the one `raw` (an add's instance)
        adds, as far as an add says (the same server, engine and settings that
        only an add sets): the changes that make it so (the patchable fields);
        None where it is another, or none is here."""
        state = self.cluster.instances.get(name)
        if state is None or state.leaving:
            return None
        defaults = self.config.instance_defaults
        try:
            added = parse_instance(raw, "instance", defaults=defaults, runtime=True)
        except ConfigError:
            return None
        settable = {f: getattr(added, f) for f in PATCHABLE}
        if dataclasses.replace(state.config, **settable) != added:
            return None
        return settable

    async def _remove_when_empty(self, name: str) -> None:
        while self._inflight(name, name in self._removed_everywhere):
            await asyncio.sleep(self.poll_s)
        self._removed_everywhere.discard(name)
        await self.scraper.unwatch(name)
        self.cluster.remove(name)
        self.migrator.stop_draining(name)
        self.metrics.forget(name)
        del self._removals[name]
        self._changed()
        log.info("instance %s removed", name)


def _parse(build: Callable[[], Any]) -> Any:
    try:
        return build()
    except ConfigError as exc:
        raise FleetError(400, str(exc), "invalid_config") from exc
