"""Config validation, presets and the options imported architectures need (none changes a
config written before it existed)."""

import json

import jax
import pytest

from kvjax import model as M


@pytest.mark.parametrize("changes,message", [
    (dict(d_model=30, num_heads=4), "num_heads=4 does not divide d_model=30"),
    (dict(num_kv_heads=3), "num_kv_heads=3 must be >= 1 and divide num_heads=4"),
    (dict(num_kv_heads=0), "num_kv_heads=0"),
    (dict(positional_encoding="xpos"), "positional_encoding='xpos'"),
    (dict(positional_encoding="alibi", num_encoder_layers=2),
     "positional_encoding='alibi' is a decoder's"),
    (dict(norm="middle"), "norm='middle'"),
    (dict(qk_norm_across_heads=True), "qk_norm_across_heads needs qk_norm"),
    (dict(parallel_residual=True), "parallel_residual needs norm='pre'"),
    (dict(shared_norm=True), "shared_norm needs parallel_residual"),
    (dict(qkv_clip=1.0, qk_norm=True, qk_norm_after_rope=True),
     "qkv_clip clips queries and keys before RoPE, which qk_norm_after_rope normalises after"),
    (dict(parallel_residual=True, norm="pre", num_encoder_layers=2),
     "parallel_residual needs norm='pre', no sandwich_norms and a decoder-only model"),
    (dict(activation="tanh"), "activation='tanh'"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(dropout=1.0), "dropout=1.0"),
    (dict(num_decoder_layers=0), "num_decoder_layers=0"),
    (dict(d_model=36, num_heads=4, positional_encoding="rope"), "rope needs an even head_dim"),
])
def test_invalid_configs_raise_naming_the_problem(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        M.preset("tiny", **changes)


def test_unknown_preset_raises():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        M.preset("huge")


def test_gpt_mini_preset_has_benchmark_sizes():
    c = M.preset("gpt-mini")
    assert (c.num_decoder_layers, c.d_model, c.num_heads, c.d_ff, c.vocab_size, c.max_len) == (
        6, 384, 6, 1536, 4096, 1024)


def test_json_round_trip():
    c = M.preset("tiny", num_kv_heads=2, positional_encoding="rope", num_encoder_layers=1)
    assert M.TransformerConfig.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="unknown TransformerConfig fields: \\['colour'\\]"):
        M.TransformerConfig.from_dict({**c.to_dict(), "colour": "red"})


def test_capacity_beyond_max_len_raises():
    with pytest.raises(ValueError, match="capacity 65 exceeds the model's max_len 64"):
        M.init_cache(M.preset("tiny"), 1, 65)


@pytest.mark.parametrize("changes,message", [
    (dict(vocab_size=64.5), "vocab_size=64.5 must be an int"),
    (dict(d_model="128"), "d_model='128' must be an int"),
    (dict(num_heads=True), "num_heads=True must be an int"),
    (dict(num_kv_heads=2.0), "num_kv_heads=2.0 must be an int or None"),
    (dict(layer_norm_eps=-1), "layer_norm_eps=-1.0 must be > 0"),
    (dict(layer_norm_eps=float("nan")), "layer_norm_eps=nan must be > 0"),
    (dict(rope_base=0), "rope_base=0.0 must be > 0"),
    (dict(dropout="0.1"), "dropout='0.1' must be a real number"),
    (dict(tie_embeddings=1), "tie_embeddings=1 must be True or False"),
    (dict(scan_layers="yes"), "scan_layers='yes' must be True or False"),
    (dict(activation=["relu"]), "activation=\\['relu'\\] must be a string"),
    (dict(bos_id=None), "bos_id=None must be an int"),
])
def test_every_field_is_type_and_range_checked(changes, message):
    with pytest.raises(ValueError, match=message):
        M.preset("tiny", **changes)


def test_numpy_scalars_are_stored_as_python_numbers():
    import numpy as np
    config = M.preset("tiny", vocab_size=np.int64(80), dropout=np.float32(0.5), rope_base=10)
    assert type(config.vocab_size) is int and type(config.dropout) is float
    assert config == M.preset("tiny", vocab_size=80, dropout=0.5, rope_base=10.0)
    assert M.TransformerConfig.from_json(config.to_json()) == config


