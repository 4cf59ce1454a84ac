"""`kvjax merge-lora`: a base checkpoint and LoRA adapters written as one whole model."""

from __future__ import annotations

from .common import add_command


def add_merge_lora(commands) -> None:
    command = add_command(
        commands, "merge-lora", "Write a checkpoint with LoRA adapters (kvjax train "
        "--lora-rank) merged into the base they were trained on: a whole model that kvjax "
        "sample, serve and train --init-from read without the adapters.")
    command.add_argument("--checkpoint", required=True, metavar="DIR",
                         help="the base checkpoint the adapters were trained on")
    command.add_argument("--lora", required=True, metavar="DIR", help="the adapters' run")
    command.add_argument("--out", required=True, metavar="OUT",
                         help="the new checkpoint directory")
    command.set_defaults(run=run_merge_lora)


def run_merge_lora(args) -> int:
    from kvjax.train import lora

    out = lora.merge_into_checkpoint(args.checkpoint, args.lora, args.out)
    print(f"wrote {out}")
    return 0
