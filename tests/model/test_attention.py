"""Attention against a plain NumPy evaluation of softmax(QKᵀ/√d_k + mask)V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M
from kvjax.model.attention import attend_blocks
from kvjax.model.positional import relative_position_buckets


def attend_from_cache_layout(q, k, v, mask):
    """`attend_blocks` on the same inputs moved into a cache stack [1, B, K, S, H], in
    blocks of 3 slots (the last one overlapping the one before it), on every backend."""
    k, v = (jnp.asarray(x).transpose(0, 2, 1, 3)[None] for x in (k, v))
    return attend_blocks(q, k, v, 0, mask, 3, one_read_bytes=0)[0]


ATTENDS = pytest.mark.parametrize("attend", [M.attend, attend_from_cache_layout],
                                  ids=["fresh", "cached"])


def numpy_attention(q, k, v, mask, scale=None, cap=None, sinks=None, bias=None):
    """q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] bool; the textbook formula, head by head,
    the logits scaled by `scale` (default 1/√H) and soft-capped at `cap` (None: not), each
    head's sink logit `sinks[n]` (where given) one more term of the softmax's sum, `bias`
    [B,N,T,S] (where given) added to the logits."""
    batch, queries, heads, dim = q.shape
    kv_heads = k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(batch):
        for n in range(heads):
            g = n // (heads // kv_heads)
            scores = q[b, :, n] @ k[b, :, g].T / np.sqrt(dim) if scale is None else (
                q[b, :, n].astype(np.float64) @ k[b, :, g].T * scale)
            if cap is not None:
                scores = cap * np.tanh(scores / cap)
            if bias is not None:
                scores = scores + bias[b, n]
            scores = np.where(mask[b], scores, -np.inf)
            for t in range(queries):
                if not mask[b, t].any():
                    continue  # a query with nothing to attend to outputs zeros
                weights = np.exp(scores[t] - scores[t].max())
                total = weights.sum()
                if sinks is not None:
                    total += np.exp(float(sinks[n]) - scores[t].max())
                out[b, t, n] = weights / total @ v[b, :, g]
    return out


@ATTENDS
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_attend_matches_numpy_formula_with_masks(attend, heads, kv_heads):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 5, heads, 8)).astype(np.float32)
    k = rng.normal(size=(2, 7, kv_heads, 8)).astype(np.float32)
    v = rng.normal(size=(2, 7, kv_heads, 8)).astype(np.float32)
    mask = rng.random((2, 5, 7)) < 0.6
    mask[0, 2] = False  # a fully masked row
    mask[1, 4] = False
    out = np.asarray(attend(q, k, v, jnp.asarray(mask)))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, numpy_attention(q, k, v, mask), atol=1e-5)
    np.testing.assert_array_equal(out[0, 2], 0.0)
    np.testing.assert_array_equal(out[1, 4], 0.0)


@pytest.mark.parametrize("way", ["fresh", "one-read", "by-blocks", "whole"])
def test_sinks_join_each_heads_softmax_as_a_key_of_value_zero(way):
    """gpt-oss's sinks, along every way of attending: a query that sees nothing still
    returns zeros, and the other rows give the sink its share of their weight."""
    rng = np.random.default_rng(5)
    q = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 7, 2, 8)).astype(np.float32) for _ in range(2))
    mask = rng.random((2, 3, 7)) < 0.6
    mask[1, 2] = False
    sinks = jnp.asarray([2.0, -1.0, 0.5, 4.0])
    if way == "fresh":
        out = M.attend(q, k, v, jnp.asarray(mask), sinks_N=sinks)
    else:
        stacks = [jnp.asarray(x).transpose(0, 2, 1, 3)[None] for x in (k, v)]
        out, _ = attend_blocks(q, *stacks, 0, jnp.asarray(mask), 3, sinks_N=sinks,
                               one_read_bytes=None if way == "one-read" else 0,
                               whole_share=0.0 if way == "whole" else 10.0)
    out = np.asarray(out)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, mask, sinks=sinks), atol=1e-5)
    np.testing.assert_array_equal(out[1, 2], 0.0)
    without = numpy_attention(q, k, v, mask)
    assert np.all(np.abs(out[0]) < np.abs(without[0]) + 1e-6)  # a share went to the sink


def alibi_bias(slopes, query_positions, key_positions):
    """ALiBi's bias [B,N,T,S]: each head's slope times (key - query position)."""
    distance = key_positions[:, None, :] - query_positions[:, :, None]
    return np.asarray(slopes)[None, :, None, None] * distance[:, None]


def t5_bucket(distance, bidirectional, num_buckets, max_distance):
    """T5's relative position bucket of one distance (key - query), in float32 as
    transformers' T5 computes it, written out with NumPy scalars."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if distance > 0 else 0
        distance = abs(distance)
    else:
        distance = -min(distance, 0)
    max_exact = num_buckets // 2
    if distance < max_exact:
        return bucket + distance
    large = max_exact + int(np.log(np.float32(distance) / np.float32(max_exact))
                            / np.float32(np.log(max_distance / max_exact))
                            * np.float32(num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 16)])
