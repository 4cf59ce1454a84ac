"""Training and checkpoints on 8 devices: the same losses as on one, restores onto any mesh."""

import jax
import numpy as np
import pytest

from kvjax import checkpoint, parallel
from kvjax import model as M
from kvjax.tokenizer import train_tokenizer
from kvjax.train import data, tasks, trainer
from kvjax.train.config import TrainConfig, TrainTask

STEPS = 20
CONFIG = TrainConfig(steps=STEPS, batch_size=8, learning_rate=3e-3, warmup_steps=2,
                     eval_every=STEPS, eval_batches=1, save_every=STEPS,
                     keep_checkpoints=1, progress=False)
MESHES = {"one device": None, "data=8": "data=8", "data=2,model=4": "data=2,model=4"}
# The encoder-decoder trains on the mesh that splits both its batch and its heads; the rows
# alone (data=8) split as they do for the language model.
VARIANT_MESHES = {"lm": tuple(MESHES), "translate": ("one device", "data=2,model=4")}


class _IdTokenizer:
    @staticmethod
    def encode(ids):
        return list(ids)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["the quick brown fox jumps over the lazy dog.\n" * 40], 300)


def lm_task(tokenizer):
    windows = data.repeat_task(96, 16, max_segment_len=1, vocab_low=4, vocab_high=20, seed=0)
    return TrainTask(name="lm", tokenizer=tokenizer, train=tasks.lm_arrays(windows[:80]),
                     val=tasks.lm_arrays(windows[80:]))


def translate_task(tokenizer):
    pairs = data.reverse_task(96, seq_len=5, vocab_low=4, vocab_high=14, seed=0)
    arrays = tasks.translation_arrays(_IdTokenizer, pairs, max_len=6)
    return TrainTask(name="translate", tokenizer=tokenizer,
                     train={k: v[:80] for k, v in arrays.items()},
                     val={k: v[80:] for k, v in arrays.items()})


VARIANTS = {
    # Dropout on: its masks must not depend on how the batch is split. Saved scanned, so
    # loading for sampling (unrolled) converts the layers after reading them onto a mesh.
    "lm": (lambda v: M.preset("tiny", vocab_size=v, dropout=0.1, scan_layers=True), lm_task),
    "translate": (lambda v: M.preset("tiny", vocab_size=v, num_encoder_layers=1,
                                     scan_layers=False), translate_task),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def runs(request, tokenizer, tmp_path_factory):
    make_config, make_task = VARIANTS[request.param]
    config, task = make_config(tokenizer.vocab_size), make_task(tokenizer)
    results = {}
    for name in VARIANT_MESHES[request.param]:
        spec = MESHES[name]
        mesh = None if spec is None else parallel.make_mesh(spec)
        out = tmp_path_factory.mktemp(request.param)
        results[name] = trainer.train(config, CONFIG, task, out, mesh=mesh)
    return config, task, results


def assert_close(losses, reference):
    assert sorted(losses) == sorted(reference)
    got, want = (np.array([d[s] for s in sorted(reference)]) for d in (losses, reference))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def test_losses_on_eight_devices_equal_one_device(runs):
    _, _, results = runs
    reference = results["one device"].losses
    assert len(reference) == STEPS and reference[1] > reference[STEPS]
    for name in set(results) - {"one device"}:
        assert_close(results[name].losses, reference)
        assert results[name].metrics["val_loss"] == pytest.approx(
            results["one device"].metrics["val_loss"], rel=1e-5)


def test_checkpoint_saved_on_eight_devices_restores_onto_any_mesh(runs):
    config, _, results = runs
    _, _, on_one = checkpoint.load_for_sampling(results["one device"].out_dir)
    for saved in sorted(set(results) - {"one device"}):
        _, _, single = checkpoint.load_for_sampling(results[saved].out_dir)
        assert all(len(leaf.sharding.device_set) == 1 for leaf in jax.tree.leaves(single))
        for spec in ("data=2,model=4", "data=8", "model=2"):
            mesh = parallel.make_mesh(spec)
            _, _, params = checkpoint.load_for_sampling(results[saved].out_dir, mesh)
            wanted = parallel.state_shardings(params, mesh)
            for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(wanted),
                                      strict=True):
                assert leaf.sharding == sharding
            jax.tree.map(np.testing.assert_array_equal, params, single)
        # The same run on another mesh ends with nearly the same weights.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5),
                     single, on_one)
    # Saved on one device, restored onto eight.
    mesh = parallel.make_mesh("data=2,model=4")
    _, _, params = checkpoint.load_for_sampling(results["one device"].out_dir, mesh)
    jax.tree.map(np.testing.assert_array_equal, params, on_one)
    assert parallel.mesh_of(params) is mesh


def test_run_resumed_on_another_mesh_continues_with_the_same_losses(runs, tmp_path):
    config, task, results = runs
    first_mesh, resume_mesh = (MESHES[name] for name in list(results)[-2:])
    first = trainer.train(config, CONFIG, task, tmp_path, stop_after=STEPS // 2,
                          mesh=first_mesh and parallel.make_mesh(first_mesh))
    resumed = trainer.train(config, CONFIG, task, tmp_path, resume=True,
                            mesh=parallel.make_mesh(resume_mesh))
    assert_close({**first.losses, **resumed.losses}, results["one device"].losses)


# LoRA targets the same projections in either variant: the language model's run tells.
@pytest.mark.parametrize("runs", ["lm"], indirect=True)
def test_lora_on_a_mesh_trains_as_on_one_device(runs, tmp_path):
    # The adapters are replicated and the frozen base is sharded as its params are, here an
    # int8 base (`model/int8_base.py`): its kernels and their scales split as the kernels
    # they replace (a base as stored splits as the runs above do).
    config, task, results = runs
    base = results["one device"].out_dir
    settings = CONFIG.replace(steps=4, warmup_steps=1, eval_every=4, save_every=4,
                              lora=M.LoRA(2, targets=("q", "v", "wo"), base_dtype="int8"))
    one = trainer.train(config, settings, task, tmp_path / "one", init_from=base)
    split = trainer.train(config, settings, task, tmp_path / "split", init_from=base,
                          mesh=parallel.make_mesh("data=2,model=4"))
    assert_close(split.losses, one.losses)
    adapters = [checkpoint.restore_params(run.out_dir, checkpoint.abstract_saved_state(
        run.out_dir)["params"]) for run in (one, split)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 *adapters)


def test_batch_that_does_not_split_is_refused_before_compiling(tokenizer, tmp_path):
    config = M.preset("tiny", vocab_size=tokenizer.vocab_size)
    with pytest.raises(ValueError, match="batch size 12 is not divisible by the mesh's data=8"):
        trainer.train(config, CONFIG.replace(batch_size=12), lm_task(tokenizer), tmp_path,
                      mesh=parallel.make_mesh())
    with pytest.raises(ValueError, match="model=8 does not divide num_heads=4"):
        trainer.train(config, CONFIG, lm_task(tokenizer), tmp_path,
                      mesh=parallel.make_mesh("model=8"))
    assert not any(tmp_path.iterdir())
