"""The model as generation and training see it, the same for both variants.

  prefill(config, params, prompt [B, P], prompt_lengths [B], capacity | cache=[, adapters=])
                                                        -> (logits [B, V], cache)
  step_fn(config, params[, adapters])(tokens [B, T], cache[, lengths [B]])
                                                        -> (logits [B, T, V], cache)
  teacher_forced_logits(config, params, batch) -> logits [B, T, V]
  teacher_forced_hidden(config, params, batch) -> final hidden states [B, T, D]
  hidden_logits(config, params, hidden) -> logits [B, T, V]

A decoder-only LM's prompt is the start of the sequence it continues; an encoder-decoder's
prompt is its source, and the target it writes starts from BOS. `prompt_slots`,
`check_prompt_length` and `row_cache` say what that means for the cache, so no caller needs to
ask which variant it holds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import int8_base, lora_rows
from .cache import KVCache, init_cache
from .config import SPEED_ONLY_FIELDS, TransformerConfig
from .experts import load_balancing_loss
from .ring import ring_slots, ring_stacks, take_into_rings
from .transformer import DecoderOnlyLM, EncoderDecoder


def build_model(config: TransformerConfig) -> DecoderOnlyLM | EncoderDecoder:
    """The variant the config describes: an encoder-decoder iff `num_encoder_layers > 0`."""
    return EncoderDecoder(config) if config.is_encoder_decoder else DecoderOnlyLM(config)


# Fields that change how the model computes but neither which params it has nor how they
# are drawn: configs that differ only in them share one compiled initialisation.
_NOT_IN_INIT = SPEED_ONLY_FIELDS + (
    "dropout", "dtype", "cache_dtype", "bos_id", "layer_norm_eps", "rope_base", "rope_scaling",
    "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_len", "rope_beta_fast", "rope_beta_slow", "rope_truncate",
    "rope_attention_factor", "rope_short_factors", "rope_long_factors", "rotary_dim",
    "sliding_window", "full_attention_layers", "unrotated_layers", "local_rope_base",
    "attention_scale", "query_scale_beta", "query_scale_length", "attention_softcap",
    "logits_softcap", "qkv_clip", "sinusoid_layout", "sinusoid_offset",
    "embedding_multiplier", "residual_multiplier", "logits_scaling")


def init_params(config: TransformerConfig, rng: jax.Array) -> dict:
    """Randomly initialised params (a pytree) for `build_model(config)`: with
    `kernel_dtype="int8"`, float params drawn as without it, their kernels and
    embedding table then quantized (`int8_base.quantize_for_decoding`)."""
    defaults = {name: getattr(TransformerConfig, name) for name in _NOT_IN_INIT
                if not (name == "rotary_dim" and config.latent_kv_rank)}  # sizes its params
    params = _init_params(config.replace(**defaults, kernel_dtype=None), rng)
    return params if config.kernel_dtype is None else int8_base.quantize_for_decoding(params)


@functools.lru_cache(maxsize=32)
def param_shapes(config: TransformerConfig) -> dict:
    """The shapes and dtypes (`jax.ShapeDtypeStruct` leaves) of `init_params(config, ...)`,
    found without making any array."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


@functools.partial(jax.jit, static_argnums=0)
def _init_params(config: TransformerConfig, rng: jax.Array) -> dict:
    """Jitted: tracing Flax's init eagerly is slower than compiling it."""
    net = build_model(config)
    tokens = jnp.zeros((1, 1), jnp.int32)
    batch = {"inputs": tokens, "source": tokens}
    return net.init(rng, batch, method=net.teacher_forced)["params"]


