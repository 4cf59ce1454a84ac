"""MXFP4, the 4-bit floats gpt-oss's releases store their experts' weights in, unpacked as
they load.

An MXFP4 tensor of torch's [out, in] layout (per expert) is two: `<name>_blocks` [..., out,
in / 32, 16] uint8, each byte two 4-bit floats (e2m1: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, the
sign in the top bit; the lower nibble the even input), and `<name>_scales` [..., out,
in / 32] uint8, the power of two each block of 32 inputs is multiplied by, as its exponent
plus 127 (e8m0). Unpacked exactly, every value is a float32 (and a bfloat16): what
transformers' `Mxfp4Config(dequantize=True)` gives.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # inputs that share one scale
_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_EXPONENT_BIAS = 127


def unpack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 tensor [..., in, out] of `blocks` [..., out, in / 32, 16] and `scales`
    [..., out, in / 32] (the layout of the unpacked tensor the files would otherwise hold)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks of shape {list(blocks.shape)} do not fit scales of "
                         f"shape {list(scales.shape)}")
    values = np.empty((*scales.shape, BLOCK), np.float32)
    values[..., 0::2] = _FP4[blocks & 0x0F]
    values[..., 1::2] = _FP4[blocks >> 4]
    exponents = scales.astype(np.int32)[..., None] - _EXPONENT_BIAS
    np.ldexp(values, exponents, out=values)
    return values.reshape(*scales.shape[:-1], -1).swapaxes(-1, -2)
