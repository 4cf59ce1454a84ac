"""Rematerialized layers (`TrainConfig.remat`, `TransformerConfig.remat`): the same step as
without, holding less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M
from kvjax.train import update
from kvjax.train.config import TrainConfig

# Both layer layouts and both variants (the step below is the scanned decoder-only one); the
# unrolled one a mixture of experts after a dense first layer, whose kind a rematerialized
# layer must know while it is traced (DeepSeek's, GLM-4.5's).
VARIANTS = {
    "decoder-only, unrolled, experts after a dense layer": dict(
        scan_layers=False, num_experts=4, experts_per_token=2, dense_ffn_layers=(0,),
        dense_d_ff=48),
    "encoder-decoder, scanned": dict(scan_layers=True, num_encoder_layers=2),
}


def make_batch(config, rows=4, length=24):
    rng = np.random.default_rng(0)
    batch = {name: rng.integers(3, config.vocab_size, (rows, length)).astype(np.int32)
             for name in ("inputs", "targets")}
    if config.is_encoder_decoder:
        batch["source"] = rng.integers(3, config.vocab_size, (rows, length - 5)).astype(np.int32)
    return batch


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_remat_gives_the_same_loss_and_gradients_dropout_included(variant):
    # Dropout on: the recomputed forward pass must draw the masks the first one drew.
    config = M.preset("tiny", num_decoder_layers=3, dropout=0.2, **VARIANTS[variant])
    params, batch = M.init_params(config, jax.random.key(0)), make_batch(config)

    @jax.jit
    def loss_and_grads(params, remat_params):
        def loss(p, c):
            logits = M.teacher_forced_logits(c, p, batch, jax.random.key(1))
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
                logits, batch["targets"][..., None], -1)[..., 0])
        return (jax.value_and_grad(loss)(params, config),
                jax.value_and_grad(loss)(remat_params, config.replace(remat=True)))

    plain, remat = loss_and_grads(params, params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(plain), jax.tree.leaves(remat),
                            strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_the_loss_in_parts_equals_the_loss_of_all_logits(monkeypatch):
    """Parts of 7 tokens over 2 x 24 (the last part padded with weight-0 tokens), some
    targets weighted 0, label smoothing on: the sums and their gradients are those of the
    whole logits'."""
    label_smoothing = 0.1
    config = M.preset("tiny", num_encoder_layers=1)
    monkeypatch.setattr(update, "LOSS_PART_BYTES", 7 * 4 * config.vocab_size)
    params, batch = M.init_params(config, jax.random.key(0)), make_batch(config, rows=2)
    weights = np.ones((2, 24), np.float32)
    weights[1, 15:] = 0

    @jax.jit
    def both(params):
        def whole(p):
            logits = M.teacher_forced_logits(config, p, batch)
            return update.cross_entropy_sum(logits, batch["targets"], weights, label_smoothing)

        def in_parts(p):
            hidden = M.teacher_forced_hidden(config, p, batch)
            return update.chunked_cross_entropy_sum(config, p, hidden, batch["targets"],
                                                    weights, label_smoothing)
        return [(fn(params), jax.grad(lambda p, fn=fn: fn(p)[0])(params))
                for fn in (whole, in_parts)]

    (whole_sums, whole_grads), (part_sums, part_grads) = both(params)
    np.testing.assert_allclose(part_sums, whole_sums, rtol=1e-6)
    assert float(part_sums[1]) == 2 * 24 - 9
    for a, b in zip(jax.tree.leaves(whole_grads), jax.tree.leaves(part_grads), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-7)


def test_a_remat_training_step_holds_fewer_bytes_and_computes_the_same_loss():
    """XLA's own count of the compiled step's temporaries: without remat every layer's
    activations and all the logits wait for the backward pass, with it only each layer's
    input."""
    config = M.preset("tiny", num_decoder_layers=4, scan_layers=True)
    batch = make_batch(config, rows=8, length=64)
    temporaries, losses = [], []
    for remat in (False, True):
        settings = TrainConfig(steps=10, batch_size=8, warmup_steps=1, progress=False,
                               remat=remat)
        state = update.init_state(config, settings)
        compiled = update._compiled_step(False, jax.default_backend()).lower(
            config, update.compiled_fields(settings), state, batch, None).compile()
        temporaries.append(compiled.memory_analysis().temp_size_in_bytes)
        losses.append(float(compiled(state, batch, None)[1]))
    assert temporaries[1] < 0.8 * temporaries[0], temporaries
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


def test_remat_sets_how_a_model_runs_not_what_it_is():
    """A checkpoint trained with it fine-tunes and resumes without it (and the other way):
    it is a speed-only field, and config.json holds it only when set."""
    config = M.preset("tiny")
    assert "remat" in M.SPEED_ONLY_FIELDS
    assert "remat" not in config.to_dict()
    assert M.TransformerConfig.from_json(config.replace(remat=True).to_json()).remat
    with pytest.raises(ValueError, match="remat='yes' must be a bool"):
        TrainConfig(remat="yes")
    with pytest.raises(ValueError, match="remat"):
        config.replace(remat=1)
