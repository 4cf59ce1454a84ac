"""Pretrained models from Hugging Face directories compute what `transformers` computes.

The directories under tests/fixtures/hf_models are tiny random models that
tests/fixtures/make_hf_models.py built and saved with `transformers`, with the logits,
greedy and beam-search tokens `transformers` computed from them. Where transformers is
installed, the last test builds them again and checks the stored expectations.
"""

import functools
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packaging.version import Version
from safetensors.numpy import load_file, save_file

from kvjax import decode, hf, text
from kvjax import model as M

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf_models"
NAMES = ("gpt2", "llama_gqa", "llama_mqa", "qwen2", "marian", "qwen3", "mistral", "phi3",
         "gemma2", "gemma3_text", "smollm3", "granite", "olmo2", "olmo3", "gpt_neox",
         "phi", "stablelm", "opt", "gemma", "starcoder2", "mixtral", "qwen3_moe", "olmoe",
         "granitemoe", "qwen2_moe", "gpt_oss", "gpt_oss_mxfp4", "glm", "glm4", "helium",
         "ernie4_5", "seed_oss", "ministral", "exaone4", "cohere", "cohere2", "nemotron",
         "arcee", "ministral3", "mistral3", "gemma3", "apertus", "hunyuan_v1_dense", "opt_350m",
         "phimoe", "nanochat", "olmo", "gpt_bigcode", "gpt_bigcode_mha", "gpt_neo", "gptj",
         "exaone", "internlm3", "falcon", "falcon_grouped", "falcon_sequential", "falcon2",
         "bloom", "mpt", "t5", "t5_relu", "mt5", "vaultgemma", "m2m_100", "bart", "mbart",
         "umt5", "flex_olmo", "granitemoehybrid", "granitemoeshared", "granitemoehybrid_moe",
         "hyperclovax", "jais2", "iquestcoder", "ernie4_5_moe", "glm4_moe", "dots1",
         "deepseek_v3", "glm4_moe_lite", "deepseek_v2", "hunyuan_v1_moe")
MODEL_TYPES = {"gpt2": "gpt2", "llama_gqa": "llama", "llama_mqa": "llama", "qwen2": "qwen2",
               "marian": "marian", "qwen3": "qwen3", "mistral": "mistral", "phi3": "phi3",
               "gemma2": "gemma2", "gemma3_text": "gemma3_text", "smollm3": "smollm3",
               "granite": "granite", "olmo2": "olmo2", "olmo3": "olmo3", "gpt_neox": "gpt_neox",
               "phi": "phi", "stablelm": "stablelm", "opt": "opt", "gemma": "gemma",
               "starcoder2": "starcoder2", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe",
               "olmoe": "olmoe", "granitemoe": "granitemoe", "qwen2_moe": "qwen2_moe",
               "gpt_oss": "gpt_oss", "gpt_oss_mxfp4": "gpt_oss", "glm": "glm", "glm4": "glm4",
               **{name: name for name in ("helium", "ernie4_5", "seed_oss", "ministral",
                                          "exaone4", "cohere", "cohere2", "nemotron", "arcee",
                                          "ministral3", "apertus", "hunyuan_v1_dense",
                                          "nanochat", "olmo", "gpt_bigcode", "gpt_neo",
                                          "gptj", "exaone", "internlm3")},
               # The language models of vision-language directories (`text_of_multimodal.py`).
               "mistral3": "ministral3", "gemma3": "gemma3_text", "opt_350m": "opt",
               "phimoe": "phimoe", "gpt_bigcode_mha": "gpt_bigcode",
               **dict.fromkeys(("falcon", "falcon_grouped", "falcon_sequential", "falcon2"),
                               "falcon"), "bloom": "bloom", "mpt": "mpt", "t5": "t5",
               "t5_relu": "t5", "mt5": "mt5", "vaultgemma": "vaultgemma", "m2m_100": "m2m_100",
               "bart": "bart", "mbart": "mbart", "umt5": "umt5", "flex_olmo": "flex_olmo",
               "granitemoehybrid": "granitemoehybrid", "granitemoehybrid_moe": "granitemoehybrid",
               "granitemoeshared": "granitemoeshared", "hyperclovax": "hyperclovax",
               "jais2": "jais2", "iquestcoder": "iquestcoder", "ernie4_5_moe": "ernie4_5_moe",
               "glm4_moe": "glm4_moe", "dots1": "dots1", "deepseek_v3": "deepseek_v3",
               "glm4_moe_lite": "glm4_moe_lite", "deepseek_v2": "deepseek_v2",
               "hunyuan_v1_moe": "hunyuan_v1_moe"}


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def load(name):
        if name not in cache:
            cache[name] = hf.load_pretrained(FIXTURES / name)
        return cache[name]

    return load


