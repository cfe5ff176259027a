"""`ferry`'s commands answer a mistake in one line and an exit code, not a traceback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["init", "/nonexistent/dir/ferry.yaml"], 1, "No such file or directory"),
        (["sim", "--trace", "/nonexistent.jsonl", "--instances", "2", "--policy", "llumnix"],
         1, "No such file or directory"),
        (["serve", "--backend", "http://127.0.0.1:1", "--port", "99999"], 2, "--port: must be"),
        (["serve", "--backend", "http://[::1"], 2, "instances[0].url: must be"),
        (["serve", "--backend", "http://127.0.0.1:1", "--redis", "redis://h:99999"], 2,
         "--redis: not a URL"),
        (["serve", "--backend", "http://127.0.0.1:1", "--admin-token", "t\u00f6k"], 2,
         "--admin-token: must be a key"),
        (["serve", "--backend", "http://127.0.0.1:1", "--host", "ferry..internal"], 2,
         "--host: 'ferry..internal' has an empty label"),
        (["serve", "--backend", "http://127.0.0.1:1", "--host", "a" * 64], 2,
         "is 64 characters (at most 63)"),
    ],
)  # fmt: skip
def test_a_mistake_is_one_line(
    argv: list[str], code: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(argv))
    assert exited.value.code == code
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_sim_refuses_a_file_that_is_no_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "ferry.yaml"
    trace.write_text("instances: []\n")
    argv = ["sim", "--trace", str(trace), "--instances", "2", "--policy", "llumnix"]
    assert main(argv) == 2
    assert "not a trace request" in capsys.readouterr().err


def test_sim_refuses_a_scaling_tick_it_could_not_get_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every 1e-9 s was a billion events a simulated second: a hang."""
    trace = tmp_path / "t.jsonl"
    assert (
        main(["trace", "--out", str(trace), "--requests", "5", "--rate", "5", "--seed", "1"]) == 0
    )
    argv = ["sim", "--trace", str(trace), "--instances", "2", "--policy", "llumnix"]
    assert main([*argv, "--autoscale", "--scale-interval", "1e-9"]) == 2
    assert "--scale-interval must be 0.01 s or more" in capsys.readouterr().err


def test_an_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--backend", "http://127.0.0.1:1", "--log-level", "loud"])
    assert exited.value.code == 2 and "--log-level" in capsys.readouterr().err


def test_sim_on_no_instances_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["sim", "--trace", "t.jsonl", "--instances", "0", "--policy", "llumnix"])
    assert exited.value.code == 2
    assert "--instances: must be at least 1 (got 0)" in capsys.readouterr().err


