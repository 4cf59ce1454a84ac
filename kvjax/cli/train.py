"""`kvjax train`: one model trained into a checkpoint directory."""

from __future__ import annotations

from .common import PRESET_NAMES, add_command, count, positive, positive_real, schedule, seed


def add_train(commands) -> None:
    train = add_command(commands, "train", "Train a decoder-only LM (--task lm) or an "
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
    train.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="compute dtype: bfloat16 is mixed precision (params, optimizer "
                            "state, loss and softmax stay float32) (default: float32)")
    train.add_argument("--init-from", metavar="CHECKPOINT", default=None,
                       help="fine-tune this checkpoint of the same task (one of kvjax's, one "
                            "that kvjax import-hf wrote, or a Hugging Face model directory, "
                            "which is imported into OUT/base first): its model and tokenizer, "
                            "its params as the start, a fresh optimizer")
    lora = train.add_argument_group(
        "LoRA", "train low-rank adapters on a frozen --init-from checkpoint instead of every "
        "weight: --out then holds the adapters alone (sample or serve them with --lora, "
        "or write the merged model with kvjax merge-lora)")
    lora.add_argument("--lora-rank", type=positive, default=None, metavar="R",
                      help="the adapters' rank")
    lora.add_argument("--lora-alpha", type=positive_real, default=None, metavar="A",
                      help="the update is scaled by A / R (default: A = R)")
    lora.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME",
                      help="kernels to adapt: q k v o (attention), wi wi_gate wo "
                           "(feed-forward; in a mixture of experts, each expert's own), "
                           "router shared_wi shared_wi_gate shared_wo shared_expert_gate (a "
                           "mixture's router, shared expert and its gate) (default: q v)")
    lora.add_argument("--lora-base-dtype", choices=("float32", "bfloat16", "int8"),
                      default=None,
                      help="hold the frozen base in this dtype while training (bfloat16: "
                           "half its memory; int8: the layers' kernels as int8 with scales, "
                           "QLoRA-style, each layer rematerialized) (default: as the "
                           "checkpoint stores it)")
    train.add_argument("--steps", type=positive, default=None,
                       help="training steps (default: the demo settings)")
    train.add_argument("--batch-size", type=positive, default=None,
                       help="examples per step (default: the demo settings)")
    train.add_argument("--learning-rate", type=positive_real, default=None,
                       help="peak learning rate (default: the demo settings)")
    train.add_argument("--warmup-steps", type=count, default=None,
                       help="learning-rate warmup steps (default: 50, or a tenth of --steps "
                            "if that is less)")
    train.add_argument("--save-every", type=positive, default=None,
                       help="steps between checkpoints (default: a tenth of --steps); one is "
                            "also saved at the end and on Ctrl-C or SIGTERM")
    train.add_argument("--heldout", type=count, default=None,
                       help="translate: pairs held out for validation and accuracy (default: "
                            "a tenth of the pairs, at most 1000; 0: none)")
    train.add_argument("--target-language", metavar="CODE", default=None,
                       help="translate: a token that starts every target (NLLB's target "
                            "language: fra_Latn, ...), forced first when evaluating")
    train.add_argument("--seed", type=seed, default=0,
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
    several = train.add_argument_group(
        "several processes", "one job over several processes (hosts), each started with the "
        "same options and its own --process-id; on a TPU pod slice, SLURM or Open MPI JAX "
        "finds these itself")
    several.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                         help="address of process 0, which serves the job's coordination "
                              "there (default: $KVJAX_COORDINATOR)")
    several.add_argument("--num-processes", type=positive, default=None,
                         help="processes in the job (default: $KVJAX_NUM_PROCESSES)")
    several.add_argument("--process-id", type=count, default=None,
                         help="this process's number, 0 ... N-1 (default: $KVJAX_PROCESS_ID)")
    several.add_argument("--cpu-devices", type=positive, default=None,
                         help="CPU devices per process, to run several processes on one "
                              "machine without accelerators")
    train.add_argument("--deterministic", action="store_true",
                       help="on a GPU, compile the step with XLA's deterministic ops, at some "
                            "cost in speed: the same seed then gives bit-identical losses and "
                            "--resume continues bit-identically (without it a GPU's losses "
                            "differ in the last digits; CPUs and TPUs are deterministic "
                            "either way)")
    train.add_argument("--remat", action="store_true",
                       help="recompute each layer's activations and the output logits in "
                            "the backward pass instead of keeping them: less memory per step "
                            "(a larger batch or model fits) for one more forward pass of "
                            "compute; the same losses up to float rounding")
    train.add_argument("--router-aux-loss-coef", type=float, default=0.0, metavar="C",
                       help="a mixture of experts: add C times the load-balancing loss "
                            "(transformers' router_aux_loss_coef, as a Hugging Face model's "
                            "config.json gives it) to the loss minimized (default: 0, none)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=run_train)


def run_train(args) -> int:
    from kvjax import distributed
    from kvjax import model as M
    from kvjax.train import tasks

    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           cpu_devices=args.cpu_devices)

    overrides = {"seed": args.seed, "progress": not args.no_progress,
                 "deterministic": args.deterministic, "remat": args.remat,
                 "router_aux_loss_coef": args.router_aux_loss_coef, **schedule(args)}
    for option, name in (("batch_size", "batch_size"), ("learning_rate", "learning_rate"),
                         ("save_every", "save_every")):
        if getattr(args, option) is not None:
            overrides[name] = getattr(args, option)
    if args.init_from is not None and args.preset is not None:
        raise ValueError("--preset does not apply with --init-from: the model is the "
                         "checkpoint's")
    if args.preset is not None:
        encoder = M.preset(args.preset).num_decoder_layers if args.task == "translate" else 0
        overrides.update(preset=args.preset, model_overrides={"num_encoder_layers": encoder})
    if args.dtype is not None:
        if args.init_from is not None:
            raise ValueError("--dtype does not apply with --init-from: the model is the "
                             "checkpoint's")
        settings = tasks.LM_SETTINGS if args.task == "lm" else tasks.TRANSLATE_SETTINGS
        model = overrides.get("model_overrides", settings.model_overrides)
        overrides["model_overrides"] = {**model, "dtype": args.dtype}
    if args.lora_rank is not None:
        overrides["lora"] = M.LoRA(args.lora_rank, args.lora_alpha,
                                   tuple(args.lora_targets or M.lora.DEFAULT_TARGETS),
                                   args.lora_base_dtype)
    elif any(v is not None for v in (args.lora_alpha, args.lora_targets,
                                     args.lora_base_dtype)):
        raise ValueError("--lora-alpha, --lora-targets and --lora-base-dtype need --lora-rank")
    if args.allow_changes and not args.resume:
        raise ValueError("--allow-changes only applies with --resume")
    out = args.out or f"runs/{args.task}"
    common = dict(resume=args.resume, allow_changes=args.allow_changes)
    if args.init_from is not None:
        common["init_from"] = args.init_from
    overrides["mesh"] = _mesh(args.mesh)
    if args.task == "lm":
        if args.heldout is not None:
            raise ValueError("--heldout applies to --task translate (an LM holds out 5% of "
                             "its text windows)")
        if args.target_language is not None:
            raise ValueError("--target-language applies to --task translate")
        result = tasks.train_lm(out, data_files=args.data, **common, **overrides)
    else:
        if args.data is not None and len(args.data) != 1:
            raise ValueError(f"--task translate takes one TSV file, got {len(args.data)}")
        if args.heldout is not None:
            overrides["num_heldout"] = args.heldout
        if args.target_language is not None:
            overrides["target_language"] = args.target_language
        data_tsv = None if args.data is None else args.data[0]
        result = tasks.train_translate(out, data_tsv=data_tsv, **common, **overrides)
    if not distributed.is_primary():
        return 0
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
