"""Decode attention as one kernel per layer on an NVIDIA GPU (Pallas, lowered through Triton).

A decode step attends one query per row over the row's cached slots. Through XLA's ops that is
six kernels per layer (the logits' product, the softmax's max and sum, the weights' conversion,
V read with its unseen slots zeroed, the weights' product), each of a microsecond or two for
so little work. Here one program per (row, kv head) reads the row's K and V once, block by
block from the first to the last slot the mask lets it see (a sliding window's blocks, or
every filled one), and keeps the softmax's running max and sum
on chip (FlashAttention's recurrence, as `model.attention._attend_filled_blocks` runs it
through XLA). Over a paged cache (`model/paged.py`) the same program reads each block's
pages through the row's page table, in place: no row is gathered into a contiguous copy
first. jax has deprecated Pallas' Triton backend: where a jax no longer has it, decode steps
run XLA's ops.

Masked slots get exactly zero weight and their values are zeroed before the product, so
whatever they hold (even NaN) cannot reach the output; a query that sees no slot returns
zeros. The kernel runs on the CPU in Pallas' interpret mode, which is how the tests compare
it with XLA's path on a machine without a GPU.

Shape letters as in `model/attention.py`; M is the G query heads of a kv head padded to the
16 rows a Triton matrix product needs, U the slots of one block.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from .fused_attention import on_cuda

KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
MIN_DOT = 16  # a Triton matrix product's smallest side
MAX_HEAD_DIM = 256
BLOCK_SLOTS = 64


MODES = ("auto", "xla", "interpret")
_mode = "auto"


@contextlib.contextmanager
def decode_kernel_mode(mode: str) -> Iterator[None]:
    """Within it, decode steps traced run attention `mode`: "auto" (the default) through the
    kernel where `compiles_here()` and XLA's ops elsewhere, "xla" through XLA's ops
    everywhere, "interpret" through the kernel run as JAX ops on any backend (how the tests
    run it on a CPU). It holds for every thread (a serving engine traces on its own);
    programs compiled before keep what they were traced with."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"decode kernel mode {mode!r}: expected one of {MODES}")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def decode_kernel_use(q_BTNH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array,
                      softcap: float | None) -> str | None:
    """How a decode step's attention over these operands runs the kernel: "compiled",
    "interpret", or None (XLA's ops), by `decode_kernel_mode` and `decode_kernel_fits`."""
    mode = _mode
    if mode == "xla" or (mode == "auto" and not compiles_here()):
        return None
    if not decode_kernel_fits(q_BTNH, k_BKSH, v_BKSH, softcap):
        return None
    return "interpret" if mode == "interpret" else "compiled"


