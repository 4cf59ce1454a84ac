"""kvjax/hf/peft.py: a PEFT LoRA adapter merged into a Hugging Face model computes what PEFT
computes with it unmerged, and every setting or tensor kvjax would not merge is refused.

The adapters under tests/fixtures/hf_adapters were made with `peft` on models of
tests/fixtures/hf_models by tests/fixtures/make_peft_adapters.py, with the logits and greedy
tokens PEFT computed; where peft is installed, the last test makes them again and compares.
"""

import functools
import importlib.util
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_cli
from packaging.version import Version
from safetensors.numpy import load_file, save_file
from test_hf_models import (
    FIXTURES,
    MODEL_TYPES,
    check_logits_and_greedy_tokens,
    copy_of,
    edit_config,
    generation_settings,
    relative_error,
)

from kvjax import checkpoint, decode, hf, text
from kvjax import model as M
from kvjax.model import lora as L
from kvjax.model import lora_rows

ADAPTERS = Path(__file__).parents[1] / "fixtures" / "hf_adapters"
NAMES = ("llama_gqa", "phi3", "gpt2", "phi", "opt", "gpt_neox", "starcoder2", "mixtral",
         "glm4", "gpt_oss", "gemma3", "cohere", "cohere2", "arcee", "nemotron", "apertus",
         "hunyuan_v1_dense", "marian", "phimoe", "nanochat", "gpt_bigcode", "gpt_bigcode_mha",
         "gpt_neo", "gptj", "falcon_grouped", "bloom", "mpt", "mt5", "m2m_100", "bart", "umt5",
         "granitemoehybrid", "granitemoehybrid_moe", "hyperclovax", "ernie4_5_moe", "glm4_moe",
         "dots1", "hunyuan_v1_moe", "deepseek_v3", "deepseek_v2", "glm4_moe_lite",
         "mixtral_experts", "qwen3_moe", "granitemoe", "glm4_moe_lite_experts", "glm4_moe_experts",
         "mixtral_per_expert", "qwen3_moe_per_expert", "qwen2_moe_all_linear", "granitemoeshared",
         "deepseek_v3_shared", "dots1_shared", "hunyuan_v1_moe_shared", "mixtral_all_linear",
         "deepseek_v3_all_linear", "hunyuan_v1_moe_router")


def expected(name):
    directory = ADAPTERS / name
    return (json.loads((directory / "expected.json").read_text()),
            load_file(str(directory / "expected.safetensors")))


@pytest.mark.parametrize("name", NAMES)
def test_the_merged_adapter_computes_what_peft_computes(name):
    record, logits = expected(name)
    config, _, params = hf.load_pretrained(FIXTURES / record["base"], lora=ADAPTERS / name)
    # Merged, the adapters are the base family's params: `generate` decodes them as the
    # family's own tests check (tests/hf/test_hf_models.py).
    check_logits_and_greedy_tokens(config, params, record, logits)
    if config.is_encoder_decoder:  # its greedy tokens, which the check above leaves out
        greedy = decode.generate(M.build_model(config), params, record["prompts"],
                                 **generation_settings(record))
        assert greedy.token_lists() == record["greedy"]
    base_greedy = json.loads((FIXTURES / record["base"] / "expected.json").read_text())["greedy"]
    assert record["greedy"] != base_greedy  # the adapter changes what the model writes


def test_alpha_pattern_scales_the_modules_it_names(tmp_path):
    """PEFT's `alpha_pattern`: a module whose name a key ends gets that key's lora_alpha (the
    first key that matches), the others lora_alpha (16 here)."""
    _, _, base = hf.load_pretrained(FIXTURES / "llama_gqa")
    _, _, plain = hf.load_pretrained(FIXTURES / "llama_gqa", lora=ADAPTERS / "llama_gqa")
    directory = copy_of("llama_gqa", tmp_path, ADAPTERS)
    edit_config(directory, "adapter_config.json",
                alpha_pattern={r"layers\.1\.mlp\.down_proj": 48, "down_proj": 32})
    _, _, patterned = hf.load_pretrained(FIXTURES / "llama_gqa", lora=directory)
    for layer, factor in (("0", 2.0), ("1", 3.0)):
        def kernel(params, layer=layer):
            return np.asarray(params["layers"][layer]["ffn"]["wo"]["kernel"], np.float64)

        np.testing.assert_allclose(kernel(patterned) - kernel(base),
                                   factor * (kernel(plain) - kernel(base)), rtol=1e-4, atol=1e-6)
        attention = ("self_attention", "qkv", "kernel")
        np.testing.assert_array_equal(L.get(patterned["layers"][layer], attention),
                                      L.get(plain["layers"][layer], attention))


