"""The two model variants: `DecoderOnlyLM` (GPT-style) and `EncoderDecoder` (the original).

Every call is functional: it takes a `KVCache` (or None for a plain full forward) and returns
`(logits, new_cache)`. Shape letters as in `model/cache.py`.

A call with a cache processes T new tokens per row in parallel. With a fresh cache and the
whole prompt this is the *prefill*: one matmul-heavy pass that fills the cache. With T = 1
it is a *decode step*: the new token's query attends over all cached keys, and the step is
bound by reading weights and cache from memory, not by arithmetic.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .attention_layers import CrossKV
from .cache import KVCache, check_cache, init_cache
from .config import TransformerConfig
from .embedder import embedder
from .layers import DecoderLayer, EncoderLayer, LayerInputs, layer_stack, run_layers
from .norms import make_norm
from .paged import pages_hold
from .quantize import quantize
from .ring import most_step_tokens, ring_inputs


def _valid_lengths(tokens_BT: jax.Array, lengths_B: jax.Array | None) -> jax.Array:
    if lengths_B is None:
        return jnp.full((tokens_BT.shape[0],), tokens_BT.shape[1], jnp.int32)
    return jnp.asarray(lengths_B, jnp.int32)


def self_attention_inputs(config: TransformerConfig, starts_B, valid_B, num_queries: int,
                          num_keys: int, capacity: int | None, pages=None, page_size: int = 0,
                          ring: int | None = None) -> tuple[LayerInputs, jax.Array, jax.Array]:
    """Positions and the causal + padding mask for T new tokens written after `starts`.

    Query t of row b sits at position starts[b] + t; key slot s holds position s. A query
    sees slot s iff s <= its position and s < the row's new length, and with a sliding
    window, iff s > its position - window (the full mask, for layers that see everything,
    rides along when some do). With a paged cache's page tables `pages` (of pages of
    `page_size` slots) a row fits only where a page holds every position it writes. With
    `ring`, the slots of the windowed layers' rings (`model/ring.py`), the inputs say what
    those layers see and where they write. Returns the layer inputs, the new lengths [B] and
    the rows that did not fit [B] (all False w/o cache).
    """
    window = config.sliding_window
    positions_BT = starts_B[:, None] + jnp.arange(num_queries, dtype=jnp.int32)
    new_lengths_B = starts_B + valid_B
    slots_S = jnp.arange(num_keys, dtype=jnp.int32)
    mask_BTS = (slots_S[None, None, :] <= positions_BT[:, :, None]) & (
        slots_S[None, None, :] < new_lengths_B[:, None, None])
    full_mask_BTS = mask_BTS if config.full_attention_layers else None
    if window is not None:
        mask_BTS &= slots_S[None, None, :] > positions_BT[:, :, None] - window
    inputs = LayerInputs(positions_BT, mask_BTS, full_mask_BTS)
    if capacity is None:
        return inputs, new_lengths_B, jnp.zeros_like(valid_B, bool)
    fits_B = starts_B + num_queries <= capacity
    if pages is not None:
        fits_B &= pages_hold(pages, page_size, starts_B, valid_B)
    new_lengths_B = jnp.where(fits_B, new_lengths_B, starts_B)
    overflowed_B = ~fits_B & (valid_B > 0)
    if ring is not None:
        ring_mask_BTS, ring_writes_BT = ring_inputs(window, ring, positions_BT, starts_B,
                                                    new_lengths_B)
        inputs = inputs.replace(ring_mask=ring_mask_BTS, ring_writes=ring_writes_BT)
    return (inputs.replace(starts=starts_B, fits=fits_B, pages=pages), new_lengths_B,
            overflowed_B)


_KV_FIELDS = ("k", "v")
_QUANTIZED_KV_FIELDS = ("k", "v", "k_scale", "v_scale")


def _stacked_kv(cache: KVCache | None):
    """The cache's self-attention K/V as `run_layers` holds them: one `(k, v)` per stack, or
    `(k, v, k_scale, v_scale)` for an int8 cache."""
    if cache is None:
        return None
    fields = _QUANTIZED_KV_FIELDS if cache.quantized else _KV_FIELDS
    return tuple(zip(*(getattr(cache, name) for name in fields), strict=True))


def _page_tables(cache: KVCache | None) -> tuple:
    """`(pages, page_size)` of a paged cache, else `()`."""
    return (cache.pages, cache.page_size) if cache is not None and cache.paged else ()


def _check_ring_call(config: TransformerConfig, cache: KVCache, num_tokens: int,
                     fresh: bool) -> None:
    """Raises a ValueError when a call after the prefill would write more tokens into the
    windowed layers' rings than their slots let its queries read back (`model/ring.py`)."""
    if cache.ring_slots is None or fresh:
        return
    most = most_step_tokens(config, cache.ring_slots)
    if num_tokens > most:
        raise ValueError(f"a call of {num_tokens} tokens per row after the prefill needs rings "
                         f"of at least {config.sliding_window + num_tokens - 1} slots; this "
                         f"cache's windowed layers keep {cache.ring_slots} (it was made for "
                         f"calls of up to {most}: init_cache(..., step_tokens=N))")