@functools.cache
def compiles_here() -> bool:
    """Whether "auto" compiles the kernel: on a single NVIDIA GPU, with a jax that still
    lowers Pallas through Triton. A program over several devices runs XLA's ops: the
    partitioner cannot split a kernel's call by rows, and would gather every row's cache
    onto each device."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return on_cuda() and jax.device_count() == 1


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def decode_kernel_fits(q_BTNH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array,
                       softcap: float | None) -> bool:
    """Whether `decode_attention` takes these operands: one query per row, float16 or
    bfloat16 K/V of one dtype, a power-of-two head dim from 16 to 256, at most 16 query
    heads per kv head, at least 16 slots, and no soft cap."""
    _, num_queries, num_heads, head_dim = q_BTNH.shape
    kv_heads, capacity = k_BKSH.shape[1], k_BKSH.shape[2]
    return (num_queries == 1 and softcap is None
            and k_BKSH.dtype in KERNEL_DTYPES and v_BKSH.dtype == k_BKSH.dtype
            and _power_of_two(head_dim) and MIN_DOT <= head_dim <= MAX_HEAD_DIM
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= MIN_DOT
            and capacity >= MIN_DOT)


def seen_blocks(mask_BTS: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """The blocks of `block` slots that hold every slot `mask` lets some query see: the
    first and one past the last (traced scalars; (0, 0) where no query sees a slot). A
    sliding window's queries see none of the blocks before it, so a decode step over a
    windowed layer reads its window, not every position the row holds."""
    capacity = mask_BTS.shape[-1]
    slots_S = jnp.arange(capacity, dtype=jnp.int32)
    last_seen = jnp.max(jnp.where(mask_BTS, slots_S + 1, 0))
    first_seen = jnp.min(jnp.where(mask_BTS, slots_S, capacity))
    num_blocks = (last_seen + block - 1) // block
    return jnp.minimum(first_seen // block, num_blocks), num_blocks


def decode_attention(q_BTNH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array,
                     mask_BTS: jax.Array, scale: float | None = None,
                     interpret: bool = False, sinks_N: jax.Array | None = None) -> jax.Array:
    """softmax(QKᵀ·scale + mask)V for one query per row over one layer of the cache,
    [B, 1, N, H] in Q's dtype. `scale` defaults to 1/√H; `sinks` [N], where given, are the
    query heads' sink logits (`model/attention.py`). The operands must pass
    `decode_kernel_fits`. `interpret`: run the kernel as JAX ops (any backend)."""
    from jax.experimental import pallas as pl

    _, kv_heads, capacity, head_dim = k_BKSH.shape
    block = min(BLOCK_SLOTS, 1 << (capacity.bit_length() - 1))
    blocks_B2, q_BKMH, seen_BS = _kernel_inputs(q_BTNH, kv_heads, k_BKSH.dtype, mask_BTS,
                                                block, scale)
    row_layer = pl.BlockSpec((None, None, capacity, head_dim), lambda b, k: (b, k, 0, 0))
    out_BKMH = _call(functools.partial(_kernel, block=block, capacity=capacity),
                     [row_layer, row_layer], interpret, "kvjax_decode_attention",
                     blocks_B2, q_BKMH, k_BKSH, v_BKSH, seen_BS,
                     sinks_KM=_sinks_KM(sinks_N, kv_heads))
    return _outputs(out_BKMH, q_BTNH)


def paged_block_pages(page_size: int, pages_per_row: int) -> int | None:
    """The pages `paged_decode_attention` reads per block from a table of `pages_per_row`
    pages of `page_size` slots (about `BLOCK_SLOTS` slots, a power of two of at least 16), or
    None where no such block exists (a page size that is not a power of two, too few slots)."""
    if not _power_of_two(page_size):
        return None
    wanted = min(pages_per_row, max(1, BLOCK_SLOTS // page_size))
    block_pages = 1 << (wanted.bit_length() - 1)
    return block_pages if block_pages * page_size >= MIN_DOT else None


def paged_decode_attention(q_BTNH: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                           pages: jax.Array, mask_BTS: jax.Array, scale: float | None = None,
                           interpret: bool = False, sinks_N: jax.Array | None = None
                           ) -> jax.Array:
    """`decode_attention` over layer `layer` of a paged cache's pools [L, pages, K, U, H]
    (`model/paged.py`), each row reading only the pages its table `pages` [B, pages per row]
    names, over the blocks it sees; `sinks` as `decode_attention`'s. A layer view
    [B, K, S, H] of the pools must pass
    `decode_kernel_fits`, and `paged_block_pages` find a block."""
    from jax.experimental import pallas as pl

    num_layers, num_pages, kv_heads, page_size, head_dim = k_pool.shape
    pages_per_row = pages.shape[1]
    block_pages = paged_block_pages(page_size, pages_per_row)
    blocks_B2, q_BKMH, seen_BS = _kernel_inputs(q_BTNH, kv_heads, k_pool.dtype, mask_BTS,
                                                block_pages * page_size, scale)
    # The layers' pools as one pool of L x pages (a reshape, no copy) and each row's pages
    # offset into the layer's: slicing a layer out of the pools would copy all of it.
    pools = [pool.reshape(num_layers * num_pages, kv_heads, page_size, head_dim)
             for pool in (k_pool, v_pool)]
    layer_pages = jnp.maximum(pages, 0) + layer * num_pages  # unassigned: page 0, masked
    whole_pool = pl.BlockSpec((num_layers * num_pages, None, page_size, head_dim),
                              lambda b, k: (0, k, 0, 0))
    table = pl.BlockSpec((None, pages_per_row), lambda b, k: (b, 0))
    kernel = functools.partial(_paged_kernel, block_pages=block_pages,
                               pages_per_row=pages_per_row)
    out_BKMH = _call(kernel, [whole_pool, whole_pool, table], interpret,
                     "kvjax_paged_decode_attention", blocks_B2, q_BKMH, *pools,
                     layer_pages.astype(jnp.int32), seen_BS,
                     sinks_KM=_sinks_KM(sinks_N, kv_heads))
    return _outputs(out_BKMH, q_BTNH)


def _kernel_inputs(q_BTNH, kv_heads, dtype, mask_BTS, block, scale):
    """What both kernels take besides the cache: each row's blocks that hold the slots it
    may see, the first and one past the last [B, 2], the queries scaled and padded per kv head
    [B, K, M, H] in the cache's dtype, and the seen slots [B, S] as int8."""
    batch, _, num_heads, head_dim = q_BTNH.shape
    group = num_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    q_BKGH = q_BTNH.reshape(batch, kv_heads, group, head_dim).astype(jnp.float32) * scale
    # The rows past the group are zeros, and their outputs are sliced off in `_outputs`.
    q_BKMH = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, MIN_DOT - group), (0, 0))).astype(dtype)
    # Each row reads the blocks that hold the slots it may see: those outside are never
    # loaded (past its length, or before its sliding window).
    blocks_B2 = jax.vmap(lambda mask_1S: jnp.stack(seen_blocks(mask_1S[None], block)))(
        mask_BTS[:, :1])
    return blocks_B2.astype(jnp.int32), q_BKMH, mask_BTS[:, 0].astype(jnp.int8)


