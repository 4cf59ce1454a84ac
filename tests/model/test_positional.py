"""model/positional.py: sinusoidal encodings in their three layouts, RoPE's rotation (of whole heads
or their leading dimensions) and Llama 3's, YaRN's and LongRoPE's frequency scaling, each
against a plain evaluation of its formula or published rule."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M
from kvjax.model.positional import (
    apply_rope,
    rope_attention_factor,
    rope_frequencies,
    sinusoidal,
)


@pytest.mark.parametrize("width", [8, 9])
def test_sinusoid_halves_hold_every_sine_then_every_cosine(width):
    positions = np.arange(6)
    got = np.asarray(sinusoidal(jnp.asarray(positions)[None], width, "halves"))[0]
    sines = [[math.sin(p / 10000 ** (2 * i / width)) for i in range((width + 1) // 2)]
             for p in positions]
    cosines = [[math.cos(p / 10000 ** (2 * i / width)) for i in range(width // 2)]
               for p in positions]
    np.testing.assert_allclose(got, np.concatenate([sines, cosines], axis=1), atol=1e-6)
    interleaved = np.asarray(sinusoidal(jnp.asarray(positions)[None], width))[0]
    np.testing.assert_allclose(interleaved[:, 0:width - 1:2], got[:, :width // 2], atol=1e-6)


@pytest.mark.parametrize("width", [8, 9])
def test_fairseq_sinusoids_are_the_table_m2m100_builds(width):
    """transformers' M2M100SinusoidalPositionalEmbedding.get_embedding in NumPy (float32,
    as torch computes it): D/2 frequencies 10000^(-i / (D/2 - 1)), every sine then every
    cosine, an odd width's last column zero; read at a position plus the offset."""
    half = width // 2
    step = np.float32(math.log(10000) / (half - 1))
    frequencies = np.exp(np.arange(half, dtype=np.float32) * -step)
    rows = np.arange(40, dtype=np.float32)[:, None] * frequencies[None]
    table = np.concatenate([np.sin(rows), np.cos(rows), np.zeros((40, width % 2))], axis=1)
    positions = np.array([[0, 1, 5, 37]])
    got = np.asarray(sinusoidal(jnp.asarray(positions + 2), width, "fairseq"))[0]
    np.testing.assert_allclose(got, table[positions[0] + 2], atol=1e-6)


def _llama3_frequencies(base, head_dim, factor, low, high, original):
    """Llama 3.1's published rule, one frequency at a time."""
    result = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            result.append(freq)
        elif wavelength > original / low:
            result.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            result.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(result)


def test_llama3_scaling_is_the_published_rule():
    config = M.preset("tiny", positional_encoding="rope", head_dim=16, rope_base=500000.0,
                      rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_len=64)
    want = _llama3_frequencies(500000.0, 16, 8.0, 1.0, 4.0, 64)
    np.testing.assert_allclose(rope_frequencies(config), want, rtol=1e-12)
    plain = rope_frequencies(config.replace(rope_scaling="none"))
    assert (want == plain).any() and (want == plain / 8).any()  # each branch taken
    assert ((want != plain) & (want != plain / 8)).any()
    linear = rope_frequencies(config.replace(rope_scaling="linear"))
    np.testing.assert_allclose(linear, plain / 8, rtol=1e-12)


