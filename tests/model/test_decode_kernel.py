"""The decode-attention kernel (`model/decode_kernel.py`): the formula, exact zeros for what a
query may not see, and a model's decode steps through it equal to XLA's ops.

The kernel runs as JAX ops ("interpret") on every backend; compiled through Triton only on an
NVIDIA GPU, where the "compiled" cases run and elsewhere skip, saying so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_tokens, steps_traced_anew
from test_attention import numpy_attention

from kvjax import model as M
from kvjax.model import decode_kernel as D
from kvjax.model.fused_attention import on_cuda

MODES = pytest.mark.parametrize("mode", ["interpret", "compiled"])
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}  # a few roundings of Q·scale and weights


def kernel_backend(mode):
    if mode == "compiled" and not D.compiles_here():
        pytest.skip(f"the kernel compiles through Triton on one NVIDIA GPU, not on "
                    f"{jax.device_count()} {jax.default_backend()} device(s)")


def decode_inputs(seed, batch, heads, kv_heads, capacity, dim, lengths, dtype):
    """A query [B, 1, N, H] per row, one layer of cache K and V [B, K, S, H] holding NaN past
    each row's length, and the mask [B, 1, S] of the filled slots."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, 1, heads, dim))
    k, v = (rng.normal(size=(batch, kv_heads, capacity, dim)) for _ in range(2))
    mask = np.arange(capacity)[None, None] < np.asarray(lengths)[:, None, None]
    unseen = ~mask[:, 0][:, None, :, None]
    k, v = (np.where(unseen, np.nan, x) for x in (k, v))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, mask


@MODES
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("heads,kv_heads,capacity,dim", [
    (4, 4, 16, 16),     # one block of the whole capacity, one query head per kv head
    (8, 2, 100, 32),    # a capacity the block does not divide: the last block starts early
    (7, 1, 160, 64),    # a group of 7 (padded to 16 rows), three blocks
])
def test_kernel_equals_the_formula_and_ignores_unseen_slots(mode, dtype, heads, kv_heads,
                                                            capacity, dim):
    kernel_backend(mode)
    lengths = [capacity, 0, capacity // 3 + 1]  # full, nothing to see, one block and a bit
    q, k, v, mask = decode_inputs(0, 3, heads, kv_heads, capacity, dim, lengths, dtype)
    assert D.decode_kernel_fits(q, k, v, None)
    out = jax.jit(D.decode_attention, static_argnames="interpret")(
        q, k, v, jnp.asarray(mask), interpret=mode == "interpret")
    assert out.shape == q.shape and out.dtype == dtype
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)  # a row that may see nothing
    as_f64 = [np.nan_to_num(np.asarray(x, np.float64)).transpose(0, 2, 1, 3) for x in (k, v)]
    reference = numpy_attention(np.asarray(q, np.float64), *as_f64, mask)
    assert np.max(np.abs(out - reference)) <= TOLERANCE[dtype] * np.max(np.abs(reference))


def test_the_kernel_runs_where_it_applies():
    q, k, v, _ = decode_inputs(1, 2, 8, 2, 32, 16, [32, 5], jnp.bfloat16)
    assert D.compiles_here() == (on_cuda() and jax.device_count() == 1)
    assert D.decode_kernel_use(q, k, v, None) == ("compiled" if D.compiles_here() else None)
    with D.decode_kernel_mode("xla"):
        assert D.decode_kernel_use(q, k, v, None) is None
    with D.decode_kernel_mode("interpret"):
        assert D.decode_kernel_use(q, k, v, None) == "interpret"
        assert D.decode_kernel_use(q, k, v, 30.0) is None  # a soft cap
        assert D.decode_kernel_use(jnp.concatenate([q, q], 1), k, v, None) is None  # 2 queries
        assert D.decode_kernel_use(q, *(x.astype(jnp.float32) for x in (k, v)), None) is None
        assert D.decode_kernel_use(q[..., :12], k[..., :12], v[..., :12], None) is None
        assert D.decode_kernel_use(q, k[:, :, :8], v[:, :, :8], None) is None  # 8 slots
    with pytest.raises(ValueError, match="'cudnn'"):
        D.decode_kernel_mode("cudnn").__enter__()


@MODES
@pytest.mark.parametrize("variant", ["decoder_only", "encoder_decoder"])
def test_decode_steps_through_the_kernel_equal_xlas(mode, variant):
    """A bfloat16 model's steps (self-attention, and cross-attention over a padded source)
    through the kernel give XLA's logits, rows of different lengths."""
    kernel_backend(mode)
    config = M.preset("tiny", d_model=64, num_heads=4, num_kv_heads=2, positional_encoding="rope",
                      num_encoder_layers=2 if variant == "encoder_decoder" else 0)
    config, params = M.with_precision(config, M.init_params(config, jax.random.key(0)),
                                      "bfloat16")
    tokens = random_tokens(1, (2, 9), config.vocab_size)
    source = source_lengths = None
    if config.is_encoder_decoder:
        source = random_tokens(2, (2, 24), config.vocab_size)
        source_lengths = jnp.array([24, 7], jnp.int32)
    outputs = []
    for attention in ("xla", mode if mode == "interpret" else "auto"):
        with D.decode_kernel_mode(attention):
            outputs.append(steps_traced_anew(config, params, tokens, 32, source,
                                             source_lengths))
    assert np.isfinite(outputs[1]).all()
    spread = np.max(np.abs(outputs[0]))
    assert np.max(np.abs(outputs[1] - outputs[0])) <= 3e-2 * spread
