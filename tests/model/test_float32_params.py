"""model/float32_params.py: a cast to another dtype leaves the params a model declares
float32 (int8 values' scales, a router's selection bias) as they are, and only those. That a
bfloat16 model declares them so, and that the readers give it them so, is held in
tests/hf/test_hf_models.py (DeepSeek-V3's selection bias) and tests/model/test_int8_base.py
(the scales)."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax.model.float32_params import keeps_float32


def test_a_cast_leaves_scales_and_the_selection_bias_in_float32_and_ints_as_they_are():
    tree = {"ffn": {"selection_bias": jnp.full(4, 1 / 3, jnp.float32),
                    "router": {"kernel": jnp.full((2, 4), 1 / 3, jnp.float32)},
                    "experts": {"wi": jnp.ones((2, 4, 3), jnp.int8),
                                "wi_scale": jnp.full((1, 4, 3), 1 / 3, jnp.float32)}},
            "norm": {"scale": jnp.full(2, 1 / 3, jnp.float32)},
            "embedding": {"embedding": jnp.ones((5, 2), jnp.int8),
                          "embedding_scale": jnp.full((5, 1), 1 / 3, jnp.float32)}}
    cast = M.cast_floats(tree, jnp.bfloat16)
    kept = {"['ffn']['selection_bias']", "['ffn']['experts']['wi_scale']",
            "['embedding']['embedding_scale']"}
    for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(tree),
                                     jax.tree.leaves(cast), strict=True):
        name = jax.tree_util.keystr(path)
        if name in kept or before.dtype == jnp.int8:
            assert after.dtype == before.dtype, name
            np.testing.assert_array_equal(after, before)
        else:  # a norm's `scale` is a weight like any other, not an int8 value's scale
            assert after.dtype == jnp.bfloat16, name
            np.testing.assert_array_equal(after, before.astype(jnp.bfloat16))
    assert [keeps_float32(n) for n in ("kernel_scale", "selection_bias", "scale", "bias")] == [
        True, True, False, False]