def test_a_mixtures_dense_layer_takes_its_ffn_adapter_at_its_own_width(tmp_path):
    """GLM-4.5's first layer is a dense FFN (64 wide; its experts' 16): an adapter of its
    down_proj merges as the formula says, and served beside the base computes the same."""
    directory = tmp_path / "dense"
    directory.mkdir()
    a_RI = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    b_OR = np.random.default_rng(1).standard_normal((32, 2)).astype(np.float32)
    save_file({"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": a_RI,
               "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": b_OR},
              str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 6, "target_modules": ["down_proj"]}))
    config, _, base = hf.load_pretrained(FIXTURES / "glm4_moe")
    _, _, merged = hf.load_pretrained(FIXTURES / "glm4_moe", lora=directory)
    np.testing.assert_allclose(merged["layers"]["0"]["ffn"]["wo"]["kernel"],
                               base["layers"]["0"]["ffn"]["wo"]["kernel"] + 3.0 * a_RI.T @ b_OR.T,
                               rtol=1e-5, atol=1e-6)
    adapters, lora = hf.load_peft_adapters(FIXTURES / "glm4_moe", directory)
    stack = lora_rows.stack(config, base, [(adapters, lora)])
    tokens = np.array([[5, 9, 3, 7], [5, 9, 3, 7]], np.int32)
    batch = {"inputs": tokens, "lengths": np.array([4, 4], np.int32)}
    got = np.asarray(_with_adapters(config, base, batch, stack, np.array([1, 0], np.int32)))
    for row, params in enumerate((merged, base)):
        want = np.asarray(M.teacher_forced_logits(config, params, batch))[row]
        assert relative_error(got[row], want) <= 1e-5


def test_only_the_adapted_kernels_change_and_the_loaded_base_is_left_as_it_was():
    _, _, base = hf.load_pretrained(FIXTURES / "phi3")
    _, _, merged = hf.load_pretrained(FIXTURES / "phi3", lora=ADAPTERS / "phi3")
    flat_base = dict(jax.tree_util.tree_leaves_with_path(base))
    flat_merged = dict(jax.tree_util.tree_leaves_with_path(merged))
    changed = sorted(jax.tree_util.keystr(path) for path in flat_base
                     if not np.array_equal(flat_base[path], flat_merged[path]))
    assert changed == [f"['layers']['{i}']['{module}']['{kernel}']['kernel']"
                       for i in range(2) for module, kernel in (
                           ("ffn", "wi"), ("ffn", "wi_gate"), ("ffn", "wo"),
                           ("self_attention", "out"), ("self_attention", "qkv"))]


@pytest.mark.parametrize("changes, message", [
    (dict(use_dora=True), "kvjax does not implement use_dora=true"),
    (dict(peft_type="IA3"), 'peft_type="IA3" is not supported (kvjax merges LoRA adapters)'),
    (dict(bias="lora_only"), 'bias="lora_only" is not supported'),
    (dict(alpha_pattern={"q_proj": -1}), "lora_alpha=-1 must be a number > 0"),
    (dict(modules_to_save=["lm_head"]), 'modules_to_save=["lm_head"]'),
    (dict(lora_alpha=0), "lora_alpha=0 must be a number > 0"),
    (dict(init_lora_weights="pissa_niter_4"), 'init_lora_weights="pissa_niter_4" changed the '
                                               "base weights the adapter was trained over"),
    (dict(init_lora_weights="olora"), "path_initial_model_for_weight_conversion"),
    (dict(target_parameters=["mlp.router.weight"]),
     'target_parameters=["mlp.router.weight"] is not supported'),
    (dict(target_parameters=["mlp.experts.down_proj"]),
     "adapt experts, and this llama model has none"),
])
def test_settings_kvjax_does_not_merge_are_refused(tmp_path, changes, message):
    directory = copy_of("llama_gqa", tmp_path, ADAPTERS)
    edit_config(directory, "adapter_config.json", **changes)
    with pytest.raises(ValueError) as error:
        hf.load_pretrained(FIXTURES / "llama_gqa", lora=directory)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "base_model.model.model.embed_tokens.lora_embedding_A": np.ones((4, 8),
                                                                                    np.float32)},
     "tensor base_model.model.model.embed_tokens.lora_embedding_A adapts no module"),
    (lambda t: {k: v for k, v in t.items() if "layers.1.mlp.down_proj.lora_B" not in k},
     "mlp.down_proj of layer 1 has lora_A without its lora_B"),
    (lambda t: {k: (v[:, :-1] if "layers.0.mlp.down_proj.lora_A" in k else v)
                for k, v in t.items()},
     "down_proj.lora_B.weight makes an update of [63, 32]; the model's wo takes 64 inputs"),
])
def test_tensors_that_do_not_fit_the_model_are_named(tmp_path, change, message):
    directory = copy_of("llama_gqa", tmp_path, ADAPTERS)
    path = directory / "adapter_model.safetensors"
    save_file(change(load_file(str(path))), str(path))
    with pytest.raises(ValueError) as error:
        hf.load_pretrained(FIXTURES / "llama_gqa", lora=directory)
    assert message in str(error.value)


