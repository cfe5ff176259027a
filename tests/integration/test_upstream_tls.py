"""https instances: a private CA, mutual TLS, and no check at all (stand-in
servers behind TLS with certificates made by openssl for the test, not vLLM)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.config import ConfigError, parse_config
from tests.conftest import Pki
from tests.helpers import Ferry, call_json, wait_until


def config(urls: list[str], **tls: Any) -> Any:
    raw = {
        "instances": [{"name": f"i{n}", "url": u, **tls} for n, u in enumerate(urls)],
        "scheduler": {"scrape_interval_s": 0.05, "seed": 1},
        "admin_token": "t",
    }
    return parse_config(raw, env={})


def complete(proxy: Ferry) -> str:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    chunks = client.completions.create(model="standin", prompt="x", max_tokens=5, stream=True)
    return "".join(c.choices[0].text for c in chunks)


def instance(proxy: Ferry, name: str = "i0") -> dict[str, Any]:
    status, rows = call_json(proxy.url + "/admin/instances", headers={"Authorization": "Bearer t"})
    assert status == 200
    (row,) = [r for r in rows if r["name"] == name]
    return row


def test_an_https_instance_signed_by_a_private_ca_is_served_with_its_ca(
    pki: Pki, sites: Any, loop_thread: Any
) -> None:
    from loadtest.standin_server import StandIn

    _, site = sites.start(StandIn(itl_s=0.001), ssl_context=pki.server_context())
    assert site.url.startswith("https://")
    proxy = Ferry(loop_thread, config([site.url], tls_ca_file=str(pki.ca)))
    try:
        wait_until(lambda: instance(proxy)["healthy"] and instance(proxy)["models"])  # scraped
        assert complete(proxy) == " tok" * 5
    finally:
        proxy.close()


@pytest.mark.parametrize(
    "trust",
    [
        pytest.param({}, id="system-roots"),
        pytest.param({"tls_ca_file": "stranger"}, id="another-ca"),
    ],
)
def test_an_https_instance_whose_certificate_is_not_trusted_is_not_used(
    trust: dict[str, str], pki: Pki, sites: Any, loop_thread: Any
) -> None:
    from loadtest.standin_server import StandIn

    standin, site = sites.start(StandIn(itl_s=0.001), ssl_context=pki.server_context())
    if trust:
        trust = {"tls_ca_file": str(pki.stranger_ca)}
    proxy = Ferry(loop_thread, config([site.url], **trust))
    try:
        wait_until(lambda: not instance(proxy)["healthy"])
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="standin", prompt="x", max_tokens=5)
        assert failed.value.status_code in (502, 503)
        assert not standin.seen_bodies  # no request went over a connection it could not check
        said = str(instance(proxy)["last_error"])
        assert "certificate" in said.lower()
    finally:
        proxy.close()


@pytest.mark.parametrize("name,served", [("engine.test", True), ("other.test", False)])
def test_the_certificate_is_checked_against_the_server_name_given(
    name: str, served: bool, pki: Pki, sites: Any, loop_thread: Any
) -> None:
    """An instance known by its address (discovery's are) whose certificate
    names a host: checked against `tls_server_name`, not the address."""
    from loadtest.standin_server import StandIn

    _, site = sites.start(StandIn(itl_s=0.001), ssl_context=pki.server_context())
    settings = {"tls_ca_file": str(pki.ca), "tls_server_name": name}
    proxy = Ferry(loop_thread, config([site.url], **settings))
    try:
        if served:
            wait_until(lambda: instance(proxy)["healthy"] and instance(proxy)["models"])
            assert complete(proxy) == " tok" * 5
        else:
            wait_until(lambda: not instance(proxy)["healthy"])
            assert "other.test" in str(instance(proxy)["last_error"])
    finally:
        proxy.close()


def test_a_failed_connection_names_the_tls_settings_not_an_object(loop_thread: Any) -> None:
    """aiohttp's message named the context as Python shows any object
    (`ssl:<ssl.SSLContext object at 0x7f...>`), in a 503 and in /admin."""
    from tests.helpers import free_port

    closed = f"https://127.0.0.1:{free_port()}"
    proxy = Ferry(loop_thread, config([closed], tls_verify=False))
    try:
        wait_until(lambda: not instance(proxy)["healthy"])
        said = str(instance(proxy)["last_error"])
        assert "ssl:tls_*" in said and "object at" not in said, said
    finally:
        proxy.close()


def test_tls_verify_false_serves_a_server_it_does_not_check(
    pki: Pki, sites: Any, loop_thread: Any
) -> None:
    from loadtest.standin_server import StandIn

    _, site = sites.start(StandIn(itl_s=0.001), ssl_context=pki.server_context())
    proxy = Ferry(loop_thread, config([site.url], tls_verify=False))
    try:
        wait_until(lambda: instance(proxy)["healthy"])
        assert complete(proxy) == " tok" * 5
    finally:
        proxy.close()


def test_mutual_tls_presents_the_client_certificate(pki: Pki, sites: Any, loop_thread: Any) -> None:
    """A server that asks for a client certificate signed by its CA: served with
    `tls_cert_file`/`tls_key_file`, refused without. The admin API's instances
    take them from `instance_defaults` (it names no file itself)."""
    from loadtest.standin_server import StandIn

    server = pki.server_context(clients_from=pki.ca)
    _, a = sites.start(StandIn(itl_s=0.001), ssl_context=server)
    _, b = sites.start(StandIn(itl_s=0.001), ssl_context=server)
    _, c = sites.start(StandIn(itl_s=0.001), ssl_context=server)
    defaults = {
        "tls_ca_file": str(pki.ca),
        "tls_cert_file": str(pki.client_cert),
        "tls_key_file": str(pki.client_key),
    }
    raw = {
        "instances": [
            {"name": "i0", "url": a.url},
            {"name": "bare", "url": b.url, "tls_cert_file": None, "tls_key_file": None},
        ],
        "instance_defaults": defaults,
        "scheduler": {"scrape_interval_s": 0.05, "seed": 1},
        "admin_token": "t",
    }
    proxy = Ferry(loop_thread, parse_config(raw, env={}))
    try:
        wait_until(lambda: instance(proxy)["healthy"] and not instance(proxy, "bare")["healthy"])
        assert complete(proxy) == " tok" * 5
        admin = {"Authorization": "Bearer t"}
        added = {"name": "i2", "url": c.url}
        status, answer = call_json(proxy.url + "/admin/instances", "POST", added, admin)
        assert status == 201, answer
        wait_until(lambda: instance(proxy, "i2")["healthy"])  # the defaults' certificate
        named = {"name": "i3", "url": "https://127.0.0.1:1", "tls_ca_file": str(pki.ca)}
        status, answer = call_json(proxy.url + "/admin/instances", "POST", named, admin)
        assert status == 400 and "instance_defaults" in answer["error"]["message"]
    finally:
        proxy.close()


@pytest.mark.parametrize("case", ["missing", "not-pem", "key-alone", "encrypted-key"])
def test_tls_files_ferry_cannot_use_are_a_config_error(case: str, pki: Pki, tmp_path: Path) -> None:
    """Said at once, naming the setting; an encrypted key is refused, not asked
    for on the terminal (which would hold the start forever)."""
    settings: dict[str, Any] = {"tls_ca_file": str(pki.ca)}
    if case == "missing":
        settings["tls_ca_file"] = str(tmp_path / "nowhere.pem")
    elif case == "not-pem":
        (tmp_path / "junk.pem").write_text("not a certificate\n")
        settings["tls_ca_file"] = str(tmp_path / "junk.pem")
    elif case == "key-alone":
        settings["tls_key_file"] = str(pki.client_key)
    else:
        encrypted = tmp_path / "encrypted.key"
        subprocess.run(
            ["openssl", "pkey", "-in", str(pki.client_key), "-aes256", "-passout", "pass:x",
             "-out", str(encrypted)],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        settings.update(tls_cert_file=str(pki.client_cert), tls_key_file=str(encrypted))
    with pytest.raises(ConfigError) as refused:
        config(["https://127.0.0.1:1"], **settings)
    message = str(refused.value)
    assert message.startswith("instances[0]"), message
    if case == "encrypted-key":
        assert "encrypted" in message
    if case in ("missing", "key-alone"):
        assert "tls_" in message


def test_an_applied_reload_reads_the_tls_files_again_and_a_refused_one_does_not(
    pki: Pki, sites: Any, loop_thread: Any, tmp_path: Path
) -> None:
    """A rotated CA is used from the next applied reload on, by every context
    made of it (an admin API instance's too: the file's CA, its own
    `tls_verify`). A refused reload put the files it had read into use all the
    same; it changes nothing now."""
    import shutil

    from loadtest.standin_server import StandIn
    from proxy import tls

    def issuer(settings: Any) -> str:
        (cert,) = tls.context(settings).get_ca_certs()
        return dict(x[0] for x in cert["subject"])["commonName"]

    _, site = sites.start(StandIn(itl_s=0.001), ssl_context=pki.server_context())
    ca = tmp_path / "ca.pem"
    shutil.copy(pki.ca, ca)
    raw: dict[str, Any] = {
        "instances": [{"name": "i0", "url": site.url}],
        "instance_defaults": {"tls_ca_file": str(ca)},
        "scheduler": {"scrape_interval_s": 0.05, "seed": 1},
        "admin_token": "t",
    }
    proxy = Ferry(loop_thread, parse_config(raw, env={}), lambda: parse_config(raw, env={}))
    admin = {"Authorization": "Bearer t"}
    try:
        wait_until(lambda: instance(proxy)["healthy"] and instance(proxy)["models"])
        derived = (str(ca), None, None, False)
        port = site.url.rsplit(":", 1)[1]  # (by another name: another server to Ferry)
        added = {"name": "i1", "url": f"https://localhost:{port}", "tls_verify": False}
        assert call_json(proxy.url + "/admin/instances", "POST", added, admin)[0] == 201
        wait_until(lambda: instance(proxy, "i1")["healthy"])
        mine = (str(ca), None, None, True)
        assert issuer(mine) == issuer(derived) == "ca"
        kept = tls.cached(mine)
        assert call_json(proxy.url + "/admin/reload", "POST", {}, admin)[0] == 200
        assert tls.cached(mine) is kept  # files unchanged: its pooled connections stay
        shutil.copy(pki.stranger_ca, ca)  # rotated; and the file refused for another reason
        raw["instances"].append({"name": "bad", "url": "https://127.0.0.1:1", "tls_ca_file": 7})
        status, _ = call_json(proxy.url + "/admin/reload", "POST", {}, admin)
        assert status == 400
        assert issuer(mine) == issuer(derived) == "ca"  # nothing changed
        raw["instances"].pop()
        status, _ = call_json(proxy.url + "/admin/reload", "POST", {}, admin)
        assert status == 200
        assert issuer(mine) == issuer(derived) == "stranger"
    finally:
        proxy.close()


def test_tls_files_gone_when_first_used_make_the_instance_unhealthy_not_a_crash(
    pki: Pki, sites: Any, loop_thread: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A `--workers` worker started again takes the file as checked at the start,
    and makes its contexts at their first call: a CA file deleted since made
    every scrape raise, unhandled, and the worker die again and again."""
    import shutil

    from loadtest.standin_server import StandIn

    _, site = sites.start(StandIn(itl_s=0.001), ssl_context=pki.server_context())
    ca = tmp_path / "ca.pem"
    shutil.copy(pki.ca, ca)
    checked = config([site.url], tls_ca_file=str(ca))
    ca.unlink()  # after the check, before the first call
    proxy = Ferry(loop_thread, checked)
    try:
        wait_until(lambda: not instance(proxy)["healthy"])
        said = str(instance(proxy)["last_error"])
        assert "TLSFilesUnusable: its TLS files cannot be used" in said, said  # (no "[Errno")
        shutil.copy(pki.ca, ca)  # back: the next look makes its context
        wait_until(lambda: instance(proxy)["healthy"] and instance(proxy)["models"])
        assert complete(proxy) == " tok" * 5
    finally:
        proxy.close()
    assert "Traceback" not in caplog.text and "never retrieved" not in caplog.text
