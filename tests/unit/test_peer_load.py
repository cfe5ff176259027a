"""The shared view's pure parts: a process's published record, the sum of its
peers' records, and a view that counts them (proxy/peer_load.py, proxy/cluster.py)."""

from __future__ import annotations

import json
import random

import pytest

from proxy.peer_load import (
    BadRecord,
    InstanceLoad,
    LoadChange,
    PeerLoads,
    ProcessRecord,
    decode,
    decode_change,
    encode,
    encode_change,
    fleet_print,
)
from proxy.policy import DispatchRequest, Priority, dispatch, make_policy
from proxy.policy.migration import RequestLoad
from tests.unit.test_cluster import make_cluster, snapshot


def record(process: str, seq: int = 0, **loads: InstanceLoad) -> ProcessRecord:
    return ProcessRecord(process, loads, seq=seq)


def test_a_record_reads_back_as_written_without_its_idle_instances() -> None:
    moving = RequestLoad(
        7,
        130,
        Priority.LOW,
        running=True,
        cached={"b": 64},
        silent_s=0.75,
        model="m",
        short_context=frozenset({"c"}),
    )
    written = ProcessRecord(
        "host:1:ab",
        {"a": InstanceLoad(12, 3, 1, 40, 2), "b": InstanceLoad()},
        {"a": (moving, RequestLoad(9, 20, Priority.NORMAL, running=False))},
        seq=31,
        fleet=fleet_print({"a": "http://h:1", "b": "http://h:2"}),
    )
    read = decode(encode(written))
    # A candidate with nothing to say of short contexts is sent as a Ferry before
    # them sent it: a peer not yet upgraded would refuse the record.
    assert [len(c) for c in json.loads(encode(written))["candidates"]["a"]] == [8, 7]
    assert read.process == "host:1:ab" and read.seq == 31 and read.fleet == written.fleet
    assert dict(read.instances) == {"a": InstanceLoad(12, 3, 1, 40, 2)}  # b: nothing in flight
    assert read.candidates["a"][0] == moving
    assert (
        read.candidates["a"][1].priority is Priority.NORMAL and not read.candidates["a"][1].running
    )


def test_the_fleet_print_tells_instance_tables_apart_in_any_order() -> None:
    same = fleet_print({"a": "http://h:1", "b": "http://h:2"})
    assert fleet_print({"b": "http://h:2", "a": "http://h:1"}) == same
    assert fleet_print({"a": "http://h:2", "b": "http://h:1"}) != same  # names swapped
    assert fleet_print({"a": "http://h:1"}) != same
    assert decode(encode(record("p"))).fleet == ""  # an older Ferry sends none


def test_the_peers_totals_sum_by_instance() -> None:
    peers = PeerLoads()
    peers.take_records(
        {
            "p1": record("p1", a=InstanceLoad(4, 1, 0, 16), b=InstanceLoad(8, 2, 1, 0)),
            "p2": record("p2", a=InstanceLoad(6, 2, 1, 0)),
        }
    )
    assert peers.totals() == {"a": InstanceLoad(10, 3, 1, 16), "b": InstanceLoad(8, 2, 1, 0)}
    peers.take_records({"p2": record("p2", a=InstanceLoad(6, 2, 1, 0))})  # p1's expired
    assert peers.totals() == {"a": InstanceLoad(6, 2, 1, 0)}


def test_a_change_counts_until_a_record_covers_it_and_never_twice() -> None:
    peers = PeerLoads()
    peers.take_records({"p1": record("p1", seq=10, a=InstanceLoad(4, 1, 0, 0))})
    # Two dispatches on a, announced after the record: the newest totals win.
    assert peers.take_change(LoadChange("p1", 12, {"a": InstanceLoad(12, 3, 0, 0)}))
    assert peers.totals() == {"a": InstanceLoad(12, 3, 0, 0)}
    # One announced earlier arrives late: it is older than what is known.
    assert not peers.take_change(LoadChange("p1", 11, {"a": InstanceLoad(8, 2, 0, 0)}))
    assert not peers.take_change(LoadChange("p1", 9, {"a": InstanceLoad(0, 0, 0, 0)}))
    assert peers.totals()["a"].inflight == 3
    # The next record covers the change (seq 12): the record's totals, once.
    peers.take_records({"p1": record("p1", seq=13, a=InstanceLoad(14, 3, 0, 0))})
    assert peers.totals() == {"a": InstanceLoad(14, 3, 0, 0)}
    # A change past the record goes on counting; the peer's death takes it away.
    peers.take_change(LoadChange("p1", 14, {"a": InstanceLoad(0, 0, 0, 0)}))
    assert peers.totals() == {"a": InstanceLoad(0, 0, 0, 0)}
    peers.take_change(LoadChange("p1", 15, {"b": InstanceLoad(5, 1, 0, 0)}))
    peers.take_records({})
    assert peers.totals() == {}
    # And a change of a process with no live record (dead, its record expired)
    # is not taken: nothing would ever age it out.
    assert not peers.take_change(LoadChange("p1", 16, {"a": InstanceLoad(6, 6, 0, 0)}))
    assert peers.totals() == {}


