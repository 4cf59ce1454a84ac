"""kvjax's benchmarks, installed as `kvjax.benchmarks` and run through `kvjax bench ...`.

`decode` (decode speed against no cache, Hugging Face and the memory floor), `fill_sweep`
(step time against filled cache slots), `train` (training tokens/s against PyTorch eager),
`decode_copies` (copies of whole cache buffers in a compiled decode loop), `serve`
(continuous batching against fixed batches of `decode.generate`).
"""
