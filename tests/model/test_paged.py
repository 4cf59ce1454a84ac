"""The paged KV cache: pages anywhere in the pool, shared by rows, or missing give what the
contiguous cache and the textbook formula give, or a flagged overflow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_tokens, run_cached, run_full, start_cache
from test_attention import alibi_bias, numpy_attention

from kvjax import model as M
from kvjax.model.paged import attend_pages, write_pages

PAGE = 4


def pool_inputs(seed=0, batch=2, queries=2, heads=4, kv_heads=2, dim=8, pages_per_row=3,
                num_pages=8):
    """Random q, pools [1, pages, K, U, H] and page tables of distinct pages in a scrambled
    order; slots in no row's pages hold NaN, which must never reach an output."""
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, queries, heads, dim))
    pools = [np.array(jax.random.normal(key, (1, num_pages, kv_heads, PAGE, dim)))
             for key in keys[1:]]
    order = np.random.default_rng(seed).permutation(num_pages)
    pages = order[:batch * pages_per_row].reshape(batch, pages_per_row).astype(np.int32)
    for pool in pools:
        pool[0, order[batch * pages_per_row:]] = np.nan
    return q, pools, pages


def contiguous(pool, pages):
    """A pool's rows as [B, S, K, H], page by page in table order (NumPy)."""
    rows = pool[0][pages]  # [B, pages per row, K, U, H]
    return rows.transpose(0, 1, 3, 2, 4).reshape(pages.shape[0], -1, *rows.shape[2:3],
                                                  rows.shape[-1])


@pytest.mark.parametrize("one_read_bytes, block_size, sinks, alibi", [
    (None, PAGE, False, False), (0, PAGE, False, False), (0, 2 * PAGE, False, False),
    (None, PAGE, True, False), (0, 2 * PAGE, True, False), (0, 2 * PAGE, False, True)],
    ids=["one-read", "page-by-page", "two-pages-at-a-time", "one-read-sinks", "two-pages-sinks",
         "two-pages-alibi"])
def test_paged_attention_equals_the_formula_over_each_rows_pages(one_read_bytes, block_size,
                                                                 sinks, alibi):
    """Blocks of two pages over three pages a row: the last block starts a page early. Row 0's
    queries see a sliding window of 6 slots, which a block of one page starts past the
    first. With each query head's sink logit (gpt-oss) too, or ALiBi's bias (a slot's
    position its index in the row's pages)."""
    q, (k_pool, v_pool), pages = pool_inputs()
    lengths = np.array([11, 5])  # row 1 ends inside its second page: its third is unseen
    k_pool[0, pages[1, 1], :, 1:] = np.nan  # past its length
    v_pool[0, pages[1, 1], :, 1:] = np.nan
    pages[1, 2] = M.NO_PAGE
    slots = np.arange(pages.shape[1] * PAGE)
    positions = lengths[:, None] - 2 + np.arange(2)
    mask = ((slots <= positions[:, :, None]) & (slots < lengths[:, None, None])
            & (slots > positions[:, :, None] - 6))
    sinks = jnp.asarray([1.5, -0.5, 0.0, 3.0]) if sinks else None
    slopes = jnp.asarray(M.alibi_slopes(4))
    bias = M.PositionBias(jnp.asarray(positions), slopes_N=slopes) if alibi else None
    out = attend_pages(q, jnp.asarray(k_pool), jnp.asarray(v_pool), 0, jnp.asarray(pages),
                       jnp.asarray(mask), block_size, one_read_bytes=one_read_bytes,
                       sinks_N=sinks, bias=bias)
    safe = np.where(pages < 0, 0, pages)
    k, v = (np.nan_to_num(contiguous(pool, safe), nan=1e9) for pool in (k_pool, v_pool))
    expected = numpy_attention(np.asarray(q), k, v, mask, sinks=sinks, bias=alibi_bias(
        slopes, positions, np.broadcast_to(slots, (2, slots.size))) if alibi else None)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)


def test_a_write_without_a_page_is_dropped_not_moved():
    pool = jnp.zeros((1, 4, 1, PAGE, 2))
    pages = jnp.array([[2, M.NO_PAGE], [1, 3]], jnp.int32)
    new = jnp.ones((2, 3, 1, 2)) * jnp.array([1.0, 2.0])[:, None, None, None]
    written = write_pages(pool, 0, new, jnp.array([2, 3]), jnp.array([True, True]), pages)
    written = np.asarray(written[0, :, 0, :, 0])
    assert written[2].tolist() == [0, 0, 1, 1]  # row 0's positions 2, 3; 4 has no page
    assert written[1].tolist() == [0, 0, 0, 2] and written[3].tolist() == [2, 2, 0, 0]
    assert written[0].tolist() == [0] * PAGE


def scrambled_tables(batch, pages_per_row, num_pages, seed=3):
    order = np.random.default_rng(seed).permutation(num_pages)[:batch * pages_per_row]
    return jnp.asarray(order.reshape(batch, pages_per_row), jnp.int32)


