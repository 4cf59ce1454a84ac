"""kvjax/hf/weights.py, tensor by tensor: each param that `load_params` builds computes what
torch's layer computes from the file's tensor (`Linear`: y = W x + b), read here by
safetensors' own NumPy loader, for the separate (Llama, Qwen2 with biases and in two shards)
and the fused (Phi-3) projections; shards of an index read as one file. Files that are not
what their config says (a tensor missing, misshapen or unused, a truncated file, a missing
shard) are refused by name."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_hf_models import (
    copy_of,
    edit_config,
    expected,
    relative_error,
    rewrite_tensor,
    teacher_forced,
)

from kvjax import hf
from kvjax.hf import tensors as T
from kvjax.hf import weights as W
from kvjax.hf.config import SUPPORTED_MODEL_TYPES, read_hf_config, to_kvjax_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models"


def loaded(name: str):
    directory = FIXTURES / name
    tensors = {}  # qwen2's files are two shards, as transformers wrote them
    for path in directory.glob("model*.safetensors"):
        tensors.update(load_file(path))
    hf = read_hf_config(directory)
    config = to_kvjax_config(hf, tied="lm_head.weight" not in tensors)
    return config, W.load_params(config, hf["model_type"], T.WeightFiles(directory)), tensors


def linear(tensors, name, x, bias=False):
    """What torch's Linear `name` makes of x [D]."""
    out = tensors[name + ".weight"] @ x
    return out + tensors[name + ".bias"] if bias else out


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "phi3"])
def test_each_projection_computes_what_its_torch_layer_does(name):
    config, params, tensors = loaded(name)
    d, n, k, h, f = (config.d_model, config.num_heads, config.kv_heads, config.head_dim,
                     config.d_ff)
    assert config.qkv_bias == (name == "qwen2")  # Qwen2's q, k and v have biases
    x = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    z = np.random.default_rng(1).standard_normal((n, h)).astype(np.float32)
    for i in range(config.num_decoder_layers):
        layer, src = params["layers"][str(i)], f"model.layers.{i}."
        qkv = layer["self_attention"]["qkv"]
        got = np.einsum("d,dnh->nh", x, qkv["kernel"]) + qkv.get("bias", 0)
        if name == "phi3":
            want = linear(tensors, src + "self_attn.qkv_proj", x)
        else:
            want = np.concatenate([linear(tensors, f"{src}self_attn.{p}_proj", x,
                                          config.qkv_bias) for p in "qkv"])
        np.testing.assert_allclose(got.reshape(-1), want, rtol=1e-5, atol=1e-6)
        assert got.shape == (n + 2 * k, h)
        out = np.einsum("nh,nhd->d", z, layer["self_attention"]["out"]["kernel"])
        np.testing.assert_allclose(out, linear(tensors, src + "self_attn.o_proj", z.reshape(-1)),
                                   rtol=1e-5, atol=1e-6)
        ffn = layer["ffn"]
        if name == "phi3":  # the gate's rows first, then the up projection's
            gate_up = linear(tensors, src + "mlp.gate_up_proj", x)
            gate, up = gate_up[:f], gate_up[f:]
        else:
            gate, up = linear(tensors, src + "mlp.gate_proj", x), linear(
                tensors, src + "mlp.up_proj", x)
        np.testing.assert_allclose(x @ ffn["wi"]["kernel"], gate, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(x @ ffn["wi_gate"]["kernel"], up, rtol=1e-5, atol=1e-6)
        hidden = np.random.default_rng(2).standard_normal(f).astype(np.float32)
        np.testing.assert_allclose(hidden @ ffn["wo"]["kernel"],
                                   linear(tensors, src + "mlp.down_proj", hidden),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(layer["attention_block"]["norm"]["scale"],
                                      tensors[src + "input_layernorm.weight"])
        np.testing.assert_array_equal(layer["ffn_block"]["norm"]["scale"],
                                      tensors[src + "post_attention_layernorm.weight"])
    np.testing.assert_array_equal(params["embedder"]["embedding"]["embedding"],
                                  tensors["model.embed_tokens.weight"])
    if "lm_head.weight" in tensors:
        np.testing.assert_allclose(x @ params["embedder"]["unembed"]["kernel"],
                                   linear(tensors, "lm_head", x), rtol=1e-5, atol=1e-6)


def test_gpt2_conv1d_weights_are_used_as_stored():
    config, params, tensors = loaded("gpt2")
    x = np.random.default_rng(0).standard_normal(config.d_model).astype(np.float32)
    prefix = "transformer." if "transformer.wte.weight" in tensors else ""
    layer = params["layers"]["0"]
    qkv = layer["self_attention"]["qkv"]
    got = np.einsum("d,dnh->nh", x, qkv["kernel"]) + qkv["bias"]
    # Conv1D: y = x W + b, with W [in, out] as the file holds it.
    want = x @ tensors[prefix + "h.0.attn.c_attn.weight"] + tensors[prefix + "h.0.attn.c_attn.bias"]
    np.testing.assert_allclose(got.reshape(-1), want, rtol=1e-5, atol=1e-6)


def test_the_shards_of_an_index_read_as_the_single_file(tmp_path):
    directory = FIXTURES / "llama_gqa"
    tensors = load_file(directory / T.SINGLE_FILE)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, in_it in shards.items():
        save_file({n: tensors[n] for n in in_it}, tmp_path / shard)
    (tmp_path / T.INDEX_FILE).write_text(json.dumps(
        {"weight_map": {n: shard for shard, in_it in shards.items() for n in in_it}}))
    files = T.WeightFiles(tmp_path)
    assert files.names() == set(names)
    for name in names:
        np.testing.assert_array_equal(files.read(name), tensors[name])
    with pytest.raises(ValueError, match="tensor model.nothing is missing"):
        files.read("model.nothing")


def test_a_directory_of_pickles_only_is_refused_saying_why(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is a pickle"):
        T.WeightFiles(tmp_path)
    (tmp_path / T.INDEX_FILE).write_text("{}")
    with pytest.raises(ValueError, match="is not a safetensors index"):
        T.WeightFiles(tmp_path)


def test_every_model_type_read_has_a_weight_layout():
    assert set(W.LAYOUTS) == set(SUPPORTED_MODEL_TYPES)


def test_an_xielu_whose_fixed_coefficients_differ_is_refused_by_name(tmp_path):
    """Apertus's files hold xIELU's beta and eps as buffers; kvjax computes with 0.5 and
    -1e-6, so a file holding another value is refused, not run as if it held those."""
    import shutil

    from kvjax import hf

    directory = tmp_path / "apertus"
    shutil.copytree(FIXTURES / "apertus", directory)
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.act_fn.beta"] = np.array(0.25, np.float32)
    save_file(tensors, str(path))
    with pytest.raises(hf.UnsupportedModelError,
                       match="model.layers.1.mlp.act_fn.beta is 0.25; kvjax's xIELU takes "
                             "beta = 0.5"):
        hf.load_model(directory)


def test_glm_multi_token_prediction_layers_are_left_unread_and_no_other_tensor(tmp_path):
    """GLM-4.5's releases store their multi-token-prediction layer after the last layer
    (model.layers.<num_hidden_layers>.*), which transformers leaves unread: so does kvjax,
    and every param is the same; a tensor of a layer the model has, unknown to it, is still
    refused by name."""
    directory = tmp_path / "glm4_moe"
    directory.mkdir()
    for path in (FIXTURES / "glm4_moe").iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    tensors = load_file(directory / "model.safetensors")
    config, params, _ = loaded("glm4_moe")
    extra = {"model.layers.3.eh_proj.weight": np.ones((32, 64), np.float32),
             "model.layers.3.enorm.weight": np.ones(32, np.float32)}
    save_file({**tensors, **extra}, directory / "model.safetensors")
    with_mtp = W.load_params(config, "glm4_moe", T.WeightFiles(directory))
    for got, want in zip(jax.tree.leaves(with_mtp), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(got, want)
    save_file({**tensors, "model.layers.2.eh_proj.weight": np.ones((32, 64), np.float32)},
              directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.eh_proj\.weight"):
        W.load_params(config, "glm4_moe", T.WeightFiles(directory))


# Files that are not what their config says: each is one error naming the problem, raised
# before anything is computed.


def test_opt_files_that_name_tensors_from_the_decoder_load_the_same_model(tmp_path):
    # OPT's released files were saved from OPTModel: "decoder.layers.0...", no "model.".
    directory = copy_of("opt", tmp_path)
    path = directory / "model.safetensors"
    save_file({name.removeprefix("model."): array
               for name, array in load_file(str(path)).items()}, str(path))
    config, _, params = hf.load_pretrained(directory)
    record, logits = expected("opt")
    assert relative_error(teacher_forced(config, params, record)[2], logits["logits_2"]) <= 1e-5


@pytest.mark.parametrize("transform, message", [
    (lambda v: None, "tensor transformer.h.1.mlp.c_fc.weight is missing"),
    (lambda v: v[:, :-1], "tensor transformer.h.1.mlp.c_fc.weight has shape [32, 127], the "
                          "config needs [32, 128]"),
])
def test_a_missing_or_misshapen_tensor_is_named(tmp_path, transform, message):
    directory = copy_of("gpt2", tmp_path)
    rewrite_tensor(directory / "model.safetensors", "transformer.h.1.mlp.c_fc.weight", transform)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        hf.load_pretrained(directory)


def test_a_tensor_the_model_does_not_use_is_refused(tmp_path):
    directory = copy_of("gpt2", tmp_path)
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    save_file({**tensors, "h.0.attn.extra_scale": np.ones(4, np.float32)}, str(path))
    with pytest.raises(ValueError, match=r"tensors \['h.0.attn.extra_scale'\] .*are not part"):
        hf.load_pretrained(directory)


def test_a_truncated_file_is_named(tmp_path):
    directory = copy_of("gpt2", tmp_path)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        hf.load_pretrained(directory)


def test_an_index_naming_a_missing_shard_is_named(tmp_path):
    directory = copy_of("qwen2", tmp_path)
    shard = sorted(directory.glob("model-0000*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"names the shard {shard.name}, which is missing"):
        hf.load_pretrained(directory)


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    directory = copy_of("gpt2", tmp_path)
    edit_config(directory, vocab_size=16)
    path = directory / "model.safetensors"
    rewrite_tensor(path, "transformer.wte.weight", lambda v: v[:16])
    with pytest.raises(ValueError, match="the tokenizer has .* ids but the model's vocab_size "
                                         "is 16"):
        hf.load_pretrained(directory)
