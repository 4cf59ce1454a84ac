"""kvjax/hf/rope.py: RoPE settings in the forms Hugging Face files give them read as
transformers reads them. That the models with YaRN (the qwen3 fixture) and LongRoPE over part
of each head (phi3) compute what transformers computes is test_hf_models.py's, and LongRoPE's
long factors past the original length is here."""

import json

import numpy as np
import pytest
from test_hf_models import FIXTURES, copy_of, edit_config, expected, relative_error, teacher_forced

from kvjax import decode, hf
from kvjax import model as M


def test_yarn_reads_as_transformers_reads_it(tmp_path):
    """Older files (Qwen2.5's) give YaRN as `rope_scaling` with a `type`; the factor defaults
    to max_position_embeddings over the original length, and DeepSeek's mscale and
    mscale_all_dim set the attention factor when none is given."""
    directory = copy_of("qwen3", tmp_path)
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
            "beta_slow": 0.5}
    edit_config(directory, rope_parameters=None, rope_theta=10000.0,
                rope_scaling={"type": "yarn", **yarn})
    config = hf.load_pretrained(directory)[0]
    assert config == hf.load_pretrained(FIXTURES / "qwen3")[0]
    assert (config.rope_scaling, config.rope_scaling_factor, config.rope_original_max_len,
            config.rope_attention_factor) == ("yarn", 4.0, 32, None)
    edit_config(directory, rope_scaling={**yarn, "type": "yarn", "factor": None, "mscale": 1.0,
                                         "mscale_all_dim": 0.5})
    config = hf.load_pretrained(directory)[0]
    assert config.rope_scaling_factor == 128 / 32  # max_position_embeddings 128
    assert config.rope_attention_factor == pytest.approx(
        (0.1 * np.log(4) + 1) / (0.05 * np.log(4) + 1))


def test_dynamic_ntk_within_max_position_embeddings_is_plain_rope(tmp_path):
    """transformers raises dynamic NTK's base only for contexts past
    max_position_embeddings, the max_len kvjax gives the model."""
    directory = copy_of("qwen2", tmp_path)
    rope = json.loads((directory / "config.json").read_text())["rope_parameters"]
    edit_config(directory, rope_parameters={**rope, "rope_type": "dynamic", "factor": 4.0})
    config = hf.load_pretrained(directory)[0]
    assert config == hf.load_pretrained(FIXTURES / "qwen2")[0]
    assert config.max_len == 128  # max_position_embeddings


def test_phi3_reads_older_names_of_longrope_as_transformers_does(tmp_path):
    """Phi-3's files name LongRoPE 'su' (the first 128k releases) or 'yarn' too, and name
    classes of their own code (`auto_map`) that transformers passes over; by default the
    max_len is the original length, where the short factors turn."""
    directory = copy_of("phi3", tmp_path)
    rope = json.loads((directory / "config.json").read_text())["rope_parameters"]
    config = hf.load_pretrained(FIXTURES / "phi3")[0]
    assert (config.max_len, config.rotary_dim) == (64, 6)  # of 128 positions, 8 dimensions
    with pytest.raises(ValueError, match="more than the model's max_len 64 \\(a longrope "
                                         "model runs past its original length when loaded "
                                         "with a longer max_len"):
        M.check_prompt_length(config, 60, max_new_tokens=8)
    for name in ("su", "yarn"):
        older = {key: value for key, value in rope.items() if key != "rope_type"}
        edit_config(directory, rope_parameters=None, rope_scaling={**older, "type": name},
                    auto_map={"AutoConfig": "configuration_phi3.Phi3Config"})
        assert hf.load_pretrained(directory)[0] == config


def test_longrope_past_its_original_length_equals_transformers():
    """Loaded with a max_len past its original 64 positions, the phi3 model turns every
    position with the long factors, as transformers turns a sequence longer than that: a
    72-token prompt's logits and greedy tokens equal transformers'."""
    config, _, params = hf.load_pretrained(FIXTURES / "phi3", max_len=128)
    assert (config.max_len, config.rope_long_factors) == (128, (1.5, 4.0, 9.0))
    record, logits = expected("phi3")
    long = {"prompts": [record["long"]["prompt"]]}
    assert relative_error(teacher_forced(config, params, long)[0], logits["long_logits"]) <= 1e-5
    greedy = decode.generate(M.build_model(config), params, long["prompts"],
                             max_new_tokens=record["max_new_tokens"],
                             eos_ids=(record["eos_id"],))
    assert greedy.token_lists() == [record["long"]["greedy"]]
    # The short factors at those positions are not what transformers computes.
    short = config.replace(rope_long_factors=config.rope_short_factors)
    assert relative_error(teacher_forced(short, params, long)[0], logits["long_logits"]) > 1e-2


@pytest.mark.parametrize("name, max_len, message", [
    ("phi3", 129, "max_len=129 must be an int from 1 to max_position_embeddings=128"),
    ("phi3", True, "max_len=True must be an int"),
    ("gpt2", 32, "max_len is chosen only for a RoPE model with a max_position_embeddings; "
                 "'gpt2' runs the length of its positions (64)"),
    ("bloom", 0, "max_len=0 must be an int >= 1"),
    ("t5", -1, "max_len=-1 must be an int >= 1"),
])
def test_a_max_len_the_model_cannot_run_is_refused(name, max_len, message):
    with pytest.raises(hf.UnsupportedModelError) as error:
        hf.load_model(FIXTURES / name, max_len=max_len)
    assert message in str(error.value)


@pytest.mark.parametrize("name, trained", [("bloom", 2048), ("t5", 512), ("m2m_100", 64)])
def test_a_model_without_a_table_of_positions_runs_its_length_or_any_length_asked(name, trained):
    # BLOOM (ALiBi), T5 (relative buckets) and M2M100 (sinusoids, which transformers extends
    # past max_position_embeddings as a row needs): nothing bounds them.
    assert hf.load_pretrained(FIXTURES / name)[0].max_len == trained
    assert hf.load_pretrained(FIXTURES / name, max_len=5000)[0].max_len == 5000


def test_a_longrope_model_without_long_factors_runs_only_within_its_original_length(tmp_path):
    directory = copy_of("phi3", tmp_path)
    rope = json.loads((directory / "config.json").read_text())["rope_parameters"]
    edit_config(directory, rope_parameters={**rope, "long_factor": None})
    assert hf.load_model(directory, max_len=64)[0].max_len == 64
    with pytest.raises(hf.UnsupportedModelError, match="needs 3 rope_long_factors > 0"):
        hf.load_model(directory, max_len=65)
