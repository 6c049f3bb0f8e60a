"""Bits of the device-side error flag the kernels set on bad batch data (``evenkv.errors``
names them for users). Each kernel that can see bad data takes ``error_ptr``, a pointer to
one int32, and ORs its bit in."""

import triton.language as tl

PAGE_OUT_OF_RANGE = tl.constexpr(1)
SLOT_OUT_OF_RANGE = tl.constexpr(2)
LENGTH_OUT_OF_RANGE = tl.constexpr(4)
QUERY_OUT_OF_RANGE = tl.constexpr(8)
# Not bad data: deterministic decode met a batch of more tokens than its workspace holds.
INVARIANCE_LOST = tl.constexpr(16)
SEQ_LEN_BELOW_Q_LEN = tl.constexpr(32)
