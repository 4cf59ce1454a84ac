"""What a `TransformerConfig` may hold: the choices of each option, and the checks that name
every value out of its range or of the wrong type (`problems`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# Each check takes a `TransformerConfig` (`config.py`, which imports this module).
Config = Any

POSITIONAL_ENCODINGS = ("sinusoidal", "learned", "rope", "alibi", "relative")
# Where each sublayer's norm sits: "post" Norm(x + Sublayer(x)) (the paper), "pre"
# x + Sublayer(Norm(x)) (GPT-2, Llama), "output" x + Norm(Sublayer(x)) (OLMo 2 and 3); the
# last two end their stacks with a norm of their own.
NORM_PLACEMENTS = ("post", "pre", "output")
NORM_TYPES = ("layernorm", "rmsnorm")
# "relu2" is relu(x)² (Nemotron's and Arcee's squared ReLU);
# "gelu" is the tanh approximation (GPT-2's "gelu_new"), "gelu_exact" the erf form; "silu"
# (swish) is ungated, "swiglu" is silu(W1 x) * W3 x (Llama's gated feed-forward network),
# "geglu" is gelu(W1 x) * W3 x with the tanh GELU (Gemma's), "clamped_swiglu" is gpt-oss's
# SwiGLU of clipped inputs, g · σ(alpha · g) · (u + 1) (`swiglu_alpha`, `swiglu_limit`).
ACTIVATIONS = ("relu", "relu2", "gelu", "gelu_exact", "silu", "swiglu", "geglu",
               "clamped_swiglu", "xielu")
GATED_ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu")
DTYPES = ("float32", "bfloat16", "float16")
# What the KV cache may hold: a float dtype, or "int8" with a float32 scale per (token, kv
# head) (`model/quantize.py`).
CACHE_DTYPES = (*DTYPES, "int8")
# What the layers' kernels may be held in besides `param_dtype` (`model/int8_base.py`).
KERNEL_DTYPES = ("int8",)
# The dtype of the int8 cache's scales, counted by `cache_size_bytes`.
CACHE_SCALE_DTYPE = np.dtype(np.float32)
# "interleaved": sin and cos of each frequency side by side (the paper's PE(pos, 2i),
# PE(pos, 2i + 1)); "halves": every sine, then every cosine (Marian); "fairseq": every sine,
# then every cosine, of frequencies 10000^(-i / (D/2 - 1)) (M2M100, NLLB).
SINUSOID_LAYOUTS = ("interleaved", "halves", "fairseq")
# How RoPE's frequencies are stretched for contexts longer than the training length:
# "linear" divides every frequency by the factor; "llama3" divides only the low ones and
# blends in between (Llama 3.1/3.2); "yarn" divides the frequencies that turn few times over
# the original length, keeps the fast ones, blends in between and scales the turned queries
# and keys (YaRN: Qwen2.5 and Qwen3 beyond their native context); "longrope" divides each
# frequency by a factor of its own and scales the turned queries and keys (Phi-3 and 3.5 of
# 128k context, Phi-4 mini).
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")
# How a mixture's router scores each expert from its logit: its share of a softmax over every
# expert, or its own sigmoid (DeepSeek-V3's router).
ROUTER_SCORINGS = ("softmax", "sigmoid")
# How a router ranks a group of experts: by the sum of its two best scores, or by its best.
ROUTER_GROUP_SCORES = ("two_best", "best")

_INT_FIELDS = ("vocab_size", "d_model", "num_heads", "d_ff", "num_decoder_layers",
               "num_encoder_layers", "max_len", "bos_id", "attention_block",
               "rope_original_max_len", "num_experts", "experts_per_token",
               "shared_expert_d_ff", "dense_d_ff", "router_groups", "router_groups_kept",
               "latent_kv_rank", "latent_q_rank", "latent_nope_dim", "latent_value_dim",
               "query_scale_length", "relative_buckets",
               "relative_max_distance", "sinusoid_offset")
_REAL_FIELDS = ("dropout", "rope_base", "layer_norm_eps", "rope_scaling_factor",
                "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
                "rope_beta_slow", "embedding_multiplier", "residual_multiplier", "logits_scaling",
                "swiglu_alpha", "swiglu_limit", "query_scale_beta", "routed_scaling")
_BOOL_FIELDS = ("tie_embeddings", "scan_layers", "remat", "qkv_bias", "out_bias", "ffn_bias",
                "scale_embeddings", "logits_bias", "qk_norm", "qk_norm_across_heads",
                "qk_norm_after_rope",
                "norm_unit_offset", "sandwich_norms", "norm_params", "embedding_norm",
                "per_stack_embeddings", "parallel_residual", "shared_norm",
                "relative_bias_per_layer", "rope_truncate", "normalize_expert_weights",
                "shared_expert_gate",
                "attention_sinks", "router_bias", "router_selection_bias")
_OPTIONAL_REALS = ("local_rope_base", "attention_scale", "attention_softcap", "logits_softcap",
                   "qkv_clip",
                   "rope_attention_factor", "sparsemixer_eps")
_CHOICES = {"positional_encoding": POSITIONAL_ENCODINGS, "norm": NORM_PLACEMENTS,
            "activation": ACTIVATIONS, "dtype": DTYPES, "param_dtype": DTYPES,
            "norm_type": NORM_TYPES, "sinusoid_layout": SINUSOID_LAYOUTS,
            "rope_scaling": ROPE_SCALINGS, "router_scoring": ROUTER_SCORINGS,
            "router_group_score": ROUTER_GROUP_SCORES}


def problems(config: Config) -> list[str]:
    """Every problem of `config`, each naming its field and value (none: a valid config).
    NumPy ints and reals are stored as Python ones on the way (`_type_problems`)."""
    problems = _type_problems(config)
    if problems:  # the range checks below assume the types
        return problems
    for name in ("vocab_size", "d_model", "num_heads", "d_ff", "num_decoder_layers", "max_len",
                 "attention_block"):
        if getattr(config, name) < 1:
            problems.append(f"{name}={getattr(config, name)} must be >= 1")
    if config.num_encoder_layers < 0:
        problems.append(f"num_encoder_layers={config.num_encoder_layers} must be >= 0")
    if config.head_dim is None:
        if config.num_heads >= 1 and config.d_model % config.num_heads:
            problems.append(f"num_heads={config.num_heads} does not divide "
                            f"d_model={config.d_model} (or give head_dim)")
    elif config.head_dim < 1:
        problems.append(f"head_dim={config.head_dim} must be >= 1")
    if config.sliding_window is not None and config.sliding_window < 1:
        problems.append(f"sliding_window={config.sliding_window} must be >= 1 or None")
    if config.embedding_dim is not None and config.embedding_dim < 1:
        problems.append(f"embedding_dim={config.embedding_dim} must be >= 1 or None")
    if config.sinusoid_offset < 0 or (config.sinusoid_offset
                                      and config.positional_encoding != "sinusoidal"):
        problems.append(f"sinusoid_offset={config.sinusoid_offset} must be >= 0, and 0 unless "
                        f"positional_encoding is 'sinusoidal'")
    if config.sinusoid_layout == "fairseq" and config.d_model < 4:
        problems.append(f"sinusoid_layout 'fairseq' needs d_model >= 4 (two frequencies at "
                        f"least), got {config.d_model}")
    problems += _layer_kind_problems(config)
    kv = config.num_kv_heads
    if kv is not None and (kv < 1 or (config.num_heads >= 1 and config.num_heads % kv)):
        problems.append(f"num_kv_heads={kv} must be >= 1 and divide num_heads={config.num_heads}")
    if config.per_stack_embeddings and (config.num_encoder_layers == 0 or not (
            config.positional_encoding == "learned" or config.embedding_norm)):
        problems.append("per_stack_embeddings gives an encoder and a decoder their own learned "
                        "positions or embedding norm: it needs an encoder (num_encoder_layers "
                        "> 0) and positional_encoding='learned' or embedding_norm")
    if config.positional_encoding == "alibi" and config.num_encoder_layers > 0:
        problems.append("positional_encoding='alibi' is a decoder's: its bias grows with how far "
                        "back a key lies, and an encoder also attends forward")
    if config.relative_buckets < 4 or config.relative_max_distance < config.relative_buckets:
        problems.append(f"relative_buckets={config.relative_buckets} must be >= 4 and <= "
                        f"relative_max_distance={config.relative_max_distance}")
    if config.relative_bias_per_layer and config.positional_encoding != "relative":
        problems.append(f"relative_bias_per_layer gives each layer a table of T5's relative "
                        f"position bias: it needs positional_encoding='relative', got "
                        f"{config.positional_encoding!r}")
    if config.positional_encoding == "rope" and config.num_heads >= 1:
        head_dim = _given_head_dim(config)
        if head_dim % 2:
            problems.append(f"rope needs an even head_dim, got {head_dim}")
    problems += _rotary_dim_problems(config)
    problems += _rope_scaling_problems(config)
    problems += _query_scale_problems(config)
    problems += _expert_problems(config)
    problems += _latent_problems(config)
    if config.cache_dtype is not None and config.cache_dtype not in CACHE_DTYPES:
        problems.append(f"cache_dtype={config.cache_dtype!r} is not None or one of "
                        f"{CACHE_DTYPES}")
    if config.kernel_dtype is not None and config.kernel_dtype not in KERNEL_DTYPES:
        problems.append(f"kernel_dtype={config.kernel_dtype!r} is not None or one of "
                        f"{KERNEL_DTYPES}")
    for name, allowed in _CHOICES.items():
        if getattr(config, name) not in allowed:
            problems.append(f"{name}={getattr(config, name)!r} is not one of {allowed}")
    if config.vocab_size >= 1 and not 0 <= config.bos_id < config.vocab_size:
        problems.append(f"bos_id={config.bos_id} is outside the vocabulary [0, "
                        f"{config.vocab_size})")
    if not 0.0 <= config.dropout < 1.0:
        problems.append(f"dropout={config.dropout} must be in [0, 1)")
    for name in ("rope_base", "layer_norm_eps", "rope_scaling_factor", "embedding_multiplier",
                 "residual_multiplier", "logits_scaling", "swiglu_alpha", "swiglu_limit",
                 *_OPTIONAL_REALS):
        value = getattr(config, name)
        if value is not None and not 0 < value < math.inf:
            problems.append(f"{name}={value} must be > 0 and finite")
    return problems


def _layer_kind_problems(config: Config) -> list[str]:
    """What is wrong with the per-layer attention options and the norms Gemma needs."""
    problems = []
    if config.full_attention_layers and config.sliding_window is None:
        problems.append(f"full_attention_layers={list(config.full_attention_layers)} needs a "
                        "sliding_window")
    if config.unrotated_layers and config.positional_encoding != "rope":
        problems.append(f"unrotated_layers={list(config.unrotated_layers)} needs "
                        "positional_encoding='rope'")
    for name in ("full_attention_layers", "unrotated_layers", "dense_ffn_layers"):
        layers = getattr(config, name)
        if list(layers) != sorted(set(layers)) or not all(
                0 <= i < config.num_decoder_layers for i in layers):
            problems.append(f"{name}={list(layers)} must be distinct layer numbers in [0, "
                            f"{config.num_decoder_layers}), in order")
    if config.local_rope_base is not None and (config.sliding_window is None
                                               or config.positional_encoding != "rope"):
        problems.append(f"local_rope_base={config.local_rope_base} needs rope and a "
                        "sliding_window")
    if config.norm_unit_offset and config.norm_type != "rmsnorm":
        problems.append("norm_unit_offset needs norm_type='rmsnorm'")
    if config.norm_unit_offset and not config.norm_params:
        problems.append("norm_unit_offset needs norm_params: it offsets a learned scale")
    if config.sandwich_norms and config.norm != "pre":
        problems.append("sandwich_norms needs norm='pre'")
    if config.parallel_residual and (config.norm != "pre" or config.sandwich_norms
                                     or config.num_encoder_layers):
        problems.append("parallel_residual needs norm='pre', no sandwich_norms and a "
                        "decoder-only model")
    if config.shared_norm and not config.parallel_residual:
        problems.append("shared_norm needs parallel_residual")
    if config.qk_norm_across_heads and not config.qk_norm:
        problems.append("qk_norm_across_heads needs qk_norm")
    if config.qk_norm_after_rope and not config.qk_norm:
        problems.append("qk_norm_after_rope needs qk_norm")
    if config.qkv_clip is not None and config.qk_norm_after_rope:
        problems.append("qkv_clip clips queries and keys before RoPE, which qk_norm_after_rope "
                        "normalises after it: set one of them")
    return problems


def _expert_problems(config: Config) -> list[str]:
    """What is wrong with a mixture of experts' options (none for a dense FFN)."""
    if config.num_experts < 0:
        return [f"num_experts={config.num_experts} must be >= 0 (0: one dense FFN)"]
    problems = []
    if config.num_experts and config.activation == "xielu":
        problems.append("activation='xielu' learns its coefficients in a dense FFN; experts "
                        "(num_experts > 0) do not take it")
    if config.shared_expert_d_ff < 0:
        problems.append(f"shared_expert_d_ff={config.shared_expert_d_ff} must be >= 0 (0: none)")
    if config.shared_expert_gate and config.shared_expert_d_ff <= 0:
        problems.append("shared_expert_gate needs a shared expert (shared_expert_d_ff > 0)")
    if config.num_experts == 0:
        if config.shared_expert_d_ff:
            problems.append("shared_expert_d_ff needs a mixture of experts (num_experts > 0)")
        if config.router_bias:
            problems.append("router_bias needs a mixture of experts (num_experts > 0)")
        if config.sparsemixer_eps is not None:
            problems.append("sparsemixer_eps needs a mixture of experts (num_experts > 0)")
        for name in ("dense_ffn_layers", "dense_d_ff", "router_selection_bias"):
            if getattr(config, name):
                problems.append(f"{name} needs a mixture of experts (num_experts > 0)")
        return problems + _router_problems(config)
    if config.dense_ffn_layers and config.dense_d_ff <= 0:
        problems.append(f"dense_ffn_layers={list(config.dense_ffn_layers)} needs their "
                        f"dense_d_ff > 0 (got {config.dense_d_ff})")
    if config.dense_ffn_layers and config.scan_layers:
        problems.append("dense_ffn_layers needs unrolled layers (scan_layers false): a scanned "
                        "stack repeats one layer")
    if config.router_selection_bias and config.sparsemixer_eps is not None:
        problems.append("router_selection_bias and sparsemixer_eps are two routers: set one")
    problems += _router_problems(config)
    if not 1 <= config.experts_per_token <= config.num_experts:
        problems.append(f"experts_per_token={config.experts_per_token} must be from 1 to "
                        f"num_experts={config.num_experts}")
    if config.sparsemixer_eps is not None:
        if not 0 <= config.sparsemixer_eps < math.inf:
            problems.append(f"sparsemixer_eps={config.sparsemixer_eps} must be >= 0 and finite")
        if config.experts_per_token != 2 or config.num_experts < 2:
            problems.append(f"sparsemixer_eps routes two experts a token, not "
                            f"experts_per_token={config.experts_per_token} of "
                            f"num_experts={config.num_experts}")
        if config.normalize_expert_weights:
            problems.append("sparsemixer_eps weighs each chosen expert by a softmax of its own: "
                            "normalize_expert_weights must be false")
    if config.num_encoder_layers:
        problems.append("num_experts needs a decoder-only model")
    return problems