@pytest.mark.parametrize("base, module", [
    ("qwen3_moe", "layers.1.mlp.shared_expert.gate_proj"),  # a mixture without a shared expert
    ("deepseek_v3", "layers.0.mlp.shared_experts.up_proj"),  # a dense layer, before the experts
    ("llama_gqa", "layers.0.mlp.shared_expert_gate"),  # no mixture at all
])
def test_a_shared_experts_adapter_goes_only_where_the_layer_has_one(tmp_path, base, module):
    """Granite 4.0's shared_mlp is the layer's FFN where there are no experts and the shared
    expert beside them (both merge, tests above); a shared expert's module of a layer that
    has none is refused by name."""
    directory = copy_of("llama_gqa", tmp_path, ADAPTERS)
    path = directory / "adapter_model.safetensors"
    name = f"base_model.model.model.{module}.lora_A.weight"  # refused before any shape is read
    save_file({name: np.ones((2, 8), np.float32),
               name.replace("lora_A", "lora_B"): np.ones((8, 2), np.float32)}, str(path))
    with pytest.raises(ValueError, match=re.escape(f"tensor {name} adapts no module kvjax "
                                                   f"merges into a {MODEL_TYPES[base]} model")):
        hf.load_pretrained(FIXTURES / base, lora=directory)


MARIAN = "base_model.model.model.decoder.layers.1.encoder_attn.k_proj"


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, f"{MARIAN}.lora_B.weight": t[f"{MARIAN}.lora_B.weight"][:-1]},
     "k_proj.lora_B.weight makes an update of [32, 31]; the model's decoder "
     "encoder_attn.k_proj takes 32 inputs to 32 outputs"),
    (lambda t: {k.replace("encoder.layers.1.", "encoder.layers.2."): v for k, v in t.items()},
     "tensor base_model.model.model.encoder.layers.2.fc1.lora_A.weight adapts no module"),
])
def test_marian_tensors_that_do_not_fit_the_model_are_named(tmp_path, change, message):
    directory = copy_of("marian", tmp_path, ADAPTERS)
    path = directory / "adapter_model.safetensors"
    save_file(change(load_file(str(path))), str(path))
    with pytest.raises(ValueError, match=re.escape(message)):
        hf.load_pretrained(FIXTURES / "marian", lora=directory)


def test_an_adapter_goes_only_where_it_can_be_merged(tmp_path):
    with pytest.raises(ValueError, match="tensor base_model.model.model.layers.0.mlp.down_proj."
                                         "lora_A.weight adapts no module kvjax merges into a "
                                         "marian model"):
        hf.load_pretrained(FIXTURES / "marian", lora=ADAPTERS / "llama_gqa")
    with pytest.raises(ValueError, match="tensor base_model.model.model.decoder.layers.0."
                                         "encoder_attn.k_proj.lora_A.weight adapts no module "
                                         "kvjax merges into a opt model"):
        hf.load_pretrained(FIXTURES / "opt", lora=ADAPTERS / "marian")
    with pytest.raises(ValueError, match="is not a PEFT adapter .no adapter_config.json."):
        text.load(FIXTURES / "llama_gqa", lora=tmp_path)


