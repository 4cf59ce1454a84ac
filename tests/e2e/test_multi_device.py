"""Runs the tests in `tests/e2e/multidevice/` on 8 emulated CPU devices.

JAX fixes its device count when it starts, and this process started it with one device, so
each file runs in its own pytest process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`. The files are named `check_*.py`, so
the suite's own collection skips them.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "multidevice"
DEVICES = 8


def run_on_devices(path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", str(path),
         "--basetemp", str(tmp_path / "basetemp")],
        capture_output=True, text=True, timeout=600, env=env, cwd=HERE.parents[2])


# The longest file runs from a module of its own (test_multi_device_generate.py): xdist hands
# out whole modules, and one module of all three (a minute and a half) could leave one worker
# running it alone at the end of the suite while the other waits.
ON_THEIR_OWN = ("check_generate.py",)


def check_on_eight_devices(name: str, tmp_path: Path) -> None:
    done = run_on_devices(HERE / name, tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


@pytest.mark.parametrize("name", sorted(p.name for p in HERE.glob("check_*.py")
                                        if p.name not in ON_THEIR_OWN))
def test_on_eight_devices(name, tmp_path):
    check_on_eight_devices(name, tmp_path)