@pytest.mark.parametrize("redis_ok", [True, False])
def test_a_drain_is_not_done_while_the_other_processes_cannot_be_counted(
    redis_ok: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 in flight, as a process that lost Redis counts it, is its own streams only."""
    answers = {
        "/admin/instances/a/drain?migrate=true": {"inflight": 0, "migrating": 0},
        "/admin/instances": [{"name": "a", "inflight": 0}],
        "/admin/sharing": {"enabled": True, "redis_ok": redis_ok},
    }
    monkeypatch.setattr("proxy.cli._admin", lambda args, path, *rest: answers[path])
    code = main(["drain", "a", "--url", "http://127.0.0.1:1", "--timeout", "0.2"])
    out = capsys.readouterr().out
    if redis_ok:
        assert code == 0 and "a: done" in out
    else:
        assert code == 1 and "cannot be counted (Redis unreachable)" in out


@pytest.fixture
def answering() -> Iterator[Any]:
    """`answering(reply)`: the URL of a port that answers every request `reply`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(reply: bytes) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    def start(reply: bytes) -> str:
        threading.Thread(target=serve, args=(reply,), daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield start
    listener.close()


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        # A TLS alert: what a TLS port answers a plain HTTP request.
        (b"\x15\x03\x01\x00\x02\x02\x46", "no complete HTTP answer (BadStatusLine("),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n[{", "IncompleteRead(2 bytes read"),
        (b"HTTP/1.1 503 Unavailable\r\nContent-Length: 500\r\n\r\n{", "HTTP 503: (the answer"),
    ],
    ids=["tls-port", "cut-200", "cut-error"],
)
def test_an_answer_that_is_not_http_or_cut_short_is_one_line(
    reply: bytes, says: str, answering: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["status", "--url", answering(reply)])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1, err


def test_a_redirect_is_not_followed_with_the_admin_token(
    answering: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Followed, a redirect would carry the token to wherever it points, and
    print that place's answer as this call's (`ferry reload` said done)."""
    with socket.socket() as closed:  # a port nothing listens on: where it would go
        closed.bind(("127.0.0.1", 0))
        elsewhere = f"http://127.0.0.1:{closed.getsockname()[1]}/steal"
    redirect = b"HTTP/1.1 302 Found\r\nLocation: %b\r\nContent-Length: 0\r\n\r\n"
    url = answering(redirect % elsewhere.encode())
    with pytest.raises(SystemExit) as exited:
        main(["reload", "--url", url, "--admin-token", "s3cret"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "HTTP 302" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("command", [["drain", "a"], ["remove", "a"]])
@pytest.mark.parametrize("timeout", ["nan", "-1", "0", "inf", "soon"])
def test_a_wait_that_is_no_time_is_refused(
    command: list[str], timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`nan` never timed out and -1 gave up at once, unsaid."""
    with pytest.raises(SystemExit) as exited:
        main([*command, "--timeout", timeout])
    assert exited.value.code == 2
    assert "--timeout: must be a positive number of seconds" in capsys.readouterr().err


def _json_reply(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
        len(body),
        body,
    )


@pytest.mark.parametrize(
    "command",
    [["status"], ["drain", "a"], ["undrain", "a"], ["add", "a", "http://x:1"], ["remove", "a"]],
)
@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b"null",
        b'["a"]',
        b'[{"name": "a"}]',
        b'[{"name": 1, "url": 2, "healthy": 1, "draining": 0,'
        b' "inflight": "x", "freeness": "y", "snapshot": 3}]',
    ],
)
def test_json_that_is_not_ferrys_answer_is_one_line(
    command: list[str], body: bytes, answering: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another server on the port (or another version of Ferry) answers JSON of
    another shape: one line saying so, not a traceback."""
    url = answering(_json_reply(body))
    assert main([*command, "--url", url]) == 1
    err = capsys.readouterr().err
    assert "answered what Ferry's admin API does not" in err and len(err.splitlines()) == 1, err


def test_a_url_no_request_can_carry_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["status", "--url", "not a url"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "unknown url type" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("lists", "code", "says"),
    [
        # Taken back (a reload still lists it): waiting on would be in vain.
        ([(1, True), (0, False)], 1, "a: the removal was called off (an undrain, or a reload"
         " that keeps it): it is still there, with 0 in flight"),
        # A peer process asked first has not heard of the removal yet: no call-off.
        ([(1, False), (1, True), (0, True), None], 0, "a: done"),
    ],
)  # fmt: skip
def test_a_removal_called_off_ends_the_wait(
    lists: list[tuple[int, bool] | None],
    code: int,
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It waited its whole --timeout, then said "a still has 1 in flight"."""
    rows = iter(
        [] if row is None else [{"name": "a", "inflight": row[0], "removing": row[1]}]
        for row in lists
    )
    answers = {
        "/admin/instances/a?migrate=true": lambda: {"inflight": 1, "migrating": 0},
        "/admin/instances": lambda: next(rows),
        "/admin/sharing": lambda: {"enabled": False},
    }
    monkeypatch.setattr("proxy.cli._admin", lambda args, path, *rest: answers[path]())
    monkeypatch.setattr("time.sleep", lambda s: None)
    # One poll more than `lists` says raises StopIteration: the wait ended there.
    assert main(["remove", "a", "--url", "http://127.0.0.1:1", "--timeout", "30"]) == code
    assert says in capsys.readouterr().out


def test_sim_refuses_a_request_no_instance_could_ever_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It would wait for room forever: the run never ended (100% CPU)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": 0, "arrival_s": 0, "prompt_tokens": 20000, "output_tokens": 5}\n')
    argv = ["sim", "--trace", str(trace), "--instances", "2", "--policy", "llumnix"]
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err
    assert exited.value.code != 0 and "needs 20000 + 5 tokens of KV" in err
    assert len(err.splitlines()) == 1, err
