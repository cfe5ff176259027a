"""Whether the running task has been asked to stop."""

from __future__ import annotations

import asyncio


def cancelling() -> bool:
    """Whether the running task is being cancelled, even if the CancelledError
    that carried the request was swallowed on the way (redis-py can do that).
    Python 3.11+ can tell; on 3.10 this is always False."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())
