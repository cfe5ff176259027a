"""Changing the fleet at runtime, with streams in flight: add, patch, remove, undrain,
reload (the admin API, SIGHUP and the CLI), in front of stand-in servers (not vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.config import load_config
from proxy.migrator import PREWARM_WAIT_S
from proxy.server import FLEET
from tests.helpers import Ferry, call_json, free_port, status, wait_until
from tests.integration.test_proxy import get, post

TOKEN = "fleet"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def send(url: str, method: str, body: Any = None) -> tuple[int, Any]:
    return call_json(url, method, body, AUTH)


def rows(proxy_url: str) -> dict[str, dict[str, Any]]:
    status_, payload, _ = get(proxy_url + "/admin/instances", AUTH)
    assert status_ == 200
    return {r["name"]: r for r in payload}


def streams(url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], list[str]]:
    """`n` streams under way through Ferry at `url`; their texts land in the list."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    texts: list[str] = []

    def one() -> None:
        chunks = client.completions.create(
            model="standin", prompt="x", max_tokens=max_tokens, stream=True
        )
        texts.append("".join(c.choices[0].text for c in chunks))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, texts


def lite_pair(ferry: Any, *urls: str) -> Ferry:
    """Ferry over `urls` with lite migration, placing round robin (one stream each)."""
    return ferry(  # type: ignore[no-any-return]
        list(urls),
        admin_token=TOKEN,
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
    )


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(30)
        assert not t.is_alive()


def test_add_patch_and_remove_with_streams_in_flight(standins: Any, ferry: Any) -> None:
    (a, site_a), (b, site_b) = standins(2, itl_s=0.02)
    proxy: Ferry = ferry([site_a.url], admin_token=TOKEN, instance_defaults={"migration": "lite"})
    threads, texts = streams(proxy.url, 3, 60)  # 1.2 s streams, all on i0
    wait_until(lambda: a.running == 3)

    # Add: 201, and it takes traffic once scraped; the name is taken now.
    code, row = send(proxy.url + "/admin/instances", "POST", {"name": "b", "url": site_b.url})
    assert code == 201 and row["name"] == "b" and row["url"] == site_b.url
    wait_until(lambda: rows(proxy.url)["b"]["healthy"])
    code, err = send(proxy.url + "/admin/instances", "POST", {"name": "b", "url": site_b.url})
    assert code == 409 and err["error"]["code"] == "instance_exists"
    assert err["error"]["type"] == "conflict_error"  # not a fault of the server
    # Another name for a server listed already: it would be billed twice.
    code, err = send(proxy.url + "/admin/instances", "POST", {"name": "c", "url": site_b.url})
    assert code == 409 and err["error"]["message"] == "instance 'b' is that server"
    code, err = send(proxy.url + "/admin/instances", "POST", {"name": "c", "url": "ftp://x"})
    assert code == 400 and err["error"]["message"].startswith("instance.url:")
    code, err = send(proxy.url + "/admin/instances", "POST", {"name": "c", "uri": "x"})
    assert code == 400 and "instance.uri: unknown key" in err["error"]["message"]
    code, err = send(proxy.url + "/admin/instances", "POST", [1, 2])
    assert code == 400 and err["error"]["type"] == "invalid_request_error"
    code, err = send(proxy.url + "/admin/instances", "POST", {"name": "c", "url": "http://[::1"})
    assert code == 400 and err["error"]["message"].startswith("instance.url:")

    # What an added instance does not say, the configuration's defaults do.
    assert rows(proxy.url)["b"]["migration"] == "lite"

    # A new request goes to the idle new instance.
    more, more_texts = streams(proxy.url, 1, 5)
    join(more)
    assert b.served == 1 and more_texts == [" tok" * 5]

    # Patch: labels and migration change; the URL cannot.
    code, row = send(
        proxy.url + "/admin/instances/i0", "PATCH", {"labels": {"zone": "b"}, "migration": "lite"}
    )
    assert code == 200 and row["labels"] == {"zone": "b"} and row["migration"] == "lite"
    code, err = send(proxy.url + "/admin/instances/i0", "PATCH", {"url": site_b.url})
    assert code == 400 and "instance.url: cannot be changed at runtime" in err["error"]["message"]
    code, err = send(proxy.url + "/admin/instances/i0", "PATCH", {"migration": "sideways"})
    assert code == 400 and err["error"]["message"].startswith("instance.migration:")
    code, err = send(proxy.url + "/admin/instances/i0", "PATCH", {"headers": {"X-Team": "a\nb"}})
    assert code == 400 and err["error"]["message"].startswith("instance.headers.X-Team:")
    code, err = send(proxy.url + "/admin/instances/i0", "PATCH", {"api_key": "k" * 200_000})
    assert code == 400 and "instance.api_key: 200000 bytes, over 8000" in err["error"]["message"]
    assert send(proxy.url + "/admin/instances/nope", "PATCH", {})[0] == 404

    # Remove without moving: 202, draining at once, gone once its streams end.
    code, row = send(proxy.url + "/admin/instances/i0", "DELETE")
    assert code == 202 and row["draining"] and row["removing"] and row["inflight"] == 3
    join(threads)
    assert texts == [" tok" * 60] * 3  # none cut
    wait_until(lambda: "i0" not in rows(proxy.url))
    metrics_text = get(proxy.url + "/metrics")[1]["raw"]
    # None of its series stay (discovery's pods come and go), the others' do.
    assert 'instance="i0"' not in metrics_text
    kept = {line.split("{")[0] for line in metrics_text.splitlines() if 'instance="b"' in line}
    assert {"ferry_instance_healthy", "ferry_requests_total"} <= kept
    assert "ferry_time_to_first_token_seconds_count" in kept
    assert send(proxy.url + "/admin/instances/i0", "DELETE")[0] == 404


