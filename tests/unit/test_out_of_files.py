"""Telling Ferry's own shortage of file descriptors from an instance's failure
(proxy/upstream.py `out_of_files`): a connect that fails with EMFILE, and a name
lookup that fails because the resolver had no descriptor left (glibc then says
"Name or service not known", even of localhost)."""

from __future__ import annotations

import errno
import os
import resource
import socket
from typing import Any

import aiohttp
import pytest

from proxy import upstream
from proxy.upstream import OutOfFiles, out_of_files

KEY: Any = None  # aiohttp's connection key: only printed


def connect_error(cause: OSError) -> aiohttp.ClientConnectorError:
    try:
        raise aiohttp.ClientConnectorError(KEY, cause) from cause
    except aiohttp.ClientConnectorError as exc:
        return exc


def test_emfile_on_a_connect_is_ferrys_and_a_refused_connect_is_the_instances() -> None:
    assert out_of_files(connect_error(OSError(errno.EMFILE, "Too many open files")))
    assert out_of_files(connect_error(OSError(errno.ENFILE, "Too many open files in system")))
    assert out_of_files(OutOfFiles("counted already"))
    assert not out_of_files(connect_error(ConnectionRefusedError(errno.ECONNREFUSED, "no")))


@pytest.mark.parametrize("spare", [2, 500])
def test_a_failed_lookup_is_ferrys_where_its_descriptors_ran_out(
    spare: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    used = len(os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    monkeypatch.setattr(upstream.resource, "getrlimit", lambda _: (used + spare, hard))
    monkeypatch.setattr(upstream, "_FILE_COUNT", [float("-inf"), False])  # counted anew
    lookup = connect_error(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert out_of_files(lookup) is (spare < upstream.FILES_SPARE)
