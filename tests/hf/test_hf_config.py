"""The `config.json` readers of `kvjax.hf` (`config.py`, `families.py`, `llama_like.py`,
`output_norms.py`, `plain_ffn.py`, `cohere.py`, `rope.py`): a setting kvjax does not run is
one error naming it, raised before anything is computed; files written the older ways read
as the fixtures' (tests/fixtures/hf_models) do."""

import json

import pytest
from test_hf_models import FIXTURES, copy_of, edit_config

from kvjax import hf


@pytest.mark.parametrize("name, changes, message", [
    ("gpt2", dict(model_type="bert"),
     "model_type 'bert' is not supported; kvjax loads apertus, arcee, bart, bloom, cohere, "
     "cohere2, deepseek_v2, deepseek_v3, dots1, ernie4_5, ernie4_5_moe, exaone, exaone4, falcon, "
     "flex_olmo, gemma, gemma2, gemma3_text, glm, glm4, glm4_moe, glm4_moe_lite, gpt2, "
     "gpt_bigcode, gpt_neo, gpt_neox, gpt_oss, gptj, granite, granitemoe, granitemoehybrid, "
     "granitemoeshared, helium, hunyuan_v1_dense, hunyuan_v1_moe, hyperclovax, internlm3, "
     "iquestcoder, jais2, llama, m2m_100, marian, mbart, ministral, ministral3, mistral, mixtral, "
     "mpt, mt5, nanochat, nemotron, olmo, olmo2, olmo3, olmoe, opt, phi, phi3, phimoe, qwen2, "
     "qwen2_moe, qwen3, qwen3_moe, seed_oss, smollm3, stablelm, starcoder2, t5, umt5, vaultgemma"),
    ("llama_gqa", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                        "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     'rope settings {"partial_rotary_factor": 0.5} are not supported for rope type \'yarn\''),
    ("qwen2", dict(use_sliding_window=False),
     "layers [1] use 'sliding_attention' with use_sliding_window false"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]),
     "layers [1] use 'sliding_attention' with use_sliding_window false"),
    ("qwen2", dict(layer_types=["full_attention", "chunked_attention"]),
     "must name 'full_attention' or 'sliding_attention' for each of the 2 layers"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4),
     "use_sliding_window=true is not supported (sliding-window attention)"),
    ("llama_mqa", dict(rope_interleaved=True), "rope_interleaved=true is not supported"),
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                   "long_factor": [2.0] * 3}),
     "longrope rope scaling needs original_max_position_embeddings and short_factor"),
    ("phi3", dict(full_attn_mod=2),
     "full_attn_mod=2 is not supported (Phi-4 mini's files hold 1, every layer in full "
     "attention; transformers' Phi-3 ignores the key, so only that value runs as it does)"),
    ("phi3", dict(interpolate_factor=4), "interpolate_factor=4 is not supported"),
    ("smollm3", dict(no_rope_layers=[1, 0]),
     "no_rope_layers=[1, 0] must hold a 1 (RoPE) or 0 (none) for each of the 3 layers"),
    ("llama_mqa", dict(partial_rotary_factor=0.75),
     "kvjax does not implement partial_rotary_factor=0.75"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True),
     "scale_attn_by_inverse_layer_idx=true is not supported"),
    ("llama_mqa", dict(some_new_trick=4), "kvjax does not implement some_new_trick=4"),
    ("llama_mqa", dict(hidden_act="gelu"), "a gated feed-forward network with gelu_exact"),
    ("marian", dict(share_encoder_decoder_embeddings=False),
     "share_encoder_decoder_embeddings=false is not supported"),
    ("m2m_100", dict(decoder_ffn_dim=128),
     "decoder_ffn_dim=128 is not supported (kvjax's encoder and decoder share ffn_dim)"),
    ("m2m_100", dict(num_hidden_layers=3),
     "num_hidden_layers=3 is not supported (transformers reads it as encoder_layers)"),
    ("gemma3_text", dict(use_bidirectional_attention=True),
     "use_bidirectional_attention=true is not supported (kvjax's Gemma is causal)"),
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     "must name 'full_attention' or 'sliding_attention' for each of the 3 layers"),
    ("gemma2", dict(hidden_activation="gelu"), "a gated feed-forward network with gelu_exact"),
    ("gemma3_text", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "scaled RoPE on sliding_attention layers is not supported"),
    ("olmo3", dict(sliding_window=0), "sliding_window=0 must be >= 1 or None"),
    ("ministral3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 4}),
     "Ministral 3's rope_parameters need llama_4_scaling_beta and "
     "original_max_position_embeddings"),
    ("ministral3", dict(layer_types=["sliding_attention", "full_attention"]),
     'kvjax does not implement layer_types=["sliding_attention", "full_attention"]'),
    ("exaone4", dict(layer_types=None, sliding_window_pattern="LXG"),
     "sliding_window_pattern='LXG' must be a string of L (local) and G (global) layers"),
    ("exaone4", dict(layer_types=None, sliding_window_pattern=True),
     "sliding_window_pattern=True must be an integer >= 1 or a string of L and G"),
    ("cohere", dict(use_qk_norm=True),
     "use_qk_norm=true is not supported (a LayerNorm over each head's query and key)"),
    ("cohere2", dict(layer_types=None, sliding_window_pattern=0),
     "sliding_window_pattern=0 must be an integer >= 1"),
    ("gemma2", dict(layer_types=None, sliding_window_pattern=0),
     "sliding_window_pattern=0 must be an integer >= 1"),
    ("olmo3", dict(layer_types=["full_attention"] * 2),
     "must name 'full_attention' or 'sliding_attention' for each of the 3 layers"),
    ("gpt_neox", dict(rope_parameters={"rope_type": "default", "rope_theta": 20000.0,
                                       "partial_rotary_factor": 0.4}),
     "rotary_dim=3 must be even and in [2, head_dim=8]"),
    ("phi", dict(qk_layernorm=True), "qk_layernorm=true is not supported (LayerNorm over each "
                                     "head's query and key)"),
    ("phimoe", dict(rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.6, 2.0],
        "long_factor": [1.5, 3.0, 6.0, 9.0], "short_mscale": 1.2, "long_mscale": 1.5,
        "original_max_position_embeddings": 64}),
     "short_mscale=1.2 and long_mscale=1.5 differ"),
    ("opt", dict(_remove_final_layer_norm=True), "_remove_final_layer_norm=true is not "
                                                 "supported (no norm after the last layer)"),
    ("opt", dict(word_embed_proj_dim=0), "word_embed_proj_dim=0 must be an int >= 1"),
    ("opt", dict(do_layer_norm_before="yes"), "do_layer_norm_before='yes' must be true or false"),
    ("gemma", dict(hidden_act="relu"), "a gated feed-forward network with relu is not supported"),
    ("stablelm", dict(use_parallel_residual=True),
     "use_parallel_residual=true is not supported (attention and FFN side by side: StableLM 2 "
     "12B's layout, which also needs per-head query and key norms)"),
    ("qwen3_moe", dict(decoder_sparse_step=2),
     "decoder_sparse_step=2 is not supported (dense FFNs between the expert layers)"),
    ("qwen3_moe", dict(mlp_only_layers=[0]),
     "mlp_only_layers=[0] is not supported (dense FFNs in some layers)"),
    ("qwen2_moe", dict(decoder_sparse_step=2),
     "decoder_sparse_step=2 is not supported (dense FFNs between the expert layers)"),
    ("qwen2_moe", dict(use_sliding_window=True), "use_sliding_window=true is not supported"),
    ("qwen3_moe", dict(num_experts=8, num_local_experts=4),
     "num_experts=8 and num_local_experts=4 differ"),
    ("mixtral", dict(num_local_experts=None), "num_experts (or num_local_experts) is missing"),
    ("mixtral", dict(num_experts_per_tok=5),
     "experts_per_token=5 must be from 1 to num_experts=4"),
    ("olmoe", dict(clip_qkv=-1.0), "invalid TransformerConfig: qkv_clip=-1.0 must be > 0"),
    # EXAONE's releases name the layers' count num_layers, which transformers reads as
    # num_hidden_layers: a file naming both differently says two things.
    ("exaone", dict(num_hidden_layers=3), "num_layers=2 and num_hidden_layers=3 differ"),
    ("internlm3", dict(bias=False), "mlp_bias=false is not supported (transformers' InternLM3 "
                                    "runs one setting for the attention's and FFN's biases)"),
    ("gpt_oss", dict(experts_per_token=3), "experts_per_token=3 and num_experts_per_tok=2"),
    ("gpt_oss", dict(quantization_config={"quant_method": "gptq", "bits": 4}),
     "quantization_config with quant_method='gptq' is not supported (gpt-oss: 'mxfp4'"),
    # Falcon-RW's position biases; layers transformers' Falcon cannot run.
    ("falcon", dict(alibi=True), "alibi=true is not supported (Falcon-RW's ALiBi, whose slopes "
                                 "times each key's position transformers rounds to bfloat16"),
    ("falcon2", dict(parallel_attn=False), "new_decoder_architecture with parallel_attn false"),
    ("falcon_grouped", dict(num_ln_in_parallel_attn=3), "num_ln_in_parallel_attn=3 must be 1 "
                                                        "or 2"),
    ("falcon", dict(num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn=2 outside the new "
                                                "decoder architecture"),
    ("falcon_sequential", dict(num_kv_heads=2, num_key_value_heads=2),
     "num_kv_heads=2 with multi_query false outside the new decoder architecture must be "
     "num_attention_heads (4)"),
    ("falcon_grouped", dict(num_kv_heads=3, num_key_value_heads=3),
     "num_kv_heads=3 must divide num_attention_heads=4"),
    ("falcon_grouped", dict(num_key_value_heads=4), "num_key_value_heads=4 is not supported"),
    ("bloom", dict(apply_residual_connection_post_layernorm=True),
     "apply_residual_connection_post_layernorm=true is not supported (the residual taken after "
     "the norm)"),
    ("bloom", dict(n_inner=100), "n_inner=100 is not supported (transformers' BLOOM runs an FFN "
                                 "4x the width)"),
    # What MPT's own code runs and transformers' MPT would silently leave out.
    ("mpt", dict(attn_config={"qk_ln": True}), "attn_config's qk_ln=true is not supported "
                                               "(LayerNorm over queries and keys"),
    ("mpt", dict(attn_config={"alibi_bias_max": 16}), "attn_config's alibi_bias_max=16 is not "
                                                      "supported"),
    ("mpt", dict(attn_config={"rope": True}), "attn_config's rope=true is not supported"),
    ("mpt", dict(logit_scale="inv_sqrt_d_model"), 'logit_scale="inv_sqrt_d_model" is not '
                                                  "supported"),
    ("mpt", dict(expansion_ratio=2), "expansion_ratio=2 is not supported"),
    ("mpt", dict(norm_type="rmsnorm"), "norm_type='rmsnorm' is not supported"),
    ("t5", dict(feed_forward_proj="gated-relu", dense_act_fn="relu"),
     "feed_forward_proj='gated-relu' is not supported"),
    ("t5", dict(dense_act_fn="relu"), 'dense_act_fn="relu" is not supported (transformers '
                                      "derives it from feed_forward_proj='gated-gelu')"),
    # ERNIE 4.5's mixtures: no biases; at least one mixture.
    ("ernie4_5_moe", dict(use_bias=True), "use_bias=true is not supported (ERNIE 4.5's "
                                          "mixtures have no biases)"),
    ("ernie4_5_moe", dict(moe_layer_start_index=3), "no layer is a mixture of experts"),
    # DeepSeek-V3's router (GLM-4.5, dots.llm1): what its groups and dense layers allow.
    ("glm4_moe", dict(first_k_dense_replace=3), "first_k_dense_replace=3 must leave a "
                                                "mixture among the 3 layers"),
    ("glm4_moe", dict(n_group=3), "router_groups=3 must split num_experts=8 into equal groups"),
    ("dots1", dict(topk_group=1, n_group=4, num_experts_per_tok=3),
     "experts_per_token=3 is more than the 2 experts of router_groups_kept=1 groups"),
    # Latent attention: the releases' RoPE over pairs, its dense and sparse layers named.
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=false is not supported"),
    ("deepseek_v3", dict(qk_head_dim=16), "qk_head_dim=16 is not supported (transformers "
                                          "derives it: qk_nope_head_dim + qk_rope_head_dim)"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc': DeepSeek-V2's "
                                                 "routers are 'greedy' and "
                                                 "'group_limited_greedy'"),
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=true is not supported "
                                               "(transformers' DeepSeek-V2 router never "
                                               "renormalises its weights)"),
    ("glm4_moe_lite", dict(mlp_layer_types=["dense", "dense", "dense"]),
     "must name 'dense' or 'sparse' for each of the 3 layers, one sparse at least"),
    ("dots1", dict(scoring_func="softmax"), 'scoring_func="softmax" is not supported (kvjax '
                                            "runs DeepSeek-V3's router, whose scores are "
                                            "sigmoids)"),
    # HunYuan MoE: one mixture shape in every layer.
    ("hunyuan_v1_moe", dict(moe_topk=[2, 1]), "moe_topk=[2, 1] must give one value for all 2 "
                                              "layers (kvjax runs the same mixture in every "
                                              "layer)"),
    ("hunyuan_v1_moe", dict(num_experts=[8]), "num_experts=[8] must give one value for all 2 "
                                              "layers"),
    # Granite 4.0's hybrid models (-h): Mamba-2 layers beside the attention ones.
    ("granitemoehybrid", dict(layer_types=["mamba", "attention"]),
     "layers [0] are Mamba-2 layers ('linear_attention'); kvjax runs the Granite 4.0 models "
     "whose layers are all attention"),
    ("granitemoehybrid", dict(layer_types=None), "layers [0, 1] are Mamba-2 layers"),
    ("granitemoehybrid", dict(layer_types=["attention"]), "layer_types names 1 layers of 2"),
    ("granitemoehybrid", dict(position_embedding_type="alibi"),
     "position_embedding_type='alibi' is not supported (rope, or null: none)"),
])
def test_unsupported_settings_are_refused(tmp_path, name, changes, message):
    directory = copy_of(name, tmp_path)
    edit_config(directory, **changes)
    with pytest.raises(hf.UnsupportedModelError) as error:
        hf.load_pretrained(directory)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name, changes", [
    # Gemma 3 gave the global layers' RoPE as rope_theta and rope_scaling, the local layers'
    # base as rope_local_base_freq, and made every sliding_window_pattern-th layer global.
    ("gemma3_text", dict(layer_types=None, _sliding_window_pattern=None, rope_parameters=None,
                         sliding_window_pattern=3, rope_theta=100000.0,
                         rope_local_base_freq=10000.0,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # OLMo 3's released files: one rope_theta, the rope_scaling of the full layers alone.
    ("olmo3", dict(rope_parameters=None, rope_theta=50000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    # Pythia's released files: RoPE's base and the fraction of each head it turns on their own.
    ("gpt_neox", dict(rope_parameters=None, rotary_emb_base=20000.0, rotary_pct=0.5)),
    # Phi-2's and StableLM's: the fraction and the base at the top level.
    ("phi", dict(rope_parameters=None, rope_theta=30000.0, partial_rotary_factor=0.25)),
    ("stablelm", dict(rope_parameters=None, rope_theta=40000.0, partial_rotary_factor=0.5)),
    # Gemma's releases: "gelu" meaning tanh GELU, which hidden_activation also says.
    ("gemma", dict(hidden_act="gelu", hidden_activation="gelu_pytorch_tanh")),
    # Qwen3-MoE's releases count the experts as num_experts; the router's training settings
    # change nothing in inference.
    ("qwen3_moe", dict(num_local_experts=None, num_experts=8, output_router_logits=True,
                       router_aux_loss_coef=0.01)),
    # Qwen2's: the sliding layers are those from max_window_layers on.
    ("qwen2", dict(layer_types=None)),
    # GLM-4's releases: RoPE's base and the fraction of each head it turns at the top level.
    ("glm4", dict(rope_parameters=None, rope_theta=20000.0, partial_rotary_factor=0.5)),
    # gpt-oss's releases: rope_scaling and rope_theta, and two keys of OpenAI's own.
    # Falcon's first releases: older names of four keys, RoPE's base at the top level, a key
    # of their own code, and no max_position_embeddings (2,048); multi_query's one kv head
    # whatever num_kv_heads says.
    ("falcon", dict(num_hidden_layers=None, num_attention_heads=None, hidden_size=None,
                    num_kv_heads=None, n_layer=2, n_head=4, n_embed=32, n_head_kv=8,
                    rope_parameters=None, rope_theta=10000.0,
                    apply_residual_connection_post_layernorm=False)),
    ("falcon_grouped", dict(num_kv_heads=None, n_head_kv=2, rope_parameters=None,
                            rope_theta=50000.0)),
    # BLOOM's releases: the keys of Megatron-DeepSpeed's training, which transformers reads
    # nowhere, and n_inner null.
    ("bloom", dict(attention_softmax_in_fp32=True, bias_dropout_fusion=True,
                   masked_softmax_fusion=True, offset_alibi=100, skip_bias_add=True,
                   skip_bias_add_qkv=False, unk_token_id=0, n_inner=None)),
    # MPT-7B's release: keys of its own code for initialisation and training.
    ("mpt", dict(init_device="cpu", init_config={"name": "kaiming_normal_"}, verbose=0,
                 tokenizer_name="EleutherAI/gpt-neox-20b", learned_pos_emb=True,
                 embedding_fraction=1.0, fc_type="torch", ffn_config={"ffn_type": "mptmlp"},
                 use_pad_tok_in_ffn=True, norm_type="low_precision_layernorm",
                 attn_config={"attn_impl": "triton", "attn_pdrop": 0, "clip_qkv": 1.0,
                              "softmax_scale": 0.25, "alibi": True, "alibi_bias_max": 8,
                              "attn_type": "multihead_attention", "prefix_lm": False,
                              "qk_ln": False, "attn_uses_sequence_id": False})),
    # T5's files before transformers 5: whether the decoder's output is scaled said by
    # tie_word_embeddings (false: not), and the keys of its first releases.
    ("t5", dict(scale_decoder_outputs=None, tie_word_embeddings=False, n_positions=512,
                output_past=True, task_specific_params={"summarization": {"prefix": "x"}})),
    # mT5's releases: tie_word_embeddings false, which changes nothing (never scaled).
    ("mt5", dict(tie_word_embeddings=False)),
    # HyperCLOVA X's Peri-LN is on where the file does not say.
    ("hyperclovax", dict(use_post_norm=None)),
    # Granite 4.0's releases: "attention" for each layer, and the unused Mamba-2 settings.
    ("granitemoehybrid", dict(layer_types=["attention", "attention"], mamba_d_state=128)),
    ("granitemoehybrid_moe", dict(layer_types=None, layers_block_type=["attention"] * 2)),
    ("gpt_oss", dict(rope_parameters=None, rope_theta=150000.0, experts_per_token=2,
                     initial_context_length=16, rope_scaling={
                         "rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16})),
])
def test_files_written_before_transformers_5_name_rope_and_layers_the_older_way(
        tmp_path, name, changes):
    directory = copy_of(name, tmp_path)
    edit_config(directory, **changes)
    config, _, _ = hf.load_pretrained(directory)
    assert config == hf.load_pretrained(FIXTURES / name)[0]


@pytest.mark.parametrize("changes", [dict(max_window_layers=2, layer_types=None),
                                     dict(use_sliding_window=False, layer_types=None)])
def test_a_qwen2_file_without_sliding_layers_attends_over_every_position(tmp_path, changes):
    directory = copy_of("qwen2", tmp_path)
    edit_config(directory, **changes)
    config, _, _ = hf.load_pretrained(directory)
    assert (config.sliding_window, config.full_attention_layers) == (None, ())


def test_deepseek_v2_lite_s_greedy_router_chooses_among_every_expert(tmp_path):
    directory = copy_of("deepseek_v2", tmp_path)  # the fixture's router: group-limited
    edit_config(directory, topk_method="greedy")
    config = hf.load_pretrained(directory)[0]
    assert (config.router_groups, config.router_groups_kept) == (1, 1)


@pytest.mark.parametrize("name", ["mistral", "ministral", "gemma2", "gemma3_text", "olmo3"])
def test_a_file_without_a_window_takes_the_one_transformers_gives_its_family(name, tmp_path):
    directory = copy_of(name, tmp_path)
    edit_config(directory, sliding_window=None)  # the key gone
    assert hf.load_pretrained(directory)[0].sliding_window == 4096


@pytest.mark.parametrize("name", ["mistral", "ministral"])
def test_a_window_of_null_is_none(name, tmp_path):
    directory = copy_of(name, tmp_path)
    edit_config(directory, layer_types=None)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sliding_window": None}))
    config = hf.load_pretrained(directory)[0]
    assert (config.sliding_window, config.full_attention_layers) == (None, ())


@pytest.mark.parametrize("name", ["olmo3", "gemma2"])
def test_sliding_layers_with_a_window_of_null_are_refused(name, tmp_path):
    """A window of null is no window, which sliding layers cannot do without (nor can
    transformers run such a file)."""
    directory = copy_of(name, tmp_path)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sliding_window": None}))
    with pytest.raises(hf.UnsupportedModelError, match="sliding_attention layers need a "
                                                       "sliding_window"):
        hf.load_pretrained(directory)


@pytest.mark.parametrize("changes", [dict(layer_types=None),
                                     dict(layer_types=None, sliding_window_pattern=3)])
def test_an_exaone4_file_without_layer_types_reads_its_pattern(tmp_path, changes):
    """EXAONE 4.0 32B's file writes its pattern as "LLLG" beside its layer types."""
    directory = copy_of("exaone4", tmp_path)
    edit_config(directory, **changes)
    config = hf.load_pretrained(directory)[0]
    assert (config.sliding_window, config.full_attention_layers,
            config.unrotated_layers) == (4, (2,), (2,))


def test_an_exaone4_file_turns_every_layer_with_rope_only_without_a_window(tmp_path):
    """EXAONE 4.0 1.2B's file has no window: every layer attends over every position and
    turns with RoPE. With a window, the global layers have no position encoding, even where
    every layer is global (transformers' default window where the file names none)."""
    directory = copy_of("exaone4", tmp_path)
    edit_config(directory, layer_types=["full_attention"] * 3)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sliding_window": None}))
    config = hf.load_pretrained(directory)[0]
    assert (config.sliding_window, config.full_attention_layers,
            config.unrotated_layers) == (None, (), ())
    edit_config(directory, sliding_window=None)  # the key gone
    config = hf.load_pretrained(directory)[0]
    assert (config.sliding_window, config.full_attention_layers,
            config.unrotated_layers) == (4096, (0, 1, 2), (0, 1, 2))


def test_a_cohere2_file_without_layer_types_reads_its_pattern_and_needs_a_window(tmp_path):
    directory = copy_of("cohere2", tmp_path)
    edit_config(directory, layer_types=None, sliding_window_pattern=3)
    config = hf.load_pretrained(directory)[0]
    assert (config.sliding_window, config.full_attention_layers,
            config.unrotated_layers) == (4, (2,), (2,))
    edit_config(directory, sliding_window=None)  # the key gone: transformers' 4,096
    assert hf.load_pretrained(directory)[0].sliding_window == 4096
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sliding_window": None}))
    with pytest.raises(hf.UnsupportedModelError, match="sliding_window=null is not supported"):
        hf.load_pretrained(directory)


def test_a_directory_without_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf.load_pretrained(tmp_path)


def test_a_vision_language_release_is_read_as_its_language_model_at_transformers_defaults():
    """Gemma 3 4B's and a Ministral 3's `text_config` as older transformers wrote them, only
    the keys that differ from the text config class's defaults: the rest are those defaults
    (heads, kv heads, head dim, vocabulary, Ministral 3's YaRN and query scale)."""
    from kvjax.hf import text_of_multimodal

    gemma = {"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"},
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                             "model_type": "gemma3_text", "num_hidden_layers": 34,
                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024}}
    config = hf.to_kvjax_config(text_of_multimodal.text_config(gemma, "gemma"), tied=True)
    assert (config.d_model, config.num_heads, config.num_kv_heads, config.head_dim,
            config.num_decoder_layers, config.d_ff, config.vocab_size) == (
        2560, 8, 4, 256, 34, 10240, 262208)
    assert (config.sliding_window, config.full_attention_layers) == (1024, (5, 11, 17, 23, 29))
    assert (config.rope_scaling, config.rope_scaling_factor, config.rope_base,
            config.local_rope_base) == ("linear", 8.0, 1e6, 1e4)
    assert config.attention_scale == 256 ** -0.5
    mistral = {"model_type": "mistral3", "text_config": {"hidden_size": 3072,
                                                         "num_hidden_layers": 26}}
    config = hf.to_kvjax_config(text_of_multimodal.text_config(mistral, "mistral"), tied=True)
    assert (config.d_model, config.num_heads, config.num_kv_heads, config.head_dim) == (
        3072, 32, 8, 128)
    assert (config.rope_scaling, config.rope_scaling_factor, config.rope_original_max_len,
            config.query_scale_beta, config.query_scale_length, config.sliding_window) == (
        "yarn", 16.0, 16384, 0.1, 16384, None)


@pytest.mark.parametrize("change, message", [
    (dict(text_config=None), "a gemma3 directory needs a text_config"),
    (dict(text_config={"model_type": "llama"}),
     "the text_config of a gemma3 model is gemma3_text's, not 'llama'")])
def test_a_vision_language_release_without_its_language_model_is_refused(tmp_path, change,
                                                                         message):
    directory = copy_of("gemma3", tmp_path)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(hf.UnsupportedModelError, match=message):
        hf.load_pretrained(directory)
