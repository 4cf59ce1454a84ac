"""`kvjax serve`: an OpenAI-compatible HTTP server for a checkpoint (see `kvjax.serve`)."""

from __future__ import annotations

import os
import sys

from .common import add_command, add_precision, byte_size, count, load_in_precision, positive

API_KEY_VARIABLE = "KVJAX_API_KEY"


def add_serve(commands) -> None:
    serve = add_command(commands, "serve", "Serve a checkpoint over OpenAI's API "
                        "(/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, "
                        "/tokenize, /detokenize, /health, /metrics) with continuous batching.")
    serve.add_argument("--checkpoint", required=True, metavar="DIR",
                       help="a kvjax checkpoint or a Hugging Face model directory")
    serve.add_argument("--lora", metavar="DIR", default=None,
                       help="LoRA adapters trained on --checkpoint, merged into it: a run "
                            "of kvjax train --lora-rank, or a PEFT adapter directory for a "
                            "Hugging Face one")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=DIR",
                       help="LoRA adapters trained on --checkpoint (runs of kvjax train "
                            "--lora-rank, or PEFT adapters of a Hugging Face model) served "
                            "side by side, unmerged: a request whose model is NAME gets the "
                            "adapter in DIR, one naming the base model gets none")
    serve.add_argument("--allow-lora-loading", action="store_true",
                       help="answer POST /v1/load_lora_adapter {lora_name, lora_path} and "
                            "/v1/unload_lora_adapter {lora_name} (vLLM's): adapters in "
                            "directories on this machine served or dropped while serving")
    serve.add_argument("--max-loras", type=count, default=None, metavar="N",
                       help="adapters served at once: --lora-modules' and those loaded "
                            "(default: --lora-modules', and at least 4 with "
                            "--allow-lora-loading); each slot costs every step a little")
    serve.add_argument("--max-lora-rank", type=positive, default=None, metavar="R",
                       help="the largest rank an adapter served may have (default: the "
                            "largest of --lora-modules', and at least 16 with "
                            "--allow-lora-loading)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    serve.add_argument("--model-name", default=None,
                       help="the model's name in the API (default: the directory's name)")
    serve.add_argument("--max-slots", type=positive, default=16,
                       help="requests generating at once (rows of the decode batch)")
    serve.add_argument("--max-staged", type=positive, default=None,
                       help="prefilled requests waiting on the device for a slot; each "
                            "staged row takes a slot's cache memory (default: --max-slots, "
                            "fewer where those would not fit beside the slots)")
    serve.add_argument("--max-queue", type=positive, default=64,
                       help="requests waiting for a slot; more are answered 429")
    serve.add_argument("--max-len", type=positive, default=None,
                       help="tokens per slot, prompt and output (a translator's source "
                            "and target each; default: the model's max_len); a decode step "
                            "may read every slot's positions, so "
                            "slots sized to the longest request accepted make it cheaper")
    serve.add_argument("--max-source-len", type=positive, default=None, metavar="N",
                       help="a translator's (an encoder-decoder's) longest source, which each "
                            "slot holds beside its target (default: --max-len): each step "
                            "reads the sources' slots, so fewer make it cheaper")
    serve.add_argument("--target-language", default=None, metavar="CODE",
                       help="a translator's target language, one token of its tokenizer "
                            "(NLLB's fra_Latn, M2M100's __fr__): the first token of every "
                            "request's target unless it names its own target_language or "
                            "another constraint (default: the token its generation config "
                            "forces, if any; else the model chooses)")
    serve.add_argument("--sampling-defaults", choices=("model", "openai"), default="model",
                       help="what a request's missing sampling settings default to: the "
                            "model's generation config's temperature, top_k, top_p, min_p "
                            "and repetition_penalty, as vLLM takes them (model), or OpenAI's "
                            "(temperature 1, nothing filtered)")
    serve.add_argument("--chunk-size", type=positive, default=None,
                       help="decode steps between the host's turns (handing out tokens, "
                            "staging requests); slots refill within a chunk (default: 32 "
                            "on a CPU, 64 on an accelerator)")
    serve.add_argument("--steps-per-check", type=positive, default=None, metavar="K",
                       help="decode steps a chunk runs between its checks of whether to go "
                            "on or refill a slot, in a loop of known trip count (default: 1 "
                            "on a CPU, 8 on an accelerator)")
    serve.add_argument("--prefill-batch", type=positive, default=8,
                       help="waiting prompts prefilled together, grouped by length")
    serve.add_argument("--prefix-cache-rows", type=count, default=None, metavar="N",
                       help="cache rows that keep recent prompts' K/V, so that a prompt "
                            "starting like one of them prefills only the rest (default: a "
                            "quarter of --max-staged; 0: off)")
    serve.add_argument("--max-stored-responses", type=count, default=256, metavar="N",
                       help="Responses API answers kept in memory, the most recent, for "
                            "previous_response_id and GET /v1/responses/ID (0: none)")
    serve.add_argument("--prefill-part", type=positive, default=512, metavar="N",
                       help="a prompt with more tokens than this left to prefill is prefilled "
                            "that many (in whole blocks of 16) per turn, the running requests "
                            "decoding in between (needs the prefix cache)")
    serve.add_argument("--page-size", type=positive, default=None, metavar="N",
                       help="keep the slots' K/V in pages of N positions: a "
                            "request takes pages as it grows, not a whole slot of --max-len, "
                            "and is preempted and resumed when they run short (a "
                            "translator's takes its max_tokens' pages at once and waits for "
                            "them; default: a row of --max-len per slot)")
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=positive, default=None, metavar="N",
                      help="with --page-size, the pages the slots' cache allocates (default: "
                           "as many as --max-slots full slots take, or for a model whose every "
                           "layer reads a sliding window, each slot's window's and one more); "
                           "more slots than those pages fill at --max-len serve short "
                           "requests in the same memory")
    pool.add_argument("--cache-memory", type=byte_size, default=None, metavar="SIZE",
                      help="with --page-size, the memory of the slots' K/V, e.g. 4GiB: as "
                           "many pages as fit in it beside the rings of a model's windowed "
                           "layers where it mixes them with global ones and a translator's "
                           "sources (the prefix cache's rows take pages of their own beside "
                           "them)")
    serve.add_argument("--warm-up", action="store_true",
                       help="compile every program (each prompt-length bucket and prefill "
                            "batch) before listening, so that no request waits for a "
                            "compilation (default: compile each when a request first needs it)")
    serve.add_argument("--mesh", default=None, metavar="data=N,model=M",
                       help="split the slots over N devices and the heads and FFN over M "
                            "(--max-slots and --max-staged multiples of N; default: one "
                            "device)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="answer /v1/ requests only with 'Authorization: Bearer KEY', as "
                            "OpenAI's clients send their api_key (default: $KVJAX_API_KEY; "
                            "none: anyone who reaches the port may use it)")
    serve.add_argument("--reasoning-parser", default=None, metavar="think|harmony",
                       help="answer a thinking model's thought as each chat choice's "
                            "`reasoning` (and `reasoning_content`), apart from its content: "
                            "think: <think> ... </think> (`qwen3` and `deepseek_r1`, vLLM's "
                            "names, are the same rule); harmony: gpt-oss's analysis channel "
                            "(`openai_gptoss`), its calls of the request's tools read too")
    add_precision(serve)
    serve.set_defaults(run=run_serve)


