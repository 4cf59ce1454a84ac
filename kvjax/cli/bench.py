"""`kvjax bench decode`, `kvjax bench train` and `kvjax bench serve` (`bench_serve.py`): speed
against baselines, in one run each; `kvjax bench precision`: each precision's memory, speed
and quality; `kvjax bench speculative`: speculative decoding against plain greedy; `kvjax bench
structured`: constrained rows against free ones; `kvjax bench kernels`: a decode step's
kernels."""

from __future__ import annotations

import os
import tempfile

from .bench_serve import add_serve
from .common import (
    CACHE_DTYPE_NAMES,
    DTYPE_NAMES,
    KERNEL_DTYPE_NAMES,
    LAYER_MODES,
    PRESET_NAMES,
    RANDOM_HF_MODELS,
    TRAIN_SHAPES,
    add_command,
    add_decode_attention,
    in_decode_attention_mode,
    positive,
)


def add_bench(commands) -> None:
    bench = add_command(commands, "bench", "Benchmarks.")
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    _add_decode(kinds)
    _add_train(kinds)
    _add_speculative(kinds)
    _add_precision(kinds)
    add_serve(kinds)
    _add_structured(kinds)
    _add_kernels(kinds)


def _add_kernels(kinds) -> None:
    kernels = add_command(
        kinds, "kernels", "Where a decode step's time goes: the kernels of one greedy "
        "generate call, from a jax.profiler trace, per generated token, with the device's "
        "busy time and the copies to the host.")
    kernels.add_argument("--preset", choices=PRESET_NAMES, default="gpt-mini", help="model size")
    model = kernels.add_mutually_exclusive_group()
    model.add_argument("--random-hf", choices=RANDOM_HF_MODELS, default=None,
                       help="instead of --preset, a published model's shape with random "
                            "weights, written by transformers")
    model.add_argument("--hf-dir", default=None, metavar="DIR",
                       help="instead of --preset, the model in a Hugging Face directory")
    kernels.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                         help="compute and weights dtype (default: the model's)")
    kernels.add_argument("--cache-dtype", choices=CACHE_DTYPE_NAMES, default=None,
                         help="the KV cache's dtype (default: the compute dtype)")
    kernels.add_argument("--batch", type=positive, default=1, help="rows decoding")
    kernels.add_argument("--prompt-len", type=positive, default=32, help="prompt tokens")
    kernels.add_argument("--new-tokens", type=positive, default=128, help="tokens to generate")
    kernels.add_argument("--layers", choices=LAYER_MODES, default="unrolled",
                         help="the layer layout")
    kernels.add_argument("--loop", default="default", metavar="LOOP",
                         help="the decode loop, as `kvjax bench decode --loops` names it "
                              "(default, device, host, host:K)")
    kernels.add_argument("--top", type=positive, default=30, help="kernels listed")
    kernels.add_argument("--engine", action="store_true",
                         help="also the same work done by a serving engine of --batch slots "
                              "(kvjax.serve.Engine), each slot making --new-tokens tokens")
    add_decode_attention(kernels)
    kernels.set_defaults(run=in_decode_attention_mode(run_bench_kernels))


def _model_dir(args, scratch: str) -> str | None:
    """The Hugging Face directory a benchmark runs: `--hf-dir`, or `--random-hf`'s model
    written into `scratch`, or None (a preset)."""
    if not args.random_hf:
        return args.hf_dir
    from kvjax.benchmarks.random_hf import write_random_hf

    print(f"writing {args.random_hf} with random weights ...")
    return write_random_hf(args.random_hf,
                           os.path.join(scratch, f"{args.random_hf}-random-weights"),
                           args.dtype or "float32")


def run_bench_kernels(args) -> int:
    from kvjax.benchmarks.kernels import format_profile, profile_decode, profile_engine

    with tempfile.TemporaryDirectory() as scratch:
        model = (args.preset, _model_dir(args, scratch), args.batch, args.prompt_len,
                 args.new_tokens, args.layers, args.dtype, args.cache_dtype)
        name, profile, seconds = profile_decode(*model, args.loop)
        setting = f"{args.layers} layers, {args.dtype or 'its own dtype'}"
        print(format_profile(profile, f"Greedy decode, {name}, batch {args.batch}, {setting}, "
                                      f"{args.loop} loop; {1e3 * seconds:.3f} ms per step "
                                      "untraced", args.top))
        if args.engine:
            _, profile, seconds = profile_engine(*model)
            print()
            print(format_profile(profile, f"The serving engine, {args.batch} slots, {setting}; "
                                          f"{1e3 * seconds:.3f} ms per step untraced",
                                 args.top))
    return 0