def prefill(config: TransformerConfig, params, prompt_BP: jax.Array,
            prompt_lengths_B: jax.Array, capacity: int | None = None, *,
            cache: KVCache | None = None, adapters=None,
            step_tokens: int | None = None) -> tuple[jax.Array, KVCache]:
    """The whole prompt batch in one parallel pass that fills a fresh cache of `capacity`
    target slots, or `cache`, an empty one (lengths 0; e.g. a paged cache with its pages
    assigned, `init_paged_cache`); returns the logits of each row's first new token [B, V]
    and the cache. `adapters`: each row's LoRA adapter, unmerged (`lora_rows.for_rows`).
    `step_tokens`, the most tokens a later call writes at once (e.g. 1 for plain sampling),
    lets a decoder-only model's sliding-window layers hold rings of the slots their window
    reads rather than every position (`model/ring.py`): the fresh cache then refuses longer
    calls and moving rows by slots."""
    if (capacity is None) == (cache is None):
        raise ValueError("prefill takes either a capacity or an empty cache to fill, "
                         f"got capacity={capacity} and {'a' if cache is not None else 'no'} "
                         "cache")
    net = build_model(config)
    capacity = cache.capacity if cache is not None else capacity
    return net.apply(_variables(params, adapters), prompt_BP, prompt_lengths_B, capacity,
                     cache, step_tokens, method=net.prefill)


def step_fn(config: TransformerConfig, params, adapters=None):
    """`tokens_to_logits(tokens [B, T], cache, lengths [B] = all T) -> (logits [B, T, V],
    cache)`: the only view of the model that the decode loops get. `adapters`: as
    `prefill` takes them."""
    net = build_model(config)
    variables = _variables(params, adapters)
    return lambda tokens, cache, lengths=None: net.apply(variables, tokens, cache, lengths,
                                                         method=net.step)


def _variables(params, adapters) -> dict:
    """What a model call applies: its params, and each row's adapters if it has them."""
    return {"params": params} if adapters is None else {
        "params": params, lora_rows.COLLECTION: adapters}


def teacher_forced_logits(config: TransformerConfig, params, batch, dropout_rng=None,
                          router_loss: bool = False, adapters=None):
    """Logits [B, T, V] of a training batch (see `teacher_forced` of each variant for its
    keys); dropout is on iff `dropout_rng` is given. With `router_loss`, (logits, the
    mixtures' load-balancing loss over the batch's tokens: `experts.load_balancing_loss`).
    `adapters`: as `prefill` takes them."""
    return _teacher_forced(config, params, batch, dropout_rng, False, router_loss, adapters)


def teacher_forced_hidden(config: TransformerConfig, params, batch, dropout_rng=None,
                          router_loss: bool = False):
    """The final hidden states [B, T, D] that `teacher_forced_logits` turns into logits
    (`hidden_logits`), so that a loss can compute the logits a part at a time; with
    `router_loss`, (hidden states, load-balancing loss) as there."""
    return _teacher_forced(config, params, batch, dropout_rng, True, router_loss)


def _teacher_forced(config, params, batch, dropout_rng, hidden: bool, router_loss: bool,
                    adapters=None):
    net = build_model(config)
    rngs = None if dropout_rng is None else {"dropout": dropout_rng}
    if not router_loss:
        return net.apply(_variables(params, adapters), batch, hidden, rngs=rngs,
                         method=net.teacher_forced)
    if not config.num_experts:
        raise ValueError("a load-balancing loss needs a mixture of experts; this model has "
                         "none (num_experts=0)")
    if config.router_scoring != "softmax":
        raise ValueError(f"a load-balancing loss is Switch Transformer's, of a softmax router; "
                         f"router_scoring={config.router_scoring!r} balances its experts by "
                         "each one's selection bias (DeepSeek-V3), not by this loss")
    out, variables = net.apply({"params": params}, batch, hidden, rngs=rngs,
                               method=net.teacher_forced, mutable=["intermediates"])
    return out, load_balancing_loss(variables["intermediates"], config.num_experts)


def hidden_logits(config: TransformerConfig, params, hidden_BTD):
    """Float32 logits [B, T, V] of final hidden states [B, T, D]."""
    net = build_model(config)
    return net.apply({"params": params}, hidden_BTD, method=net.logits)