OPTION_FIELDS = ("head_dim", "qkv_bias", "out_bias", "ffn_bias", "norm_type",
                 "scale_embeddings", "logits_bias", "sinusoid_layout", "sinusoid_offset",
                 "rope_scaling",
                 "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_max_len", "rope_beta_fast", "rope_beta_slow", "rope_truncate",
                 "rope_attention_factor", "qk_norm", "qk_norm_across_heads", "sliding_window",
                 "parallel_residual", "shared_norm", "norm_params", "embedding_norm",
                 "qkv_clip")


def test_a_config_without_options_writes_what_it_wrote_before_them():
    written = M.preset("gpt-mini").to_dict()
    assert not set(OPTION_FIELDS) & set(written)
    assert M.TransformerConfig.from_dict(written) == M.preset("gpt-mini")


def test_options_round_trip_through_json():
    config = M.preset("tiny", head_dim=16, qkv_bias=True, norm_type="rmsnorm",
                      positional_encoding="rope", rope_scaling="llama3",
                      rope_scaling_factor=8.0, rope_original_max_len=32)
    written = json.loads(config.to_json())
    assert written["head_dim"] == 16 and written["rope_scaling"] == "llama3"
    assert M.TransformerConfig.from_json(config.to_json()) == config
    yarn = config.replace(rope_scaling="yarn", rope_beta_fast=16.0, rope_truncate=False,
                          rope_attention_factor=1.5)
    assert M.TransformerConfig.from_json(yarn.to_json()) == yarn
    longrope = config.replace(rope_scaling="longrope", rope_original_max_len=64, rotary_dim=12,
                              rope_short_factors=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5),
                              rope_long_factors=(2.0, 3, 4, 5, 6, 7), unrotated_layers=[1])
    assert M.TransformerConfig.from_json(longrope.to_json()) == longrope


def test_the_first_decoder_layers_keep_what_is_said_of_them():
    config = M.preset("tiny", num_decoder_layers=4, positional_encoding="rope", sliding_window=4,
                      full_attention_layers=(1, 3), unrotated_layers=(0, 2))
    assert config.first_decoder_layers(2) == config.replace(
        num_decoder_layers=2, full_attention_layers=(1,), unrotated_layers=(0,))
    assert config.first_decoder_layers(1).full_attention_layers == ()


def test_head_dim_follows_the_width_unless_given():
    config = M.preset("tiny")  # d_model 32, 4 heads
    assert config.head_dim == 8
    assert config.replace(d_model=64).head_dim == 16
    wide = config.replace(head_dim=24)
    assert wide.replace(d_model=64).head_dim == 24
    assert M.cache_size_bytes(wide, 1, 10).self_attention == 2 * 10 * 2 * 4 * 24 * 4
    params = jax.eval_shape(lambda: M.init_params(wide, jax.random.key(0)))
    assert params["layers"]["0"]["self_attention"]["qkv"]["kernel"].shape == (32, 12, 24)
    assert params["layers"]["0"]["self_attention"]["out"]["kernel"].shape == (4, 24, 32)