def _add_structured(kinds) -> None:
    structured = add_command(
        kinds, "structured", "The greedy decode step of rows held to a JSON Schema against "
        "free rows, and the time to compile each schema into a token automaton.")
    structured.add_argument("--checkpoint", default="checkpoints/python-docs-lm",
                            metavar="DIR", help="the model and tokenizer (the shipped LM)")
    structured.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 32],
                            help="batch sizes to measure")
    structured.add_argument("--new-tokens", type=positive, default=64, help="steps per call")
    structured.add_argument("--repeats", type=positive, default=3, help="timed runs (best)")
    structured.add_argument("--schema", default="flat", help="which schema the step table "
                            "holds rows to (flat, nested, 'any object')")
    structured.set_defaults(run=run_bench_structured)


def run_bench_structured(args) -> int:
    from kvjax.benchmarks.structured import SCHEMAS, format_tables, structured_benchmark

    if args.schema not in SCHEMAS:
        raise ValueError(f"--schema {args.schema!r} is none of {sorted(SCHEMAS)}")
    steps, builds = structured_benchmark(args.checkpoint, tuple(args.batch_sizes),
                                         new_tokens=args.new_tokens, repeats=args.repeats,
                                         schema=args.schema)
    print(format_tables(steps, builds, args.schema))
    return 0


def _add_decode(kinds) -> None:
    decode = add_command(kinds, "decode", "Greedy decode speed with random weights, with the "
                         "ratios to no cache, to Hugging Face GPT-2 (if installed: pip install "
                         "-e '.[bench]') and to the memory-bandwidth floor, measured in one "
                         "run.")
    decode.add_argument("--preset", choices=PRESET_NAMES, default="gpt-mini", help="model size")
    decode.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 8, 32],
                        help="batch sizes to measure")
    decode.add_argument("--prompt-len", type=positive, default=32, help="prompt tokens")
    decode.add_argument("--new-tokens", type=positive, default=256, help="tokens to generate")
    decode.add_argument("--repeats", type=positive, default=3, help="timed runs (best)")
    decode.add_argument("--layers", choices=LAYER_MODES, nargs="+", default=list(LAYER_MODES),
                        help="layer modes to time: scanned (stacked) and/or unrolled")
    decode.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers")
    decode.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="kvjax's params, compute and cache dtype (default: float32; "
                             "transformers and the sweep stay float32)")
    decode.add_argument("--cache-dtype", choices=CACHE_DTYPE_NAMES, default=None,
                        help="kvjax's KV cache dtype; int8 adds a float32 scale per token "
                             "and kv head (default: --dtype)")
    decode.add_argument("--kernel-dtype", choices=KERNEL_DTYPE_NAMES, default=None,
                        help="kvjax's layer kernels; int8 holds them as int8 with a float32 "
                             "scale per output feature (default: --dtype)")
    model = decode.add_mutually_exclusive_group()
    model.add_argument("--hf-dir", metavar="DIR", default=None,
                       help="time the decoder-only model in this Hugging Face directory "
                            "instead of --preset; transformers runs the same weights (no sweep)")
    model.add_argument("--random-hf", choices=RANDOM_HF_MODELS, default=None,
                       help="as --hf-dir, on a model of this published model's sizes with "
                            "random weights (in --dtype), written by transformers to a "
                            "temporary directory first (needs the bench extra; no sweep)")
    decode.add_argument("--loops", nargs="+", default=["default"], metavar="LOOP",
                        help="decode loops to time side by side: default (what generate runs), "
                             "device (decisions on the device, the end checked every step), "
                             "host or host:K (decided on the host, the end checked every K "
                             "steps)")
    decode.add_argument("--no-no-cache", action="store_true", help="skip the no-cache baseline")
    decode.add_argument("--devices", type=positive, default=1,
                        help="also time kvjax with each batch split over this many devices "
                             "(on a CPU, host devices), in rows beside the one-device rows")
    decode.add_argument("--whole-cache", action="store_true",
                        help="also time each layer mode reading every cache slot at each step "
                             "(as before decode attention read only filled blocks)")
    decode.add_argument("--no-sweep", action="store_true",
                        help="skip the sweep of step time against filled cache slots")
    decode.add_argument("--sweep-batch", type=positive, default=32, help="rows in the sweep")
    decode.add_argument("--sweep-capacity", type=positive, default=1024,
                        help="cache slots in the sweep")
    decode.add_argument("--sweep-fills", type=positive, nargs="+",
                        default=[64, 128, 256, 512, 1024], help="filled slots to time")
    decode.add_argument("--sweep-window", type=positive, default=128,
                        help="the sliding window of the sweep's windowed cache, in slots")
    decode.add_argument("--sweep-plot", default="decode_sweep.png",
                        help="where to write the sweep's PNG plot")
    add_decode_attention(decode)
    decode.set_defaults(run=in_decode_attention_mode(run_bench_decode))