def expected(name):
    directory = FIXTURES / name
    return (json.loads((directory / "expected.json").read_text()),
            load_file(str(directory / "expected.safetensors")))


@functools.partial(jax.jit, static_argnums=0)
def _teacher_forced(config, params, batch):
    return M.teacher_forced_logits(config, params, batch)


def teacher_forced(config, params, record, continued=False):
    """Each prompt's logits [T_i, V] (Marian: of `targets[i]` given source i), from one
    compiled forward over the padded batch; `continued`: each decoder-only prompt followed by
    transformers' greedy tokens but the last, whose logits come after the prompt's."""
    def padded(rows):
        lengths = [len(row) for row in rows]
        tokens = np.zeros((len(rows), max(lengths)), np.int32)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = row
        return tokens, np.array(lengths, np.int32)

    rows = record["targets"] if config.is_encoder_decoder else record["prompts"]
    if continued and not config.is_encoder_decoder:
        rows = [prompt + greedy[:-1] for prompt, greedy in zip(rows, record["greedy"],
                                                              strict=True)]
    inputs, lengths = padded(rows)
    batch = {"inputs": inputs, "lengths": lengths}
    if config.is_encoder_decoder:
        batch["source"], batch["source_lengths"] = padded(record["prompts"])
    logits = np.asarray(_teacher_forced(config, params, batch))
    return [logits[i, :n] for i, n in enumerate(lengths)]


