"""Tensor-core dots and narrowing casts shared by the kernels.

Triton's CPU interpreter (3.6) gets two bf16 operations wrong: ``tl.dot`` on bf16 operands
(errors of ~1e10 on a plain 16 x 16 dot; fp16 and fp32 are right), and fp32 -> bf16 casts,
which it truncates instead of rounding to nearest even. Under the interpreter ``dot``
widens its operands to fp32 first and ``narrow`` rounds by hand; compiled kernels take the
plain operations. The switch is a compile-time constant, read once, when Triton reads
``TRITON_INTERPRET`` too.
"""

import os

import triton
import triton.language as tl

INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def dot(a, b):
    """a [M, K] @ b [K, N] -> fp32 [M, N]."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def dot_acc(a, b, acc):
    """acc [M, N] fp32 + a [M, K] @ b [K, N]."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def narrow(x, dtype: tl.constexpr):
    """x (any float dtype) cast to ``dtype``, rounding to nearest even."""
    if INTERPRETER:
        if dtype == tl.bfloat16:
            if x.dtype != tl.bfloat16:
                bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)
