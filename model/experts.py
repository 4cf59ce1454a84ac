"""A mixture of experts in place of a decoder layer's dense FFN (`num_experts` > 0).

A router (a kernel [D, experts]) scores every expert for each token; the token goes through
the `experts_per_token` experts of highest softmax probability, and its output is theirs
summed, each weighted by its probability (divided by the chosen ones' sum under
`normalize_expert_weights`; Phi-3.5-MoE's SparseMixer weighs each of its two otherwise,
`sparsemixer`; DeepSeek-V3's router scores each expert by a sigmoid of its own and chooses
within the best groups of experts, `route`). An expert is an FFN like `FeedForward`'s:
W2 act(W1 x), or W2 (act(W1 x) * W3 x) for the gated activations (`gated_units`), with
biases of its own under `ffn_bias` (gpt-oss). Params, beside the router's (a kernel, and a
bias under `router_bias`): `experts/wi` and `experts/wi_gate` [D, experts, d_ff],
`experts/wo` [experts, d_ff, D], laid out so that every expert's projections are one matrix,
and `experts/bi`, `experts/bi_gate` [experts, d_ff], `experts/bo` [experts, D]. A shared expert
(`shared_expert_d_ff` > 0) is a `FeedForward` of that width every token goes through, its
output added to the chosen experts' (times a sigmoid gate of the token, a kernel [D, 1], under
`shared_expert_gate`).

Two ways to run the chosen experts compute the same sums; the shapes pick one while tracing
(`gathers`), by the weights each reads:
- few pairs of a token and a chosen expert (decoding a few rows): each pair multiplies by
  its own expert's weights, gathered (`gathered`): a step reads (and copies) only the chosen
  experts' weights, what a memory-bound step pays for;
- more (a prompt, training, a large batch): every token through every expert, the hidden
  units weighted by the router's weights, zero for the experts not chosen (`every_expert`):
  num_experts / experts_per_token times the work of the chosen experts alone, in three plain
  matmuls that read each expert's weights once. A dropless mixture cannot do better in XLA
  without kernels of its own: `jax.lax.ragged_dot`, which sorts tokens into one group per
  expert, becomes the same dense product on CPUs and GPUs (masked, with a copy of the
  tokens for every expert), slower than plain matmuls.

Adapters served side by side (`model/lora_rows.py`) add, in both ways, each token's row's
pair of every expert it goes through to that expert's products.

Training can add Switch Transformer's auxiliary load-balancing loss (`load_balancing_loss`):
when the "intermediates" collection is mutable, each mixture sows its router's load
(`router_load`), which the loss sums over every mixture and token of the batch.

The experts and the chosen experts have no shape letters of their own (docs/shapes.md has
none left): arrays are named for what they hold, their shapes given in brackets, where
`tokens` are the B·T rows of the call side by side and `pairs` are tokens × experts_per_token.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import lora_rows
from .config import TransformerConfig
from .config_checks import GATED_ACTIVATIONS
from .feed_forward import FeedForward, activation_function, gated_units


def route(router_logits: jax.Array, experts_per_token: int, normalize: bool,
          sparsemixer_eps: float | None = None, selection_bias: jax.Array | None = None,
          scoring: str = "softmax", groups: int = 1, groups_kept: int = 1,
          scaling: float = 1.0, group_score: str = "two_best") -> tuple[jax.Array, jax.Array]:
    """(weights [tokens, k] float32, experts [tokens, k] int32) of the k experts of each token
    that score highest, from `router_logits` [tokens, experts]: scored by a softmax over them
    (or each by its sigmoid, `scoring` "sigmoid"), chosen by the scores plus `selection_bias`
    [experts] where given and among the experts of each token's `groups_kept` best of
    `groups` groups (`best_groups_only`, ranked by `group_score`), weighed by the scores
    alone; the weights divided by their sum when `normalize`, then times `scaling`. With
    `sparsemixer_eps`, the two SparseMixer chooses (`sparsemixer`)."""
    if sparsemixer_eps is not None:
        return sparsemixer(router_logits.astype(jnp.float32), sparsemixer_eps)
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    if selection_bias is None and groups == 1:
        weights, experts = jax.lax.top_k(scores, experts_per_token)
    else:
        choice = scores if selection_bias is None else scores + selection_bias.astype(jnp.float32)
        _, experts = jax.lax.top_k(best_groups_only(choice, groups, groups_kept, group_score),
                                   experts_per_token)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * scaling, experts.astype(jnp.int32)


def best_groups_only(choice: jax.Array, groups: int, kept: int,
                     group_score: str = "two_best") -> jax.Array:
    """`choice` [tokens, experts] where an expert is in one of its token's `kept` best groups
    and -inf elsewhere: the experts split into `groups` equal groups in their order, a
    group scored by the sum of its two highest values ("two_best", DeepSeek-V3's
    group-limited routing) or by its highest ("best", DeepSeek-V2's)."""
    if groups == 1:
        return choice
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, groups, experts // groups)
    group_scores = (jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1) if group_score == "two_best"
                    else jnp.max(grouped, axis=-1))
    _, best = jax.lax.top_k(group_scores, kept)
    in_best = jnp.any(jax.nn.one_hot(best, groups, dtype=bool), axis=1)
    return jnp.where(in_best[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)


def sparsemixer(scores: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """Phi-3.5-MoE's two experts of each token (SparseMixer as it routes at inference) from
    its router's `scores` [tokens, experts]: the highest-scoring expert, weighted by its
    probability under a softmax over the experts whose scores s are near its own m
    ((m - s) / max(|s|, m) <= 2·eps, the rest left out), then the highest of the others, the
    same way with the first left out of its softmax."""
    chosen, weights = [], []
    candidates = scores
    for _ in range(2):
        best = jnp.argmax(candidates, axis=-1)
        top = jnp.max(candidates, axis=-1, keepdims=True)
        far = (top - scores) / jnp.maximum(jnp.abs(scores), top) > 2 * eps
        gates = jax.nn.softmax(jnp.where(far, -jnp.inf, candidates), axis=-1)
        weights.append(jnp.take_along_axis(gates, best[:, None], axis=-1)[:, 0])
        chosen.append(best)
        candidates = jnp.where(jax.nn.one_hot(best, scores.shape[-1], dtype=bool), -jnp.inf,
                               candidates)
    return jnp.stack(weights, axis=-1), jnp.stack(chosen, axis=-1).astype(jnp.int32)


ROUTER_LOAD = "router_load"  # what a mixture sows into "intermediates"


def router_load(router_logits: jax.Array, experts_per_token: int) -> dict[str, jax.Array]:
    """What the load-balancing loss needs of one mixture's `router_logits` [tokens, experts]:
    `chosen` [experts], how many tokens chose each expert among their `experts_per_token`;
    `probability` [experts], the router's softmax summed over the tokens; `tokens` []."""
    probabilities = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, experts = jax.lax.top_k(probabilities, experts_per_token)
    chosen = jnp.sum(jax.nn.one_hot(experts, router_logits.shape[-1], dtype=jnp.float32),
                     axis=(0, 1))
    return {"chosen": chosen, "probability": jnp.sum(probabilities, axis=0),
            "tokens": jnp.asarray(router_logits.shape[0], jnp.float32)}


def load_balancing_loss(intermediates, num_experts: int) -> jax.Array:
    """Switch Transformer's auxiliary loss, as transformers computes it over every mixture's
    tokens together (`load_balancing_loss_func`): num_experts · Σ_e f_e · P_e, where f_e is
    the share of tokens that chose expert e (a token counts once for each of its chosen
    experts, so the f_e sum to experts_per_token) and P_e the router's mean probability of e.
    It is smallest when the tokens spread evenly over the experts. `intermediates` holds the
    `router_load` every mixture sowed (stacked over scanned layers)."""
    sums = {"chosen": 0.0, "probability": 0.0, "tokens": 0.0}
    for path, value in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
        keys = [getattr(entry, "key", None) for entry in path]
        if ROUTER_LOAD in keys and keys[-1] in sums:
            axes = tuple(range(value.ndim - (0 if keys[-1] == "tokens" else 1)))
            sums[keys[-1]] = sums[keys[-1]] + jnp.sum(value, axis=axes)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    return num_experts * jnp.sum((sums["chosen"] / tokens) * (sums["probability"] / tokens))


def gathers(pairs: int, num_experts: int) -> bool:
    """Whether `pairs` token-expert pairs take the gathered way: a gathered expert's weights
    are read, written as a copy and read again, so it reads less than every expert's weights
    once while three times the pairs stay under the experts."""
    return 3 * pairs < num_experts


class ExpertWeights(NamedTuple):
    """One layer's experts: kernels `wi`, `wi_gate` [D, experts, d_ff] and `wo` [experts,
    d_ff, D]; with biases (`ffn_bias`), `bi`, `bi_gate` [experts, d_ff] and `bo` [experts, D].
    Those a config does not have are None."""

    wi: jax.Array
    wi_gate: jax.Array | None
    wo: jax.Array
    bi: jax.Array | None = None
    bi_gate: jax.Array | None = None
    bo: jax.Array | None = None


def gathered(tokens, weights, experts, w: ExpertWeights, units, adapters=None):
    """[tokens, D]: each (token, chosen expert) pair through that expert's weights, gathered,
    summed per token with `weights` [tokens, k]. `units(a, b)` makes the hidden units of W1 x
    and W3 x (b None without a gate). `adapters`: each row's adapters of the experts
    (`lora_rows.expert_pairs`), each pair adding its expert's x A B of its token's row."""
    k = experts.shape[1]
    chosen = experts.reshape(-1)  # [pairs], token-major
    x = jnp.repeat(tokens, k, axis=0)[:, None, :]  # [pairs, 1, D]

    def adapted(target, inputs, out):  # inputs [pairs, 1, in], out [pairs, 1, out]
        if adapters is None or target not in adapters:
            return out
        a, b, columns = adapters[target]
        low = inputs @ a[chosen].astype(inputs.dtype)  # [pairs, 1, n·r]
        low = low * jnp.repeat(columns, k, axis=0)[:, None].astype(low.dtype)
        return out + (low @ b[chosen].astype(low.dtype)).astype(out.dtype)

    def up(kernel, bias, target):  # [pairs, 1, d_ff]
        out = adapted(target, x, x @ jnp.moveaxis(kernel[:, chosen], 1, 0))
        return out if bias is None else out + bias[chosen][:, None]

    h = units(up(w.wi, w.bi, "wi"),
              None if w.wi_gate is None else up(w.wi_gate, w.bi_gate, "wi_gate"))
    out = adapted("wo", h, h @ w.wo[chosen])
    if w.bo is not None:
        out = out + w.bo[chosen][:, None]
    out = out[:, 0].reshape(tokens.shape[0], k, -1).astype(jnp.float32)
    return jnp.sum(out * weights[..., None], axis=1)


def every_expert(tokens, weights, experts, w: ExpertWeights, units, adapters=None):
    """[tokens, D]: every token through every expert, each hidden unit scaled by the token's
    router weight for its expert (zero where not chosen), so that one product with every
    expert's down projection sums the chosen experts' outputs (and one with their output
    biases, their weighted sum). Three plain matmuls, which read the kernels as they lie:
    [D, experts · d_ff] and [experts · d_ff, D]. `adapters` as `gathered` takes them: every
    expert's pair too, its down projection's weighted alike."""
    count, width = w.wo.shape[:2]
    rows = jnp.arange(tokens.shape[0])[:, None]
    combine = jnp.zeros((tokens.shape[0], count), jnp.float32).at[rows, experts].set(weights)

    def low(target, inputs, spec):  # each token's row's columns of x A, [tokens, experts, n·r]
        a, _, columns = adapters[target]
        out = jnp.einsum(spec, inputs, a.astype(inputs.dtype))
        return out * columns[:, None].astype(out.dtype)

    def up(kernel, bias, target):  # [tokens, experts, d_ff]
        out = (tokens @ kernel.reshape(kernel.shape[0], -1)).reshape(-1, count, width)
        if adapters is not None and target in adapters:
            update = jnp.einsum("ter,erf->tef", low(target, tokens, "ti,eir->ter"),
                                adapters[target][1].astype(out.dtype))
            out = out + update.astype(out.dtype)
        return out if bias is None else out + bias

    h = units(up(w.wi, w.bi, "wi"),
              None if w.wi_gate is None else up(w.wi_gate, w.bi_gate, "wi_gate"))
    h = h * combine[..., None].astype(h.dtype)
    out = (h.reshape(-1, count * width) @ w.wo.reshape(count * width, -1)).astype(jnp.float32)
    if adapters is not None and "wo" in adapters:
        out = out + jnp.einsum("ter,erd->td", low("wo", h, "tef,efr->ter"),
                               adapters["wo"][1].astype(h.dtype)).astype(jnp.float32)
    if w.bo is not None:
        out = out + combine @ w.bo.astype(jnp.float32)
    return out


def hidden_units(config: TransformerConfig):
    """`units(a, b)` of the ways above: the config's activation of W1 x (a), gated by W3 x
    (b) where it is a gated one."""
    if config.activation in GATED_ACTIVATIONS:
        return gated_units(config)
    act = activation_function(config.activation)
    return lambda a, _: act(a)


class Experts(nn.Module):
    """The experts' FFNs and their weighted sum for each token."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, weights, experts):
        """x_BTD's tokens through their chosen `experts` [tokens, k], summed with `weights`
        [tokens, k]: [B, T, D]."""
        c = self.config
        init_in = nn.initializers.lecun_normal(in_axis=0, out_axis=2, batch_axis=(1,))
        init_out = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))

        def param(name, init, shape):
            return self.param(name, init, shape, c.weights_dtype).astype(c.compute_dtype)

        def bias(name, width):
            if not c.ffn_bias:
                return None
            return param(name, nn.initializers.zeros_init(), (c.num_experts, width))

        gated = c.activation in GATED_ACTIVATIONS
        shape_in = (c.d_model, c.num_experts, c.d_ff)
        # In this order, each param's draw is the one it had before biases existed.
        wi, wo = param("wi", init_in, shape_in), param("wo", init_out, (
            c.num_experts, c.d_ff, c.d_model))
        wi_gate = param("wi_gate", init_in, shape_in) if gated else None
        w = ExpertWeights(wi, wi_gate, wo, bi=bias("bi", c.d_ff),
                          bi_gate=bias("bi_gate", c.d_ff) if gated else None,
                          bo=bias("bo", c.d_model))
        tokens = x_BTD.reshape(-1, c.d_model).astype(c.compute_dtype)
        way = gathered if gathers(experts.size, c.num_experts) else every_expert
        out = way(tokens, weights, experts, w, hidden_units(c),
                  lora_rows.expert_pairs(self, x_BTD.shape[1]))
        return out.astype(c.compute_dtype).reshape(x_BTD.shape)


class MixtureOfExperts(nn.Module):
    """The router and the experts, and the shared expert every token goes through where the
    config has one: [B, T, D] -> [B, T, D]."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD):
        c = self.config
        router = nn.Dense(c.num_experts, use_bias=c.router_bias, dtype=c.compute_dtype,
                          param_dtype=c.weights_dtype, name="router")
        router_logits = lora_rows.add_update(self, "router", x_BTD, router(x_BTD)).reshape(
            -1, c.num_experts)
        if self.is_mutable_collection("intermediates"):
            self.sow("intermediates", ROUTER_LOAD, router_load(router_logits,
                                                               c.experts_per_token))
        selection_bias = (self.param("selection_bias", nn.initializers.zeros_init(),
                                     (c.num_experts,), jnp.float32)
                          if c.router_selection_bias else None)
        weights, experts = route(router_logits, c.experts_per_token,
                                 c.normalize_expert_weights, c.sparsemixer_eps, selection_bias,
                                 c.router_scoring, c.router_groups, c.router_groups_kept,
                                 c.routed_scaling, c.router_group_score)
        out = Experts(c, name="experts")(x_BTD, weights, experts)
        if not c.shared_expert_d_ff:
            return out
        shared = FeedForward(c, c.shared_expert_d_ff, name="shared_expert")(x_BTD)
        if c.shared_expert_gate:
            gate = nn.Dense(1, use_bias=False, dtype=c.compute_dtype,
                            param_dtype=c.weights_dtype, name="shared_expert_gate")
            shared = shared * jax.nn.sigmoid(
                lora_rows.add_update(self, "shared_expert_gate", x_BTD, gate(x_BTD)))
        return out + shared
