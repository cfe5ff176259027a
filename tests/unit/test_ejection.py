"""Outlier ejection (proxy/ejection.py): pure, time passed in."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.ejection import Ejection, EjectionSettings

SETTINGS = EjectionSettings(after_failures=3, base_s=5.0, max_s=40.0)


def fail(record: Ejection, now: float, times: int) -> list[bool]:
    return [record.failure(now, SETTINGS) for _ in range(times)]


def test_the_nth_failure_in_a_row_ejects_and_a_success_resets_the_count() -> None:
    record = Ejection()
    assert fail(record, 0.0, 2) == [False, False]
    record.success(0.0, SETTINGS)
    assert fail(record, 0.0, 3) == [False, False, True]
    assert record.ejected(4.9) and not record.ejected(5.0)


def test_the_backoff_doubles_up_to_the_cap_and_a_quiet_success_forgets() -> None:
    record, now, backoffs = Ejection(), 0.0, []
    for _ in range(5):
        fail(record, now, 3)
        backoffs.append(record.until - now)
        now = record.until  # back in, and failing again at once
    assert backoffs == [5.0, 10.0, 20.0, 40.0, 40.0]
    record.success(now + 39.0, SETTINGS)  # not quiet long enough
    assert record.times == 5
    record.success(now + 40.0, SETTINGS)
    fail(record, now + 41.0, 3)
    assert record.until == now + 41.0 + 5.0


def test_failures_of_calls_sent_before_the_ejection_do_not_extend_it() -> None:
    record = Ejection()
    fail(record, 0.0, 3)
    assert fail(record, 1.0, 6) == [False] * 6 and record.until == 5.0


def test_zero_never_ejects() -> None:
    record = Ejection()
    assert not any(record.failure(0.0, EjectionSettings(after_failures=0)) for _ in range(100))


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 100)), max_size=60))
def test_an_ejection_never_lasts_longer_than_the_cap(events: list[tuple[bool, float]]) -> None:
    record, now = Ejection(), 0.0
    for failed, step in events:
        now += step
        if failed:
            record.failure(now, SETTINGS)
        else:
            record.success(now, SETTINGS)
        assert record.until - now <= SETTINGS.max_s
