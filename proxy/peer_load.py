"""What one Ferry process tells the others of its load, and the sum of theirs.

With a shared view (proxy/sharing.py) each process publishes a record every few
tens of ms: per instance, the totals of its own ledger, and, for instances that
shed load, the streams it could move (the rescheduler lease holder plans over
everyone's). A decision reads own ledger + the peers' totals + the scrape.

Between records, a process announces each change of its in-flight counts (a
dispatch, a release) within milliseconds as a `LoadChange`: the new totals of
the instances concerned. Records every 50 ms alone leave a burst invisible: four
processes taking 200 requests/s between them each miss the last 10 or so
placements of the others, and pile onto the instance that looked freest. Every
record and change carries the process's sequence number of its count changes,
so the newest totals win whichever arrives first (`PeerLoads`), and neither is
counted twice: both are absolute totals, never deltas.

The totals are the ledger's, not a view's: KV blocks of the requests in flight
(their virtual usage from dispatch on, queued prompts included), the request
count, the high-priority count, and the prompt tokens still waiting for a first
token. The priority headroom is applied once, to the merged count, where the
view is built (proxy/cluster.py): reserved per process, it would be reserved
once for every process that runs a high-priority request there.

Pure: text in, records out; no I/O, no clocks. A malformed record (another
version, a hand-edited key) is refused whole, so one bad peer never poisons the
view with half its numbers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from proxy.policy import Priority
from proxy.policy.migration import RequestLoad

VERSION = 1


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """One process's totals for one instance (or the sum over processes)."""

    blocks: int = 0  # KV blocks of its in-flight requests
    inflight: int = 0  # requests in flight
    high: int = 0  # high-priority requests among them
    queued_tokens: int = 0  # prompt tokens of those still waiting for their first token
    waiting: int = 0  # requests still waiting for their first token

    def __add__(self, other: InstanceLoad) -> InstanceLoad:
        return InstanceLoad(
            self.blocks + other.blocks,
            self.inflight + other.inflight,
            self.high + other.high,
            self.queued_tokens + other.queued_tokens,
            self.waiting + other.waiting,
        )

    @property
    def empty(self) -> bool:
        return self == NO_LOAD


