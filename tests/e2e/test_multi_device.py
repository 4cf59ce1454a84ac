"""Runs the tests in `tests/e2e/multidevice/` on 8 emulated CPU devices.

JAX fixes its device count when it starts, and this process started it with one device, so
the files run in a pytest process of their own with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`. The files are named `check_*.py`, so
the suite's own collection skips them.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "multidevice"
DEVICES = 8


def run_on_devices(names: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess,
                                                              dict[str, list[str]]]:
    """One pytest process over the files `names`: its outcome, and each file's tests'
    outcomes ("passed", "failed", "error" or "skipped", from its JUnit report)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    report = tmp_path / "report.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *[str(HERE / name) for name in names], "--basetemp", str(tmp_path / "basetemp"),
         "--junitxml", str(report)],
        capture_output=True, text=True, timeout=600, env=env, cwd=HERE.parents[2])
    outcomes: dict[str, list[str]] = {name: [] for name in names}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            name = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
            outcomes.setdefault(name, []).append(
                next((OUTCOMES[child.tag] for child in case if child.tag in OUTCOMES), "passed"))
    return done, outcomes


OUTCOMES = {"failure": "failed", "error": "error", "skipped": "skipped"}  # JUnit's tags


def _tail(done: subprocess.CompletedProcess) -> str:
    return done.stdout[-6000:] + done.stderr[-3000:]


def check_ran_and_passed(name: str, done: subprocess.CompletedProcess,
                         outcomes: dict[str, list[str]]) -> None:
    ran = outcomes.get(name, [])
    assert ran and "passed" in ran, f"no test of {name} passed:\n{_tail(done)}"
    assert not {"failed", "error"} & set(ran), f"{name}: {ran}\n{_tail(done)}"


def check_on_eight_devices(name: str, tmp_path: Path) -> None:
    done, outcomes = run_on_devices([name], tmp_path)
    check_ran_and_passed(name, done, outcomes)
    assert done.returncode == 0, _tail(done)


# The longest file runs from a module of its own (test_multi_device_generate.py): xdist hands
# out whole modules, and one module of all of them (a minute and a half more) could leave one
# worker running it alone at the end of the suite while the other waits.
ON_THEIR_OWN = ("check_generate.py",)
TOGETHER = sorted(p.name for p in HERE.glob("check_*.py") if p.name not in ON_THEIR_OWN)


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    """The other files in one pytest process: its start and the programs the files share
    are paid once."""
    return run_on_devices(TOGETHER, tmp_path_factory.mktemp("eight_devices"))


@pytest.mark.parametrize("name", TOGETHER)
def test_on_eight_devices(name, together):
    done, outcomes = together
    check_ran_and_passed(name, done, outcomes)
    # A process that failed with every test passing (at exit, say) fails every file.
    failed = {"failed", "error"} & {o for other in TOGETHER for o in outcomes.get(other, [])}
    assert done.returncode == 0 or failed, _tail(done)
