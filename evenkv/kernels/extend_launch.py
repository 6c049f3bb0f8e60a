"""Thin launchers for the extend plan and extend kernels.

Each launcher sizes the grid, passes strides and compile-time constants, and launches;
it does not validate its inputs (``evenkv.extend`` and ``evenkv.Attention`` do), only the
score scales it folds from them, and it allocates nothing. Caches come as ``[num_pages,
page_size, Hkv, D]`` views with any strides (``evenkv.checks.as_pages``), passed as (page,
offset-in-page, head) strides.
"""

import triton

from evenkv.checks import FP8_KV_DTYPES

from .extend import extend_kernel
from .launching import launch_or_compile, score_scales

# The extend kernel counts sorted starts in chunks of this many requests (fixed, so the
# batch size never triggers a recompile; larger batches loop).
SEARCH_BLOCK = 256


def num_query_blocks_bound(total_q: int, batch_size: int, max_q_len: int, group_size: int, block_m: int) -> int:
    """Upper bound on sum_b ceil(q_len_b * G / block_m) from host ints only.

    sum ceil(a_b / M) <= floor(sum a_b / M) + B (each ceil adds < 1), and each term is
    at most ceil(max_q_len * G / M); sum a_b <= total_q * G since cu_seqlens_q[-1] <= total_q.
    """
    by_total = (total_q * group_size) // block_m + batch_size
    by_max = batch_size * triton.cdiv(max_q_len * group_size, block_m)
    return max(0, min(by_total, by_max))


def launch_extend(q, k_cache, v_cache, k_new, v_new, out, cu_seqlens_q, seq_lens, page_table, order, sorted_start,
                  errors, *, num_programs_bound: int, req_begin: int, max_q_len: int, page_size: int, sm_scale: float,
                  causal: bool, window: int | None, logit_cap: float | None, block_m: int, block_n: int,
                  num_warps: int, num_stages: int, warmup: bool = False, sinks=None, k_scale: float = 1.0,
                  v_scale: float = 1.0):
    """One program per (query block, KV head) of the plan; ``num_programs_bound`` query blocks at most.

    q/out [total_q, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D], q's dtype or FP8;
    k_new/v_new [total_q, Hkv, D] or None; page_table [B, max_pages] int32; errors [1] int32; sinks [Hq]
    or None; k_scale, v_scale: an FP8 cache's dequantization scales (1.0 for other caches).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[-2]
    batch = seq_lens.shape[0]
    grid = num_programs_bound * num_kv_heads
    if (grid == 0 or batch == 0) and not warmup:
        return None
    qk_scale, cap_scale = score_scales(sm_scale, logit_cap)
    # The cache's keys are read as stored, so k_scale folds into their score scale, which must
    # fit float32 (ValueError, as decode's); k_new's keys are real values and take qk_scale.
    cache_qk_scale, _ = score_scales(sm_scale, logit_cap, k_scale)
    has_new = k_new is not None
    kn, vn = (k_new, v_new) if has_new else (q, q)  # unused pointers when not HAS_NEW
    sink_ptr = sinks if sinks is not None else q  # unused when not HAS_SINKS
    return launch_or_compile(
        extend_kernel, (max(grid, 1),), warmup,
        q, k_cache, v_cache, kn, vn, out, cu_seqlens_q, seq_lens, page_table, order, sorted_start, errors, sink_ptr,
        batch, req_begin, page_table.shape[1] * page_size, window or 0, q.shape[0], max_q_len, k_cache.shape[0],
        qk_scale, cache_qk_scale, cap_scale, float(v_scale),  # floats: Triton does not specialize on their values
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), page_table.stride(0),
        NUM_KV_HEADS=num_kv_heads, G=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size,
        CAUSAL=causal, HAS_NEW=has_new, WINDOW=window is not None, SOFTCAP=bool(logit_cap),
        KV_FP8=k_cache.dtype in FP8_KV_DTYPES, HAS_SINKS=sinks is not None, BLOCK_B=SEARCH_BLOCK,
        NUM_STAGES=num_stages, num_warps=num_warps)
