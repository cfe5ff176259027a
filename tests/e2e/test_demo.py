"""`make demo`'s logic in its short mode, on the session's real vLLM servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.demo import SHORT, demo
from loadtest.vllm_servers import VLLMServer
from tests.helpers import free_port


def test_the_demo_compares_both_policies_and_its_drain_loses_nothing(
    vllm_pair: list[VLLMServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs, png = demo([s.url for s in vllm_pair], SHORT, tmp_path, free_port())
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split() == ["round_robin", "llumnix"])
    assert header.startswith(" ")  # the table's header row, over the two columns
    labels = ("P50 TTFT (ms)", "P99 TTFT (ms)", "P99 worst stall (ms)", "preemptions")
    for label in (*labels, "drain took (ms)"):
        row = next(line for line in out.splitlines() if line.startswith(label))
        numbers = row[len(label) :].split()[:2]
        assert all(n.isdigit() for n in numbers), row
    for run in runs:
        assert len(run.streams) == SHORT.requests and run.complete == SHORT.requests
    assert all(run.drain["took_s"] > 0 for run in runs)  # both runs drained
    # round_robin runs without migration: its drain waited, nothing rebalanced.
    assert runs[0].drain["moved"] == 0 and runs[0].drain["rebalanced"] == 0
    drain = runs[1].drain
    assert drain["inflight"] >= 1 and drain["moved"] >= 1
    assert f"{SHORT.requests}/{SHORT.requests} streams of this run finished" in out
    assert png.exists() and png.stat().st_size > 10_000
