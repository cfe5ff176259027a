"""The ledger's running totals under any sequence of calls (hypothesis)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.ledger import Ledger, LedgerEntry
from proxy.policy import Priority

# One step: ("add", prompt tokens, cached tokens, watched), ("token", which),
# ("prompt", which, tokens), ("release", which), ("look", engine waiting,
# in order, how many of the entries so far it speaks for).
STEPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 300), st.integers(0, 100), st.booleans()),
    st.tuples(st.just("token"), st.integers(0, 50)),
    st.tuples(st.just("prompt"), st.integers(0, 50), st.integers(0, 300)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("look"), st.integers(0, 6), st.booleans(), st.integers(0, 50)),
)


@settings(max_examples=300)
@given(st.lists(STEPS, max_size=60))
@example([("add", 10, 0, False), ("add", 10, 0, False), ("look", 1, True, 1)])
def test_queued_prefill_and_waiting_are_the_live_unstarted_entries(steps: list[tuple]) -> None:
    ledger = Ledger()
    entries: list[LedgerEntry] = []
    live: set[int] = set()
    for step in steps:
        kind = step[0]
        if kind == "add":
            _, prompt, cached, watched = step
            entry = ledger.add("a", "m", Priority.NORMAL, prompt, 0.0, cached, watched)
            entries.append(entry)
            live.add(entry.id)
        elif not entries:
            continue
        elif kind == "token":
            ledger.add_generated(entries[step[1] % len(entries)], 1)
        elif kind == "prompt":
            ledger.set_prompt_tokens(entries[step[1] % len(entries)], step[2])
        elif kind == "release":
            entry = entries[step[1] % len(entries)]
            ledger.release(entry)
            live.discard(entry.id)
        else:
            _, waiting, in_order, upto = step
            reached_id = entries[upto % len(entries)].id
            before = {e.id: e.started for e in entries}
            ledger.settle_unwatched("a", waiting, reached_id, in_order)
            settled = [e for e in entries if e.started and not before[e.id]]
            # Only unwatched entries the look speaks for, and only as many as
            # the engine's queue leaves (none where it may run out of order).
            assert all(not e.watched and e.id <= reached_id for e in settled)
            pending = [
                e
                for e in entries
                if e.id in live
                and not before[e.id]
                and e.id <= reached_id
                and e.prompt_tokens > e.cached_tokens
            ]
            assert len(settled) <= max(0, len(pending) - waiting)
            if not in_order and waiting:
                assert not settled
        unstarted = [e for e in entries if e.id in live and not e.started]
        expected = sum(max(0, e.prompt_tokens - e.cached_tokens) for e in unstarted)
        assert ledger.queued_tokens("a") == expected
        assert ledger.waiting("a") == len(unstarted)
        assert ledger.count("a") == len(live)
