"""`kvjax import-hf`: a Hugging Face model directory written as a kvjax checkpoint."""

from __future__ import annotations

from .common import add_command


def add_import_hf(commands) -> None:
    command = add_command(
        commands, "import-hf", "Write the model in a local Hugging Face directory (GPT-2, "
        "Llama, Qwen2 or Marian: config.json, safetensors, tokenizer files) as a kvjax "
        "checkpoint, with an integrity manifest, that `kvjax sample` and `kvjax train "
        "--init-from` read.")
    command.add_argument("directory", metavar="DIR", help="the Hugging Face model directory")
    command.add_argument("out", metavar="OUT", help="the new checkpoint directory")
    command.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                         help="the params' dtype (default: float32)")
    command.set_defaults(run=run_import_hf)


def run_import_hf(args) -> int:
    from kvjax.hf.convert import import_checkpoint

    out = import_checkpoint(args.directory, args.out, dtype=args.dtype)
    print(f"wrote {out}")
    return 0