def relative_error(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check_logits_and_greedy_tokens(config, params, record, logits):
    """Each prompt's logits within 1e-5 of `logits` (relative), and for a decoder-only model
    each of `record`'s greedy tokens the argmax of the logits before it."""
    for i, got in enumerate(teacher_forced(config, params, record, continued=True)):
        prompt_logits = logits[f"logits_{i}"]
        assert relative_error(got[:len(prompt_logits)], prompt_logits) <= 1e-5
        if not config.is_encoder_decoder:
            prompt_len = len(record["prompts"][i])
            assert got[prompt_len - 1:].argmax(-1).tolist() == record["greedy"][i]


# Every family's greedy tokens are checked as the argmax of one forward over the prompts and
# transformers' tokens, which holds the family's layers to transformers' at every position
# `generate` decodes. `generate` itself (a prefill, then steps through the cache) and beam
# search (which reorders the cache) run on one family of each kind of cache: learned positions,
# an encoder's, sliding windows, windows beside full layers with softcapped scores, each layer's
# own RoPE base beside windows, a layer without positions (and one beside windowed layers with
# RoPE and norms on each sublayer's output), a mixture of experts with a shared expert and one
# routed by SparseMixer, queries scaled by position, keys normed after RoPE, ALiBi, T5's
# relative position buckets, UMT5's table in each layer, and a dense layer before mixtures
# whose experts are chosen with a bias of each. Cached decoding equals the full
# forward for every option the families use (tests/model/test_transformer.py and the
# options' own tests).
BEAM_FAMILIES = ("gpt2", "marian", "mistral", "gemma2", "qwen2_moe")
GENERATE_FAMILIES = BEAM_FAMILIES + ("gemma3_text", "smollm3", "exaone4", "cohere2",
                                     "ministral3", "hunyuan_v1_dense", "phimoe", "nanochat",
                                     "bloom", "t5", "mbart", "umt5", "ernie4_5_moe", "dots1",
                                     "deepseek_v3", "glm4_moe_lite", "deepseek_v2")


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_tokens_equal_transformers(loaded, name):
    config, tokenizer, params = loaded(name)
    record, logits = expected(name)
    assert config.tie_embeddings == (name in ("gpt2", "llama_mqa", "marian", "qwen3", "gemma2",
                                              "smollm3", "opt", "gemma", "starcoder2",
                                              "granitemoe", "ernie4_5", "ernie4_5_moe",
                                              "exaone4", "cohere",
                                              "cohere2", "gemma3", "olmo", "gpt_bigcode_mha",
                                              "gpt_neo", "exaone", "falcon",
                                              "falcon_sequential", "falcon2", "bloom",
                                              "mpt", "t5", "t5_relu", "mt5", "vaultgemma",
                                              "bart", "umt5", "granitemoehybrid"))
    assert config.qk_norm == (name in ("qwen3", "gemma3_text", "olmo2", "olmo3", "qwen3_moe",
                                       "olmoe", "exaone4", "gemma3", "apertus",
                                       "hunyuan_v1_dense", "nanochat", "flex_olmo",
                                       "glm4_moe", "dots1", "hunyuan_v1_moe"))
    assert config.qk_norm_after_rope == (name in ("hunyuan_v1_dense", "nanochat",
                                                  "hunyuan_v1_moe"))
    # nanochat and OLMo (1): no norm holds a learned parameter; nanochat's normalise the
    # embeddings too.
    assert (config.norm_params, config.embedding_norm) == {
        "nanochat": (False, True), "olmo": (False, False), "bloom": (True, True),
        "bart": (True, True), "mbart": (True, True)}.get(name, (True, False))
    # BART and mBART: the encoder's and the decoder's own learned positions and norms.
    assert config.per_stack_embeddings == (name in ("bart", "mbart"))
    assert (config.positional_encoding == "alibi") == (name in ("bloom", "mpt"))
    # M2M100: fairseq's sinusoids, the first position numbered after the padding id (1).
    assert (config.sinusoid_layout, config.sinusoid_offset) == {
        "marian": ("halves", 0), "m2m_100": ("fairseq", 2)}.get(name, ("interleaved", 0))
    # T5: buckets of distance, 8 up to 16 or the default 32 up to 128, a table for each
    # stack (UMT5: for each layer); the decoder's output scaled by 1/√d_model where
    # scale_decoder_outputs says.
    assert (config.positional_encoding == "relative") == (name in ("t5", "t5_relu", "mt5",
                                                                   "umt5"))
    assert (config.relative_buckets, config.relative_max_distance) == (
        (8, 16) if name in ("t5", "umt5") else (32, 128))
    assert config.relative_bias_per_layer == (name == "umt5")
    assert config.qkv_clip == {"olmo": 0.5, "olmoe": 1.0, "mpt": 1.0}.get(name)
    # GPTBigCode: one kv head (multi_query), or one per query head with unscaled attention;
    # GPT-Neo's attention unscaled.
    # Falcon: one kv head (multi_query), two (the new architecture), one per query head; MPT
    # its own softmax_scale.
    if name.startswith(("gpt_bigcode", "gpt_neo", "falcon", "mpt")):
        assert (config.kv_heads, config.attention_scale) == {
            "gpt_bigcode": (1, None), "gpt_bigcode_mha": (4, 1.0), "gpt_neo": (4, 1.0),
            "gpt_neox": (4, None), "falcon": (1, None), "falcon_grouped": (2, None),
            "falcon_sequential": (4, None), "falcon2": (2, None), "mpt": (4, 0.25)}[name]
    assert config.logits_softcap == {"gemma2": 8.0, "nanochat": 2.0, "vaultgemma": 8.0}.get(name)
    assert config.qk_norm_across_heads == (name in ("olmo2", "olmo3", "olmoe", "flex_olmo"))
    assert (config.norm == "output") == (name in ("olmo2", "olmo3", "exaone4", "flex_olmo"))
    assert (config.num_experts, config.experts_per_token, config.normalize_expert_weights) == {
        "mixtral": (4, 2, True), "qwen3_moe": (8, 2, True), "olmoe": (8, 3, False),
        "granitemoe": (4, 2, True), "qwen2_moe": (8, 2, False), "phimoe": (4, 2, False),
        "flex_olmo": (4, 2, True), "granitemoeshared": (4, 2, True),
        "granitemoehybrid_moe": (4, 2, True), "ernie4_5_moe": (4, 2, True),
        "glm4_moe": (8, 2, True), "dots1": (8, 3, False), "deepseek_v3": (8, 2, True),
        "glm4_moe_lite": (8, 3, True), "deepseek_v2": (8, 3, False),
        "hunyuan_v1_moe": (8, 2, True)}.get(
        name, (4, 2, True) if name.startswith("gpt_oss") else (0, 2, True))
    gpt_oss = name.startswith("gpt_oss")
    assert (config.attention_sinks, config.router_bias, config.activation == "clamped_swiglu",
            config.ffn_bias and config.num_experts > 0) == (gpt_oss,) * 4
    assert (config.swiglu_alpha, config.swiglu_limit) == ((1.5, 0.5) if gpt_oss else (1.702, 7.0))
    assert (config.shared_expert_d_ff, config.shared_expert_gate) == {
        "qwen2_moe": (40, True), "granitemoeshared": (40, False),
        "granitemoehybrid_moe": (40, False), "ernie4_5_moe": (16, False),
        "glm4_moe": (16, False), "dots1": (32, False), "deepseek_v3": (16, False),
        "glm4_moe_lite": (16, False), "deepseek_v2": (32, False),
        "hunyuan_v1_moe": (64, False)}.get(name, (0, False))
    # ERNIE 4.5's, GLM-4.5's and dots.llm1's mixtures: layer 0 dense, the experts chosen with
    # a bias of each; GLM's and dots' by DeepSeek-V3's router.
    assert (config.dense_ffn_layers, config.dense_d_ff, config.router_selection_bias) == {
        "ernie4_5_moe": ((0,), 64, True), "glm4_moe": ((0,), 64, True),
        "dots1": ((0,), 64, True), "deepseek_v3": ((0,), 64, True),
        "glm4_moe_lite": ((0, 2), 64, True), "deepseek_v2": ((0,), 64, False)}.get(
        name, ((), 0, False))
    assert (config.router_scoring, config.router_groups, config.router_groups_kept,
            config.routed_scaling) == {"glm4_moe": ("sigmoid", 4, 2, 2.5),
                                       "dots1": ("sigmoid", 2, 1, 1.5),
                                       "deepseek_v3": ("sigmoid", 4, 2, 2.5),
                                       "glm4_moe_lite": ("sigmoid", 1, 1, 1.8),
                                       "deepseek_v2": ("softmax", 4, 2, 1.5)}.get(
        name, ("softmax", 1, 1, 1.0))
    assert config.router_group_score == ("best" if name == "deepseek_v2" else "two_best")
    # DeepSeek's latent attention: kv and q ranks, each head's unturned key and value widths.
    assert (config.latent_kv_rank, config.latent_q_rank, config.latent_nope_dim,
            config.latent_value_dim) == {"deepseek_v3": (12, 16, 8, 6),
                                         "glm4_moe_lite": (12, 0, 12, 20),
                                         "deepseek_v2": (12, 0, 8, 8)}.get(name, (0, 0, 0, 0))
    assert config.sliding_window == {"mistral": 4, "phi3": 6, "gemma2": 4,
                                     "gemma3_text": 5, "olmo3": 4, "starcoder2": 4,
                                     "qwen2": 4, "ministral": 4, "exaone4": 4, "cohere2": 4,
                                     "gemma3": 5, "gpt_neo": 4, "vaultgemma": 4, "dots1": 4}.get(
        name, 4 if gpt_oss else None)
    assert config.full_attention_layers == {"gemma2": (1,), "gemma3_text": (2,),
                                            "olmo3": (1,), "qwen2": (0,), "ministral": (1,),
                                            "exaone4": (2,), "cohere2": (2,),
                                            "gemma3": (2,), "gpt_neo": (0,),
                                            "vaultgemma": (1,), "dots1": (0, 1)}.get(
        name, (1,) if gpt_oss else ())
    assert config.local_rope_base == {"gemma3_text": 10000.0, "olmo3": 50000.0,
                                      "gemma3": 10000.0}.get(name)
    # Granite 4.0's mixture: no position encoding in any layer.
    assert config.unrotated_layers == {"smollm3": (1,), "exaone4": (2,), "cohere2": (2,),
                                       "granitemoehybrid_moe": (0, 1)}.get(name, ())
    biases = (config.qkv_bias, config.out_bias, config.ffn_bias)
    assert biases == {"helium": (True, False, False), "ernie4_5": (True, True, True),
                      "seed_oss": (True, True, False), "cohere": (True, True, False),
                      "cohere2": (False, False, False), "nemotron": (True, True, True),
                      "arcee": (False, False, False), "nanochat": (True, True, False),
                      "internlm3": (True, True, True), "falcon_sequential": (True, True, True),
                      "bloom": (True, True, True), "mpt": (False, False, False),
                      "jais2": (True, True, True), "glm4_moe": (True, False, False),
                      **dict.fromkeys(("falcon", "falcon_grouped", "falcon2"),
                                      (False, False, False))}.get(name, biases)
    assert config.parallel_residual == (name in ("gpt_neox", "phi", "cohere", "cohere2",
                                                 "gptj", "falcon", "falcon_grouped", "falcon2"))
    assert config.shared_norm == (name in ("phi", "cohere", "cohere2", "gptj", "falcon",
                                           "falcon2"))
    assert config.logits_bias == (name in ("phi", "marian", "phimoe", "gptj", "bart", "mbart"))
    assert config.sparsemixer_eps == (0.2 if name == "phimoe" else None)
    assert (config.query_scale_beta, config.query_scale_length) == (
        (0.5, 4) if name in ("ministral3", "mistral3") else (0.0, 1))
    assert config.rotary_dim == {"gpt_neox": 4, "phi": 2, "stablelm": 4, "glm": 4,
                                 "glm4": 4, "nemotron": 4, "gptj": 4, "glm4_moe": 4,
                                 "deepseek_v3": 4, "glm4_moe_lite": 4,
                                 "deepseek_v2": 4}.get(name,
                                                                          config.rotary_dim)
    assert (config.activation == "relu2") == (name in ("nemotron", "arcee", "nanochat", "jais2"))
    assert (config.activation == "xielu") == (name == "apertus")
    assert (config.activation == "gelu_exact") == (name in ("gpt_neox", "falcon", "falcon2",
                                                            "falcon_grouped",
                                                            "falcon_sequential", "mpt",
                                                            "bart", "mbart"))
    assert config.sandwich_norms == (name in ("gemma2", "gemma3_text", "glm4", "gemma3",
                                              "hyperclovax"))
    assert (config.norm_type == "layernorm") == (name in ("gpt2", "marian", "gpt_neox", "phi",
                                                          "stablelm", "opt", "starcoder2",
                                                          "cohere", "cohere2", "nemotron",
                                                          "opt_350m", "phimoe", "olmo", "jais2",
                                                          "gpt_bigcode", "gpt_bigcode_mha",
                                                          "gpt_neo", "gptj", "falcon",
                                                          "falcon_grouped",
                                                          "falcon_sequential", "falcon2",
                                                          "bloom", "mpt", "m2m_100", "bart",
                                                          "mbart"))
    # OPT-350m: post-LN layers and a table narrower than the layers, projected in and out.
    assert (config.norm == "post", config.embedding_dim) == (
        (True, 16) if name == "opt_350m" else (name in ("marian", "bart"), None))
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_scale,
            config.logits_scaling) == {
        **dict.fromkeys(("granite", "granitemoe", "granitemoehybrid", "granitemoeshared"),
                        (2.0, 0.5, 0.25, 2.0)), "granitemoehybrid_moe": (1.0, 0.5, 0.25, 1.0),
        "hyperclovax": (2.0, 0.5, 0.25, 2.0)  # the logits multiplied by 0.5
        }.get(name, (1.0, 1.0, config.attention_scale,
                     {"cohere": 4.0, "cohere2": 2.0, "t5_relu": 32 ** 0.5}.get(name, 1.0)))
    # Granite 4.0's dense FFN: the shared_mlp's 48 hidden units.
    if name == "granitemoehybrid":
        assert config.d_ff == 48
    check_logits_and_greedy_tokens(config, params, record, logits)
    if name in GENERATE_FAMILIES:  # the prompts run as one ragged batch
        greedy = decode.generate(M.build_model(config), params, record["prompts"],
                                 **generation_settings(record))
        assert greedy.token_lists() == record["greedy"]


