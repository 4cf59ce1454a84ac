"""Attention as one fused kernel where the backend has one: cuDNN's flash attention on NVIDIA
GPUs.

XLA's own attention writes the [B, N, T, S] logits and weights of every layer out to memory
and reads them back (forward and backward), which dominates a training step at long
sequences. cuDNN's kernel keeps them on chip and, with a causal mask, skips the blocks above
the diagonal (and with a sliding window, those left of the window). It takes the mask as a
description (causal or not, each row's number of valid keys, a window) rather than as a
boolean array, so callers that know their mask has that shape say so (`key_lengths`,
`causal` and `window` of `model.attention.attend`); any other mask runs XLA's.

Shape letters as in `model/attention.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.extend
import jax.numpy as jnp

# What cuDNN's fused kernel takes (jax checks the same at trace time).
FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
FUSED_MAX_HEAD_DIM = 128


_FUSED_ALLOWED = contextvars.ContextVar("kvjax_fused_attention_allowed", default=True)


@contextlib.contextmanager
def xla_attention_only():
    """Programs traced inside run XLA's attention even where a fused kernel applies: what
    deterministic training does (`kvjax.train.update`), whose bit-identical reruns and
    resumes are checked with XLA's attention."""
    token = _FUSED_ALLOWED.set(False)
    try:
        yield
    finally:
        _FUSED_ALLOWED.reset(token)


@functools.cache
def on_cuda() -> bool:
    """Whether the default backend is an NVIDIA GPU (a ROCm GPU is a "gpu" too)."""
    backend = jax.extend.backend.get_backend()
    return backend.platform == "gpu" and "cuda" in backend.platform_version.lower()


def fused_attention_applies(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                            softcap: float | None) -> bool:
    """Whether `attend_fused` can run these operands: an NVIDIA GPU, float16 or bfloat16 Q,
    K and V, a head dim that is a multiple of 8 up to 128, no soft cap on the logits, and
    not inside `xla_attention_only`."""
    head_dim = q_BTNH.shape[-1]
    return (softcap is None and _FUSED_ALLOWED.get() and on_cuda()
            and q_BTNH.dtype in FUSED_DTYPES and k_BSKH.dtype == v_BSKH.dtype == q_BTNH.dtype
            and head_dim % 8 == 0 and head_dim <= FUSED_MAX_HEAD_DIM)


def attend_fused(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                 key_lengths_B: jax.Array, causal: bool, scale: float | None,
                 window: int | None = None) -> jax.Array:
    """softmax(QKᵀ·scale + mask)V [B, T, N, H] through cuDNN, for the mask `key slot <
    key_lengths[b]` (and `key slot <= query index` with `causal`, and `key slot > query
    index - window` with a sliding window of `window` positions, the query's own included;
    causal only).

    A row with no valid key is given one: cuDNN's softmax over nothing is not finite, and a
    NaN there would reach the gradients even where the caller zeroes the row's output (as
    `attend` does). A length past the last key means every key."""
    lengths_B = jnp.clip(key_lengths_B, 1, k_BSKH.shape[1]).astype(jnp.int32)
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, scale=scale, is_causal=causal,
                                        key_value_seq_lengths=lengths_B,
                                        local_window_size=_left_window(window),
                                        implementation="cudnn")


def _left_window(window: int | None) -> tuple[int, int] | None:
    """A window of `window` positions ending at the query as jax's `local_window_size`:
    the keys it reaches to the left of the query and to the right (none)."""
    return None if window is None else (window - 1, 0)