def prompt_is_source(config: TransformerConfig) -> bool:
    """Whether a prompt is a source the model encodes and answers (an encoder-decoder, e.g. a
    translator) rather than the start of the text it continues (a language model)."""
    return config.is_encoder_decoder


def target_start(config: TransformerConfig, prompt_BP: jax.Array, prompt_lengths_B: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """The target tokens a prefill leaves in the cache, [B, P'] and their lengths [B]: the
    prompt itself for an LM; BOS alone for an encoder-decoder, whose prompt is its source."""
    if not config.is_encoder_decoder:
        return prompt_BP, prompt_lengths_B
    batch = prompt_BP.shape[0]
    return (jnp.full((batch, 1), config.bos_id, jnp.int32), jnp.ones((batch,), jnp.int32))


def row_cache(config: TransformerConfig, rows: int, capacity: int,
              source_capacity: int | None = None, step_tokens: int | None = None) -> KVCache:
    """An empty cache of `rows` rows of `capacity` slots that prefilled rows are put into
    (`KVCache.put_rows`, `copy_row`): an encoder-decoder's holds a source of up to
    `source_capacity` (default `capacity`) tokens beside its target. With `step_tokens`
    (as `init_cache` takes it) a decoder-only model's windowed layers keep rings, which
    `copy_row` fills and `put_rows` refuses."""
    if not config.is_encoder_decoder:
        return init_cache(config, rows, capacity, step_tokens=step_tokens)
    return init_cache(config, rows, capacity,
                      source_capacity=capacity if source_capacity is None else source_capacity)


def rows_in_rings(config: TransformerConfig, cache: KVCache, rows_R: jax.Array,
                  step_tokens: int) -> KVCache | None:
    """Rows `rows` [R] of `cache`, a contiguous cache of every position (a kept prompt's),
    as a cache for calls of up to `step_tokens` tokens whose windowed layers keep rings
    (`init_cache(..., step_tokens)`); None where no layer would keep one."""
    slots = ring_slots(config, cache.capacity, step_tokens)
    if slots is None or cache.paged or cache.rings is not None:
        return None
    lengths_R = cache.lengths[rows_R]
    return cache.replace(**take_into_rings(cache._self_attention(), ring_stacks(config), slots,
                                           rows_R, lengths_R),
                         lengths=lengths_R, overflow=cache.overflow[rows_R],
                         slots=cache.capacity, rings=ring_stacks(config))


def prompt_slots(config: TransformerConfig, prompt_length: int) -> int:
    """Target cache slots a prompt of `prompt_length` tokens fills before generation: all of
    them for an LM, one (BOS) for an encoder-decoder, whose prompt is the source."""
    return 1 if config.is_encoder_decoder else prompt_length


def check_prompt_length(config: TransformerConfig, prompt_length: int,
                        max_new_tokens: int = 1) -> None:
    """Raises a ValueError unless a prompt of `prompt_length` tokens and `max_new_tokens`
    generated after it fit the model's `max_len`."""
    # An imported longrope model's max_len is its original length unless asked for more.
    why = (" (a longrope model runs past its original length when loaded with a longer "
           "max_len: kvjax.hf.load_pretrained(..., max_len=N), kvjax import-hf --max-len N)"
           if config.rope_scaling == "longrope"
           and config.max_len <= config.rope_original_max_len else "")
    if prompt_length > config.max_len:
        raise ValueError(f"prompt length {prompt_length} exceeds the model's max_len "
                         f"{config.max_len}{why}")
    used = prompt_slots(config, prompt_length)
    if used + max_new_tokens > config.max_len:
        start = " (the target starts from BOS)" if config.is_encoder_decoder else ""
        raise ValueError(f"prompt length {prompt_length} + max_new_tokens {max_new_tokens} "
                         f"needs {used + max_new_tokens} target positions{start}, more than "
                         f"the model's max_len {config.max_len}{why}")
