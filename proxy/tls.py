"""TLS to the instances: the context an https instance's calls are made with.

An https instance is checked against the system's trusted roots, as any client
would. Its `tls_ca_file` trusts that bundle instead (a private CA), its
`tls_cert_file`/`tls_key_file` present a client certificate (mutual TLS), and
`tls_verify: false` checks nothing (a test fleet's self-signed servers).

Contexts are kept by their settings, and made in a worker thread (reading the
system's roots takes tens of milliseconds): a call finds its instance's with
a dict lookup (proxy/upstream.py `tls_of`). When a reload is applied, those of
the instances then served are made again where their files changed
(`reread`): a rotated certificate is taken by the connections opened after
it, and an unchanged one keeps its pooled connections (aiohttp pools them by
context). Reading a configuration makes each of its contexts once to check
its files (`check`), and keeps none: a reload that is refused changes nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
import threading
from collections.abc import Iterable

log = logging.getLogger("ferry.tls")

Settings = tuple[str | None, str | None, str | None, bool]  # CA, cert, key, verify
_Stamp = tuple[tuple[int, ...] | None, ...]  # its files' inode, size and times

_made: dict[Settings, tuple[ssl.SSLContext, _Stamp]] = {}
_changing = threading.Lock()  # the threads that make contexts (the event loop only reads)


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
        try:
            made.load_cert_chain(cert_file, key_file, password=_no_password)
        except ssl.SSLError as exc:  # OpenSSL's "[SSL] PEM lib" names neither file
            where = f"{cert_file} with key {key_file}" if key_file else f"{cert_file} (no key file)"
            raise ValueError(
                f"{where}: not a PEM certificate and its unencrypted private key ({exc})"
            ) from None
    return made


def check(settings: Settings) -> None:
    """Raise as `load` does where `settings`' files cannot be used. Checked once
    while the files stay as they were: the instances that share settings (an
    `instance_defaults` given to a hundred) are not each a read of them."""
    _checked(settings, _stamp(settings))


@functools.lru_cache(maxsize=256)
def _checked(settings: Settings, stamp: _Stamp) -> None:
    load(settings)  # (a failure is not cached: it raises)


def cached(settings: Settings) -> ssl.SSLContext | None:
    """The context in use for `settings`, if one was made."""
    kept = _made.get(settings)
    return None if kept is None else kept[0]


def context(settings: Settings) -> ssl.SSLContext:
    """The context in use for `settings`, made now if none is (in a thread:
    it reads files); raises as `load` does."""
    made = cached(settings)
    if made is None:
        with _changing:
            made = cached(settings)  # (another thread's, made while this one waited)
            if made is None:
                stamp = _stamp(settings)
                made = load(settings)
                _made[settings] = made, stamp
    return made


def reread(serving: Iterable[Settings]) -> None:
    """Now that a reload is applied: keep the contexts of the instances
    `serving`, each made again if its files changed (one whose files cannot be
    read now keeps those it had), and drop the others."""
    wanted = set(serving)
    # (One at a time: a reload whose client left goes on in its thread.)
    with _changing:
        for settings, (_, was) in list(_made.items()):
            if settings not in wanted:
                del _made[settings]
                continue
            stamp = _stamp(settings)
            if stamp == was:
                continue
            try:
                _made[settings] = load(settings), stamp
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning("TLS files %s not read again, kept as they were: %s", settings[:3], exc)


def _stamp(settings: Settings) -> _Stamp:
    def of(path: str | None) -> tuple[int, ...] | None:
        try:
            found = os.stat(path) if path else None
        except OSError:
            return None
        if found is None:
            return None
        # (ctime too: a copy that keeps its mtime, `cp -p`, is still a change.)
        return found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns

    return tuple(of(path) for path in settings[:3])


class _Context(ssl.SSLContext):
    """aiohttp's connection errors name the context (`ssl:<...SSLContext object
    at 0x7f...>`, in a 503's message and /admin/instances): by what it is."""

    def __repr__(self) -> str:
        return "tls_*"


def _no_password() -> bytes:
    raise ValueError("the key is encrypted: Ferry takes an unencrypted one")
