"""Tensor-core dots, narrowing casts, the soft-cap and the FP8 store rounding shared by the kernels.

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

from . import launching

INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
LOG2E = tl.constexpr(launching.LOG2E)  # the host scales' log2(e), as a kernel constant
# e4m3's largest finite value: stores into an FP8 cache saturate to it.
FP8_E4M3_MAX = tl.constexpr(448.0)
# Decode against an FP8 cache runs its dots in fp16; q is scaled by this first (a power of two:
# exact) so that bf16 queries up to 2**20 stay in fp16's range.
FP8_Q_PRESCALE = tl.constexpr(1.0 / 16.0)


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
def settled(x):
    """x (an fp32 dot result, any shape), unchanged, through a copy Triton cannot see through:
    an asynchronous (wgmma) dot that produced x is waited for here, not left in flight into
    the loop's next iteration. ptxas drops the copy."""
    if INTERPRETER:
        return x
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


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


@triton.jit
def soft_cap(s, qk_scale, cap_scale):
    """Soft-capped base-2 scores of raw scores s = q . k (fp32): cap * tanh(s * sm_scale / cap)
    * log2(e), with qk_scale = 2 * log2(e) * sm_scale / cap and cap_scale = cap * log2(e)
    (``launching.score_scales``). tanh(y) = 1 - 2 / (e^{2y} + 1) saturates to +-cap_scale
    without inf / inf."""
    e = tl.exp2(s * qk_scale)
    return cap_scale - (2.0 * cap_scale) / (e + 1.0)


@triton.jit
def to_fp8(x, dtype: tl.constexpr):
    """x (fp32) saturated to e4m3's range and cast to the FP8 ``dtype``, rounding to nearest
    even. The interpreter's cast truncates and drops the sign of zero: there the 3 mantissa
    bits are rounded by hand first (on the fp32 bits for normal values, with an fp32 add for
    subnormal ones, below 2**-6) and the sign bit is set after the cast."""
    x = tl.minimum(tl.maximum(x, -FP8_E4M3_MAX), FP8_E4M3_MAX)
    if INTERPRETER:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        # Adding 2**-9 * 1.5 * 2**23 rounds to a multiple of 2**-9, e4m3's subnormal step.
        magic = 1.5 * 2.0 ** 14
        subnormal = (tl.abs(x) + magic) - magic
        magnitude = tl.where(tl.abs(x) < 2.0 ** -6, subnormal, tl.abs(normal))
        sign = ((bits >> 24) & 0x80).to(tl.uint8)
        return (magnitude.to(dtype).to(tl.uint8, bitcast=True) | sign).to(dtype, bitcast=True)
    return x.to(dtype)


@triton.jit
def e4m3_pairs_to_fp16(x):
    """x (int16, any shape): two e4m3 values per element, as an FP8 cache stores element 2j
    (low byte) and 2j + 1 (high byte) of a row -> (low, high) fp16 tensors of x's shape, exact.

    Reading an FP8 tile as int16 pairs lets Triton stage and load it as a 16-bit tile (ldmatrix)
    in the layout of a 16-bit dot operand; a tile of bytes reaches that layout through one
    shared-memory load per byte. The pair splits a row's elements into its even and odd ones,
    which the dots take as two halves. Compiled, each call takes two neighbouring pairs (one
    32-bit register): one byte permute gathers their low bytes into one half and their high
    bytes into the other, so each ``cvt`` writes two elements of one output, already packed
    as the dot reads them (one ``cvt`` per pair would leave two half-registers to repack)."""
    if INTERPRETER:
        low = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        high = ((x >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return low, high
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
