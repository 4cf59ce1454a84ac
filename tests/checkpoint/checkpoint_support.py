"""Checkpoint test helpers shared by the tests of save, restore, load and metadata."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import checkpoint as ckpt
from kvjax.checkpoint import Checkpointer

TOKENIZER = b"tokenizer bytes"


def make_state(seed: int = 0, d_model: int = 8) -> dict:
    """A small training state shaped like the trainer's, with a bfloat16 leaf and optax tuples."""
    k_embed, k_w, k_rng = jax.random.split(jax.random.key(seed), 3)
    params = {
        "embed": jax.random.normal(k_embed, (16, d_model)),
        "layer": {
            "w": jax.random.normal(k_w, (d_model, d_model)).astype(jnp.bfloat16),
            "b": jnp.full((d_model,), seed, jnp.float32),
        },
    }
    return {
        "params": params,
        "opt_state": optax.adamw(1e-3).init(params),
        "step": jnp.int32(seed),
        "rng": jax.random.key_data(k_rng),
        "data_position": jnp.int32(1000 + seed),
    }


def abstract_of(tree):
    return jax.eval_shape(lambda: tree)


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    pairs = zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True)
    for (path, a), e in pairs:
        name = jax.tree_util.keystr(path)
        assert isinstance(a, jax.Array), name
        assert a.dtype == e.dtype, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)


def save_steps(directory, steps):
    with Checkpointer(directory, save_every=1, keep=10) as checkpointer:
        for step in steps:
            assert checkpointer.save(step, make_state(step))


def step_dirs(directory) -> list[int]:
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())


def snapshot(directory) -> dict:
    """Every file and directory under `directory` with its size and mtime."""
    root = Path(directory)
    entries = {}
    for path in [root, *root.rglob("*")]:
        info = path.stat()
        entries[str(path.relative_to(root))] = (path.is_dir(), info.st_size, info.st_mtime_ns)
    return entries


def make_saved_dir(tmp_path) -> Path:
    """A checkpoint directory with metadata and steps 1 and 2 (step 2 is the latest)."""
    directory = tmp_path / "run"
    ckpt.write_metadata(directory, {"d_model": 8}, "lm", TOKENIZER)
    save_steps(directory, [1, 2])
    return directory
