"""One job over 2 processes with 2 CPU devices each (`kvjax.distributed`), against the same
job in one process with 4: the same losses, checkpoints that load from one to the other,
the same greedy tokens, and a job that loses a process ends instead of hanging.

JAX joins processes when it starts, so each runs in a subprocess of its own, talking over
127.0.0.1 (gloo collectives, JAX's coordination service on a free port). Two launches run
at once, both of `multiprocess/job.py`: the reference job in one process, and the job over
2 processes, which generates from the reference's checkpoint and ends with a run of
`kvjax train` in which process 0 is killed after step 12. Once that job is over, the
reference's process finishes the killed run.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_cli

from kvjax import checkpoint, distributed
from kvjax.train import run_dir

HERE = Path(__file__).parent / "multiprocess"
TIMEOUT = 300  # seconds for a launch
DETECTION = 60  # seconds within which the survivor of a killed process must end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv, log: Path) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = " ".join(  # conftest's optimization level stays
        f for f in env.get("XLA_FLAGS", "").split()
        if "xla_force_host_platform_device_count" not in f)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, HERE / "job.py", *map(str, argv)],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=HERE.parents[2])


def watch(one, victim, survivor, ended: Path) -> tuple[dict, float | None]:
    """Waits for the three processes, killing any still running after `TIMEOUT`, and the
    survivor `DETECTION` + 30 s after the victim died; creates `ended` once both are gone.
    Returns their exit codes (None: killed here) and how long the survivor outlived the
    victim."""
    deadline, died, outlived = time.monotonic() + TIMEOUT, None, None
    procs = {"one": one, "victim": victim, "survivor": survivor}
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        if died is None and victim.poll() is not None:
            died = time.monotonic()
        if died is not None and outlived is None:
            if survivor.poll() is None and time.monotonic() - died > DETECTION + 30:
                survivor.kill()
            if survivor.poll() is not None:
                outlived = time.monotonic() - died
        if victim.poll() is not None and survivor.poll() is not None:
            ended.touch()  # the reference's process may now finish the killed run
        time.sleep(0.1)
    codes = {name: proc.poll() for name, proc in procs.items()}
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return codes, outlived


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jobs")
    words = "zero one two three four five six seven eight nine ten eleven twelve".split()
    lines = np.random.default_rng(0).choice(words, (600, 12))
    text = tmp / "text.txt"
    text.write_text("".join(" ".join(line) + ".\n" for line in lines))
    common = [tmp, "--text", text]
    started = time.monotonic()
    one = start([*common, "--name", "one", "--resume", tmp / "killed", "--cpu-devices", 4],
                tmp / "one.log")
    address = f"127.0.0.1:{free_port()}"
    two = [start([*common, "--name", "two", "--load", "one", "--die-in", tmp / "killed",
                  "--coordinator", address, "--num-processes", 2, "--process-id", i,
                  "--cpu-devices", 2], tmp / f"two-{i}.log") for i in range(2)]
    codes, outlived = watch(one, two[0], two[1], tmp / "killed.ended")
    logs = {name: (tmp / f"{name}.log").read_text() for name in ("one", "two-0", "two-1")}
    print(f"launches took {time.monotonic() - started:.1f} s; the survivor ended "
          f"{outlived} s after process 0 died")
    assert codes["one"] == 0, logs["one"][-3000:]
    assert (tmp / "two.json").exists(), logs["two-0"][-3000:] + logs["two-1"][-3000:]
    results = {name: json.loads((tmp / f"{name}.json").read_text())
               for name in ("one", "two", "resumed")}
    return tmp, results, {"codes": codes, "seconds": outlived, "log": logs["two-1"]}


def losses(record) -> np.ndarray:
    return np.array([record["losses"][str(step)] for step in range(1, 21)])


@pytest.mark.parametrize("variant", ["lm", "translate"])
def test_losses_over_two_processes_equal_one_process(runs, variant):
    _, results, _ = runs
    one, two = results["one"], results["two"]
    assert (one["processes"], one["devices"]) == (1, 4)
    assert (two["processes"], two["devices"]) == (2, 4)
    assert two["rows"] == "slice(0, 4, None)"  # process 0's half of each batch of 8
    assert sorted(two[variant]["losses"], key=int) == [str(s) for s in range(1, 21)]
    np.testing.assert_allclose(losses(two[variant]), losses(one[variant]), rtol=1e-5)
    assert losses(one[variant])[-1] < losses(one[variant])[0]
    assert two[variant]["metrics"]["val_loss"] == pytest.approx(
        one[variant]["metrics"]["val_loss"], rel=1e-5)


def test_greedy_tokens_over_two_processes_equal_one_process(runs):
    _, results, _ = runs
    one, two = results["one"]["generated"], results["two"]["generated"]  # same checkpoint
    for generated in (one, two):
        assert generated["placed"]
    assert two["not_fully_addressable"] > 0 and one["not_fully_addressable"] == 0
    assert two["tokens"] == one["tokens"]
    np.testing.assert_allclose(two["logprobs"], one["logprobs"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["lm", "translate"])
def test_checkpoint_of_two_processes_loads_in_one(runs, variant):
    tmp, _, _ = runs
    two, one = tmp / f"two-{variant}", tmp / f"one-{variant}"
    assert checkpoint.read_manifest(two)["sha256"]  # checked by every load below
    _, _, params = checkpoint.load_for_sampling(two)
    _, _, reference = checkpoint.load_for_sampling(one)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert all(leaf.sharding == device for leaf in jax.tree.leaves(params))
    # The same training in one process ends with nearly the same weights.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5),
                 params, reference)
    records = run_dir.MetricsLog(two / run_dir.METRICS_FILE, 20).read()
    assert [r["step"] for r in records] == [10, 20]  # written once, by process 0
    assert (two / run_dir.RUN_FILE).exists() and (two / run_dir.LOSS_CURVE_FILE).exists()


def test_a_killed_process_ends_the_job_and_its_checkpoint_resumes(runs):
    tmp, results, kill = runs
    codes, log = kill["codes"], kill["log"]
    assert codes["victim"] == -9, log[-3000:]
    assert codes["survivor"] not in (0, None), log[-3000:]  # None: killed here, still running
    assert kill["seconds"] is not None and kill["seconds"] < DETECTION, log[-3000:]
    assert "another task died" in log, log[-3000:]  # JAX's coordination service's words
    # Resumed by the reference's one process from what two processes saved.
    saved, resumed = results["resumed"]["saved"], results["resumed"]["losses"]
    assert saved in (5, 10)  # the last complete checkpoint: the one at step 10 may be cut off
    assert sorted(resumed, key=int) == [str(s) for s in range(saved + 1, 21)]
    reference = results["one"]["lm"]["losses"]
    np.testing.assert_allclose([resumed[s] for s in sorted(resumed, key=int)],
                               [reference[s] for s in sorted(resumed, key=int)], rtol=1e-5)
    records = run_dir.MetricsLog(tmp / "killed" / run_dir.METRICS_FILE, 20).read()
    assert [r["step"] for r in records] == [10, 20]


@pytest.mark.parametrize("coordinator, num_processes, process_id, message", [
    ("127.0.0.1:1234", 2, 2, "process_id=2 must be below num_processes=2"),
    ("127.0.0.1", 2, 0, "coordinator '127.0.0.1' is not HOST:PORT"),
    ("127.0.0.1:99999", 2, 0, "coordinator '127.0.0.1:99999' is not HOST:PORT"),
    (":1234", 2, 0, "coordinator ':1234' is not HOST:PORT"),
    ("127.0.0.1:1234", 0, 0, "num_processes=0 must be an integer >= 1"),
    ("127.0.0.1:1234", 2, -1, "process_id=-1 must be an integer >= 0"),
])
def test_bad_start_up_values_are_refused_naming_them(coordinator, num_processes, process_id,
                                                      message):
    with pytest.raises(ValueError, match=message):
        distributed.initialize(coordinator, num_processes, process_id)


def test_bad_start_up_environment_is_refused_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("KVJAX_PROCESS_ID", "first")
    with pytest.raises(ValueError, match="KVJAX_PROCESS_ID='first' is not an integer"):
        distributed.initialize("127.0.0.1:1234", 2)
    monkeypatch.setenv("KVJAX_PROCESS_ID", "3")
    code, _, err = run_cli(capsys, "train", "--task", "lm", "--coordinator", "127.0.0.1:1234",
                           "--num-processes", 2)
    assert code == 2
    assert "process_id=3 must be below num_processes=2" in err


def test_processes_started_differently_are_refused(monkeypatch):
    from jax.experimental import multihost_utils

    def gather(theirs):  # 2 processes: this one, and process 1 started with `theirs`
        def allgather(digest):
            other = np.frombuffer(hashlib.sha256(theirs).digest(), np.uint32)
            return np.stack([digest, other])
        return allgather

    monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
    monkeypatch.setattr(multihost_utils, "process_allgather", gather(b"settings"))
    distributed.check_same("settings", b"settings")
    monkeypatch.setattr(multihost_utils, "process_allgather", gather(b"other"))
    with pytest.raises(ValueError, match="process 1 was started with other settings than "
                                         "process 0"):
        distributed.check_same("settings", b"settings")