@pytest.mark.parametrize("variant, options", [
    (0, dict()),
    (2, dict(positional_encoding="rope", num_kv_heads=2, scan_layers=True, cache_dtype="int8")),
], ids=["decoder_only-paper", "encoder_decoder-rope-gqa-scanned-int8"])
def test_paged_decoding_equals_the_contiguous_cache(options, variant, request):
    """A prefill and decode steps through pages scattered over the pool give the contiguous
    cache's logits (the int8 cache quantises alike either way), and the uncached forward's
    within float tolerance where the cache is float. The int8 cache is read page by page
    (its scales with its values), the float one in one pass."""
    if "cache_dtype" in options:
        request.getfixturevalue("layers_read_by_blocks")
    config = M.preset("tiny", num_encoder_layers=variant, **options)
    params = M.init_params(config, jax.random.key(0))
    tokens = random_tokens(1, (2, 12), config.vocab_size)
    source = random_tokens(5, (2, 7), config.vocab_size) if variant else None
    source_lengths = jnp.array([7, 4]) if variant else None
    prompt_lengths = jnp.array([5, 3])
    outputs = {}
    for kind in ("contiguous", "paged"):
        cache = start_cache(config, params, 2, 16, source, source_lengths)
        if kind == "paged":
            paged = M.init_paged_cache(config, 2, 11, PAGE, 4).replace(
                pages=scrambled_tables(2, 4, 11))
            cache = paged.replace(cross_k=cache.cross_k, cross_v=cache.cross_v,
                                  cross_k_scale=cache.cross_k_scale,
                                  cross_v_scale=cache.cross_v_scale,
                                  source_lengths=cache.source_lengths)
        first, cache = run_cached(config, params, tokens[:, :5], cache, prompt_lengths)
        steps = [first[np.arange(2), prompt_lengths - 1]]
        for t in range(6):
            logits, cache = run_cached(config, params, tokens[:, 5 + t:6 + t], cache)
            steps.append(logits[:, 0])
        outputs[kind] = np.stack(steps)
        assert cache.lengths.tolist() == [11, 9] and not cache.overflow.any()
    np.testing.assert_allclose(outputs["paged"], outputs["contiguous"], atol=2e-5, rtol=0)
    if variant == 0 and "cache_dtype" not in options:
        full = run_full(config, params, tokens[:1, :11])
        np.testing.assert_allclose(outputs["paged"][:, 0], full[0, 4:], atol=1e-5, rtol=0)


def test_rows_sharing_a_prefix_page_read_it_and_never_write_it():
    """Row 1 starts where row 0's first page ends and points at that page: its logits equal
    the uncached forward of the whole sequence, and the shared page is unchanged."""
    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2)
    params = M.init_params(config, jax.random.key(0))
    tokens = random_tokens(2, (1, 10), config.vocab_size)
    tokens = jnp.concatenate([tokens, tokens.at[:, 6:].set((tokens[:, 6:] + 1) % 64)])
    cache = M.init_paged_cache(config, 1, 6, PAGE, 3).replace(
        pages=jnp.array([[4, 1, 5]], jnp.int32))
    prefill = jax.jit(M.prefill, static_argnums=0)
    _, cache = prefill(config, params, tokens[:1, :PAGE], jnp.array([PAGE]), cache=cache)
    shared = cache.replace(pages=jnp.array([[4, 0, 2], [4, 3, 1]], jnp.int32),
                           lengths=jnp.array([PAGE, PAGE]), overflow=jnp.zeros(2, bool))
    before = [np.asarray(k[:, 4]) for k in shared.k]
    logits, after = run_cached(config, params, tokens[:, PAGE:], shared)
    full = run_full(config, params, tokens)
    np.testing.assert_allclose(logits, full[:, PAGE:], atol=1e-5, rtol=0)
    assert all(np.array_equal(np.asarray(k[:, 4]), b) for k, b in zip(after.k, before, strict=True))
    assert after.lengths.tolist() == [10, 10] and not after.overflow.any()


def test_a_row_without_pages_for_its_tokens_overflows_and_writes_nothing():
    config = M.preset("tiny")
    params = M.init_params(config, jax.random.key(0))
    cache = M.init_paged_cache(config, 2, 4, PAGE, 2).replace(
        pages=jnp.array([[0, 1], [2, M.NO_PAGE]], jnp.int32))
    tokens = random_tokens(3, (2, 6), config.vocab_size)
    _, cache = run_cached(config, params, tokens, cache)
    assert cache.lengths.tolist() == [6, 0] and cache.overflow.tolist() == [False, True]
    assert all(not np.asarray(k[:, 2:]).any() for k in cache.k)


def test_bad_paged_caches_are_refused_naming_the_value(tiny_config):
    with pytest.raises(ValueError, match="num_pages=0"):
        M.init_paged_cache(tiny_config, 2, 0, PAGE, 2)
    with pytest.raises(ValueError, match="exceeds the model's max_len"):
        M.init_paged_cache(tiny_config, 1, 4, PAGE, tiny_config.max_len)
    cache = M.init_paged_cache(tiny_config, 2, 4, PAGE, 2)
    with pytest.raises(ValueError, match="page tables"):
        cache.take_rows(jnp.array([0]))
    params = M.init_params(tiny_config, jax.random.key(0))
    with pytest.raises(ValueError, match=r"shape \(2, 2\), but a batch of 3"):
        run_cached(tiny_config, params, jnp.zeros((3, 1), jnp.int32), cache)
    with pytest.raises(ValueError, match="either a capacity or an empty cache"):
        M.prefill(tiny_config, params, jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32),
                  8, cache=cache)
