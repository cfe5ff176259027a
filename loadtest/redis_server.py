"""A throwaway `redis-server` (Debian's package; `make setup` installs it) for
tests and benchmarks: on 127.0.0.1, no persistence, stopped by its caller."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def start_redis(port: int, workdir: Path, timeout_s: float = 10.0) -> subprocess.Popen[bytes]:
    """Start redis-server on 127.0.0.1:`port` and wait until it answers PING."""
    binary = redis_binary()
    if binary is None:
        raise FileNotFoundError(
            "redis-server is not installed (Debian: apt-get install redis-server)"
        )
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
        + ["--dir", str(workdir), "--protected-mode", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not start on port {port}")
        time.sleep(0.05)