def run_serve(args) -> int:
    import uvicorn

    from kvjax import parallel
    from kvjax.serve import memory, structured
    from kvjax.serve.limits import Limits, header_timeout_protocol
    from kvjax.serve.protocol import model_sampling_defaults
    from kvjax.serve.server import build_app
    from kvjax.serve.slots import source_capacity

    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    if api_key is None and not is_loopback(args.host):
        print(f"kvjax serve: warning: listening on {args.host} with no API key: anyone who "
              f"can reach the port may use the model (set --api-key or ${API_KEY_VARIABLE})",
              file=sys.stderr)
    mesh = None if args.mesh is None else parallel.make_mesh(args.mesh)
    if args.cache_memory is not None and args.page_size is None:
        raise ValueError("--cache-memory sizes the slots' pages: give --page-size too")
    loaded = load_in_precision(args.checkpoint, args, lora=args.lora)
    if args.target_language is not None:  # refused by its option's name, before building
        structured.language(args.target_language, loaded.tokenizer, loaded.is_translation,
                            "--target-language")
    defaults = model_sampling_defaults(loaded, args.sampling_defaults)
    if defaults:
        print("kvjax serve: sampling defaults from the model's generation config: "
              + ", ".join(f"{k}={v}" for k, v in defaults.items()), file=sys.stderr)
    adapters = served_adapters(args, loaded.config.scan_layers)
    capacity = loaded.config.max_len if args.max_len is None else args.max_len
    num_pages = args.num_pages if args.cache_memory is None else memory.pages_in(
        loaded.config, args.cache_memory, args.page_size, args.max_slots, capacity,
        source_capacity(loaded.config, capacity, args.max_source_len, args.prefix_cache_rows))
    limits = Limits(max_stored_responses=args.max_stored_responses)
    app = build_app(loaded, model_name=args.model_name, max_slots=args.max_slots,
                    max_staged=args.max_staged, max_queue=args.max_queue,
                    max_len=args.max_len, chunk_size=args.chunk_size,
                    steps_per_check=args.steps_per_check, prefill_batch=args.prefill_batch,
                    prefix_cache_rows=args.prefix_cache_rows, prefill_part=args.prefill_part,
                    page_size=args.page_size, num_pages=num_pages, warm_up=args.warm_up,
                    mesh=mesh, api_key=api_key, limits=limits,
                    reasoning_parser=args.reasoning_parser, adapters=adapters,
                    max_adapters=args.max_loras, max_adapter_rank=args.max_lora_rank,
                    load_adapter=adapter_loader(args, loaded.config.scan_layers)
                    if args.allow_lora_loading else None, max_source_len=args.max_source_len,
                    target_language=args.target_language,
                    sampling_defaults=args.sampling_defaults)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                http=header_timeout_protocol(limits.header_timeout))
    return 0