def test_remove_with_migrate_moves_streams_and_undrain_calls_it_off(
    standins: Any, ferry: Any
) -> None:
    (a, site_a), (b, site_b) = standins(2, itl_s=0.02)
    proxy = lite_pair(ferry, site_a.url, site_b.url)
    threads, texts = streams(proxy.url, 4, 200)  # 4 s streams
    wait_until(lambda: a.running == 2 and b.running == 2)
    # Undrain before the removal is done (streams still run there) keeps the instance.
    code, _ = send(proxy.url + "/admin/instances/i1", "DELETE")
    assert code == 202 and rows(proxy.url)["i1"]["removing"]
    code, row = send(proxy.url + "/admin/instances/i1/undrain", "POST")
    assert code == 200 and not row["draining"] and not row["removing"]
    # Unless its server was added again under another name meanwhile: it would
    # then be two instances, billed twice.
    code, _ = send(proxy.url + "/admin/instances/i1", "DELETE")
    assert code == 202
    code, _ = send(proxy.url + "/admin/instances", "POST", {"name": "again", "url": site_b.url})
    assert code == 201
    code, err = send(proxy.url + "/admin/instances/i1/undrain", "POST")
    assert code == 409 and err["error"]["message"] == "instance 'again' is that server now"
    assert rows(proxy.url)["i1"]["removing"]
    code, _ = send(proxy.url + "/admin/instances/again", "DELETE")
    code, row = send(proxy.url + "/admin/instances/i1/undrain", "POST")
    assert code == 200 and not row["removing"]

    code, row = send(proxy.url + "/admin/instances/i0?migrate=true", "DELETE")
    assert code == 202 and row["migrating"] == 2
    # Moved off, so i0 is gone long before its 4 s streams would have ended.
    wait_until(lambda: "i0" not in rows(proxy.url), timeout=2.5)
    join(threads)
    assert texts == [" tok" * 200] * 4
    assert "i1" in rows(proxy.url)


def test_reload_applies_the_file_and_refuses_a_bad_one(
    standins: Any, loop_thread: Any, tmp_path: Path
) -> None:
    (a, site_a), (b, site_b) = standins(2, itl_s=0.02)
    path = tmp_path / "ferry.yaml"

    def write(instances: list[dict[str, Any]], **scheduler: Any) -> None:
        path.write_text(
            json.dumps(
                {
                    "instances": instances,
                    "scheduler": {"scrape_interval_s": 0.05, **scheduler},
                    "admin_token": TOKEN,
                }
            )
        )

    write([{"name": "a", "url": site_a.url}])
    proxy = Ferry(loop_thread, load_config(path), load=lambda: load_config(path))
    try:
        threads, texts = streams(proxy.url, 2, 60)
        wait_until(lambda: a.running == 2)
        write(
            [{"name": "b", "url": site_b.url, "labels": {"new": "yes"}}],
            policy="round_robin",
        )
        code, summary = send(proxy.url + "/admin/reload", "POST")
        assert code == 200
        assert summary["added"] == ["b"] and summary["removed"] == ["a"]
        assert summary["scheduler_changed"] and summary["restart_required"] == []
        wait_until(lambda: set(rows(proxy.url)) == {"b"})  # a went once its streams ended
        join(threads)
        assert texts == [" tok" * 60] * 2
        wait_until(lambda: rows(proxy.url)["b"]["healthy"])

        # A bad file changes nothing and says where it is wrong.
        path.write_text(json.dumps({"instances": [{"name": "b", "url": site_b.url, "x": 1}]}))
        code, err = send(proxy.url + "/admin/reload", "POST")
        assert code == 400 and "instances[0].x: unknown key" in err["error"]["message"]
        assert set(rows(proxy.url)) == {"b"}
        path.write_text("instances: [")
        code, err = send(proxy.url + "/admin/reload", "POST")
        assert code == 400 and "not valid YAML" in err["error"]["message"]
        path.write_bytes(b"# caf\xe9\n" + path.read_bytes())
        code, err = send(proxy.url + "/admin/reload", "POST")
        assert code == 400 and "not UTF-8" in err["error"]["message"]

        # A changed instance keeps its name and takes the new settings.
        write([{"name": "b", "url": site_b.url, "labels": {"new": "no"}}], policy="round_robin")
        code, summary = send(proxy.url + "/admin/reload", "POST")
        assert code == 200 and summary["changed"] == ["b"] and not summary["scheduler_changed"]
        assert rows(proxy.url)["b"]["labels"] == {"new": "no"}

        # What is read only at the start is named, not silently ignored.
        path.write_text(
            path.read_text().replace('"admin_token"', '"redis_url": "redis://h:1", "admin_token"')
        )
        code, summary = send(proxy.url + "/admin/reload", "POST")
        assert code == 200 and summary["restart_required"] == ["redis_url"]
        # Against what runs, not the file read last: still needed, then not.
        assert send(proxy.url + "/admin/reload", "POST")[1]["restart_required"] == ["redis_url"]
        write([{"name": "b", "url": site_b.url, "labels": {"new": "no"}}], policy="round_robin")
        assert send(proxy.url + "/admin/reload", "POST")[1]["restart_required"] == []
        # Discovery with no instance listed: applied without it, the fleet would
        # be none. Refused whole.
        listed = json.loads(path.read_text())
        found = [{"dns": "localhost", "port": 1, "engine": "openai"}]
        path.write_text(json.dumps({**listed, "instances": [], "discovery": found}))
        code, err = send(proxy.url + "/admin/reload", "POST")
        assert code == 409 and err["error"]["code"] == "restart_required"
        assert set(rows(proxy.url)) == {"b"}

        # Renamed: the new name is added while the old one is still there.
        write([{"name": "b2", "url": site_b.url}], policy="round_robin")
        code, summary = send(proxy.url + "/admin/reload", "POST")
        assert code == 200 and summary["added"] == ["b2"] and summary["removed"] == ["b"]
        wait_until(lambda: set(rows(proxy.url)) == {"b2"})
    finally:
        proxy.close()


