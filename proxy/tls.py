"""TLS to the instances: the context an https instance's calls are made with.

An https instance is checked against the system's trusted roots, as any client
would. Its `tls_ca_file` trusts that bundle instead (a private CA), its
`tls_cert_file`/`tls_key_file` present a client certificate (mutual TLS), and
`tls_verify: false` checks nothing (a test fleet's self-signed servers).

Contexts are made when the configuration is read (`context(..., fresh=True)`),
where a file that cannot be read is a configuration error, and kept by their
settings: a call finds its instance's with a dict lookup, and reads no file on
the event loop. A reload reads the files again (a refused one too: the files
are what they are), so a rotated certificate is taken by the connections
opened after it.
"""

from __future__ import annotations

import contextlib
import ssl

Settings = tuple[str | None, str | None, str | None, bool]  # CA, cert, key, verify

_made: dict[Settings, ssl.SSLContext] = {}


def context(settings: Settings, *, fresh: bool = False) -> ssl.SSLContext:
    """The client context for `settings`; `fresh` reads its files again, and
    those of every other context made of one of them (an admin API instance's:
    the file's files, its own `tls_verify`). Raises OSError or ssl.SSLError
    where a file cannot be read as PEM."""
    made = None if fresh else _made.get(settings)
    if made is None:
        made = _made[settings] = _make(settings)
        files = {f for f in settings[:3] if f}
        if fresh and files:
            for other in [s for s in _made if s != settings and files & set(s[:3])]:
                with contextlib.suppress(OSError, ssl.SSLError, ValueError):
                    _made[other] = _make(other)  # (else it keeps the files it had)
    return made


def _make(settings: Settings) -> ssl.SSLContext:
    ca_file, cert_file, key_file, verify = settings
    made = ssl.create_default_context(cafile=ca_file)  # the system's roots without one
    if not verify:
        made.check_hostname = False
        made.verify_mode = ssl.CERT_NONE
    if cert_file:
        # An encrypted key is refused, not asked for on the terminal (OpenSSL's way).
        made.load_cert_chain(cert_file, key_file, password=_no_password)
    return made


def _no_password() -> bytes:
    raise ValueError("the key is encrypted: Ferry takes an unencrypted one")
