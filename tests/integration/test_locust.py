"""loadtest/locustfile.py, headless, replaying a small trace through Ferry to two stand-ins."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.standin_server import StandIn
from loadtest.trace import TraceSpec, generate, write
from tests.helpers import Ferry, Site

ROOT = Path(__file__).resolve().parents[2]


def test_locust_replays_trace_and_reports_ttft_itl(
    standins: Callable[..., list[tuple[StandIn, Site]]],
    ferry: Callable[..., Ferry],
    tmp_path: Path,
) -> None:
    servers = standins(2, itl_s=0.005)
    proxy = ferry([site.url for _, site in servers])
    trace = tmp_path / "trace.jsonl"
    spec = TraceSpec(requests=30, rate=20, seed=1, input_mean=20, output_mean=10, max_len=64)
    write(trace, generate(spec))

    env = {**os.environ, "FERRY_TRACE": str(trace), "FERRY_MODEL": "standin"}
    command = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless"]
    command += ["-u", "10", "-r", "10", "-t", "4s", "--host", proxy.url]
    command += ["--csv", str(tmp_path / "out"), "--only-summary"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

    with open(tmp_path / "out_stats.csv", newline="") as f:
        rows: dict[str, dict[str, Any]] = {row["Type"]: row for row in csv.DictReader(f)}
    assert int(rows["TTFT"]["Request Count"]) > 0, rows
    assert int(rows["ITL"]["Request Count"]) > 0, rows
    assert int(rows["POST"]["Request Count"]) > 0, rows
    assert int(rows["POST"]["Failure Count"]) == 0, done.stdout + done.stderr
    assert sum(standin.served for standin, _ in servers) > 0
