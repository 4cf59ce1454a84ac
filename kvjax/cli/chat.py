"""`kvjax chat`: a conversation with an instruct model on the terminal."""

from __future__ import annotations

import sys

from .common import add_command, add_precision, load_in_precision, positive, seed
from .sample import add_sampling_options, sampling_from

HELP = "/reset forgets the conversation, /exit (or an end of input) ends it"


def add_chat(commands) -> None:
    chat = add_command(commands, "chat", "Talk with an instruct model: each line you type is "
                       "a user's message, rendered with the conversation so far by the "
                       f"model's chat template, and its answer streams back ({HELP}).")
    chat.add_argument("--checkpoint", required=True, metavar="DIR",
                      help="a Hugging Face model directory with a chat template, or a kvjax "
                           "checkpoint (its plain template)")
    chat.add_argument("--lora", metavar="DIR", default=None,
                      help="LoRA adapters trained on --checkpoint, merged into it")
    chat.add_argument("--system", metavar="TEXT", default=None,
                      help="a system message before the conversation")
    chat.add_argument("--max-new-tokens", type=positive, default=256,
                      help="the longest answer (fewer where the model's length ends)")
    add_sampling_options(chat)
    chat.add_argument("--seed", type=seed, default=0,
                      help="sampling seed of the first answer; each next one takes the next")
    add_precision(chat)
    chat.set_defaults(run=run_chat)


def run_chat(args) -> int:
    from kvjax import text
    from kvjax.serve import chat

    loaded = load_in_precision(args.checkpoint, args, lora=args.lora)
    if loaded.is_translation:
        raise ValueError(f"{args.checkpoint} translates its prompt; it has no chat")
    sampling = sampling_from(args, loaded)
    opening = [] if args.system is None else [{"role": "system", "content": args.system}]
    messages = list(opening)
    print(f"kvjax chat: {HELP}", file=sys.stderr)
    for turn, line in enumerate(_lines()):
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = list(opening)
            continue
        if not line.strip():
            continue
        asked = messages + [{"role": "user", "content": line}]
        ids, _ = chat.prompt_ids(loaded, asked)
        try:
            room = text.room(loaded, ids)
        except ValueError as error:
            print(f"kvjax chat: {error}; /reset starts over", file=sys.stderr)
            continue
        result = text.sample_text(loaded, ids, max_new_tokens=min(args.max_new_tokens, room),
                                  sampling=sampling, seed=args.seed + turn,
                                  on_text=lambda piece: print(piece, end="", flush=True))
        print(flush=True)
        messages = asked + [{"role": "assistant", "content": result.text}]
    return 0


def _lines():
    """The lines typed (or piped in), without their newline, until the input ends."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line.rstrip("\n")
