"""`kvjax bench serve`: the serving engine against fixed batches of `decode.generate` (and
transformers' continuous batching) on requests arriving over time."""

from __future__ import annotations

from .common import (
    PRESET_NAMES,
    add_command,
    add_decode_attention,
    count,
    in_decode_attention_mode,
    positive,
    positive_real,
    seed,
)


def add_serve(kinds) -> None:
    serve = add_command(kinds, "serve", "Continuous batching (kvjax.serve's engine) against "
                        "fixed batches of decode.generate and, where it is installed, "
                        "transformers' continuous batching, on requests with mixed lengths "
                        "arriving over time: tokens/s, time to first token and inter-token "
                        "latency; the engine and the fixed batches take turns --repeats "
                        "times (median).")
    serve.add_argument("--preset", choices=PRESET_NAMES, default="small", help="model size")
    serve.add_argument("--encoder-layers", type=count, default=0, metavar="N",
                       help="N > 0: the preset as an encoder-decoder (a translator) of N "
                            "encoder layers, whose prompts are sources")
    serve.add_argument("--sliding-window", type=positive, default=None, metavar="N",
                       help="every layer of the preset attends over the last N positions "
                            "(as Mistral 7B v0.1): with --page-size, a request holds about "
                            "N positions' pages however long it runs")
    serve.add_argument("--full-attention-layers", type=count, nargs="+", default=(),
                       metavar="I", help="with --sliding-window, these layers (numbered from "
                       "0) attend over every position, as Gemma 2 and 3's global layers do: "
                       "the slots keep the other layers in rings of the window")
    serve.add_argument("--requests", type=positive, default=128, help="requests to serve")
    serve.add_argument("--rate", type=positive_real, default=50.0,
                       help="mean arrivals per second (Poisson)")
    serve.add_argument("--prompt-lengths", type=positive, nargs=2, default=[8, 64],
                       metavar=("MIN", "MAX"), help="prompt tokens, uniform in [MIN, MAX]")
    serve.add_argument("--output-lengths", type=positive, nargs=2, default=[8, 128],
                       metavar=("MIN", "MAX"), help="tokens to generate, uniform in [MIN, MAX]")
    serve.add_argument("--long-tail", action="store_true",
                       help="output lengths log-uniform in [MIN, MAX] (many short, few long)")
    serve.add_argument("--shared-prefix", type=count, default=0, metavar="N",
                       help="every prompt starts with the same N tokens (a system prompt); "
                            "a model without learned positions gets the positions it takes")
    serve.add_argument("--max-slots", type=positive, default=16, help="the engine's slots")
    serve.add_argument("--max-len", type=positive, default=None,
                       help="positions per engine slot (default: the longest prompt plus the "
                            "longest output, as a deployment sizes its slots to the longest "
                            "request it accepts)")
    serve.add_argument("--chunk-size", type=positive, default=None,
                       help="the engine's decode steps per chunk (default: the engine's, "
                            "32 on a CPU, 64 on an accelerator)")
    serve.add_argument("--prefix-cache-rows", type=count, default=None, metavar="N",
                       help="the engine's prefix cache rows (default: the engine's; 0: off)")
    serve.add_argument("--steps-per-check", type=positive, default=None, metavar="K",
                       help="decode steps between the chunk's checks of whether to go on or "
                            "admit, run in a loop of known trip count (default: the "
                            "engine's, 1 on a CPU, 8 on an accelerator)")
    serve.add_argument("--page-size", type=positive, default=None, metavar="N",
                       help="the engine's slots in pages of N positions (default: a row of "
                            "--max-len per slot)")
    serve.add_argument("--num-pages", type=positive, default=None, metavar="N",
                       help="with --page-size, the pages of the engine's slots (default: "
                            "--max-slots full slots)")
    serve.add_argument("--max-staged", type=positive, default=None,
                       help="the engine's staged rows (default: the engine's, --max-slots)")
    serve.add_argument("--batch", type=positive, default=16,
                       help="requests per decode.generate call in the baseline")
    serve.add_argument("--seed", type=seed, default=0, help="workload and weights seed")
    serve.add_argument("--no-hf", action="store_true",
                       help="skip transformers' continuous batching")
    serve.add_argument("--lora-adapters", type=count, default=0, metavar="N",
                       help="a third contender: the engine serving N random LoRA adapters "
                            "(rank --lora-rank on every attention and FFN kernel) beside the "
                            "base, requests spread over them in turn")
    serve.add_argument("--lora-rank", type=positive, default=8, help="with --lora-adapters")
    serve.add_argument("--repeats", type=positive, default=3,
                       help="runs of the engine and the fixed batches, in turn (median)")
    add_decode_attention(serve)
    serve.set_defaults(run=in_decode_attention_mode(run_bench_serve))


def run_bench_serve(args) -> int:
    from kvjax.benchmarks.serve import serve_benchmark

    print(serve_benchmark(args.preset, args.requests, args.rate, tuple(args.prompt_lengths),
                          tuple(args.output_lengths), args.max_slots, args.chunk_size,
                          args.batch, args.seed, args.long_tail,
                          compare_transformers=not args.no_hf, repeats=args.repeats,
                          max_len=args.max_len, shared_prefix=args.shared_prefix,
                          prefix_cache_rows=args.prefix_cache_rows,
                          steps_per_check=args.steps_per_check,
                          page_size=args.page_size, num_pages=args.num_pages,
                          max_staged=args.max_staged, lora_adapters=args.lora_adapters,
                          lora_rank=args.lora_rank, encoder_layers=args.encoder_layers,
                          sliding_window=args.sliding_window,
                          full_attention_layers=tuple(args.full_attention_layers)))
    return 0
