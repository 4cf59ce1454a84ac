"""`kvjax export-peft`: LoRA adapters trained on a Hugging Face model written as PEFT's."""

from __future__ import annotations

from .common import add_command


def add_export_peft(commands) -> None:
    command = add_command(
        commands, "export-peft", "Write the LoRA adapters of a kvjax train --lora-rank run on a "
        "Hugging Face model (--init-from DIR) as a PEFT adapter of that model "
        "(adapter_config.json, adapter_model.safetensors), which PEFT and transformers load "
        "over the same directory.")
    command.add_argument("--lora", required=True, metavar="DIR", help="the adapters' run")
    command.add_argument("--hf-dir", required=True, metavar="DIR",
                         help="the Hugging Face model directory they were trained on")
    command.add_argument("--out", required=True, metavar="OUT",
                         help="the new adapter directory")
    command.set_defaults(run=run_export_peft)


def run_export_peft(args) -> int:
    from kvjax.hf.peft import export_peft_adapter

    out = export_peft_adapter(args.lora, args.hf_dir, args.out)
    print(f"wrote {out}")
    return 0
