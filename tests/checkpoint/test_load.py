"""kvjax/checkpoint/load.py: loading for sampling gives back the saved config, tokenizer and
params, in the layer layout asked for, and refuses params of another config."""

import jax
import jax.numpy as jnp
import optax
import pytest
from checkpoint_support import assert_trees_equal, snapshot

from kvjax import checkpoint as ckpt
from kvjax.checkpoint import Checkpointer, CheckpointError


def _model_and_tokenizer():
    from kvjax.model import init_params
    from kvjax.model.config import preset
    from kvjax.tokenizer import train_tokenizer

    text = "the quick brown fox jumps over the lazy dog.\n" * 20 + "pack my box with jugs\n"
    tokenizer = train_tokenizer([text], 300)
    config = preset("tiny", vocab_size=tokenizer.vocab_size)
    return config, tokenizer, init_params


def test_load_for_sampling_round_trip(tmp_path):
    config, tokenizer, init_params = _model_and_tokenizer()
    params = init_params(config, jax.random.key(1))
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": jnp.int32(5)}
    ckpt.write_metadata(tmp_path, config.to_dict(), "lm", tokenizer.to_bytes())
    with Checkpointer(tmp_path, save_every=100, keep=1) as checkpointer:
        assert checkpointer.save(5, state, force=True)

    loaded_config, loaded_tokenizer, loaded_params = ckpt.load_for_sampling(tmp_path)

    assert loaded_config == config
    assert loaded_tokenizer.to_bytes() == tokenizer.to_bytes()
    assert loaded_tokenizer.encode("the lazy fox") == tokenizer.encode("the lazy fox")
    assert_trees_equal(loaded_params, params)


@pytest.mark.parametrize("saved_scanned", [True, False])
def test_load_for_sampling_holds_the_layers_as_asked_whichever_way_they_were_saved(
        tmp_path, saved_scanned):
    from kvjax import model as M

    config, tokenizer, init_params = _model_and_tokenizer()
    config = config.replace(scan_layers=saved_scanned)
    params = init_params(config, jax.random.key(1))
    ckpt.write_metadata(tmp_path, config.to_dict(), "lm", tokenizer.to_bytes())
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        checkpointer.save(1, {"params": params, "step": jnp.int32(1)})

    default_config, _, default_params = ckpt.load_for_sampling(tmp_path)
    assert default_config == config.replace(scan_layers=M.TransformerConfig.scan_layers)
    for scan_layers in (True, False):
        loaded_config, _, loaded_params = ckpt.load_for_sampling(tmp_path, scan_layers=scan_layers)
        assert loaded_config == config.replace(scan_layers=scan_layers)
        assert_trees_equal(loaded_params, M.with_layer_layout(config, params, scan_layers)[1])
        if scan_layers == default_config.scan_layers:
            assert_trees_equal(loaded_params, default_params)


def test_load_for_sampling_refuses_params_of_another_config(tmp_path):
    config, tokenizer, init_params = _model_and_tokenizer()
    params = init_params(config, jax.random.key(1))
    ckpt.write_metadata(tmp_path, config.replace(d_model=64).to_dict(), "lm", tokenizer.to_bytes())
    save = {"params": params, "step": jnp.int32(1)}
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        checkpointer.save(1, save)
    before = snapshot(tmp_path)

    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / '1'} does not match"):
        ckpt.load_for_sampling(tmp_path)

    assert snapshot(tmp_path) == before
