"""The fused attention kernel (cuDNN's, on NVIDIA GPUs) takes a description of the mask in
place of the mask. Here: on every backend, the descriptions the model passes say exactly what
its masks say, and deterministic training leaves the kernel out; on an NVIDIA GPU, the kernel
computes what XLA's attention does and zeroes rows with no key without a NaN in the
gradients, and bfloat16 training is bit-identical with deterministic ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_tokens

from kvjax import model as M
from kvjax.model import attention as A
from kvjax.model import fused_attention as F
from kvjax.train import update
from kvjax.train.config import TrainConfig


def _described_mask(key_lengths_B, causal, num_queries, num_keys, window=None):
    slots_S = jnp.arange(num_keys)
    mask_BTS = jnp.broadcast_to(slots_S[None, None, :] < key_lengths_B[:, None, None],
                                (key_lengths_B.shape[0], num_queries, num_keys))
    queries_T1 = jnp.arange(num_queries)[None, :, None]
    if causal:
        mask_BTS &= slots_S[None, None, :] <= queries_T1
    if window is not None:
        mask_BTS &= slots_S[None, None, :] > queries_T1 - window
    return mask_BTS


@pytest.mark.parametrize("encoder_layers", [0, 2], ids=["decoder_only", "encoder_decoder"])
def test_the_masks_described_to_a_fused_kernel_are_the_models_masks(monkeypatch,
                                                                    encoder_layers):
    """With the fused route taken on any backend by a stand-in that builds its mask from the
    description alone, a training forward and a prefill give the logits of XLA's route."""
    config = M.preset("tiny", num_encoder_layers=encoder_layers, positional_encoding="rope",
                      num_kv_heads=2)
    net, params = M.build_model(config), M.init_params(config, jax.random.key(1))
    tokens = random_tokens(0, (3, 10), config.vocab_size)
    lengths = jnp.asarray([10, 4, 0 if encoder_layers else 1], jnp.int32)
    batch = {"inputs": tokens, "lengths": lengths}
    if encoder_layers:
        batch |= {"source": random_tokens(1, (3, 7), config.vocab_size),
                  "source_lengths": jnp.asarray([7, 2, 5], jnp.int32)}

    def forward(params):
        logits = M.teacher_forced_logits(config, params, batch)
        if encoder_layers:
            cache = net.apply({"params": params}, batch["source"], batch["source_lengths"], 16,
                              method=net.prefill)[1]
            first = net.apply({"params": params}, tokens, cache, lengths, method=net.step)[0]
        else:
            first = net.apply({"params": params}, tokens, lengths, 16, method=net.prefill)[0]
        return logits, first

    # A function of its own per run: jax caches a trace by the function traced, and the
    # second run must be traced with the stand-in in place.
    expected = jax.jit(lambda p: forward(p))(params)
    described = []

    def from_description(q, k, v, key_lengths_B, causal, scale, window=None):
        assert window is None
        described.append(causal)
        mask = _described_mask(key_lengths_B, causal, q.shape[1], k.shape[1])
        return A.attend(q, k, v, mask, scale)

    monkeypatch.setattr(A, "fused_attention_applies", lambda *args: True)
    monkeypatch.setattr(A, "attend_fused", from_description)
    got = jax.jit(lambda p: forward(p))(params)
    # Encoder layers and cross-attention (not causal) and decoder layers (causal) all took
    # the fused route; the encoder-decoder's cached step reads the cache, which no fused
    # kernel does.
    assert set(described) == ({False, True} if encoder_layers else {True})
    if encoder_layers:  # the encoder twice (training, prefill), cross-attention in training
        assert described.count(False) == 2 * encoder_layers + config.num_decoder_layers
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))


@pytest.mark.parametrize("scan_layers, full_layers, windows", [
    (False, (1,), {3, None}), (True, (), {3}), (True, (1,), set())],
    ids=["unrolled-local-and-global", "scanned-all-local", "scanned-local-and-global"])
def test_sliding_windows_are_described_where_each_layers_kind_is_known(
        monkeypatch, scan_layers, full_layers, windows):
    """A stand-in for the fused route builds its mask from the description alone: where a
    layer's kind is known while tracing, local layers describe their window and global ones
    none, and the logits equal XLA's route; a scanned stack of both kinds describes nothing
    (a layer's kind is traced there)."""
    config = M.preset("tiny", positional_encoding="rope", sliding_window=3,
                      full_attention_layers=full_layers, scan_layers=scan_layers)
    params = M.init_params(config, jax.random.key(1))
    batch = {"inputs": random_tokens(0, (2, 8), 64), "lengths": jnp.asarray([8, 5], jnp.int32)}
    forward = functools.partial(M.teacher_forced_logits, config)
    expected = jax.jit(lambda p: forward(p, batch))(params)
    described = []

    def from_description(q, k, v, key_lengths_B, causal, scale, window=None):
        described.append(window)
        mask = _described_mask(key_lengths_B, causal, q.shape[1], k.shape[1], window)
        return A.attend(q, k, v, mask, scale)

    monkeypatch.setattr(A, "fused_attention_applies", lambda *args: True)
    monkeypatch.setattr(A, "attend_fused", from_description)
    got = jax.jit(lambda p: forward(p, batch))(params)
    assert set(described) == windows  # (a scanned body may be traced more than once)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


