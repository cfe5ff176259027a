"""Outlier ejection, as Envoy's outlier detection does it: an instance whose calls
fail `after_failures` times in a row (connect failure, upstream 5xx, a stream
broken mid-way) takes no new traffic for a backoff that doubles with each
ejection in a row, up to `max_s`. Its first success after a quiet `max_s`
forgets the past ejections. A client's own 4xx never counts, and the last
instance serving a model is never ejected (proxy/cluster.py).

Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EjectionSettings:
    after_failures: int = 5  # 0: never eject
    base_s: float = 5.0
    max_s: float = 300.0


@dataclass(slots=True)
class Ejection:
    """One instance's record."""

    failures: int = 0  # consecutive failed calls
    times: int = 0  # ejections in a row: the next backoff is base * 2**times
    until: float = 0.0  # monotonic seconds; ejected while now < until

    def ejected(self, now: float) -> bool:
        return now < self.until

    def failure(self, now: float, settings: EjectionSettings, may_eject: bool = True) -> bool:
        """Count a failed call; True when it ejects the instance now (never
        without `may_eject`: the count goes on, and a later failure ejects it)."""
        self.failures += 1
        if not settings.after_failures or self.failures < settings.after_failures:
            return False
        if not may_eject:
            return False
        if self.ejected(now):
            return False  # calls that started before the ejection
        backoff = min(settings.max_s, settings.base_s * 2**self.times)
        self.until, self.times, self.failures = now + backoff, self.times + 1, 0
        return True

    def success(self, now: float, settings: EjectionSettings) -> None:
        self.failures = 0
        if self.times and now >= self.until + settings.max_s:
            self.times = 0
