"""evenkv's benchmarks, run from the repository root as modules:

    python -m benchmarks.decode_imbalance --help   decode against FA3, FlashInfer and the engines' kernels
    python -m benchmarks.prefill --help            extend / prefill against FA3 and FlashInfer
    python -m benchmarks.serving --help            the engines end to end (vLLM, SGLang)
    python -m benchmarks.tune_decode --help        decode config sweeps
    python -m benchmarks.read_floor --help         the timing protocol's plain-read floor
    python -m benchmarks.report RUN_DIR            tables and plots of a run folder

The peers (``benchmarks/peers``) are imported by their usual module paths; none of their
source lives here.
"""
