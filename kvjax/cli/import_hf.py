"""`kvjax import-hf`: a Hugging Face model directory written as a kvjax checkpoint."""

from __future__ import annotations

from .common import KERNEL_DTYPE_NAMES, add_command, positive


def add_import_hf(commands) -> None:
    command = add_command(
        commands, "import-hf", "Write the model in a local Hugging Face directory (config.json, "
        "safetensors, tokenizer files; the families docs/pretrained.md lists) as a kvjax "
        "checkpoint, with an integrity manifest, that `kvjax sample`, `kvjax serve` and "
        "`kvjax train --init-from` read.")
    command.add_argument("directory", metavar="DIR", help="the Hugging Face model directory")
    command.add_argument("out", metavar="OUT", help="the new checkpoint directory")
    command.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                         help="the params' dtype (default: float32)")
    command.add_argument("--kernel-dtype", choices=KERNEL_DTYPE_NAMES, default=None,
                         help="int8 writes the layers' attention, FFN and expert weights and "
                              "the embedding table as int8 with float32 scales, quantized as "
                              "they are read (default: as --dtype)")
    command.add_argument("--max-len", type=positive, default=None, metavar="N",
                         help="a RoPE model's longest sequence, up to its "
                              "max_position_embeddings (default: that; for LongRoPE, the "
                              "original length: past it, every position turns with the long "
                              "factors); an ALiBi or T5 model's, any length (default: the "
                              "one it was trained on)")
    command.add_argument("--lora", metavar="DIR", default=None,
                         help="a PEFT LoRA adapter trained on DIR (adapter_config.json, "
                              "adapter_model.safetensors), written merged into the params")
    command.set_defaults(run=run_import_hf)


def run_import_hf(args) -> int:
    from kvjax.hf.convert import import_checkpoint

    out = import_checkpoint(args.directory, args.out, dtype=args.dtype, max_len=args.max_len,
                            lora=args.lora, kernel_dtype=args.kernel_dtype)
    print(f"wrote {out}")
    return 0
