"""model/interface.py: the model as generation and training see it, the same for both
variants: where a target starts, and one compiled initialisation for configs that draw the
same params."""

import jax
import jax.numpy as jnp

from kvjax import model as M
from kvjax.model import interface


def test_the_interface_says_where_a_target_starts():
    prompts, lengths = jnp.asarray([[5, 6, 7], [8, 0, 0]]), jnp.asarray([3, 1])
    lm, translator = M.preset("tiny"), M.preset("tiny", num_encoder_layers=1, bos_id=3)
    assert not M.prompt_is_source(lm) and M.prompt_is_source(translator)
    tokens, starts = M.target_start(lm, prompts, lengths)
    assert tokens is prompts and starts is lengths
    tokens, starts = M.target_start(translator, prompts, lengths)
    assert tokens.tolist() == [[3], [3]] and starts.tolist() == [1, 1]
    assert [M.prompt_slots(c, 3) for c in (lm, translator)] == [3, 1]


def test_fields_that_draw_no_params_share_one_compiled_initialisation():
    """Configs that differ only in how the model computes (not which params it has) get the
    params their own initialisation draws, from one compiled program."""
    base = M.preset("tiny", num_encoder_layers=1, positional_encoding="rope", num_kv_heads=2)
    other = base.replace(
        attention_block=4, dropout=0.1, dtype="bfloat16", cache_dtype="int8", bos_id=3,
        layer_norm_eps=1e-5, rope_base=500.0, rope_scaling="linear", rope_scaling_factor=2.0,
        rope_low_freq_factor=2.0, rope_high_freq_factor=8.0, rope_original_max_len=32,
        sliding_window=8, full_attention_layers=(1,), local_rope_base=100.0,
        attention_scale=0.3, attention_softcap=20.0, logits_softcap=30.0, remat=True,
        sinusoid_layout="halves", rope_beta_fast=16.0, rope_beta_slow=2.0, rope_truncate=False,
        rope_attention_factor=1.2, rope_short_factors=(1.0, 2.0), rope_long_factors=(3.0, 4.0),
        rotary_dim=4, unrotated_layers=(1,), embedding_multiplier=2.0, residual_multiplier=0.5,
        logits_scaling=3.0, query_scale_beta=0.1, query_scale_length=8, qkv_clip=2.0)
    # The sinusoids' offset is set only where the sinusoids are: checked beside the others.
    sinusoids = base.replace(positional_encoding="sinusoidal")
    offset = sinusoids.replace(sinusoid_offset=2, sinusoid_layout="fairseq")
    assert {name for name in interface._NOT_IN_INIT if getattr(other, name) ==
            getattr(base, name)} == {"sinusoid_offset"} != {
        name for name in interface._NOT_IN_INIT if getattr(offset, name) ==
        getattr(sinusoids, name)}
    rng = jax.random.key(3)
    before = interface._init_params._cache_size()
    shared = M.init_params(other, rng)
    assert interface._init_params._cache_size() - before <= 1
    M.init_params(base, rng)
    assert interface._init_params._cache_size() - before <= 1
    M.init_params(sinusoids, rng)
    programs = interface._init_params._cache_size()
    M.init_params(offset, rng)
    assert interface._init_params._cache_size() == programs
    own = interface._init_params(other, rng)  # drawn by the config's own program
    assert jax.tree.structure(own) == jax.tree.structure(shared)
    for mine, theirs in zip(jax.tree.leaves(own), jax.tree.leaves(shared), strict=True):
        assert mine.dtype == theirs.dtype
        assert jnp.array_equal(mine, theirs)
