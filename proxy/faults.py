"""How a background loop reports a failure it did not foresee.

A loop that must outlive any one round (sharing, KV events, the rescheduler,
drains) catches what it did not expect, loses that round, and goes on. The
failure is logged with its traceback once per cause, and again at most every
REPEAT_S while it lasts, not every round; a round that succeeds ends it.
"""

from __future__ import annotations

import logging
import time

REPEAT_S = 60.0


class Faults:
    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log, self.what = log, what
        self.count = 0  # failed rounds since the last good one
        self._cause = ""
        self._logged_at = -REPEAT_S

    def failed(self, exc: BaseException) -> None:
        """Call from the `except` block, so the traceback is the one logged."""
        self.count += 1
        now = time.monotonic()
        cause = f"{type(exc).__name__}: {exc}"
        if cause != self._cause or now - self._logged_at >= REPEAT_S:
            self._cause, self._logged_at = cause, now
            self.log.exception("%s failed (%d in a row); the next one runs", self.what, self.count)

    def ok(self) -> None:
        self.count, self._cause = 0, ""
