"""The mesh and the param layout: sizes, sharding rules and the bad-input errors."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax import decode, hf, parallel
from kvjax import model as M


def test_default_mesh_puts_every_device_on_data():
    mesh = parallel.make_mesh()
    assert dict(mesh.shape) == {"data": 8, "model": 1}
    assert dict(parallel.make_mesh("model=2").shape) == {"data": 4, "model": 2}
    assert dict(parallel.make_mesh({"data": 2, "model": 4}).shape) == {"data": 2, "model": 4}
    two = parallel.make_mesh("data=2", devices=jax.devices()[:2])
    assert two.devices.tolist() == [[d] for d in jax.devices()[:2]]


@pytest.mark.parametrize("spec, message", [
    ("data=16", "needs 16 devices, but only 8 exist"),
    ("data=2,model=2", "has 4 devices, but there are 8"),
    ("data=3", "mesh data=3 does not divide the 8 devices"),
    ("data=4,model=x", "needs an integer size, got 'x'"),
    ("batch=8", "mesh axis 'batch'"),
    ("data=0", "data=0 must be >= 1"),
])
def test_bad_mesh_is_refused_with_its_numbers(spec, message):
    with pytest.raises(ValueError, match=message):
        parallel.make_mesh(spec)


def test_model_axis_must_divide_heads_kv_heads_and_d_ff():
    mesh = parallel.make_mesh("data=2,model=4")
    parallel.check_model_axis(M.preset("tiny"), mesh)  # 4 heads, d_ff 64
    cases = [({"num_heads": 2, "d_model": 32}, "model=4 does not divide num_heads=2"),
             ({"num_kv_heads": 2}, "model=4 does not divide kv heads=2"),
             ({"d_ff": 66}, "model=4 does not divide d_ff=66")]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            parallel.check_model_axis(M.preset("tiny", **overrides), mesh)
    with pytest.raises(ValueError, match="batch size 12 is not divisible by the mesh's data=8"):
        parallel.check_batch(12, parallel.make_mesh())


@pytest.mark.parametrize("scan_layers", [True, False])
def test_params_split_by_head_and_ffn_hidden_rest_replicated(scan_layers):
    config = M.preset("tiny", num_encoder_layers=1, scan_layers=scan_layers)
    mesh = parallel.make_mesh("data=4,model=2")
    params = parallel.shard_params(M.init_params(config, jax.random.key(0)), mesh)
    lead = (None,) if scan_layers else ()
    specs = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf.sharding.spec
             for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    layer = "decoder_layers/" if scan_layers else "decoder_layers/0/"
    assert specs[layer + "self_attention/qkv/kernel"] == P(*lead, None, "model", None)
    assert specs[layer + "self_attention/out/kernel"] == P(*lead, "model", None, None)
    assert specs[layer + "cross_attention/query/kernel"] == P(*lead, None, "model", None)
    assert specs[layer + "ffn/wi/kernel"] == P(*lead, None, "model")
    assert specs[layer + "ffn/wi/bias"] == P(*lead, "model")
    assert specs[layer + "ffn/wo/kernel"] == P(*lead, "model", None)
    assert specs[layer + "ffn/wo/bias"] == P()
    assert specs["embedder/embedding/embedding"] == P()
    split = [name for name, spec in specs.items() if spec != P()]
    assert len(split) == (13 if scan_layers else 21)  # 7 per decoder, 5 per encoder layer
    ffn = (params["decoder_layers"] if scan_layers else params["decoder_layers"]["0"])["ffn"]
    assert ffn["wi"]["kernel"].addressable_shards[0].data.shape[-1] == config.d_ff // 2
    assert parallel.mesh_of(params) is mesh


def test_train_command_refuses_a_mesh_larger_than_the_host(tmp_path, capsys):
    from kvjax import cli

    code = cli.main(["train", "--task", "lm", "--mesh", "data=4,model=4", "--out",
                     str(tmp_path / "run")])
    assert code == 2
    assert "mesh data=4,model=4 needs 16 devices, but only 8 exist" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_pretrained_model_loads_onto_a_mesh_and_makes_its_tokens():
    directory = Path(__file__).parents[2] / "fixtures" / "hf_models" / "qwen2"
    mesh = parallel.make_mesh("data=4,model=2")
    config, _, params = hf.load_pretrained(directory, mesh=mesh)
    attention = params["layers"]["0"]["self_attention"]
    assert attention["qkv"]["bias"].sharding.spec == P("model", None)
    assert attention["qkv"]["kernel"].sharding.spec == P(None, "model", None)
    record = json.loads((directory / "expected.json").read_text())
    out = decode.generate(M.build_model(config), params, record["prompts"],
                          max_new_tokens=record["max_new_tokens"], eos_ids=(record["eos_id"],))
    assert out.token_lists() == record["greedy"]  # what transformers generated


@pytest.mark.parametrize("fields, heads", [
    (dict(num_kv_heads=2), "model"),
    (dict(positional_encoding="rope", head_dim=12, rotary_dim=4, latent_kv_rank=10,
          latent_nope_dim=6, latent_value_dim=8), None),  # one latent row per token: whole
])
def test_a_paged_cache_steps_on_a_mesh_as_on_one_device(fields, heads):
    """Pools split by kv head over `model` (a latent cache's rows held whole), page tables by
    row over `data`: the logits are those of one device."""
    config = M.preset("tiny", **fields)
    params = M.init_params(config, jax.random.key(0))
    mesh = parallel.make_mesh("data=4,model=2")
    tokens = jax.random.randint(jax.random.key(1), (4, 6), 0, config.vocab_size)
    cache = M.init_paged_cache(config, 4, 12, 4, 3).replace(
        pages=jnp.arange(12, dtype=jnp.int32)[::-1].reshape(4, 3))

    @functools.partial(jax.jit, static_argnums=2)
    def prefill_then_step(params, cache, mesh):
        step = M.step_fn(config, params)
        _, cache = step(tokens, parallel.constrain_rows(cache, mesh))
        logits, cache = step(tokens[:, :1], cache)
        return logits, parallel.constrain_rows(cache, mesh)

    alone, _ = prefill_then_step(params, cache, None)
    split, cache = prefill_then_step(parallel.shard_params(params, mesh), cache, mesh)
    assert cache.k[0].sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, heads)), 5)
    assert cache.pages.sharding.spec == P("data")
    np.testing.assert_allclose(split, alone, atol=1e-5, rtol=0)
