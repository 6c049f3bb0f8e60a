"""Triton kernels for paged decode attention (q_len = 1).

Work unit: a KV *tile* = BLOCK_N consecutive tokens of one request for one KV head,
with all G = Hq / Hkv query heads of that KV head packed into the tile's rows
(PackGQA, padded to G_PAD >= 16 rows for the tensor-core dot). A *segment* is the
run of tiles of one (request, KV head) pair.

Two kernels walk the segments, one per scheduling mode:

* ``decode_stream_kernel`` (policy ``balanced``): a persistent grid of C CTAs. The
  planner lays every segment end to end on one cost line (each segment costs its
  tiles) and gives CTA c the cost range
  ``[c * piece, min((c + 1) * piece, total))``, which it walks in one loop across
  segments. A segment cut by a range boundary
  produces partial (O, LSE) pairs. The CTA that stores the last of a few pieces merges
  them (``_arrive_and_merge``); ``merge_stream_kernel`` merges segments of more pieces, in
  a grid launched early (programmatic dependent launch on sm90) that waits for the decode
  kernel before it reads a partial.
* ``decode_units_kernel`` (policies ``fa3`` and ``none``): work units are
  (request, split, KV head) triples. Persistent CTAs pull units from an atomic
  counter in the planner's (heaviest first) order, or one program runs one unit.

Both kernels take their online-softmax steps with ``_attend_tile`` (the units kernel
through ``_attend_tiles``, one loop per unit) and share ``_store_whole``, ``_store_partial``
and ``_merge_to_out``. Softmax is computed in base 2: the fp32 scores are
scaled by ``sm_scale * log2(e)`` so ``exp2`` replaces ``exp``; every LSE in this module
is a base-2 log-sum-exp.

What a layer adds to plain attention (``decode_launch.LayerTerms``):

* sliding window W (runtime ``window``, 0 = none): a segment is the tiles of the request's
  last min(seq_len, W) tokens, counted from the window's first token (``plan.window_tiles``),
  so the plan and the walk cost the window's tokens only;
* soft-cap (SOFTCAP): base-2 scores ``numerics.soft_cap(s, qk_scale, cap_scale)``;
* sinks (HAS_SINKS): a per-query-head logit in the softmax denominator, added where a
  row's result is final (``_add_sinks``: a whole segment's store, or its merge);
* FP8 cache (KV_FP8): e4m3 tiles widened to fp16 in registers, q prescaled into fp16
  (``_load_q``), k_scale folded into qk_scale and v_scale applied to what is stored. Token and slot offsets are int64 because ``slot * stride``
passes 2**31 for caches beyond 2**31 elements.

Memory safety does not depend on the page table: a page id outside ``[0, num_pages)`` is
never dereferenced (its K and V load as zeros; the request's result is then undefined).
``evenkv.kernels.plan.audit_pages_kernel``, once per plan, sets PAGE_OUT_OF_RANGE in the
error flag for such ids, so the tile loops carry nothing for it. Lengths were clamped to the page table by the
planner.

Specialization: integers that vary with the batch or the cache (the batch size, the page
table's row stride, the cache's page count) are ``do_not_specialize``, so a server compiles
each kernel once per config, at start-up.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .numerics import FP8_Q_PRESCALE, LOG2E, dot, narrow, soft_cap
from .plan import window_tiles


@triton.jit
def _load_q(q_ptr, stride_qb, stride_qh, b, h,
            G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            KV_FP8: tl.constexpr):
    """Rows g < G of q[b, h*G + g, :] as stored; rows >= G are zero (they only pad the dot).

    The softmax scale is applied to the fp32 scores, not to q: scaling q and rounding it
    back to fp16/bf16 would overflow for |q| * sm_scale * log2(e) > 65504 (fp16) and add a
    rounding step. KV_FP8: q * FP8_Q_PRESCALE in fp16, the dtype an FP8 cache is widened
    to (one conversion instruction per two values; to bf16 it takes four); the prescale
    keeps bf16 queries up to 2**20 in fp16's range, and the host folds its inverse into
    qk_scale."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_g[:, None] < G) & (offs_d[None, :] < HEAD_DIM)
    ptrs = q_ptr + b.to(tl.int64) * stride_qb + (h * G + offs_g[:, None]).to(tl.int64) * stride_qh + offs_d[None, :]
    q = tl.load(ptrs, mask=mask, other=0.0)
    if KV_FP8:
        q = (q.to(tl.float32) * FP8_Q_PRESCALE).to(tl.float16)
    return q