def test_a_reload_to_a_shorter_scrape_interval_applies_at_once(
    standins: Any, loop_thread: Any, tmp_path: Path
) -> None:
    """Each instance's loop slept the interval it had: a reload from 30 s to
    50 ms left the instance unlooked-at (its health, its load) until the 30 s
    were over."""
    [(standin, site)] = standins(1)
    path = tmp_path / "ferry.yaml"

    def write(interval_s: float) -> None:
        scheduler = {"scrape_interval_s": interval_s}
        instances = [{"name": "a", "url": site.url}]
        path.write_text(
            json.dumps({"instances": instances, "scheduler": scheduler, "admin_token": TOKEN})
        )

    write(30.0)
    proxy = Ferry(loop_thread, load_config(path), load=lambda: load_config(path))
    try:
        wait_until(lambda: rows(proxy.url)["a"]["healthy"])
        looks = len(standin.metrics_reads)
        for zone in ("b", "c"):  # a change that leaves the interval: no look sooner
            changed = {"labels": {"zone": zone}}
            assert send(proxy.url + "/admin/instances/a", "PATCH", changed)[0] == 200
        time.sleep(0.3)
        assert len(standin.metrics_reads) == looks
        write(0.05)
        code, summary = send(proxy.url + "/admin/reload", "POST")
        assert code == 200 and summary["scheduler_changed"]
        wait_until(lambda: len(standin.metrics_reads) >= looks + 5, timeout=3)
    finally:
        proxy.close()


def test_reload_without_a_file_is_refused(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1)
    proxy = ferry([site.url], admin_token=TOKEN)
    code, err = send(proxy.url + "/admin/reload", "POST")
    assert code == 409 and err["error"]["code"] == "no_config_file"
    assert post(proxy.url + "/admin/reload", b"")[0] == 401  # no token


