"""kvjax/checkpoint/save.py: exact round trips, retention, atomic saves (a process killed
mid-save leaves the previous step loadable), and errors of a background save surfacing."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint._src.path.atomicity as orbax_atomicity
import pytest
from checkpoint_support import (
    abstract_of,
    assert_trees_equal,
    make_state,
    step_dirs,
)

from kvjax import checkpoint as ckpt
from kvjax.checkpoint import Checkpointer, CheckpointError

REPO_ROOT = Path(__file__).resolve().parents[2]
TMP_SUFFIX = ".orbax-checkpoint-tmp"


# Round trips and retention ---------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [True, False])
def test_restore_gives_identical_arrays(tmp_path, async_save):
    state = make_state(seed=3)
    with Checkpointer(tmp_path, save_every=1, keep=1, async_save=async_save) as checkpointer:
        assert checkpointer.save(3, state)

    step, restored = ckpt.restore_latest(tmp_path, abstract_of(state))

    assert step == 3
    assert_trees_equal(restored, state)
    assert restored["params"]["layer"]["w"].dtype == jnp.bfloat16
    restored_key, saved_key = (jax.random.wrap_key_data(s["rng"]) for s in (restored, state))
    np.testing.assert_array_equal(
        jax.random.normal(restored_key, (4,)), jax.random.normal(saved_key, (4,))
    )
    assert_trees_equal(ckpt.restore_params(tmp_path, abstract_of(state["params"])), state["params"])


def test_relative_directories_save_and_restore(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = make_state(seed=4)
    with Checkpointer("runs/relative", save_every=1, keep=1) as checkpointer:
        assert checkpointer.save(2, state)
    step, restored = ckpt.restore_latest("runs/relative", abstract_of(state))
    assert step == 2
    assert_trees_equal(restored, state)


def test_numpy_leaves_are_stored_as_jax_holds_them(tmp_path):
    state = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "pos": np.int64(7)}
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        checkpointer.save(0, state)
        state["params"]["w"][:] = -1  # the save already owns a copy

    _, restored = ckpt.restore_latest(tmp_path, abstract_of(state))

    np.testing.assert_array_equal(restored["params"]["w"], np.arange(6).reshape(2, 3))
    assert restored["pos"].dtype == jnp.asarray(np.int64(7)).dtype
    assert int(restored["pos"]) == 7


def test_keeps_only_the_last_k_steps(tmp_path):
    with Checkpointer(tmp_path, save_every=1, keep=2) as checkpointer:
        for step in range(1, 6):
            assert checkpointer.save(step, make_state(step))
    assert step_dirs(tmp_path) == [4, 5]
    step, restored = ckpt.restore_latest(tmp_path, abstract_of(make_state()))
    assert step == 5
    assert_trees_equal(restored, make_state(5))


def test_maybe_save_respects_save_every_and_final_save_forces(tmp_path):
    with Checkpointer(tmp_path, save_every=3, keep=10) as checkpointer:
        saved = [step for step in range(1, 11) if checkpointer.maybe_save(step, make_state(step))]
        assert saved == [3, 6, 9]
        assert checkpointer.save(10, make_state(10), force=True)
        # The last step is often also a due step: saving it again is a no-op, not an error.
        assert not checkpointer.save(10, make_state(10), force=True)
        assert not checkpointer.maybe_save(9, make_state(9))
        with pytest.raises(ValueError, match="step 8 is older than step 10"):
            checkpointer.save(8, make_state(8), force=True)
        assert checkpointer.all_steps() == [3, 6, 9, 10]
    assert step_dirs(tmp_path) == [3, 6, 9, 10]
    assert ckpt.latest_step(tmp_path) == 10


def test_rejects_typed_prng_keys(tmp_path):
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        with pytest.raises(TypeError, match="key_data"):
            checkpointer.save(1, {"rng": jax.random.key(0)})


# Atomicity and failures while saving -----------------------------------------------------------

_KILLED_CHILD = """
import sys
import jax.numpy as jnp
import numpy as np
from kvjax.checkpoint import Checkpointer