def _latent_problems(config: Config) -> list[str]:
    """What is wrong with latent attention's options (none where `latent_kv_rank` is 0)."""
    names = ("latent_kv_rank", "latent_q_rank", "latent_nope_dim", "latent_value_dim")
    negative = [f"{name}={getattr(config, name)} must be >= 0" for name in names
                if getattr(config, name) < 0]
    if negative or not config.latent_kv_rank:
        return negative + [f"{name} needs latent attention (latent_kv_rank > 0)"
                           for name in names[1:] if getattr(config, name) > 0]
    problems = []
    if config.positional_encoding != "rope" or config.rotary_dim is None:
        problems.append("latent attention turns a shared key part of rotary_dim dimensions: "
                        "it needs positional_encoding='rope' and rotary_dim")
    elif (config.head_dim or config.d_model // config.num_heads) < max(
            config.rotary_dim + config.latent_nope_dim, config.latent_value_dim):
        problems.append(f"head_dim={config.head_dim or config.d_model // config.num_heads} "
                        f"must hold rotary_dim + latent_nope_dim "
                        f"= {config.rotary_dim + config.latent_nope_dim} and latent_value_dim "
                        f"= {config.latent_value_dim}")
    if config.latent_value_dim < 1:
        problems.append("latent attention needs latent_value_dim >= 1")
    if config.kv_heads != config.num_heads:
        problems.append(f"latent attention gives every head its own K and V: num_kv_heads="
                        f"{config.num_kv_heads} must be num_heads={config.num_heads}")
    for name in ("qkv_bias", "qk_norm", "qkv_clip"):
        if getattr(config, name) not in (False, None):
            problems.append(f"{name} is not implemented for latent attention")
    if config.num_encoder_layers:
        problems.append("latent attention needs a decoder-only model")
    return problems


