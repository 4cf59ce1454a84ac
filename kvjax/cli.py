"""The `kvjax` command line. It only parses options and calls library functions.

    kvjax demo                       train both demo models, save them, show generations
    kvjax train --task lm|translate  train one model into a checkpoint directory
    kvjax sample --checkpoint DIR --prompt TEXT
    kvjax cache-size                 the KV-cache size formula for a preset or given sizes
    kvjax bench decode               decode speed against no cache, HF GPT-2 and memory
    kvjax bench train                training tokens/s against PyTorch eager

A bad option, path or input ends with one line on stderr and exit code 2. A training run
stopped by Ctrl-C or SIGTERM saves a checkpoint first and exits with 130 or 143; a run whose
loss diverges exits with 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Sequence

MAX_SEED = 2**63 - 1  # kvjax.text.MAX_SEED: jax.random.key takes a signed 64-bit seed
PRESET_NAMES = ("tiny", "small", "gpt-mini")  # model.PRESETS, named here to keep jax unloaded
LAYER_MODES = ("scanned", "unrolled")  # kvjax.bench.LAYER_MODES
DTYPE_NAMES = ("float32", "bfloat16", "float16")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default and keeps the descriptions' line breaks."""


class _Parser(argparse.ArgumentParser):
    """Reports a bad option in one line (no usage dump): `kvjax train: error: ...`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63 - 1], got {value}")
    return value


def _positive_real(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


# Names for argparse's messages ("invalid _seed value: 'x'" reads better as "invalid int").
for _type, _name in ((_positive, "int"), (_count, "int"), (_seed, "int"),
                     (_positive_real, "number")):
    _type.__name__ = _name


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvjax", description=__doc__, formatter_class=_Formatter)
    parser.add_argument("--compilation-cache", metavar="DIR", default=None,
                        help="keep compiled programs in DIR so that the next run skips "
                             "compiling them (off when not given)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(commands)
    _add_train(commands)
    _add_sample(commands)
    _add_cache_size(commands)
    _add_bench(commands)
    return parser


def _command(commands, name: str, help_text: str) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=help_text, description=help_text,
                               formatter_class=_Formatter)


def _add_demo(commands) -> None:
    demo = _command(commands, "demo", "Train a small LM on Python's documentation and a "
                    "numbers-to-words translator (about 2 minutes each on 2 CPU cores), save "
                    "both, print generations, accuracy, perplexity and decode speed.")
    demo.add_argument("--out", default="checkpoints/demo",
                      help="directory for the two checkpoints (a previous demo's are replaced)")
    demo.add_argument("--steps", type=_positive, default=None,
                      help="training steps for each model (default: the demo settings)")
    demo.add_argument("--warmup-steps", type=_count, default=None,
                      help="learning-rate warmup steps (default: 50, or a tenth of --steps "
                           "if that is less)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(run=_run_demo)


def _add_train(commands) -> None:
    train = _command(commands, "train", "Train a decoder-only LM (--task lm) or an "
                     "encoder-decoder translator (--task translate) with checkpoints, a "
                     "metrics JSONL file and a loss-curve PNG in --out.")
    train.add_argument("--task", choices=("lm", "translate"), required=True,
                       help="lm: next-token prediction on text; translate: source -> target")
    train.add_argument("--data", nargs="+", metavar="FILE", default=None,
                       help="lm: UTF-8 text files; translate: one TSV file of "
                            "source<TAB>target lines (default: Python's documentation, or "
                            "numbers spelled as English words)")
    train.add_argument("--preset", choices=PRESET_NAMES, default=None,
                       help="model size (default: the demo's reduced 'small' model)")
    train.add_argument("--steps", type=_positive, default=None,
                       help="training steps (default: the demo settings)")
    train.add_argument("--batch-size", type=_positive, default=None,
                       help="examples per step (default: the demo settings)")
    train.add_argument("--learning-rate", type=_positive_real, default=None,
                       help="peak learning rate (default: the demo settings)")
    train.add_argument("--warmup-steps", type=_count, default=None,
                       help="learning-rate warmup steps (default: 50, or a tenth of --steps "
                            "if that is less)")
    train.add_argument("--save-every", type=_positive, default=None,
                       help="steps between checkpoints (default: a tenth of --steps); one is "
                            "also saved at the end and on Ctrl-C or SIGTERM")
    train.add_argument("--heldout", type=_count, default=None,
                       help="translate: pairs held out for validation and accuracy (default: "
                            "a tenth of the pairs, at most 1000; 0: none)")
    train.add_argument("--seed", type=_seed, default=0,
                       help="seed for init, shuffling, dropout")
    train.add_argument("--out", default=None,
                       help="checkpoint directory (default: runs/<task>)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in --out, with the data and "
                            "settings it was started with (recorded in its run.json)")
    train.add_argument("--allow-changes", action="store_true",
                       help="with --resume: accept other data or other --steps and schedule "
                            "settings than the run was started with")
    train.add_argument("--mesh", default=None, metavar="data=N,model=M",
                       help="split each batch over N devices and the heads and FFN over M "
                            "(default: every device on data)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=_run_train)


def _add_sample(commands) -> None:
    sample = _command(commands, "sample", "Generate from a checkpoint, streaming the text as "
                      "it is made. For a translation checkpoint the prompt is the source.")
    sample.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a directory written by `kvjax train` or `kvjax demo`")
    sample.add_argument("--prompt", required=True, help="the text to continue or translate")
    sample.add_argument("--max-new-tokens", type=_positive, default=64,
                        help="stop after this many tokens (fewer if the model's length ends)")
    sample.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sample.add_argument("--top-k", type=_count, default=0,
                        help="keep the k likeliest (0 = all)")
    sample.add_argument("--top-p", type=float, default=1.0,
                        help="keep the smallest set of likeliest tokens with this much mass")
    sample.add_argument("--min-p", type=float, default=0.0,
                        help="keep tokens at least this fraction as likely as the likeliest")
    sample.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 1 makes tokens already in the prompt or output less likely")
    sample.add_argument("--no-repeat-ngram-size", type=_count, default=0,
                        help="n > 0: never repeat an n-gram of the prompt or output")
    sample.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end the text before this string (repeatable; \\n and \\t "
                             "are a newline and a tab)")
    sample.add_argument("--num-samples", type=_positive, default=1,
                        help="samples of the prompt, from one prefill")
    sample.add_argument("--beams", type=_positive, default=1,
                        help="beam search with this many beams (1 = sampling as above)")
    sample.add_argument("--seed", type=_seed, default=0, help="sampling seed")
    sample.set_defaults(run=_run_sample)


def _add_cache_size(commands) -> None:
    size = _command(commands, "cache-size", "Bytes of the KV cache: 2 x length x layers x "
                    "kv_heads x head_dim x bytes per sequence, for a preset or for the sizes "
                    "given (e.g. --layers 32 --heads 32 --head-dim 128 --dtype float16).")
    size.add_argument("--preset", choices=PRESET_NAMES, default=None,
                      help="take the sizes from this preset (default: gpt-mini unless "
                           "--layers/--heads/--head-dim are given)")
    size.add_argument("--layers", type=_positive, help="decoder layers")
    size.add_argument("--heads", type=_positive, help="query heads")
    size.add_argument("--kv-heads", type=_positive, help="kv heads (default: --heads)")
    size.add_argument("--head-dim", type=_positive, help="dimension of each head")
    size.add_argument("--encoder-layers", type=int, default=0,
                      help="> 0: an encoder-decoder, whose cross-attention cache is shown too")
    size.add_argument("--length", type=_positive, default=1024, help="tokens per sequence")
    size.add_argument("--source-length", type=_positive, default=None,
                      help="source tokens of an encoder-decoder (default: --length)")
    size.add_argument("--batch", type=_positive, default=1, help="sequences")
    size.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                      help="cache dtype (default: the model's compute dtype)")
    size.set_defaults(run=_run_cache_size)


def _add_bench(commands) -> None:
    bench = _command(commands, "bench", "Benchmarks.")
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    decode = _command(kinds, "decode", "Greedy decode speed with random weights, with the "
                      "ratios to no cache, to Hugging Face GPT-2 (if installed: pip install "
                      "-e '.[bench]') and to the memory-bandwidth floor, measured in one run.")
    decode.add_argument("--preset", choices=PRESET_NAMES, default="gpt-mini", help="model size")
    decode.add_argument("--batch-sizes", type=_positive, nargs="+", default=[1, 8, 32],
                        help="batch sizes to measure")
    decode.add_argument("--prompt-len", type=_positive, default=32, help="prompt tokens")
    decode.add_argument("--new-tokens", type=_positive, default=256, help="tokens to generate")
    decode.add_argument("--repeats", type=_positive, default=3, help="timed runs (best)")
    decode.add_argument("--layers", choices=LAYER_MODES, nargs="+", default=list(LAYER_MODES),
                        help="layer modes to time: scanned (stacked) and/or unrolled")
    decode.add_argument("--no-hf", action="store_true", help="skip Hugging Face GPT-2")
    decode.add_argument("--no-no-cache", action="store_true", help="skip the no-cache baseline")
    decode.add_argument("--devices", type=_positive, default=1,
                        help="also time kvjax with each batch split over this many devices "
                             "(on a CPU, host devices), in rows beside the one-device rows")
    decode.add_argument("--whole-cache", action="store_true",
                        help="also time each layer mode reading every cache slot at each step "
                             "(as before decode attention read only filled blocks)")
    decode.add_argument("--no-sweep", action="store_true",
                        help="skip the sweep of step time against filled cache slots")
    decode.add_argument("--sweep-batch", type=_positive, default=32, help="rows in the sweep")
    decode.add_argument("--sweep-capacity", type=_positive, default=1024,
                        help="cache slots in the sweep")
    decode.add_argument("--sweep-fills", type=_positive, nargs="+",
                        default=[64, 128, 256, 512, 1024], help="filled slots to time")
    decode.add_argument("--sweep-plot", default="decode_sweep.png",
                        help="where to write the sweep's PNG plot")
    decode.set_defaults(run=_run_bench_decode)
    train = _command(kinds, "train", "Training tokens/s of kvjax's train step against "
                     "PyTorch eager (Hugging Face GPT-2 of the same sizes, AdamW, clipping; "
                     "if installed: pip install -e '.[bench]'), measured in one run.")
    train.add_argument("--preset", choices=PRESET_NAMES, default="gpt-mini", help="model size")
    train.add_argument("--batch-size", type=_positive, default=8, help="sequences per step")
    train.add_argument("--seq-len", type=_positive, default=256, help="tokens per sequence")
    train.add_argument("--steps", type=_positive, default=5, help="steps per timed run")
    train.add_argument("--repeats", type=_positive, default=3, help="timed runs (best)")
    train.add_argument("--layers", choices=LAYER_MODES, nargs="+", default=list(LAYER_MODES),
                       help="layer modes to time: scanned (stacked) and/or unrolled")
    train.add_argument("--devices", type=_positive, default=1,
                       help="also time kvjax with each batch split over this many devices "
                            "(on a CPU, host devices)")
    train.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    train.set_defaults(run=_run_bench_train)


# What each command runs. Imports are local: `kvjax --help` should not wait for jax.


def _schedule(args) -> dict:
    """--steps and --warmup-steps as training overrides; warmup scales down with few steps."""
    overrides = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
        overrides["warmup_steps"] = min(50, args.steps // 10)
    if args.warmup_steps is not None:
        overrides["warmup_steps"] = args.warmup_steps
    return overrides


def _run_demo(args) -> int:
    from kvjax.demo import run_demo

    overrides = _schedule(args)
    report = run_demo(args.out, progress=not args.no_progress, lm_overrides=overrides,
                      translate_overrides=overrides)
    return 0 if report.passed else 1


def _run_train(args) -> int:
    from kvjax import model as M
    from kvjax.train import tasks

    overrides = {"seed": args.seed, "progress": not args.no_progress, **_schedule(args)}
    for option, name in (("batch_size", "batch_size"), ("learning_rate", "learning_rate"),
                         ("save_every", "save_every")):
        if getattr(args, option) is not None:
            overrides[name] = getattr(args, option)
    if args.preset is not None:
        encoder = M.preset(args.preset).num_decoder_layers if args.task == "translate" else 0
        overrides.update(preset=args.preset, model_overrides={"num_encoder_layers": encoder})
    if args.allow_changes and not args.resume:
        raise ValueError("--allow-changes only applies with --resume")
    out = args.out or f"runs/{args.task}"
    common = dict(resume=args.resume, allow_changes=args.allow_changes)
    overrides["mesh"] = _mesh(args.mesh)
    if args.task == "lm":
        if args.heldout is not None:
            raise ValueError("--heldout applies to --task translate (an LM holds out 5% of "
                             "its text windows)")
        result = tasks.train_lm(out, data_files=args.data, **common, **overrides)
    else:
        if args.data is not None and len(args.data) != 1:
            raise ValueError(f"--task translate takes one TSV file, got {len(args.data)}")
        if args.heldout is not None:
            overrides["num_heldout"] = args.heldout
        data_tsv = None if args.data is None else args.data[0]
        result = tasks.train_translate(out, data_tsv=data_tsv, **common, **overrides)
    metrics = " ".join(f"{k}={v:.4g}" for k, v in result.metrics.items())
    print(f"trained to step {result.step}: {metrics}\ncheckpoint: {result.out_dir}\n"
          f"metrics: {result.metrics_path}\nloss curve: {result.loss_curve_path}")
    return 0


def _mesh(spec: str | None):
    """The mesh `--mesh` asks for; without it every device on `data`, or None on one device
    (which needs no mesh)."""
    import jax

    from kvjax import parallel

    if spec is None and jax.device_count() == 1:
        return None
    return parallel.make_mesh(spec)


def _run_sample(args) -> int:
    from kvjax import text

    loaded = text.load(args.checkpoint)
    room = text.room(loaded, args.prompt)  # a prompt too long fails here, before the echo
    if args.max_new_tokens > room:
        print(f"kvjax sample: --max-new-tokens {args.max_new_tokens} does not fit the model's "
              f"length ({loaded.config.max_len} tokens) after this prompt; generating at most "
              f"{room}", file=sys.stderr)
    if loaded.is_translation:
        print(f"{args.prompt} -> ", end="", flush=True)
    else:
        print(args.prompt, end="", flush=True)
    settings = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size, num_beams=args.beams, seed=args.seed,
        stop=[_unescape(s) for s in args.stop])
    if args.num_samples == 1:
        try:
            result = text.sample_text(loaded, args.prompt, **settings,
                                      on_text=lambda piece: print(piece, end="", flush=True))
        finally:
            print(flush=True)  # whatever happens, the echoed line ends before anything else
        results = [result]
    else:
        print()  # samples are printed whole, each after its own header
        results = text.sample_texts(loaded, args.prompt, num_samples=args.num_samples,
                                    **settings)
        for i, result in enumerate(results):
            print(f"--- sample {i + 1} of {len(results)} ({len(result.tokens)} tokens; stop: "
                  f"{result.stop_reason}) ---\n{result.text}")
    first = results[0]
    total = sum(len(r.tokens) for r in results)
    compiled = (f"; compilation {first.compile_seconds:.2f} s not included"
                if first.compile_seconds > 0 else "")
    stops = "/".join(sorted({r.stop_reason for r in results}))
    print(f"[{total} tokens in {first.decode_seconds:.2f} s: "
          f"{total / max(first.decode_seconds, 1e-9):.1f} tokens/s{compiled}; first text after "
          f"{first.first_chunk_seconds:.2f} s; stop: {stops}]")
    return 0


def _unescape(text: str) -> str:
    """A --stop value with \\n and \\t (as a shell passes them) turned into the characters."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def _run_cache_size(args) -> int:
    from kvjax import model as M
    from kvjax.model.config import describe_cache_size

    given = {"num_decoder_layers": args.layers, "num_heads": args.heads,
             "num_kv_heads": args.kv_heads}
    if args.head_dim is not None:
        heads = args.heads or M.preset(args.preset or "gpt-mini").num_heads
        given["d_model"] = heads * args.head_dim
    config = M.preset(args.preset or "gpt-mini", num_encoder_layers=args.encoder_layers,
                      **{k: v for k, v in given.items() if v is not None})
    print(describe_cache_size(config, args.batch, args.length, args.dtype, args.source_length))
    return 0


