"""`kvjax sample`: text from a checkpoint, streamed as it is made."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import add_command, add_precision, count, load_in_precision, positive, seed


def add_sample(commands) -> None:
    sample = add_command(commands, "sample", "Generate from a checkpoint, streaming the text "
                         "as it is made. For a translation checkpoint the prompt is the source.")
    sample.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a directory written by `kvjax train`, `kvjax demo` or "
                             "`kvjax import-hf`, or a Hugging Face model directory")
    sample.add_argument("--lora", metavar="DIR", default=None,
                        help="LoRA adapters trained on --checkpoint, merged into it: a "
                             "run of kvjax train --lora-rank, or a PEFT adapter directory "
                             "for a Hugging Face one")
    sample.add_argument("--prompt", required=True, help="the text to continue or translate")
    sample.add_argument("--chat", action="store_true",
                        help="the prompt is a user's message, rendered by the model's chat "
                             "template (as /v1/chat/completions renders it) for the model to "
                             "answer")
    sample.add_argument("--system", metavar="TEXT", default=None,
                        help="with --chat, a system message before the user's")
    sample.add_argument("--max-new-tokens", type=positive, default=64,
                        help="stop after this many tokens (fewer if the model's length ends)")
    add_sampling_options(sample)
    sample.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end the text before this string (repeatable; \\n and \\t "
                             "are a newline and a tab)")
    sample.add_argument("--num-samples", type=positive, default=1,
                        help="samples of the prompt, from one prefill")
    sample.add_argument("--beams", type=positive, default=1,
                        help="beam search with this many beams (1 = sampling as above)")
    sample.add_argument("--seed", type=seed, default=0, help="sampling seed")
    add_precision(sample)
    sample.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                        help="draft tokens and verify them in one model call; greedy output "
                             "is unchanged, sampled output keeps its distribution. ngram: by "
                             "prompt lookup (a copy of what follows the latest earlier "
                             "occurrence of the last --ngram-size tokens); draft: with the "
                             "smaller model of --draft-checkpoint")
    sample.add_argument("--draft-checkpoint", metavar="DIR", default=None,
                        help="the draft model of --speculative draft, loaded as --checkpoint "
                             "is; it must have the same tokenizer")
    sample.add_argument("--num-draft-tokens", type=positive, default=4,
                        help="tokens drafted per step with --speculative")
    sample.add_argument("--ngram-size", type=positive, default=2,
                        help="suffix length looked up with --speculative ngram")
    sample.add_argument("--min-tokens-per-call", type=float, default=2.0,
                        help="with --speculative, drafting turns off below this moving "
                             "average of tokens a verifying call emits per row (0: always)")
    shape = sample.add_mutually_exclusive_group()
    shape.add_argument("--regex", metavar="PATTERN", default=None,
                       help="the generated text matches PATTERN (Rust regex syntax)")
    shape.add_argument("--choice", action="append", default=None, metavar="TEXT",
                       help="the generated text is one of these (repeat the option)")
    shape.add_argument("--json-schema", metavar="FILE|JSON", default=None,
                       help="the generated text is JSON valid against this schema (a file, "
                            "or the schema's text)")
    shape.add_argument("--target-language", metavar="CODE", default=None,
                       help="a translator's target language, its token forced first (NLLB's "
                            "codes: fra_Latn, deu_Latn, ...; default: the token its "
                            "generation config forces, if any)")
    sample.set_defaults(run=run_sample)


def add_sampling_options(parser) -> None:
    """The sampling options `sampling_from` reads (`kvjax sample`, `kvjax chat`)."""
    # These five default to the model's (--sampling-defaults), else greedy and off.
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy (default: the model's, else 0)")
    parser.add_argument("--top-k", type=count, default=None,
                        help="keep the k likeliest, 0 = all (default: the model's, else 0)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="keep the smallest set of likeliest tokens with this much mass "
                             "(default: the model's, else 1)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="keep tokens at least this fraction as likely as the likeliest "
                             "(default: the model's, else 0)")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="> 1 makes tokens already in the prompt or output less likely "
                             "(default: the model's, else 1)")
    parser.add_argument("--sampling-defaults", choices=("model", "greedy"), default="model",
                        help="where the five settings above come from when not given: the "
                             "model's generation config's, as kvjax serve and vLLM take them "
                             "(model), or none: greedy (greedy)")
    parser.add_argument("--no-repeat-ngram-size", type=count, default=0,
                        help="n > 0: never repeat an n-gram of the prompt or output")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="in [-2, 2]: > 0 makes tokens already output less likely "
                             "(OpenAI's)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="in [-2, 2]: > 0 makes tokens less likely the more often they "
                             "were output (OpenAI's)")
    parser.add_argument("--min-tokens", type=count, default=0,
                        help="generate at least this many tokens before an end-of-text id "
                             "may end the text")


def sampling_from(args, loaded):
    """The `decode.Sampling` of `add_sampling_options`' options for the model `loaded`."""
    from kvjax import decode

    return decode.Sampling(
        **_sampling_defaults(args, loaded), no_repeat_ngram_size=args.no_repeat_ngram_size,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens)


