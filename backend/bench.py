"""``python -m evenkv.bench [ARGS...]``: the decode-imbalance benchmark, same as ``evenkv bench``.

The benchmark lives in the repository (benchmarks/decode_imbalance.py); this module only
finds and runs it, so it needs an editable install or a checkout.
"""

import sys

from .cli import run_bench

if __name__ == "__main__":
    sys.exit(run_bench(sys.argv[1:]))
