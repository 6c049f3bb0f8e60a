"""Triton kernels for extend / prefill attention over a paged KV cache (q_len >= 1).

Work unit: a *query block* = BLOCK_M packed rows of one request for one KV head.
Packed row r of a request stands for query ``r // G`` and query head ``h * G + r % G``
(PackGQA: the G query heads that share KV head h sit in the same tile, so each K/V
tile is loaded once for all of them, and any G works, 5 and 7 included). A request
with q_len queries has ``ceil(q_len * G / BLOCK_M)`` blocks per KV head.

Positions: query i of request b sits at absolute position ``seq_len - q_len + i``
(``seq_len`` counts the new tokens) and, when causal, sees KV positions ``<= `` its
own; with a sliding window W it sees ``[p - W + 1, p]``. KV position t comes from

* the paged cache, slot ``page_table[b, t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE``,
  for every t (vLLM layout, ``HAS_NEW = False``), or
* the cache for t < seq_len - q_len and ``k_new[cu_seqlens_q[b] + t - (seq_len - q_len)]``
  for the new tokens (SGLang layout, ``HAS_NEW = True``).

Each source is walked in BLOCK_N tiles split into three loops: tiles that need a
mask at the window's left edge, tiles that need none (every row sees every key: the
bulk of a long prefill, so it runs without mask arithmetic), and tiles that need the
causal or end-of-source mask. Softmax runs in base 2 (scores scaled by
``sm_scale * log2(e)`` in fp32 so ``exp2`` replaces ``exp``); accumulation is fp32.

Compile-time variants beside CAUSAL, WINDOW and SOFTCAP:

* ``HAS_NEW``: the new tokens' K/V come from k_new/v_new (above).
* ``KV_FP8``: the cache holds FP8 (e4m3); real K = stored K * k_scale, real V = stored V *
  v_scale (per-tensor host floats). Tiles are widened to q's dtype in registers, k_scale
  folds (on the host) into the cache source's score scale and v_scale into the output's
  normaliser: the accumulator holds V in stored units, so k_new/v_new tiles (real values)
  enter it with p divided by v_scale (see ``_online_softmax``).
* ``HAS_SINKS``: ``sinks[head]`` (natural log, neither scaled nor capped; gpt-oss) joins
  every row's softmax denominator at the end of the row: out = sum_j e^{s_j} v_j /
  (sum_j e^{s_j} + e^{sink}).

Schedule: one program per (query block, KV head), KV head fastest. Programs are
numbered in the order the extend plan kernel gives: requests by decreasing
``seq_len`` (the cost of their heaviest block), and inside a request from its last
(heaviest, it sees the most keys) block to its first. The hardware hands programs
to SMs in increasing id as SMs free up, so this is longest-processing-time-first
list scheduling, which keeps the tail short for skewed (chunked-prefill) batches.
The grid is an upper bound from host ints (no sync); surplus programs exit at once.

Offsets that multiply a token, slot or page index by a stride are int64: a cache or
a batch of queries can pass 2**31 elements.

Memory safety does not depend on the batch data: query rows are clamped to ``q`` (rows
``[0, total_q)``) and lengths to the page table (each sets its bit in the error flag), and
a token whose page id lies outside ``[0, num_pages)`` is never read: its K and V are taken
as zeros, as in the decode kernels (``plan.audit_pages_kernel`` reports it). The tile loops
read such a token at page 0 and note it; a program that noted one attends to the cache
again with every tile masked, its loads masked by the page test, so the common path
carries no per-key page test. Per-batch integers are ``do_not_specialize``, so a server compiles each
config once, at start-up.

Odd values: a query whose scores hold a NaN (a NaN in q or in a key it sees) gives NaN, as
torch's softmax does; a query that sees no key (only possible for inconsistent lengths) and
has no sink gives zeros.
"""

import triton
import triton.language as tl

from .error_bits import LENGTH_OUT_OF_RANGE, QUERY_OUT_OF_RANGE, SEQ_LEN_BELOW_Q_LEN
from .numerics import LOG2E, dot, dot_acc, narrow, soft_cap
from .plan import query_range


