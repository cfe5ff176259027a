"""How a background loop logs what it did not foresee (proxy/faults.py)."""

from __future__ import annotations

import logging

import pytest

from proxy import faults
from proxy.faults import Faults


def fail(fault: Faults, exc: Exception) -> None:
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001 - the loop's own catch-all
        fault.failed(caught)


def test_once_per_cause_again_after_a_good_round_or_a_while(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = Faults(logging.getLogger("test.faults"), "a round")
    now = [1000.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="test.faults"):
        for _ in range(5):
            fail(fault, KeyError("gone"))
        assert caplog.text.count("a round failed") == 1  # not every round
        assert "(1 in a row)" in caplog.text and "Traceback" in caplog.text
        fail(fault, ValueError("other"))  # another cause: said
        assert caplog.text.count("a round failed") == 2
        now[0] += faults.REPEAT_S
        fail(fault, ValueError("other"))  # still failing a minute on: said again
        assert "(7 in a row)" in caplog.text
        fault.ok()
        fail(fault, ValueError("other"))  # after a good round: a new episode
        assert caplog.text.count("a round failed") == 4
        assert caplog.records[-1].args == ("a round", 1)