def test_a_change_reads_back_as_written() -> None:
    change = LoadChange("h:2:cd", 7, {"a": InstanceLoad(3, 1, 1, 16), "b": InstanceLoad()})
    assert decode_change(encode_change(change)) == change  # an idle instance too: it went to 0
    with pytest.raises(BadRecord, match="not a load change"):
        decode_change(json.dumps({"p": "x", "s": -1, "l": {}}))
    with pytest.raises(BadRecord, match="not a load change"):
        decode_change(b"[]")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{", "not JSON"),
        (json.dumps({"v": 2, "process": "p", "instances": {}}), "not a version 1 record"),
        (json.dumps({"v": 1, "instances": {}}), "process: must be a non-empty string"),
        (json.dumps({"v": 1, "process": "p", "instances": {"a": [1, 2, 3]}}), "5 counts"),
        (json.dumps({"v": 1, "process": "p", "instances": {"a": [1, -2, 0, 0]}}), "5 counts"),
        (json.dumps({"v": 1, "process": "p", "instances": {"a": [True, 1, 0, 0]}}), "5 counts"),
        (json.dumps({"v": 1, "process": "p", "instances": []}), "must be an object"),
        (json.dumps({"v": 1, "process": "p", "seq": -1}), "seq: must be a count"),
        # Past any count: 10**400 raised OverflowError in every view built with it.
        (
            '{"v": 1, "process": "p", "instances": {"a": [1%s, 1, 0, 0, 0]}}' % ("0" * 400),
            "5 counts",
        ),
        (
            json.dumps(
                {"v": 1, "process": "p", "candidates": {"a": [[1, 2, 1, True, {}, 10**400]]}}
            ),
            "silent_s must be seconds",
        ),
        (
            '{"v": 1, "process": "p", "candidates": {"a": [[1, 2, 1, true, {}, NaN]]}}',
            "silent_s must be seconds",
        ),
        (
            json.dumps({"v": 1, "process": "p", "candidates": {"a": [[1, 2, 9, True, {}]]}}),
            "is not a valid Priority",
        ),
        (
            json.dumps({"v": 1, "process": "p", "candidates": {"a": [[1, 2, 1, 1, {}]]}}),
            "must be counts",
        ),
        (
            json.dumps({"v": 1, "process": "p", "candidates": {"a": [[1, 2, 1, True, {}, -1]]}}),
            "silent_s must be seconds",
        ),
        (
            json.dumps({"v": 1, "process": "p", "candidates": {"a": [[1, 2, 1, True, {}, "1"]]}}),
            "silent_s must be seconds",
        ),
        (
            json.dumps({"v": 1, "process": "p", "candidates": {"a": [[1, 2, 1, True, {}, 0, 3]]}}),
            "model must be a name or null",
        ),
        (
            json.dumps(
                {"v": 1, "process": "p", "candidates": {"a": [[1, 2, 1, True, {}, 0, "m", [3]]]}}
            ),
            "short_context must list names",
        ),
        (
            json.dumps(
                {"v": 1, "process": "p", "candidates": {"a": [[1, 2, 1, True, {}, 0, "m", "c"]]}}
            ),
            "must be a list",
        ),
    ],
)
def test_a_malformed_record_is_refused_whole(text: str, why: str) -> None:
    with pytest.raises(BadRecord, match=why):
        decode(text)


def test_the_view_counts_the_peers_load_between_scrapes() -> None:
    cluster = make_cluster("a", "b")
    cluster.ledger.add("a", "m", Priority.NORMAL, 32, now=0.0)  # 2 blocks here
    cluster.set_peer_load({"a": InstanceLoad(20, 4, 0, 0)})  # a peer's 4 requests
    view = cluster.instance_view("a")
    assert (view.inflight, view.batch, view.virtual_blocks) == (5, 5, 22)
    assert view.freeness == (100 - 22) / 5
    assert cluster.local_load("a") == InstanceLoad(2, 1, 0, 32, 1)  # what this process publishes
    # So this process places its next request on b, which it has never used.
    chosen = dispatch(
        make_policy("llumnix"), DispatchRequest("m"), cluster.view(), random.Random(0)
    )
    assert chosen.name == "b"
    # The peer's load leaves the view as soon as its totals do (it died, or finished).
    cluster.set_peer_load({})
    assert cluster.instance_view("a").inflight == 1


def test_a_scrape_does_not_count_the_peers_requests_as_outside_traffic() -> None:
    cluster = make_cluster("a")
    cluster.set_peer_load({"a": InstanceLoad(30, 3, 0, 0)})
    cluster.record_scrape("a", snapshot(running=4, kv_usage=0.4), now=1.0)
    view = cluster.instance_view("a")
    # The engine's 40 blocks and 4 requests: 30 and 3 are the peer's, the rest bypassed Ferry.
    assert (view.virtual_blocks, view.batch, view.inflight) == (40, 4, 3)


def test_a_peer_s_waiting_requests_do_not_pass_for_preempted_ones() -> None:
    cluster = make_cluster("a")
    cluster.ledger.add("a", "m", Priority.NORMAL, 16, now=0.0)
    cluster.set_peer_load({"a": InstanceLoad(2, 2, 0, 32, 2)})  # a peer's 2, not started
    cluster.record_scrape("a", snapshot(running=0, waiting=3), now=1.0)
    assert cluster.instance_view("a").engine_preempted == 0
    cluster.record_scrape("a", snapshot(running=0, waiting=4), now=1.25)
    assert cluster.instance_view("a").engine_preempted == 1


def test_priority_headroom_is_reserved_once_however_many_processes_run_high() -> None:
    cluster = make_cluster("a", headroom=20)
    cluster.ledger.add("a", "m", Priority.HIGH, 16, now=0.0)
    cluster.set_peer_load({"a": InstanceLoad(1, 1, 1, 0)})  # a peer's high request too
    view = cluster.instance_view("a")
    assert view.virtual_blocks == 1 + 1 + 20
    assert view.freeness_high == (100 - 2) / 2


def test_a_record_from_a_peer_without_waiting_counts_reads_as_none_waiting() -> None:
    text = json.dumps({"v": 1, "process": "old", "instances": {"a": [4, 2, 0, 16]}})
    assert dict(decode(text).instances) == {"a": InstanceLoad(4, 2, 0, 16, 0)}
