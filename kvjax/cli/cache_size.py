"""`kvjax cache-size`: the KV-cache size formula for a preset or for given sizes."""

from __future__ import annotations

from .common import CACHE_DTYPE_NAMES, PRESET_NAMES, add_command, positive


def add_cache_size(commands) -> None:
    size = add_command(commands, "cache-size", "Bytes of the KV cache: 2 x length x layers x "
                       "kv_heads x head_dim x bytes per sequence (int8: x (head_dim + 4), a "
                       "float32 scale per token and kv head), for a preset or for the "
                       "sizes given (e.g. --layers 32 --heads 32 --head-dim 128 --dtype "
                       "float16).")
    size.add_argument("--preset", choices=PRESET_NAMES, default=None,
                      help="take the sizes from this preset (default: gpt-mini unless "
                           "--layers/--heads/--head-dim are given)")
    size.add_argument("--layers", type=positive, help="decoder layers")
    size.add_argument("--heads", type=positive, help="query heads")
    size.add_argument("--kv-heads", type=positive, help="kv heads (default: --heads)")
    size.add_argument("--head-dim", type=positive, help="dimension of each head")
    size.add_argument("--encoder-layers", type=int, default=0,
                      help="> 0: an encoder-decoder, whose cross-attention cache is shown too")
    size.add_argument("--sliding-window", type=positive, default=None, metavar="N",
                      help="every layer attends over the last N positions (Mistral 7B v0.1): "
                           "what a paged cache then holds is shown too")
    size.add_argument("--length", type=positive, default=1024, help="tokens per sequence")
    size.add_argument("--source-length", type=positive, default=None,
                      help="source tokens of an encoder-decoder (default: --length)")
    size.add_argument("--batch", type=positive, default=1, help="sequences")
    size.add_argument("--dtype", choices=CACHE_DTYPE_NAMES, default=None,
                      help="cache dtype (default: the model's compute dtype)")
    size.set_defaults(run=run_cache_size)


def run_cache_size(args) -> int:
    from kvjax import model as M
    from kvjax.model.cache_size import describe_cache_size

    given = {"num_decoder_layers": args.layers, "num_heads": args.heads,
             "num_kv_heads": args.kv_heads}
    if args.head_dim is not None:
        heads = args.heads or M.preset(args.preset or "gpt-mini").num_heads
        given["d_model"] = heads * args.head_dim
    config = M.preset(args.preset or "gpt-mini", num_encoder_layers=args.encoder_layers,
                      sliding_window=args.sliding_window,
                      **{k: v for k, v in given.items() if v is not None})
    print(describe_cache_size(config, args.batch, args.length, args.dtype, args.source_length))
    return 0
