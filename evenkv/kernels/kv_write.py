"""Triton kernel that scatters new K/V rows into a paged cache.

``k_cache[page, offset, h, :] = k_new[i, h, :]`` (same for V) for every token i whose slot
``slot_mapping[i] = page x page_size + offset`` is >= 0 (an FP8 cache stores ``new / scale``,
saturated to e4m3's range and rounded to nearest even); a negative slot (a padded token) is
skipped, and so is a slot past the cache (``num_slots``), which sets SLOT_OUT_OF_RANGE in the
error flag.
"""

import triton
import triton.language as tl

from .error_bits import SLOT_OUT_OF_RANGE
from .numerics import narrow, to_fp8


@triton.jit(do_not_specialize=["num_slots"])
def kv_write_kernel(
    k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, error_ptr, num_slots, k_scale, v_scale,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
    stride_kc_page, stride_kc_off, stride_kc_head, stride_vc_page, stride_vc_off, stride_vc_head,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    """One program per new token; writes its [NUM_KV_HEADS, HEAD_DIM] K and V rows into the caches'
    [num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM] views, any strides (KV_FP8: quantized, divided
    by k_scale / v_scale with IEEE division, as torch divides)."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= num_slots:
        tl.atomic_or(error_ptr, SLOT_OUT_OF_RANGE, sem="relaxed")
    if (slot >= 0) & (slot < num_slots):
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_new_ptr + tok * stride_kn_tok + offs_h[:, None] * stride_kn_head + offs_d[None, :], mask=mask)
        v = tl.load(v_new_ptr + tok * stride_vn_tok + offs_h[:, None] * stride_vn_head + offs_d[None, :], mask=mask)
        if KV_FP8:
            k = to_fp8(tl.math.div_rn(k.to(tl.float32), k_scale), k_cache_ptr.dtype.element_ty)
            v = to_fp8(tl.math.div_rn(v.to(tl.float32), v_scale), v_cache_ptr.dtype.element_ty)
        page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
        k_row = page * stride_kc_page + offset * stride_kc_off
        v_row = page * stride_vc_page + offset * stride_vc_off
        tl.store(k_cache_ptr + k_row + offs_h[:, None] * stride_kc_head + offs_d[None, :],
                 narrow(k, k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + v_row + offs_h[:, None] * stride_vc_head + offs_d[None, :],
                 narrow(v, v_cache_ptr.dtype.element_ty), mask=mask)