def _run_bench_decode(args) -> int:
    from kvjax.bench import decode_benchmark, format_table
    from kvjax.fill_sweep import check_sweep

    if not args.no_sweep:  # before minutes of timing, not after
        check_sweep(args.preset, args.sweep_capacity, args.sweep_fills)
    rows, facts = decode_benchmark(
        args.preset, tuple(args.batch_sizes), args.prompt_len, args.new_tokens, args.repeats,
        layer_modes=tuple(args.layers), compare_no_cache=not args.no_no_cache,
        compare_hf=not args.no_hf, devices=args.devices, whole_cache=args.whole_cache)
    print(format_table(rows, facts))
    if not args.no_sweep:
        from kvjax import model as M
        from kvjax.fill_sweep import fill_sweep, format_sweep, plot_sweep

        sweep = fill_sweep(args.preset, args.sweep_batch, args.sweep_capacity,
                           tuple(args.sweep_fills), tuple(args.layers), args.repeats)
        block = M.preset(args.preset).attention_block
        print("\n" + format_sweep(sweep, args.sweep_batch, args.sweep_capacity, block))
        plot_sweep(sweep, args.sweep_plot, args.sweep_batch, args.sweep_capacity)
        print(f"plot: {args.sweep_plot}")
    return 0


def _run_bench_train(args) -> int:
    from kvjax.bench_train import format_train_table, train_benchmark

    rows, setting = train_benchmark(
        args.preset, args.batch_size, args.seq_len, args.steps, args.repeats,
        devices=args.devices, layer_modes=tuple(args.layers), compare_torch=not args.no_torch)
    print(format_train_table(rows, setting))
    return 0


