"""`kvjax demo`: train both demo models, save them, show what they do."""

from __future__ import annotations

from .common import add_command, count, positive, schedule


def add_demo(commands) -> None:
    demo = add_command(commands, "demo", "Train a small LM on Python's documentation and a "
                       "numbers-to-words translator (about 2 minutes each on 2 CPU cores), "
                       "save both, print generations, accuracy, perplexity and decode speed.")
    demo.add_argument("--out", default="checkpoints/demo",
                      help="directory for the two checkpoints (a previous demo's are replaced)")
    demo.add_argument("--steps", type=positive, default=None,
                      help="training steps for each model (default: the demo settings)")
    demo.add_argument("--warmup-steps", type=count, default=None,
                      help="learning-rate warmup steps (default: 50, or a tenth of --steps "
                           "if that is less)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(run=run_demo)


def run_demo(args) -> int:
    from kvjax.demo import run_demo as demo

    overrides = schedule(args)
    report = demo(args.out, progress=not args.no_progress, lm_overrides=overrides,
                  translate_overrides=overrides)
    return 0 if report.passed else 1