@triton.jit
def _attend_tile(q, k_head, v_head, stride_k_slot, stride_v_slot, page_row_ptr, tok0, seq_len, num_pages,
                 qk_scale, cap_scale, m, l, acc, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step of q [G_PAD, BLOCK_D] against the tile of tokens tok0 ..
    tok0 + BLOCK_N - 1 of a segment (those at or past ``seq_len`` are masked, so the
    page-table tail and the unused part of the last page are never read). k_head / v_head
    point at the segment's KV head; an FP8 cache is widened to q's dtype (fp16, see
    ``_load_q``) in registers, its scales folded into qk_scale and the stored output. Scores are ``s * qk_scale``
    or, with SOFTCAP, ``soft_cap(s, qk_scale, cap_scale)`` (base 2). A token whose page id
    lies outside [0, num_pages) is not read: its K and V load as zeros
    (``evenkv.kernels.plan.audit_pages_kernel`` flags it).

    Returns the new (m [G_PAD] running base-2 max, l [G_PAD] running sum, acc [G_PAD,
    BLOCK_D] fp32 unnormalised)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tok = tok0 + offs_n
    mask_n = tok < seq_len
    page = tl.load(page_row_ptr + tok // PAGE_SIZE, mask=mask_n, other=0)
    # One unsigned compare covers negative ids too.
    page_ok = page.to(tl.uint32, bitcast=True) < num_pages
    slot = page.to(tl.int64) * PAGE_SIZE + tok % PAGE_SIZE
    kv_mask = (mask_n & page_ok)[:, None] & mask_d[None, :]
    k = tl.load(k_head + slot[:, None] * stride_k_slot + offs_d[None, :], mask=kv_mask, other=0.0)
    s = dot(q, tl.trans(k.to(q.dtype)))
    if SOFTCAP:
        s = soft_cap(s, qk_scale, cap_scale)
    else:
        s = s * qk_scale
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_head + slot[:, None] * stride_v_slot + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + dot(narrow(p, q.dtype), v.to(q.dtype))
    return m_new, l, acc


@triton.jit
def _attend_tiles(q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                  page_row_ptr, h, seq_len, first_tok, tile_begin, tile_end, num_pages, qk_scale, cap_scale,
                  PAGE_SIZE: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax of q against tiles [tile_begin, tile_end) of one segment, whose tile t
    holds tokens first_tok + t * BLOCK_N ..; scores as in ``_attend_tile``.

    Returns (acc [G_PAD, BLOCK_D] fp32, unnormalised), m [G_PAD] (running base-2 max)
    and l [G_PAD] (running sum).
    """
    k_head = k_ptr + h.to(tl.int64) * stride_k_head
    v_head = v_ptr + h.to(tl.int64) * stride_v_head
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for tile in tl.range(tile_begin, tile_end, num_stages=NUM_STAGES):
        m, l, acc = _attend_tile(q, k_head, v_head, stride_k_slot, stride_v_slot, page_row_ptr,
                                 first_tok + tile * BLOCK_N, seq_len, num_pages, qk_scale, cap_scale, m, l, acc,
                                 PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP)
    return acc, m, l


@triton.jit
def _add_sinks(acc, m, l, sinks_ptr, h, row0, G: tl.constexpr, ROWS: tl.constexpr):
    """Rows g in [row0, row0 + ROWS) of a finished (acc [ROWS, *] fp32, m base-2 max, l sum):
    the sink logit of query head h*G + g (``sinks`` [Hq], natural log) joins the softmax
    denominator. Both are rescaled to max(m, sink) so neither term overflows; a row that saw
    no token stays at acc = 0."""
    offs_g = row0 + tl.arange(0, ROWS)
    sink = tl.load(sinks_ptr + h * G + offs_g, mask=offs_g < G, other=float("-inf")).to(tl.float32) * LOG2E
    top = tl.maximum(m, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    alpha = tl.exp2(m - top)
    return acc * alpha[:, None], l * alpha + tl.exp2(sink - top)


@triton.jit
def _store_rows(out_ptr, stride_ob, stride_oh, b, h, row0, d0, acc, l,
                G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, COLS: tl.constexpr):
    """out[b, h*G + g, d0 + i] = acc[g - row0, i] / l[g - row0] for g in [row0, row0 + ROWS),
    g < G, and i < COLS, d0 + i < HEAD_DIM; a row that saw no token (l == 0) is written as zeros."""
    offs_g = row0 + tl.arange(0, ROWS)
    offs_d = d0 + tl.arange(0, COLS)
    safe_l = tl.where(l > 0, l, 1.0)
    o = tl.where(l[:, None] > 0, acc / safe_l[:, None], 0.0)
    mask = (offs_g[:, None] < G) & (offs_d[None, :] < HEAD_DIM)
    ptrs = out_ptr + tl.cast(b, tl.int64) * stride_ob + tl.cast(h * G + offs_g[:, None], tl.int64) * stride_oh + offs_d[None, :]
    tl.store(ptrs, narrow(o, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_whole(out_ptr, stride_ob, stride_oh, b, h, acc, m, l, sinks_ptr, v_scale,
                 G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr):
    """A segment walked whole by one CTA: out[b, h*G:(h+1)*G] from its (acc, m, l), with the
    sinks (HAS_SINKS) and an FP8 cache's V scale (KV_FP8)."""
    if HAS_SINKS:
        acc, l = _add_sinks(acc, m, l, sinks_ptr, h, 0, G, G_PAD)
    if KV_FP8:
        acc = acc * v_scale
    _store_rows(out_ptr, stride_ob, stride_oh, b, h, 0, 0, acc, l, G, G_PAD, HEAD_DIM, BLOCK_D)


@triton.jit
def _store_partial(o_part_ptr, lse_part_ptr, slot, acc, m, l, v_scale,
                   G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   KV_FP8: tl.constexpr):
    """o_part[slot] = acc / l (fp32 [G, HEAD_DIM]; times an FP8 cache's V scale); lse_part[slot]
    = m + log2(l) ([G]). Sinks join at the merge."""
    if KV_FP8:
        acc = acc * v_scale
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    base = slot.to(tl.int64) * G
    mask = (offs_g[:, None] < G) & (offs_d[None, :] < HEAD_DIM)
    tl.store(o_part_ptr + (base + offs_g[:, None]) * HEAD_DIM + offs_d[None, :], acc / l[:, None], mask=mask)
    tl.store(lse_part_ptr + base + offs_g, m + tl.log2(l), mask=offs_g < G)


@triton.jit
def _segment_span(first_tile, n_tiles, piece):
    """The CTAs that walk a segment whose n_tiles tiles start at cost ``first_tile``:
    (first CTA, number of CTAs). CTA c walks cost range [c * piece, (c + 1) * piece)."""
    first_cta = first_tile // piece
    return first_cta, (first_tile + n_tiles - 1) // piece - first_cta + 1


@triton.jit
def _fused_cut(b, h, seg_lo, n_tiles, piece, NUM_KV_HEADS: tl.constexpr, FUSED_MERGE_PIECES: tl.constexpr):
    """A cut segment (b, h) starting at cost seg_lo, as the decode kernel's own merge sees
    it: (b * Hkv + h, or -1 if it has more than FUSED_MERGE_PIECES pieces; its first CTA;
    its pieces)."""
    span_cta, span_pieces = _segment_span(seg_lo, n_tiles, piece)
    return tl.where(span_pieces <= FUSED_MERGE_PIECES, b * NUM_KV_HEADS + h, -1), span_cta, span_pieces


@triton.jit(do_not_specialize=["stride_pt", "window", "batch_size", "num_pages"])
def decode_stream_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, o_part_ptr, lse_part_ptr, merge_counters_ptr,
    seq_lens_ptr, page_table_ptr, active_req_ptr, cta_start_ptr, plan_scalars_ptr, sinks_ptr,
    stride_qb, stride_qh, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_ob, stride_oh, stride_pt, qk_scale, cap_scale, v_scale, window, batch_size, num_pages,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, FUSED_MERGE_PIECES: tl.constexpr, MERGE_ROWS: tl.constexpr,
    EMPTY_SCAN: tl.constexpr, USE_PDL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Persistent balanced decode: CTA c walks cost range [c*piece, (c+1)*piece).

    Segment (b, h) spans cost [seg_lo, seg_lo + n_tiles), segments in (request, head)
    order with empty requests skipped (``active_req``); its tile t sits at cost
    seg_lo + t and holds tokens first_tok + t * BLOCK_N .. (``window_tiles``: with a
    sliding window a segment is only the tiles of the window's tokens). The CTA starts in the request the plan wrote to
    ``cta_start[c]`` and takes one cost unit per iteration of a single loop, across
    segments, so the software pipeline keeps the next segment's page-table and K/V loads
    in flight while one segment ends (a loop per segment drained it at every segment: with
    many short requests that latency, not bandwidth, set the time). Each iteration reloads the segment's q rows (L1/L2 hits), which keeps every
    load of the loop a pipelined load.

    A segment this CTA covers whole is written to ``out``; a cut one goes to partial slot
    2*c + (c is the segment's first CTA). Only the range's first and last segments can be
    cut; one of few pieces is merged by its last piece to arrive (``_arrive_and_merge``),
    one of more pieces by ``merge_stream_kernel``.
    """
    cta = tl.program_id(0)
    if USE_PDL:
        # Let the merge grid launch now: its programs find their segments while this
        # kernel runs and wait for it to finish before reading partials.
        gdc_launch_dependents()
    num_ctas = tl.num_programs(0)
    piece = tl.load(plan_scalars_ptr)
    total = tl.load(plan_scalars_ptr + 1)
    num_active = tl.load(plan_scalars_ptr + 2)
    k = tl.load(cta_start_ptr + 4 * cta)
    b = tl.load(cta_start_ptr + 4 * cta + 1)
    seq_len = tl.load(cta_start_ptr + 4 * cta + 2)
    req_lo = tl.load(cta_start_ptr + 4 * cta + 3)
    next_b = tl.load(active_req_ptr + 2 * (k + 1), mask=k + 1 < num_active, other=0)
    next_seq_len = tl.load(active_req_ptr + 2 * (k + 1) + 1, mask=k + 1 < num_active, other=0)
    # Empty requests (seq_len 0: padded graph rows) are on no CTA's cost range; CTA c
    # writes zeros for requests c, c + C, ... among them. Their lengths are loaded now
    # and looked at after the walk, so the load is off the path to the first tile.
    scan_rows = cta + num_ctas * tl.arange(0, EMPTY_SCAN)
    scan_lens = tl.load(seq_lens_ptr + scan_rows, mask=scan_rows < batch_size, other=1)

    pos = cta * piece
    end = tl.minimum(pos + piece, total)
    first_tok, n_tiles = window_tiles(seq_len, window, BLOCK_N)
    h = tl.maximum(pos - req_lo, 0) // tl.maximum(n_tiles, 1)
    seg_lo = req_lo + h * n_tiles
    # The first segment is cut at its start if it has tiles before this range.
    first_seg, first_seg_cta, first_seg_pieces = _fused_cut(b, h, seg_lo, n_tiles, piece, NUM_KV_HEADS,
                                                            FUSED_MERGE_PIECES)
    tiles_before = pos - seg_lo
    first_seg = tl.where((pos < end) & (tiles_before > 0), first_seg, -1)

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for c in tl.range(pos, end, num_stages=NUM_STAGES):
        if c >= seg_lo + n_tiles:
            # The next segment: the next KV head of this request, or the next request.
            seg_lo = seg_lo + n_tiles
            if h == NUM_KV_HEADS - 1:
                h = 0
                k = k + 1
                b = next_b
                seq_len = next_seq_len
                first_tok, n_tiles = window_tiles(seq_len, window, BLOCK_N)
                next_b = tl.load(active_req_ptr + 2 * (k + 1), mask=k + 1 < num_active, other=0)
                next_seq_len = tl.load(active_req_ptr + 2 * (k + 1) + 1, mask=k + 1 < num_active, other=0)
            else:
                h = h + 1
        tile = c - seg_lo
        q = _load_q(q_ptr, stride_qb, stride_qh, b, h, G, G_PAD, HEAD_DIM, BLOCK_D, KV_FP8)
        m, l, acc = _attend_tile(q, k_ptr + h.to(tl.int64) * stride_k_head, v_ptr + h.to(tl.int64) * stride_v_head,
                                 stride_k_slot, stride_v_slot, page_table_ptr + b.to(tl.int64) * stride_pt,
                                 first_tok + tile * BLOCK_N, seq_len, num_pages, qk_scale, cap_scale, m, l, acc,
                                 PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP)
        # The segment's last tile in this range: store it whole, or as a cut piece.
        tile_end = tl.minimum(end - seg_lo, n_tiles)
        if tile == tile_end - 1:
            if (pos <= seg_lo) & (tile_end == n_tiles):
                _store_whole(out_ptr, stride_ob, stride_oh, b, h, acc, m, l, sinks_ptr, v_scale, G, G_PAD, HEAD_DIM,
                             BLOCK_D, HAS_SINKS, KV_FP8)
            else:
                # Slot 2c + 1 if the segment's first tile is in this range (c is its first CTA).
                _store_partial(o_part_ptr, lse_part_ptr, 2 * cta + (seg_lo >= pos).to(tl.int32),
                               acc, m, l, v_scale, G, G_PAD, HEAD_DIM, BLOCK_D, KV_FP8)
            m = tl.full([G_PAD], float("-inf"), tl.float32)
            l = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    # The loop ended in the range's last segment: cut at its end if it has tiles in and
    # past this range (and did not start before it: then it is the first one, counted).
    last_seg, last_seg_cta, last_seg_pieces = _fused_cut(b, h, seg_lo, n_tiles, piece, NUM_KV_HEADS,
                                                         FUSED_MERGE_PIECES)
    tiles_to_end = end - seg_lo
    tiles_before = pos - seg_lo
    last_seg = tl.where((pos < end) & (tiles_to_end > 0) & (tiles_to_end < n_tiles) & (tiles_before <= 0), last_seg, -1)

    if tl.sum((scan_lens == 0).to(tl.int32), 0) > 0:
        for i in range(EMPTY_SCAN):
            if tl.sum(tl.where(tl.arange(0, EMPTY_SCAN) == i, scan_lens, 0), 0) == 0:
                _store_empty_request(out_ptr, stride_ob, stride_oh, cta + num_ctas * i,
                                     NUM_KV_HEADS, G, G_PAD, HEAD_DIM, BLOCK_D)
    for r in range(cta + num_ctas * EMPTY_SCAN, batch_size, num_ctas):
        if tl.load(seq_lens_ptr + r) == 0:
            _store_empty_request(out_ptr, stride_ob, stride_oh, r, NUM_KV_HEADS, G, G_PAD, HEAD_DIM, BLOCK_D)
    # The arrivals wait for the walk to end: a merge inside the loop would raise its
    # register pressure past the 128-register cap (spills in the tile loop).
    if (first_seg >= 0) | (last_seg >= 0):
        _arrive_and_merge(o_part_ptr, lse_part_ptr, merge_counters_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr,
                          first_seg, first_seg_cta, first_seg_pieces, last_seg, last_seg_cta, last_seg_pieces,
                          NUM_KV_HEADS, G, HEAD_DIM, BLOCK_D, MERGE_ROWS, HAS_SINKS)


@triton.jit
def _store_empty_request(out_ptr, stride_ob, stride_oh, r, NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
                         G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r] = 0: a request of no tokens attends to nothing."""
    zero_acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    zero_l = tl.zeros([G_PAD], tl.float32)
    for h in range(NUM_KV_HEADS):
        _store_rows(out_ptr, stride_ob, stride_oh, r, h, 0, 0, zero_acc, zero_l, G, G_PAD, HEAD_DIM, BLOCK_D)


@triton.jit
def _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, b, h, row0, d0,
                  first, count, slot_a, slot_c, slot_first_extra,
                  G: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                  BLOCK_P: tl.constexpr, HAS_SINKS: tl.constexpr):
    """out[b, h*G + g, d0 : d0 + COLS] for g in [row0, row0 + ROWS) (g < G, columns <
    HEAD_DIM) = the log-sum-exp merge of partials i = first .. first + count - 1 of those
    rows and columns, stored at slot a*i + c (+extra for i == first), with the rows' sinks
    (HAS_SINKS).

    A [BLOCK_P partials, ROWS, COLS] tile per step, so a segment cut into many pieces costs
    a few dependent loads, not one per piece; the softmax weights are per (partial, row),
    one exp2 each. The result depends only on the partials (fixed order). Loads bypass L1
    (``.cg``): partials written by other CTAs of the same launch must come from L2.
    """
    offs_p = tl.arange(0, BLOCK_P)
    offs_r = row0 + tl.arange(0, ROWS)
    offs_d = d0 + tl.arange(0, COLS)
    mask_r = offs_r < G
    mask_d = offs_d < HEAD_DIM
    m = tl.full([ROWS], float("-inf"), tl.float32)
    weight = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, COLS], tl.float32)
    for p0 in range(first, first + count, BLOCK_P):
        i = p0 + offs_p
        slot = (slot_a * i + slot_c + tl.where(i == first, slot_first_extra, 0)).to(tl.int64)
        mask_pr = (i < first + count)[:, None] & mask_r[None, :]
        row_index = slot[:, None] * G + offs_r[None, :]
        lse = tl.load(lse_part_ptr + row_index, mask=mask_pr, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_part_ptr + row_index[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=mask_pr[:, :, None] & mask_d[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        safe_m = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - safe_m[None, :])
        alpha = tl.exp2(m - safe_m)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        weight = weight * alpha + tl.sum(w, 0)
        m = m_new
    if HAS_SINKS:
        acc, weight = _add_sinks(acc, m, weight, sinks_ptr, h, row0, G, ROWS)
    _store_rows(out_ptr, stride_ob, stride_oh, b, h, row0, d0, acc, weight, G, ROWS, HEAD_DIM, COLS)


@triton.jit
def _arrive_and_merge(o_part_ptr, lse_part_ptr, merge_counters_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr,
                      first_seg, first_seg_cta, first_seg_pieces, last_seg, last_seg_cta, last_seg_pieces,
                      NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      MERGE_ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Arrive at this CTA's cut segments of few pieces (``first_seg`` / ``last_seg`` =
    b * Hkv + h, or -1 for none), whose pieces it has stored, and merge into ``out`` each
    one at which it arrives last. A segment's pieces run on CTAs seg_cta ..
    seg_cta + pieces - 1; CTA c's is at slot 2c + (c == seg_cta).

    The arrival counter is ``merge_counters[seg_cta]`` (a CTA is the first CTA of at most
    one cut segment); the last arrival resets it to 0 for the next launch (or graph
    replay). Both arrivals are one two-lane atomic, so their round trips overlap. Arrival
    order decides only who merges: the merge order is fixed. Segments of more pieces are
    left to ``merge_stream_kernel``: their last pieces arrive together at the end of the
    kernel, where one CTA's serial merge steps each wait on memory that the other CTAs
    keep loaded, and a grid of merge programs does them in parallel.
    """
    lane = tl.arange(0, 2)
    seg = tl.where(lane == 0, first_seg, last_seg)
    seg_cta = tl.where(lane == 0, first_seg_cta, last_seg_cta)
    pieces = tl.where(lane == 0, first_seg_pieces, last_seg_pieces)
    arriving = seg >= 0
    # Every thread's partial stores happen before the (release) arrivals.
    tl.debug_barrier()
    arrived = tl.atomic_add(merge_counters_ptr + seg_cta, 1, mask=arriving, sem="acq_rel", scope="gpu")
    merging = arriving & (arrived == pieces - 1)
    tl.atomic_xchg(merge_counters_ptr + seg_cta, 0, mask=merging)
    for i in range(2):
        mine = merging & (lane == i)
        if tl.sum(mine.to(tl.int32), 0) > 0:
            segment = tl.sum(tl.where(mine, seg, 0), 0)
            _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, segment // NUM_KV_HEADS,
                          segment % NUM_KV_HEADS, 0, 0, tl.sum(tl.where(mine, seg_cta, 0), 0),
                          tl.sum(tl.where(mine, pieces, 0), 0), 2, 0, 1, G, HEAD_DIM, MERGE_ROWS, BLOCK_D,
                          # One partial per step: a step of several reduces across them through
                          # shared memory, slower here than the extra dependent loads.
                          BLOCK_P=1, HAS_SINKS=HAS_SINKS)


@triton.jit(do_not_specialize=["window"])
def merge_stream_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, cta_start_ptr, plan_scalars_ptr, sinks_ptr, stride_ob, stride_oh, window,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, G_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, WHOLE_P: tl.constexpr, ROW_P: tl.constexpr, CHUNK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr, CHUNK_P: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_MERGE_PIECES: tl.constexpr,
    USE_PDL: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Grid (C,). Merges every segment cut into more than FUSED_MERGE_PIECES pieces (fewer
    are merged inside ``decode_stream_kernel``), with the programs of the CTA boundaries
    inside it: a segment of P pieces holds P - 1 boundaries (CTAs first_cta + 1 ..
    first_cta + P - 1 start inside its tiles), and the t-th of them takes a share of the
    segment's [G, HEAD_DIM] output sized so that each program takes one or a few steps:

    * P <= WHOLE_P: the first one merges all rows in one [WHOLE_P, G_ROWS, BLOCK_D] step;
    * P <= ROW_P: rows t, t + (P - 1), ..., one [ROW_P, 1, BLOCK_D] step each;
    * more: items t, t + (P - 1), ... of the G * D_CHUNKS (row, CHUNK_D columns) items
      (D_CHUNKS = cdiv(HEAD_DIM, CHUNK_D)), each in cdiv(P, CHUNK_P) [CHUNK_P, 1, CHUNK_D] steps.

    The request at boundary j is the one CTA j starts in (``cta_start[j]``). One program
    per CTA fits in one wave once the decode kernel's CTAs leave.

    USE_PDL (programmatic dependent launch, sm90): this grid is launched while the decode
    kernel runs; each program finds its segment, then waits (``gdc_wait``) for the decode
    kernel to finish before it reads any partial.
    """
    j = tl.program_id(0)
    piece = tl.load(plan_scalars_ptr)
    num_active = tl.load(plan_scalars_ptr + 2)
    # A run of n tiles spans at most cdiv(n - 1, piece) + 1 CTAs: if even the longest
    # request's segments are merged inside the decode kernel, no program has work.
    most_pieces = tl.cdiv(tl.load(plan_scalars_ptr + 3) - 1, piece) + 1
    k = tl.load(cta_start_ptr + 4 * j)
    b = tl.load(cta_start_ptr + 4 * j + 1)
    _, n_tiles = window_tiles(tl.load(cta_start_ptr + 4 * j + 2), window, BLOCK_N)
    req_lo = tl.load(cta_start_ptr + 4 * j + 3)
    x = j * piece
    if (j > 0) & (k < num_active) & (most_pieces > FUSED_MERGE_PIECES):
        h = (x - req_lo) // n_tiles
        first_tile = req_lo + h * n_tiles
        first_cta, pieces = _segment_span(first_tile, n_tiles, piece)
        if (first_tile < x) & (x < first_tile + n_tiles) & (pieces > FUSED_MERGE_PIECES):
            if USE_PDL:
                gdc_wait()
            # CTA c stored this segment at slot 2c, or 2c + 1 when c is the first CTA.
            t = j - first_cta - 1
            helpers = pieces - 1
            if pieces <= WHOLE_P:
                if t == 0:
                    _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, b, h, 0, 0,
                                  first_cta, pieces, 2, 0, 1, G, HEAD_DIM, G_ROWS, BLOCK_D, WHOLE_P, HAS_SINKS)
            elif pieces <= ROW_P:
                for row in range(t, G, helpers):
                    _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, b, h, row, 0,
                                  first_cta, pieces, 2, 0, 1, G, HEAD_DIM, 1, BLOCK_D, ROW_P, HAS_SINKS)
            else:
                for item in range(t, G * D_CHUNKS, helpers):
                    _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, b, h,
                                  item // D_CHUNKS, (item % D_CHUNKS) * CHUNK_D, first_cta, pieces, 2, 0, 1, G,
                                  HEAD_DIM, 1, CHUNK_D, CHUNK_P, HAS_SINKS)


@triton.jit(do_not_specialize=["stride_pt", "window", "num_pages"])
def decode_units_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, o_part_ptr, lse_part_ptr,
    seq_lens_ptr, page_table_ptr, unit_req_ptr, unit_split_ptr, req_splits_ptr, req_tiles_per_split_ptr,
    num_units_ptr, queue_ptr, sinks_ptr,
    stride_qb, stride_qh, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_ob, stride_oh, stride_pt, qk_scale, cap_scale, v_scale, window, num_pages,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, PERSISTENT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Unit-queue decode. Unit u = (split j = u // Hkv, head h = u % Hkv); split j is
    split ``unit_split[j]`` of request ``unit_req[j]``.

    PERSISTENT: CTAs pull units from ``queue[0]`` (atomic); the last CTA to leave resets
    both queue words so the next launch (or graph replay) starts from zero.
    Otherwise program u runs unit u, and every request has exactly one split.
    A request with one split writes ``out``; split k of a longer one writes partial
    slot u, which ``merge_units_kernel`` reads back.
    """
    if PERSISTENT:
        num_units = tl.load(num_units_ptr)
        unit = tl.atomic_add(queue_ptr, 1)
    else:
        num_units = tl.num_programs(0)
        unit = tl.program_id(0)
    while unit < num_units:
        j = unit // NUM_KV_HEADS
        h = unit % NUM_KV_HEADS
        if PERSISTENT:
            b = tl.load(unit_req_ptr + j)
            split = tl.load(unit_split_ptr + j)
            num_splits = tl.load(req_splits_ptr + b)
            tiles_per_split = tl.load(req_tiles_per_split_ptr + b)
        else:
            b = j
            split = j * 0
            num_splits = split + 1
            tiles_per_split = split
        seq_len = tl.load(seq_lens_ptr + b)
        first_tok, n_tiles = window_tiles(seq_len, window, BLOCK_N)
        # split is 0 whenever num_splits is 1, so tile_begin is 0 there.
        tile_begin = split * tiles_per_split
        tile_end = tl.where(num_splits == 1, n_tiles, tl.minimum(tile_begin + tiles_per_split, n_tiles))
        q = _load_q(q_ptr, stride_qb, stride_qh, b, h, G, G_PAD, HEAD_DIM, BLOCK_D, KV_FP8)
        acc, m, l = _attend_tiles(
            q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
            page_table_ptr + b.to(tl.int64) * stride_pt, h, seq_len, first_tok, tile_begin, tile_end, num_pages,
            qk_scale, cap_scale, PAGE_SIZE, G_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES, SOFTCAP)
        if num_splits == 1:
            _store_whole(out_ptr, stride_ob, stride_oh, b, h, acc, m, l, sinks_ptr, v_scale, G, G_PAD, HEAD_DIM,
                         BLOCK_D, HAS_SINKS, KV_FP8)
        else:
            _store_partial(o_part_ptr, lse_part_ptr, unit, acc, m, l, v_scale, G, G_PAD, HEAD_DIM, BLOCK_D, KV_FP8)
        if PERSISTENT:
            unit = tl.atomic_add(queue_ptr, 1)
        else:
            unit = num_units
    if PERSISTENT:
        leaving = tl.atomic_add(queue_ptr + 1, 1)
        if leaving == tl.num_programs(0) - 1:
            tl.atomic_xchg(queue_ptr, 0)
            tl.atomic_xchg(queue_ptr + 1, 0)


@triton.jit
def merge_units_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, req_splits_ptr, req_split_base_ptr, merge_list_ptr, merge_count_ptr,
    sinks_ptr, stride_ob, stride_oh,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_P: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Persistent grid: merge the splits of the requests that have more than one, listed in
    ``merge_list`` ([>= merge_count] int32). Item i is row i % G of KV head (i // G) % Hkv of
    request merge_list[i // (G * Hkv)]; split k of (b, h) is at slot (req_split_base[b] + k)
    * Hkv + h. A batch whose requests all have one split launches programs that find no item."""
    items = tl.load(merge_count_ptr) * (NUM_KV_HEADS * G)
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        b = tl.load(merge_list_ptr + item // (NUM_KV_HEADS * G))
        h = (item // G) % NUM_KV_HEADS
        num_splits = tl.load(req_splits_ptr + b)
        base = tl.load(req_split_base_ptr + b)
        _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, b, h, item % G, 0, base,
                      num_splits, NUM_KV_HEADS, h, 0, G, HEAD_DIM, ROWS, BLOCK_D, BLOCK_P, HAS_SINKS)
