"""Ferry as its own process, for the demo and the benchmarks: how to start it and
when it is up."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request


def ferry_command(*args: str) -> list[str]:
    """`ferry ARGS...` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "proxy.cli", *args]


def wait_healthy(
    url: str,
    process: subprocess.Popen[bytes] | None = None,
    timeout_s: float = 60,
    path: str = "/health",
) -> None:
    """Wait until Ferry at `url` answers `path` with a 2xx (/health: it is up;
    /readyz: an instance can take traffic); fail early if `process` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"ferry exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + path, timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"ferry at {url} did not become healthy in {timeout_s:g}s")