def test_import_hf_writes_the_merged_model_that_sample_reads_back(tmp_path, capsys):
    out = tmp_path / "merged"
    code, stdout, err = run_cli(capsys, "import-hf", FIXTURES / "gpt2", out, "--lora",
                                ADAPTERS / "gpt2")
    assert code == 0, err
    _, _, want = hf.load_pretrained(FIXTURES / "gpt2", lora=ADAPTERS / "gpt2")
    _, _, got = checkpoint.load_for_sampling(out)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    with pytest.raises(ValueError, match="it merges into the Hugging Face directory it was "
                                         "trained on, and .* is a kvjax checkpoint"):
        text.load(out, lora=ADAPTERS / "gpt2")


def test_fixtures_are_what_peft_computes(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    # The fixtures are what the releases that wrote them compute (as the base models'
    # fixtures): an older transformers or peft computes the logits otherwise, in the 5th digit.
    bases = {json.loads((ADAPTERS / name / "expected.json").read_text())["base"]
             for name in NAMES}
    wrote = {"transformers": max((json.loads((FIXTURES / base / "config.json").read_text())
                                  ["transformers_version"] for base in bases), key=Version),
             "peft": max((json.loads((ADAPTERS / name / "adapter_config.json").read_text())
                          ["peft_version"] for name in NAMES), key=Version)}
    for package, installed in (("transformers", transformers), ("peft", peft)):
        if Version(installed.__version__) < Version(wrote[package]):
            pytest.skip(f"the fixtures were written by {package} {wrote[package]}, this is the "
                        f"older {installed.__version__}")
    spec = importlib.util.spec_from_file_location(
        "make_peft_adapters", ADAPTERS.parent / "make_peft_adapters.py")
    make_peft_adapters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_peft_adapters)
    make_peft_adapters.main(tmp_path)
    for name in NAMES:
        record, logits = expected(name)
        assert json.loads((tmp_path / name / "expected.json").read_text()) == record, name
        fresh = load_file(str(tmp_path / name / "expected.safetensors"))
        for key, value in logits.items():  # float32 sums round as the machine's kernels add
            assert relative_error(fresh[key], value) <= 1e-5, (name, key)


