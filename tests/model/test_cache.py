"""KVCache's row operations against NumPy: what each row holds after the operation, in
both layer layouts (unrolled: a stack per layer; scanned: one stack of every layer). The
decoders and the engine reach the cache only through these operations, so their tests run
on one layout and these hold the operations equal in both."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M
from kvjax.model.paged import copy_row_into_pages

LAYOUTS = {"unrolled": False, "scanned": True}
FIELDS = ("k", "v", "k_scale", "v_scale")  # the self-attention stacks the operations move
CROSS_FIELDS = ("cross_k", "cross_v", "cross_k_scale", "cross_v_scale")  # an encoder-decoder's


def numbered_cache(scan_layers: bool, batch: int, capacity: int, first: int = 0,
                   lengths=None, source: int | None = None, source_lengths=None
                   ) -> M.KVCache:
    """An int8 cache of two layers numbered from `first` on: each scale entry a distinct
    number, each K and V entry that number modulo 127 (int8), so a misplaced slot, row or
    layer shows in the scales, which move with them, and in K and V. With `source`, an
    encoder-decoder's, its cross-attention K/V of that many source slots numbered too."""
    config = M.preset("tiny", num_kv_heads=2, cache_dtype="int8", scan_layers=scan_layers,
                      num_encoder_layers=0 if source is None else 2)
    cache = M.init_cache(config, batch_size=batch, capacity=capacity, source_capacity=source)
    count = [first]

    def numbered(stack):
        values = count[0] + np.arange(stack.size).reshape(stack.shape)
        count[0] += stack.size
        return jnp.asarray(values % 127 if stack.dtype == jnp.int8 else values, stack.dtype)

    lengths = np.arange(batch) + 3 if lengths is None else np.asarray(lengths)
    cross = {} if source is None else {
        **{name: tuple(map(numbered, getattr(cache, name))) for name in CROSS_FIELDS},
        "source_lengths": jnp.asarray(np.arange(batch) + 2 if source_lengths is None
                                      else source_lengths, jnp.int32)}
    return cache.replace(**{name: tuple(map(numbered, getattr(cache, name))) for name in FIELDS},
                         lengths=jnp.asarray(lengths, jnp.int32),
                         overflow=jnp.ones((batch,), bool), **cross)


def layers(cache: M.KVCache, name: str) -> np.ndarray:
    """Field `name` as one array [L, B, K, S, ...] whatever the layout."""
    return np.concatenate([np.asarray(stack) for stack in getattr(cache, name)])


@pytest.mark.parametrize("scan_layers", LAYOUTS.values(), ids=LAYOUTS)
def test_take_rows_holds_the_rows_asked_for_repeats_included(scan_layers):
    cache = numbered_cache(scan_layers, batch=3, capacity=8)
    taken = cache.take_rows(jnp.array([2, 0, 2]))
    for name in FIELDS:
        np.testing.assert_array_equal(layers(taken, name), layers(cache, name)[:, [2, 0, 2]])
    np.testing.assert_array_equal(taken.lengths, [5, 3, 5])


@pytest.mark.parametrize("scan_layers", LAYOUTS.values(), ids=LAYOUTS)
def test_take_prefixes_holds_each_rows_first_slots_in_fewer_slots(scan_layers):
    cache = numbered_cache(scan_layers, batch=3, capacity=16)
    taken = cache.take_prefixes(jnp.array([2, 0]), jnp.array([5, 9]), capacity=12)
    assert taken.capacity == 12 and taken.batch_size == 2
    np.testing.assert_array_equal(taken.lengths, [5, 9])
    np.testing.assert_array_equal(taken.overflow, [False, False])
    for name in FIELDS:
        np.testing.assert_array_equal(layers(taken, name),
                                      layers(cache, name)[:, [2, 0], :, :12])
    with pytest.raises(ValueError, match=r"capacity=17 must be in \[1, 16\]"):
        cache.take_prefixes(jnp.array([0]), jnp.array([1]), capacity=17)


@pytest.mark.parametrize("scan_layers", LAYOUTS.values(), ids=LAYOUTS)
def test_put_rows_writes_the_sources_slots_and_lengths_and_drops_rows_past_the_end(scan_layers):
    cache = numbered_cache(scan_layers, batch=3, capacity=16)
    source = numbered_cache(scan_layers, batch=2, capacity=12, first=10**6, lengths=[7, 11])
    # Source row 1 into row 0, source row 0 into row 3: past the last row, written nowhere.
    put = cache.put_rows(source, jnp.array([1, 0]), jnp.array([0, 3]))
    for name in FIELDS:
        expected = layers(cache, name).copy()
        expected[:, 0, :, :12] = layers(source, name)[:, 1]
        np.testing.assert_array_equal(layers(put, name), expected)
    np.testing.assert_array_equal(put.lengths, [11, 4, 5])
    np.testing.assert_array_equal(put.overflow, [False, True, True])


@pytest.mark.parametrize("scan_layers", LAYOUTS.values(), ids=LAYOUTS)
@pytest.mark.parametrize("length, copied", [(7, 10), (16, 16)])
def test_copy_row_copies_the_blocks_its_length_fills(scan_layers, length, copied):
    """Blocks of 5 slots of a 16-slot row: a length of 7 copies two blocks (slots 0-9); a
    full row copies four, the last from slot 11 so as not to pass the row's end."""
    cache = numbered_cache(scan_layers, batch=3, capacity=16)
    source = numbered_cache(scan_layers, batch=2, capacity=16, first=10**6,
                            lengths=[2, length])
    out = cache.copy_row(source, jnp.asarray(1), jnp.asarray(2), block=5)
    for name in FIELDS:
        expected = layers(cache, name).copy()
        expected[:, 2, :, :copied] = layers(source, name)[:, 1, :, :copied]
        np.testing.assert_array_equal(layers(out, name), expected)
    np.testing.assert_array_equal(out.lengths, [3, 4, length])
    np.testing.assert_array_equal(out.overflow, [True, True, False])


