"""`ferry vllm [vLLM server arguments]`: vLLM's own OpenAI server with the shim on.

It adds the two flags that turn the shim on and runs vLLM in this process's
place. The same can be done by hand:

    vllm serve MODEL ... \
      --kv-transfer-config '{"kv_connector": "FerryConnector",
                             "kv_connector_module_path": "migration_shim.connector",
                             "kv_role": "kv_both", "kv_port": 14579,
                             "kv_load_failure_policy": "recompute"}' \
      --middleware migration_shim.control.middleware

`kv_port` is where this instance receives KV blocks from other instances; it
must differ per instance on one host. `kv_connector_extra_config` may set
`host` (the address others reach the port on, default 127.0.0.1), `lease_s`
(how long staged blocks wait to be claimed) and `staging_bytes`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys

CONNECTOR = "FerryConnector"
CONNECTOR_MODULE = "migration_shim.connector"
MIDDLEWARE = "migration_shim.control.middleware"


def shim_flags(kv_port: int, host: str = "127.0.0.1") -> list[str]:
    config = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_port": kv_port,
        # A block that fails to load is recomputed, never a failed request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host": host},
    }
    return ["--kv-transfer-config", json.dumps(config), "--middleware", MIDDLEWARE]


def command(vllm_args: list[str], kv_port: int | None = None, host: str = "127.0.0.1") -> list[str]:
    if any(a.startswith("--kv-transfer-config") for a in vllm_args):
        raise SystemExit("ferry vllm: --kv-transfer-config is set by the shim; drop it")
    port = kv_port or free_port(host)
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *vllm_args,
        *shim_flags(port, host),
    ]


def run(vllm_args: list[str], kv_port: int | None, host: str) -> int:
    argv = command(vllm_args, kv_port, host)
    os.execv(argv[0], argv)  # vLLM takes this process's place: signals reach it directly
    return 0  # not reached


# Ports handed out below the kernel's ephemeral range (32768 and up on Linux):
# a port the kernel picks is one it may give the next outgoing connection too,
# and vLLM binds its KV port only once it has loaded the model, tens of seconds
# later. Seen: "Address already in use" on a busy test machine.
FREE_PORTS = range(20000, 32000)
_PICK = random.Random()  # its own: a test's seeded `random` must not pick ports
# Handed out by this process: a port picked for a server not yet bound is free
# to the kernel, so without this a second pick could name it again.
_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range, and not one
    this process handed out before."""
    for _ in range(1000):
        port = _PICK.choice(FREE_PORTS)
        if port in _HANDED_OUT:
            continue
        _HANDED_OUT.add(port)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} in {FREE_PORTS}")