def _with_new_kv(cache: KVCache, stacked, new_lengths_B, overflowed_B) -> KVCache:
    fields = _QUANTIZED_KV_FIELDS if cache.quantized else _KV_FIELDS
    new = {name: tuple(kv[i] for kv in stacked) for i, name in enumerate(fields)}
    return cache.replace(**new, lengths=new_lengths_B, overflow=cache.overflow | overflowed_B)


def _cross_inputs(cross_k, cross_v, cross_k_scale=None, cross_v_scale=None):
    """Cross-attention K/V (tuples of stacks), and an int8 cache's scales of them, as
    `run_layers`' per-layer inputs."""
    inputs = tuple({"cross_k": k, "cross_v": v} for k, v in zip(cross_k, cross_v, strict=True))
    if cross_k_scale is None:
        return inputs
    return tuple({**layer, "cross_k_scale": k_scale, "cross_v_scale": v_scale}
                 for layer, k_scale, v_scale in zip(inputs, cross_k_scale, cross_v_scale,
                                                    strict=True))


def _bias_table(module: nn.Module, config: TransformerConfig, name: str):
    """A stack's table of T5's relative position bias [R, N] (`positional_encoding=
    "relative"`), shared by its layers; None otherwise (each layer's own table, with
    `relative_bias_per_layer`, is the layer's)."""
    if config.positional_encoding != "relative" or config.relative_bias_per_layer:
        return None
    return module.param(name, nn.initializers.normal(stddev=0.02),
                        (config.relative_buckets, config.num_heads), config.weights_dtype)


def _final_norm(config: TransformerConfig, name: str):
    """Pre-LN and output-LN stacks end with a norm; post-LN stacks already end normalised."""
    if config.norm in ("pre", "output"):
        return make_norm(config, name)
    return lambda x: x


