"""The projections around attention: the model width to heads (`projection`) and the heads
back to the model width (`OutputProjection`).

Shape letters as in `model/attention.py`; F is the N·H features of all heads side by side.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import TransformerConfig


def projection(config: TransformerConfig, heads: int, name: str) -> nn.DenseGeneral:
    """[B, T, D] -> [B, T, heads, H]: a kernel [D, heads, H], a bias [heads, H] if `qkv_bias`."""
    return nn.DenseGeneral(
        features=(heads, config.head_dim), use_bias=config.qkv_bias,
        dtype=config.compute_dtype, param_dtype=config.weights_dtype, name=name,
    )


class OutputProjection(nn.Module):
    """Heads back to the model width: [B, T, N, H] -> [B, T, D] with a kernel [N, H, D]
    (and a bias [D] if `out_bias`).

    Computed as one [B·T, N·H] x [N·H, D] matmul: a contraction over two axes at once
    is slower on some backends (XLA:CPU among them) than the same 2-D product. On a GPU a
    single row (batch-1 decoding) is multiplied as two, the second zero: XLA:GPU turns a
    product of one row with a matrix of this size into a multiply and a sum that it does not
    fuse, which writes out and reads back a product as large as the kernel.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTNH):
        c = self.config
        kernel = self.param("kernel", nn.initializers.lecun_normal(in_axis=(0, 1), out_axis=2),
                            (c.num_heads, c.head_dim, c.d_model), c.weights_dtype)
        x_BTNH, kernel = nn.dtypes.promote_dtype(x_BTNH, kernel, dtype=c.compute_dtype)
        x_BTF = x_BTNH.reshape(*x_BTNH.shape[:2], -1)
        one_row = x_BTF.shape[:2] == (1, 1) and jax.default_backend() == "gpu"
        if one_row:
            x_BTF = jnp.concatenate([x_BTF, jnp.zeros_like(x_BTF)])
        out_BTD = x_BTF @ kernel.reshape(-1, c.d_model)
        if one_row:
            out_BTD = out_BTD[:1]
        if c.out_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (c.d_model,),
                              c.weights_dtype)
            out_BTD = out_BTD + bias.astype(out_BTD.dtype)
        return out_BTD