@pytest.mark.parametrize("scan_layers", LAYOUTS.values(), ids=LAYOUTS)
def test_copy_row_into_pages_fills_the_pages_the_rows_table_names(scan_layers):
    """A row of length 10 in pages of 4: the pages its table names second and third (the
    first held already, a shared prefix) get slots 4-11, those past the source's capacity of
    10 as zeros; no other page changes."""
    config = M.preset("tiny", num_kv_heads=2, cache_dtype="int8", scan_layers=scan_layers)
    source = numbered_cache(scan_layers, batch=2, capacity=10, first=10**6, lengths=[3, 10])
    paged = M.init_paged_cache(config, batch_size=2, num_pages=6, page_size=4, pages_per_row=3)
    paged = paged.replace(pages=jnp.array([[0, 1, 2], [5, 3, 4]], jnp.int32))
    for name in FIELDS:
        paged = paged.replace(**{name: tuple(stack + 1 for stack in getattr(paged, name))})
    out = copy_row_into_pages(paged, source, jnp.asarray(1), jnp.asarray(1), first_page=1)
    for name in FIELDS:
        held = layers(source, name)[:, 1]  # [L, K, 10, ...]
        row = np.concatenate([held, np.zeros_like(held[:, :, :2])], axis=2)  # slots 0-11
        expected = layers(paged, name).copy()  # [L, pages, K, U, ...]
        for j, page in ((1, 3), (2, 4)):
            expected[:, page] = row[:, :, 4 * j:4 * (j + 1)]
        np.testing.assert_array_equal(layers(out, name), expected)
    np.testing.assert_array_equal(out.lengths, [0, 10])
    np.testing.assert_array_equal(out.overflow, [False, False])


@pytest.mark.parametrize("scan_layers", LAYOUTS.values(), ids=LAYOUTS)
def test_an_encoder_decoders_rows_move_with_their_cross_attention_and_source_lengths(
        scan_layers):
    """put_rows writes a prefilled row's source slots (8 of the 12 a row holds) and source
    length; copy_row copies the blocks of 5 source slots its source length of 7 fills
    (slots 0-9), as it does the target's."""
    cache = numbered_cache(scan_layers, batch=3, capacity=16, source=12)
    prefilled = numbered_cache(scan_layers, batch=2, capacity=4, first=10**6, source=8,
                               source_lengths=[5, 8])
    put = cache.put_rows(prefilled, jnp.array([1, 0]), jnp.array([0, 3]))
    for name in CROSS_FIELDS:
        expected = layers(cache, name).copy()
        expected[:, 0, :, :8] = layers(prefilled, name)[:, 1]
        np.testing.assert_array_equal(layers(put, name), expected)
    np.testing.assert_array_equal(put.source_lengths, [8, 3, 4])
    staged = numbered_cache(scan_layers, batch=2, capacity=16, first=10**6, lengths=[2, 3],
                            source=12, source_lengths=[4, 7])
    out = cache.copy_row(staged, jnp.asarray(1), jnp.asarray(2), block=5)
    for name, copied in (*((n, 5) for n in FIELDS), *((n, 10) for n in CROSS_FIELDS)):
        expected = layers(cache, name).copy()
        expected[:, 2, :, :copied] = layers(staged, name)[:, 1, :, :copied]
        np.testing.assert_array_equal(layers(out, name), expected)
    np.testing.assert_array_equal(out.source_lengths, [2, 3, 7])
    np.testing.assert_array_equal(out.lengths, [3, 4, 3])


def test_rows_move_only_between_caches_of_one_kind():
    decoder_only = numbered_cache(False, batch=2, capacity=8)
    encoder_decoder = numbered_cache(False, batch=2, capacity=8, source=8)
    with pytest.raises(ValueError, match="this is a decoder-only, the source an "
                                         "encoder-decoder's"):
        decoder_only.put_rows(encoder_decoder, jnp.array([0]), jnp.array([1]))
    with pytest.raises(ValueError, match="this is an encoder-decoder's, the source a "
                                         "decoder-only"):
        encoder_decoder.copy_row(decoder_only, jnp.asarray(0), jnp.asarray(1), block=4)
    with pytest.raises(ValueError, match="an encoder-decoder's target does not start"):
        encoder_decoder.take_prefixes(jnp.array([0]), jnp.array([1]), capacity=4)
    with pytest.raises(ValueError, match="this model is decoder-only"):
        M.init_cache(M.preset("tiny"), batch_size=1, capacity=4, source_capacity=4)


def test_unrolled_layers_own_one_cache_buffer_each():
    config = M.preset("tiny", num_decoder_layers=3, num_kv_heads=2, scan_layers=False)
    cache = M.init_cache(config, batch_size=2, capacity=10)
    assert len(cache.k) == len(cache.v) == 3
    assert all(k.shape == (1, 2, 2, 10, config.head_dim) for k in cache.k + cache.v)
    assert cache.capacity == 10 and cache.batch_size == 2
    assert cache.nbytes == M.cache_size_bytes(config, 2, 10).total
    reordered = cache.replace(lengths=jnp.array([3, 7], jnp.int32)).take_rows(jnp.array([1, 1, 0]))
    np.testing.assert_array_equal(reordered.lengths, [7, 7, 3])
    assert reordered.k[2].shape == (1, 3, 2, 10, config.head_dim)
