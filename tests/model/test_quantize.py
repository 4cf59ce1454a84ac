"""model/quantize.py: the int8 KV cache's quantisation equals its formula written out in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model import quantize


def numpy_quantize(x):
    """The int8 cache's quantisation written out: per vector over the last axis,
    scale = max|x| / 127, values = round(x / scale)."""
    scale = np.abs(x).max(-1) / 127
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    return np.round(x / safe).astype(np.int8), scale.astype(np.float32)


def test_quantize_round_trip_is_within_half_a_scale():
    x = np.random.default_rng(0).normal(size=(3, 5, 2, 16)).astype(np.float32) * 7
    x[0, 0, 1] = 0.0  # a head of zeros: scale 0, stored exactly
    values, scales = jax.jit(quantize.quantize)(x)
    assert values.dtype == jnp.int8 and scales.dtype == jnp.float32
    assert scales.shape == (3, 5, 2)
    reference_values, reference_scales = numpy_quantize(x)
    np.testing.assert_array_equal(values, reference_values)
    np.testing.assert_allclose(scales, reference_scales, rtol=1e-7)
    assert int(np.abs(np.asarray(values, np.int32)).max(-1).min()) in (0, 127)
    np.testing.assert_array_equal(np.abs(np.asarray(values, np.int32)).max(-1)[scales > 0], 127)
    error = np.abs(np.asarray(quantize.dequantize(values, scales)) - x)
    assert (error <= np.asarray(scales)[..., None] / 2 * (1 + 1e-5)).all()
    np.testing.assert_array_equal(quantize.round_trip(x)[0, 0, 1], 0.0)