@pytest.mark.parametrize("name, targets", [
    ("phi3", ("q", "v", "o", "wi")),  # fused qkv and gate-up, some of their parts unadapted
    ("gpt2", ("q", "k", "v", "o", "wo")),  # c_proj of attention and of the MLP apart
    ("llama_gqa", ("k", "wi_gate")),
    ("phi", ("q", "o", "wi", "wo")),  # Phi-2's dense, fc1 and fc2
    ("opt", ("k", "o", "wo")),  # under model.decoder.layers
    ("gpt_neox", ("k", "v", "wi")),  # query_key_value's heads interleaved
    ("starcoder2", ("q", "wo")),
    ("glm4", ("q", "k", "wi_gate")),  # each head's query and key rows reordered
    ("gpt_oss", ("q", "wi", "wi_gate", "wo")),  # experts: gate_up_proj at twice the rank
    ("gpt_oss", ("wi_gate",)),  # gate_up_proj's up columns alone
    ("helium", ("q", "k", "wi")),  # RoPE over pairs, as GLM's, with Llama's names
    ("cohere", ("q", "k", "wi_gate")),  # RoPE over pairs too
    ("nemotron", ("k", "wi", "wo")),  # up_proj and down_proj alone
    ("nanochat", ("q", "k", "wi")),  # each head's halves swapped, fc1
    ("gpt_bigcode", ("k", "v", "o")),  # c_attn's one kv head
    ("gpt_bigcode_mha", ("q", "v", "wi")),  # c_attn's heads, each its q, k and v in turn
    ("gpt_neo", ("q", "o", "wo")),
    ("gptj", ("q", "k", "wo")),  # RoPE over pairs, fc_out
    ("falcon_grouped", ("q", "v", "o", "wi")),  # query_key_value by kv-head group
    ("falcon_sequential", ("k", "wo")),  # each head's q, k and v in turn
    ("bloom", ("q", "v", "o")),  # as GPT-NeoX's, under self_attention
    ("mpt", ("k", "wi", "wo")),  # Wqkv, under transformer.blocks
    ("ernie4_5_moe", ("q", "k")),  # a mixture's attention, RoPE over pairs
    ("glm4_moe", ("k", "v", "o")),
    # Encoder-decoders: both stacks' self-attention and FFN, never the cross-attention.
    ("marian", ("q", "k", "v", "o", "wi", "wo")),
    ("t5_relu", ("v", "wi")),  # an ungated FFN's wi
    ("mt5", ("q", "o", "wi", "wi_gate", "wo")),  # a gated one's wi_0 and wi_1
    # Latent attention: a query latent's q_b_proj, kv_b_proj's keys and values per head,
    # o_proj over values narrower than a head; q_proj without a query latent.
    ("deepseek_v3", ("q", "k", "v", "o", "router")),  # the router's weight a parameter
    ("deepseek_v2", ("k", "o")),
    ("glm4_moe_lite", ("q", "v")),
    # Mixtures' stacked experts: gate_up_proj the gates then the ups (gpt-oss's interleave
    # them), at twice the rank with both; GraniteMoE's under block_sparse_moe.
    ("mixtral", ("o", "wi", "wi_gate", "wo", "router")),  # the router at the experts' rank
    ("qwen3_moe", ("q", "wi_gate")),
    ("granitemoe", ("k", "wo")),
    # A shared expert and the gate scaling it (Qwen2-MoE's), beside experts; GraniteMoeShared's
    # shared_mlp, its gate and up projections in one input_linear.
    ("qwen2_moe", ("wi", "wo", "shared_wi", "shared_wo", "shared_expert_gate")),
    ("granitemoeshared", ("q", "shared_wi_gate", "shared_wo")),
])
def test_adapters_written_as_peft_merge_as_kvjax_merges_them(tmp_path, name, targets):
    from kvjax.hf.peft import write_peft_adapter

    config, _, params = hf.load_pretrained(FIXTURES / name)
    settings = M.LoRA(2, 6.0, targets)
    adapters = L.init_adapters(config, params, settings, jax.random.key(0))
    adapters = jax.tree_util.tree_map_with_path(  # B no longer zero
        lambda path, x: x + 0.1 if path[-1].key == "lora_b" else x, adapters)
    write_peft_adapter(config, MODEL_TYPES[name], adapters, settings, tmp_path / "peft",
                       str(FIXTURES / name))
    _, _, got = hf.load_pretrained(FIXTURES / name, lora=tmp_path / "peft")
    want = L.merge(config, params, adapters, settings)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6), got, want)
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert written["task_type"] == ("SEQ_2_SEQ_LM" if config.is_encoder_decoder
                                    else "CAUSAL_LM")
    # gpt-oss's gate_up_proj holds wi's and wi_gate's pairs at twice the rank, PEFT's r, the
    # attention's rank its rank_pattern.
    both = bool(config.num_experts) and {"wi", "wi_gate"} <= set(targets)
    assert written["r"] == (4 if both else 2) and written["lora_alpha"] == 6.0
    if config.num_experts and set(targets) & set(L.EXPERT_TARGETS):
        attention = [t for t in targets if t not in (*L.EXPERT_TARGETS, *L.MIXTURE_TARGETS)]
        assert ("mlp.gate.weight" in written["target_parameters"]) == ("router" in targets)
        assert written["rank_pattern"] == ({f"self_attn.{t}_proj": 2 for t in attention}
                                           if both else {})


def test_adapters_of_a_mixtures_dense_layers_are_not_written_as_peft(tmp_path):
    from kvjax.hf.peft import write_peft_adapter

    config, _, params = hf.load_pretrained(FIXTURES / "glm4_moe")  # layer 0 a dense FFN
    settings = M.LoRA(2, targets=("q", "wo"))
    adapters = L.init_adapters(config, params, settings, jax.random.key(0))
    with pytest.raises(ValueError, match=r"adapters of the dense FFN of the layers \[0\] of a "
                                         r"glm4_moe model \(wo\) are not written as a PEFT "
                                         "adapter"):
        write_peft_adapter(config, "glm4_moe", adapters, settings, tmp_path, "glm4_moe")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name, target, message", [
    # PEFT reads these mixtures' shared experts' gate_proj, up_proj and down_proj as experts'.
    ("dots1", "shared_wi", r"adapters of the shared expert of a dots1 model \(shared_wi\)"),
    # GraniteMoE's router is none of the modules PEFT's adapters of it name.
    ("granitemoe", "router", "adapters of the router of a granitemoe model"),
])
def test_adapters_peft_would_not_read_as_trained_are_not_written(tmp_path, name, target,
                                                                  message):
    from kvjax.hf.peft import write_peft_adapter

    config, _, params = hf.load_pretrained(FIXTURES / name)
    settings = M.LoRA(2, targets=("q", target))
    adapters = L.init_adapters(config, params, settings, jax.random.key(0))
    with pytest.raises(ValueError, match=message + " are not written as a PEFT adapter"):
        write_peft_adapter(config, MODEL_TYPES[name], adapters, settings, tmp_path, name)
    assert not any(tmp_path.iterdir())


