"""model/lora_rows.py: a batch whose rows add different LoRA adapters, unmerged, computes for
each row what the model with that row's adapter merged in computes (prefill, cached steps,
scanned or unrolled layers), and a row with none what the base computes (bit for bit on a CPU);
a stack's slots filled or emptied while served compile nothing new."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_full, trained_adapters

from kvjax import model as M
from kvjax.model import lora as L
from kvjax.model import lora_rows

# Different ranks, scales and targets: the stack pads ranks and fills missing targets.
LORAS = (L.LoRA(4, 8.0, ("q", "v", "o", "wi_gate", "wo")), L.LoRA(2, None, ("k", "wi")))
# And a mixture's router's, its shared expert's, and the gate scaling it.
MIXTURE = (("router", "shared_wi", "shared_expert_gate"), ("shared_wi_gate", "shared_wo"))


def config_of(scan_layers: bool, latent: bool = False, mixture: bool = False
              ) -> M.TransformerConfig:
    """Llama's layer; with `latent`, DeepSeek-V3's latent attention (a query latent, values
    narrower than a head); with `mixture`, 16 experts (one a token: a decode step's few pairs
    gather their experts, a prompt's go through every expert) and a gated shared expert after
    a dense first layer."""
    heads = dict(num_heads=4, head_dim=12, rotary_dim=4, latent_kv_rank=10, latent_nope_dim=6,
                 latent_value_dim=8, latent_q_rank=12) if latent else dict(num_kv_heads=2)
    if mixture:
        heads.update(num_experts=16, experts_per_token=1, dense_ffn_layers=(0,), dense_d_ff=48,
                     shared_expert_d_ff=24, shared_expert_gate=True)
    return M.preset("tiny", positional_encoding="rope", norm_type="rmsnorm",
                    activation="swiglu", ffn_bias=False, scan_layers=scan_layers, **heads)


@functools.partial(jax.jit, static_argnums=(0, 4))
def prefill_then_steps(config, params, stack, adapter_B, capacity, tokens_BT):
    """Logits [B, T, V]: the first 5 tokens prefilled, then one cached step per token."""
    rows = lora_rows.for_rows(stack, adapter_B)
    lengths_B = jnp.full(tokens_BT.shape[0], 5, jnp.int32)
    first_BV, cache = M.prefill(config, params, tokens_BT[:, :5], lengths_B, capacity,
                                adapters=rows)
    step = M.step_fn(config, params, rows)
    logits = [first_BV]
    for t in range(5, tokens_BT.shape[1] - 1):
        logits_B1V, cache = step(tokens_BT[:, t:t + 1], cache)
        logits.append(logits_B1V[:, 0])
    return jnp.stack(logits, axis=1)


# Latent attention's q, k and v adapt its query and kv_up kernels: a prefill adds them to the
# expanded keys and values, a step to what the latent rows give the queries and values.
# A mixture's experts: each token adds its own expert's pair of its row's adapter; its router
# and shared expert, as any kernel (a row's router adapter changes the experts it chooses).
@pytest.mark.parametrize("scan_layers, latent, mixture", [
    (False, False, False), (True, False, False), (True, True, False), (False, False, True)],
    ids=["unrolled", "scanned", "latent", "mixture"])
def test_each_row_computes_its_own_adapters_merged_model(scan_layers, latent, mixture):
    config = config_of(scan_layers, latent, mixture)
    params = M.init_params(config, jax.random.key(0))
    loras = [L.LoRA(lora.rank, lora.alpha, lora.targets + (mixture_targets if mixture else ()))
             for lora, mixture_targets in zip(LORAS, MIXTURE, strict=True)]
    adapters = [(trained_adapters(config, params, lora, i), lora) for i, lora in enumerate(loras)]
    stack = lora_rows.stack(config, params, adapters)
    assert stack.count == 2
    merged = [params] + [L.merge(config, params, a, lora) for a, lora in adapters]
    tokens = jax.random.randint(jax.random.key(3), (4, 10), 3, config.vocab_size)
    adapter_B = jnp.array([2, 0, 1, 2], jnp.int32)
    got = prefill_then_steps(config, params, stack, adapter_B, 16, tokens)
    for b, adapter in enumerate(adapter_B.tolist()):
        want = run_full(config, merged[adapter], tokens[b:b + 1])[0, 4:9]
        np.testing.assert_allclose(got[b], want, atol=2e-5, rtol=1e-5)
    base = prefill_then_steps(config, params, None, adapter_B, 16, tokens)
    assert_base(got[1], base[1])  # no adapter
    for b in (0, 2):  # and an adapter changes what a row computes
        assert float(jnp.max(jnp.abs(got[b] - base[b]))) > 1e-2


def assert_base(got, base):
    """A row that adds no adapter computes what the base computes: bit for bit on a CPU; a
    GPU's compiler may tile the base's products otherwise beside the adapters'."""
    if jax.default_backend() == "cpu":
        assert np.array_equal(got, base)
    else:
        np.testing.assert_allclose(got, base, atol=1e-5, rtol=1e-5)


def test_slots_filled_and_emptied_while_served_compile_nothing_new():
    config = config_of(scan_layers=False)
    params = M.init_params(config, jax.random.key(0))
    first, second = [(trained_adapters(config, params, lora, i + 5), lora)
                     for i, lora in enumerate(LORAS)]
    # Room for three adapters of rank 4 on every target, the first one in slot 1.
    stack = lora_rows.stack(config, params, [first], capacity=3, rank=4,
                            targets=lora_rows.servable_targets(config, params))
    assert (stack.count, stack.rank) == (3, 4)
    tokens = jax.random.randint(jax.random.key(4), (3, 10), 3, config.vocab_size)
    adapter_B = jnp.array([1, 2, 3], jnp.int32)
    base = prefill_then_steps(config, params, None, adapter_B, 16, tokens)
    before = prefill_then_steps(config, params, stack, adapter_B, 16, tokens)
    compiled = prefill_then_steps._cache_size()
    filled = lora_rows.put(config, params, stack, 3, second)
    after = prefill_then_steps(config, params, filled, adapter_B, 16, tokens)
    emptied = lora_rows.put(config, params, filled, 1, None)
    last = prefill_then_steps(config, params, emptied, adapter_B, 16, tokens)
    assert prefill_then_steps._cache_size() == compiled

    def merged(adapter, b):
        return run_full(config, L.merge(config, params, *adapter), tokens[b:b + 1])[0, 4:9]

    for got in (before, after):
        np.testing.assert_allclose(got[0], merged(first, 0), atol=2e-5, rtol=1e-5)
        assert_base(got[1], base[1])  # an empty slot
    assert_base(before[2], base[2])
    np.testing.assert_allclose(after[2], merged(second, 2), atol=2e-5, rtol=1e-5)
    assert_base(last[0], base[0])
    np.testing.assert_array_equal(last[2], after[2])


def test_what_a_stack_cannot_hold_is_refused_by_name():
    config = config_of(scan_layers=False)
    params = M.init_params(config, jax.random.key(0))
    narrow = lora_rows.stack(config, params, [], capacity=2, rank=2, targets=("q", "v"))
    wide = (trained_adapters(config, params, LORAS[0], 1), LORAS[0])  # rank 4: q v o ...
    small = L.LoRA(2, targets=("q", "wo"))
    with pytest.raises(ValueError, match="adapter 1 has rank 4, more than the stack's 2"):
        lora_rows.put(config, params, narrow, 1, wide)
    with pytest.raises(ValueError, match=r"adapter 2 adapts 'wo', which the stack does not "
                                         r"hold \(its targets: q, v\)"):
        lora_rows.put(config, params, narrow, 2,
                      (trained_adapters(config, params, small, 2), small))
    for index in (0, 3, 1.0):
        with pytest.raises(ValueError, match=f"index={index!r} must be an int from 1 to the "
                                             "stack's 2 slots"):
            lora_rows.put(config, params, narrow, index, None)
    with pytest.raises(ValueError, match="capacity=1 must be an int >= 1 and hold the 2 "
                                         "adapters given"):
        lora_rows.stack(config, params, [wide, wide], capacity=1)


def test_a_mixtures_experts_take_adapters_over_a_float_base_only():
    """A stack holds adapters of a mixture's experts, each expert a pair (`servable_targets`
    lists them); over int8 experts' kernels, which a layer dequantizes outside the adapters,
    they are refused by name."""
    config = M.preset("tiny", num_experts=4, experts_per_token=2, ffn_bias=False)
    params = M.init_params(config, jax.random.key(0))
    dense = L.LoRA(2, targets=("q",))
    experts = L.LoRA(2, targets=("q", "wi"))
    pairs = [(L.init_adapters(config, params, lora, jax.random.key(1)), lora)
             for lora in (dense, experts)]
    assert lora_rows.servable_targets(config, params) == L.TARGETS[:5] + ("wo", "router")
    assert lora_rows.servable_targets(config, params, experts=False) == L.TARGETS[:4] + (
        "router",)
    stack = lora_rows.stack(config, params, pairs)
    assert stack.pairs["layers"]["0"]["ffn"]["experts"]["wi"]["a"].shape == (
        4, config.d_model, 2 * 2)  # [experts, D, n·R]
    int8_config = config.replace(kernel_dtype="int8")
    int8_params = M.init_params(int8_config, jax.random.key(0))
    with pytest.raises(ValueError, match=r"LoRA on a mixture's experts \('wi'\) needs a float "
                                         "base"):
        lora_rows.stack(int8_config, int8_params, pairs)
    with pytest.raises(ValueError, match="at least one adapter"):
        lora_rows.stack(config, params, [])
    assert lora_rows.for_rows(None, jnp.zeros(3, jnp.int32)) is None
