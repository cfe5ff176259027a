"""TLS to the instances: the context an https instance's calls are made with.

An https instance is checked against the system's trusted roots, as any client
would. Its `tls_ca_file` trusts that bundle instead (a private CA), its
`tls_cert_file`/`tls_key_file` present a client certificate (mutual TLS), and
`tls_verify: false` checks nothing (a test fleet's self-signed servers).

Contexts are kept by their settings: a call finds its instance's with a dict
lookup. One is made at its first call, and made again, from the files as they
are then, when a reload is applied (`reread`): a rotated certificate is taken
by the connections opened after it. Reading a configuration makes each of its
contexts once to check its files (`load`), and keeps none: a reload that is
refused changes nothing.
"""

from __future__ import annotations

import logging
import ssl

log = logging.getLogger("ferry.tls")

Settings = tuple[str | None, str | None, str | None, bool]  # CA, cert, key, verify

_made: dict[Settings, ssl.SSLContext] = {}


def load(settings: Settings) -> ssl.SSLContext:
    """A client context made from `settings`' files as they are now. Raises
    OSError, ssl.SSLError or ValueError where one cannot be read as PEM."""
    ca_file, cert_file, key_file, verify = settings
    made = _Context(ssl.PROTOCOL_TLS_CLIENT)  # as ssl.create_default_context makes it
    if ca_file:
        made.load_verify_locations(ca_file)
    else:
        made.load_default_certs()
    if not verify:
        made.check_hostname = False
        made.verify_mode = ssl.CERT_NONE
    if cert_file:
        # An encrypted key is refused, not asked for on the terminal (OpenSSL's way).
        made.load_cert_chain(cert_file, key_file, password=_no_password)
    return made


def context(settings: Settings) -> ssl.SSLContext:
    """The context in use for `settings`, made now if none is (its first call,
    in a worker started again, say); raises as `load` does."""
    made = _made.get(settings)
    if made is None:
        made = _made[settings] = load(settings)
    return made


def reread() -> None:
    """Make every context in use again from its files, now that a reload is
    applied; one whose files cannot be read now keeps the files it had."""
    for settings in list(_made):
        try:
            _made[settings] = load(settings)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("TLS files %s not read again, kept as they were: %s", settings[:3], exc)


class _Context(ssl.SSLContext):
    """aiohttp's connection errors name the context (`ssl:<...SSLContext object
    at 0x7f...>`, in a 503's message and /admin/instances): by what it is."""

    def __repr__(self) -> str:
        return "tls_*"


def _no_password() -> bytes:
    raise ValueError("the key is encrypted: Ferry takes an unencrypted one")
