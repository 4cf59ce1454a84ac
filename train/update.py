"""One training update: the loss, the optimizer, and the compiled step and evaluation.

`train_step` is one AdamW update with a linear warmup into a cosine decay and global-norm
gradient clipping; `validation_loss` is the mean cross-entropy over a validation set. Batches
are dicts of arrays as `kvjax.train.trainer` describes them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from kvjax import model as M
from kvjax import parallel
from kvjax.model import int8_base, layers
from kvjax.model.fused_attention import xla_attention_only
from kvjax.model.lora import merge as merge_lora

from .config import TrainConfig

Batch = Mapping[str, np.ndarray]


@flax.struct.dataclass
class TrainState:
    """params and opt_state (pytrees), step int32[] (updates done = index of the next batch),
    rng uint32[2] (key data of the run's base key; step s uses fold_in(rng, s))."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


# Loss ------------------------------------------------------------------------------------------


def cross_entropy_sum(logits_BTV, targets_BT, weights_BT, label_smoothing: float = 0.0):
    """(sum of per-token losses times `weights_BT`, sum of `weights_BT`): a target counts as
    much as its weight, 1 for a real one and 0 for padding. No target id is special, since an
    imported vocabulary's id 0 is a real token.

    With label smoothing e, a token's loss is (1 - e) * -log p(target) + e * mean_v -log p(v),
    the cross-entropy against (1 - e) * one_hot(target) + e / V.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    log_total_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    # The target's logit as a product with its one-hot row rather than a gather: the
    # gather's gradient is a scatter, which XLA:CPU runs as a pass of its own over [B, T, V]
    # before the gradient's transposing copy; the one-hot product fuses into that copy.
    one_hot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype)
    nll_BT = log_total_BT - jnp.sum(logits_BTV * one_hot_BTV, axis=-1)
    if label_smoothing:
        mean_log_prob_BT = logits_BTV.mean(-1) - log_total_BT
        nll_BT = (1 - label_smoothing) * nll_BT - label_smoothing * mean_log_prob_BT
    weights_BT = jnp.asarray(weights_BT, jnp.float32)
    return (nll_BT * weights_BT).sum(), weights_BT.sum()


# The most float32 logits a rematerialized step holds at once (`chunked_cross_entropy_sum`).
LOSS_PART_BYTES = 256 * 2**20


def chunked_cross_entropy_sum(model_config: M.TransformerConfig, params, hidden_BTD,
                              targets_BT, weights_BT, label_smoothing: float = 0.0):
    """`cross_entropy_sum` of the logits of final hidden states [B, T, D], computed a part of
    the B · T tokens at a time (a part's tokens side by side, [T, D]) and recomputed in the
    backward pass: a step holds one part's float32 logits (at most `LOSS_PART_BYTES`) and
    their gradient, not [B, T, V], which for a large vocabulary are much of what training
    holds."""
    tokens, vocab = hidden_BTD.shape[0] * hidden_BTD.shape[1], model_config.vocab_size
    per_part = max(1, min(tokens, LOSS_PART_BYTES // (4 * vocab)))
    parts = -(-tokens // per_part)

    def split(x_BT):  # [B, T, ...] -> [parts, tokens of a part, ...]; padding weighs 0
        x = x_BT.reshape(tokens, *x_BT.shape[2:])
        x = jnp.pad(x, [(0, parts * per_part - tokens)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(parts, per_part, *x.shape[1:])

    @jax.checkpoint
    def part_sums(params, hidden_TD, targets_T, weights_T):
        logits_1TV = M.hidden_logits(model_config, params, hidden_TD[None])
        return cross_entropy_sum(logits_1TV, targets_T[None], weights_T[None],
                                 label_smoothing)

    def add(sums, part):
        total, count = part_sums(params, *part)
        return (sums[0] + total, sums[1] + count), None

    zero = jnp.zeros((), jnp.float32)
    (total, count), _ = jax.lax.scan(add, (zero, zero), (
        split(hidden_BTD), split(jnp.asarray(targets_BT)),
        split(jnp.asarray(weights_BT, jnp.float32))))
    return total, count


def target_weights(batch: Batch):
    """The batch's `weights` [B, T], or ones where it has none (every target counts)."""
    if "weights" in batch:
        return batch["weights"]
    return np.ones(np.shape(batch["targets"]), np.float32)


# Optimizer and compiled steps ------------------------------------------------------------------


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=config.steps, end_value=config.learning_rate * config.final_lr_fraction)


DECAYED_PARAMS = ("kernel", "embedding", "position_embedding", "encoder_position_embedding",
                  "decoder_position_embedding", "lora_a", "lora_b")


def decay_mask(params) -> Any:
    """True for the params weight decay applies to: kernels and embedding tables, chosen by
    name. Biases and LayerNorm scales are not decayed, whatever their rank: stacked over
    scanned layers they are [L, D], as a kernel of an unrolled layer is."""
    def decayed(path, _):
        return getattr(path[-1], "key", None) in DECAYED_PARAMS

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                    weight_decay=config.weight_decay, mask=decay_mask),
    )