def _sinks_KM(sinks_N, kv_heads):
    """The sink logits [N] as the kernels take them, [K, M] in float32 (the rows past a
    group's queries padded with zeros), or None."""
    if sinks_N is None:
        return None
    sinks_KG = sinks_N.astype(jnp.float32).reshape(kv_heads, -1)
    return jnp.pad(sinks_KG, ((0, 0), (0, MIN_DOT - sinks_KG.shape[1])))


def _call(kernel, cache_specs, interpret, name, blocks_B2, q_BKMH, *operands, sinks_KM=None):
    """The kernel over a grid of (row, kv head): the blocks and queries, then `operands`
    (the cache's, by `cache_specs`, then the seen slots), then the sinks where given."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    batch, kv_heads, _, head_dim = q_BKMH.shape
    per_head = pl.BlockSpec((None, None, MIN_DOT, head_dim), lambda b, k: (b, k, 0, 0))
    sinks = []
    if sinks_KM is not None:
        operands, sinks = (*operands, sinks_KM), [pl.BlockSpec((None, MIN_DOT),
                                                               lambda b, k: (k, 0))]
    seen = operands[len(cache_specs)]
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads),
        in_specs=[pl.BlockSpec((None, 2), lambda b, k: (b, 0)), per_head, *cache_specs,
                  pl.BlockSpec((None, seen.shape[1]), lambda b, k: (b, 0)), *sinks],
        out_specs=per_head,
        out_shape=jax.ShapeDtypeStruct(q_BKMH.shape, jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=name,
    )(blocks_B2, q_BKMH, *operands)


def _outputs(out_BKMH, q_BTNH):
    """The kernel's outputs [B, K, M, H] as attention's [B, 1, N, H] in Q's dtype."""
    batch, _, num_heads, head_dim = q_BTNH.shape
    group = num_heads // out_BKMH.shape[1]
    return out_BKMH[:, :, :group].reshape(batch, 1, num_heads, head_dim).astype(q_BTNH.dtype)


