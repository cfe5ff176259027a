from __future__ import annotations

import dataclasses
import itertools
import os
import ssl
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from loadtest.paged_standin import DEFAULT_PROFILE, PagedStandIn
from loadtest.redis_server import redis_binary, start_redis
from loadtest.standin_server import StandIn
from tests.helpers import Ferry, LoopThread, Site, Sites, debian_tool, ferry_config, free_port

_REDIS_PREFIXES = itertools.count(1)

# No per-example deadline: on a loaded 2-core machine one example can stall for a
# second behind a busy vLLM server, and that is no bug of the code under test.
# (With CI set, Hypothesis's own "ci" profile applies, deadline-free as well.)
settings.register_profile("ferry", deadline=None)
if not os.environ.get("CI"):
    settings.load_profile("ferry")


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def sites(loop_thread: LoopThread) -> Iterator[Sites]:
    started = Sites(loop_thread)
    yield started
    started.close()


@pytest.fixture
def standins(sites: Sites) -> Callable[..., list[tuple[StandIn, Site]]]:
    """Factory: start n stand-in servers (not vLLM) on the loop thread."""
    return lambda n, **options: [sites.start(StandIn(**options)) for _ in range(n)]


@pytest.fixture
def paged_standins(sites: Sites) -> Callable[..., list[tuple[PagedStandIn, Site]]]:
    """Factory: start n paged-KV stand-in engines (not vLLM); other options override
    the fields of their `loadtest.sim.profile.Profile`."""

    def make(n: int, stream_interval: int = 1, **profile: Any) -> list[tuple[PagedStandIn, Site]]:
        engine = dataclasses.replace(DEFAULT_PROFILE, **profile)
        return [
            sites.start(
                PagedStandIn(engine, stream_interval=stream_interval), handler_cancellation=True
            )
            for _ in range(n)
        ]

    return make


@pytest.fixture
def ferry(loop_thread: LoopThread) -> Iterator[Callable[..., Ferry]]:
    """Factory: start Ferry in front of the given base URLs."""
    started: list[Ferry] = []

    def make(urls: list[str], **sections: Any) -> Ferry:
        proxy = Ferry(loop_thread, ferry_config(urls, **sections))
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on 127.0.0.1 (Debian's package: `make setup` installs
    it; CI must have it), for the whole session: its URL."""
    if redis_binary() is None or not _redis_client_installed():
        if os.environ.get("CI"):
            pytest.fail("redis-server or the redis package missing: `make setup` installs both")
        pytest.skip("redis-server or the redis package missing (`make setup` installs both)")
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def redis_prefix(redis_server: str) -> str:
    """A key prefix of this test's own, so tests sharing the server share nothing."""
    return f"test{next(_REDIS_PREFIXES)}"


def _redis_client_installed() -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_ca: Path  # a CA that signed none of them

    def server_context(self, clients_from: Path | None = None) -> ssl.SSLContext:
        """The stand-in's side; `clients_from`: it asks for a client certificate
        that CA signed (mutual TLS)."""
        made = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        made.load_cert_chain(self.server_cert, self.server_key)
        if clients_from is not None:
            made.verify_mode = ssl.CERT_REQUIRED
            made.load_verify_locations(clients_from)
        return made


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and engine.test, a client one
    (made by openssl for the session), and another CA that signed none."""
    openssl = debian_tool("openssl", "openssl")
    tmp = tmp_path_factory.mktemp("pki")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=tmp, check=True, capture_output=True, timeout=60)

    def ca(name: str) -> Path:
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem")  # fmt: skip
        return tmp / f"{name}.pem"

    def signed(name: str, extensions: str) -> tuple[Path, Path]:
        (tmp / f"{name}.ext").write_text(extensions)
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
            "-out", f"{name}.pem")  # fmt: skip
        return tmp / f"{name}.pem", tmp / f"{name}.key"

    root = ca("ca")
    server = signed(
        "server", "subjectAltName=IP:127.0.0.1,DNS:engine.test\nextendedKeyUsage=serverAuth\n"
    )
    client = signed("client", "extendedKeyUsage=clientAuth\n")
    return Pki(root, *server, *client, stranger_ca=ca("stranger"))