def run_sample(args) -> int:
    from kvjax import decode, text

    loaded = load_in_precision(args.checkpoint, args, lora=args.lora)
    sampling = sampling_from(args, loaded)  # checked before the echo, as the prompt is
    speculative = None
    if args.speculative:
        draft_model = draft_params = None
        if args.speculative == "draft":
            draft = _draft(args, loaded)
            draft_model, draft_params = draft.net, draft.params
        speculative = decode.Speculative(args.speculative, args.num_draft_tokens,
                                         args.ngram_size, draft_model, draft_params,
                                         args.min_tokens_per_call)
    elif args.draft_checkpoint is not None:
        raise ValueError("--draft-checkpoint is the draft model of --speculative draft")
    constraint = _constraint(args, loaded)
    if constraint is not None:  # a schema it cannot compile fails here, before the echo
        decode.compile_constraint(constraint, loaded.tokenizer)
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat's system message: give --chat too")
    prompt = _chat_prompt(args, loaded) if args.chat else args.prompt
    room = text.room(loaded, prompt)  # a prompt too long fails here, before the echo
    if args.max_new_tokens > room:
        print(f"kvjax sample: --max-new-tokens {args.max_new_tokens} does not fit the model's "
              f"length ({loaded.config.max_len} tokens) after this prompt; generating at most "
              f"{room}", file=sys.stderr)
    if loaded.is_translation:
        print(f"{args.prompt} -> ", end="", flush=True)
    elif not args.chat:  # an answer is printed alone
        print(args.prompt, end="", flush=True)
    settings = dict(max_new_tokens=args.max_new_tokens, num_beams=args.beams, seed=args.seed,
                    sampling=sampling, speculative=speculative, constraint=constraint,
                    stop=[_unescape(s) for s in args.stop])
    if args.num_samples == 1:
        try:
            result = text.sample_text(loaded, prompt, **settings,
                                      on_text=lambda piece: print(piece, end="", flush=True))
        finally:
            print(flush=True)  # whatever happens, the echoed line ends before anything else
        results = [result]
    else:
        print()  # samples are printed whole, each after its own header
        results = text.sample_texts(loaded, prompt, num_samples=args.num_samples,
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
    if first.speculation is not None:
        drafted, accepted = int(first.speculation.drafted.sum()), int(
            first.speculation.accepted.sum())
        print(f"[speculative {args.speculative}: {accepted} of {drafted} drafted tokens "
              f"accepted ({first.speculation.acceptance_rate:.0%}); "
              f"{int(first.speculation.steps)} decode steps]")
    return 0


def _draft(args, loaded):
    """The --draft-checkpoint model, in --dtype, checked to share the target's tokenizer."""
    from kvjax.decode import draft_model

    if args.draft_checkpoint is None:
        raise ValueError("--speculative draft needs a --draft-checkpoint")
    draft = load_in_precision(args.draft_checkpoint, args)
    draft_model.check_draft(loaded.config, draft.config, draft.params, prompt_length=1)
    if draft.tokenizer.to_bytes() != loaded.tokenizer.to_bytes():
        raise ValueError(f"the tokenizer of --draft-checkpoint {args.draft_checkpoint} differs "
                         f"from the one of --checkpoint {args.checkpoint}: the draft's token "
                         f"ids must mean the target's tokens")
    return draft


def _constraint(args, loaded):
    """The --regex, --choice, --json-schema or --target-language constraint, or None."""
    from kvjax import decode

    if args.target_language is not None:
        if not loaded.is_translation:
            raise ValueError("--target-language is a translator's (an encoder-decoder's); "
                             f"{args.checkpoint} continues text")
        return decode.StartsWith.from_text(loaded.tokenizer, args.target_language,
                                           "--target-language")
    if args.regex is not None:
        return decode.Regex(args.regex)
    if args.choice is not None:
        return decode.Choice(args.choice)
    if args.json_schema is None:
        return None
    schema = args.json_schema
    if not schema.lstrip().startswith("{"):
        try:
            schema = Path(schema).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read --json-schema {args.json_schema}: {e}") from None
    return decode.JsonSchema(schema)


def _unescape(text: str) -> str:
    """A --stop value with \\n and \\t (as a shell passes them) turned into the characters."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def _chat_prompt(args, loaded) -> list[int]:
    """The token ids of `--prompt` as a user's message (after `--system`'s), rendered by the
    model's chat template for it to answer."""
    from kvjax.serve import chat

    if loaded.is_translation:
        raise ValueError("--chat: this model translates its prompt; it has no chat")
    messages = [{"role": "system", "content": args.system}] * (args.system is not None)
    return chat.prompt_ids(loaded, messages + [{"role": "user", "content": args.prompt}])[0]


def _sampling_defaults(args, loaded) -> dict:
    """The five settings the model's generation config may name: each as given, else the
    model's (with --sampling-defaults model, said on stderr), else greedy and off."""
    from kvjax.tokenizer.generation_rules import SAMPLING_KEYS  # the five, as options are named

    given = {key: getattr(args, key) for key in SAMPLING_KEYS}
    model = dict(loaded.tokenizer.sampling_defaults) if args.sampling_defaults == "model" else {}
    taken = {k: v for k, v in model.items() if given.get(k, 0) is None}
    if taken:
        print("kvjax sample: sampling defaults from the model's generation config: "
              + ", ".join(f"{k}={v}" for k, v in taken.items())
              + " (--sampling-defaults greedy leaves them out)", file=sys.stderr)
    return {**taken, **{k: v for k, v in given.items() if v is not None}}
