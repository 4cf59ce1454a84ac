"""The command line: help texts, one-line errors with exit code 2, and cache-size output."""

import subprocess
import sys

import jax
import pytest
from conftest import run_cli

from kvjax import cli
from kvjax import model as M
from kvjax.cli import common
from kvjax.decode.plan import ON_DEVICE
from kvjax.model.cache_size import cache_size_bytes

SUBCOMMANDS = (["demo"], ["train"], ["sample"], ["chat"], ["serve"], ["import-hf"],
               ["cache-size"],
               ["bench", "decode"], ["bench", "train"], ["bench", "serve"],
               ["bench", "speculative"], ["bench", "precision"], ["bench", "kernels"])



@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_explains_its_options_with_defaults(capsys, argv):
    code, out, _ = run_cli(capsys, *argv, "--help")
    assert code == 0
    options = [line for line in out.splitlines() if line.strip().startswith("--")
               and line.strip().split()[0] != "--help"]
    assert options, out
    assert "(default:" in out


def test_llama_shaped_cache_is_512_mib_per_sequence(capsys):
    code, out, _ = run_cli(capsys, "cache-size", "--layers", "32", "--heads", "32",
                           "--head-dim", "128", "--length", "1024", "--dtype", "float16")
    assert code == 0
    assert "2 (K and V) x 1024 x 32 x 32 x 128 x 2 = 536,870,912 bytes = 512 MiB per sequence" \
        in out


def test_cache_size_of_a_preset_follows_the_formula(capsys):
    code, out, _ = run_cli(capsys, "cache-size", "--preset", "gpt-mini", "--length", "300",
                           "--batch", "4", "--kv-heads", "2")
    config = M.preset("gpt-mini", num_kv_heads=2)
    expected = 2 * 300 * config.num_decoder_layers * 2 * config.head_dim * 4 * 4
    assert cache_size_bytes(config, 4, 300).total == expected
    assert code == 0 and f"({expected:,} bytes)" in out


def test_cache_size_of_an_encoder_decoder_shows_the_cross_attention_part(capsys):
    code, out, _ = run_cli(capsys, "cache-size", "--preset", "tiny", "--encoder-layers", "2",
                           "--length", "10", "--source-length", "20")
    assert code == 0 and "cross-attention K/V of 20 source tokens" in out


def test_cache_size_of_a_windowed_model_shows_what_rings_and_pages_hold(capsys):
    code, out, _ = run_cli(capsys, "cache-size", "--preset", "tiny", "--length", "100",
                           "--sliding-window", "16", "--batch", "2")
    # 2 (K and V) x 16 x 2 layers x 4 kv heads x 8 x 4 bytes = 8 KiB a sequence, 16 KiB for 2.
    assert code == 0 and "batch 2: 100 KiB" in out
    assert "2 of 2 layers over a window of 16: generate and the engine's slots keep rings of " \
           "16 positions there, 16 KiB for the batch" in out
    assert "window of 16: a paged cache (the engine's) holds only those positions, 16 KiB" in out
    code, out, _ = run_cli(capsys, "cache-size", "--preset", "tiny", "--length", "16",
                           "--sliding-window", "16")
    assert code == 0 and "window" not in out  # a window no shorter than the tokens saves none


