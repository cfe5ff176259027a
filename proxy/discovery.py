"""Instances found in DNS: a Kubernetes headless Service's name resolves to one
address per ready pod; Ferry resolves it every `refresh_s` and applies the
difference to the running fleet. It needs nothing but DNS.

- An address that appears becomes an instance `<name>@<address>:<port>`
  (`DiscoveryConfig.instance`); it takes traffic after its first good scrape.
- An address that disappears is removed through the fleet: drained (its streams
  moved off where migration is on), forgotten once empty. One that comes back
  before then is taken back (undrained).
- A name that fails to resolve keeps the last set found (with a warning): one
  DNS hiccup never empties the fleet. Scaling the Service to zero pods therefore
  keeps the last instances until their scrapes fail them.

Start/stop contract: `refresh_all()` once before serving, then `start()` runs
one task per name; `stop()` cancels them and waits. The resolver and the sleep
are arguments, so tests control both.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from proxy.config import DiscoveryConfig
from proxy.fleet import Fleet, FleetError

log = logging.getLogger("ferry.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, sorted, through the loop's resolver
    (getaddrinfo on a thread: /etc/hosts, then DNS, as nsswitch.conf says)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True, slots=True)
class Change:
    added: tuple[str, ...]  # names to add
    restored: tuple[str, ...]  # names being removed that are wanted again
    removed: tuple[str, ...]  # names to remove


def diff(owned: Iterable[str], removing: Iterable[str], wanted: Iterable[str]) -> Change:
    """What to do so that the names of one source match `wanted`.

    `owned`: the source's names still in the fleet; `removing`: those of them
    draining towards removal, which the source does not remove again, and takes
    back only if `wanted` names them."""
    owned_set, removing_set, wanted_set = set(owned), set(removing), set(wanted)
    return Change(
        added=tuple(sorted(wanted_set - owned_set)),
        restored=tuple(sorted(wanted_set & owned_set & removing_set)),
        removed=tuple(sorted(owned_set - wanted_set - removing_set)),
    )


class Discovery:
    def __init__(
        self,
        fleet: Fleet,
        sources: tuple[DiscoveryConfig, ...],
        *,
        resolver: Resolver = resolve,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.fleet = fleet
        self.sources = sources
        self.resolver = resolver
        self.sleep = sleep
        self._owned: list[set[str]] = [set() for _ in sources]
        # Names this source is removing (their address left DNS), and names an
        # operator removed (the admin API, here or on a peer): those stay out
        # while their address stays in DNS, or a bad pod could not be evicted.
        self._removing: list[set[str]] = [set() for _ in sources]
        self._evicted: list[set[str]] = [set() for _ in sources]
        # Of those it is removing, the ones an operator had drained: -> whether
        # their streams were moving off. Back in DNS, they stay drained so.
        self._drained: dict[str, bool] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def refresh_all(self) -> None:
        for index in range(len(self.sources)):
            await self.refresh(index)

    async def refresh(self, index: int) -> Change | None:
        """Resolve source `index` once and apply the difference; None when the
        name did not resolve (nothing changes)."""
        source = self.sources[index]
        try:
            addresses = await self.resolver(source.dns, source.port)
        # ValueError: a name the resolver refuses before any lookup (UnicodeError,
        # from its IDNA encoding); the config check should have caught it already.
        except (OSError, ValueError) as exc:  # socket.gaierror included
            log.warning(
                "discovery: %s did not resolve (%s); keeping %d instances",
                source.dns,
                exc,
                len(self._owned[index]),
            )
            return None
        wanted = {source.instance(a).name: source.instance(a) for a in addresses}
        owned, mine, evicted = self._owned[index], self._removing[index], self._evicted[index]
        present, removing = set(self.fleet.cluster.instances), self.fleet.removing
        evicted |= {n for n in owned if (n not in present or n in removing) and n not in mine}
        evicted -= {n for n in owned if n in present and n not in removing}  # undrained
        evicted &= set(wanted)  # out of DNS: forgotten, and added again when back
        owned &= present  # removals that finished
        mine &= owned & removing
        # A configured instance at the same address is that engine already.
        configured = {s.url for n, s in self.fleet.cluster.instances.items() if n not in owned}
        wanted = {
            n: i
            for n, i in wanted.items()
            if n not in evicted and i.url.rstrip("/") not in configured
        }
        change = diff(owned, mine | evicted, wanted)
        for name in change.added:
            try:
                self.fleet.add(wanted[name])
            except FleetError as exc:  # a configured instance of that name
                log.warning("discovery: %s not added: %s", name, exc)
                continue
            owned.add(name)
        for name in change.restored:
            self.fleet.undrain(name)
            mine.discard(name)
            if name in self._drained:  # the operator's drain stays, as a reload's does
                self.fleet.drain(name, migrate=self._drained.pop(name))
        for name in change.removed:
            if self.fleet.cluster.instances[name].draining:
                self._drained[name] = name in self.fleet.migrator.evacuating
            else:  # (undrained since an earlier round noted it)
                self._drained.pop(name, None)
            self.fleet.remove(name, migrate=True)
            mine.add(name)
        for name in [n for n in self._drained if n not in present]:  # gone for good
            del self._drained[name]
        self.fleet.discovered = frozenset().union(*self._owned)
        if change.added or change.restored or change.removed:
            log.info(
                "discovery: %s: added %s, back %s, removing %s",
                source.dns,
                list(change.added),
                list(change.restored),
                list(change.removed),
            )
        return change

    def start(self) -> None:
        for index, source in enumerate(self.sources):
            task = asyncio.create_task(self._run(index), name=f"discovery-{source.dns}")
            self._tasks.append(task)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _run(self, index: int) -> None:
        while True:
            await self.sleep(self.sources[index].refresh_s)
            try:
                await self.refresh(index)
            except Exception:  # one bad round must not end discovery
                log.exception("discovery: %s: refresh failed", self.sources[index].dns)