def _host_devices(count: int) -> None:
    """Lets the CPU backend show `count` devices, where it would show one. XLA reads this
    when JAX starts, so it must be set before jax is first imported (in this process it is
    not yet, unless `main` is called from a program that imported it)."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "devices", 1) > 1:
        _host_devices(args.devices)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            if args.compilation_cache:
                _enable_compilation_cache(args.compilation_cache)
            return args.run(args)
    except (ValueError, OSError) as error:  # CheckpointError is a ValueError
        return _fail(args, error, 2)
    except KeyboardInterrupt:
        print(f"\nkvjax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        from kvjax.train.trainer import TrainingDiverged, TrainingInterrupted

        if isinstance(error, TrainingInterrupted):
            return _fail(args, error, error.exit_code)
        if isinstance(error, TrainingDiverged):
            return _fail(args, error, 1)
        raise


def _fail(args, error: BaseException, code: int) -> int:
    message = " ".join(str(error).split())  # one line, whatever the message holds
    print(f"kvjax {args.command}: error: {message}", file=sys.stderr, flush=True)
    return code


def _enable_compilation_cache(directory: str) -> None:
    from kvjax import enable_compilation_cache

    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"--compilation-cache {directory} is not a directory")
    try:
        enable_compilation_cache(directory)
    except OSError as e:
        raise OSError(f"--compilation-cache {directory} cannot be used: "
                      f"{e.strerror or e}") from None
    probe = os.path.join(directory, f".kvjax-write-test-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise OSError(f"--compilation-cache {directory} is not writable: "
                      f"{e.strerror or e}") from None


def _in_orbax(filename: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in filename


def _quiet_orbax_leftovers(unraisable) -> None:
    """Drops what orbax's background reads print when they are garbage-collected after a
    failed read, whose error was already reported in one line: "Event loop is closed", and
    the same read error again from each pending coroutine. Anything else is shown."""
    error, source = unraisable.exc_value, unraisable.object
    code = getattr(source, "cr_code", None)
    if isinstance(error, RuntimeError) and "Event loop is closed" in str(error):
        return
    if code is not None and _in_orbax(code.co_filename):
        return
    sys.__unraisablehook__(unraisable)


def _not_an_orbax_leftover(record: logging.LogRecord) -> bool:
    """A filter for the `asyncio` logger: False for its report of an orbax read whose
    exception no one retrieved ("... exception was never retrieved"), the same failed read
    that was already reported in one line; True for everything else."""
    error = record.exc_info[1] if record.exc_info else None
    if error is None or "never retrieved" not in record.getMessage():
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return not any(_in_orbax(frame.filename) for frame in frames)


def console_main() -> None:
    """The `kvjax` console script: `main` with asyncio's shutdown noise filtered."""
    sys.unraisablehook = _quiet_orbax_leftovers
    logging.getLogger("asyncio").addFilter(_not_an_orbax_leftover)
    sys.exit(main())


if __name__ == "__main__":
    console_main()
