"""MXFP4 unpacking (`kvjax/hf/mxfp4.py`) against ml_dtypes' own 4-bit (e2m1) and 8-bit
power-of-two (e8m0) floats: every code, both nibbles, the scales' whole range; a gpt-oss
directory stored so loads the model transformers unpacks (tests/hf/test_hf_models.py)."""

import ml_dtypes
import numpy as np
import pytest

from kvjax.hf import mxfp4


def reference(blocks, scales):
    """Each nibble as ml_dtypes' float4_e2m1fn, times its block's float8_e8m0fnu, the low
    nibble first; [..., out, in] transposed to [..., in, out]."""
    low = (blocks & 0x0F).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    high = (blocks >> 4).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    values = np.stack([low, high], axis=-1).reshape(*scales.shape, mxfp4.BLOCK)
    values = values * scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)[..., None]
    return values.reshape(*scales.shape[:-1], -1).swapaxes(-1, -2)


def test_every_code_and_scale_unpacks_as_ml_dtypes_reads_them():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8)
    blocks[0, 0, 0] = np.arange(16, dtype=np.uint8) * 17  # every code, in both nibbles
    scales = rng.integers(100, 150, size=(3, 5, 2), dtype=np.uint8)
    scales[0, :, 0] = [127, 0, 1, 200, 250]  # 1, then 2^-127 to 2^123
    got = mxfp4.unpack(blocks, scales)
    assert got.shape == (3, 64, 5) and got.dtype == np.float32
    np.testing.assert_array_equal(got, reference(blocks, scales))
    np.testing.assert_array_equal(got[0, :32:2, 0], [0, .5, 1, 1.5, 2, 3, 4, 6,
                                                     -0., -.5, -1, -1.5, -2, -3, -4, -6])
    assert np.signbit(got[0, 16, 0])  # code 8, the low nibble of byte 8: -0


@pytest.mark.parametrize("blocks, scales, message", [
    (np.zeros((2, 1, 16), np.uint8), np.zeros((2, 2), np.uint8), "do not fit scales"),
    (np.zeros((2, 1, 8), np.uint8), np.zeros((2, 1), np.uint8), "do not fit scales"),
    (np.zeros((2, 1, 16), np.int8), np.zeros((2, 1), np.uint8), "must be uint8"),
])
def test_tensors_that_are_not_mxfp4_are_named(blocks, scales, message):
    with pytest.raises(ValueError, match=message):
        mxfp4.unpack(blocks, scales)