def test_yarn_keeps_the_fast_pairs_divides_the_slow_and_blends_between():
    # Pair i is where 16 · ln(32 / (r · 2π)) / (2 · ln 10⁴) = i for r rotations over the 32
    # original positions: -0.995 for beta_fast 16 (below 0: from pair 0), 2.016 for
    # beta_slow 0.5, rounded out to 3: pair 0 kept, 1 and 2 blended, 3 on divided by 4.
    config = M.preset("tiny", positional_encoding="rope", head_dim=16, rope_scaling="yarn",
                      rope_scaling_factor=4.0, rope_original_max_len=32, rope_beta_fast=16.0,
                      rope_beta_slow=0.5)
    plain = rope_frequencies(config.replace(rope_scaling="none"))
    divided = np.array([0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(rope_frequencies(config),
                               plain * (1 - divided) + plain / 4 * divided, rtol=1e-12)
    unrounded = np.clip(np.arange(8) / 2.016, 0, 1)  # from pair 0 to pair 2.016
    np.testing.assert_allclose(rope_frequencies(config.replace(rope_truncate=False)),
                               plain * (1 - unrounded) + plain / 4 * unrounded, rtol=1e-3)
    assert rope_attention_factor(config) == pytest.approx(1 + 0.1 * math.log(4))
    assert rope_attention_factor(config.replace(rope_attention_factor=1.5)) == 1.5
    assert rope_attention_factor(config.replace(rope_scaling="linear")) == 1.0


def test_longrope_divides_each_pair_by_its_short_factor():
    config = M.preset("tiny", positional_encoding="rope", rope_scaling="longrope",
                      rope_scaling_factor=32.0, rope_original_max_len=64,
                      rope_short_factors=(1.0, 1.5, 2.0, 4.0))
    plain = rope_frequencies(config.replace(rope_scaling="none"))
    np.testing.assert_allclose(rope_frequencies(config), plain / [1.0, 1.5, 2.0, 4.0],
                               rtol=1e-12)
    assert rope_attention_factor(config) == pytest.approx(
        math.sqrt(1 + math.log(32) / math.log(64)))
    partial = config.replace(rotary_dim=4, rope_short_factors=(1.0, 3.0))
    np.testing.assert_allclose(rope_frequencies(partial), [1.0, 1 / (3.0 * 100.0)],
                               rtol=1e-12)  # base^(-2i/4) over the 4 turned dimensions


def test_longrope_past_its_original_length_turns_with_the_long_factors():
    """A model set up for more than the original length turns every position with the long
    factors; the attention factor stays the one of the whole stretch."""
    short = M.preset("tiny", positional_encoding="rope", rope_scaling="longrope",
                     rope_scaling_factor=32.0, rope_original_max_len=64, max_len=64,
                     rope_short_factors=(1.0, 1.5, 2.0, 4.0),
                     rope_long_factors=(2.0, 3.0, 8.0, 16.0))
    plain = rope_frequencies(short.replace(rope_scaling="none"))
    np.testing.assert_allclose(rope_frequencies(short), plain / [1.0, 1.5, 2.0, 4.0],
                               rtol=1e-12)
    long = short.replace(max_len=65)
    np.testing.assert_allclose(rope_frequencies(long), plain / [2.0, 3.0, 8.0, 16.0],
                               rtol=1e-12)
    assert rope_attention_factor(long) == rope_attention_factor(short)


def test_rope_turns_only_the_leading_dimensions_it_has_frequencies_for():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 3, 2, 8)).astype(np.float32)
    positions = jnp.asarray([[0, 3, 7]])
    inv_freq = np.array([1.0, 0.25])
    got = np.asarray(apply_rope(jnp.asarray(x), positions, inv_freq, 1.5))
    want = np.asarray(apply_rope(jnp.asarray(x[..., :4]), positions, inv_freq, 1.5))
    np.testing.assert_array_equal(got[..., :4], want)
    np.testing.assert_array_equal(got[..., 4:], x[..., 4:])


def test_rope_rotates_halves_by_position_times_frequency():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 3, 2, 8)).astype(np.float32)
    inv_freq = np.array([1.0, 0.5, 0.25, 0.125])
    positions = np.array([[0, 3, 7]])
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq))
    angle = positions[0][:, None, None] * inv_freq  # [T, 1, H/2]
    x1, x2 = x[0, ..., :4], x[0, ..., 4:]
    want = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)
    np.testing.assert_allclose(got[0], want, atol=1e-6)
    scaled = apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq, 1.5)
    np.testing.assert_allclose(np.asarray(scaled), 1.5 * got, rtol=1e-6)