def _router_problems(config: Config) -> list[str]:
    """What is wrong with DeepSeek's router options (`router_scoring`, `router_groups`,
    `router_groups_kept`, `router_group_score`, `routed_scaling`)."""
    problems = []
    deepseek = (config.router_scoring != "softmax" or config.router_groups != 1
                or config.router_groups_kept != 1 or config.routed_scaling != 1)
    if deepseek and config.num_experts == 0:
        problems.append("router_scoring, router_groups, router_groups_kept and routed_scaling "
                        "need a mixture of experts (num_experts > 0)")
    if config.router_group_score != "two_best" and config.router_groups == 1:
        problems.append(f"router_group_score={config.router_group_score!r} ranks groups of "
                        "experts: it needs router_groups > 1")
    if deepseek and config.sparsemixer_eps is not None:
        problems.append("sparsemixer_eps is a router of its own: it takes no router_scoring, "
                        "router_groups or routed_scaling")
    if not 0 < config.routed_scaling < math.inf:
        problems.append(f"routed_scaling={config.routed_scaling} must be > 0 and finite")
    groups, kept = config.router_groups, config.router_groups_kept
    if groups < 1 or not 1 <= kept <= groups:
        problems.append(f"router_groups={groups} and router_groups_kept={kept} need "
                        "1 <= router_groups_kept <= router_groups")
    elif groups > 1 and config.num_experts:
        size, left = divmod(config.num_experts, groups)
        smallest = 2 if config.router_group_score == "two_best" else 1
        if left or size < smallest:
            problems.append(f"router_groups={groups} must split num_experts="
                            f"{config.num_experts} into equal groups"
                            + (" of at least two (a group is scored by its two best experts)"
                               if smallest == 2 else ""))
        elif config.experts_per_token > kept * size:
            problems.append(f"experts_per_token={config.experts_per_token} is more than the "
                            f"{kept * size} experts of router_groups_kept={kept} groups")
    return problems