def compiled_fields(config: TrainConfig) -> TrainConfig:
    """`config` with the fields `train_step` does not read reset: `train_step` is compiled per
    TrainConfig, so runs that differ only in them (seed, evaluation, logging, saving) share
    one compilation."""
    return config.replace(seed=0, eval_every=1, eval_batches=0, log_every=1, save_every=None,
                          keep_checkpoints=1, progress=False)


def init_state(model_config: M.TransformerConfig, train_config: TrainConfig,
               mesh: Mesh | None = None, params: Any = None) -> TrainState:
    """The state before the first step: fresh params (or `params`, e.g. a checkpoint's to
    fine-tune) and a fresh optimizer state for the seed, laid out on `mesh` by
    `parallel.state_shardings` when one is given."""
    if model_config.kernel_dtype is not None:
        raise ValueError(f"kernel_dtype={model_config.kernel_dtype!r} holds weights for "
                         "decoding; a training run holds float params (LoRA trains over an "
                         "int8 base with lora base_dtype='int8')")
    if train_config.router_aux_loss_coef and not model_config.num_experts:
        raise ValueError(f"router_aux_loss_coef={train_config.router_aux_loss_coef} weighs a "
                         "mixture of experts' load-balancing loss; this model has no experts")
    if train_config.router_aux_loss_coef and model_config.router_scoring != "softmax":
        raise ValueError(f"router_aux_loss_coef={train_config.router_aux_loss_coef} weighs a "
                         f"softmax router's load-balancing loss; router_scoring="
                         f"{model_config.router_scoring!r} balances its experts by each one's "
                         "selection bias (DeepSeek-V3)")
    step_config, seed_key = compiled_fields(train_config), jax.random.key(train_config.seed)
    if params is None:
        state = _init_state(model_config, step_config, seed_key)
    else:
        state = _state_for_params(step_config, params, seed_key)
    return state if mesh is None else parallel.shard_params(state, mesh)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_state(model_config: M.TransformerConfig, step_config: TrainConfig,
                seed_key: jax.Array) -> TrainState:
    params_rng, base_rng = jax.random.split(seed_key)
    params = M.init_params(model_config, params_rng)
    return TrainState(params=params, opt_state=make_optimizer(step_config).init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.key_data(base_rng))


@functools.partial(jax.jit, static_argnums=0)
def _state_for_params(step_config: TrainConfig, params, seed_key: jax.Array) -> TrainState:
    # One compiled program, so that every leaf of the state is placed alike and the first
    # train_step's program serves the later ones. The base key is the one fresh params
    # leave, so dropout does not depend on where the params came from.
    _, base_rng = jax.random.split(seed_key)
    return TrainState(params=params, opt_state=make_optimizer(step_config).init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.key_data(base_rng))


def train_step(model_config: M.TransformerConfig, train_config: TrainConfig, state: TrainState,
               batch: Batch, mesh: Mesh | None = None, base: Any = None
               ) -> tuple[TrainState, jax.Array]:
    """One AdamW update on `batch`; returns the new state and the batch's mean loss.

    With `train_config.lora`, `state.params` are the adapters and `base` the frozen params
    they adapt: the loss is the merged model's (`model.lora.merge`; over an int8 base each
    rematerialized layer merges its own, `model/int8_base.py`), and only the adapters have
    gradients and moments.

    With a `mesh`, the state comes in laid out by `parallel.state_shardings` and the batch
    split over `data` (`parallel.shard_batch`); the new state leaves with the same layout,
    so every step runs one compiled program. The loss and gradients are sums over the whole
    batch, which XLA reduces across devices: the same numbers as on one device. The state's
    buffers are donated: `state` cannot be used after the call.
    """
    step = _compiled_step(train_config.deterministic, jax.default_backend())
    return step(model_config, train_config, state, batch, base, mesh=mesh)