checkpointer = Checkpointer(sys.argv[1], save_every=1, keep=5)
checkpointer.save(1, {"w": jnp.arange(8.0)})
checkpointer.wait()
big = np.random.default_rng(0).random(50_000_000, dtype=np.float32)  # 200 MB, incompressible
checkpointer.save(2, {"w": jnp.arange(8.0) + 1, "big": jnp.asarray(big)})
print("saving", flush=True)
checkpointer.wait()
print("saved", flush=True)
"""


def _bytes_under(path: Path) -> int | None:
    """Total size of the files under `path`, or None once it no longer exists (renamed)."""
    try:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except FileNotFoundError:
        return None


def test_process_killed_mid_save_leaves_previous_step_loadable(tmp_path):
    directory = tmp_path / "run"
    in_progress = directory / f"2{TMP_SUFFIX}"
    with open(tmp_path / "child.log", "w+") as log:
        child = subprocess.Popen(
            [sys.executable, "-c", _KILLED_CHILD, str(directory)],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            started = any(line.strip() == "saving" for line in child.stdout)
            # Kill once the array bytes are streaming to disk (or, if that is missed, whenever
            # the save happens to be), so that the kill lands in the middle of writing data.
            deadline = time.monotonic() + 10
            while started and time.monotonic() < deadline:
                written = _bytes_under(in_progress)
                if written is None or written > 8_000_000:
                    break
                time.sleep(0.002)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=60)
            child.stdout.close()
        log.seek(0)
        assert started, f"the child failed before saving step 2:\n{log.read()[-3000:]}"
    assert child.returncode in (-signal.SIGKILL, 0)  # 0: it finished before the kill

    leftovers = [p.name for p in directory.iterdir() if TMP_SUFFIX in p.name]
    step = ckpt.latest_step(directory)
    if step == 1:  # the normal case: the kill landed while step 2 was being written
        assert leftovers, "a save in progress should exist only as a temporary directory"
        _, restored = ckpt.restore_latest(directory, {"w": jax.ShapeDtypeStruct((8,), jnp.float32)})
        np.testing.assert_array_equal(restored["w"], np.arange(8.0))
    else:  # the background write had already been renamed into place: it must be complete
        assert step == 2 and not leftovers
        big = np.random.default_rng(0).random(50_000_000, dtype=np.float32)
        _, restored = ckpt.restore_latest(directory, abstract_of({"w": jnp.zeros(8), "big": big}))
        np.testing.assert_array_equal(restored["big"], big)

    # The next writer clears the leftover and saves normally.
    with Checkpointer(directory, save_every=1, keep=5) as checkpointer:
        checkpointer.save(3, {"w": jnp.arange(8.0) + 3})
    assert not [p.name for p in directory.iterdir() if TMP_SUFFIX in p.name]
    assert ckpt.latest_step(directory) == 3


@pytest.fixture
def failing_finalize(monkeypatch):
    """Makes orbax's final rename fail. Permissions cannot do it: the tests may run as root."""

    async def finalize(self):
        raise OSError(f"simulated disk failure finalizing {self.get()}")

    def arm():
        monkeypatch.setattr(orbax_atomicity.AtomicRenameTemporaryPath, "finalize", finalize)

    return arm


def test_async_save_error_surfaces_at_wait(tmp_path, failing_finalize):
    checkpointer = Checkpointer(tmp_path, save_every=1, keep=5, async_save=True)
    checkpointer.save(1, make_state(1))
    checkpointer.wait()
    failing_finalize()

    assert checkpointer.save(2, make_state(2))  # returns before the background write fails
    with pytest.raises(CheckpointError, match="saving step 2 to .* failed") as info:
        checkpointer.wait()
    assert isinstance(info.value.__cause__, OSError)
    checkpointer.close()

    assert step_dirs(tmp_path) == [1]
    step, restored = ckpt.restore_latest(tmp_path, abstract_of(make_state()))
    assert step == 1
    assert_trees_equal(restored, make_state(1))


def test_async_save_error_surfaces_when_leaving_the_with_block(tmp_path, failing_finalize):
    with pytest.raises(CheckpointError, match="saving step 1"):
        with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer:
            failing_finalize()
            checkpointer.save(1, make_state(1))
    assert ckpt.latest_step(tmp_path) is None


def test_sync_save_error_raises_from_save(tmp_path, failing_finalize):
    failing_finalize()
    with Checkpointer(tmp_path, save_every=1, keep=5, async_save=False) as checkpointer:
        with pytest.raises(CheckpointError, match="saving step 1"):
            checkpointer.save(1, make_state(1))
