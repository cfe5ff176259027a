"""Client API keys: who may use Ferry's OpenAI routes.

With `api_keys` set (the YAML, or FERRY_API_KEYS), every route but health,
readiness, metrics and /admin (which has its own token) needs
`Authorization: Bearer <one of the keys>`; without it a client gets 401 in
OpenAI's error shape, as OpenAI answers a wrong key. Without this, a Ferry in
front of keyed engines (each instance's `api_key`) would serve anyone who can
reach it with the engines' keys.

A client's key is Ferry's, not an engine's: it is not sent on to the instances
(`CHECKED` tells the relay to drop it). The keys are read per request from the
running configuration, so a reload rotates them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Callable

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from proxy.config import FerryConfig
from proxy.errors import error_response

# Probes and scrapers carry no client key; /admin checks its own token.
OPEN_PATHS = frozenset({"/health", "/livez", "/readyz", "/ping", "/metrics"})
CHECKED = web.RequestKey("client_key_checked", bool)  # the Authorization was Ferry's key


def middleware(keys: Callable[[], tuple[str, ...]]) -> Middleware:
    """Answer 401 to a request without a valid key while `keys()` is not empty."""

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        allowed = keys()
        if not needs_key(request, allowed):
            return await handler(request)
        if not authorized(request.headers.get("Authorization", ""), allowed):
            answer = refused()
            if hdrs.EXPECT in request.headers:
                # Not told to continue (server.py's `_expect_continue`), the
                # client may send its body or not: no telling where the next
                # request would begin.
                answer.force_close()
            return answer
        request[CHECKED] = True
        return await handler(request)

    return check_key


def needs_key(request: web.Request, allowed: tuple[str, ...]) -> bool:
    """Whether `request` must carry one of the keys `allowed` (none: no key is asked)."""
    path = request.path
    return bool(allowed) and not (
        path in OPEN_PATHS or path == "/admin" or path.startswith("/admin/")
    )


def refused() -> web.Response:
    return error_response(
        401,
        "missing or wrong API key: send it as Authorization: Bearer <key>",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def authorized(header: str, keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header carries one of `keys` as a bearer token.
    Digests of equal length are compared in constant time, every key each time,
    so the answer's timing says nothing of how much of a guess, or of its
    length, was right."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
    matched = False
    for digest in _digests(keys):
        matched |= hmac.compare_digest(given, digest)
    return matched


@functools.lru_cache(maxsize=8)
def _digests(keys: tuple[str, ...]) -> tuple[bytes, ...]:
    """The keys' digests, once per set of keys (a reload brings a new one)."""
    return tuple(hashlib.sha256(key.encode()).digest() for key in keys)


def describe(config: FerryConfig) -> str:
    """For the start-up line: whether clients need a key."""
    n = len(config.api_keys)
    return f"clients need one of {n} API key{'s' if n > 1 else ''}" if n else "no client key asked"