# XLA's switch for run-to-run determinism on a GPU; the other backends run deterministically.
DETERMINISTIC_COMPILER_OPTIONS = {"gpu": {"xla_gpu_deterministic_ops": True}}


@functools.cache
def _compiled_step(deterministic: bool, backend: str):
    """The jitted `_train_step`, compiled with the deterministic options of `backend` or not.
    Compiler options belong to a jitted function, so each setting is one of its own."""
    options = DETERMINISTIC_COMPILER_OPTIONS.get(backend) if deterministic else None
    return jax.jit(_train_step, static_argnums=(0, 1), static_argnames="mesh",
                   donate_argnums=2, compiler_options=options)


def _train_step(model_config: M.TransformerConfig, train_config: TrainConfig, state: TrainState,
                batch: Batch, base: Any = None, mesh: Mesh | None = None
                ) -> tuple[TrainState, jax.Array]:
    dropout_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    lora = train_config.lora
    int8 = lora is not None and lora.int8_base
    if train_config.remat or int8:
        model_config = model_config.replace(remat=True)

    def loss_fn(params):
        if int8:  # each layer makes its float kernels where it runs, and again for its grads
            params = int8_base.attach(model_config, base, params, lora)
        elif lora is not None:
            params = merge_lora(model_config, base, params, lora, keep_dtype=False)
        with (layers.layer_params_from(int8_base.unpack_fn(model_config, lora)) if int8
              else contextlib.nullcontext()):
            return _loss(model_config, train_config, params, batch, dropout_rng)

    # Bit-identical reruns on a GPU are checked with XLA's attention, not the fused kernel's.
    with xla_attention_only() if train_config.deterministic else contextlib.nullcontext():
        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = make_optimizer(train_config).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    if mesh is not None:
        state = jax.lax.with_sharding_constraint(state, parallel.state_shardings(state, mesh))
    return state, loss


def _loss(model_config: M.TransformerConfig, train_config: TrainConfig, params, batch: Batch,
          dropout_rng: jax.Array) -> jax.Array:
    """(what the step minimizes, the batch's mean cross-entropy per counted target token):
    the cross-entropy plus `router_aux_loss_coef` times the load-balancing loss, if any."""
    coef = train_config.router_aux_loss_coef
    forward = M.teacher_forced_hidden if train_config.remat else M.teacher_forced_logits
    out = forward(model_config, params, batch, dropout_rng, router_loss=coef > 0)
    out, router_loss = out if coef > 0 else (out, 0.0)
    if train_config.remat:  # the logits are recomputed too, a part at a time
        total, count = chunked_cross_entropy_sum(
            model_config, params, out, batch["targets"], target_weights(batch),
            train_config.label_smoothing)
    else:
        total, count = cross_entropy_sum(out, batch["targets"], target_weights(batch),
                                         train_config.label_smoothing)
    loss = total / jnp.maximum(count, 1.0)
    return loss + coef * router_loss, loss


@functools.partial(jax.jit, static_argnums=0)
def _loss_sum(model_config: M.TransformerConfig, params, batch: Batch):
    logits = M.teacher_forced_logits(model_config, params, batch)
    return cross_entropy_sum(logits, batch["targets"], target_weights(batch))


def validation_loss(model_config: M.TransformerConfig, params, val: Mapping[str, np.ndarray],
                    batch_size: int, max_batches: int = 0) -> dict[str, float]:
    """Mean cross-entropy per counted target token (`target_weights`) over the validation
    set, and its exp."""
    total = count = 0.0
    for batch in _chunks(val, batch_size, max_batches):
        batch_total, batch_count = _loss_sum(model_config, params, batch)
        total, count = total + float(batch_total), count + float(batch_count)
    loss = total / max(count, 1.0)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}


def _chunks(arrays: Mapping[str, np.ndarray], size: int, max_chunks: int) -> Iterator[dict]:
    # Every chunk has `size` rows, so one compiled program serves them all: the last one is
    # filled up with earlier rows whose weights are all 0, which count for nothing.
    num_examples = len(next(iter(arrays.values())))
    starts = range(0, num_examples, size)
    for start in starts[:max_chunks] if max_chunks else starts:
        positions = np.arange(start, start + size)
        chunk = {key: value[positions % num_examples] for key, value in arrays.items()}
        chunk["weights"] = np.array(target_weights(chunk), np.float32)
        chunk["weights"][positions >= num_examples] = 0.0
        yield chunk