def generation_settings(record):
    return dict(max_new_tokens=record["max_new_tokens"], eos_ids=(record["eos_id"],))


@pytest.mark.parametrize("name", BEAM_FAMILIES)
def test_beam_search_equals_transformers(loaded, name):
    config, _, params = loaded(name)
    record, _ = expected(name)
    beam = decode.beam_search(M.build_model(config), params, record["prompts"],
                              num_beams=record["num_beams"], **generation_settings(record))
    assert beam.token_lists() == record["beam"]
    assert record["beam"] != record["greedy"]  # the beams found something else to prefer
    if "beams" in record:  # every beam, as transformers' num_return_sequences ranks them
        every = decode.beam_search(M.build_model(config), params, record["prompts"],
                                   num_beams=record["num_beams"], **generation_settings(record),
                                   num_return_sequences=record["num_beams"])
        assert every.token_lists() == [tokens for beams in record["beams"] for tokens in beams]
        assert np.all(np.diff(every.scores.reshape(len(record["prompts"]), -1)) <= 0)


@pytest.mark.parametrize("name", ["llama_gqa", "smollm3"])  # SmolLM3: a traced NoPE layer
def test_scanned_layers_load_the_same_model(name):
    scanned_config, _, scanned = hf.load_pretrained(FIXTURES / name, scan_layers=True)
    assert scanned_config.scan_layers
    record, logits = expected(name)
    assert relative_error(teacher_forced(scanned_config, scanned, record)[1],
                          logits["logits_1"]) <= 1e-5