def _add_train(kinds) -> None:
    train = add_command(kinds, "train", "Training tokens/s and MFU of kvjax's train step "
                        "against PyTorch (Hugging Face's model of the same sizes, AdamW, "
                        "clipping; if installed: pip install -e '.[bench]'), measured in one "
                        "run.")
    train.add_argument("--preset", choices=PRESET_NAMES, default="gpt-mini", help="model size")
    train.add_argument("--shape", choices=TRAIN_SHAPES, default=None,
                       help="instead of --preset, a published model's shape with random "
                            "weights (transformers' Llama for llama-1b, else its GPT-2)")
    train.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="compute dtype (params stay float32; PyTorch under autocast)")
    train.add_argument("--torch-compile", action="store_true",
                       help="also time PyTorch through torch.compile")
    train.add_argument("--batch-size", type=positive, default=8, help="sequences per step")
    train.add_argument("--seq-len", type=positive, default=256, help="tokens per sequence")
    train.add_argument("--steps", type=positive, default=5, help="steps per timed run")
    train.add_argument("--repeats", type=positive, default=3, help="timed runs (best)")
    train.add_argument("--layers", choices=LAYER_MODES, nargs="+", default=list(LAYER_MODES),
                       help="layer modes to time: scanned (stacked) and/or unrolled")
    train.add_argument("--devices", type=positive, default=1,
                       help="also time kvjax with each batch split over this many devices "
                            "(on a CPU, host devices)")
    train.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    train.add_argument("--lora", action="store_true",
                       help="instead: LoRA against full fine-tuning on the same model, "
                            "tokens/s and each step's peak memory")
    train.add_argument("--lora-rank", type=positive, default=8, help="with --lora: the rank")
    train.add_argument("--lora-base-dtype", choices=("float32", "bfloat16", "int8"), nargs="+",
                       default=["float32", "bfloat16", "int8"],
                       help="with --lora: the dtypes to hold the frozen base in, one run each")
    train.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME",
                       help="with --lora: the kernels to adapt (default: q v)")
    train.add_argument("--remat", choices=("off", "on", "both"), default="off",
                       help="with --lora: each contender's step without the layers "
                            "rematerialized (kvjax train's default), with them (kvjax train "
                            "--remat), or both to measure the memory it saves")
    train.add_argument("--deterministic", choices=("on", "off", "both"), default="off",
                       help="kvjax's step with XLA's deterministic ops on a GPU (as kvjax train "
                            "--deterministic runs it), without them (its default), or both to "
                            "measure their cost")
    train.set_defaults(run=run_bench_train)


def _add_precision(kinds) -> None:
    precision = add_command(kinds, "precision", "float32, bfloat16, an int8 KV cache and int8 "
                            "layer kernels side by side: params bytes, cache bytes per "
                            "sequence, decode tokens/s with a long "
                            "cache (random weights), and the shipped LM's perplexity and "
                            "greedy agreement and the shipped translator's accuracy.")
    precision.add_argument("--preset", choices=PRESET_NAMES, default="gpt-mini",
                           help="model size of the cache and speed columns")
    precision.add_argument("--batch", type=positive, default=32, help="rows decoding")
    precision.add_argument("--filled", type=positive, default=1024,
                           help="filled slots of each row's cache while timing")
    precision.add_argument("--repeats", type=positive, default=3, help="timed runs (best)")
    precision.add_argument("--no-quality", action="store_true",
                           help="skip the shipped models' perplexity, agreement and accuracy")
    precision.set_defaults(run=run_bench_precision)


def _add_speculative(kinds) -> None:
    speculative = add_command(
        kinds, "speculative", "Greedy tokens/s with speculative decoding (prompt lookup or a "
        "draft model) against plain greedy, on a task whose output copies its prompt and one "
        "whose does not; with the acceptance rate and a check that both give the same tokens.")
    speculative.add_argument("--checkpoint", default="checkpoints/python-docs-lm",
                             metavar="DIR", help="the model (the shipped Python-docs LM)")
    speculative.add_argument("--preset", choices=PRESET_NAMES, default=None,
                             help="a model of this size with random weights instead")
    speculative.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 8],
                             help="batch sizes to measure")
    speculative.add_argument("--prompt-len", type=positive, default=96,
                             help="tokens of each passage")
    speculative.add_argument("--new-tokens", type=positive, default=96,
                             help="tokens to generate")
    speculative.add_argument("--num-draft-tokens", type=positive, default=4,
                             help="tokens drafted per step")
    speculative.add_argument("--ngram-size", type=positive, default=2,
                             help="suffix length looked up in the context")
    speculative.add_argument("--min-tokens-per-call", type=float, default=2.0,
                             help="drafting turns off below this moving average of tokens "
                                  "a verifying call emits per row (0: always draft)")
    drafts = speculative.add_mutually_exclusive_group()
    drafts.add_argument("--draft-checkpoint", metavar="DIR", default=None,
                        help="draft with this model (same tokenizer) instead of prompt lookup; "
                             "the --checkpoint itself gives the upper bound on acceptance")
    drafts.add_argument("--draft-layers", type=positive, default=None, metavar="N",
                        help="draft with the model's first N layers instead of prompt lookup")
    speculative.add_argument("--repeats", type=positive, default=10, help="timed runs (best)")
    speculative.set_defaults(run=run_bench_speculative)


