"""One frozen config for both Transformer variants, with presets.

The config sizes everything: it validates itself (`config_checks.py` says what each option
may hold) and knows its head dimension; what a KV cache of it takes is `cache_size.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

from .config_checks import problems as config_problems


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of a decoder-only LM (`num_encoder_layers == 0`) or an encoder-decoder.

    The defaults follow "Attention Is All You Need": sinusoidal positions, post-LayerNorm
    (`LayerNorm(x + Sublayer(x))`) and a ReLU feed-forward network.
    """

    vocab_size: int = 4096
    d_model: int = 384
    num_heads: int = 6
    num_kv_heads: int | None = None  # None: same as num_heads (MHA); 1: MQA; else GQA.
    d_ff: int = 1536
    num_decoder_layers: int = 6
    num_encoder_layers: int = 0  # > 0 makes an encoder-decoder.
    max_len: int = 1024
    # "sinusoidal" or "learned" (added to the embeddings), "rope" (turning queries and keys),
    # "alibi" (a bias on the attention logits by distance, decoder-only) or "relative" (T5's
    # learned bias by bucket of distance, one table per stack): `positional.PositionBias`.
    positional_encoding: str = "sinusoidal"
    norm: str = "post"
    activation: str = "relu"
    tie_embeddings: bool = True
    dropout: float = 0.0
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    rope_base: float = 10000.0
    bos_id: int = 1  # the token an encoder-decoder's target starts from
    layer_norm_eps: float = 1e-6
    # How a stack of layers is held (see `layer_stacks`). False (the default): unrolled
    # layers with their own params (`layers/0`, ...) and their own cache buffers, so each
    # layer reads its weights and its cache where they lie; decoding and training are faster
    # this way (benchmarks/README.md). True: one `nn.scan` over stacked [L, ...] params and
    # one stacked cache buffer, traced once, so compile time does not grow with depth; worth
    # it for deep models. `unstack_layer_params`/`stack_layer_params` convert between them.
    scan_layers: bool = False
    # Slots per block of decode attention (`attend_blocks`): a step reads the cache in blocks
    # up to the longest row, so a smaller block wastes less past that row's end and a larger
    # one pays the per-block overhead fewer times.
    attention_block: int = 64
    remat: bool = False  # training recomputes each layer in the backward pass (`nn.remat`)
    # Options that imported architectures need (`kvjax.hf`). Their defaults are the model
    # above, and `to_dict` leaves out whichever is at its default, so a config.json written
    # before they existed reads back equal.
    head_dim: int | None = None  # None: d_model // num_heads
    qkv_bias: bool = False  # biases on the query/key/value projections (GPT-2, Qwen2)
    out_bias: bool = False  # a bias on the attention output projection (GPT-2)
    ffn_bias: bool = True  # biases in the feed-forward network (Llama has none)
    norm_type: str = "layernorm"  # or "rmsnorm": x * rsqrt(mean(x²) + eps) * w
    scale_embeddings: bool = True  # multiply token embeddings by √D (the paper, Marian)
    logits_bias: bool = False  # an additive bias [V] on the output logits (Marian)
    sinusoid_layout: str = "interleaved"
    # Added to every position before its sinusoid is computed: fairseq's models number the
    # first token's position after the padding id (M2M100 and NLLB: 2).
    sinusoid_offset: int = 0
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original/low are divided
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept
    # llama3, yarn, longrope: the context length the model was trained at.
    rope_original_max_len: int = 8192
    # yarn: frequencies that turn more than beta_fast times over the original length are kept,
    # those turning fewer than beta_slow times divided by the factor, the ones between blended
    # over the dimensions between (rounded out to whole ones with `rope_truncate`).
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    # yarn, longrope: what the turned queries and keys are multiplied by (their products by its
    # square); None: 0.1 · ln(factor) + 1 for yarn, sqrt(1 + ln(factor) / ln(original length))
    # for longrope.
    rope_attention_factor: float | None = None
    # longrope: each dimension pair's frequency is divided by its factor: the short ones for a
    # model whose max_len is within rope_original_max_len, the long ones at every position of
    # a model made for a longer context.
    rope_short_factors: tuple[float, ...] = ()
    rope_long_factors: tuple[float, ...] = ()
    # The leading dimensions of each head that RoPE turns, the rest passed through unturned;
    # None: all of them (Phi-4 mini turns three quarters).
    rotary_dim: int | None = None
    # What the KV cache stores; None: the compute dtype. "int8" stores K and V as int8 with a
    # float32 scale per (token, kv head), dequantised block by block as attention reads them.
    cache_dtype: str | None = None
    # What the projection kernels are held in; None: `param_dtype`. "int8" holds the layers'
    # self-attention, FFN and expert kernels and the embedding table as int8 with float32
    # scales, each layer making its `param_dtype` kernels where it runs (`model/int8_base.py`).
    kernel_dtype: str | None = None
    qk_norm: bool = False  # RMSNorm over each head's query and key, before RoPE (Qwen3)
    # With qk_norm, one RMSNorm over all heads' queries together (and one over all kv heads'
    # keys), its scale [N·H] ([K·H]), where Qwen3 normalises each head alone (OLMo 2 and 3).
    qk_norm_across_heads: bool = False
    # With qk_norm, the norms take the queries and keys after RoPE has turned them (HunYuan).
    qk_norm_after_rope: bool = False
    # Self-attention sees only the last `sliding_window` positions (itself included; Mistral).
    # None: all earlier positions. A contiguous cache still holds every position of a row;
    # where every layer has the window, a paged one may drop those behind it (`attention_reach`).
    sliding_window: int | None = None
    # positional_encoding="relative": the buckets of distance each stack's table holds (half
    # for each direction in an encoder) and the distance past which they share the last.
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # positional_encoding="relative": each self-attention layer holds a table of its own
    # (UMT5) rather than reading its stack's one (T5).
    relative_bias_per_layer: bool = False
    # Decoder layers (0-based) that attend over every earlier position although
    # `sliding_window` is set: Gemma 2 and 3 alternate local and global layers.
    full_attention_layers: tuple[int, ...] = ()
    # Decoder layers (0-based) whose attention turns neither queries nor keys: no position
    # encoding at all, the causal mask alone telling order (SmolLM3's NoPE layers).
    unrotated_layers: tuple[int, ...] = ()
    # RoPE base of the sliding-window layers, which then turn unscaled (Gemma 3: 10000 where
    # its global layers use 1e6 and a linear scaling). None: the same RoPE in every layer.
    local_rope_base: float | None = None
    # RMSNorm multiplies by (1 + scale), its scale starting at 0, in float32 (Gemma).
    norm_unit_offset: bool = False
    # A second norm on each sublayer's output before the residual sum (pre-norm only):
    # x + norm2(Sublayer(norm1(x))), Gemma 2 and 3's "sandwich".
    sandwich_norms: bool = False
    # False: every norm of the model without learned parameters, RMSNorm without its scale
    # and LayerNorm without scale and bias (nanochat's).
    norm_params: bool = True
    # A norm over the embeddings, before the first layer (nanochat's).
    embedding_norm: bool = False
    # An encoder-decoder whose encoder and decoder each add their own learned positions and
    # have their own `embedding_norm`, over the one table of tokens (BART, mBART).
    per_stack_embeddings: bool = False
    # The attention and the FFN both read the layer's input, each through its own norm, and
    # their outputs join it in one sum: x + Attn(norm1(x)) + FFN(norm2(x)) (pre-norm,
    # decoder-only; GPT-NeoX and Pythia). With `shared_norm`, through one norm:
    # x + Attn(norm(x)) + FFN(norm(x)) (Phi-1, Phi-1.5, Phi-2).
    parallel_residual: bool = False
    shared_norm: bool = False
    # What multiplies QKᵀ; None: 1/√head_dim (Gemma: query_pre_attn_scalar^-1/2), or with
    # latent attention 1/√(rotary_dim + latent_nope_dim).
    attention_scale: float | None = None
    # Multi-head latent attention (`model/latent_attention.py`; DeepSeek-V3, Kimi K2,
    # Moonlight, GLM-4.7-Flash): with `latent_kv_rank` > 0 each token's keys and values come
    # from a latent vector of that width (each head's `latent_nope_dim` key and
    # `latent_value_dim` value dimensions) and a key part of `rotary_dim` dimensions every
    # head shares; its queries from `latent_q_rank` dimensions (0: from the token directly).
    # A head is [turned, unturned, zeros]: head_dim holds rotary_dim + latent_nope_dim and
    # latent_value_dim. The cache holds each token's latent and shared key part, not heads.
    latent_kv_rank: int = 0
    latent_q_rank: int = 0
    latent_nope_dim: int = 0
    latent_value_dim: int = 0
    # Queries at position p (after RoPE) multiplied by 1 + beta · ln(1 + floor(p / length)):
    # logits sharpen, step by step, as positions pass each multiple of `length` (Ministral 3,
    # from Llama 4's attention temperature). beta 0: off.
    query_scale_beta: float = 0.0
    query_scale_length: int = 1
    # A learned logit per query head that joins each of its softmaxes as one more key whose
    # value is zero (`self_attention/sinks` [N]; gpt-oss): a query may give most of its weight
    # to nothing rather than spread it over the keys it sees.
    attention_sinks: bool = False
    # Soft caps: logits -> cap · tanh(logits / cap), for attention (before the mask) and for
    # the output logits (Gemma 2). None: no cap.
    attention_softcap: float | None = None
    logits_softcap: float | None = None
    # Self-attention's queries, keys and values clipped to [-qkv_clip, qkv_clip] as they leave
    # their projections, after the norms of `qk_norm` where those come before RoPE (OLMo 1.7's,
    # OLMoE's). None: not clipped.
    qkv_clip: float | None = None
    # Granite's multipliers: on the token embeddings (after any √D), on each sublayer's
    # output before the residual sum, and the output logits divided by `logits_scaling`.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # The token table's width where it is not d_model (OPT-350m's word_embed_proj_dim): the
    # embeddings looked up are projected to d_model (`project_in`, no bias) and the last
    # hidden states back to this width for the output layer (`project_out`). None: d_model.
    embedding_dim: int | None = None
    # A mixture of experts in place of each decoder layer's FFN (0: one dense FFN): a router
    # scores `num_experts` FFNs of `d_ff` hidden units for every token, the token goes
    # through the `experts_per_token` it scores highest, and their outputs are summed,
    # weighted by the router's softmax over all experts; with `normalize_expert_weights`
    # those weights are divided by their sum (Mixtral, Qwen3-MoE), without it taken as they
    # are (OLMoE). Decoder-only (`model/experts.py`); with `ffn_bias` each expert has biases
    # of its own, and with `router_bias` the router too (gpt-oss). A shared expert of
    # `shared_expert_d_ff` hidden units (0: none) takes every token beside its chosen ones,
    # its output scaled by a sigmoid gate of the token under `shared_expert_gate` (Qwen2-MoE).
    num_experts: int = 0
    experts_per_token: int = 2
    normalize_expert_weights: bool = True
    shared_expert_d_ff: int = 0
    shared_expert_gate: bool = False
    router_bias: bool = False
    # ERNIE 4.5's mixtures: the layers `dense_ffn_layers` have one dense FFN of `dense_d_ff`
    # hidden units in place of the mixture (unrolled layers only), and with
    # `router_selection_bias` a mixture chooses each token's experts by its softmax plus a
    # learned bias of each expert (`selection_bias` [experts]), weighing them by the softmax.
    dense_ffn_layers: tuple[int, ...] = ()
    dense_d_ff: int = 0
    router_selection_bias: bool = False
    # DeepSeek-V3's router (GLM-4.5, dots.llm1): under `router_scoring` "sigmoid" each
    # expert's score is the sigmoid of its logit rather than its share of a softmax; with
    # `router_groups` > 1 the experts are split into that many equal groups, each group
    # scored by its two best scores (plus the selection bias; `router_group_score`
    # "two_best") or by its best one ("best", DeepSeek-V2's group-limited greedy), and a
    # token chooses only among the experts of its `router_groups_kept` best groups. The
    # chosen experts' weights (after `normalize_expert_weights`) are multiplied by
    # `routed_scaling`.
    router_scoring: str = "softmax"
    router_groups: int = 1
    router_groups_kept: int = 1
    router_group_score: str = "two_best"
    routed_scaling: float = 1.0
    # Phi-3.5-MoE's router (SparseMixer, as it decides at inference; two experts a token): the
    # top expert, weighted by its probability under a softmax over the experts whose logits
    # are within 2·eps (relative) of its own, then the second the same way with the top one
    # left out. None: the softmax over every expert above.
    sparsemixer_eps: float | None = None
    # The "clamped_swiglu" activation's (gpt-oss): (clip(W3 x, ±limit) + 1) · g · σ(alpha · g)
    # with g = min(W1 x, limit).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        problems = config_problems(self)
        if problems:
            raise ValueError("invalid TransformerConfig: " + "; ".join(problems))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)

    # Derived sizes -------------------------------------------------------------------------

    @property
    def rotary_dims(self) -> int:
        """The leading dimensions of each head that RoPE turns."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def cached_heads(self) -> tuple[int, int]:
        """(K of the cache's key stacks, K of its value stacks): `kv_heads` each, or with
        latent attention one key head, each token's latent and its shared turned key part
        (`cached_head_dim` wide), and no value heads: a latent layer reads its values from
        that same latent (`model/latent_attention.py`)."""
        return (1, 0) if self.latent_kv_rank else (self.kv_heads, self.kv_heads)

    @property
    def cached_head_dim(self) -> int:
        """H of the cache's stacks: `head_dim`, or with latent attention `rotary_dim +
        latent_kv_rank`."""
        return self.rotary_dims + self.latent_kv_rank if self.latent_kv_rank else self.head_dim

    @property
    def is_encoder_decoder(self) -> bool:
        return self.num_encoder_layers > 0

    def is_local_layer(self, number: int) -> bool:
        """Whether decoder layer `number` (0-based) attends over a sliding window."""
        return self.sliding_window is not None and number not in self.full_attention_layers

    @property
    def attention_reach(self) -> int | None:
        """How many positions, its own included, a decoder query reads at most: the sliding
        window where every decoder layer attends over one (Mistral 7B v0.1, Phi-3, StarCoder2),
        else None (every earlier position). A row's positions further back than this behind
        its next one are never read again, so a paged cache may give their pages back."""
        if self.sliding_window is None or any(
                not self.is_local_layer(i) for i in range(self.num_decoder_layers)):
            return None
        return self.sliding_window

    def first_decoder_layers(self, num_layers: int) -> TransformerConfig:
        """The config of this model's first `num_layers` decoder layers: what is said of a
        layer past them (which attend in full, which turn no RoPE) goes with it."""
        def kept(layers):
            return tuple(i for i in layers if i < num_layers)

        return self.replace(num_decoder_layers=num_layers,
                            full_attention_layers=kept(self.full_attention_layers),
                            unrotated_layers=kept(self.unrotated_layers),
                            dense_ffn_layers=kept(self.dense_ffn_layers))

    def layer_stacks(self, num_layers: int) -> tuple[int, ...]:
        """How many layers each stack of a `num_layers` stack holds: everything held per
        layer (cache buffers, cross-attention K/V) is a tuple of arrays with a leading axis
        of that many layers. One stack of all layers when `scan_layers`, else one per layer.
        """
        return (num_layers,) if self.scan_layers else (1,) * num_layers

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weights_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def kv_cache_dtype(self) -> jnp.dtype:
        """What the KV cache stores: `cache_dtype`, else the compute dtype."""
        return jnp.dtype(self.cache_dtype or self.dtype)

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with `changes`; a head_dim that was d_model // num_heads follows new sizes."""
        if "head_dim" not in changes and self.head_dim == self.d_model // self.num_heads:
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)

    # Serialisation (JSON next to every checkpoint) -----------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field, less the imported-architecture options and the cache and kernel dtypes
        at their defaults."""
        values = dataclasses.asdict(self)
        for name, default in _OPTION_DEFAULTS.items():
            if values[name] == default:
                del values[name]
        if values["head_dim"] == self.d_model // self.num_heads:
            del values["head_dim"]
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransformerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {unknown}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> TransformerConfig:
        return cls.from_dict(json.loads(text))


# Fields that set how fast a model runs, never what it computes: two configs that differ only
# in them hold the same model (a checkpoint trained with one fine-tunes or resumes with another).
SPEED_ONLY_FIELDS = ("attention_block", "remat")

# The options written to config.json only when set (see `to_dict`): the imported
# architectures' and the cache and kernel dtypes; head_dim is left out
# when it is d_model // num_heads.
_OPTION_DEFAULTS = {name: getattr(TransformerConfig, name) for name in (
    "qkv_bias", "out_bias", "ffn_bias", "norm_type", "scale_embeddings", "logits_bias",
    "sinusoid_layout", "sinusoid_offset", "rope_scaling", "rope_scaling_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len", "rope_beta_fast",
    "rope_beta_slow", "rope_truncate", "rope_attention_factor", "rope_short_factors",
    "rope_long_factors", "rotary_dim", "cache_dtype", "kernel_dtype", "qk_norm",
    "qk_norm_across_heads", "qk_norm_after_rope",
    "sliding_window", "relative_buckets", "relative_max_distance", "relative_bias_per_layer",
    "full_attention_layers", "unrotated_layers", "local_rope_base",
    "norm_unit_offset", "sandwich_norms", "norm_params", "embedding_norm",
    "per_stack_embeddings", "parallel_residual",
    "shared_norm", "attention_scale",
    "query_scale_beta", "query_scale_length",
    "attention_sinks", "attention_softcap", "logits_softcap", "qkv_clip",
    "embedding_multiplier", "residual_multiplier", "logits_scaling", "embedding_dim",
    "num_experts", "experts_per_token", "normalize_expert_weights", "shared_expert_d_ff",
    "shared_expert_gate", "router_bias", "dense_ffn_layers", "dense_d_ff",
    "router_selection_bias", "router_scoring", "router_groups", "router_groups_kept",
    "router_group_score", "routed_scaling", "latent_kv_rank", "latent_q_rank",
    "latent_nope_dim", "latent_value_dim",
    "sparsemixer_eps", "swiglu_alpha", "swiglu_limit",
    "remat")}


PRESETS: dict[str, TransformerConfig] = {
    # For tests: every code path, milliseconds to compile and run.
    "tiny": TransformerConfig(
        vocab_size=64, d_model=32, num_heads=4, d_ff=64, num_decoder_layers=2, max_len=64
    ),
    # For the demo: a few minutes of training on a laptop CPU.
    "small": TransformerConfig(
        vocab_size=1024, d_model=128, num_heads=4, d_ff=512, num_decoder_layers=3, max_len=256
    ),
    # The size the decode benchmark uses (GPT-2-shaped, 6 layers).
    "gpt-mini": TransformerConfig(
        vocab_size=4096, d_model=384, num_heads=6, d_ff=1536, num_decoder_layers=6, max_len=1024
    ),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """Returns the named preset with `overrides` applied (e.g. `num_encoder_layers=2`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
