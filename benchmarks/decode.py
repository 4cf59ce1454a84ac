"""Decode speed: kvjax vs. no cache, vs. Hugging Face GPT-2, vs. the memory floor.

    python benchmarks/decode.py [--batch-sizes 1 8 32] [--no-hf] ...

The same as `kvjax bench decode`; the measurement lives in `kvjax.bench`.
"""

import os
import sys

# Run as a script, this folder comes first on sys.path, and this file's name would shadow
# the `decode` package.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

from kvjax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