def test_relative_position_buckets_are_t5s(bidirectional, num_buckets, max_distance):
    distances = np.arange(-300, 301)
    got = np.asarray(relative_position_buckets(jnp.asarray(distances), bidirectional,
                                               num_buckets, max_distance))
    want = [t5_bucket(int(d), bidirectional, num_buckets, max_distance) for d in distances]
    np.testing.assert_array_equal(got, want)
    assert got.min() == 0 and got.max() == num_buckets - 1 if bidirectional else \
        got.max() == num_buckets - 1


@pytest.mark.parametrize("way", ["fresh", "one-read", "by-blocks"])
def test_a_t5_bias_adds_each_heads_entry_for_the_keys_bucket(way):
    """T5's learned table, along every way of attending: bidirectional over the new tokens
    (an encoder), causal over a cache's slots."""
    rng = np.random.default_rng(7)
    table = rng.normal(size=(8, 4)).astype(np.float32)
    k, v = (rng.normal(size=(2, 9, 2, 8)).astype(np.float32) for _ in range(2))
    if way == "fresh":
        q = rng.normal(size=(2, 9, 4, 8)).astype(np.float32)
        positions = np.arange(9)[None].repeat(2, 0)
        key_positions, mask = positions, np.ones((2, 9, 9), bool)
        mask[1, :, 7:] = False
        bias = M.PositionBias(jnp.asarray(positions), table=jnp.asarray(table),
                              num_buckets=8, max_distance=16, bidirectional=True)
        out = M.attend(q, k, v, jnp.asarray(mask), bias=bias)
    else:
        q = rng.normal(size=(2, 2, 4, 8)).astype(np.float32)
        positions = np.array([[7, 8], [3, 4]])
        key_positions = np.arange(9)[None].repeat(2, 0)
        mask = key_positions[:, None, :] <= positions[:, :, None]
        bias = M.PositionBias(jnp.asarray(positions), table=jnp.asarray(table),
                              num_buckets=8, max_distance=16)
        stacks = [jnp.asarray(x).transpose(0, 2, 1, 3)[None] for x in (k, v)]
        out, _ = attend_blocks(q, *stacks, 0, jnp.asarray(mask), 3, bias=bias,
                               one_read_bytes=None if way == "one-read" else 0,
                               whole_share=10.0)
    distance = key_positions[:, None, :] - positions[:, :, None]
    buckets = np.vectorize(lambda d: t5_bucket(int(d), way == "fresh", 8, 16))(distance)
    expected = numpy_attention(q, k, v, mask, scale=1.0 / np.sqrt(8),
                               bias=np.moveaxis(table[buckets], -1, 1))
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def test_alibi_slopes_are_the_papers():
    """Press et al.'s slopes: 2^(-8i/N) for N a power of two; for 12 heads those of 8, then
    every other slope of 16 (BLOOM's rule)."""
    np.testing.assert_allclose(M.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    sixteen = 2.0 ** (-np.arange(1, 17) / 2)
    np.testing.assert_allclose(M.alibi_slopes(12),
                               np.concatenate([2.0 ** -np.arange(1, 9), sixteen[0:8:2]]))


@pytest.mark.parametrize("way", ["fresh", "one-read", "by-blocks", "whole"])
def test_alibi_adds_each_heads_slope_times_the_keys_distance(way):
    """ALiBi along every way of attending: over the new tokens at their positions (with a
    row that starts at position 3), and over a cache's slots with queries at the positions
    after a prefill of 5 and 3 tokens."""
    rng = np.random.default_rng(6)
    slopes = jnp.asarray(M.alibi_slopes(6))
    k, v = (rng.normal(size=(2, 8, 3, 8)).astype(np.float32) for _ in range(2))
    if way == "fresh":
        q = rng.normal(size=(2, 8, 6, 8)).astype(np.float32)
        positions = np.array([np.arange(8), np.arange(3, 11)])
        mask = np.tril(np.ones((8, 8), bool))[None].repeat(2, 0)
        out = M.attend(q, k, v, jnp.asarray(mask),
                       bias=M.PositionBias(jnp.asarray(positions), slopes_N=slopes))
        key_positions = positions
    else:
        q = rng.normal(size=(2, 2, 6, 8)).astype(np.float32)
        positions = np.array([[5, 6], [3, 4]])
        key_positions = np.arange(8)[None].repeat(2, 0)
        mask = key_positions[:, None, :] <= positions[:, :, None]
        stacks = [jnp.asarray(x).transpose(0, 2, 1, 3)[None] for x in (k, v)]
        out, _ = attend_blocks(q, *stacks, 0, jnp.asarray(mask), 3,
                               bias=M.PositionBias(jnp.asarray(positions),
                                                            slopes_N=slopes),
                               one_read_bytes=None if way == "one-read" else 0,
                               whole_share=0.0 if way == "whole" else 10.0)
    expected = numpy_attention(q, k, v, mask, bias=alibi_bias(slopes, positions, key_positions))
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
    assert not np.allclose(expected, numpy_attention(q, k, v, mask), atol=1e-2)


@ATTENDS
def test_masked_keys_get_exactly_zero_weight(attend):
    # Huge values behind the mask would leak into the output if their weight were not 0.
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 3, 2, 4)).astype(np.float32)
    k = rng.normal(size=(1, 6, 2, 4)).astype(np.float32)
    v = rng.normal(size=(1, 6, 2, 4)).astype(np.float32)
    mask = np.tril(np.ones((3, 6), bool), k=2)[None]
    poisoned = v.copy()
    poisoned[:, 5] = 1e30
    clean = attend(q, k, v, jnp.asarray(mask))
    np.testing.assert_array_equal(attend(q, k, poisoned, jnp.asarray(mask)), clean)