class DecoderOnlyLM(nn.Module):
    """GPT-style language model: embed, causal decoder layers, tied or separate unembedding."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        if c.is_encoder_decoder:
            raise ValueError(f"DecoderOnlyLM needs num_encoder_layers=0, got "
                             f"{c.num_encoder_layers}; use EncoderDecoder")
        self.embedder = embedder(c)
        self.layers = layer_stack(DecoderLayer, c, c.num_decoder_layers, "layers")
        self.final_norm = _final_norm(c, "final_norm")
        self.bias_table = _bias_table(self, c, "position_bias")

    def __call__(self, tokens_BT, cache: KVCache | None = None, lengths_B=None,
                 fresh: bool = False, logits_at_B=None, hidden: bool = False):
        """Logits [B, T, V] for `tokens` [B, T]; `lengths` [B] counts each row's valid tokens.

        Without a cache, the rows start at position 0. With one, they continue at
        `cache.lengths` and their K/V are written into the returned cache; `fresh` says the
        cache is empty, so attention needs only the new tokens (the prefill). `logits_at`
        [B] (indices into T) asks for one token's logits per row, [B, 1, V]: the others'
        are never computed (the unembedding is a large part of a prefill). With `hidden`
        (no cache), the final hidden states [B, T, D] come back instead of their logits.
        """
        if cache is not None:
            check_cache(self.config, cache, *tokens_BT.shape)
            _check_ring_call(self.config, cache, tokens_BT.shape[1], fresh)
        valid_B = _valid_lengths(tokens_BT, lengths_B)
        batch, num_tokens = tokens_BT.shape
        starts_B = jnp.zeros((batch,), jnp.int32) if cache is None else cache.lengths
        num_keys = num_tokens if cache is None or fresh else cache.capacity
        capacity = None if cache is None else cache.capacity
        inputs, new_lengths_B, overflowed_B = self_attention_inputs(
            self.config, starts_B, valid_B, num_tokens, num_keys, capacity,
            *_page_tables(cache), ring=None if cache is None else cache.ring_slots)
        inputs = inputs.replace(fresh=fresh,
                                key_lengths=valid_B if cache is None or fresh else None,
                                bias_table=self.bias_table)
        x = self.embedder(tokens_BT, inputs.positions)
        x, stacked, _ = run_layers(self.config, self.layers, self.config.num_decoder_layers, x,
                                   _stacked_kv(cache), shared=inputs)
        if logits_at_B is not None:
            x = jnp.take_along_axis(x, logits_at_B[:, None, None], axis=1)
        if hidden and cache is None:
            return self.final_norm(x), None
        logits = self.embedder.logits(self.final_norm(x))
        if cache is None:
            return logits, None
        return logits, _with_new_kv(cache, stacked, new_lengths_B, overflowed_B)

    def prefill(self, prompt_BP, prompt_lengths_B, capacity: int,
                empty: KVCache | None = None, step_tokens: int | None = None):
        """A fresh cache of `capacity` slots filled with the prompts, and the logits of each
        row's next token [B, V] (read at its last valid prompt position). `empty`, an empty
        cache of that capacity (e.g. a paged one), is filled instead of a new one.
        `step_tokens`: as `init_cache` takes it (windowed layers then keep rings)."""
        cache = (init_cache(self.config, prompt_BP.shape[0], capacity, step_tokens=step_tokens)
                 if empty is None else empty)
        logits_B1V, cache = self(prompt_BP, cache, prompt_lengths_B, fresh=True,
                                 logits_at_B=jnp.maximum(prompt_lengths_B - 1, 0))
        return logits_B1V[:, 0], cache

    def step(self, tokens_BT, cache: KVCache, lengths_B=None):
        """`(logits [B, T, V], cache)` for T new tokens per row after what the cache holds;
        `lengths` [B] counts each row's valid new tokens (default: all T)."""
        return self(tokens_BT, cache, lengths_B)

    def teacher_forced(self, batch, hidden: bool = False):
        """Logits [B, T, V] for a training batch: `inputs` [B, T], optional `lengths` [B].
        With `hidden`, the final hidden states [B, T, D] they are computed from (`logits`)."""
        return self(batch["inputs"], None, batch.get("lengths"), hidden=hidden)[0]

    def logits(self, x_BTD):
        """Float32 logits [B, T, V] of final hidden states."""
        return self.embedder.logits(x_BTD)


