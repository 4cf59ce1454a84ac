"""Decode speed: kvjax vs. no cache, vs. Hugging Face GPT-2, vs. the memory floor.

    python benchmarks/decode.py [--batch-sizes 1 8 32] [--no-hf] ...

The same as `kvjax bench decode`; the measurement lives in `kvjax.bench`.
"""

import sys

from kvjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
