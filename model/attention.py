"""Scaled dot-product multi-head attention: softmax(QKᵀ/√d_k + mask)V.

Shape letters: B batch, T queries, S keys, N query heads, K kv heads, G = N/K query heads per
kv head, H head dim, D model dim. With grouped-query attention (K < N) each group of G query
heads shares one K/V head, so the cache holds K heads, not N.

Fresh keys and values come out of their projections as [B, S, K, H]; the cache stores them
as [B, K, S, H] (see `model/cache.py`): `attend` takes the first, `attend_blocks` the second.

What runs where: a call without a cache, and the prefill (the prompt into an empty cache),
attend over the new tokens' K/V (`attend`): through cuDNN's fused kernel on an NVIDIA GPU
where the caller describes its mask (`model/fused_attention.py`), else through XLA's own
ops (`jax.nn.dot_product_attention`, whose default is XLA's on every backend). A call that
reads the cache (decode steps, a chunk after the prefill, cross-attention over the cached
source) runs `attend_blocks`, which on a CPU reads only the blocks of slots that some row
has filled, and on an accelerator reads a layer of up to 64 MiB in one pass (there a loop
iteration or a branch waits for the host, and costs more than the reading). A float16 or
bfloat16 decode step on one NVIDIA GPU attends through one kernel per layer instead
(`model/decode_kernel.py`).

With an int8 cache (`model/quantize.py`) `attend_blocks` always reads by blocks and applies
the scales block by block, to the logits and to the weights, and the prefill attends over
its new K/V as the cache holds them (quantised and dequantised), so that a token's output
does not depend on whether it came in the prefill or a later step: one prefill over a whole
sequence equals a shorter prefill followed by decode steps, as it does with a float cache.

Attention sinks (`config.attention_sinks`, gpt-oss): each query head has a learned logit s
that joins each of its softmaxes as one more key whose value is zero,
w_i = exp(l_i) / (Σ_j exp(l_j) + exp(s)), so a query may give little weight to every key it
sees. Every way of attending above takes them (`sinks` [N]), except cuDNN's and jax's fused
attention, which a call with sinks does not use. A query that sees no key returns zeros.

A position bias (`positional.PositionBias`: ALiBi's, BLOOM and MPT; T5's learned buckets)
gives no position to the tokens; each head adds to the logit of query position i for key
position j a bias by j - i. Key positions are those of the new tokens in `attend`, a slot's
index in a cache (slot j holds position j). The flash kernels (cuDNN's, jax's, the decode
kernel) take no such bias, so a call with one runs XLA's ops, as with sinks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .decode_kernel import decode_attention, decode_kernel_use, seen_blocks
from .fused_attention import attend_fused, fused_attention_applies
from .positional import PositionBias


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap · tanh(logits / cap): logits squashed into (-cap, cap), unchanged for None."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def attend(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
           mask_BTS: jax.Array, scale: float | None = None,
           softcap: float | None = None, *, key_lengths_B: jax.Array | None = None,
           causal: bool = False, window: int | None = None,
           sinks_N: jax.Array | None = None, bias: PositionBias | None = None) -> jax.Array:
    """softmax(QKᵀ/√H + mask)V with a boolean mask (True = may attend). Returns [B, T, N, H].

    `scale` replaces 1/√H; `softcap` caps the scaled logits (`soft_cap`) before the mask.
    Masked keys get exactly zero weight; the softmax runs in float32 for every input dtype.
    A query row with no key to attend to (all masked) returns zeros rather than NaN or a
    uniform average. `key_lengths` [B], where given, says what the mask is: key slot s is
    allowed iff s < key_lengths[b] (and s <= the query's index, with `causal`, and
    s > the query's index - `window` where a window is given); a fused kernel then runs
    where the backend has one (`model/fused_attention.py`). `sinks` [N] (where given) are
    each query head's sink logit (above); `bias`, a bias by distance (above), the
    keys at the queries' positions (self-attention over the new tokens).
    """
    if window is not None and not causal:
        raise ValueError(f"a sliding window of {window} describes a causal mask only")
    fusable = sinks_N is None and softcap is None and bias is None
    if key_lengths_B is not None and fusable and fused_attention_applies(
            q_BTNH, k_BSKH, v_BSKH, softcap):
        out = attend_fused(q_BTNH, k_BSKH, v_BSKH, key_lengths_B, causal, scale, window)
        return _zero_rows_without_keys(out, mask_BTS).astype(q_BTNH.dtype)
    if fusable:
        out = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None],
                                           scale=scale)
        return _zero_rows_without_keys(out, mask_BTS).astype(q_BTNH.dtype)
    # jax's attention has no cap, no sinks and no bias: the same softmax, written out.
    batch, num_queries, num_heads, head_dim = q_BTNH.shape
    kv_heads = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(batch, num_queries, kv_heads, num_heads // kv_heads, head_dim)
    logits_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32)
    logits_BKGTS = soft_cap(logits_BKGTS * (head_dim**-0.5 if scale is None else scale),
                            softcap)
    if bias is not None:
        logits_BKGTS = logits_BKGTS + bias.logits_BKGTS(
            kv_heads, bias.positions_BT[:, :k_BSKH.shape[1]])
    weights_BKGTS = _masked_softmax(logits_BKGTS, mask_BTS, _sinks_KG(sinks_N, kv_heads))
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", weights_BKGTS.astype(v_BSKH.dtype), v_BSKH,
                           preferred_element_type=jnp.float32)
    return out_BTKGH.reshape(q_BTNH.shape).astype(q_BTNH.dtype)


# Per slot, a block of the loop below costs XLA:CPU about three times what one product over
# the whole cache does (each block is copied out of the cache before its products), so a
# step whose filled blocks cover more than this share of a layer's capacity reads all of it.
WHOLE_CACHE_SHARE = 1 / 3
# A stack of several layers (scanned layers) gets no per-step choice. A product over one of
# its layers first copies that layer out of the stack: for a layer of K larger than this the
# copy costs more than the blocks it would save, so the stack is always read by blocks; a
# smaller layer (a few rows) is always read whole, which costs less than choosing.
STACKED_WHOLE_MAX_BYTES = 1 << 20
# On an accelerator each iteration of a loop, and each conditional, waits for the host to
# read its predicate (a GPU: some 10 µs, the time it takes to read tens of MB), so a layer
# up to this size is read in one pass with no branch and no loop: every slot, unseen ones
# zeroed. On a CPU a loop iteration costs next to nothing and the blocks above pay, except
# in a layer of a few rows of a small model: its one pass is as fast as the choice between
# the two ways, and its step compiles into a smaller program (no conditional, one way
# instead of two), which is most of what a small model costs on a CPU.
ACCELERATOR_ONE_READ_MAX_BYTES = 64 << 20
CPU_ONE_READ_MAX_BYTES = 64 << 10


def one_read_max_bytes() -> int:
    """The largest layer of the cache `attend_blocks` reads in one pass by default."""
    if jax.default_backend() == "cpu":
        return CPU_ONE_READ_MAX_BYTES
    return ACCELERATOR_ONE_READ_MAX_BYTES


def attend_blocks(q_BTNH: jax.Array, k_LBKSH: jax.Array, v_LBKSH: jax.Array, layer,
                  mask_BTS: jax.Array, block_size: int,
                  whole_share: float = WHOLE_CACHE_SHARE,
                  scales: tuple[jax.Array, jax.Array] | None = None,
                  one_read_bytes: int | None = None, scale: float | None = None,
                  softcap: float | None = None, sinks_N: jax.Array | None = None,
                  bias: PositionBias | None = None) -> tuple[jax.Array, jax.Array]:
    """`attend` over layer `layer` of the cache's stacks [L, B, K, S, H], reading only the
    blocks of `block_size` slots from the first to the last slot that `mask` lets any query
    see (`seen_blocks`): a row's filled slots, or a sliding window's.
    `scales` are an int8 cache's (k_scale, v_scale) stacks [L, B, K, S] (None for floats):
    the keys and values attended to are then `k * k_scale` and `v * v_scale`. `scale`,
    `softcap`, `sinks` and `bias` are `attend`'s (the keys' positions: the slots).

    Returns the output [B, T, N, H] and how many blocks of the capacity were read (a scalar).
    The range of blocks is traced: a decode loop compiles once and each step pays for what
    it sees, not for the capacity. For a float cache, when those blocks cover more than
    `whole_share` of the capacity, one product over every slot costs less than the loop
    (`_attend_whole`); otherwise the blocks run in a `lax.while_loop`
    (`_attend_filled_blocks`). A stack of several layers is read one way at
    every step, by its layers' size (`STACKED_WHOLE_MAX_BYTES`). An int8 cache is always
    read by blocks. A layer of at most `one_read_bytes` (default `one_read_max_bytes()`:
    up to 64 KiB on a CPU, 64 MiB on an accelerator) is read in one pass over all of it,
    with no loop and no conditional, float or int8. A decode step that
    `decode_kernel_use` admits runs the kernel instead, each row read over its own seen blocks.
    Either way slots a query may not see get exactly zero weight, whatever they hold (even
    NaN) cannot reach the output, and a query that sees no slot at all returns zeros.
    """
    _, _, kv_heads, capacity, _ = k_LBKSH.shape
    block = min(block_size, capacity)
    first_block, num_blocks = seen_blocks(mask_BTS, block)
    layers_BKSH = [jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in (k_LBKSH, v_LBKSH)]
    kernel = None if scales is not None or bias is not None else decode_kernel_use(
        q_BTNH, *layers_BKSH, softcap)
    if kernel is not None:
        k_BKSH, v_BKSH = (jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False)
                          for stack in (k_LBKSH, v_LBKSH))
        return decode_attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale,
                                interpret=kernel == "interpret", sinks_N=sinks_N), \
            num_blocks - first_block
    q_XMH = _queries_XMH(q_BTNH, kv_heads, scale)
    sinks_KG = _sinks_KG(sinks_N, kv_heads)
    all_blocks = -(-capacity // block)
    layer_bytes = k_LBKSH.size // k_LBKSH.shape[0] * k_LBKSH.dtype.itemsize
    if one_read_bytes is None:
        one_read_bytes = one_read_max_bytes()
    if layer_bytes <= one_read_bytes:
        if scales is None:
            out_XMH = _attend_whole(q_XMH, k_LBKSH, v_LBKSH, layer, mask_BTS, softcap,
                                    zero_unseen=True, sinks_KG=sinks_KG, bias=bias)
        else:  # one block of every slot: the loop's body, run once
            out_XMH = _attend_filled_blocks(q_XMH, k_LBKSH, v_LBKSH, layer, mask_BTS, softcap,
                                            capacity, 1, scales, sinks_KG=sinks_KG, bias=bias)
        return _to_BTNH(out_XMH, q_BTNH), jnp.asarray(all_blocks, jnp.int32)
    if scales is not None:
        # An int8 cache is always read by blocks: a product over a whole layer would first
        # convert all of it to float32 (XLA:CPU does not fuse the conversion into the
        # product), a float copy of the layer at every step; a block converts only its own
        # slots and copies a quarter of the bytes of a float32 block (benchmarks/README.md).
        blocks = _attend_filled_blocks(q_XMH, k_LBKSH, v_LBKSH, layer, mask_BTS, softcap,
                                       block, num_blocks, scales, sinks_KG=sinks_KG,
                                       first_block=first_block, bias=bias)
        return _to_BTNH(blocks, q_BTNH), num_blocks - first_block
    args = (q_XMH, k_LBKSH, v_LBKSH, layer, mask_BTS, softcap)

    def by_blocks():
        return _attend_filled_blocks(*args, block, num_blocks, sinks_KG=sinks_KG,
                                     first_block=first_block, bias=bias)

    if k_LBKSH.shape[0] > 1:
        if layer_bytes > STACKED_WHOLE_MAX_BYTES:
            return _to_BTNH(by_blocks(), q_BTNH), num_blocks - first_block
        return (_to_BTNH(_attend_whole(*args, sinks_KG=sinks_KG, bias=bias), q_BTNH),
                jnp.asarray(all_blocks, jnp.int32))
    out_XMH, blocks_read = jax.lax.cond(
        (num_blocks - first_block) * block > whole_share * capacity,
        lambda: (_attend_whole(*args, sinks_KG=sinks_KG, bias=bias),
                 jnp.asarray(all_blocks, jnp.int32)),
        lambda: (by_blocks(), num_blocks - first_block))
    return _to_BTNH(out_XMH, q_BTNH), blocks_read


def _queries_XMH(q_BTNH, kv_heads: int, scale: float | None) -> jax.Array:
    """The queries [B, T, N, H] as the products take them, [X, M, H] in float32, scaled.

    (B, K) merged into one batch axis X of heads and (G, T) into M query rows: with one
    batch axis the products take each block as it is sliced. With two, (B, K), a backend
    that drops a unit B axis (XLA:CPU does) copies K transposed for every product."""
    batch, num_queries, num_heads, head_dim = q_BTNH.shape
    group = num_heads // kv_heads
    q_XMH = (q_BTNH.reshape(batch, num_queries, kv_heads, group, head_dim)
             .transpose(0, 2, 3, 1, 4).reshape(batch * kv_heads, group * num_queries, head_dim))
    q_XMH = q_XMH.astype(jnp.float32)
    return q_XMH / jnp.sqrt(float(head_dim)) if scale is None else q_XMH * scale


def _to_BTNH(out_XMH, q_BTNH):
    """The [X, M, H] output back in the query's [B, T, N, H] layout and dtype."""
    batch, num_queries, num_heads, head_dim = q_BTNH.shape
    kv_heads = out_XMH.shape[0] // batch
    out = out_XMH.reshape(batch, kv_heads, num_heads // kv_heads, num_queries, head_dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(q_BTNH.shape).astype(q_BTNH.dtype)


def _attend_whole(q_XMH, k_LBKSH, v_LBKSH, layer, mask_BTS, softcap, zero_unseen: bool = False,
                  sinks_KG=None, bias=None):
    """Softmax attention over every slot of the layer in two products, its logits capped
    by `softcap` (None: not) and biased by `bias` where given, beside the sinks
    [K, G] where given. Returns [X, M, H].
    `zero_unseen`: V is always read with unseen slots zeroed (below), never conditionally."""
    _, batch, kv_heads, capacity, head_dim = k_LBKSH.shape
    num_queries = mask_BTS.shape[1]
    group = q_XMH.shape[1] // num_queries
    k_XSH = jax.lax.dynamic_index_in_dim(k_LBKSH, layer, keepdims=False).reshape(
        -1, capacity, head_dim)
    v_BKSH = jax.lax.dynamic_index_in_dim(v_LBKSH, layer, keepdims=False)
    logits_XMS = soft_cap(jnp.einsum("XMH,XSH->XMS", q_XMH.astype(k_XSH.dtype), k_XSH,
                                     preferred_element_type=jnp.float32), softcap)
    logits_BKGTS = logits_XMS.reshape(batch, kv_heads, group, num_queries, capacity)
    if bias is not None:
        logits_BKGTS = logits_BKGTS + bias.logits_BKGTS(kv_heads, jnp.arange(capacity))
    weights_XMS = _masked_softmax(logits_BKGTS, mask_BTS, sinks_KG).reshape(logits_XMS.shape)

    def mix(v_BKSH):
        return jnp.einsum("XMS,XSH->XMH", weights_XMS.astype(v_BKSH.dtype),
                          v_BKSH.reshape(-1, capacity, head_dim),
                          preferred_element_type=jnp.float32)

    # Unseen slots have weight exactly 0, so only a non-finite value in one can reach the
    # output (0 * NaN): V is read with them zeroed. A layer of a stack of several is copied
    # out of the stack before its product anyway, and the zeroing rides along with that
    # copy. A single layer is read in place, where zeroing would copy the whole V; there the
    # rare output that is not finite is mixed again from a copy with the unseen slots zeroed.
    def mix_seen():
        seen_B1S1 = jnp.any(mask_BTS, axis=1)[:, None, :, None]
        return mix(jnp.where(seen_B1S1, v_BKSH, 0))

    if v_LBKSH.shape[0] > 1 or zero_unseen:
        return mix_seen()
    out_XMH = mix(v_BKSH)
    return jax.lax.cond(jnp.all(jnp.isfinite(out_XMH)), lambda: out_XMH, mix_seen)


def _attend_filled_blocks(q_XMH, k_LBKSH, v_LBKSH, layer, mask_BTS, softcap, block,
                          num_blocks, scales=None, pages=None, sinks_KG=None, first_block=0,
                          bias=None):
    """The online softmax (FlashAttention's recurrence) over blocks `first_block` to
    `num_blocks` (one past the last) of `block` slots, in a `lax.while_loop` (no loop when
    one block holds every slot). The slots outside them must be unseen. Returns [X, M, H].

    Per query it keeps a running max m, a running sum l of exp(logit - m) and an
    accumulator of the weighted values, both rescaled by exp(m_old - m_new) whenever a block
    raises the max. The values of unseen slots are zeroed before their product. Each block
    is sliced straight out of the stack, so a scanned layer reads its blocks without first
    copying its whole layer out of the stack. With `scales` (an int8 cache's) a block is
    converted to float32 as it is read, and its scales are applied to its logits and to its
    weights; an unseen slot's weight stays exactly 0 whatever its scale holds. The logits
    are capped by `softcap` (None: not) after the scales. With `pages` [B, pages per row]
    the stacks are a paged cache's pools [L, pages, K, U, H] (`model/paged.py`), `block` is
    a multiple of their page size and a row's block is gathered from its pages. With
    `sinks` [K, G] each query's running max and sum start from its head's sink logit, as if
    its sink were one more slot, seen first, whose value is zero. With `bias` each
    block's logits take the bias of its slots (after the cap).
    """
    batch, _, capacity = mask_BTS.shape
    kv_heads, head_dim = k_LBKSH.shape[2], k_LBKSH.shape[4]
    heads, rows, _ = q_XMH.shape
    num_queries = mask_BTS.shape[1]
    group = rows // num_queries

    dtype = jnp.float32 if scales is not None else k_LBKSH.dtype

    def read_page(pool, start):  # -> [B, K, U, ...]: each row's pages of the block's slots
        # The layers' pools as one pool of L x pages (a reshape, no copy), each page offset
        # into its layer's: slicing the layer out of a stack of several would copy all of
        # its pages at every block.
        num_layers, num_pages, _, page_size = pool.shape[:4]
        every_layer = pool.reshape(num_layers * num_pages, *pool.shape[2:])
        columns = start // page_size + jnp.arange(block // page_size)
        rows = jnp.take(every_layer, jnp.maximum(pages[:, columns], 0) + layer * num_pages,
                        axis=0)
        rows = jnp.swapaxes(rows, 1, 2)  # [B, K, pages of the block, page slots, ...]
        return rows.reshape(*rows.shape[:2], block, *rows.shape[4:])

    def read_block(stack_LBKSH, start):  # -> [X, U, H], U = block slots
        # The stack goes into the loop as it is, not reshaped: at batch 1 XLA:CPU fuses the
        # cache write into a reshape of it and into the loop's carry separately, and must
        # then copy the whole stack for each of the two.
        if pages is not None:
            return read_page(stack_LBKSH, start).reshape(heads, block, head_dim).astype(dtype)
        return jax.lax.dynamic_slice(stack_LBKSH, (layer, 0, 0, start, 0),
                                     (1, batch, kv_heads, block, head_dim)).reshape(
                                         heads, block, head_dim).astype(dtype)

    def read_scales(scale_LBKS, start):  # -> [B, K, 1, 1, U], as the block's logits
        if pages is not None:
            return read_page(scale_LBKS, start).reshape(batch, kv_heads, 1, 1, block)
        return jax.lax.dynamic_slice(scale_LBKS, (layer, 0, 0, start),
                                     (1, batch, kv_heads, block)).reshape(
                                         batch, kv_heads, 1, 1, block)

    def body(carry):
        index, max_BKGT, sum_BKGT, acc_XMH = carry
        # The last block starts early when `block` does not divide the capacity; the slots
        # before `first` were read by the block before it and are masked here.
        first = index * block
        start = jnp.minimum(first, capacity - block)
        seen_BTU = jax.lax.dynamic_slice(mask_BTS, (0, 0, start), (batch, num_queries, block))
        seen_BTU &= start + jnp.arange(block, dtype=jnp.int32) >= first
        logits_XMU = jnp.einsum("XMH,XUH->XMU", q_XMH.astype(dtype),
                                read_block(k_LBKSH, start), preferred_element_type=jnp.float32)
        logits_BKGTU = logits_XMU.reshape(batch, kv_heads, group, num_queries, block)
        if scales is not None:
            logits_BKGTU = logits_BKGTU * read_scales(scales[0], start)
        logits_BKGTU = soft_cap(logits_BKGTU, softcap)
        if bias is not None:
            logits_BKGTU = logits_BKGTU + bias.logits_BKGTS(
                kv_heads, start + jnp.arange(block, dtype=jnp.int32))
        logits_BKGTU = jnp.where(seen_BTU[:, None, None], logits_BKGTU, -jnp.inf)
        new_max = jnp.maximum(max_BKGT, jnp.max(logits_BKGTU, axis=-1))
        # While a query has seen no slot its max is -inf; subtract 0 then, so exp() gives 0.
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        rescale_BKGT = jnp.exp(max_BKGT - shift)
        weights_BKGTU = jnp.exp(logits_BKGTU - shift[..., None])
        sum_BKGT = sum_BKGT * rescale_BKGT + jnp.sum(weights_BKGTU, axis=-1)
        any_seen_BU = jnp.any(seen_BTU, axis=1)[:, None, :, None]
        v_BKUH = read_block(v_LBKSH, start).reshape(batch, kv_heads, block, head_dim)
        v_XUH = jnp.where(any_seen_BU, v_BKUH, 0).reshape(heads, block, head_dim)
        mixed_BKGTU = weights_BKGTU
        if scales is not None:
            mixed_BKGTU = jnp.where(seen_BTU[:, None, None],
                                    weights_BKGTU * read_scales(scales[1], start), 0.0)
        update_XMH = jnp.einsum("XMU,XUH->XMH",
                                mixed_BKGTU.reshape(heads, rows, block).astype(v_XUH.dtype),
                                v_XUH, preferred_element_type=jnp.float32)
        acc_XMH = acc_XMH * rescale_BKGT.reshape(heads, rows, 1) + update_XMH
        return index + 1, new_max, sum_BKGT, acc_XMH

    stats_shape = (batch, kv_heads, group, num_queries)
    if sinks_KG is None:
        first_max, first_sum = jnp.full(stats_shape, -jnp.inf), jnp.zeros(stats_shape)
    else:
        first_max = jnp.broadcast_to(sinks_KG[None, :, :, None], stats_shape)
        first_sum = jnp.ones(stats_shape)
    init = (jnp.asarray(first_block, jnp.int32), first_max.astype(jnp.float32),
            first_sum.astype(jnp.float32), jnp.zeros((heads, rows, head_dim), jnp.float32))
    if block == capacity:  # one block holds every slot: no loop
        _, _, sum_BKGT, acc_XMH = body(init)
    else:
        _, _, sum_BKGT, acc_XMH = jax.lax.while_loop(
            lambda carry: carry[0] < num_blocks, body, init)
    return acc_XMH / jnp.where(sum_BKGT > 0, sum_BKGT, 1.0).reshape(heads, rows, 1)


def _masked_softmax(logits_BKGTS: jax.Array, mask_BTS: jax.Array,
                    sinks_KG: jax.Array | None = None) -> jax.Array:
    """softmax over S of the logits where `mask` allows, in float32: masked slots get
    exactly 0, and a query that may see no slot gets all zeros (no NaN). With `sinks` [K, G]
    each head's sink logit joins the denominator."""
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, -jnp.inf)
    top = jnp.max(logits_BKGTS, axis=-1, keepdims=True)
    if sinks_KG is not None:
        sink = sinks_KG[None, :, :, None, None].astype(jnp.float32)
        top = jnp.maximum(top, sink)
    weights = jnp.exp(logits_BKGTS - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks_KG is not None:
        total = total + jnp.exp(sink - top)
    return weights / jnp.where(total > 0, total, 1.0)


def _sinks_KG(sinks_N: jax.Array | None, kv_heads: int) -> jax.Array | None:
    """The query heads' sink logits [N] grouped by kv head, [K, G], in float32."""
    if sinks_N is None:
        return None
    return sinks_N.astype(jnp.float32).reshape(kv_heads, -1)


def _zero_rows_without_keys(out_BTNH, mask_BTS):
    has_key_BT = jnp.any(mask_BTS, axis=-1)
    return jnp.where(has_key_BT[:, :, None, None], out_BTNH, 0)