@triton.jit
def _tile_rows(page_row_ptr, tile, in_range, stride_k_page, stride_k_off, stride_v_page, stride_v_off, num_pages,
               PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(K row offsets, V row offsets, page_ok) of the tile's positions ``tile * BLOCK_N +
    [0, BLOCK_N)`` relative to its source's first position: offsets [BLOCK_N] int64,
    page_ok [BLOCK_N] bool.

    PAGED (the cache, whose first position is 0): position t is read at ``page_table[t //
    PAGE_SIZE] * stride_page + (t % PAGE_SIZE) * stride_off``. Page sizes and BLOCK_N are
    powers of two, so a tile is whole pages (its in-page offsets do not depend on the
    tile: the compiler hoists them out of the loop) or part of one page (one page-table
    entry). MASKED: entries are read only where in_range (None for unmasked tiles, known
    to be in range). page_ok: the page id lies in [0, num_pages); the offsets of a position
    on any other page point at page 0, so they never leave the cache. Not PAGED (k_new /
    v_new rows): row t at ``t * stride_page``, page_ok all true.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if PAGED:
        if BLOCK_N >= PAGE_SIZE:
            entry = tile * (BLOCK_N // PAGE_SIZE) + offs_n // PAGE_SIZE
            in_page = (offs_n % PAGE_SIZE).to(tl.int64)
        else:
            entry = tl.zeros_like(offs_n) + (tile * BLOCK_N) // PAGE_SIZE
            in_page = ((tile * BLOCK_N) % PAGE_SIZE + offs_n).to(tl.int64)
        if MASKED:
            page = tl.load(page_row_ptr + entry, mask=in_range, other=0)
        else:
            page = tl.load(page_row_ptr + entry)
        # One unsigned compare covers negative ids too.
        page_ok = page.to(tl.uint32, bitcast=True) < num_pages
        page = tl.where(page_ok, page, 0).to(tl.int64)
        return page * stride_k_page + in_page * stride_k_off, page * stride_v_page + in_page * stride_v_off, page_ok
    else:
        rel = (tile * BLOCK_N + offs_n).to(tl.int64)
        return rel * stride_k_page, rel * stride_v_page, offs_n >= 0


@triton.jit
def _load_rows(base, row_off, keys, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``base + row_off`` ([BLOCK_N] int64 offsets) -> [BLOCK_N, BLOCK_D]; rows outside
    keys ([BLOCK_N] bool, MASKED only) and padded dims (D = 80, 96) load as 0."""
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + row_off[:, None] + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=keys[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _online_softmax(s, m, l, tok, keys, row_pos, window, qk_scale, cap_scale, p_div,
                    MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, P_DIV: tl.constexpr):
    """One online-softmax step on raw scores s [BLOCK_M, BLOCK_N] fp32 = q . k.

    Base-2 scores are s * qk_scale or, with SOFTCAP, ``soft_cap(s, qk_scale, cap_scale)``.
    MASKED: key tok[j] is seen by row r iff keys[j], tok[j] <= row_pos[r] and (WINDOW)
    tok[j] > row_pos[r] - window; unmasked tiles are known to satisfy all three (tok,
    keys, row_pos and window are then unused).
    Returns p [BLOCK_M, BLOCK_N] (unnormalised probabilities, base 2; divided by the host
    float p_div with P_DIV), alpha [BLOCK_M] (the rescale of the old accumulator), and the
    new m, l [BLOCK_M] fp32 (l sums the undivided p).
    """
    if SOFTCAP:
        s = soft_cap(s, qk_scale, cap_scale)
    if MASKED:
        seen = keys[None, :] & (tok[None, :] <= row_pos[:, None])
        if WINDOW:
            seen = seen & (tok[None, :] > row_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    # Without a cap the scale is applied inside exp2's argument (one FMA per score;
    # max commutes with a positive scale).
    if SOFTCAP:
        m_new = tl.maximum(m, tl.max(s, 1))
    else:
        m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    if MASKED:
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead so that
        # exp2(-inf - -inf) never makes a NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    if P_DIV:
        # The division rides on exp2's per-row bias: one add per row, not a multiply per score.
        p_sub = m_sub + tl.log2(p_div)
    else:
        p_sub = m_sub
    if SOFTCAP:
        p = tl.exp2(s - p_sub[:, None])
    else:
        p = tl.exp2(tl.fma(s, qk_scale, -p_sub[:, None]))
    alpha = tl.exp2(m - m_sub)
    if P_DIV:
        return p, alpha, m_new, l * alpha + tl.sum(p, 1) * p_div
    return p, alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def _attend_tiles(
    acc, m, l, bad, q, k_base, v_base, stride_k_page, stride_k_off, stride_v_page, stride_v_off,
    page_row_ptr, num_pages, row_pos, tok_base, tile_begin, tile_end, kv_end, window, qk_scale, cap_scale, p_div,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, ZERO_BAD_PAGES: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, P_DIV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Online softmax of q [BLOCK_M, BLOCK_D] against tiles [tile_begin, tile_end).

    Tile t holds KV positions tok_base + t*BLOCK_N + [0, BLOCK_N), addressed as in
    ``_tile_rows``; MASKED tiles are masked as in ``_online_softmax``, the others are
    seen in full by every row (the bulk of a long prefill, run without mask arithmetic).
    A position on a page outside the cache (PAGED) loads K = V = 0 with ZERO_BAD_PAGES (MASKED
    tiles only); otherwise it is read at page 0 and recorded in bad ([BLOCK_N] bool, ORed
    over the tiles). K/V tiles of another dtype (FP8) are widened to q's dtype. Scores,
    p_div and P_DIV as in ``_online_softmax``.
    Returns the updated (acc [BLOCK_M, BLOCK_D] fp32 unnormalised, m, l [BLOCK_M] fp32, bad).
    """
    for tile in tl.range(tile_begin, tile_end, num_stages=NUM_STAGES):
        if MASKED:
            tok = tok_base + tile * BLOCK_N + tl.arange(0, BLOCK_N)
            keys = tok < kv_end
        else:
            tok = None
            keys = None
        k_off, v_off, page_ok = _tile_rows(page_row_ptr, tile, keys, stride_k_page, stride_k_off, stride_v_page,
                                           stride_v_off, num_pages, PAGED, PAGE_SIZE, MASKED, BLOCK_N)
        loaded = keys
        if ZERO_BAD_PAGES:
            loaded = keys & page_ok
        elif PAGED:
            bad = bad | ~page_ok
        k = _load_rows(k_base, k_off, loaded, MASKED, HEAD_DIM, BLOCK_D)
        s = dot(q, tl.trans(k.to(q.dtype)))
        p, alpha, m, l = _online_softmax(s, m, l, tok, keys, row_pos, window, qk_scale, cap_scale, p_div,
                                         MASKED, WINDOW, SOFTCAP, P_DIV)
        v = _load_rows(v_base, v_off, loaded, MASKED, HEAD_DIM, BLOCK_D)
        acc = dot_acc(narrow(p, q.dtype), v.to(q.dtype), acc * alpha[:, None])
    return acc, m, l, bad


@triton.jit
def _tile_ranges(lo, hi, full_lo, full_hi, BLOCK_N: tl.constexpr):
    """Split positions [lo, hi) (relative to the source's first position) into tiles:
    [t_begin, f_begin) masked, [f_begin, f_end) unmasked (inside [full_lo, full_hi)),
    [f_end, t_end) masked. Empty when hi <= lo."""
    t_begin = lo // BLOCK_N
    t_end = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N), t_begin)
    f_begin = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(full_lo, lo), BLOCK_N), t_begin), t_end)
    f_end = tl.minimum(tl.maximum(tl.minimum(full_hi, hi) // BLOCK_N, f_begin), t_end)
    return t_begin, f_begin, f_end, t_end


@triton.jit
def _attend_source(
    acc, m, l, q, k_base, v_base, stride_k_page, stride_k_off, stride_v_page, stride_v_off,
    page_row_ptr, num_pages, row_pos, tok_base, lo, hi, full_lo, full_hi, kv_end, window, qk_scale, cap_scale, p_div,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, ZERO_BAD_PAGES: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, P_DIV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Attend to positions [lo, hi) of one source (relative to its first position
    tok_base): masked tiles, then the tiles inside [full_lo, full_hi) without masks, then
    masked tiles again (see ``_tile_ranges`` and ``_attend_tiles``); with ZERO_BAD_PAGES
    every tile masked, the positions on pages outside the cache loading zeros.
    Returns (acc, m, l, whether a position on a page outside the cache was read as page 0)."""
    t0, t1, t2, t3 = _tile_ranges(lo, hi, full_lo, full_hi, BLOCK_N)
    bad = tl.zeros([BLOCK_N], tl.int1)
    if ZERO_BAD_PAGES:
        # Bad batch data only: one stage, so this loop's registers do not crowd the common path's.
        acc, m, l, bad = _attend_tiles(acc, m, l, bad, q, k_base, v_base, stride_k_page, stride_k_off, stride_v_page,
                                       stride_v_off, page_row_ptr, num_pages, row_pos, tok_base, t0, t3, kv_end,
                                       window, qk_scale, cap_scale, p_div, PAGED, PAGE_SIZE, True, True, WINDOW,
                                       SOFTCAP, P_DIV, HEAD_DIM, BLOCK_D, BLOCK_N, 1)
    else:
        acc, m, l, bad = _attend_tiles(acc, m, l, bad, q, k_base, v_base, stride_k_page, stride_k_off, stride_v_page,
                                       stride_v_off, page_row_ptr, num_pages, row_pos, tok_base, t0, t1, kv_end,
                                       window, qk_scale, cap_scale, p_div, PAGED, PAGE_SIZE, True, False, WINDOW,
                                       SOFTCAP, P_DIV, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES)
        acc, m, l, bad = _attend_tiles(acc, m, l, bad, q, k_base, v_base, stride_k_page, stride_k_off, stride_v_page,
                                       stride_v_off, page_row_ptr, num_pages, row_pos, tok_base, t1, t2, kv_end,
                                       window, qk_scale, cap_scale, p_div, PAGED, PAGE_SIZE, False, False, WINDOW,
                                       SOFTCAP, P_DIV, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES)
        acc, m, l, bad = _attend_tiles(acc, m, l, bad, q, k_base, v_base, stride_k_page, stride_k_off, stride_v_page,
                                       stride_v_off, page_row_ptr, num_pages, row_pos, tok_base, t2, t3, kv_end,
                                       window, qk_scale, cap_scale, p_div, PAGED, PAGE_SIZE, True, False, WINDOW,
                                       SOFTCAP, P_DIV, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES)
    return acc, m, l, tl.max(bad.to(tl.int32), 0) > 0


@triton.jit(do_not_specialize=["batch_size", "req_begin", "capacity", "window", "total_q", "max_q_len", "num_pages",
                            "stride_pt"])
def extend_kernel(
    q_ptr, k_ptr, v_ptr, k_new_ptr, v_new_ptr, out_ptr,
    cu_seqlens_ptr, seq_lens_ptr, page_table_ptr, order_ptr, sorted_start_ptr, error_ptr, sinks_ptr,
    batch_size, req_begin, capacity, window, total_q, max_q_len, num_pages, qk_scale, cache_qk_scale, cap_scale,
    v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_k_page, stride_k_off, stride_k_head, stride_v_page, stride_v_off, stride_v_head,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_pt,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_NEW: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_B: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program (x, h) = pid // Hkv, pid % Hkv: query block x of the planned order, KV head h.

    q [total_q, Hq, D], out [total_q, Hq, D] fp16/bf16 (row stride, head stride; unit stride
    in D); caches (q's dtype, or FP8 with KV_FP8) addressed as page * stride_page + offset *
    stride_off + head * stride_head; k_new/v_new [total_q, Hkv, D] q's dtype (HAS_NEW);
    page_table [B, max_pages] int32 (row stride stride_pt); sinks [Hq] fp32/bf16/fp16
    (HAS_SINKS); qk_scale, cap_scale: base-2 score scales of real K (``score_scales``);
    cache_qk_scale: qk_scale with the FP8 cache's k_scale folded in (checked on the host, as
    decode's), else qk_scale; v_scale: the FP8 cache's V dequantization scale (KV_FP8);
    capacity = max_pages * PAGE_SIZE bounds every cache position read; num_pages: pages in the
    caches. A request's q_len is clamped to [0, max_q_len] (as the plan counts its blocks) and
    its rows to [0, total_q), a range starting before row 0 gets none (QUERY_OUT_OF_RANGE);
    seq_len is raised to q_len (SEQ_LEN_BELOW_Q_LEN) and
    clamped to capacity (+ q_len with HAS_NEW; LENGTH_OUT_OF_RANGE), so every query has a
    position and every cache position read lies in the page table.
    """
    pid = tl.program_id(0)
    h = pid % NUM_KV_HEADS
    x = pid // NUM_KV_HEADS
    # Sorted position of x's request: the last r with sorted_start[r] <= x (sorted_start
    # is non-decreasing and starts at 0), found by counting instead of a serial search.
    count = tl.zeros([], tl.int32)
    for b0 in range(0, batch_size, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        starts = tl.load(sorted_start_ptr + offs_b, mask=offs_b < batch_size, other=2147483647)
        count += tl.sum((starts <= x).to(tl.int32), 0)
    r = count - 1
    b = tl.load(order_ptr + r)
    local = x - tl.load(sorted_start_ptr + r)
    # The plan kernel's clamp, so both count the same blocks; then the rows kept inside q. A
    # range that starts before row 0 gets none: clamped to row 0 it would write the first
    # request's rows.
    q_first, q_len, _ = query_range(cu_seqlens_ptr, b, b < batch_size, max_q_len)
    n_blocks = tl.where(b >= req_begin, tl.cdiv(q_len * G, BLOCK_M), 0)
    q_begin = tl.minimum(tl.maximum(q_first, 0), total_q).to(tl.int32)
    rows_inside = tl.where(q_first >= 0, tl.minimum(q_len, total_q - q_begin), 0)
    if (local == 0) & (h == 0) & (rows_inside < q_len):
        tl.atomic_or(error_ptr, QUERY_OUT_OF_RANGE, sem="relaxed")
    q_len = rows_inside
    if (local < n_blocks) & (q_len > 0):
        raw_len = tl.load(seq_lens_ptr + b)
        if HAS_NEW:
            max_len = capacity + q_len
        else:
            max_len = capacity
        seq_len = tl.minimum(tl.maximum(raw_len, q_len), tl.maximum(max_len, q_len)).to(tl.int32)
        if raw_len < q_len:
            tl.atomic_or(error_ptr, SEQ_LEN_BELOW_Q_LEN, sem="relaxed")
        if raw_len > max_len:
            tl.atomic_or(error_ptr, LENGTH_OUT_OF_RANGE, sem="relaxed")
        prefix = seq_len - q_len
        block = n_blocks - 1 - local  # heaviest block first
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        qi = offs_m // G
        row_valid = qi < q_len
        qi = tl.minimum(qi, q_len - 1)  # padded rows copy the last query (never stored)
        head = h * G + offs_m % G
        offs_d = tl.arange(0, BLOCK_D)
        row_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        q_rows = (q_begin + qi).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
                    mask=row_mask, other=0.0)

        if CAUSAL:
            row_pos = prefix + qi
            pos_lo = prefix + (block * BLOCK_M) // G
            pos_hi = prefix + tl.minimum((block * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
        else:
            row_pos = tl.zeros_like(qi) + (seq_len - 1)
            pos_lo = seq_len - 1
            pos_hi = seq_len - 1
        # Keys some row may see: [kv_lo, pos_hi + 1); keys every row sees: [full_lo, pos_lo + 1).
        if WINDOW:
            kv_lo = tl.maximum(pos_lo - window + 1, 0)
            full_lo = pos_hi - window + 1
        else:
            kv_lo = 0
            full_lo = 0
        kv_hi = pos_hi + 1
        full_hi = pos_lo + 1

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # Source 1: the paged cache, positions [0, cache_end).
        if HAS_NEW:
            cache_end = prefix
        else:
            cache_end = seq_len
        cache_end = tl.minimum(cache_end, capacity)
        page_row = page_table_ptr + b.to(tl.int64) * stride_pt
        k_head = k_ptr + h.to(tl.int64) * stride_k_head
        v_head = v_ptr + h.to(tl.int64) * stride_v_head
        c_hi = tl.minimum(kv_hi, cache_end)
        acc, m, l, bad_page = _attend_source(acc, m, l, q, k_head, v_head, stride_k_page, stride_k_off, stride_v_page,
                                             stride_v_off, page_row, num_pages, row_pos, 0, kv_lo, c_hi, full_lo,
                                             full_hi, cache_end, window, cache_qk_scale, cap_scale, 1.0, True,
                                             PAGE_SIZE, False, WINDOW, SOFTCAP, False, HEAD_DIM, BLOCK_D, BLOCK_N,
                                             NUM_STAGES)
        if bad_page:
            # A page id outside the cache (bad batch data; the page audit flags it) was read as
            # page 0: attend to the cache again, leaving that page's tokens out. Only then, so
            # the common path carries no per-key page test.
            acc, m, l, _ = _attend_source(
                tl.zeros([BLOCK_M, BLOCK_D], tl.float32), tl.full([BLOCK_M], float("-inf"), tl.float32),
                tl.zeros([BLOCK_M], tl.float32), q, k_head, v_head, stride_k_page, stride_k_off, stride_v_page,
                stride_v_off, page_row, num_pages, row_pos, 0, kv_lo, c_hi, full_lo, full_hi, cache_end, window,
                cache_qk_scale, cap_scale, 1.0, True, PAGE_SIZE, True, WINDOW, SOFTCAP, False, HEAD_DIM, BLOCK_D,
                BLOCK_N, NUM_STAGES)
        if HAS_NEW:
            # Source 2: the new tokens, positions [prefix, seq_len) = rows of k_new/v_new (q's
            # dtype, real values). With KV_FP8, acc holds the cache's V in stored units (v_scale
            # applies once, at the end), so these tiles' p enter it divided by v_scale: a per-row
            # exp2 bias, cheaper than a multiply per score or a second accumulator. For the usual
            # v_scale <= 1 that makes p larger, never subnormal; p / v_scale <= 1 / v_scale must
            # fit q's dtype (fp16: v_scale > 2**-16).
            kn = k_new_ptr + q_begin.to(tl.int64) * stride_knt + h.to(tl.int64) * stride_knh
            vn = v_new_ptr + q_begin.to(tl.int64) * stride_vnt + h.to(tl.int64) * stride_vnh
            acc, m, l, _ = _attend_source(acc, m, l, q, kn, vn, stride_knt, 0, stride_vnt, 0, page_row, num_pages,
                                          row_pos, prefix, tl.maximum(kv_lo - prefix, 0), kv_hi - prefix,
                                          full_lo - prefix, full_hi - prefix, seq_len, window, qk_scale, cap_scale,
                                          v_scale, False, PAGE_SIZE, False, WINDOW, SOFTCAP, KV_FP8, HEAD_DIM, BLOCK_D,
                                          BLOCK_N, NUM_STAGES)

        if HAS_SINKS:
            # The sink joins the denominator in base 2; both terms are rescaled to max(m, sink)
            # so neither overflows. A row that saw no key keeps acc = 0 (and l = 0 if its sink
            # is -inf, the same as no sink).
            sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
            top = tl.maximum(m, sink)
            top = tl.where(top == float("-inf"), 0.0, top)
            alpha = tl.exp2(m - top)
            acc = acc * alpha[:, None]
            l = l * alpha + tl.exp2(sink - top)
        # A row that saw no key (only possible for inconsistent lengths) and no sink has l = 0:
        # it is written as zeros. A NaN score leaves l NaN, and the row NaN (torch's softmax).
        no_key = l == 0.0
        safe_l = tl.where(no_key, 1.0, l)
        if KV_FP8:
            safe_l = safe_l / v_scale  # acc holds V in stored units
        o = tl.where(no_key[:, None], 0.0, acc / safe_l[:, None])
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :],
                 narrow(o, out_ptr.dtype.element_ty), mask=row_mask)
