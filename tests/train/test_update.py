"""train/update.py: the loss is the masked mean NumPy computes, the learning rate warms up then
decays, weight decay moves a scanned model as it moves the same model unrolled, a GPU's
step compiles with XLA's deterministic ops, and a mixture's load-balancing loss joins the loss
minimized, not the one reported."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M
from kvjax.tokenizer import PAD_ID
from kvjax.train import update
from kvjax.train.config import TrainConfig


def test_deterministic_steps_compile_with_xlas_deterministic_ops():
    """A GPU's step gets XLA's deterministic-ops option; this backend's XLA knows the option by
    that name (it refuses names it does not know), and a step compiled with it computes what
    the default step does. Other backends are deterministic without options."""
    options = update.DETERMINISTIC_COMPILER_OPTIONS["gpu"]
    assert update._compiled_step(True, "cpu") is update._compiled_step(True, "cpu")
    assert update._compiled_step(True, "cpu") is not update._compiled_step(True, "gpu")
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        jax.jit(jnp.sum, compiler_options={"xla_gpu_no_such_option": True})(jnp.ones(3))
    config = M.preset("tiny")
    train_config = TrainConfig(steps=10, batch_size=2, warmup_steps=1, progress=False)
    batch = {"inputs": np.full((2, 8), 5, np.int32), "targets": np.full((2, 8), 6, np.int32)}
    step_config = update.compiled_fields(train_config)
    losses = []
    for step in (update._compiled_step(True, "gpu"), update._compiled_step(False, "gpu")):
        state = update.init_state(config, train_config)
        losses.append(float(step(config, step_config, state, batch)[1]))
    assert options == {"xla_gpu_deterministic_ops": True}
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    with pytest.raises(ValueError, match="deterministic='yes' must be a bool"):
        TrainConfig(deterministic="yes")


def numpy_cross_entropy(logits, targets, mask, label_smoothing):
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    vocab = logits.shape[-1]
    wanted = (1 - label_smoothing) * np.eye(vocab)[targets] + label_smoothing / vocab
    per_token = -(wanted * log_probs).sum(-1)
    return per_token[mask].sum() / mask.sum()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_is_the_masked_mean(label_smoothing):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
    targets = rng.integers(1, 11, size=(3, 5))
    targets[0, 3:] = PAD_ID
    targets[2, 1:] = PAD_ID
    weights = (targets != PAD_ID).astype(np.float32)
    total, count = update.cross_entropy_sum(logits, targets, weights, label_smoothing)
    assert count == 9
    expected = numpy_cross_entropy(logits.astype(np.float64), targets, weights > 0,
                                   label_smoothing)
    np.testing.assert_allclose(total / count, expected, rtol=1e-5)
    logits[weights == 0] = 100.0  # what the model says at padding does not count
    assert update.cross_entropy_sum(logits, targets, weights, label_smoothing)[0] == (
        pytest.approx(total))


def test_learning_rate_warms_up_then_decays():
    config = TrainConfig(steps=100, learning_rate=1e-2, warmup_steps=10, final_lr_fraction=0.1)
    schedule = update.learning_rate_schedule(config)
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(5e-3)
    assert float(schedule(10)) == pytest.approx(1e-2)
    assert float(schedule(100)) == pytest.approx(1e-3)


def test_weight_decay_takes_the_same_step_for_scanned_and_unrolled_layers():
    """Stacked over scanned layers, biases and LayerNorm scales are [L, D]: chosen by rank
    they would be decayed there and not in the same model unrolled."""
    scanned = M.preset("tiny", num_encoder_layers=1, num_decoder_layers=2, scan_layers=True)
    unrolled = scanned.replace(scan_layers=False)
    params = M.init_params(scanned, jax.random.key(0))
    params = jax.tree.map(lambda p: p + 0.5, params)  # no param at zero: decay moves each
    optimizer = update.make_optimizer(TrainConfig(steps=10, warmup_steps=0, weight_decay=0.5))

    @jax.jit  # one program per tree structure, not one per eager op and leaf shape
    def one_step(p):  # with zero gradients, the update is the weight decay alone
        updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, p), optimizer.init(p), p)
        return updates

    moved_scanned = M.unstack_layer_params(scanned, one_step(params))
    moved_unrolled = one_step(M.unstack_layer_params(scanned, params))
    assert jax.tree.structure(moved_unrolled) == jax.tree.structure(
        jax.eval_shape(lambda: M.init_params(unrolled, jax.random.key(0))))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(moved_scanned),
                            jax.tree.leaves(moved_unrolled), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=jax.tree_util.keystr(path))
        name = path[-1].key
        assert bool(np.any(np.asarray(a) != 0)) == (name in update.DECAYED_PARAMS), name


def test_the_load_balancing_loss_joins_the_loss_minimized_not_the_loss_reported():
    config = M.preset("tiny", num_experts=4, experts_per_token=2, ffn_bias=False,
                      activation="swiglu")
    params = M.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    logits, router_loss = jax.jit(lambda p: M.teacher_forced_logits(config, p, batch,
                                                                    router_loss=True))(params)
    total, count = update.cross_entropy_sum(logits, batch["targets"],
                                            update.target_weights(batch))
    for remat in (False, True):  # the logits whole, or a part at a time
        train_config = TrainConfig(steps=2, warmup_steps=0, router_aux_loss_coef=0.25,
                                   remat=remat)
        model_config = config.replace(remat=remat)
        minimized, reported = jax.jit(lambda p, c=train_config, m=model_config:
                                      update._loss(m, c, p, batch, None))(params)
        np.testing.assert_allclose(reported, total / count, rtol=1e-5)
        np.testing.assert_allclose(minimized, reported + 0.25 * router_loss, rtol=1e-5)
    state = update.init_state(config, train_config, params=params)
    before = np.asarray(state.params["layers"]["0"]["ffn"]["router"]["kernel"])
    state, loss = update.train_step(config, train_config, state, batch)
    np.testing.assert_allclose(loss, reported, rtol=1e-5)  # the step reports the cross-entropy
    assert not np.array_equal(state.params["layers"]["0"]["ffn"]["router"]["kernel"],
                              before)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.25 weighs a mixture"):
        update.init_state(M.preset("tiny"), train_config)
    with pytest.raises(ValueError, match="router_scoring='sigmoid' balances its experts"):
        update.init_state(config.replace(router_scoring="sigmoid"), train_config)
    with pytest.raises(ValueError, match="router_aux_loss_coef=-1 must be >= 0"):
        TrainConfig(router_aux_loss_coef=-1)


def test_lora_on_a_mixtures_experts_trains_their_adapters_and_lowers_the_loss():
    """Every expert's own pair (`model.lora`) trains over the frozen mixture: the loss falls,
    and the experts' B, zero at the start, move; a dense first layer (DeepSeek's) gets a pair
    of its own width."""
    config = M.preset("tiny", num_experts=4, experts_per_token=2, ffn_bias=False,
                      activation="swiglu", dense_ffn_layers=(0,), dense_d_ff=48)
    base = M.init_params(config, jax.random.key(0))
    settings = M.LoRA(2, 4.0, ("q", "wi", "wo"))
    train_config = TrainConfig(steps=4, warmup_steps=0, learning_rate=3e-2, lora=settings)
    adapters = M.lora.init_adapters(config, base, settings, jax.random.key(1))
    state = update.init_state(config, train_config, params=adapters)
    tokens = jax.random.randint(jax.random.key(2), (4, 9), 0, config.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    losses = []
    for _ in range(4):
        state, loss = update.train_step(config, train_config, state, batch, base=base)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    moved = np.asarray(state.params["layers"]["1"]["wi"]["lora_b"])  # [experts, r, F]
    assert moved.shape == (4, 2, config.d_ff) and np.any(moved != 0)
    dense = np.asarray(state.params["layers"]["0"]["wo"]["lora_a"])  # [dense F, r]
    assert dense.shape == (48, 2)
