"""Build one FlashInfer JIT module before its wrapper first needs it, in a background
process, so that the builds of a run (15-120 s each on a fresh machine) overlap each other
and the other implementations' work:

    python -m benchmarks.peers.fi_jit decode   Q KV HEAD_DIM WINDOW
    python -m benchmarks.peers.fi_jit prefill  Q KV HEAD_DIM WINDOW
    python -m benchmarks.peers.fi_jit holistic Q KV HEAD_DIM
    python -m benchmarks.peers.fi_jit xqa      Q KV HEAD_DIM PAGE GROUP WINDOW

Q / KV: bf16, fp16 or fp8; WINDOW: 1 for the sliding-window build, else 0. Each kind is the
module one wrapper loads, built with the arguments that wrapper passes in FlashInfer 0.6.13
(int32 indices, output in the query dtype, no positional encoding, no soft-cap):

    decode    BatchDecodeWithPagedKVCacheWrapper, tensor cores off: gen_batch_decode_module
    prefill   the same wrapper, tensor cores on (FA2 prefill kernel): gen_batch_prefill_module
    holistic  BatchAttention: gen_batch_attention_module
    xqa       trtllm_batch_decode_with_kv_cache(backend="xqa"): gen_xqa_module

FlashInfer holds a file lock per module while building it, so a wrapper that needs the
module before the build here is done waits for it, then loads it; a failed build here
costs nothing but the time (the wrapper builds again and raises the compiler's error).
Run as a module from the repository root, never as a script: this folder's
``flashinfer.py`` (the adapter) would shadow the real package.
"""

import sys

import torch

from . import start_background

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def decode_spec(ctx, tensor_cores: bool) -> tuple:
    """The module BatchDecodeWithPagedKVCacheWrapper.plan loads for ``ctx`` (a benchmark Context)."""
    return ("prefill" if tensor_cores else "decode", dtype_name(ctx.dtype), dtype_name(ctx.cache_dtype),
            str(ctx.shape.head_dim), str(int(ctx.window > 0)))


def holistic_spec(ctx) -> tuple:
    return ("holistic", dtype_name(ctx.dtype), dtype_name(ctx.cache_dtype), str(ctx.shape.head_dim))


def xqa_spec(ctx) -> tuple:
    return ("xqa", dtype_name(ctx.dtype), dtype_name(ctx.cache_dtype), str(ctx.shape.head_dim), str(ctx.page_size),
            str(ctx.shape.group), str(int(ctx.window > 0)))


def command(spec: tuple) -> list:
    """argv that builds ``spec`` in a fresh interpreter (the same Python as this process),
    for ``start_background``, which runs it from the repository root."""
    return [sys.executable, "-m", __name__, *spec]


def start(spec: tuple) -> list:
    """Build ``spec`` in the background (once per run): an adapter's ``prebuild``."""
    return [" ".join(spec)] if start_background(spec, command(spec)) else []


def jit_spec(spec: tuple):
    """The FlashInfer JitSpec of ``spec``."""
    kind, q, kv, d = spec[0], DTYPES[spec[1]], DTYPES[spec[2]], int(spec[3])
    idx = torch.int32
    if kind == "decode":
        from flashinfer.jit import gen_batch_decode_module
        return gen_batch_decode_module(q, kv, q, idx, d, d, 0, spec[4] == "1", False)
    if kind == "prefill":
        from flashinfer.jit import gen_batch_prefill_module
        return gen_batch_prefill_module("fa2", q, kv, q, idx, d, d, 0, spec[4] == "1", False, False)
    if kind == "holistic":
        from flashinfer.jit import gen_batch_attention_module
        return gen_batch_attention_module(q, kv, q, idx, d, d, 0, False, False)
    if kind == "xqa":
        from flashinfer.jit.xqa import gen_xqa_module
        return gen_xqa_module(q, kv, int(spec[4]), d, int(spec[5]), spec[6] == "1", q, 1)
    raise ValueError(f"kind: expected decode, prefill, holistic or xqa, got {kind!r}")


if __name__ == "__main__":
    jit_spec(tuple(sys.argv[1:])).build(verbose=False)