class EncoderDecoder(nn.Module):
    """The original Transformer. `encode` the source once; `start_decoding` projects the
    encoder output to every layer's cross-attention K/V and puts them in a fresh cache;
    `decode` then runs the decoder with that cache (prefill or one token per step)."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        if not c.is_encoder_decoder:
            raise ValueError("EncoderDecoder needs num_encoder_layers > 0, got 0")
        # One embedding for source and target: the tokenizer is shared.
        self.embedder = embedder(c)
        self.encoder_layers = layer_stack(EncoderLayer, c, c.num_encoder_layers,
                                          "encoder_layers")
        self.encoder_norm = _final_norm(c, "encoder_norm")
        self.cross_kv = layer_stack(CrossKV, c, c.num_decoder_layers, "cross_kv")
        self.decoder_layers = layer_stack(DecoderLayer, c, c.num_decoder_layers,
                                          "decoder_layers")
        self.decoder_norm = _final_norm(c, "decoder_norm")
        self.encoder_bias = _bias_table(self, c, "encoder_position_bias")
        self.decoder_bias = _bias_table(self, c, "decoder_position_bias")

    def encode(self, source_BS, source_lengths_B=None):
        """Encoder output [B, S, D]; padded source positions are never attended to."""
        valid_B = _valid_lengths(source_BS, source_lengths_B)
        length = source_BS.shape[1]
        positions_BS = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), source_BS.shape)
        slots_S = jnp.arange(length, dtype=jnp.int32)
        mask_BSS = jnp.broadcast_to(slots_S[None, None, :] < valid_B[:, None, None],
                                    (source_BS.shape[0], length, length))
        x = self.embedder(source_BS, positions_BS, stack="encoder")
        x, _, _ = run_layers(self.config, self.encoder_layers, self.config.num_encoder_layers,
                             x, shared=LayerInputs(positions_BS, mask_BSS, key_lengths=valid_B,
                                                   bias_table=self.encoder_bias))
        return self.encoder_norm(x)

    def _cross_kv(self, encoded_BSD):
        """Every decoder layer's cross-attention K and V of the encoder output: tuples of
        stacks [L_i, B, S, K, H]."""
        _, _, per_layer = run_layers(self.config, self.cross_kv, self.config.num_decoder_layers,
                                     encoded_BSD)
        return (tuple(out["cross_k"] for out in per_layer),
                tuple(out["cross_v"] for out in per_layer))

    def start_decoding(self, encoded_BSD, source_lengths_B, capacity: int,
                       dtype=None, empty: KVCache | None = None) -> KVCache:
        """A fresh cache of `capacity` target slots holding the cross-attention K/V (put in
        `empty`, an empty cache of that capacity, where given)."""
        cross_k, cross_v = self._cross_kv(encoded_BSD)
        cache = (init_cache(self.config, encoded_BSD.shape[0], capacity, dtype) if empty is None
                 else empty)

        def cache_layout(x_LBSKH):  # -> [L_i, B, K, S, H], as the cache holds K and V
            return jnp.swapaxes(x_LBSKH, -3, -2).astype(cache.dtype)

        scales = {}
        if cache.quantized:  # values [L_i, B, S, K, H] -> int8, scales [L_i, B, K, S]
            (cross_k, k_scale), (cross_v, v_scale) = (
                zip(*map(quantize, stacks), strict=True) for stacks in (cross_k, cross_v))
            scales = {name: tuple(jnp.swapaxes(s, -2, -1) for s in stacks)
                      for name, stacks in (("cross_k_scale", k_scale),
                                           ("cross_v_scale", v_scale))}
        return cache.replace(
            cross_k=tuple(map(cache_layout, cross_k)),
            cross_v=tuple(map(cache_layout, cross_v)), **scales,
            source_lengths=_valid_lengths(encoded_BSD[..., 0], source_lengths_B))

    def decode(self, target_BT, cache: KVCache | None = None, lengths_B=None, *,
               encoded_BSD=None, source_lengths_B=None, hidden: bool = False):
        """Logits [B, T, V] for target tokens and the updated cache.

        With a cache (from `start_decoding`), rows continue at `cache.lengths` and read the
        cached cross-attention K/V. Without one, the targets start at position 0 and the
        cross K/V are projected from `encoded` here (a plain full forward, as in training).
        """
        if cache is not None:
            check_cache(self.config, cache, *target_BT.shape)
        valid_B = _valid_lengths(target_BT, lengths_B)
        batch, num_tokens = target_BT.shape
        if cache is None:
            if encoded_BSD is None:
                raise ValueError("decode without a cache needs the encoder output `encoded_BSD`")
            cross_k, cross_v = self._cross_kv(encoded_BSD)
            cross_scales = (None, None)
            source_lengths_B = _valid_lengths(encoded_BSD[..., 0], source_lengths_B)
            starts_B, num_keys, capacity = jnp.zeros((batch,), jnp.int32), num_tokens, None
        else:
            cross_k, cross_v = cache.cross_k, cache.cross_v
            cross_scales = (cache.cross_k_scale, cache.cross_v_scale)
            source_lengths_B = cache.source_lengths
            starts_B, num_keys, capacity = cache.lengths, cache.capacity, cache.capacity
        inputs, new_lengths_B, overflowed_B = self_attention_inputs(
            self.config, starts_B, valid_B, num_tokens, num_keys, capacity,
            *_page_tables(cache))
        source_slots = jnp.arange(encoded_BSD.shape[1] if cache is None
                                  else cache.source_length, dtype=jnp.int32)
        inputs = inputs.replace(cross_mask=jnp.broadcast_to(
            source_slots[None, None, :] < source_lengths_B[:, None, None],
            (batch, num_tokens, source_slots.shape[0])),
            key_lengths=valid_B if cache is None else None,
            source_lengths=source_lengths_B if cache is None else None,
            bias_table=self.decoder_bias)
        x = self.embedder(target_BT, inputs.positions)
        x, stacked, _ = run_layers(self.config, self.decoder_layers,
                                   self.config.num_decoder_layers, x, _stacked_kv(cache),
                                   _cross_inputs(cross_k, cross_v, *cross_scales), inputs)
        if hidden and cache is None:  # the final hidden states, as `DecoderOnlyLM`'s
            return self.decoder_norm(x), None
        logits = self.embedder.logits(self.decoder_norm(x))
        if cache is None:
            return logits, None
        return logits, _with_new_kv(cache, stacked, new_lengths_B, overflowed_B)

    def __call__(self, source_BS, target_BT, source_lengths_B=None, target_lengths_B=None,
                 hidden: bool = False):
        """`(logits [B, T, V], None)` for teacher-forced targets: encode, then decode all
        targets at once. The second item is the cache, as for `DecoderOnlyLM`; a full
        forward keeps none."""
        encoded = self.encode(source_BS, source_lengths_B)
        return self.decode(target_BT, None, target_lengths_B, encoded_BSD=encoded,
                           source_lengths_B=source_lengths_B, hidden=hidden)

    def prefill(self, source_BS, source_lengths_B, capacity: int,
                empty: KVCache | None = None, step_tokens: int | None = None):
        """Encodes the sources once, puts their cross-attention K/V in a fresh cache of
        `capacity` target slots (or in `empty`) and feeds BOS: returns the first target
        token's logits [B, V] and the cache. `step_tokens` is taken for one interface with
        `DecoderOnlyLM.prefill`: an encoder-decoder's target cache keeps every position."""
        del step_tokens
        encoded = self.encode(source_BS, source_lengths_B)
        cache = self.start_decoding(encoded, source_lengths_B, capacity, empty=empty)
        bos_B1 = jnp.full((source_BS.shape[0], 1), self.config.bos_id, jnp.int32)
        logits_B1V, cache = self.decode(bos_B1, cache)
        return logits_B1V[:, 0], cache

    def step(self, tokens_BT, cache: KVCache, lengths_B=None):
        """`(logits [B, T, V], cache)` for T new target tokens per row (`lengths` as for
        `DecoderOnlyLM.step`)."""
        return self.decode(tokens_BT, cache, lengths_B)

    def teacher_forced(self, batch, hidden: bool = False):
        """Logits [B, T, V] for a training batch: `source` [B, S], `source_lengths` [B],
        `inputs` [B, T] (the targets shifted right) and `lengths` [B]. With `hidden`, the
        final hidden states [B, T, D] they are computed from (`logits`)."""
        return self(batch["source"], batch["inputs"], batch.get("source_lengths"),
                    batch.get("lengths"), hidden=hidden)[0]

    def logits(self, x_BTD):
        """Float32 logits [B, T, V] of final hidden states."""
        return self.embedder.logits(x_BTD)