def test_a_sighup_before_ferry_reads_its_file_is_a_reload_once_it_runs(
    standins: Any, tmp_path: Path
) -> None:
    """Ignored until the loop took SIGHUP over, one that came while Ferry read
    its file or imported its modules was lost, and the change it announced was
    not applied. The file is a FIFO here: Ferry waits in its read (the second:
    the command line's check reads it, then the serving process) while the
    signal comes, deterministically."""
    (_, site_a), (_, site_b) = standins(2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    path = tmp_path / "ferry.yaml"

    def config(names: dict[str, str]) -> str:
        instances = [{"name": n, "url": u} for n, u in names.items()]
        server = {"port": port, "shutdown_delay_s": 0}
        return json.dumps({"instances": instances, "server": server, "admin_token": TOKEN})

    os.mkfifo(path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        edited = tmp_path / "edited.yaml"
        edited.write_text(config({"a": site_a.url, "b": site_b.url}))
        for read in range(2):
            with open(path, "w") as fifo:  # (returns once Ferry opened it to read)
                if read == 1:
                    proc.send_signal(signal.SIGHUP)  # "b was added", before Ferry runs
                    time.sleep(0.2)
                    os.replace(edited, path)  # what the reload reads, Ferry the FIFO still
                fifo.write(config({"a": site_a.url}))
            if read == 0:  # Ferry read it whole and closed it, before it is opened again
                wait_until(lambda: str(path) not in _open_files(proc.pid), timeout=10)
        _serves_a_and_b(proc, url)
    finally:
        proc.terminate()
        proc.wait(30)


def _serves_a_and_b(proc: subprocess.Popen[bytes], url: str) -> None:
    """Ferry came up (not ended by the signal) and serves the edited file's two."""
    wait_until(lambda: proc.poll() is not None or status(url + "/readyz") == 200, timeout=30)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    wait_until(lambda: set(rows(url)) == {"a", "b"})


def _open_files(pid: int) -> set[str]:
    names = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            names.add(os.readlink(fd))
    return names


def test_a_sighup_while_ferry_starts_is_a_reload_once_it_runs(
    standins: Any, tmp_path: Path
) -> None:
    """SIGHUP's default is to end the process: one that came while Ferry
    started (its first scrapes take a while) ended it, silently. Now it is
    taken once Ferry runs, as the reload it was sent for."""
    (a, site_a), (_, site_b) = standins(2)
    a.metrics_delay_s = 4.0  # the first round waits on it
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    path = tmp_path / "ferry.yaml"

    def write(names: dict[str, str]) -> None:
        config = {
            "instances": [{"name": n, "url": u} for n, u in names.items()],
            "scheduler": {"scrape_timeout_s": 5.0},
            "server": {"port": port, "shutdown_delay_s": 0},
            "admin_token": TOKEN,
        }
        path.write_text(json.dumps(config))

    write({"a": site_a.url})
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(1.5)  # started, and waiting on the first round
        assert status(url + "/readyz") == 0
        write({"a": site_a.url, "b": site_b.url})
        proc.send_signal(signal.SIGHUP)
        a.metrics_delay_s = 0.0
        _serves_a_and_b(proc, url)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_reload_whose_read_never_returns_does_not_keep_ferry_from_exiting(
    standins: Any, tmp_path: Path
) -> None:
    """The file is swapped for a FIFO nobody writes (as a hung network mount
    would leave a read): the reload waits in its read forever. Read in asyncio's
    default executor, that thread was joined at exit, and Ferry never exited on
    SIGTERM whatever its grace."""
    [(_, site)] = standins(1)
    port = free_port()
    path = tmp_path / "ferry.yaml"
    server = {"port": port, "shutdown_delay_s": 0, "shutdown_grace_s": 1}
    path.write_text(json.dumps({"instances": [{"name": "a", "url": site.url}], "server": server}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: status(f"http://127.0.0.1:{port}/readyz") == 200, timeout=30)
        path.unlink()
        os.mkfifo(path)
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "wait_for_partner" in _waits(proc.pid), timeout=10)  # opening it
        proc.terminate()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _waits(pid: int) -> set[str]:
    """What the process's threads wait on in the kernel (a FIFO's open:
    `wait_for_partner`)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # ended meanwhile
            found.add((task / "wchan").read_text())
    return found


def test_port_0_says_the_port_it_took(standins: Any) -> None:
    """`--port 0` lets the system pick: the start line named port 0."""
    [(_, site)] = standins(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--backend", site.url, "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = next(x for x in proc.stderr if "ferry listening on" in x)
        found = re.search(r"http://127\.0\.0\.1:(\d+) ", line)
        assert found and int(found[1]) > 0, line
        assert status(f"http://127.0.0.1:{found[1]}/livez") == 200
    finally:
        proc.terminate()
        proc.wait(30)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_host_star_listens_on_ipv4_and_ipv6(standins: Any) -> None:
    """`0.0.0.0` serves IPv4 alone and `::` IPv6 alone (asyncio binds it
    IPv6-only): `*` serves both, as a dual-stack or IPv6 cluster needs."""
    [(_, site)] = standins(1)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--backend", site.url]
        + ["--host", "*", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: status(f"http://127.0.0.1:{port}/livez") == 200, timeout=30)
        assert status(f"http://[::1]:{port}/livez") == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_sighup_and_the_cli_change_a_running_ferry(standins: Any, tmp_path: Path) -> None:
    (a, site_a), (b, site_b), (c, site_c) = standins(3, itl_s=0.02)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    path = tmp_path / "ferry.yaml"

    def write(names: dict[str, str]) -> None:
        path.write_text(
            json.dumps(
                {
                    "instances": [{"name": n, "url": u} for n, u in names.items()],
                    "scheduler": {"scrape_interval_s": 0.05},
                    "server": {"port": port, "shutdown_delay_s": 0},
                    "admin_token": TOKEN,
                }
            )
        )

    write({"a": site_a.url})
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    cli: Callable[..., subprocess.CompletedProcess[str]] = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "proxy.cli", *args, "--url", url, "--admin-token", TOKEN],
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        wait_until(lambda: status(url + "/readyz") == 200, timeout=30)
        threads, texts = streams(url, 2, 50)
        wait_until(lambda: a.running == 2)
        write({"a": site_a.url, "b": site_b.url})
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "b" in rows(url))

        done = cli("add", "c", site_c.url, "--label", "role=spare")
        assert done.returncode == 0, done.stderr
        assert rows(url)["c"]["labels"] == {"role": "spare"}
        assert cli("add", "c", site_c.url).returncode == 1  # 409: the name exists
        assert cli("drain", "c").returncode == 0
        assert cli("undrain", "c").returncode == 0 and not rows(url)["c"]["draining"]
        # A name is a name: `c/drain?` is no instance (it drained c, through the route).
        done = cli("undrain", "c/drain?")
        assert done.returncode == 1 and "HTTP 404" in done.stderr
        assert not rows(url)["c"]["draining"]
        done = cli("add", "d", site_c.url, "--label", "spare")
        assert done.returncode == 2 and "--label 'spare': must be KEY=VALUE" in done.stderr
        # Its port taken: one line, not a traceback.
        taken = subprocess.run(
            [sys.executable, "-m", "proxy.cli", "serve", "--backend", site_b.url,
             "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert taken.returncode == 1 and "Traceback" not in taken.stderr, taken.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in taken.stderr
        done = cli("remove", "a")  # waits until a's streams end and it is gone
        assert done.returncode == 0, done.stderr
        join(threads)
        assert texts == [" tok" * 50] * 2
        assert set(rows(url)) == {"b", "c"}
        table = cli("status").stdout.splitlines()
        assert table[0].split()[:2] == ["NAME", "URL"] and len(table) == 3
        done = cli("reload")  # the file names a and b, not c
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["added"] == ["a"] and summary["removed"] == ["c"]
        wait_until(lambda: set(rows(url)) == {"a", "b"})
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_drain_moves_streams_whose_instance_answers_after_it(standins: Any, ferry: Any) -> None:
    """A busy instance sends a stream's headers late: the stream is in flight (billed)
    but not yet movable when the drain comes; it moves as soon as it is."""
    (a, site_a), (b, site_b) = standins(2, itl_s=0.02)
    a.headers_delay_s = 2.0
    proxy = lite_pair(ferry, site_a.url, site_b.url)
    threads, texts = streams(proxy.url, 4, 150)
    wait_until(lambda: rows(proxy.url)["i0"]["inflight"] == 2)
    code, row = send(proxy.url + "/admin/instances/i0/drain?migrate=true", "POST")
    assert code == 200 and row["migrating"] == 0  # none has answered yet
    # Moved once answered (2 s), not left to end in place (5 s).
    wait_until(lambda: rows(proxy.url)["i0"]["inflight"] == 0, timeout=3.5)
    join(threads)
    assert texts == [" tok" * 150] * 4
    text = get(proxy.url + "/metrics")[1]["raw"]
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 2.0' in text


def test_a_drain_does_not_wait_for_a_slow_prewarm(standins: Any, ferry: Any) -> None:
    """A destination that queues (here: 4 s to any first token) would hold a pre-warm,
    and with it the move, past the stream's end: the move goes on after
    `PREWARM_WAIT_S` and the source is empty at once."""
    (a, site_a), (b, site_b) = standins(2, itl_s=0.05)
    b.ttft_s = 4.0
    proxy = lite_pair(ferry, site_a.url, site_b.url)
    threads, texts = streams(proxy.url, 2, 60)  # one on each: 3 s of tokens on i0
    wait_until(lambda: a.running == 1 and b.running == 1)
    time.sleep(0.3)  # a few tokens out
    code, _ = send(proxy.url + "/admin/instances/i0/drain?migrate=true", "POST")
    assert code == 200
    drained = time.monotonic()
    wait_until(lambda: rows(proxy.url)["i0"]["inflight"] == 0, timeout=2.5)
    assert time.monotonic() - drained < PREWARM_WAIT_S + 1.0  # not the 4 s pre-warm
    join(threads)
    assert texts == [" tok" * 60] * 2
    text = get(proxy.url + "/metrics")[1]["raw"]
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 1.0' in text
    assert any(body.get("max_tokens") == 1 for body in b.seen_bodies)  # it was pre-warmed


def test_a_prewarm_is_billed_to_its_destination_while_it_runs(standins: Any, ferry: Any) -> None:
    """A pre-warm queues a prefill on the destination, the freest instance, where the
    next arrivals would go too: the ledger bills it there until it ends, so a burst
    sees it, and drops it after."""
    (a, site_a), (b, site_b) = standins(2, itl_s=0.05)
    b.ttft_s = 4.0  # the pre-warm waits there until the move gives up on it
    proxy = lite_pair(ferry, site_a.url, site_b.url)
    threads, texts = streams(proxy.url, 2, 60)  # one on each
    wait_until(lambda: a.running == 1 and b.running == 1)
    time.sleep(0.3)
    code, _ = send(proxy.url + "/admin/instances/i0/drain?migrate=true", "POST")
    assert code == 200
    wait_until(lambda: any(body.get("max_tokens") == 1 for body in b.seen_bodies))
    during = rows(proxy.url)
    assert (during["i0"]["inflight"], during["i1"]["inflight"]) == (1, 2)  # stream + pre-warm
    wait_until(lambda: rows(proxy.url)["i0"]["inflight"] == 0, timeout=2.5)
    assert rows(proxy.url)["i1"]["inflight"] == 2  # its own stream and the moved one
    join(threads)
    assert texts == [" tok" * 60] * 2
    wait_until(lambda: rows(proxy.url)["i1"]["inflight"] == 0)


def test_a_move_stops_waiting_for_its_prewarm_once_its_stream_stops(
    standins: Any, ferry: Any
) -> None:
    """The source goes silent mid-move (as when its engine preempts the stream being
    moved): the move cuts over at once instead of waiting out the pre-warm."""
    (a, site_a), (b, site_b) = standins(2, itl_s=0.05)
    a.stall_after, a.stall_s = 12, 5.0  # silent from about 0.6 s on
    b.ttft_s = 2.0  # a pre-warm there would wait 2 s for its token
    proxy = lite_pair(ferry, site_a.url, site_b.url)
    threads, texts = streams(proxy.url, 2, 60)
    wait_until(lambda: a.running == 1 and b.running == 1)
    time.sleep(0.3)
    code, _ = send(proxy.url + "/admin/instances/i0/drain?migrate=true", "POST")
    assert code == 200
    drained = time.monotonic()
    wait_until(lambda: rows(proxy.url)["i0"]["inflight"] == 0, timeout=2.5)
    # Stopped about 0.3 s after the drain, noticed within a few of its 50 ms gaps.
    assert time.monotonic() - drained < PREWARM_WAIT_S - 0.1
    join(threads)
    assert texts == [" tok" * 60] * 2
    assert any(body.get("max_tokens") == 1 for body in b.seen_bodies)  # a pre-warm began


def test_a_move_cuts_right_after_a_token_not_in_the_middle_of_a_gap(
    standins: Any, ferry: Any
) -> None:
    """Ordered between two tokens 0.6 s apart, a move waits for the next one and
    cuts there: its downtime is the destination's first token alone (here almost
    nothing), not also the 0.25 s of the gap that had passed. (A move waits at
    most CUT_WAIT_MAX_S, 0.5 s, for the next token.)"""
    (a, site_a), (b, site_b) = standins(2, itl_s=0.6)
    proxy = lite_pair(ferry, site_a.url, site_b.url)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    chunks = client.completions.create(model="standin", prompt="x", max_tokens=5, stream=True)
    seen = [next(chunks).choices[0].text, next(chunks).choices[0].text]  # its pace is known
    time.sleep(0.25)
    code, _ = send(proxy.url + "/admin/instances/i0/drain?migrate=true", "POST")
    assert code == 200
    seen += [c.choices[0].text for c in chunks]
    assert "".join(seen) == " tok" * 5
    text = get(proxy.url + "/metrics")[1]["raw"]
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 1.0' in text
    [downtime] = re.findall(r"^ferry_migration_downtime_seconds_sum (\S+)$", text, re.M)
    assert float(downtime) < 0.2


def test_a_removal_called_off_as_it_stops_the_scrapes_leaves_the_instance_scraped(
    standins: Any, ferry: Any
) -> None:
    """An undrain (a pod back in DNS, a peer's undrain, a reload) that comes while
    the removal stops the instance's scrapes: the instance stays, and is scraped
    again, so its health is its own and not frozen at the last scrape."""
    sites = standins(2)
    proxy = lite_pair(ferry, *(site.url for _, site in sites))
    fleet = proxy.site.app[FLEET]

    async def remove_then_undrain() -> None:
        fleet.remove("i1", migrate=False)
        await asyncio.sleep(0)  # the removal finds i1 idle and stops its scrapes
        fleet.undrain("i1")
        await asyncio.sleep(0.1)

    proxy.loop.run(remove_then_undrain())
    row = rows(proxy.url)["i1"]
    assert row["healthy"] and not row["draining"] and not row["removing"]
    sites[1][0].metrics_body = b"not metrics"
    wait_until(lambda: not rows(proxy.url)["i1"]["healthy"])


def test_a_reload_that_gives_a_new_instance_an_old_url_applies_whole(
    standins: Any, loop_thread: Any, tmp_path: Path
) -> None:
    """An instance that moves to another server frees its URL for one the same
    file adds before it: the reload applies (it was refused half done, with the
    added instance left running, because the add came first)."""
    (_, one), (_, two), (_, three), (_, four) = standins(4)
    path = tmp_path / "ferry.yaml"

    def write(instances: list[dict[str, str]]) -> None:
        path.write_text(json.dumps({"instances": instances, "admin_token": TOKEN}))

    write([{"name": "a", "url": one.url}, {"name": "c", "url": two.url}])
    proxy = Ferry(loop_thread, load_config(path), load=lambda: load_config(path))
    try:
        write(
            [
                {"name": "n1", "url": three.url},
                {"name": "y", "url": one.url},  # a's server, before a moves on
                {"name": "a", "url": four.url},
                {"name": "c", "url": two.url},
            ]
        )
        code, summary = send(proxy.url + "/admin/reload", "POST")
        assert code == 200, summary
        assert (summary["added"], summary["changed"]) == (["n1", "y"], ["a"])
        urls = {name: row["url"] for name, row in rows(proxy.url).items()}
        assert urls == {"n1": three.url, "y": one.url, "a": four.url, "c": two.url}
    finally:
        proxy.close()


def test_a_patch_that_makes_an_instance_another_ones_server_is_refused(
    standins: Any, ferry: Any
) -> None:
    """One URL with another `x-data-parallel-rank` header is another server; a
    PATCH that drops the header would make two instances bill one server (an
    add of the same is refused too)."""
    [(_, site)] = standins(1)
    proxy = ferry([site.url], admin_token=TOKEN)
    rank = {"name": "d1", "url": site.url, "headers": {"x-data-parallel-rank": "1"}}
    assert send(proxy.url + "/admin/instances", "POST", rank)[0] == 201
    code, err = send(proxy.url + "/admin/instances/d1", "PATCH", {"headers": {}})
    assert code == 409 and "'i0' is that server" in err["error"]["message"]
    assert send(proxy.url + "/admin/instances", "POST", {**rank, "name": "d2"})[0] == 409
    rank2 = {"headers": {"x-data-parallel-rank": "2"}}
    assert send(proxy.url + "/admin/instances/d1", "PATCH", rank2)[0] == 200


def test_an_instance_restarted_with_another_model_is_read_again_at_once(
    standins: Any, ferry: Any
) -> None:
    """An engine that answers 404 for a model listed for it serves another now
    (restarted on its port): the request goes to an instance that serves it,
    and the instance's models are read again at its next look, not after
    `models_refresh_s`."""
    (swapped, a), (other, b) = standins(2, model="m1", itl_s=0.001)
    proxy = ferry(
        [a.url, b.url],
        scheduler={"policy": "round_robin", "models_refresh_s": 600, "scrape_interval_s": 0.05},
    )
    wait_until(lambda: proxy.view("i0").models == frozenset({"m1"}))
    swapped.model = "m2"
    api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    for _ in range(2):  # round robin: one of them tries `swapped` first
        assert api.completions.create(model="m1", prompt="x", max_tokens=2).choices[0].text
    wait_until(lambda: proxy.view("i0").models == frozenset({"m2"}))
    assert api.completions.create(model="m2", prompt="x", max_tokens=2).choices[0].text
    # A 404 that is not about the model (a gateway's, say) is the client's answer.
    swapped.model, other.fail_status = "m1", 404
    proxy.cluster.instances["i0"].models_stale = True
    wait_until(lambda: proxy.view("i0").models == frozenset({"m1"}))
    with pytest.raises(openai.NotFoundError, match="told to fail"):
        for _ in range(2):  # round robin: one of them tries `other` first, not again
            api.completions.create(model="m1", prompt="x", max_tokens=2)


def test_an_instance_that_leads_back_to_ferry_ends_the_round_at_once(
    standins: Any, ferry: Any
) -> None:
    """An instance added with Ferry's own URL: a request sent there comes back
    (its `Via` says so) and goes no further, where it went round and round,
    thousands of connections deep, until its client gave up."""
    [(standin, site)] = standins(1)
    proxy = ferry([site.url], admin_token=TOKEN, scheduler={"policy": "round_robin"})
    added = {"name": "self", "url": proxy.url, "engine": "openai"}
    assert send(proxy.url + "/admin/instances", "POST", added)[0] == 201
    wait_until(lambda: rows(proxy.url)["self"]["healthy"] and proxy.view("self").models)
    assert send(proxy.url + "/admin/instances/i0", "DELETE")[0] == 202
    wait_until(lambda: "i0" not in rows(proxy.url))
    answer = httpx.post(
        proxy.url + "/v1/completions", json={"model": "standin", "prompt": "x"}, timeout=10
    )
    assert answer.status_code == 502 and "leads to Ferry itself" in answer.text
    assert standin.served == 0


def test_a_request_its_instance_failed_is_answered_by_a_draining_one_if_none_else(
    standins: Any, ferry: Any
) -> None:
    """A request an instance failed, with no instance left but one draining, was
    answered with the failure (a 503) where its streams were resumed on the
    draining one: it is answered there, whole or streamed. A new request is
    still refused: a drain takes none."""
    (draining, draining_site), (failing, failing_site) = standins(2, itl_s=0.001)
    failing.break_whole = True
    proxy = ferry([draining_site.url, failing_site.url], admin_token=TOKEN)
    wait_until(lambda: all(r["healthy"] for r in rows(proxy.url).values()))
    assert send(proxy.url + "/admin/instances/i0/drain", "POST")[0] == 200
    body = {"model": "standin", "prompt": "x", "max_tokens": 3}
    answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-ferry-instance"] == "i0"
    assert answer.json()["choices"][0]["text"] == " tok" * 3
    assert draining.served == 1
    failing.break_whole, failing.drop_next = False, 2  # (a stream cut before its headers, twice)
    streamed = httpx.post(proxy.url + "/v1/completions", json={**body, "stream": True}, timeout=10)
    assert streamed.status_code == 200 and streamed.headers["x-ferry-instance"] == "i0"
    assert streamed.text.endswith("data: [DONE]\n\n") and draining.served == 2


def test_an_instance_removed_while_a_request_to_it_is_encoded_waits_for_it(
    standins: Any, ferry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large body is encoded in a thread after its instance is chosen: billed
    only after that, the instance could be removed meanwhile (nothing in flight
    on it), and the request was a 500 (a KeyError) whose bill stayed on the
    name for good, a later removal never done. Billed at once, the removal
    waits for it."""
    from proxy import relay

    encoded = relay._encoded

    async def slowly(body: dict[str, Any], size: int) -> bytes:
        await asyncio.sleep(0.5)
        return await encoded(body, size)

    monkeypatch.setattr(relay, "_encoded", slowly)
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url], admin_token=TOKEN)
    wait_until(lambda: rows(proxy.url)["i0"]["healthy"])
    answers: list[httpx.Response] = []
    body = {"model": "standin", "prompt": "x", "max_tokens": 2}
    asker = threading.Thread(
        target=lambda: answers.append(
            httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
        )
    )
    asker.start()
    wait_until(lambda: proxy.view("i0").inflight == 1, timeout=2)  # billed, being encoded
    assert send(proxy.url + "/admin/instances/i0", "DELETE")[0] == 202
    asker.join(10)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["choices"][0]["text"] == " tok" * 2
    wait_until(lambda: "i0" not in rows(proxy.url))  # and then removed