NO_LOAD = InstanceLoad()
_NONE: Mapping[str, tuple[RequestLoad, ...]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ProcessRecord:
    """What `process` published: its totals by instance, and its movable streams
    on the instances that shed load (ids are its own, unique only within it)."""

    process: str
    instances: Mapping[str, InstanceLoad]
    candidates: Mapping[str, tuple[RequestLoad, ...]] = field(default_factory=lambda: _NONE)
    seq: int = 0  # the process's count changes so far, when the record was made
    fleet: str = ""  # its instance table's fingerprint (`fleet_print`); "": an older Ferry's


@dataclass(frozen=True, slots=True)
class LoadChange:
    """`process`'s totals of some instances after its count change number `seq`."""

    process: str
    seq: int
    instances: Mapping[str, InstanceLoad]


class BadRecord(ValueError):
    """A published record this version cannot read."""


def encode(record: ProcessRecord) -> str:
    """The record as compact JSON; instances with nothing in flight are left out."""
    loads = {
        name: [load.blocks, load.inflight, load.high, load.queued_tokens, load.waiting]
        for name, load in record.instances.items()
        if not load.empty
    }
    candidates = {
        name: [
            [
                r.id,
                r.tokens,
                int(r.priority),
                r.running,
                dict(r.cached),
                round(r.silent_s, 3),
                r.model,
                # Only where it says something: a peer that predates it refuses
                # a record whose candidates have more fields than it knows.
                *([sorted(r.short_context)] if r.short_context else []),
            ]
            for r in loads_
        ]
        for name, loads_ in record.candidates.items()
        if loads_
    }
    body: dict[str, Any] = {"v": VERSION, "process": record.process, "instances": loads}
    body["seq"] = record.seq
    if record.fleet:
        body["fleet"] = record.fleet
    if candidates:
        body["candidates"] = candidates
    return json.dumps(body, separators=(",", ":"))


def decode(text: str | bytes) -> ProcessRecord:
    """A record from its JSON; raises `BadRecord` saying what is wrong."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadRecord(f"not JSON: {exc}") from exc
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise BadRecord(f"not a version {VERSION} record")
    process = body.get("process")
    if not isinstance(process, str) or not process:
        raise BadRecord("process: must be a non-empty string")
    try:
        instances = {str(n): _load(v) for n, v in _dict(body.get("instances", {})).items()}
        candidates = {
            str(n): tuple(_request(r) for r in _list(v))
            for n, v in _dict(body.get("candidates", {})).items()
        }
        seq = body.get("seq", 0)
        if not _count(seq):
            raise ValueError(f"seq: must be a count (got {seq!r})")
        fleet = body.get("fleet", "")
        if not isinstance(fleet, str):
            raise ValueError(f"fleet: must be a string (got {fleet!r})")
    except (TypeError, ValueError) as exc:
        raise BadRecord(f"{process}: {exc}") from exc
    return ProcessRecord(process, instances, candidates, seq, fleet)


def fleet_print(urls: Mapping[str, str]) -> str:
    """A short fingerprint of an instance table (name -> URL): processes sharing a
    view must agree on which server each name is, or one's load and drains land
    on another's different server."""
    table = json.dumps(sorted(urls.items()), separators=(",", ":"))
    return hashlib.blake2b(table.encode(), digest_size=6).hexdigest()


def encode_change(change: LoadChange) -> str:
    loads = {
        n: [x.blocks, x.inflight, x.high, x.queued_tokens, x.waiting]
        for n, x in change.instances.items()
    }
    return json.dumps({"p": change.process, "s": change.seq, "l": loads}, separators=(",", ":"))


def decode_change(text: str | bytes) -> LoadChange:
    """A change from its JSON; raises `BadRecord` saying what is wrong."""
    try:
        body = json.loads(text)
        process, seq = body["p"], body["s"]
        if not isinstance(process, str) or not _count(seq):
            raise ValueError("p: must be a process name, s: a count")
        loads = {str(n): _load(v) for n, v in _dict(body["l"]).items()}
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise BadRecord(f"not a load change: {exc}") from exc
    return LoadChange(process, seq, loads)


class PeerLoads:
    """The newest totals known of each peer: its last record, overlaid with the
    changes it announced after that record (a higher `seq`)."""

    def __init__(self) -> None:
        self.records: dict[str, ProcessRecord] = {}
        self._changes: dict[str, dict[str, tuple[int, InstanceLoad]]] = {}

    def take_records(self, records: Mapping[str, ProcessRecord]) -> None:
        """This round's records, one per live peer: a peer without one is gone,
        its announced changes with it; changes a record already covers are dropped."""
        self.records = dict(records)
        for process in list(self._changes):
            record = records.get(process)
            if record is None:
                del self._changes[process]
                continue
            changes = self._changes[process]
            for name in [n for n, (seq, _) in changes.items() if seq <= record.seq]:
                del changes[name]

    def take_change(self, change: LoadChange) -> bool:
        """Whether the change is newer than what is known (and so counts now). A
        change from a process with no live record is not taken: it may be dead
        (its record expired), and nothing would ever age the change out."""
        record = self.records.get(change.process)
        if record is None or change.seq <= record.seq:
            return False
        known = self._changes.setdefault(change.process, {})
        newer = False
        for name, load in change.instances.items():
            if name not in known or known[name][0] < change.seq:
                known[name] = (change.seq, load)
                newer = True
        return newer

    def of(self, process: str) -> dict[str, InstanceLoad]:
        """One peer's totals by instance."""
        record = self.records.get(process)
        loads = dict(record.instances) if record is not None else {}
        for name, (_, load) in self._changes.get(process, {}).items():
            loads[name] = load
        return loads

    def totals(self) -> dict[str, InstanceLoad]:
        """Every peer's totals, summed by instance."""
        total: dict[str, InstanceLoad] = {}
        for process in self.records.keys() | self._changes.keys():
            for name, load in self.of(process).items():
                total[name] = total.get(name, NO_LOAD) + load
        return total


def _load(raw: Any) -> InstanceLoad:
    values = _list(raw)
    # 4 from a peer that predates `waiting` (its waiting requests then count as
    # preempted ones on the engine's queue until it is upgraded).
    if len(values) not in (4, 5) or not all(_count(v) for v in values):
        raise ValueError(f"an instance's totals must be 5 counts, 0 or more (got {raw!r})")
    return InstanceLoad(*values)


def _request(raw: Any) -> RequestLoad:
    values = _list(raw)
    if len(values) == 5:  # from a peer that predates silent_s
        values = [*values, 0.0]
    if len(values) == 6:  # from a peer that predates model (any instance serves it)
        values = [*values, None]
    if len(values) == 7:  # from a peer that predates short_context
        values = [*values, []]
    if len(values) != 8:
        raise ValueError(
            "a candidate must be [id, tokens, priority, running, cached, silent_s, model,"
            f" short_context] ({raw!r})"
        )
    ident, tokens, priority, running, cached, silent_s, model, short = values
    if not (_count(ident) and _count(tokens) and isinstance(running, bool)):
        raise ValueError(f"a candidate's id and tokens must be counts ({raw!r})")
    if not (
        isinstance(silent_s, int | float)
        and not isinstance(silent_s, bool)
        and 0 <= silent_s <= _MAX_COUNT  # (no NaN, no infinity, no 10**400)
    ):
        raise ValueError(f"a candidate's silent_s must be seconds, 0 or more ({raw!r})")
    if not all(isinstance(k, str) and _count(v) for k, v in _dict(cached).items()):
        raise ValueError(f"a candidate's cached tokens must map names to counts ({raw!r})")
    if not (model is None or isinstance(model, str)):
        raise ValueError(f"a candidate's model must be a name or null ({raw!r})")
    if not all(isinstance(name, str) for name in _list(short)):
        raise ValueError(f"a candidate's short_context must list names ({raw!r})")
    return RequestLoad(
        ident,
        tokens,
        Priority(priority),
        running,
        cached=dict(cached),
        silent_s=float(silent_s),
        model=model,
        short_context=frozenset(short),
    )


# Past any real count, and below where float arithmetic loses integers: one
# peer's 10**400 would raise OverflowError in every view built with it.
_MAX_COUNT = 2**53


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"must be a list (got {type(value).__name__})")
    return value


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"must be an object (got {type(value).__name__})")
    return value