@pytest.mark.parametrize("options, message", [
    (dict(norm_type="batchnorm"), "norm_type='batchnorm' is not one of"),
    (dict(head_dim=0), "head_dim=0 must be >= 1"),
    (dict(num_heads=3), "num_heads=3 does not divide d_model=32 (or give head_dim)"),
    (dict(rope_scaling="llama3"), "needs positional_encoding='rope'"),
    (dict(positional_encoding="rope", rope_scaling="llama3", rope_low_freq_factor=4.0,
          rope_high_freq_factor=4.0), "rope_low_freq_factor (4.0) < rope_high_freq_factor"),
    (dict(positional_encoding="rope", rope_scaling="yarn", rope_beta_fast=1.0,
          rope_beta_slow=2.0), "needs 0 < rope_beta_slow (2.0) <= rope_beta_fast (1.0)"),
    (dict(positional_encoding="rope", rope_scaling="yarn", rope_scaling_factor=0.5),
     "yarn rope scaling needs rope_scaling_factor >= 1, got 0.5"),
    (dict(positional_encoding="rope", rope_scaling="yarn", rope_attention_factor=0.0),
     "rope_attention_factor=0.0 must be > 0 and finite"),
    (dict(positional_encoding="rope", rotary_dim=5), "rotary_dim=5 must be even and in [2, "
     "head_dim=8]"),
    (dict(rotary_dim=4), "rotary_dim=4 needs positional_encoding='rope'"),
    (dict(positional_encoding="rope", rope_scaling="longrope", rope_original_max_len=64,
          rope_short_factors=(1.0, 2.0)),
     "longrope with max_len=64 (original length 64) needs 4 rope_short_factors > 0"),
    (dict(positional_encoding="rope", rope_scaling="longrope", rope_original_max_len=32,
          rope_short_factors=(1.0,) * 4),
     "longrope with max_len=64 (original length 32) needs 4 rope_long_factors > 0, one per "
     "dimension pair RoPE turns; got []"),
    (dict(positional_encoding="rope", rope_scaling="longrope", rope_original_max_len=32,
          rope_long_factors=(1.0, 2.0, -1.0, 3.0)), "needs 4 rope_long_factors > 0"),
    (dict(rope_long_factors=(1.0, "2")), "rope_long_factors=(1.0, '2') must be a list of real"),
    (dict(unrotated_layers=(1,)), "unrotated_layers=[1] needs positional_encoding='rope'"),
    (dict(positional_encoding="rope", unrotated_layers=(2,)),
     "unrotated_layers=[2] must be distinct layer numbers in [0, 2), in order"),
    (dict(positional_encoding="rope", unrotated_layers=(1.0,)),
     "unrotated_layers=(1.0,) must be a list of ints"),
    (dict(residual_multiplier=0.0), "residual_multiplier=0.0 must be > 0 and finite"),
    (dict(logits_scaling=float("inf")), "logits_scaling=inf must be > 0 and finite"),
    (dict(embedding_multiplier="2"), "embedding_multiplier='2' must be a real number"),
    (dict(embedding_dim=0), "embedding_dim=0 must be >= 1 or None"),
    (dict(embedding_dim=2.5), "embedding_dim=2.5 must be an int or None"),
    (dict(sparsemixer_eps=0.01), "sparsemixer_eps needs a mixture of experts"),
    (dict(num_experts=4, experts_per_token=3, sparsemixer_eps=0.01),
     "sparsemixer_eps routes two experts a token, not experts_per_token=3 of num_experts=4"),
    (dict(num_experts=4, sparsemixer_eps=-1.0, normalize_expert_weights=False),
     "sparsemixer_eps=-1.0 must be >= 0 and finite"),
    (dict(num_experts=4, sparsemixer_eps=0.01), "normalize_expert_weights must be false"),
    (dict(sinusoid_layout="split"), "sinusoid_layout='split' is not one of"),
    (dict(sinusoid_offset=-1), "sinusoid_offset=-1 must be >= 0"),
    (dict(per_stack_embeddings=True, positional_encoding="learned"),
     "per_stack_embeddings gives an encoder and a decoder their own learned positions"),
    (dict(per_stack_embeddings=True, num_encoder_layers=1), "needs an encoder (num_encoder_"),
    (dict(positional_encoding="learned", sinusoid_offset=2),
     "sinusoid_offset=2 must be >= 0, and 0 unless positional_encoding is 'sinusoidal'"),
    (dict(sinusoid_offset=1.5), "sinusoid_offset=1.5 must be an int"),
    (dict(sinusoid_layout="fairseq", d_model=2, num_heads=1),
     "sinusoid_layout 'fairseq' needs d_model >= 4"),
    (dict(qkv_bias=1), "qkv_bias=1 must be True or False"),
    (dict(relative_bias_per_layer=True),
     "relative_bias_per_layer gives each layer a table of T5's relative position bias: it "
     "needs positional_encoding='relative', got 'sinusoidal'"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError) as error:
        M.preset("tiny", **options)
    assert message in str(error.value)


def test_a_head_dim_of_its_own_needs_no_divisible_width():
    assert M.preset("tiny", num_heads=3, head_dim=8).head_dim == 8