@functools.partial(jax.jit, static_argnums=0)
def _with_adapters(config, params, batch, stack, adapter_B):
    return M.teacher_forced_logits(config, params, batch,
                                   adapters=lora_rows.for_rows(stack, adapter_B))


# A module the file fuses (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn) and rows kvjax
# holds in another order (GLM-4's queries and keys); a mixture's biased attention (Phi-3.5-MoE);
# latent attention's q_proj, kv_b_proj and o_proj (DeepSeek-V2); a mixture's experts, stacked
# (gpt-oss's interleaved, Mixtral's, Qwen3-MoE's, GraniteMoE's, GLM-4.5's at its own alpha) or
# each its own (Mixtral's before transformers 5.0); shared experts (Qwen2-MoE's with the gate
# scaling it, DeepSeek-V3's beside a dense first layer); PEFT's all-linear over Mixtral, its
# router's weight among the rest.
@pytest.mark.parametrize("name", ["phi3", "gpt2", "glm4", "cohere", "nemotron", "apertus",
                                  "hunyuan_v1_dense", "phimoe", "deepseek_v2", "gpt_oss",
                                  "mixtral_experts", "qwen3_moe", "granitemoe",
                                  "glm4_moe_experts", "mixtral_per_expert",
                                  "qwen2_moe_all_linear", "deepseek_v3_shared",
                                  "mixtral_all_linear"])
def test_served_unmerged_beside_the_base_an_adapter_computes_what_peft_computes(name):
    record, logits = expected(name)
    base = FIXTURES / record["base"]
    config, _, params = hf.load_pretrained(base)
    adapters, lora = hf.load_peft_adapters(base, ADAPTERS / name)
    stack = lora_rows.stack(config, params, [(adapters, lora)])
    base_logits = load_file(str(base / "expected.safetensors"))
    rows = [p + g[:-1] for p, g in zip(record["prompts"], record["greedy"], strict=True)]
    tokens = np.zeros((2 * len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows + rows):
        tokens[i, :len(row)] = row
    lengths = np.array([len(row) for row in rows + rows], np.int32)
    adapter_B = np.array([1] * len(rows) + [0] * len(rows), np.int32)  # adapted, then not
    got = np.asarray(_with_adapters(config, params, {"inputs": tokens, "lengths": lengths},
                                    stack, adapter_B))
    for i in range(len(rows)):
        for row, want in ((i, logits[f"logits_{i}"]),
                          (len(rows) + i, base_logits[f"logits_{i}"])):
            assert relative_error(got[row, :len(want)], want) <= 1e-5


# An encoder-decoder's; latent attention's down projections (q_a_proj, kv_a_proj_with_mqa).
@pytest.mark.parametrize("name", ["marian", "mt5", "m2m_100", "deepseek_v3"])
def test_adapters_that_only_merge_are_not_served_beside_others(name):
    with pytest.raises(hf.UnsupportedModelError, match="are merged, not served beside others"):
        hf.load_peft_adapters(FIXTURES / expected(name)[0]["base"], ADAPTERS / name)


def test_serve_reads_peft_adapters_to_serve_side_by_side(capsys, monkeypatch, tmp_path):
    built = {}
    monkeypatch.setattr("kvjax.serve.server.build_app",
                        lambda loaded, **options: built.update(options, loaded=loaded))
    monkeypatch.setattr("uvicorn.run", lambda *args, **kwargs: None)
    code, _, err = run_cli(capsys, "serve", "--checkpoint", FIXTURES / "gpt2",
                           "--lora-modules", f"tuned={ADAPTERS / 'gpt2'}")
    assert code == 0, err
    (name, (adapters, lora)), = built["adapters"].items()
    want, want_lora = hf.load_peft_adapters(FIXTURES / "gpt2", ADAPTERS / "gpt2")
    assert name == "tuned" and lora == want_lora and lora.scale == 1
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(want), strict=True):
        assert np.array_equal(a, b)
    code, _, err = run_cli(capsys, "serve", "--checkpoint", FIXTURES / "gpt2",
                           "--lora-modules", f"tuned={tmp_path}")
    assert code == 2 and "a Hugging Face model serves PEFT adapters" in err
