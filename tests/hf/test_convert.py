"""Imported models on the command line: `kvjax sample` reads a Hugging Face directory as it
reads a kvjax checkpoint, and `kvjax import-hf` writes one that samples the same tokens."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from kvjax import checkpoint, hf, text
from kvjax.hf import convert

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf_models"



# Sampled, so that equal text means equal params, tokenizer and settings; a translator's
# import is read back in tests/train/test_finetune.py, its beams in tests/hf/test_hf_models.py.
@pytest.mark.parametrize("name, options", [
    ("gpt2", ["--temperature", "0.9", "--top-k", "20", "--seed", "3"]),
    ("gemma3_text", ["--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]),
    ("qwen3_moe", ["--temperature", "0.7", "--seed", "7"]),
    ("t5", ["--temperature", "0.9", "--seed", "11"]),  # its stacks' bias tables, its buckets
])
def test_import_hf_then_sample_gives_the_same_tokens(capsys, tmp_path, name, options):
    out = tmp_path / "imported"
    code, stdout, err = run_cli(capsys, "import-hf", str(FIXTURES / name), str(out))
    assert code == 0, err
    assert stdout.strip() == f"wrote {out}"
    results = []
    for directory in (FIXTURES / name, out):
        code, stdout, err = run_cli(capsys, "sample", "--checkpoint", str(directory),
                                    "--prompt", "Hello there", "--max-new-tokens", "6", *options)
        assert code == 0, err
        results.append(stdout.rsplit("\n[", 1)[0])  # the text, without the timing line
    assert results[0] == results[1]
    # The checkpoint holds the same model: config, tokenizer and params, verified.
    config, tokenizer, params = checkpoint.load_for_sampling(out)
    imported = text.load(FIXTURES / name)
    assert config == imported.config
    assert tokenizer.encode("Hello there") == imported.tokenizer.encode("Hello there")
    assert checkpoint.read_manifest(out) is not None
    for a, b in zip(jax_leaves(params), jax_leaves(imported.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_import_hf_max_len_writes_a_longrope_model_for_its_long_context(capsys, tmp_path):
    out = tmp_path / "imported"
    code, _, err = run_cli(capsys, "import-hf", str(FIXTURES / "phi3"), str(out), "--max-len",
                           "128")
    assert code == 0, err
    config, _, params = checkpoint.load_for_sampling(out)
    wanted, expected_params = hf.load_model(FIXTURES / "phi3", max_len=128)
    assert config == wanted and config.rope_long_factors == (1.5, 4.0, 9.0)
    for a, b in zip(jax_leaves(params), jax_leaves(expected_params), strict=True):
        np.testing.assert_array_equal(a, b)
    code, stdout, err = run_cli(capsys, "import-hf", str(FIXTURES / "phi3"),
                                str(tmp_path / "other"), "--max-len", "4096")
    assert code == 2 and stdout == "" and err.strip().count("\n") == 0
    assert "max_len=4096 must be an int from 1 to max_position_embeddings=128" in err
    # `text.load` takes it for a Hugging Face directory, not for a checkpoint.
    assert text.load(FIXTURES / "phi3", max_len=128).config == wanted
    with pytest.raises(ValueError, match="max_len=128 is chosen when a Hugging Face directory "
                                         "is loaded; the kvjax checkpoint"):
        text.load(out, max_len=128)


def test_import_hf_kernel_dtype_int8_writes_the_quantized_model_read_back_as_it_is(
        capsys, tmp_path):
    """A mixture of experts (its experts, attention and table int8) written by `import-hf
    --kernel-dtype int8`: a quarter of the float32 import's bytes, the model `load_pretrained`
    quantizes, loaded by `text.load` (what `kvjax sample` reads) without quantizing it again."""
    import jax.numpy as jnp

    out = tmp_path / "int8"
    code, _, err = run_cli(capsys, "import-hf", str(FIXTURES / "qwen3_moe"), str(out),
                           "--kernel-dtype", "int8")
    assert code == 0, err
    config, _, params = checkpoint.load_for_sampling(out)
    wanted, _, expected = hf.load_pretrained(FIXTURES / "qwen3_moe", kernel_dtype="int8")
    assert config == wanted and config.kernel_dtype == "int8"
    for a, b in zip(jax_leaves(params), jax_leaves(expected), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert {a.dtype for a in jax_leaves(params)} >= {jnp.dtype("int8")}
    loaded = text.load(out)
    assert loaded.config == wanted
    for a, b in zip(jax_leaves(loaded.params), jax_leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    float32 = sum(a.size * 4 for a in jax_leaves(hf.load_model(FIXTURES / "qwen3_moe")[1]))
    assert sum(a.nbytes for a in jax_leaves(params)) < 0.4 * float32


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_import_hf_of_a_bad_directory_is_one_line_and_writes_nothing(capsys, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(FIXTURES / "gpt2", source)
    values = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**values, "model_type": "bert"}))
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "import-hf", str(source), str(out))
    assert code == 2 and stdout == ""
    assert err.strip().count("\n") == 0
    assert ("model_type 'bert' is not supported; kvjax loads apertus, arcee, bart, bloom, cohere, "
            "cohere2, deepseek_v2, deepseek_v3, dots1, ernie4_5, ernie4_5_moe, exaone, exaone4, "
            "falcon, flex_olmo, gemma, gemma2, gemma3_text, glm, glm4, glm4_moe, glm4_moe_lite, "
            "gpt2, gpt_bigcode, gpt_neo, gpt_neox, gpt_oss, gptj, granite, granitemoe, "
            "granitemoehybrid, granitemoeshared, helium, hunyuan_v1_dense, hunyuan_v1_moe, "
            "hyperclovax, internlm3, iquestcoder, jais2, llama, m2m_100, marian, mbart, ministral,"
            " ministral3, mistral, mixtral, mpt, mt5, nanochat, nemotron, olmo, olmo2, olmo3, "
            "olmoe, opt, phi, phi3, phimoe, qwen2, qwen2_moe, qwen3, qwen3_moe, seed_oss, smollm3,"
            " stablelm, starcoder2, t5, umt5, vaultgemma") in err
    assert not out.exists()
    code, _, err = run_cli(capsys, "import-hf", str(tmp_path / "nowhere"), str(out))
    assert code == 2 and "is not a directory" in err and not out.exists()


def test_sample_of_an_unsupported_model_is_one_line(capsys, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(FIXTURES / "llama_mqa", source)
    values = json.loads((source / "config.json").read_text())
    values["rope_parameters"] = {"rope_type": "ntk-by-parts", "factor": 2.0, "rope_theta": 1e4}
    (source / "config.json").write_text(json.dumps(values))
    code, _, err = run_cli(capsys, "sample", "--checkpoint", str(source), "--prompt", "x")
    assert code == 2
    assert err.strip().count("\n") == 0 and "rope scaling of type 'ntk-by-parts'" in err


def test_import_hf_refuses_a_directory_with_checkpoints(tmp_path):
    out = convert.import_checkpoint(FIXTURES / "llama_mqa", tmp_path / "ckpt")
    with pytest.raises(checkpoint.CheckpointError, match="already holds checkpoint steps"):
        convert.import_checkpoint(FIXTURES / "llama_mqa", out)
