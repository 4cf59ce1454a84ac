"""One frozen config for both Transformer variants, with presets.

The config sizes everything: it validates itself and knows its head dimension; what a KV
cache of it takes is `cache_size.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

POSITIONAL_ENCODINGS = ("sinusoidal", "learned", "rope")
NORM_PLACEMENTS = ("post", "pre")
NORM_TYPES = ("layernorm", "rmsnorm")
# "gelu" is the tanh approximation (GPT-2's "gelu_new"), "gelu_exact" the erf form; "silu"
# (swish) is ungated, "swiglu" is silu(W1 x) * W3 x (Llama's gated feed-forward network),
# "geglu" is gelu(W1 x) * W3 x with the tanh GELU (Gemma's).
ACTIVATIONS = ("relu", "gelu", "gelu_exact", "silu", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")
DTYPES = ("float32", "bfloat16", "float16")
# What the KV cache may hold: a float dtype, or "int8" with a float32 scale per (token, kv
# head) (`model/quantize.py`).
CACHE_DTYPES = (*DTYPES, "int8")
# The dtype of the int8 cache's scales, counted by `cache_size_bytes`.
CACHE_SCALE_DTYPE = np.dtype(np.float32)
# "interleaved": sin and cos of each frequency side by side (the paper's PE(pos, 2i),
# PE(pos, 2i + 1)); "halves": every sine, then every cosine (Marian, fairseq).
SINUSOID_LAYOUTS = ("interleaved", "halves")
# How RoPE's frequencies are stretched for contexts longer than the training length:
# "linear" divides every frequency by the factor; "llama3" divides only the low ones and
# blends in between (Llama 3.1/3.2); "yarn" divides the frequencies that turn few times over
# the original length, keeps the fast ones, blends in between and scales the turned queries
# and keys (YaRN: Qwen2.5 and Qwen3 beyond their native context); "longrope" divides each
# frequency by a factor of its own and scales the turned queries and keys (Phi-3 and 3.5 of
# 128k context, Phi-4 mini).
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")


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
    qk_norm: bool = False  # RMSNorm over each head's query and key, before RoPE (Qwen3)
    # Self-attention sees only the last `sliding_window` positions (itself included; Mistral).
    # None: all earlier positions. The cache still holds every position of a row.
    sliding_window: int | None = None
    # Decoder layers (0-based) that attend over every earlier position although
    # `sliding_window` is set: Gemma 2 and 3 alternate local and global layers.
    full_attention_layers: tuple[int, ...] = ()
    # RoPE base of the sliding-window layers, which then turn unscaled (Gemma 3: 10000 where
    # its global layers use 1e6 and a linear scaling). None: the same RoPE in every layer.
    local_rope_base: float | None = None
    # RMSNorm multiplies by (1 + scale), its scale starting at 0, in float32 (Gemma).
    norm_unit_offset: bool = False
    # A second norm on each sublayer's output before the residual sum (pre-norm only):
    # x + norm2(Sublayer(norm1(x))), Gemma 2 and 3's "sandwich".
    sandwich_norms: bool = False
    # What multiplies QKᵀ; None: 1/√head_dim (Gemma: query_pre_attn_scalar^-1/2).
    attention_scale: float | None = None
    # Soft caps: logits -> cap · tanh(logits / cap), for attention (before the mask) and for
    # the output logits (Gemma 2). None: no cap.
    attention_softcap: float | None = None
    logits_softcap: float | None = None

    def __post_init__(self):
        problems = _type_problems(self)
        if problems:  # the range checks below assume the types
            raise ValueError("invalid TransformerConfig: " + "; ".join(problems))
        for name in ("vocab_size", "d_model", "num_heads", "d_ff", "num_decoder_layers", "max_len",
                     "attention_block"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_encoder_layers < 0:
            problems.append(f"num_encoder_layers={self.num_encoder_layers} must be >= 0")
        if self.head_dim is None:
            if self.num_heads >= 1 and self.d_model % self.num_heads:
                problems.append(f"num_heads={self.num_heads} does not divide "
                                f"d_model={self.d_model} (or give head_dim)")
        elif self.head_dim < 1:
            problems.append(f"head_dim={self.head_dim} must be >= 1")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window={self.sliding_window} must be >= 1 or None")
        problems += _layer_kind_problems(self)
        kv = self.num_kv_heads
        if kv is not None and (kv < 1 or (self.num_heads >= 1 and self.num_heads % kv)):
            problems.append(f"num_kv_heads={kv} must be >= 1 and divide num_heads={self.num_heads}")
        if self.positional_encoding == "rope" and self.num_heads >= 1:
            head_dim = _given_head_dim(self)
            if head_dim % 2:
                problems.append(f"rope needs an even head_dim, got {head_dim}")
        problems += _rotary_dim_problems(self)
        problems += _rope_scaling_problems(self)
        if self.cache_dtype is not None and self.cache_dtype not in CACHE_DTYPES:
            problems.append(f"cache_dtype={self.cache_dtype!r} is not None or one of "
                            f"{CACHE_DTYPES}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.vocab_size >= 1 and not 0 <= self.bos_id < self.vocab_size:
            problems.append(f"bos_id={self.bos_id} is outside the vocabulary [0, "
                            f"{self.vocab_size})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        for name in ("rope_base", "layer_norm_eps", "rope_scaling_factor", *_OPTIONAL_REALS):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                problems.append(f"{name}={value} must be > 0 and finite")
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
    def is_encoder_decoder(self) -> bool:
        return self.num_encoder_layers > 0

    def is_local_layer(self, number: int) -> bool:
        """Whether decoder layer `number` (0-based) attends over a sliding window."""
        return self.sliding_window is not None and number not in self.full_attention_layers

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
        """Every field, less the imported-architecture options and `cache_dtype` at their
        defaults."""
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

_INT_FIELDS = ("vocab_size", "d_model", "num_heads", "d_ff", "num_decoder_layers",
               "num_encoder_layers", "max_len", "bos_id", "attention_block",
               "rope_original_max_len")
_REAL_FIELDS = ("dropout", "rope_base", "layer_norm_eps", "rope_scaling_factor",
                "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
                "rope_beta_slow")
_BOOL_FIELDS = ("tie_embeddings", "scan_layers", "remat", "qkv_bias", "out_bias", "ffn_bias",
                "scale_embeddings", "logits_bias", "qk_norm", "norm_unit_offset",
                "sandwich_norms", "rope_truncate")
_OPTIONAL_REALS = ("local_rope_base", "attention_scale", "attention_softcap", "logits_softcap",
                   "rope_attention_factor")
_CHOICES = {"positional_encoding": POSITIONAL_ENCODINGS, "norm": NORM_PLACEMENTS,
            "activation": ACTIVATIONS, "dtype": DTYPES, "param_dtype": DTYPES,
            "norm_type": NORM_TYPES, "sinusoid_layout": SINUSOID_LAYOUTS,
            "rope_scaling": ROPE_SCALINGS}
# The options written to config.json only when set (see `to_dict`): the imported
# architectures' and the cache dtype; head_dim is left out
# when it is d_model // num_heads.
_OPTION_DEFAULTS = {name: getattr(TransformerConfig, name) for name in (
    "qkv_bias", "out_bias", "ffn_bias", "norm_type", "scale_embeddings", "logits_bias",
    "sinusoid_layout", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor",
    "rope_high_freq_factor", "rope_original_max_len", "rope_beta_fast", "rope_beta_slow",
    "rope_truncate", "rope_attention_factor", "rope_short_factors", "rope_long_factors",
    "rotary_dim", "cache_dtype", "qk_norm",
    "sliding_window", "full_attention_layers", "local_rope_base", "norm_unit_offset",
    "sandwich_norms", "attention_scale", "attention_softcap", "logits_softcap", "remat")}


def _layer_kind_problems(config: TransformerConfig) -> list[str]:
    """What is wrong with the per-layer attention options and the norms Gemma needs."""
    problems = []
    layers = config.full_attention_layers
    if layers:
        if config.sliding_window is None:
            problems.append(f"full_attention_layers={list(layers)} needs a sliding_window")
        if list(layers) != sorted(set(layers)) or not all(
                0 <= i < config.num_decoder_layers for i in layers):
            problems.append(f"full_attention_layers={list(layers)} must be distinct layer "
                            f"numbers in [0, {config.num_decoder_layers}), in order")
    if config.local_rope_base is not None and (config.sliding_window is None
                                               or config.positional_encoding != "rope"):
        problems.append(f"local_rope_base={config.local_rope_base} needs rope and a "
                        "sliding_window")
    if config.norm_unit_offset and config.norm_type != "rmsnorm":
        problems.append("norm_unit_offset needs norm_type='rmsnorm'")
    if config.sandwich_norms and config.norm != "pre":
        problems.append("sandwich_norms needs norm='pre'")
    return problems


def _rope_scaling_problems(config: TransformerConfig) -> list[str]:
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
        name = ("rope_long_factors" if config.max_len > config.rope_original_max_len
                else "rope_short_factors")  # the ones `rope_frequencies` turns with
        factors = getattr(config, name)
        pairs = (config.rotary_dim or _given_head_dim(config)) // 2
        if len(factors) != pairs or not all(0 < f < math.inf for f in factors):
            problems.append(f"longrope with max_len={config.max_len} (original length "
                            f"{config.rope_original_max_len}) needs {pairs} {name} > 0, one "
                            f"per dimension pair RoPE turns; got {list(factors)}")
    if config.rope_scaling in ("llama3", "yarn", "longrope") and config.rope_original_max_len < 1:
        problems.append(f"rope_original_max_len={config.rope_original_max_len} must be >= 1")
    return problems


def _given_head_dim(config: TransformerConfig) -> int:
    """The head dimension while the config is being checked, before `head_dim` is set."""
    return config.head_dim or config.d_model // max(config.num_heads, 1)


def _rotary_dim_problems(config: TransformerConfig) -> list[str]:
    dims = config.rotary_dim
    if dims is None:
        return []
    head_dim = _given_head_dim(config)
    problems = [] if config.positional_encoding == "rope" else [
        f"rotary_dim={dims} needs positional_encoding='rope'"]
    if dims % 2 or not 2 <= dims <= head_dim:
        problems.append(f"rotary_dim={dims} must be even and in [2, head_dim={head_dim}]")
    return problems


def _type_problems(config: TransformerConfig) -> list[str]:
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
    for name in ("num_kv_heads", "head_dim", "sliding_window", "rotary_dim"):
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
    layers = config.full_attention_layers
    if isinstance(layers, tuple | list) and all(
            isinstance(i, int | np.integer) and not isinstance(i, bool) for i in layers):
        object.__setattr__(config, "full_attention_layers", tuple(int(i) for i in layers))
    else:
        problems.append(f"full_attention_layers={layers!r} must be a list of ints")
    for name in _BOOL_FIELDS:
        value = getattr(config, name)
        if not isinstance(value, bool | np.bool_):
            problems.append(f"{name}={value!r} must be True or False")
        else:
            object.__setattr__(config, name, bool(value))
    for name in _CHOICES:
        if not isinstance(getattr(config, name), str):
            problems.append(f"{name}={getattr(config, name)!r} must be a string")
    if config.cache_dtype is not None and not isinstance(config.cache_dtype, str):
        problems.append(f"cache_dtype={config.cache_dtype!r} must be a string or None")
    return problems


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