def test_bfloat16_weights_load_as_asked():
    config, _, params = hf.load_pretrained(FIXTURES / "llama_mqa", dtype="bfloat16")
    assert config.dtype == config.param_dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
    record, logits = expected("llama_mqa")
    # The files hold bfloat16 weights; only the computation rounds differently.
    assert relative_error(teacher_forced(config, params, record)[0], logits["logits_0"]) < 0.05
    # Read with int8 kernels: what quantizing the loaded model gives.
    loaded = text.load(FIXTURES / "llama_mqa", dtype="bfloat16", kernel_dtype="int8")
    want_config, want = M.with_precision(config, params, kernel_dtype="int8")
    assert loaded.config == want_config and loaded.config.kernel_dtype == "int8"
    assert jax.tree.structure(loaded.params) == jax.tree.structure(want)
    for got, leaf in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want), strict=True):
        assert got.dtype == leaf.dtype
        np.testing.assert_array_equal(got, leaf)


def test_a_router_s_selection_bias_stays_float32_in_a_bfloat16_model(loaded):
    """DeepSeek-V3's `e_score_correction_bias` picks experts by small differences of float32
    scores: read into a bfloat16 model it stays float32, as transformers keeps it, the dtype
    the model declares for it, and so does the float32 model cast to bfloat16."""
    config, _, params = hf.load_pretrained(FIXTURES / "deepseek_v3", dtype="bfloat16")
    dtypes = {jax.tree_util.keystr(path): leaf.dtype
              for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    biases = {name for name in dtypes if name.endswith("['selection_bias']")}
    assert biases and {dtypes[name] for name in biases} == {jnp.dtype("float32")}
    assert {dtypes[name] for name in dtypes.keys() - biases} == {jnp.dtype("bfloat16")}
    declared = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    assert jax.tree.map(lambda x: x.dtype, params) == jax.tree.map(lambda x: x.dtype, declared)
    float_config, _, float_params = loaded("deepseek_v3")
    cast_config, cast = M.with_precision(float_config, float_params, "bfloat16")
    assert cast_config == config
    for got, want in zip(jax.tree.leaves(cast), jax.tree.leaves(params), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    record, logits = expected("deepseek_v3")
    assert relative_error(teacher_forced(config, params, record)[0], logits["logits_0"]) < 0.05


# Copies of the fixtures to change, for the tests of bad input here and in the other files.


def copy_of(name, tmp_path, fixtures=FIXTURES):
    """A copy of the fixture `name` of `fixtures` under `tmp_path`, to change."""
    target = tmp_path / fixtures.name / name
    shutil.copytree(fixtures / name, target)
    return target


def edit_config(directory, file="config.json", **changes):
    """`changes` made to the JSON object in `directory / file`; a value None removes its
    key."""
    path = directory / file
    values = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    path.write_text(json.dumps(values))


def rewrite_tensor(path, name, transform):
    tensors = load_file(str(path))
    tensors = {k: v for k, v in ((k, transform(v) if k == name else v)
                                 for k, v in tensors.items()) if v is not None}
    save_file(tensors, str(path))


def test_fixtures_are_what_transformers_computes(tmp_path):
    transformers = pytest.importorskip("transformers")
    # Config defaults and the families a release knows change between transformers releases:
    # the fixtures are what the releases that wrote them compute, and an older one cannot
    # write them.
    written_by = max((json.loads((FIXTURES / name / "config.json").read_text())
                      ["transformers_version"] for name in NAMES), key=Version)
    if Version(transformers.__version__) < Version(written_by):
        pytest.skip(f"the fixtures were written by transformers {written_by}, this is the older "
                    f"{transformers.__version__}")
    spec = importlib.util.spec_from_file_location("make_hf_models",
                                                  FIXTURES.parent / "make_hf_models.py")
    make_hf_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_hf_models)
    make_hf_models.main(tmp_path)
    # Tokens exactly; float32 sums (the logits, a mixture's load-balancing loss) as another
    # machine's kernels add them, within 1e-5 of the largest.
    for name in NAMES:
        fresh = json.loads((tmp_path / name / "expected.json").read_text())
        record, logits = expected(name)
        loss, fresh_loss = record.pop("router_aux_loss", 0.0), fresh.pop("router_aux_loss", 0.0)
        assert fresh == record, name
        assert abs(fresh_loss - loss) <= 1e-5 * abs(loss), name
        fresh_logits = load_file(str(tmp_path / name / "expected.safetensors"))
        for key, value in logits.items():
            assert relative_error(fresh_logits[key], value) <= 1e-5, (name, key)
