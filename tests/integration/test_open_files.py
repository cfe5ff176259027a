"""Ferry and its file descriptors, with `ferry serve` as a real process under a
real limit (util-linux's `prlimit`) in front of a stand-in server (not vLLM).

Each stream holds two descriptors, so Ferry raises its soft limit at start; where
the hard limit stops it and they run out, that is Ferry's shortage: the requests
it cannot place get a 503 saying so, and the instance is not blamed for it."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from proxy.server import OPEN_FILES_WANTED
from tests.helpers import call_json, debian_tool, ferry_process, wait_until

LIMIT = 64  # descriptors for a Ferry that cannot raise them


def _soft_open_files(pid: int) -> int:
    limits = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"^Max open files\s+(\d+)\s+(\d+)", limits, re.MULTILINE)
    assert found, limits
    return int(found.group(1))


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _stop(proc: subprocess.Popen[bytes]) -> str:
    proc.kill()
    _, err = proc.communicate(timeout=10)
    return err.decode()


def test_ferry_raises_its_soft_open_files_limit(standins: Any, tmp_path: Path) -> None:
    [(_, site)] = standins(1)
    prlimit = debian_tool("prlimit", "util-linux")
    hard = int(subprocess.check_output([prlimit, "--nofile", "--raw", "--noheadings",
                                        "--output=HARD", "--pid", str(os.getpid())]))  # fmt: skip
    config = {"instances": [{"name": "a", "url": site.url}]}
    proc, _ = ferry_process(
        config, tmp_path / "ferry.yaml", stderr=subprocess.PIPE, launcher=(prlimit, "--nofile=256:")
    )
    try:
        assert _soft_open_files(proc.pid) == min(OPEN_FILES_WANTED, hard)
    finally:
        log = _stop(proc)
    assert f"{min(OPEN_FILES_WANTED, hard)} open files" in log


def test_running_out_of_files_is_ferrys_503_and_not_the_instances_fault(
    standins: Any, tmp_path: Path
) -> None:
    [(_, site)] = standins(1, itl_s=0.05)
    prlimit = debian_tool("prlimit", "util-linux")
    config = {
        "instances": [{"name": "a", "url": site.url}],
        "scheduler": {"scrape_interval_s": 0.1},
        "admin_token": "t",
    }
    proc, url = ferry_process(
        config,
        tmp_path / "ferry.yaml",
        stderr=subprocess.PIPE,
        launcher=(prlimit, f"--nofile={LIMIT}:{LIMIT}"),
    )
    port = int(url.rsplit(":", 1)[1])
    held: list[http.client.HTTPConnection] = []
    try:
        assert _soft_open_files(proc.pid) == LIMIT  # it could not raise it
        # Connections Ferry accepts until it has no descriptor left (a few more
        # wait in the listen backlog and take any that frees up).
        for _ in range(LIMIT - _open_files(proc.pid) + 4):
            held.append(http.client.HTTPConnection("127.0.0.1", port, timeout=10))
            held[-1].connect()
        wait_until(lambda: _open_files(proc.pid) >= LIMIT)

        def stream(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
            body = {"model": "standin", "prompt": "x", "max_tokens": 20, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            answer = conn.getresponse()
            return answer.status, answer.read()

        # At once, so that most need a connection of their own to the instance.
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(stream, held[:6]))
    finally:
        for conn in held:
            conn.close()
    try:
        refused = [body for code, body in answers if code == 503]
        assert refused, answers
        for body in refused:
            error = json.loads(body)["error"]
            assert error["code"] == "ferry_overloaded", error
            assert "out of file descriptors" in error["message"]
        assert all(b"data: [DONE]" in body for code, body in answers if code == 200)
        # Its descriptors back, Ferry serves again, and the instance was never blamed.
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        wait_until(lambda: _open_files(proc.pid) < LIMIT - 8)
        assert client.completions.create(model="standin", prompt="x", max_tokens=3).choices
        code, rows = call_json(url + "/admin/instances", headers={"Authorization": "Bearer t"})
        assert code == 200, rows
        [row] = rows
        assert row["healthy"] and row["call_failures"] == 0 and row["last_error"] is None, row
        with urllib.request.urlopen(url + "/metrics", timeout=5) as page:
            metrics = page.read().decode()
        counted = f'ferry_requests_total{{instance="a",outcome="out_of_files"}} {len(refused)}.0'
        assert counted in metrics
    finally:
        log = _stop(proc)
    assert log.count("out of file descriptors, answering 503") == 1, log  # not one per call
