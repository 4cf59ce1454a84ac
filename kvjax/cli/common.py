"""What the commands share: the parser classes, argument types and choices, and how a command
is added. Nothing here imports jax, so that `kvjax --help` answers at once."""

from __future__ import annotations

import argparse
import re

MAX_SEED = 2**63 - 1  # kvjax.text.MAX_SEED: jax.random.key takes a signed 64-bit seed
PRESET_NAMES = ("tiny", "small", "gpt-mini")  # model.PRESETS, named here to keep jax unloaded
LAYER_MODES = ("scanned", "unrolled")  # kvjax.benchmarks.decode.LAYER_MODES
# kvjax.benchmarks.random_hf's
RANDOM_HF_MODELS = ("gpt2", "llama-1b", "qwen2-0.5b", "granitemoe-1b")
TRAIN_SHAPES = ("gpt2-small", "llama-1b")  # kvjax.benchmarks.train.SHAPES
DTYPE_NAMES = ("float32", "bfloat16", "float16")
CACHE_DTYPE_NAMES = (*DTYPE_NAMES, "int8")  # model.config.CACHE_DTYPES
KERNEL_DTYPE_NAMES = ("int8",)  # model.config_checks.KERNEL_DTYPES


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default and keeps the descriptions' line breaks. An option whose
    default is None says in its own help what it then does."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Reports a bad option in one line (no usage dump): `kvjax train: error: ...`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63 - 1], got {value}")
    return value


def positive_real(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


_BINARY_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def byte_size(text: str) -> int:
    """Bytes of a size written as a number with a binary unit: '4GiB', '512 MiB', '1.5GiB',
    '1000000' (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = (match.group(2) or "B") if match else None
    if unit not in _BINARY_UNITS:
        raise argparse.ArgumentTypeError(f"a size is a number and one of "
                                         f"{', '.join(_BINARY_UNITS)}, got {text!r}")
    value = int(float(match.group(1)) * _BINARY_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


# Names for argparse's messages ("invalid seed value: 'x'" reads better as "invalid int").
for _type, _name in ((positive, "int"), (count, "int"), (seed, "int"),
                     (positive_real, "number"), (byte_size, "size")):
    _type.__name__ = _name


def add_command(commands, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand's parser, described by `help_text` in `kvjax --help` and its own help."""
    return commands.add_parser(name, help=help_text, description=help_text,
                               formatter_class=Formatter)


def add_precision(parser: argparse.ArgumentParser) -> None:
    """--dtype, --cache-dtype and --kernel-dtype, which `load_in_precision` applies."""
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="params, compute and cache dtype (default: the checkpoint's)")
    parser.add_argument("--cache-dtype", choices=CACHE_DTYPE_NAMES, default=None,
                        help="KV cache dtype; int8 stores K and V as int8 with a float32 scale "
                             "per token and kv head (default: --dtype)")
    parser.add_argument("--kernel-dtype", choices=KERNEL_DTYPE_NAMES, default=None,
                        help="int8 holds the layers' attention, FFN and expert weights and "
                             "the embedding table as int8 with float32 scales, about half the "
                             "memory of bfloat16; each layer computes with them in --dtype "
                             "(default: as the checkpoint holds them)")


def load_in_precision(directory, args, lora=None):
    """The model in `directory` (`kvjax.text.load`, with `lora`) in the precision --dtype,
    --cache-dtype and --kernel-dtype ask for; a Hugging Face directory is read in them."""
    import dataclasses

    from kvjax import model as M
    from kvjax import text

    loaded = text.load(directory, lora=lora, dtype=args.dtype, kernel_dtype=args.kernel_dtype)
    if args.cache_dtype is None:
        return loaded
    config, params = M.with_precision(loaded.config, loaded.params,
                                      cache_dtype=args.cache_dtype)
    return dataclasses.replace(loaded, config=config, params=params)


def schedule(args) -> dict:
    """--steps and --warmup-steps as training overrides; warmup scales down with few steps."""
    overrides = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
        overrides["warmup_steps"] = min(50, args.steps // 10)
    if args.warmup_steps is not None:
        overrides["warmup_steps"] = args.warmup_steps
    return overrides


def add_decode_attention(parser) -> None:
    parser.add_argument("--decode-attention", choices=("auto", "xla"), default="auto",
                        help="decode steps' attention: auto (one kernel per layer on an "
                             "NVIDIA GPU, XLA's ops elsewhere) or xla (XLA's ops everywhere)")


def in_decode_attention_mode(run):
    """`run(args)` with its decode steps' attention as `--decode-attention` says."""
    def wrapped(args) -> int:
        from kvjax.model.decode_kernel import decode_kernel_mode

        with decode_kernel_mode(args.decode_attention):
            return run(args)

    return wrapped
