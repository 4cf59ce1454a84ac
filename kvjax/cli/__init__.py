"""The `kvjax` command line. It only parses options and calls library functions.

    kvjax demo                       train both demo models, save them, show generations
    kvjax train --task lm|translate  train one model into a checkpoint directory
    kvjax sample --checkpoint DIR --prompt TEXT   (a kvjax checkpoint or a Hugging Face model)
    kvjax chat --checkpoint DIR      a conversation with an instruct model on the terminal
    kvjax serve --checkpoint DIR     an OpenAI-compatible server with continuous batching
    kvjax import-hf DIR OUT          a Hugging Face model directory as a kvjax checkpoint
    kvjax merge-lora --checkpoint DIR --lora DIR --out OUT   LoRA adapters merged into a model
    kvjax export-peft --lora DIR --hf-dir DIR --out OUT   LoRA adapters as a PEFT adapter
    kvjax cache-size                 the KV-cache size formula for a preset or given sizes
    kvjax bench decode               decode speed against no cache, HF GPT-2 and memory
    kvjax bench train                training tokens/s against PyTorch eager

A bad option, path or input ends with one line on stderr and exit code 2. A training run
stopped by Ctrl-C or SIGTERM saves a checkpoint first and exits with 130 or 143; a run whose
loss diverges exits with 1.
"""

# The docstring above is `kvjax --help`'s description. Each command is a module here with an
# `add_<command>(commands)` that builds its parser and sets `run`, the function it calls;
# `common.py` holds what they share and `errors.py` how failures are reported. A command's
# imports of jax and the library happen when it runs: `kvjax --help` should not wait for jax.

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence

from . import compilation_cache
from .bench import add_bench
from .cache_size import add_cache_size
from .chat import add_chat
from .common import LAYER_MODES, PRESET_NAMES, Formatter, Parser, schedule
from .compilation_cache import ENVIRONMENT_VARIABLE
from .demo import add_demo
from .errors import fail, not_an_orbax_leftover, one_line_warnings, quiet_orbax_leftovers
from .export_peft import add_export_peft
from .import_hf import add_import_hf
from .merge_lora import add_merge_lora
from .sample import add_sample
from .serve import add_serve
from .train import add_train

# In the order `kvjax --help` lists them.
COMMANDS = (add_demo, add_train, add_sample, add_chat, add_serve, add_import_hf,
            add_merge_lora, add_export_peft, add_cache_size, add_bench)

# Where these were before the commands became modules of their own.
_schedule = schedule
_not_an_orbax_leftover = not_an_orbax_leftover

__all__ = ["COMMANDS", "LAYER_MODES", "PRESET_NAMES", "build_parser", "console_main", "main"]


def build_parser() -> Parser:
    parser = Parser(prog="kvjax", description=__doc__, formatter_class=Formatter)
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compilation-cache", metavar="DIR", default=None,
                       help="keep compiled programs in DIR so that the next run skips "
                            "compiling them (default: sample and serve keep them in "
                            "$XDG_CACHE_HOME/kvjax/jax or ~/.cache/kvjax/jax, or in "
                            f"${ENVIRONMENT_VARIABLE} (off: nowhere); other commands nowhere)")
    cache.add_argument("--no-compilation-cache", action="store_true",
                       help="compile every program anew, keeping none")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "devices", 1) > 1:
        _host_devices(args.devices)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = one_line_warnings(args.command, warnings.showwarning)
            directory, named = compilation_cache.choose(
                args.command, args.compilation_cache, args.no_compilation_cache, os.environ)
            if directory is not None:
                compilation_cache.use(directory, named)
            return args.run(args)
    except (ValueError, OSError) as error:  # CheckpointError is a ValueError
        return fail(args.command, error, 2)
    except KeyboardInterrupt:
        print(f"\nkvjax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        from kvjax.train.trainer import TrainingDiverged, TrainingInterrupted

        if isinstance(error, TrainingInterrupted):
            return fail(args.command, error, error.exit_code)
        if isinstance(error, TrainingDiverged):
            return fail(args.command, error, 1)
        raise


def console_main() -> None:
    """The `kvjax` console script: `main` with asyncio's shutdown noise filtered."""
    sys.unraisablehook = quiet_orbax_leftovers
    logging.getLogger("asyncio").addFilter(not_an_orbax_leftover)
    sys.exit(main())


def _host_devices(count: int) -> None:
    """Lets the CPU backend show `count` devices, where it would show one. XLA reads this
    when JAX starts, so it must be set before jax is first imported (in this process it is
    not yet, unless `main` is called from a program that imported it)."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