@ATTENDS
def test_bfloat16_attention_softmax_runs_in_float32(attend):
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(1, 4, 2, 16)).astype(np.float32) for _ in range(3))
    mask = np.ones((1, 4, 4), bool)
    out = attend(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), jnp.asarray(mask))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), numpy_attention(q, k, v, mask),
                               atol=0.05)


def test_attention_gradient_is_finite_with_fully_masked_rows():
    # Training attends without a cache; the cache's blocked loop is for inference only.
    q = jnp.ones((1, 2, 1, 4))
    kv = jnp.ones((1, 3, 1, 4))
    mask = jnp.array([[[True, False, False], [False, False, False]]])
    grads = jax.jit(jax.grad(lambda q: M.attend(q, kv, kv, mask).sum()))(q)
    assert jnp.isfinite(grads).all()


@pytest.mark.parametrize("scaled", [False, True], ids=["float", "scaled"])
def test_a_sliding_window_reads_only_the_blocks_it_covers(scaled):
    """Decode queries whose windows start past the first blocks: the loop starts at the
    block of the first slot any query sees, and what it skips (NaN here) never counted."""
    rng = np.random.default_rng(7)
    capacity, block = 40, 4
    q = rng.normal(size=(2, 1, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, capacity, 2, 8)).astype(np.float32) for _ in range(2))
    slots = np.arange(capacity)
    mask = np.stack([(slots >= 13) & (slots < 21), (slots >= 17) & (slots < 31)])[:, None]
    k, v = (np.where(mask[:, 0, :, None, None], x, np.nan) for x in (k, v))
    stacks = [jnp.asarray(x).transpose(0, 2, 1, 3)[None] for x in (k, v)]
    scales = None
    if scaled:  # an int8 cache's way (its scales at 1): always read by blocks
        scales = tuple(jnp.ones(s.shape[:-1]) for s in stacks)
    out, blocks_read = attend_blocks(q, *stacks, 0, jnp.asarray(mask), block, scales=scales,
                                     one_read_bytes=0, whole_share=1.0)
    assert int(blocks_read) == 8 - 3  # blocks 3 (slots 12-15) to 7 (slots 28-31)
    np.testing.assert_allclose(out, numpy_attention(q, *(np.nan_to_num(x) for x in (k, v)),
                                                     mask), atol=1e-5)