def served_adapters(args, scan_layers: bool) -> dict | None:
    """--lora-modules as `build_app` takes them: {name: (adapters, lora)}."""
    if args.lora is not None and (args.lora_modules or args.allow_lora_loading):
        raise ValueError("--lora merges adapters into the model that --lora-modules' (and "
                         "loaded) adapters were not trained on: give one or the other")
    if not args.lora_modules:
        return None
    load = adapter_loader(args, scan_layers)
    adapters = {}
    for module in args.lora_modules:
        name, _, directory = module.partition("=")
        if not name or not directory:
            raise ValueError(f"--lora-modules {module!r}: expected NAME=DIR")
        if name in adapters:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        try:
            adapters[name] = load(directory)
        except ValueError as error:
            raise ValueError(f"--lora-modules {module}: {error}") from None
    return adapters


def adapter_loader(args, scan_layers: bool):
    """A directory -> `(adapters, lora)` trained on --checkpoint: PEFT adapters of a Hugging
    Face model, runs of `kvjax train --lora-rank` on a kvjax checkpoint."""
    from kvjax import checkpoint, hf

    pretrained = hf.is_hf_directory(args.checkpoint)

    def load(directory: str):
        if pretrained != hf.is_peft_directory(directory):
            raise ValueError("a Hugging Face model serves PEFT adapters, a kvjax checkpoint "
                             f"the runs of kvjax train --lora-rank on it; {args.checkpoint} "
                             f"is {'the first' if pretrained else 'the second'}")
        return (hf.load_peft_adapters if pretrained else checkpoint.load_adapters)(
            args.checkpoint, directory, scan_layers)

    return load


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only takes connections from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
