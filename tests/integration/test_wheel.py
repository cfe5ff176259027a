"""The built wheel, as `pip install llm-ferry` gets it: built from this tree,
installed into a fresh venv with its runtime dependencies (from the package
index pip is configured with), then `ferry --version` and `ferry init`.

About 20 s here: the wheel builds without isolation (this venv's setuptools),
and pip fetches aiohttp, uvloop, prometheus-client, pyyaml, pyzmq and msgspec (cached
after once).
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from proxy.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_wheel_installs_and_writes_the_example(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", wheels, ROOT,
    )  # fmt: skip
    (wheel,) = wheels.glob("llm_ferry-*.whl")
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    run(env / "bin" / "pip", "install", "-q", "--disable-pip-version-check", wheel)
    work = tmp_path / "work"
    work.mkdir()
    ferry = env / "bin" / "ferry"
    # Run outside the checkout, so nothing of it is importable by accident.
    assert run(ferry, "--version", cwd=work).startswith("ferry ")
    run(ferry, "init", cwd=work)
    written = work / "ferry.yaml"
    assert written.read_text() == (ROOT / "configs" / "example.yaml").read_text()
    assert load_config(written).instances
    refused = subprocess.run([ferry, "init"], cwd=work, capture_output=True, text=True)
    assert refused.returncode == 1 and "--force" in refused.stderr
    run(ferry, "init", "--force", cwd=work)