@pytest.mark.parametrize("argv, message", [
    (["train", "--task", "lm", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["train", "--task", "poetry"], "argument --task: invalid choice: 'poetry'"),
    (["bench", "serve", "--sliding-window", "0"], "argument --sliding-window: must be >= 1, got 0"),
    (["sample", "--prompt", "x"], "the following arguments are required: --checkpoint"),
    (["cache-size", "--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
])
def test_bad_options_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_a_missing_checkpoint_is_one_line_naming_the_path(capsys, tmp_path):
    missing = tmp_path / "nothing-here"
    code, out, err = run_cli(capsys, "sample", "--checkpoint", str(missing), "--prompt", "x")
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and str(missing) in err, err
    assert not missing.exists()


def test_the_console_script_starts_without_loading_jax():
    code = ("import sys; from kvjax.cli import build_parser; build_parser(); "
            "sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_cli_choices_are_the_librarys():
    from kvjax.benchmarks import decode as bench
    assert cli.PRESET_NAMES == tuple(M.PRESETS)
    assert cli.LAYER_MODES == bench.LAYER_MODES
    from kvjax.benchmarks import random_hf
    assert common.RANDOM_HF_MODELS == random_hf.RANDOM_HF_MODELS
    from kvjax.benchmarks import train as train_bench
    assert common.TRAIN_SHAPES == tuple(train_bench.SHAPES)


def test_weights_alone_multiplies_every_matrix_parameter_once():
    from kvjax.benchmarks import floors as bench
    # One head: qkv is [D, 3, D], which is not an output projection. Every size distinct.
    config = M.preset("tiny", num_heads=1, num_kv_heads=1, vocab_size=80, max_len=40,
                      scan_layers=True)
    params = M.init_params(config, jax.random.key(0))
    matrices = bench.step_matrices(config, params)
    leaves = jax.tree.leaves(M.unstack_layer_params(config, params))  # per layer, unstacked
    unrolled = bench.step_matrices(*M.with_layer_layout(config, params, scan_layers=False))
    assert [w.shape for w, _ in unrolled] == [w.shape for w, _ in matrices]
    assert sum(w.size for w, _ in matrices) == sum(x.size for x in leaves if x.ndim >= 2)
    d, f, v, layers = config.d_model, config.d_ff, config.vocab_size, config.num_decoder_layers
    assert sorted((w.shape, left) for w, left in matrices) == sorted(
        [((v, d), True)] + [((d, 3 * d), False), ((d, d), False), ((d, f), False),
                            ((f, d), False)] * layers)
    untied = config.replace(tie_embeddings=False, positional_encoding="learned")
    shapes = [w.shape for w, left in bench.step_matrices(
        untied, M.init_params(untied, jax.random.key(0))) if not left]
    assert (d, v) in shapes and (v, d) not in shapes and (config.max_len, d) not in shapes
    with pytest.raises(ValueError, match="decoder-only"):
        bench.step_matrices(config.replace(num_encoder_layers=1), params)


def test_a_step_of_a_mixture_of_experts_reads_the_chosen_experts_alone():
    from kvjax.benchmarks import floors as bench
    config = M.preset("tiny", num_experts=8, experts_per_token=2, ffn_bias=False,
                      activation="swiglu", tie_embeddings=False, shared_expert_d_ff=16,
                      vocab_size=80)
    params = M.init_params(config, jax.random.key(0))
    d, f, layers = config.d_model, config.d_ff, config.num_decoder_layers
    every = sum(x.size * 4 for x in jax.tree.leaves(params))
    expert = 3 * d * f * 4  # one expert's wi, wi_gate and wo, float32
    assert bench.step_param_bytes(config, params) == every - layers * 6 * expert
    shapes = sorted(w.shape for w, _ in bench.step_matrices(config, params))
    # Per layer: qkv, out, the router, the shared expert's three, two experts' three each.
    assert len(shapes) == 1 + layers * (3 + 3 + 2 * 3)
    assert shapes.count((d, f)) == layers * 4 and shapes.count((f, d)) == layers * 2
    assert shapes.count((d, 8)) == layers and shapes.count((d, 16)) == 2 * layers
    assert shapes.count((16, d)) == layers and (d, 80) in shapes


def test_decode_benchmark_on_more_devices_than_jax_sees_names_the_flag():
    from kvjax.benchmarks import decode as bench
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
        bench.decode_benchmark("tiny", batch_sizes=(2,), prompt_len=4, new_tokens=8,
                               devices=64, log=lambda _: None)


def test_decode_benchmark_times_each_loop_in_a_row_of_its_own():
    from kvjax.benchmarks import decode as bench
    loops = {name: bench.parse_loop(name) for name in ("default", "host:3")}
    rows, facts = bench.decode_benchmark(
        "tiny", batch_sizes=(2,), prompt_len=4, new_tokens=8, repeats=1,
        layer_modes=("scanned",), compare_no_cache=False, compare_hf=False, loops=loops,
        log=lambda _: None)
    assert [r.label for r in rows] == ["scanned", "scanned, host:3 loop"]
    assert all(r.kvjax_seconds > 0 for r in rows)
    assert "| 2 | scanned, host:3 loop |" in bench.format_table(rows, facts)
    assert bench.parse_loop("device")({}) == ON_DEVICE
    for bad in ("host:0", "host:x", "fast"):
        with pytest.raises(ValueError, match=f"decode loop {bad!r}"):
            bench.parse_loop(bad)


# The published models' parameter counts.
PUBLISHED_PARAMETERS = {"gpt2": 124_439_808, "llama-1b": 1_235_814_400,
                        "qwen2-0.5b": 494_032_768, "granitemoe-1b": 1_334_628_352}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMETERS))
def test_the_random_hf_models_have_the_published_sizes(name):
    pytest.importorskip("transformers")
    from kvjax.benchmarks import random_hf
    from kvjax.hf.config import to_kvjax_config
    config = to_kvjax_config(random_hf._random_hf_configs()[name].to_dict(), tied=True)
    shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    assert sum(x.size for x in jax.tree.leaves(shapes)) == PUBLISHED_PARAMETERS[name]


def test_train_benchmark_times_both_layer_modes_and_prints_a_table(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")  # restored after: --devices sets it for this process
    code, out, _ = run_cli(capsys, "bench", "train", "--preset", "tiny", "--batch-size", "2",
                           "--seq-len", "8", "--steps", "1", "--repeats", "1", "--no-torch")
    assert code == 0
    assert "| kvjax, scanned layers, 1 device |" in out
    assert "| kvjax, unrolled layers, 1 device |" in out
    mfu = [float(line.split("|")[4].strip(" %")) for line in out.splitlines()
           if line.startswith("| kvjax")]
    assert len(mfu) == 2 and all(0 < value < 100 for value in mfu)
    assert "TFLOP/s." in out
    code, _, err = run_cli(capsys, "bench", "train", "--preset", "tiny", "--seq-len", "8",
                           "--devices", "64")
    assert code == 2 and "xla_force_host_platform_device_count=64" in err


def test_model_flops_are_nanogpts_count_for_the_published_shapes():
    from kvjax.benchmarks import train as bench
    # GPT-2 small: 124,439,808 parameters, of which 1024 x 768 positions are looked up.
    assert bench.model_flops_per_token(bench.SHAPES["gpt2-small"], 1024) == (
        6 * (124_439_808 - 1024 * 768) + 12 * 12 * 12 * 64 * 1024)
    # Llama-3.2-1B: 1,235,814,400 parameters, the embedding table tied to the output layer.
    assert bench.model_flops_per_token(bench.SHAPES["llama-1b"], 2048) == (
        6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 2048)


def test_fill_sweep_times_every_way_and_plots_it(tmp_path):
    from kvjax.benchmarks import fill_sweep
    rows = fill_sweep.fill_sweep("tiny", batch=2, capacity=16, fills=(4, 16), repeats=1,
                                 steps=2, window=4, log=lambda _: None)
    assert [(r.layers, r.filled) for r in rows] == [
        (mode, filled) for mode in ("scanned", "unrolled") for filled in (4, 16)]
    assert all(getattr(r, f"{way}_seconds") > 0 for r in rows for way in fill_sweep.WAYS)
    table = fill_sweep.format_sweep(rows, 2, 16, 64, window=4)
    assert "| unrolled | 16 |" in table and "sliding window of 4 slots" in table
    fill_sweep.plot_sweep(rows, str(tmp_path / "sweep.png"), 2, 16)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_decode_rejects_a_sweep_fill_past_the_capacity_before_timing(capsys):
    assert cli.main(["bench", "decode", "--preset", "tiny", "--sweep-capacity", "32",
                     "--sweep-fills", "8", "40"]) == 2
    assert "filled lengths [40] must be in [1, 32]" in capsys.readouterr().err


def test_serving_beyond_loopback_without_a_key_warns(capsys, monkeypatch):
    """`kvjax serve` says so before it loads anything when anyone who reaches the port could
    use the model (the checkpoint here does not exist, so the command ends right after)."""
    from kvjax.cli.serve import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("example.internal")
    monkeypatch.delenv("KVJAX_API_KEY", raising=False)
    for host, key, warned in (("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                              ("127.0.0.1", None, False)):
        argv = ["serve", "--checkpoint", "/nonexistent/kvjax-model", "--host", host]
        code, _, err = run_cli(capsys, *argv, *(["--api-key", key] if key else []))
        assert code == 2 and "/nonexistent/kvjax-model" in err
        assert ("no API key" in err) == warned, (host, key, err)


def test_sample_chat_answers_the_message_as_the_model_s_template_frames_it(capsys):
    """`kvjax sample --chat` on Gemma 3's template: the greedy answer to the text the
    template makes of the messages (its system message joined to the user's turn)."""
    from pathlib import Path

    from kvjax import decode, text

    directory = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "gemma3_text"
    code, out, err = run_cli(capsys, "sample", "--checkpoint", directory, "--chat", "--system",
                             "Answer briefly.", "--prompt", "Hello there",
                             "--max-new-tokens", "5")
    assert code == 0, err
    loaded = text.load(directory)
    framed = ("<s><start_of_turn>user\nAnswer briefly.\n\nHello there<end_of_turn>\n"
              "<start_of_turn>model\n")
    tokens = decode.generate(loaded.net, loaded.params, [loaded.tokenizer.encode(framed)],
                             max_new_tokens=5, eos_ids=loaded.tokenizer.stop_ids
                             ).token_lists()[0]
    assert out.rsplit("\n[", 1)[0] == loaded.tokenizer.decode(tokens)  # the answer alone
    code, _, err = run_cli(capsys, "sample", "--checkpoint", directory, "--system", "x",
                           "--prompt", "Hello")
    assert code == 2 and "--system is a chat's system message: give --chat too" in err
    code, _, err = run_cli(capsys, "sample", "--checkpoint", "checkpoints/numbers-to-words",
                           "--chat", "--prompt", "12")
    assert code == 2 and "--chat: this model translates its prompt; it has no chat" in err


def test_sample_takes_the_models_sampling_defaults_unless_told_otherwise(capsys, tmp_path):
    """As `kvjax serve` and vLLM: the generation config's temperature and top_k where the
    options leave them out; an option given, or `--sampling-defaults greedy`, wins."""
    import json
    import shutil
    from pathlib import Path

    from kvjax import decode, text

    directory = tmp_path / "gpt2"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "gpt2",
                    directory)
    path = directory / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "temperature": 0.7, "top_k": 5}))
    loaded = text.load(directory)

    def sampled(*options):
        code, out, err = run_cli(capsys, "sample", "--checkpoint", directory, "--prompt",
                                 "Hello", "--max-new-tokens", "6", "--seed", "4", *options)
        assert code == 0, err
        return out.rsplit("\n[", 1)[0], err

    def expected(sampling):
        return "Hello" + text.sample_text(loaded, "Hello", max_new_tokens=6, seed=4,
                                          sampling=sampling).text

    out, err = sampled()
    assert out == expected(decode.Sampling(temperature=0.7, top_k=5))
    assert "sampling defaults from the model's generation config: temperature=0.7, " \
           "top_k=5" in err
    out, err = sampled("--temperature", "1.2")
    assert out == expected(decode.Sampling(temperature=1.2, top_k=5))
    assert "top_k=5" in err and "temperature" not in err
    out, err = sampled("--sampling-defaults", "greedy")
    assert out == expected(decode.GREEDY) and err == ""


def test_chat_answers_each_line_with_the_conversation_so_far(capsys, monkeypatch):
    """`kvjax chat` on Gemma 3's template: the first answer is the greedy answer to the
    template's rendering of the first line; the next line is asked after the whole
    conversation; /reset forgets it; the input's end ends the chat."""
    import io
    from pathlib import Path

    from kvjax import decode, text
    from kvjax.serve import chat

    directory = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "gemma3_text"
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nGo\n\n/reset\nHi\n"))
    code, out, err = run_cli(capsys, "chat", "--checkpoint", directory, "--max-new-tokens", "2",
                             "--temperature", "0")
    assert code == 0, err
    assert "/reset forgets the conversation" in err
    loaded = text.load(directory)

    def greedy(ids):
        tokens = decode.generate(loaded.net, loaded.params, [ids], max_new_tokens=2,
                                 eos_ids=loaded.tokenizer.stop_ids).token_lists()[0]
        return loaded.tokenizer.decode(tokens)

    first = greedy(loaded.tokenizer.encode(
        "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"))
    talk = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first}, {"role": "user", "content": "Go"}]
    second = greedy(chat.prompt_ids(loaded, talk)[0])
    assert out.split("\n")[:3] == [first, second, first]  # after /reset: the first again