def run_bench_speculative(args) -> int:
    from kvjax.benchmarks.speculative import format_table, speculative_benchmark

    rows = speculative_benchmark(args.checkpoint, args.preset, tuple(args.batch_sizes),
                                 args.prompt_len, args.new_tokens, args.num_draft_tokens,
                                 args.ngram_size, args.repeats, args.draft_checkpoint,
                                 args.draft_layers, args.min_tokens_per_call)
    drafts_from = (args.draft_checkpoint if args.draft_layers is None
                   else f"of the first {args.draft_layers} layer(s)")
    print(format_table(rows, args.num_draft_tokens, args.ngram_size, drafts_from))
    return 0


def run_bench_decode(args) -> int:
    from kvjax.benchmarks.decode import decode_benchmark, format_table, parse_loop
    from kvjax.benchmarks.fill_sweep import check_sweep

    sweep = not (args.no_sweep or args.hf_dir or args.random_hf)  # the sweep is per preset
    if sweep:  # before minutes of timing, not after
        check_sweep(args.preset, args.sweep_capacity, args.sweep_fills)
    loops = {name: parse_loop(name) for name in args.loops}  # a bad name fails first
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = _model_dir(args, scratch)
        rows, facts = decode_benchmark(
            args.preset, tuple(args.batch_sizes), args.prompt_len, args.new_tokens,
            args.repeats, layer_modes=tuple(args.layers), compare_no_cache=not args.no_no_cache,
            compare_hf=not args.no_hf, devices=args.devices, whole_cache=args.whole_cache,
            hf_dir=hf_dir, dtype=args.dtype, cache_dtype=args.cache_dtype,
            kernel_dtype=args.kernel_dtype, loops=loops)
    print(format_table(rows, facts))
    if sweep:
        from kvjax import model as M
        from kvjax.benchmarks.fill_sweep import fill_sweep, format_sweep, plot_sweep

        sweep = fill_sweep(args.preset, args.sweep_batch, args.sweep_capacity,
                           tuple(args.sweep_fills), tuple(args.layers), args.repeats,
                           window=args.sweep_window)
        block = M.preset(args.preset).attention_block
        print("\n" + format_sweep(sweep, args.sweep_batch, args.sweep_capacity, block,
                                  window=args.sweep_window))
        plot_sweep(sweep, args.sweep_plot, args.sweep_batch, args.sweep_capacity)
        print(f"plot: {args.sweep_plot}")
    return 0


def run_bench_train(args) -> int:
    from kvjax.benchmarks.train import format_train_table, train_benchmark

    if args.remat != "off" and not args.lora:
        raise ValueError(f"--remat {args.remat} applies with --lora (whose table shows each "
                         "step's memory)")
    if args.lora:
        from kvjax.benchmarks.train_lora import format_lora_table, lora_benchmark
        from kvjax.model.lora import DEFAULT_TARGETS

        rows, setting = lora_benchmark(
            args.shape or args.preset, args.batch_size, args.seq_len, args.lora_rank,
            tuple(args.lora_targets or DEFAULT_TARGETS), args.steps, args.repeats, args.dtype,
            tuple(None if d == "float32" else d for d in args.lora_base_dtype),
            {"off": (False,), "on": (True,), "both": (False, True)}[args.remat])
        print(format_lora_table(rows, setting))
        return 0

    rows, setting, peak = train_benchmark(
        args.shape or args.preset, args.batch_size, args.seq_len, args.steps, args.repeats,
        devices=args.devices, layer_modes=tuple(args.layers), compare_torch=not args.no_torch,
        deterministic={"on": (True,), "off": (False,), "both": (True, False)}[args.deterministic],
        dtype=args.dtype, torch_compile=args.torch_compile)
    print(format_train_table(rows, setting, peak))
    return 0


def run_bench_precision(args) -> int:
    from kvjax.benchmarks.precision import precision_report

    print(precision_report(args.preset, args.batch, args.filled, args.repeats,
                           quality=not args.no_quality))
    return 0
