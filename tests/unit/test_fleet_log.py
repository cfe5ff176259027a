"""The fleet log's compaction (proxy/fleet.py `compact`): an instance's changes
in their shortest form leave it as all of them, in order, would."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from proxy.fleet import compact, op_instance
from proxy.sharing import _merged, _refused_add

NAME = "i0"


def apply(ops: list[dict[str, Any]]) -> dict[str, Any]:
    """What the changes leave of one instance, as Fleet applies them: an add or a
    remove starts it over, a patch overrides keys, drain and undrain set a flag;
    a reload (`file`) makes it what the file says, where a drain is not the file's."""
    state: dict[str, Any] = {"present": None, "config": {}, "draining": None}
    for op in ops:
        kind = op["op"]
        if kind == "add":
            state = {"present": True, "config": dict(op["instance"]), "draining": False}
        elif kind == "remove":
            state = {"present": False, "config": {}, "draining": None}
        elif kind == "patch":
            state["config"] = {**state["config"], **op["changes"]}
        elif kind == "file":
            draining = op["draining"] if op["listed"] else None
            state = {"present": "file", "config": {}, "draining": draining}
        else:
            state["draining"] = kind == "drain"
    return state


changes = st.dictionaries(st.sampled_from(["migration", "labels", "api_key"]), st.integers(0, 3))
# The admin API's changes, and a reload's (`file`), made in the process that reloads.
admin_ops = st.one_of(
    st.builds(lambda url: {"op": "add", "instance": {"name": NAME, "url": url}}, st.integers(0, 3)),
    st.builds(lambda m: {"op": "remove", "name": NAME, "migrate": m}, st.booleans()),
    st.builds(lambda c: {"op": "patch", "name": NAME, "changes": c}, changes),
    st.builds(lambda m: {"op": "drain", "name": NAME, "migrate": m}, st.booleans()),
    st.just({"op": "undrain", "name": NAME}),
)
ops = st.one_of(
    admin_ops,
    st.builds(
        lambda listed, draining: {
            "op": "file",
            "name": NAME,
            "listed": listed,
            "draining": listed and draining,
        },
        st.booleans(),
        st.booleans(),
    ),  # fmt: skip
)


@given(st.lists(ops, max_size=30))
def test_the_compacted_changes_leave_the_instance_as_all_of_them(history: list[Any]) -> None:
    kept: list[dict[str, Any]] = []
    for n, op in enumerate(history):
        kept = compact(kept, {"origin": f"p{n % 3}", "op": op})
    assert len(kept) <= 4  # a remove and an add, one patch, one drain or undrain
    assert apply([e["op"] for e in kept]) == apply(history)


def test_patches_merge_with_the_later_winning() -> None:
    first = {"origin": "a", "op": {"op": "patch", "name": NAME, "changes": {"migration": "lite"}}}
    later = {"origin": "b", "op": {"op": "patch", "name": NAME, "changes": {"migration": "full"}}}
    labels = {"origin": "a", "op": {"op": "patch", "name": NAME, "changes": {"labels": {"z": 1}}}}
    [merged] = compact(compact([first], later), labels)
    assert merged["op"]["changes"] == {"migration": "full", "labels": {"z": 1}}
    assert merged["origin"] == "a"  # the last to change it


def test_the_instance_an_op_is_about() -> None:
    assert op_instance({"op": "drain", "name": "x", "migrate": True}) == "x"
    assert op_instance({"op": "add", "instance": {"name": "y", "url": "http://h"}}) == "y"
    assert op_instance({"op": "add", "instance": "not a mapping"}) is None
    assert op_instance("junk") is None