def test_a_runtime_address_is_not_read_from_ferrys_environment(
    standins: Any, ferry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admin API shows an instance's URL, and sends its `api_key` to the
    server it names: `${VAR}` there would hand any of Ferry's variables (the
    clients' keys) to whoever holds the admin token."""
    monkeypatch.setenv("FERRY_SECRET_FOR_TEST", "hunter2")
    [(standin, site)] = standins(1)
    proxy = ferry([site.url], admin_token=TOKEN)
    for added in (
        {"name": "leak", "url": "http://127.0.0.1:9/${FERRY_SECRET_FOR_TEST}"},
        {"name": "leak", "url": "http://127.0.0.1:9", "api_key": "${FERRY_SECRET_FOR_TEST}"},
        {"name": "leak", "url": "http://127.0.0.1:9", "headers": {"X-K": "${PATH}"}},
    ):
        status_, payload = send(proxy.url + "/admin/instances", "POST", added)
        assert status_ == 400 and "reads none of Ferry's environment" in json.dumps(payload)
    assert "leak" not in rows(proxy.url)
    typo = send(proxy.url + "/admin/instances/i0", "PATCH", {"migraton": "lite"})
    assert typo[0] == 400 and "no such field" in typo[1]["error"]["message"]


def test_an_instance_whose_models_cannot_be_read_says_why(standins: Any, ferry: Any) -> None:
    """Its load reads fine, so it is healthy, yet it takes no traffic for a model
    it has not listed: `/admin/instances` says why, until its models read again."""
    [(standin, site)] = standins(1)
    standin.models_body = b"<html>a gateway's page</html>"
    proxy = ferry([site.url], admin_token=TOKEN, scheduler={"models_refresh_s": 0.1})
    wait_until(lambda: rows(proxy.url)["i0"]["models_error"] is not None)
    assert rows(proxy.url)["i0"]["healthy"]
    standin.models_body = None
    wait_until(lambda: rows(proxy.url)["i0"]["models_error"] is None)
    standin.models_body = b'{"object": "list", "data": null}'
    wait_until(lambda: rows(proxy.url)["i0"]["models_error"] is not None)
    assert "not a list" in rows(proxy.url)["i0"]["models_error"]
    assert rows(proxy.url)["i0"]["healthy"]


def test_a_client_that_reads_nothing_holds_up_no_other_drain(standins: Any, ferry: Any) -> None:
    """A move takes effect between a stream's writes, and a client that reads
    nothing holds its stream's write for its send timeout (60 s). Its drain
    waited for that move, and so did every other drain: another instance's
    streams moved nowhere until they ended where they were."""
    import socket

    from proxy.server import IN_FLIGHT

    (a, site_a), (b, site_b), (c, site_c) = standins(3, itl_s=0.0002)
    proxy = lite_pair(ferry, site_a.url, site_b.url, site_c.url)
    for name in ("i1", "i2"):
        assert send(proxy.url + f"/admin/instances/{name}/drain", "POST")[0] == 200
    # A stream on i0 whose client stops reading: Ferry's buffer for it fills.
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    host, port = proxy.url.removeprefix("http://").split(":")
    slow.connect((host, int(port)))
    body = json.dumps({"model": "standin", "prompt": "x", "max_tokens": 200_000, "stream": True})
    slow.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    try:
        in_flight = proxy.site.app[IN_FLIGHT]

        def backlog() -> int:
            requests = list(in_flight.tasks.values())
            return max(
                (r.transport.get_write_buffer_size() for r in requests if r.transport), default=0
            )

        wait_until(lambda: proxy.loop.call(backlog) > 64 * 1024, timeout=20)
        assert send(proxy.url + "/admin/instances/i0?migrate=true", "DELETE")[0] == 202
        # Four ordinary streams on i1 (4 s each), then i1 drained too, with room on i2.
        send(proxy.url + "/admin/instances/i1/undrain", "POST")
        b.itl_s = 0.02
        threads, texts = streams(proxy.url, 4, 200)
        wait_until(lambda: b.running == 4)
        send(proxy.url + "/admin/instances/i2/undrain", "POST")
        assert send(proxy.url + "/admin/instances/i1?migrate=true", "DELETE")[0] == 202
        wait_until(lambda: "i1" not in rows(proxy.url), timeout=2)  # moved off, not ended
        join(threads)
        assert texts == [" tok" * 200] * 4
        assert "i0" in rows(proxy.url)  # its stream is still there, its client still slow
    finally:
        slow.close()


def test_a_look_at_an_instances_old_url_says_nothing_of_its_new_one(
    standins: Any, loop_thread: Any, tmp_path: Path
) -> None:
    """A reload gives an instance a new URL, where nothing listens, while a look
    at its old server is under way (a busy engine's /metrics answers late). The
    old server's answer is not recorded for the new one: it stays unhealthy
    (it was shown healthy, and /readyz said 200, with nothing behind it)."""
    [(busy, site)] = standins(1)
    path = tmp_path / "ferry.yaml"

    def write(url: str) -> None:
        scheduler = {"scrape_interval_s": 0.05}
        instances = [{"name": "a", "url": url}]
        path.write_text(
            json.dumps({"instances": instances, "scheduler": scheduler, "admin_token": TOKEN})
        )

    write(site.url)
    proxy = Ferry(loop_thread, load_config(path), load=lambda: load_config(path))
    try:
        wait_until(lambda: proxy.view("a").healthy)
        busy.metrics_delay_s = 0.5
        time.sleep(0.7)  # the look begun before the delay is over; one is under way
        write(f"http://127.0.0.1:{free_port()}")
        code, summary = send(proxy.url + "/admin/reload", "POST")
        assert code == 200 and summary["changed"] == ["a"], summary
        healthy = []
        ends = time.monotonic() + 1.5  # past the old look's answer, and more looks
        while time.monotonic() < ends:
            healthy.append(proxy.loop.call(lambda: proxy.cluster.instances["a"].healthy))
            time.sleep(0.01)
        assert not any(healthy)
    finally:
        proxy.close()


def test_admin_changes_to_an_instance_being_replaced_are_refused_until_it_is_in(
    standins: Any, ferry: Any
) -> None:
    """A peer removed the instance and added it again; this process still ends
    the old server's streams (proxy/sharing.py `_hold`). A change through it
    would go to the old one and be undone, or call the removal off and keep the
    old server for good: a 409 with Retry-After instead."""
    (_, a), (_, b) = standins(2)
    proxy = ferry([a.url, b.url], admin_token=TOKEN)
    fleet = proxy.site.app[FLEET]
    proxy.loop.call(fleet.begin_replacement, "i1")
    for method, path, body in (
        ("POST", "/admin/instances/i1/drain", None),
        ("POST", "/admin/instances/i1/undrain", None),
        ("PATCH", "/admin/instances/i1", {"labels": {"zone": "b"}}),
        ("DELETE", "/admin/instances/i1", None),
    ):
        code, answer = send(proxy.url + path, method, body)
        assert code == 409 and answer["error"]["code"] == "instance_replacing", (path, answer)
    assert not rows(proxy.url)["i1"]["draining"]
    proxy.loop.call(fleet.end_replacement, "i1")
    assert send(proxy.url + "/admin/instances/i1/drain", "POST")[0] == 200