def _query_scale_problems(config: Config) -> list[str]:
    beta, length = config.query_scale_beta, config.query_scale_length
    problems = []
    if not 0 <= beta < math.inf:
        problems.append(f"query_scale_beta={beta} must be >= 0 and finite")
    if length < 1:
        problems.append(f"query_scale_length={length} must be >= 1")
    return problems


def _rope_scaling_problems(config: Config) -> list[str]:
    if config.rope_scaling == "none" or not isinstance(config.rope_scaling, str):
        return []
    problems = []
    if config.positional_encoding != "rope":
        problems.append(f"rope_scaling={config.rope_scaling!r} needs positional_encoding='rope'")
    if config.rope_scaling == "llama3":
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        if not 0 < low < high < math.inf:
            problems.append(f"llama3 rope scaling needs 0 < rope_low_freq_factor ({low}) < "
                            f"rope_high_freq_factor ({high})")
    if config.rope_scaling == "yarn":
        fast, slow = config.rope_beta_fast, config.rope_beta_slow
        if not 0 < slow <= fast < math.inf:
            problems.append(f"yarn rope scaling needs 0 < rope_beta_slow ({slow}) <= "
                            f"rope_beta_fast ({fast})")
        if config.rope_scaling_factor < 1:
            problems.append(f"yarn rope scaling needs rope_scaling_factor >= 1, got "
                            f"{config.rope_scaling_factor}")
    if config.rope_scaling == "longrope":
        name = longrope_factors_field(config)
        factors = getattr(config, name)
        pairs = (config.rotary_dim or _given_head_dim(config)) // 2
        if len(factors) != pairs or not all(0 < f < math.inf for f in factors):
            problems.append(f"longrope with max_len={config.max_len} (original length "
                            f"{config.rope_original_max_len}) needs {pairs} {name} > 0, one "
                            f"per dimension pair RoPE turns; got {list(factors)}")
    if config.rope_scaling in ("llama3", "yarn", "longrope") and config.rope_original_max_len < 1:
        problems.append(f"rope_original_max_len={config.rope_original_max_len} must be >= 1")
    return problems