def _kernel(blocks_ref, q_ref, k_ref, v_ref, seen_ref, *refs, block, capacity):
    """One (row, kv head): its G queries over the row's blocks `blocks_ref[0]` to
    `blocks_ref[1]` (one past the last).
    `refs`: the sinks' (where given), then the output's."""
    from jax.experimental import pallas as pl

    def read(index):
        # The last block starts early when `block` does not divide the capacity: every read
        # stays inside the row, and the slots before `first` (read by the block before) are
        # masked here.
        first = index * block
        start = jnp.minimum(first, capacity - block)
        slots_U = start + jnp.arange(block, dtype=jnp.int32)
        seen_U = (seen_ref[pl.ds(start, block)] != 0) & (slots_U >= first)
        return k_ref[pl.ds(start, block), :], v_ref[pl.ds(start, block), :], seen_U

    refs[-1][...] = _online_softmax(q_ref[...], blocks_ref[0], blocks_ref[1], read,
                                    *refs[:-1])


def _paged_kernel(blocks_ref, q_ref, k_ref, v_ref, pages_ref, seen_ref, *refs,
                  block_pages, pages_per_row):
    """One (row, kv head) of a paged cache: its G queries over the pages of the row's blocks
    `blocks_ref[0]` to `blocks_ref[1]`, each block `block_pages` pages of the row's table."""
    from jax.experimental import pallas as pl

    page_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    block = block_pages * page_size

    def read(index):
        first = index * block_pages  # the last block starts early, as in `_kernel`
        start = jnp.minimum(first, pages_per_row - block_pages)
        block_page_ids = pages_ref[pl.ds(start, block_pages)]
        slots_U = start * page_size + jnp.arange(block, dtype=jnp.int32)
        seen_U = ((seen_ref[pl.ds(start * page_size, block)] != 0)
                  & (slots_U >= first * page_size))
        return (k_ref[block_page_ids].reshape(block, head_dim),
                v_ref[block_page_ids].reshape(block, head_dim),
                seen_U)

    refs[-1][...] = _online_softmax(q_ref[...], blocks_ref[0], blocks_ref[1], read,
                                    *refs[:-1])


def _online_softmax(q_MH, first_block, num_blocks, read, sinks_ref=None):
    """softmax(QKᵀ)V of the queries q [M, H] over blocks `first_block` to `num_blocks` (one
    past the last), block i's keys, values and seen slots being `read(i)` ([U, H], [U, H],
    [U] bool): FlashAttention's running max and sum, unseen slots at exactly zero weight and
    their values zeroed. With `sinks_ref` [M] each query's max and sum start from its sink,
    a slot of value zero."""
    head_dim = q_MH.shape[-1]

    def body(index, carry):
        max_M, sum_M, acc_MH = carry
        k_UH, v_UH, seen_U = read(index)
        logits_MU = jnp.dot(q_MH, k_UH.T, preferred_element_type=jnp.float32)
        logits_MU = jnp.where(seen_U[None, :], logits_MU, -jnp.inf)
        new_max_M = jnp.maximum(max_M, jnp.max(logits_MU, axis=1))
        # While a query has seen no slot its max is -inf; subtract 0 then, so exp() gives 0.
        shift_M = jnp.where(new_max_M > -jnp.inf, new_max_M, 0.0)
        rescale_M = jnp.exp(max_M - shift_M)
        weights_MU = jnp.exp(logits_MU - shift_M[:, None])
        sum_M = sum_M * rescale_M + jnp.sum(weights_MU, axis=1)
        v_UH = jnp.where(seen_U[:, None], v_UH, 0)
        update_MH = jnp.dot(weights_MU.astype(v_UH.dtype), v_UH,
                            preferred_element_type=jnp.float32)
        return new_max_M, sum_M, acc_MH * rescale_M[:, None] + update_MH

    if sinks_ref is None:
        first_max, first_sum = jnp.full((MIN_DOT,), -jnp.inf, jnp.float32), 0.0
    else:
        first_max, first_sum = sinks_ref[...], 1.0
    init = (first_max, jnp.full((MIN_DOT,), first_sum, jnp.float32),
            jnp.zeros((MIN_DOT, head_dim), jnp.float32))
    _, sum_M, acc_MH = jax.lax.fori_loop(first_block, num_blocks, body, init)
    return acc_MH / jnp.where(sum_M > 0, sum_M, 1.0)[:, None]