needs_fused = pytest.mark.skipif(
    not F.fused_attention_applies(*[jnp.zeros((1, 1, 1, 64), jnp.bfloat16)] * 3, None),
    reason="cuDNN's fused attention runs on NVIDIA GPUs only")


def test_a_described_window_is_the_window_jax_is_asked_for():
    """The description's window as jax's `local_window_size`, run by jax's own XLA route on
    every backend: the same mask as the model's."""
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, 9, 4, 8))
    k, v = (jax.random.normal(key, (2, 9, 2, 8)) for key in keys[1:])
    lengths = jnp.asarray([9, 6], jnp.int32)
    got = jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                       local_window_size=F._left_window(4),
                                       implementation="xla")
    want = A.attend(q, k, v, _described_mask(lengths, True, 9, 9, window=4))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


@needs_fused
@pytest.mark.parametrize("causal, queries, window", [
    (True, 40, None), (False, 40, None), (False, 24, None), (True, 40, 16)],
    ids=["causal", "padding", "cross", "window"])
def test_fused_attention_equals_xlas_and_zeroes_rows_without_keys(causal, queries, window):
    batch, length, heads, kv_heads, head_dim = 3, 40, 8, 2, 64
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, queries, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, length, kv_heads, head_dim), jnp.bfloat16)
            for key in keys[1:3])
    lengths = jnp.asarray([length, 17, 0], jnp.int32)
    mask = _described_mask(lengths, causal, queries, length, window)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)

    def loss(q, k, v, fused):
        out = A.attend(q, k, v, mask, key_lengths_B=lengths if fused else None, causal=causal,
                       window=window if fused else None)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    (fused_out, fused_grads), (xla_out, xla_grads) = (
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, fused)
        for fused in (True, False))
    np.testing.assert_allclose(float(fused_out), float(xla_out), rtol=2e-2)
    out = A.attend(q, k, v, mask, key_lengths_B=lengths, causal=causal, window=window)
    want = A.attend(q, k, v, mask)
    assert not np.any(np.asarray(out[2]))  # the row with no key
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=3e-2, rtol=3e-2)
    for fused_grad, xla_grad in zip(fused_grads, xla_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(fused_grad, np.float32)))
        np.testing.assert_allclose(np.asarray(fused_grad, np.float32),
                                   np.asarray(xla_grad, np.float32), atol=0.15, rtol=5e-2)


def test_deterministic_training_runs_xlas_attention(monkeypatch):
    """The fused route is taken by a training step, but not by a deterministic one."""
    config = M.preset("tiny", positional_encoding="rope")
    fused = []
    monkeypatch.setattr(A, "attend_fused", lambda q, *args: fused.append(1) or q)
    monkeypatch.setattr(F, "on_cuda", lambda: True)
    tokens = np.asarray(random_tokens(3, (2, 9), config.vocab_size))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    for deterministic, calls in ((True, 0), (False, config.num_decoder_layers)):
        train_config = update.compiled_fields(TrainConfig(
            steps=10, batch_size=2, warmup_steps=1, deterministic=deterministic))
        state = update.init_state(config, train_config)
        fused.clear()
        jax.jit(update._train_step, static_argnums=(0, 1)).lower(
            config.replace(dtype="bfloat16"), train_config, state, batch)
        assert len(fused) == calls, deterministic


@needs_fused
def test_bfloat16_training_is_bit_identical_when_deterministic():
    config = M.preset("tiny", num_heads=2, d_model=128, dtype="bfloat16")
    train_config = TrainConfig(steps=10, batch_size=4, warmup_steps=1, progress=False,
                               deterministic=True)
    tokens = np.asarray(random_tokens(3, (4, 33), config.vocab_size))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    step_config = update.compiled_fields(train_config)
    runs = []
    for _ in range(2):
        state, losses = update.init_state(config, train_config), []
        for _ in range(3):
            state, loss = update.train_step(config, step_config, state, batch)
            losses.append(float(loss))
        runs.append((losses, jax.tree.map(np.asarray, state.params)))
    assert runs[0][0] == runs[1][0]
    jax.tree.map(np.testing.assert_array_equal, runs[0][1], runs[1][1])


@needs_fused
@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_bfloat16_training_steps_through_the_fused_kernel_follow_xlas(scan_layers):
    """Three AdamW steps of a bfloat16 model, with the fused kernel and with XLA's attention
    (`xla_attention_only`): the losses agree to bfloat16's precision."""
    config = M.preset("tiny", num_heads=2, d_model=128, dtype="bfloat16",
                      scan_layers=scan_layers)
    train_config = update.compiled_fields(TrainConfig(steps=10, batch_size=4, warmup_steps=1))
    tokens = np.asarray(random_tokens(3, (4, 33), config.vocab_size))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    runs = []
    for fused in (True, False):
        # A function of its own per run: jax caches a trace by the function traced.
        step = jax.jit(lambda *args: update._train_step(*args), static_argnums=(0, 1))
        state, losses = update.init_state(config, train_config), []
        for _ in range(3):
            if fused:
                state, loss = step(config, train_config, state, batch)
            else:
                with F.xla_attention_only():
                    state, loss = step(config, train_config, state, batch)
            losses.append(float(loss))
        runs.append(losses)
    np.testing.assert_allclose(runs[0], runs[1], rtol=2e-2)