def longrope_factors_field(config: Config) -> str:
    """The factors a longrope model turns with: the long ones when its max_len passes its
    original length, else the short ones."""
    long = config.max_len > config.rope_original_max_len
    return "rope_long_factors" if long else "rope_short_factors"


def _given_head_dim(config: Config) -> int:
    """The head dimension while the config is being checked, before `head_dim` is set."""
    return config.head_dim or config.d_model // max(config.num_heads, 1)


def _rotary_dim_problems(config: Config) -> list[str]:
    dims = config.rotary_dim
    if dims is None:
        return []
    head_dim = _given_head_dim(config)
    problems = [] if config.positional_encoding == "rope" else [
        f"rotary_dim={dims} needs positional_encoding='rope'"]
    if dims % 2 or not 2 <= dims <= head_dim:
        problems.append(f"rotary_dim={dims} must be even and in [2, head_dim={head_dim}]")
    return problems


def _type_problems(config: Config) -> list[str]:
    """What is of the wrong type: a bool is not an int, "128" is not an int, 64.5 is not an
    int. NumPy integers and reals are accepted and stored as Python int and float, so that
    the config stays hashable and JSON-serialisable."""
    problems = []

    def check(name: str, kinds: tuple, convert, what: str) -> None:
        value = getattr(config, name)
        if isinstance(value, kinds) and not isinstance(value, bool | np.bool_):
            object.__setattr__(config, name, convert(value))
        else:
            problems.append(f"{name}={value!r} must be {what}")

    for name in _INT_FIELDS:
        check(name, (int, np.integer), int, "an int")
    for name in ("num_kv_heads", "head_dim", "sliding_window", "rotary_dim", "embedding_dim"):
        if getattr(config, name) is not None:
            check(name, (int, np.integer), int, "an int or None")
    for name in _REAL_FIELDS:
        check(name, (int, float, np.integer, np.floating), float, "a real number")
    for name in _OPTIONAL_REALS:
        if getattr(config, name) is not None:
            check(name, (int, float, np.integer, np.floating), float, "a real number or None")
    for name in ("rope_short_factors", "rope_long_factors"):
        factors = getattr(config, name)
        if isinstance(factors, tuple | list) and all(
                isinstance(f, int | float | np.integer | np.floating) and not isinstance(f, bool)
                for f in factors):
            object.__setattr__(config, name, tuple(float(f) for f in factors))
        else:
            problems.append(f"{name}={factors!r} must be a list of real numbers")
    for name in ("full_attention_layers", "unrotated_layers", "dense_ffn_layers"):
        layers = getattr(config, name)
        if isinstance(layers, tuple | list) and all(
                isinstance(i, int | np.integer) and not isinstance(i, bool) for i in layers):
            object.__setattr__(config, name, tuple(int(i) for i in layers))
        else:
            problems.append(f"{name}={layers!r} must be a list of ints")
    for name in _BOOL_FIELDS:
        value = getattr(config, name)
        if not isinstance(value, bool | np.bool_):
            problems.append(f"{name}={value!r} must be True or False")
        else:
            object.__setattr__(config, name, bool(value))
    for name in _CHOICES:
        if not isinstance(getattr(config, name), str):
            problems.append(f"{name}={getattr(config, name)!r} must be a string")
    for name in ("cache_dtype", "kernel_dtype"):
        if getattr(config, name) is not None and not isinstance(getattr(config, name), str):
            problems.append(f"{name}={getattr(config, name)!r} must be a string or None")
    return problems