@given(st.lists(st.tuples(ops, st.booleans()), max_size=30))
@example(  # a key patched before an add the stale account missed (once applied after it)
    [
        ({"op": "patch", "name": NAME, "changes": {"migration": 0}}, True),
        ({"op": "add", "instance": {"name": NAME, "url": 0}}, False),
        ({"op": "patch", "name": NAME, "changes": {}}, True),
    ]
)
def test_a_stale_account_merged_with_a_full_one_leaves_the_instance_as_all_changes(
    made: list[tuple[dict[str, Any], bool]],
) -> None:
    """After Redis loses its data each process writes back its own compacted
    account (proxy/sharing.py `_merged`); one process may have missed some
    changes. Merged in the order they were made, in either order of writing,
    the accounts leave the instance as every change would."""
    full: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for n, (op, seen) in enumerate(made):
        entry = {"origin": f"p{n % 3}", "op": op, "at": float(n)}
        full = compact(full, entry)
        if seen:
            stale = compact(stale, entry)
    everything = apply([op for op, _ in made])
    assert apply([e["op"] for e in _merged(stale, full)]) == everything
    assert apply([e["op"] for e in _merged(full, stale)]) == everything


def test_a_merged_patch_without_a_time_for_a_key_takes_its_own() -> None:
    """A Ferry before per-key times wrote merged patches with none, or with the
    newest change's record only: each key missing a time has the patch's, so
    it is not put before an add it came after (and dropped)."""
    add = {"origin": "a", "op": {"op": "add", "instance": {"name": NAME, "url": "u"}}, "at": 1.0}
    old = {
        "origin": "a",
        "op": {"op": "patch", "name": NAME, "changes": {"migration": "lite", "labels": 2}},
    }
    old |= {"at": 2.0, "changed_at": {"labels": 2.0}}  # migration's time not recorded
    merged = _merged([add, old], [add])
    assert apply([e["op"] for e in merged])["config"] == {
        "name": NAME,
        "url": "u",
        "migration": "lite",
        "labels": 2,
    }


FILE = {"present": True, "config": {"name": NAME, "url": "file"}, "draining": False}
ABSENT = {"present": False, "config": {}, "draining": None}


def applied_here(ops: list[dict[str, Any]], start: dict[str, Any]) -> dict[str, Any]:
    """What the changes leave of the instance in a process that starts with
    `start` (the file names it, or not), as Fleet applies them: an add of a
    name there is refused, a change to one not there too."""
    state = dict(start)
    for op in ops:
        kind = op["op"]
        if kind == "add":
            if not state["present"]:
                state = {"present": True, "config": dict(op["instance"]), "draining": False}
        elif kind == "remove":
            state = dict(ABSENT)
        elif not state["present"]:
            continue
        elif kind == "patch":
            state["config"] = {**state["config"], **op["changes"]}
        else:
            state["draining"] = kind == "drain"
    return state


def made(history: list[dict[str, Any]], start: dict[str, Any]) -> list[dict[str, Any]]:
    """The ops of `history` their makers could make, in log order (an add of a
    name they have, or a change to one they lack, is refused where it is made)."""
    logged: list[dict[str, Any]] = []
    for op in history:
        present = applied_here(logged, start)["present"]
        if op["op"] != "remove" and (op["op"] == "add") == present:
            continue
        logged.append(op)
    return logged


@given(st.sampled_from([FILE, ABSENT]), st.lists(st.tuples(admin_ops, st.booleans()), max_size=20))
@example(FILE, [({"op": "remove", "name": NAME, "migrate": True}, True), (
    {"op": "add", "instance": {"name": NAME, "url": 1}}, True)])  # fmt: skip
def test_a_process_started_later_from_its_file_ends_as_the_log_leaves_it(
    start: dict[str, Any], history: list[tuple[dict[str, Any], bool]]
) -> None:
    """Its file names the instance (or not), as the processes' that made the
    changes did: the compacted changes, and those merged with an account that
    missed some (Redis lost its data), leave it as every change in order would.
    The add alone after a remove left the file's server in place (refused: the
    name was taken)."""
    logged = made([op for op, _ in history], start)
    seen = {id(op) for op, kept in history if kept}
    full: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for n, op in enumerate(logged):
        if _refused_add(op, full):  # as `Sharing._record` leaves it out
            continue
        entry = {"origin": f"p{n % 3}", "op": op, "at": float(n)}
        full = compact(full, entry)
        if id(op) in seen:
            stale = compact(stale, entry)
    want = applied_here(logged, start)
    assert applied_here([e["op"] for e in full], start) == want
    for merged in (_merged(stale, full), _merged(full, stale)):
        assert applied_here([e["op"] for e in merged], start) == want
