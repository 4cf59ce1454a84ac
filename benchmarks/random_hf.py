"""Published models' shapes with random weights, written by transformers as Hugging Face
directories: what `kvjax bench decode --random-hf NAME` times kvjax and transformers on, at
real sizes, without downloading anything."""

from __future__ import annotations

import os

from kvjax import model as M


def _random_hf_configs():
    """name -> a transformers config of a published model's sizes (its architecture,
    widths, heads, vocabulary, RoPE and tying), for `write_random_hf`."""
    import transformers as T

    return {
        "gpt2": T.GPT2Config(),  # GPT-2 small, 124M parameters
        "llama-1b": T.LlamaConfig(  # Llama-3.2-1B
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            bos_token_id=128000, eos_token_id=128001),
        "qwen2-0.5b": T.Qwen2Config(  # Qwen2-0.5B
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=151643, eos_token_id=151643),
        # Granite 3.1 1B-A400M: a mixture of 32 experts, 8 for each token, in every layer
        "granitemoe-1b": T.GraniteMoeConfig(
            vocab_size=49155, hidden_size=1024, intermediate_size=512, num_hidden_layers=24,
            num_attention_heads=16, num_key_value_heads=8, num_local_experts=32,
            num_experts_per_tok=8, max_position_embeddings=131072, rms_norm_eps=1e-6,
            tie_word_embeddings=True, embedding_multiplier=12.0,
            attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=6.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
            bos_token_id=0, eos_token_id=0, pad_token_id=0),
    }


RANDOM_HF_MODELS = ("gpt2", "llama-1b", "qwen2-0.5b", "granitemoe-1b")


def write_random_hf(name: str, directory: str | os.PathLike, dtype: str = "float32") -> str:
    """Writes the model `name` (one of RANDOM_HF_MODELS) with random weights in `dtype` as a
    Hugging Face directory (`save_pretrained`, safetensors) and returns its path; needs
    torch and transformers. The weights are drawn on the GPU where torch has one."""
    import torch
    import transformers

    config = _random_hf_configs()[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype))
    model.save_pretrained(directory)
    return os.fspath(directory)


def random_gpt2(config: M.TransformerConfig):
    """A Hugging Face GPT-2 of the preset's sizes with random weights (not kvjax's weights:
    the contenders share sizes, not numbers), in eval mode; needs transformers."""
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_len, n_embd=config.d_model,
        n_layer=config.num_decoder_layers, n_head=config.num_heads, n_inner=config.d_ff,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
