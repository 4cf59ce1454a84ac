"""kvjax/checkpoint/layout.py: the pieces every reader and writer shares. Leaves are named and
keyed along their paths as messages and orbax's metadata show them, a checksum is that of the
stored bytes (hashlib's), an error is described by its innermost cause in one line, and a
directory that is not there is named."""

import hashlib

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.checkpoint import layout


@flax.struct.dataclass
class Holder:
    weights: dict


def test_leaves_are_named_and_keyed_along_their_paths():
    tree = {"params": {"embed": np.ones(2), "layers": [np.zeros(1), Holder({"k": np.ones(3)})]},
            "step": 3}
    assert set(layout.flat(tree)) == {("params", "embed"), ("params", "layers", "0"),
                                      ("params", "layers", "1", "weights", "k"), ("step",)}
    names = {layout.leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    assert names == {"params/embed", "params/layers/0", "params/layers/1/weights/k", "step"}
    assert layout.leaf_name(()) == "<root>"


def test_a_checksum_is_hashlibs_of_the_stored_bytes_in_c_order():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert layout.sha256(array) == hashlib.sha256(array.tobytes()).hexdigest()
    assert layout.sha256(array.T) == hashlib.sha256(array.T.copy().tobytes()).hexdigest()
    assert layout.sha256(jnp.asarray(array)) == layout.sha256(array)
    assert layout.sha256(array.astype(np.float16)) != layout.sha256(array)
    flipped = array.copy()
    flipped.reshape(-1).view(np.uint8)[5] ^= 1  # one bit of one float
    assert layout.sha256(flipped) != layout.sha256(array)


def test_an_error_is_described_by_its_innermost_cause_in_one_line():
    try:
        try:
            try:
                raise OSError("byte range [0, 80) not valid for value of size 40\n{spec...}")
            except OSError as inner:
                raise RuntimeError("reading failed") from inner
        except RuntimeError as middle:
            raise ValueError("restore failed") from middle
    except ValueError as outer:
        assert layout.describe(outer) == (
            "OSError: byte range [0, 80) not valid for value of size 40")
    long = RuntimeError("x" * 1000)
    assert layout.describe(long) == "RuntimeError: " + "x" * 400 + "..."
    looped = RuntimeError("a")
    looped.__cause__ = ValueError("b")
    looped.__cause__.__cause__ = looped  # a cycle ends where it closes
    assert layout.describe(looped) == "ValueError: b"
    assert layout.describe(KeyError()) == "KeyError: "


def test_a_directory_that_is_not_there_is_named(tmp_path):
    assert layout.existing_directory(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match=f"checkpoint directory {tmp_path / 'no'} does"):
        layout.existing_directory(tmp_path / "no")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        layout.existing_directory(tmp_path / "file")
