"""Triton kernels for paged decode attention: decode rows of one query token, and
speculative-verify rows of 1 + draft tokens.

Work unit: a KV *tile* = BLOCK_N consecutive tokens of one request for one KV head,
with the rows of that KV head packed into the tile's rows: its G = Hq / Hkv query heads
(PackGQA), times the row's query tokens for a verify row (MULTI_Q: tile row r is query
token r // G and query head h * G + r % G), padded to ROWS >= 16 rows for the tensor-core
dot. Every query token of a row reads each KV byte once, so a verify row costs what a
decode row costs in bytes. A *segment* is the run of tiles of one (request, KV head) pair.

Two kernels walk the segments, one per scheduling mode:

* ``decode_stream_kernel`` (policy ``balanced``): a persistent grid of C CTAs. The
  planner lays every segment end to end on one cost line (each segment costs its
  tiles) and gives CTA c the cost range
  ``[c * piece, min((c + 1) * piece, total))``, which it walks in one loop across
  segments (or, for verify rows, one loop per segment). A segment cut by a range boundary
  produces partial (O, LSE) pairs. The CTA that stores the last of a few pieces merges
  them (``_arrive_and_merge``); ``merge_stream_kernel`` merges segments of more pieces, in
  a grid launched early (programmatic dependent launch on sm90) that waits for the decode
  kernel before it reads a partial. In deterministic mode (DETERMINISTIC) the ranges start
  at chunk boundaries and ``merge_units_kernel`` merges the chunks in a fixed order.
* ``decode_units_kernel`` (policies ``fa3`` and ``none``): work
  units are (request, split, KV head) triples. Persistent CTAs pull units from an atomic
  counter in the planner's (heaviest first) order, or one program runs one unit.

Both kernels take their online-softmax steps with ``_attend_tile`` (the units kernel
through ``_attend_tiles``, one loop per unit) and share ``_store_whole``, ``_store_partial``
and ``_merge_to_out``. Softmax is computed in base 2: the fp32 scores are
scaled by ``sm_scale * log2(e)`` so ``exp2`` replaces ``exp``; every LSE in this module
is a base-2 log-sum-exp.

Verify rows (MULTI_Q): request b's query tokens are q rows ``q_start .. q_start + q_len``
(``plan.decode_query_rows``), token t at position seq_len - q_len + t. Causal: token t sees
the keys up to its position. TREE: ``tree[q_start + t]`` is a bit mask over the request's
new tokens (bit j: token t sees new token j; the prefix is always seen), SGLang's
tree-shaped drafts; a tree token sits at the prefix's end plus its depth, which its bit count
gives (its ancestors and itself), and a sliding window bounds its prefix keys from there. A
partial slot holds SLOT_ROWS = G * (most query tokens of a row) rows.

What a layer adds to plain attention (``decode_launch.LayerTerms``):

* sliding window W (runtime ``window``, 0 = none): a segment is the tiles of the request's
  last min(seq_len, W) tokens (a verify row's ``plan.row_window``), counted from the
  window's first token (``plan.window_tiles``), so the plan and the walk cost the window's
  tokens only; verify rows mask each token's own window;
* soft-cap (SOFTCAP): base-2 scores ``numerics.soft_cap(s, qk_scale, cap_scale)``;
* sinks (HAS_SINKS): a per-query-head logit in the softmax denominator, added where a
  row's result is final (``_add_sinks``: a whole segment's store, or its merge);
* FP8 cache (KV_FP8): e4m3 tiles read as int16 pairs and widened to fp16 in registers, the
  dots run over the head dim's even and odd elements apart (``_attend_tile``), q prescaled
  into fp16 (``_load_q``), k_scale folded into qk_scale and v_scale applied to what is stored.

The caches are read as [num_pages, page_size, Hkv, D] with any page, offset and head strides
and a unit stride in D: token-major (NHD) pages, whose page stride is page_size offsets, as
slots (slot = page * page_size + offset), and pages of any other stride (head-major HND pages,
the pages of a cross-layer allocation; PAGE_GAP) with one more term (``_token_rows``). Token
and slot offsets are int64 because ``slot * stride`` passes 2**31 for caches beyond 2**31
elements. A NaN in q or in a key that a row sees makes that row's output NaN, as in
exact softmax attention; a row that sees no key (and no sink) is zeros.

Memory safety does not depend on the batch data: a page id outside ``[0, num_pages)`` is
never dereferenced (its tokens' K and V load as zeros: that request's result is wrong, and flagged);
``evenkv.kernels.plan.audit_pages_kernel``, once per plan, sets PAGE_OUT_OF_RANGE in the
error flag for such ids, so the tile loops carry nothing for it. Lengths and query ranges
were clamped by the planner; query rows at or past ``total_q`` (q's rows) are neither read
nor written, and the first CTA flags QUERY_OUT_OF_RANGE if the plan's rows pass it.

Specialization: integers that vary with the batch or the cache (the batch size, the page
table's row stride, the cache's page count, q's rows) are ``do_not_specialize``, so a
server compiles each kernel once per config, at start-up.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .error_bits import QUERY_OUT_OF_RANGE
from .numerics import FP8_Q_PRESCALE, LOG2E, dot, dot_acc, e4m3_pairs_to_fp16, narrow, settled, soft_cap

from .plan import ACTIVE_REQ_FIELDS, decode_query_rows, row_window, window_tiles


@triton.jit
def _row_fields(row0, q_start, q_len, total_q, G: tl.constexpr, ROWS: tl.constexpr, MULTI_Q: tl.constexpr):
    """Tile rows row0 .. row0 + ROWS - 1 of a segment: (their q rows, query head offset g in
    [0, G) of each, which hold a query that exists). Plain decode: the scalar q row q_start
    (= b) and g = row; verify rows: [ROWS] q rows, token r // G of the request's, head r % G,
    those past q_len or past q's rows (``total_q``) absent."""
    offs = row0 + tl.arange(0, ROWS)
    if MULTI_Q:
        tok = offs // G
        row = q_start + tok
        g = offs % G
        present = (tok < q_len) & (row < total_q)
    else:
        row = q_start
        g = offs
        present = offs < G
    return row, g, present


@triton.jit
def _query_start(q_start, b, MULTI_Q: tl.constexpr):
    """The first q row of request b: the plan's for verify rows, b itself for plain decode."""
    if MULTI_Q:
        first = q_start
    else:
        first = b
    return first


@triton.jit
def _row_offsets(row, stride, MULTI_Q: tl.constexpr):
    """Offsets of ``_row_fields``' q rows: one scalar for plain decode, a [ROWS, 1] column else."""
    if MULTI_Q:
        offsets = row.to(tl.int64)[:, None] * stride
    else:
        offsets = row.to(tl.int64) * stride
    return offsets


@triton.jit
def _row_columns(g, present, offs_d, G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PACK: tl.constexpr):
    """Where tile columns ``offs_d`` [COLS] of rows of query head offset g ([ROWS], those
    ``present``) lie in q's and out's rows: ([ROWS, COLS] column offsets, [ROWS, COLS] mask).
    Unpacked, column c is column c (< HEAD_DIM). HEAD_PACK > 1: a row belongs to the pack's KV
    head g // (G / HEAD_PACK), whose HEAD_DIM / HEAD_PACK columns are its share of the tile's;
    only those are the row's."""
    if HEAD_PACK > 1:
        cols = offs_d[None, :] - (g // (G // HEAD_PACK))[:, None] * (HEAD_DIM // HEAD_PACK)
        mask = present[:, None] & (cols >= 0) & (cols < HEAD_DIM // HEAD_PACK)
    else:
        cols = offs_d[None, :]
        mask = present[:, None] & (offs_d[None, :] < HEAD_DIM)
    return cols, mask


@triton.jit
def _pack_columns(offs, head_stride, COLS_PER_HEAD: tl.constexpr, PACK_GAP: tl.constexpr):
    """Offsets in a cache row of a packed tile's columns ``offs``: column c is column
    c % COLS_PER_HEAD of the pack's (c // COLS_PER_HEAD)-th KV head, head_stride apart. Heads
    stored side by side (no PACK_GAP: SGLang's pools) are the columns themselves, so the
    loads take their addresses as the unpacked tile does; a gap (vLLM's K and V halves, HND
    pages) costs a runtime offset for the second head's columns."""
    if PACK_GAP:
        cols = (offs // COLS_PER_HEAD) * head_stride + offs % COLS_PER_HEAD
    else:
        cols = offs
    return cols


@triton.jit
def _load_q(q_ptr, stride_qb, stride_qh, q_start, q_len, total_q, h,
            G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            KV_FP8: tl.constexpr, MULTI_Q: tl.constexpr, HEAD_PACK: tl.constexpr):
    """The segment's tile rows of q ([ROWS, BLOCK_D], ``_row_fields``) as stored. Plain decode:
    absent rows (past G) are zero. Verify rows: a row past the request's q_len re-reads its
    last token (it only pads the dot and is never stored), so the load needs no per-row mask
    and its addresses are one segment base plus loop-invariant int32 row offsets (the tile
    loop reloads q every tile); a request whose q rows pass q's ``total_q`` rows loads zeros
    (the plan flags it).

    The softmax scale is applied to the fp32 scores, not to q: scaling q and rounding it
    back to fp16/bf16 would overflow for |q| * sm_scale * log2(e) > 65504 (fp16) and add a
    rounding step. KV_FP8: q * FP8_Q_PRESCALE in fp16, the dtype an FP8 cache is widened
    to (one conversion instruction per two values; to bf16 it takes four); the prescale
    keeps bf16 queries up to 2**20 in fp16's range, and the host folds its inverse into
    qk_scale.

    HEAD_PACK > 1 (plain decode rows only): the tile holds the G / HEAD_PACK query heads of
    each of HEAD_PACK neighbouring KV heads, each in its own head's HEAD_DIM / HEAD_PACK
    columns and zero in the others (``_row_columns``), so one dot over all columns scores
    every row against its own head's keys only."""
    tl.static_assert(HEAD_PACK == 1 or not MULTI_Q, "packed KV heads take plain decode rows only")
    offs_d = tl.arange(0, BLOCK_D)
    if MULTI_Q:
        offs = tl.arange(0, ROWS)
        tok = tl.minimum(offs // G, tl.maximum(q_len - 1, 0))
        base = q_ptr + q_start.to(tl.int64) * stride_qb + (h * G).to(tl.int64) * stride_qh
        ptrs = base + (tok * stride_qb + (offs % G) * stride_qh)[:, None] + offs_d[None, :]
        in_range = q_start + tl.maximum(q_len, 1) <= total_q
        if BLOCK_D == HEAD_DIM:
            q = tl.load(ptrs, mask=in_range, other=0.0)
        else:
            q = tl.load(ptrs, mask=in_range & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        row, g, present = _row_fields(0, q_start, q_len, total_q, G, ROWS, MULTI_Q)
        cols, mask = _row_columns(g, present, offs_d, G, HEAD_DIM, HEAD_PACK)
        ptrs = q_ptr + _row_offsets(row, stride_qb, MULTI_Q) + (h * G + g[:, None]).to(tl.int64) * stride_qh + cols
        q = tl.load(ptrs, mask=mask, other=0.0)
    if KV_FP8:
        q = (q.to(tl.float32) * FP8_Q_PRESCALE).to(tl.float16)
    return q


@triton.jit
def _load_tree(tree_ptr, q_start, q_len, total_q, G: tl.constexpr, ROWS: tl.constexpr, TREE: tl.constexpr):
    """[ROWS] int32: each tile row's tree mask over its request's new tokens (TREE), else 0."""
    if TREE:
        row, _, present = _row_fields(0, q_start, q_len, total_q, G, ROWS, True)
        tree = tl.load(tree_ptr + row, mask=present, other=0)
    else:
        tree = tl.zeros([ROWS], tl.int32)
    return tree


@triton.jit
def _bit_count16(x):
    """The set bits among the low 16 of each of x's non-negative int32 values (SWAR sums)."""
    x = x - ((x >> 1) & 0x5555)
    x = (x & 0x3333) + ((x >> 2) & 0x3333)
    x = (x + (x >> 4)) & 0x0F0F
    return (x + (x >> 8)) & 0x1F


@triton.jit
def _seen_keys(tok, seq_len, q_len, tree, window, G: tl.constexpr, ROWS: tl.constexpr, TREE: tl.constexpr):
    """[ROWS, BLOCK_N]: whether each tile row of a verify row sees key ``tok`` (< seq_len
    already checked). Token t = row // G sits at position p = seq_len - q_len + t and sees
    keys <= p (causal); with a window W only keys > p - W. With TREE it sees the prefix and
    the new tokens its mask names, and sits at p = seq_len - q_len + its depth (its mask's bits
    less one: its ancestors and itself), as the engine places it; a window W then bounds the
    prefix only, for its ancestors lie within W whenever W >= q_len (DecodeAttention's rule)."""
    first_new = seq_len - q_len
    if TREE:
        rel = tok[None, :] - first_new
        named = ((tree[:, None] >> tl.minimum(tl.maximum(rel, 0), 31)) & 1) != 0
        depth = _bit_count16(tree & ((1 << q_len) - 1)) - 1
        in_window = (window <= 0) | (tok[None, :] > (first_new + depth)[:, None] - window)
        return tl.where(rel < 0, in_window, named)
    pos = first_new + tl.arange(0, ROWS) // G
    seen = tok[None, :] <= pos[:, None]
    return seen & ((window <= 0) | (tok[None, :] > pos[:, None] - window))


@triton.jit
def _token_rows(head_ptr, page, tok, stride_off, stride_page, PAGE_SIZE: tl.constexpr, PAGE_GAP: tl.constexpr):
    """[BLOCK_N, 1] pointers to tokens ``tok`` ([BLOCK_N], on pages ``page``) of one head's cache:
    at slot (page * PAGE_SIZE + offset) * stride_off where pages are PAGE_SIZE offsets apart,
    else (PAGE_GAP) at page * stride_page + offset * stride_off. Page sizes are powers of two."""
    if PAGE_GAP:
        rows = head_ptr + (page.to(tl.int64) * stride_page + (tok & (PAGE_SIZE - 1)) * stride_off)[:, None]
    else:
        slot = page.to(tl.int64) * PAGE_SIZE + (tok & (PAGE_SIZE - 1))
        rows = head_ptr + slot[:, None] * stride_off
    return rows


@triton.jit
def _tile_pages(page_row_ptr, tok0, seq_len, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] int32 page ids of tokens tok0 .. tok0 + BLOCK_N - 1 from a request's page-table
    row (0 for tokens at or past ``seq_len``: the table's tail is never read)."""
    tok = tok0 + tl.arange(0, BLOCK_N)
    # tok >= 0: an unsigned division is one shift.
    return tl.load(page_row_ptr + tok.to(tl.uint32) // PAGE_SIZE, mask=tok < seq_len, other=0)


@triton.jit
def _attend_tile(q, k_head, v_head, stride_k_slot, stride_k_page, stride_k_head, stride_v_slot, stride_v_page,
                 stride_v_head, page_row_ptr, page, tok0, seq_len, q_len, tree, window, num_pages, qk_scale, cap_scale,
                 m, l, acc, G: tl.constexpr, ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_GAP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                 MULTI_Q: tl.constexpr, TREE: tl.constexpr, HEAD_PACK: tl.constexpr, PACK_GAP: tl.constexpr,
                 LOOP_PER_SEGMENT: tl.constexpr):
    """One online-softmax step of q [ROWS, BLOCK_D] against the tile of tokens tok0 ..
    tok0 + BLOCK_N - 1 of a segment, on pages ``page`` ([BLOCK_N] int32, ``_tile_pages``; None:
    loaded here from the request's page-table row ``page_row_ptr``; tokens at or past ``seq_len``
    are masked, so the unused part of the last page is never read; MULTI_Q: each row
    sees the keys of ``_seen_keys``). k_head / v_head point at the segment's KV head (its
    first, whose HEAD_PACK heads' rows the tile's columns hold, ``_pack_columns``). An FP8
    cache is read as int16 pairs and widened to q's dtype (fp16, see ``_load_q``) in registers
    (``e4m3_pairs_to_fp16``): each dot runs as two, over the even and the odd elements of the
    head dim, so the staged tiles reach the dots through ldmatrix; its scales are folded into
    qk_scale and the stored output. Scores are ``s * qk_scale`` or, with SOFTCAP,
    ``soft_cap(s, qk_scale, cap_scale)`` (base 2). A token whose page id lies outside [0,
    num_pages) is not read: its K and V load as zeros (``evenkv.kernels.plan.audit_pages_kernel``
    flags it). Tokens are addressed by ``_token_rows``.

    Returns the new (m [ROWS] running base-2 max, l [ROWS] running sum, acc [ROWS,
    BLOCK_D] fp32 unnormalised).

    Tiles of 64+ rows take wgmma dots on sm90, and the PV dot is waited for in its own tile:
    in the walk's one loop across segments Triton 3.6 would leave it in flight into the next
    tile while the segment-end store and reset read and rewrite acc, and ptxas then serializes
    every wgmma of the kernel (its note C7515). A loop per segment (LOOP_PER_SEGMENT,
    ``_attend_tiles``) reads acc only after its end, so there the two PV dots of an FP8 tile stay
    in flight over the next tile's loads and QK dots; a bf16 cache's one dot keeps the wait (in
    flight it timed no faster, and head dim 256's 64-row tile then reloads one more value from
    local memory a tile)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tok = tok0 + offs_n
    mask_n = tok < seq_len
    if page is None:
        page = _tile_pages(page_row_ptr, tok0, seq_len, PAGE_SIZE, BLOCK_N)
    # One unsigned compare covers negative ids too.
    key_ok = mask_n & (page.to(tl.uint32, bitcast=True) < num_pages)
    KV_FP8: tl.constexpr = k_head.dtype.element_ty == tl.float8e4nv
    tl.static_assert(HEAD_PACK == 1 or KV_FP8, "packed KV heads read FP8 caches only (configs.kv_head_pack)")
    if KV_FP8:
        offs_pair = tl.arange(0, BLOCK_D // 2)
        kv_mask = key_ok[:, None] & (offs_pair[None, :] < HEAD_DIM // 2)
        k_pairs = tl.load(_token_rows(k_head, page, tok, stride_k_slot, stride_k_page, PAGE_SIZE,
                                      PAGE_GAP).to(tl.pointer_type(tl.int16)) +
                          _pack_columns(offs_pair, stride_k_head // 2, HEAD_DIM // 2 // HEAD_PACK, PACK_GAP)[None, :],
                          mask=kv_mask, other=0)
        k_even, k_odd = e4m3_pairs_to_fp16(k_pairs)
        q_even, q_odd = tl.split(tl.reshape(q, [ROWS, BLOCK_D // 2, 2]))
        s = dot_acc(q_odd, tl.trans(k_odd), dot(q_even, tl.trans(k_even)))
    else:
        kv_mask = key_ok[:, None] & mask_d[None, :]
        k = tl.load(_token_rows(k_head, page, tok, stride_k_slot, stride_k_page, PAGE_SIZE, PAGE_GAP) +
                    offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k.to(q.dtype)))
    # Without a soft-cap the scores stay unscaled until the exponent: a row's max is scaled once
    # (qk_scale > 0 keeps it the max) and each score's scale and shift are one fused multiply-add.
    if SOFTCAP:
        s = soft_cap(s, qk_scale, cap_scale)
        score_scale = 1.0
    else:
        score_scale = qk_scale
    if MULTI_Q:
        # Only a tile that reaches the new tokens or starts before the last row's window (the
        # narrowest: keys > seq_len - 1 - W) is masked; the prefix tiles inside every row's
        # window, most of the loop's, are seen whole by every row.
        if (tok0 + BLOCK_N > seq_len - q_len) | ((window > 0) & (tok0 < seq_len - window)):
            s = tl.where(mask_n[None, :] & _seen_keys(tok, seq_len, q_len, tree, window, G, ROWS, TREE), s,
                         float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * score_scale)
        # A row that has seen no key yet (m_new = -inf: a causal row in a tile of later
        # tokens) keeps acc = l = 0 instead of computing -inf - -inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # Every row sees every key of the tile, one at least.
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * score_scale)
        m_use = m_new
    p = tl.exp2(s * score_scale - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    l = l * alpha + tl.sum(p, 1)
    if KV_FP8:
        v_pairs = tl.load(_token_rows(v_head, page, tok, stride_v_slot, stride_v_page, PAGE_SIZE,
                                      PAGE_GAP).to(tl.pointer_type(tl.int16)) +
                          _pack_columns(offs_pair, stride_v_head // 2, HEAD_DIM // 2 // HEAD_PACK, PACK_GAP)[None, :],
                          mask=kv_mask, other=0)
        v_even, v_odd = e4m3_pairs_to_fp16(v_pairs)
        # acc's even and odd columns, each its own dot's accumulator; the split and the join
        # only relabel registers.
        acc_even, acc_odd = tl.split(tl.reshape(acc * alpha[:, None], [ROWS, BLOCK_D // 2, 2]))
        p = narrow(p, q.dtype)
        acc = tl.reshape(tl.join(dot_acc(p, v_even, acc_even), dot_acc(p, v_odd, acc_odd)), [ROWS, BLOCK_D])
    else:
        v = tl.load(_token_rows(v_head, page, tok, stride_v_slot, stride_v_page, PAGE_SIZE, PAGE_GAP) +
                    offs_d[None, :], mask=kv_mask, other=0.0)
        acc = dot_acc(narrow(p, q.dtype), v.to(q.dtype), acc * alpha[:, None])
    if ROWS >= 64 and not (LOOP_PER_SEGMENT and KV_FP8):
        acc = settled(acc)
    return m_new, l, acc


@triton.jit
def _attend_tiles(q, k_ptr, v_ptr, stride_k_slot, stride_k_page, stride_k_head, stride_v_slot, stride_v_page,
                  stride_v_head, page_row_ptr, h, seq_len, q_len, tree, window, first_tok, tile_begin, tile_end,
                  num_pages, qk_scale, cap_scale, G: tl.constexpr, ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  PAGE_GAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_STAGES: tl.constexpr, SOFTCAP: tl.constexpr, MULTI_Q: tl.constexpr, TREE: tl.constexpr,
                  HEAD_PACK: tl.constexpr, PACK_GAP: tl.constexpr):
    """Online softmax of q against tiles [tile_begin, tile_end) of one segment, whose tile t
    holds tokens first_tok + t * BLOCK_N ..; scores and masks as in ``_attend_tile``.

    Returns (acc [ROWS, BLOCK_D] fp32, unnormalised), m [ROWS] (running base-2 max)
    and l [ROWS] (running sum).
    """
    k_head = k_ptr + (h * HEAD_PACK).to(tl.int64) * stride_k_head
    v_head = v_ptr + (h * HEAD_PACK).to(tl.int64) * stride_v_head
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    # Loaded inside a tile, its page ids get a pipeline stage of their own from Triton 3.6's
    # pipeliner, and K and V then run only NUM_STAGES - 2 tiles ahead (the 64-row tile at 3
    # stages: two K/V buffers). Tiles of 64+ rows load the next tile's page ids a tile ahead, as
    # a plain loop-carried value, so K and V run NUM_STAGES - 1 ahead (three buffers); smaller
    # tiles timed no faster with it (docs/tuning.md).
    PAGES_AHEAD: tl.constexpr = ROWS >= 64
    page = _tile_pages(page_row_ptr, first_tok + tile_begin * BLOCK_N, seq_len, PAGE_SIZE, BLOCK_N) \
        if PAGES_AHEAD else None
    for tile in tl.range(tile_begin, tile_end, num_stages=NUM_STAGES):
        tok0 = first_tok + tile * BLOCK_N
        if PAGES_AHEAD:
            next_page = _tile_pages(page_row_ptr, tok0 + BLOCK_N, seq_len, PAGE_SIZE, BLOCK_N)
        m, l, acc = _attend_tile(q, k_head, v_head, stride_k_slot, stride_k_page, stride_k_head, stride_v_slot,
                                 stride_v_page, stride_v_head, page_row_ptr, page, tok0, seq_len,
                                 q_len, tree, window, num_pages, qk_scale, cap_scale, m, l, acc, G, ROWS, PAGE_SIZE,
                                 PAGE_GAP, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, MULTI_Q, TREE, HEAD_PACK, PACK_GAP,
                                 LOOP_PER_SEGMENT=True)
        if PAGES_AHEAD:
            page = next_page
    return acc, m, l


@triton.jit
def _add_sinks(acc, m, l, sinks_ptr, h, row0, G: tl.constexpr, ROWS: tl.constexpr, MULTI_Q: tl.constexpr):
    """Rows row0 .. row0 + ROWS - 1 of a finished (acc [ROWS, *] fp32, m base-2 max, l sum):
    the sink logit of each row's query head (``sinks`` [Hq], natural log) joins the softmax
    denominator. Both are rescaled to max(m, sink) so neither term overflows; a row that saw
    no key stays at acc = 0."""
    offs_g = row0 + tl.arange(0, ROWS)
    if MULTI_Q:
        offs_g = offs_g % G
    sink = tl.load(sinks_ptr + h * G + offs_g, mask=offs_g < G, other=float("-inf")).to(tl.float32) * LOG2E
    top = tl.maximum(m, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    alpha = tl.exp2(m - top)
    return acc * alpha[:, None], l * alpha + tl.exp2(sink - top)


@triton.jit
def _store_rows(out_ptr, stride_ob, stride_oh, q_start, q_len, total_q, h, row0, d0, acc, l,
                G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, COLS: tl.constexpr,
                MULTI_Q: tl.constexpr, HEAD_PACK: tl.constexpr):
    """Tile rows row0 .. row0 + ROWS - 1 of a segment (``_row_fields``), columns d0 .. d0 +
    COLS - 1 (< HEAD_DIM): out = acc / l. A row that saw no key (l == 0) is zeros; a NaN
    stays NaN. HEAD_PACK > 1: only the columns of each row's own KV head (``_row_columns``)."""
    row, g, present = _row_fields(row0, q_start, q_len, total_q, G, ROWS, MULTI_Q)
    offs_d = d0 + tl.arange(0, COLS)
    o = acc / tl.where(l == 0, 1.0, l)[:, None]
    cols, mask = _row_columns(g, present, offs_d, G, HEAD_DIM, HEAD_PACK)
    ptrs = out_ptr + _row_offsets(row, stride_ob, MULTI_Q) + (h * G + g[:, None]).to(tl.int64) * stride_oh + cols
    tl.store(ptrs, narrow(o, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_whole(out_ptr, stride_ob, stride_oh, q_start, q_len, total_q, h, acc, m, l, sinks_ptr, v_scale,
                 G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr, MULTI_Q: tl.constexpr, HEAD_PACK: tl.constexpr):
    """A segment walked whole by one CTA: its rows of out from its (acc, m, l), with the
    sinks (HAS_SINKS) and an FP8 cache's V scale (KV_FP8)."""
    if HAS_SINKS:
        acc, l = _add_sinks(acc, m, l, sinks_ptr, h, 0, G, ROWS, MULTI_Q)
    if KV_FP8:
        acc = acc * v_scale
    _store_rows(out_ptr, stride_ob, stride_oh, q_start, q_len, total_q, h, 0, 0, acc, l, G, ROWS, HEAD_DIM, BLOCK_D,
                MULTI_Q, HEAD_PACK)


@triton.jit
def _segment_rows(q_len, G: tl.constexpr, MULTI_Q: tl.constexpr):
    """Rows of a segment's result: G per query token."""
    if MULTI_Q:
        rows = q_len * G
    else:
        rows = G
    return rows


@triton.jit
def _store_partial(o_part_ptr, lse_part_ptr, slot, q_len, acc, m, l, v_scale,
                   G: tl.constexpr, ROWS: tl.constexpr, SLOT_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, MULTI_Q: tl.constexpr):
    """Rows r < the segment's rows of partial slot ``slot`` (SLOT_ROWS rows of fp32 [HEAD_DIM]):
    o_part = acc / l (times an FP8 cache's V scale; 0 for a row that saw no key), lse_part =
    m + log2(l) (-inf then). Sinks join at the merge."""
    if KV_FP8:
        acc = acc * v_scale
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    base = slot.to(tl.int64) * SLOT_ROWS
    rows = offs_r < tl.minimum(_segment_rows(q_len, G, MULTI_Q), SLOT_ROWS)
    mask = rows[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = acc / tl.where(l == 0, 1.0, l)[:, None]
    tl.store(o_part_ptr + (base + offs_r[:, None]) * HEAD_DIM + offs_d[None, :], o, mask=mask)
    tl.store(lse_part_ptr + base + offs_r, m + tl.log2(l), mask=rows)


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


@triton.jit
def _next_segment(active_req_ptr, num_active, seg_lo, h, k, b, seq_len, next_b, next_seq_len, chunk, next_chunk,
                  chunk_base, q_start, q_len, next_q_start, next_q_len, seg_window, first_tok, n_tiles, window,
                  NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, MULTI_Q: tl.constexpr,
                  DETERMINISTIC: tl.constexpr):
    """The stream walk's step from segment (k-th active request, KV head h) at cost seg_lo to
    the next one: the next KV head of the request, or the next request's first. The next
    request's fields were loaded one request ahead (``next_*``), so the step waits on no load;
    it loads those of the request after (DETERMINISTIC: its chunk length ahead too, the first
    partial slot of the one it enters only now). Returns the walk's state, in the order it
    takes it (chunk fields unchanged without DETERMINISTIC, query fields without MULTI_Q)."""
    seg_lo = seg_lo + n_tiles
    if h == NUM_KV_HEADS - 1:
        h = 0
        k = k + 1
        b = next_b
        seq_len = next_seq_len
        nxt = active_req_ptr + ACTIVE_REQ_FIELDS * (k + 1)
        next_b = tl.load(nxt, mask=k + 1 < num_active, other=0)
        next_seq_len = tl.load(nxt + 1, mask=k + 1 < num_active, other=0)
        if DETERMINISTIC:
            chunk = next_chunk
            next_chunk = tl.load(nxt + 4, mask=k + 1 < num_active, other=1)
            chunk_base = tl.load(nxt - ACTIVE_REQ_FIELDS + 5, mask=k < num_active, other=0)
        if MULTI_Q:
            q_start = next_q_start
            q_len = next_q_len
            next_q_start = tl.load(nxt + 2, mask=k + 1 < num_active, other=0)
            next_q_len = tl.load(nxt + 3, mask=k + 1 < num_active, other=0)
            seg_window = row_window(window, q_len)
        first_tok, n_tiles = window_tiles(seq_len, seg_window, BLOCK_N)
    else:
        h = h + 1
    return (seg_lo, h, k, b, seq_len, next_b, next_seq_len, chunk, next_chunk, chunk_base, q_start, q_len,
            next_q_start, next_q_len, seg_window, first_tok, n_tiles)


@triton.jit
def _store_run(out_ptr, stride_ob, stride_oh, o_part_ptr, lse_part_ptr, sinks_ptr, v_scale, cta, pos, seg_lo, tile,
               n_tiles, chunk, chunk_base, q_start, b, q_len, total_q, h, acc, m, l,
               NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, SLOT_ROWS: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
               MULTI_Q: tl.constexpr, DETERMINISTIC: tl.constexpr, HEAD_PACK: tl.constexpr):
    """Store the (acc [ROWS, BLOCK_D], m [ROWS], l [ROWS]) of a run of segment (b, h) ending at
    its tile ``tile``, walked by CTA ``cta`` from cost ``pos``: whole to out if the run is the
    segment, else as a partial. DETERMINISTIC: the run is a chunk, stored at slot (chunk_base +
    chunk index) * Hkv + h. Otherwise it is the segment's part in this CTA's range, at slot
    2 * cta + 1 if it holds the segment's first tile (cta is its first CTA), else 2 * cta."""
    if DETERMINISTIC:
        whole = n_tiles <= chunk
        slot = (chunk_base + tile // chunk) * NUM_KV_HEADS + h
    else:
        whole = (pos <= seg_lo) & (tile == n_tiles - 1)
        slot = 2 * cta + (seg_lo >= pos).to(tl.int32)
    if whole:
        _store_whole(out_ptr, stride_ob, stride_oh, _query_start(q_start, b, MULTI_Q), q_len, total_q, h,
                     acc, m, l, sinks_ptr, v_scale, G, ROWS, HEAD_DIM, BLOCK_D, HAS_SINKS, KV_FP8, MULTI_Q, HEAD_PACK)
    else:
        _store_partial(o_part_ptr, lse_part_ptr, slot, q_len, acc, m, l, v_scale, G, ROWS, SLOT_ROWS, HEAD_DIM,
                       BLOCK_D, KV_FP8, MULTI_Q)


@triton.jit(do_not_specialize=["stride_pt", "window", "batch_size", "num_pages", "max_q_len", "total_q"])
def decode_stream_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, o_part_ptr, lse_part_ptr, merge_counters_ptr,
    seq_lens_ptr, cu_seqlens_ptr, tree_ptr, page_table_ptr, active_req_ptr, cta_start_ptr, cta_pos_ptr,
    plan_scalars_ptr, sinks_ptr, error_ptr,
    stride_qb, stride_qh, stride_k_slot, stride_k_page, stride_k_head, stride_v_slot, stride_v_page, stride_v_head,
    stride_ob, stride_oh, stride_pt, qk_scale, cap_scale, v_scale, window, batch_size, num_pages, max_q_len, total_q,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, SLOT_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_GAP: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, FUSED_MERGE_PIECES: tl.constexpr, MERGE_ROWS: tl.constexpr,
    EMPTY_SCAN: tl.constexpr, USE_PDL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr, MULTI_Q: tl.constexpr, TREE: tl.constexpr, DETERMINISTIC: tl.constexpr,
    SEGMENT_LOOPS: tl.constexpr, HEAD_PACK: tl.constexpr, PACK_GAP: tl.constexpr,
):
    """Persistent balanced decode: CTA c walks cost range [cta_pos[c], cta_pos[c + 1]) (c * piece
    onwards; in deterministic mode moved up to a chunk boundary).

    Segment (b, h) spans cost [seg_lo, seg_lo + n_tiles), segments in (request, head)
    order with empty requests skipped (``active_req``: batch index, length, first q row,
    q_len); its tile t sits at cost seg_lo + t and holds tokens first_tok + t * BLOCK_N ..
    (``window_tiles``: with a sliding window a segment is only the tiles of the window's
    tokens). The CTA starts in the request the plan wrote to ``cta_start[c]`` and takes one
    cost unit per iteration of a single loop, across segments, so the software pipeline
    keeps the next segment's page-table and K/V loads in flight while one segment ends (a
    loop per segment drained it at every segment: with many short requests that latency,
    not bandwidth, set the time). Each iteration reloads the segment's q rows (L1/L2 hits),
    which keeps every load of the loop a pipelined load.

    SEGMENT_LOOPS: one pipelined loop per run instead (a segment's tiles in this range, or a
    chunk in deterministic mode; ``_attend_tiles``), with the run's q rows loaded once before
    it. Verify rows take it: their q tile is G x q_len rows, whose reload (and, for wgmma
    dots, store to shared memory) every tile, with the walk's loop-carried state, cost more
    than the pipeline drained at each run's end.

    A segment this CTA covers whole is written to ``out``; a cut one goes to partial slot
    2*c + (c is the segment's first CTA). Only the range's first and last segments can be
    cut; one of few pieces is merged by its last piece to arrive (``_arrive_and_merge``),
    one of more pieces by ``merge_stream_kernel``.

    DETERMINISTIC: a segment is walked in chunks (``plan.chunk_tiles``, from its request's own
    length), no CTA range cuts one, and each chunk of a segment of several is stored as a
    partial at slot (chunk_base + chunk) * Hkv + h, every one from a fresh accumulator; the
    merge is ``merge_units_kernel``'s, in chunk order. So a request's result does not depend
    on where the CTA ranges fall, i.e. on the rest of the batch.

    HEAD_PACK > 1: a segment is HEAD_PACK neighbouring KV heads of a request, read as one head
    of HEAD_DIM columns (NUM_KV_HEADS, G and HEAD_DIM count the packs: ``_load_q``); PACK_GAP:
    the cache does not store those heads side by side (``_pack_columns``).
    """
    cta = tl.program_id(0)
    if USE_PDL:
        # Let the merge grid launch now: its programs find their segments while this
        # kernel runs and wait for it to finish before reading partials.
        gdc_launch_dependents()
    num_ctas = tl.num_programs(0)
    piece = tl.load(plan_scalars_ptr)
    num_active = tl.load(plan_scalars_ptr + 2)
    k = tl.load(cta_start_ptr + 4 * cta)
    b = tl.load(cta_start_ptr + 4 * cta + 1)
    seq_len = tl.load(cta_start_ptr + 4 * cta + 2)
    req_lo = tl.load(cta_start_ptr + 4 * cta + 3)
    if DETERMINISTIC:
        pos = tl.load(cta_pos_ptr + cta)
        end = tl.load(cta_pos_ptr + cta + 1)
    else:
        pos = cta * piece
        end = tl.minimum(pos + piece, tl.load(plan_scalars_ptr + 1))
    next_b = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * (k + 1), mask=k + 1 < num_active, other=0)
    next_seq_len = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * (k + 1) + 1, mask=k + 1 < num_active, other=0)
    if DETERMINISTIC:
        chunk = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * k + 4, mask=k < num_active, other=1)
        chunk_base = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * k + 5, mask=k < num_active, other=0)
        next_chunk = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * (k + 1) + 4, mask=k + 1 < num_active, other=1)
        # Tiles left in the chunk being walked (the range starts at a chunk boundary): a
        # countdown, so the loop tests the chunk's end without a division.
        chunk_left = chunk
    else:
        # No chunks: the walk carries these unused.
        chunk = 1
        chunk_base = 0
        next_chunk = 1
    if MULTI_Q:
        q_start = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * k + 2, mask=k < num_active, other=0)
        q_len = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * k + 3, mask=k < num_active, other=0)
        next_q_start = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * (k + 1) + 2, mask=k + 1 < num_active, other=0)
        next_q_len = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * (k + 1) + 3, mask=k + 1 < num_active, other=0)
        if (cta == 0) & (tl.load(plan_scalars_ptr + 4) > total_q):
            tl.atomic_or(error_ptr, QUERY_OUT_OF_RANGE, sem="relaxed")
        seg_window = row_window(window, q_len)
    else:
        # A plain decode row's q row is b (``_query_start``): no second loop-carried copy of it.
        q_start = 0
        q_len = 1
        next_q_start = 0
        next_q_len = 1
        seg_window = window
    # Empty requests (seq_len 0: padded graph rows) are on no CTA's cost range; CTA c
    # writes zeros for requests c, c + C, ... among them. Their lengths are loaded now
    # and looked at after the walk, so the load is off the path to the first tile.
    scan_rows = cta + num_ctas * tl.arange(0, EMPTY_SCAN)
    scan_lens = tl.load(seq_lens_ptr + scan_rows, mask=scan_rows < batch_size, other=1)

    first_tok, n_tiles = window_tiles(seq_len, seg_window, BLOCK_N)
    h = tl.maximum(pos - req_lo, 0) // tl.maximum(n_tiles, 1)
    seg_lo = req_lo + h * n_tiles
    # The first segment is cut at its start if it has tiles before this range.
    first_seg, first_seg_cta, first_seg_pieces = _fused_cut(b, h, seg_lo, n_tiles, piece, NUM_KV_HEADS,
                                                            FUSED_MERGE_PIECES)
    tiles_before = pos - seg_lo
    first_seg = tl.where((pos < end) & (tiles_before > 0), first_seg, -1)
    # Plain decode rows derive a merged segment's q row from its id; verify rows carry it.
    first_q_start = q_start
    first_q_len = q_len

    if SEGMENT_LOOPS:
        # One pipelined loop per run (a segment's tiles in this range; in deterministic mode a
        # chunk), with the run's q rows loaded once before it.
        c = pos
        while c < end:
            if c >= seg_lo + n_tiles:
                (seg_lo, h, k, b, seq_len, next_b, next_seq_len, chunk, next_chunk, chunk_base, q_start, q_len,
                 next_q_start, next_q_len, seg_window, first_tok, n_tiles) = _next_segment(
                    active_req_ptr, num_active, seg_lo, h, k, b, seq_len, next_b, next_seq_len, chunk, next_chunk,
                    chunk_base, q_start, q_len, next_q_start, next_q_len, seg_window, first_tok, n_tiles, window,
                    NUM_KV_HEADS, BLOCK_N, MULTI_Q, DETERMINISTIC)
            tile_begin = c - seg_lo
            run_end = tl.minimum(end - seg_lo, n_tiles)
            if DETERMINISTIC:
                run_end = tl.minimum(run_end, tile_begin + chunk)
            q = _load_q(q_ptr, stride_qb, stride_qh, _query_start(q_start, b, MULTI_Q), q_len, total_q, h, G, ROWS,
                        HEAD_DIM, BLOCK_D, KV_FP8, MULTI_Q, HEAD_PACK)
            tree = _load_tree(tree_ptr, q_start, q_len, total_q, G, ROWS, TREE)
            acc, m, l = _attend_tiles(q, k_ptr, v_ptr, stride_k_slot, stride_k_page, stride_k_head, stride_v_slot,
                                      stride_v_page, stride_v_head, page_table_ptr + b.to(tl.int64) * stride_pt, h,
                                      seq_len, q_len, tree, window, first_tok, tile_begin, run_end, num_pages,
                                      qk_scale, cap_scale, G, ROWS, PAGE_SIZE, PAGE_GAP, HEAD_DIM, BLOCK_D, BLOCK_N,
                                      NUM_STAGES, SOFTCAP, MULTI_Q, TREE, HEAD_PACK, PACK_GAP)
            _store_run(out_ptr, stride_ob, stride_oh, o_part_ptr, lse_part_ptr, sinks_ptr, v_scale, cta, pos, seg_lo,
                       run_end - 1, n_tiles, chunk, chunk_base, q_start, b, q_len, total_q, h, acc, m, l,
                       NUM_KV_HEADS, G, ROWS, SLOT_ROWS, HEAD_DIM, BLOCK_D, HAS_SINKS, KV_FP8, MULTI_Q,
                       DETERMINISTIC, HEAD_PACK)
            c = seg_lo + run_end
    else:
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for c in tl.range(pos, end, num_stages=NUM_STAGES):
            if c >= seg_lo + n_tiles:
                (seg_lo, h, k, b, seq_len, next_b, next_seq_len, chunk, next_chunk, chunk_base, q_start, q_len,
                 next_q_start, next_q_len, seg_window, first_tok, n_tiles) = _next_segment(
                    active_req_ptr, num_active, seg_lo, h, k, b, seq_len, next_b, next_seq_len, chunk, next_chunk,
                    chunk_base, q_start, q_len, next_q_start, next_q_len, seg_window, first_tok, n_tiles, window,
                    NUM_KV_HEADS, BLOCK_N, MULTI_Q, DETERMINISTIC)
                if DETERMINISTIC:
                    chunk_left = chunk
            tile = c - seg_lo
            q = _load_q(q_ptr, stride_qb, stride_qh, _query_start(q_start, b, MULTI_Q), q_len, total_q, h, G, ROWS,
                        HEAD_DIM, BLOCK_D, KV_FP8, MULTI_Q, HEAD_PACK)
            tree = _load_tree(tree_ptr, q_start, q_len, total_q, G, ROWS, TREE)
            m, l, acc = _attend_tile(q, k_ptr + (h * HEAD_PACK).to(tl.int64) * stride_k_head,
                                     v_ptr + (h * HEAD_PACK).to(tl.int64) * stride_v_head, stride_k_slot,
                                     stride_k_page, stride_k_head, stride_v_slot, stride_v_page, stride_v_head,
                                     page_table_ptr + b.to(tl.int64) * stride_pt, None, first_tok + tile * BLOCK_N,
                                     seq_len,
                                     q_len, tree, window, num_pages, qk_scale, cap_scale, m, l, acc, G, ROWS,
                                     PAGE_SIZE, PAGE_GAP, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, MULTI_Q, TREE,
                                     HEAD_PACK, PACK_GAP, LOOP_PER_SEGMENT=False)
            if DETERMINISTIC:
                # The chunk's last tile: store it, fresh accumulator after.
                chunk_left -= 1
                run_ends = (chunk_left == 0) | (tile == n_tiles - 1)
            else:
                # The segment's last tile in this range.
                run_ends = tile == tl.minimum(end - seg_lo, n_tiles) - 1
            if run_ends:
                _store_run(out_ptr, stride_ob, stride_oh, o_part_ptr, lse_part_ptr, sinks_ptr, v_scale, cta, pos,
                           seg_lo, tile, n_tiles, chunk, chunk_base, q_start, b, q_len, total_q, h, acc, m, l,
                           NUM_KV_HEADS, G, ROWS, SLOT_ROWS, HEAD_DIM, BLOCK_D, HAS_SINKS, KV_FP8, MULTI_Q,
                           DETERMINISTIC, HEAD_PACK)
                m = tl.full([ROWS], float("-inf"), tl.float32)
                l = tl.zeros([ROWS], tl.float32)
                acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
                if DETERMINISTIC:
                    chunk_left = chunk
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
                _store_empty_request(out_ptr, stride_ob, stride_oh, cu_seqlens_ptr, cta + num_ctas * i, max_q_len,
                                     total_q, NUM_KV_HEADS, G, ROWS, HEAD_DIM, BLOCK_D, MULTI_Q, HEAD_PACK)
    for r in range(cta + num_ctas * EMPTY_SCAN, batch_size, num_ctas):
        if tl.load(seq_lens_ptr + r) == 0:
            _store_empty_request(out_ptr, stride_ob, stride_oh, cu_seqlens_ptr, r, max_q_len, total_q, NUM_KV_HEADS,
                                 G, ROWS, HEAD_DIM, BLOCK_D, MULTI_Q, HEAD_PACK)
    # The arrivals wait for the walk to end: a merge inside the loop would raise its
    # register pressure past the 128-register cap (spills in the tile loop). Deterministic
    # mode cuts no segment between CTAs (its chunks are merged by merge_units_kernel).
    if not DETERMINISTIC:
        if (first_seg >= 0) | (last_seg >= 0):
            _arrive_and_merge(o_part_ptr, lse_part_ptr, merge_counters_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr,
                              first_seg, first_seg_cta, first_seg_pieces, first_q_start, first_q_len,
                              last_seg, last_seg_cta, last_seg_pieces, q_start, q_len, total_q,
                              NUM_KV_HEADS, G, SLOT_ROWS, HEAD_DIM, BLOCK_D, MERGE_ROWS, HAS_SINKS, MULTI_Q,
                              HEAD_PACK)


@triton.jit
def _store_empty_request(out_ptr, stride_ob, stride_oh, cu_seqlens_ptr, r, max_q_len, total_q,
                         NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, MULTI_Q: tl.constexpr, HEAD_PACK: tl.constexpr):
    """Request r's rows of out = 0: a request of no tokens attends to nothing."""
    zero_acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    zero_l = tl.zeros([ROWS], tl.float32)
    if MULTI_Q:
        q_start, q_len, _ = decode_query_rows(cu_seqlens_ptr, r, r >= 0, 0, max_q_len, MULTI_Q)
    else:
        q_start = r
        q_len = 1
    for h in range(NUM_KV_HEADS):
        _store_rows(out_ptr, stride_ob, stride_oh, q_start, q_len, total_q, h, 0, 0, zero_acc, zero_l, G, ROWS,
                    HEAD_DIM, BLOCK_D, MULTI_Q, HEAD_PACK)


@triton.jit
def _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start, q_len, total_q, h,
                  row0, d0, first, count, slot_a, slot_c, slot_first_extra,
                  G: tl.constexpr, SLOT_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                  COLS: tl.constexpr, BLOCK_P: tl.constexpr, HAS_SINKS: tl.constexpr, MULTI_Q: tl.constexpr,
                  HEAD_PACK: tl.constexpr):
    """Tile rows row0 .. row0 + ROWS - 1 (those of the segment) and columns d0 .. d0 + COLS -
    1 (< HEAD_DIM) of a segment's rows of out = the log-sum-exp merge of partials i = first ..
    first + count - 1 of those rows and columns, stored at slot a*i + c (+extra for i ==
    first), with the rows' sinks (HAS_SINKS).

    A [BLOCK_P partials, ROWS, COLS] tile per step, so a segment cut into many pieces costs
    a few dependent loads, not one per piece; the softmax weights are per (partial, row),
    one exp2 each. The result depends only on the partials (fixed order). Loads bypass L1
    (``.cg``): partials written by other CTAs of the same launch must come from L2.
    """
    offs_p = tl.arange(0, BLOCK_P)
    offs_r = row0 + tl.arange(0, ROWS)
    offs_d = d0 + tl.arange(0, COLS)
    mask_r = offs_r < tl.minimum(_segment_rows(q_len, G, MULTI_Q), SLOT_ROWS)
    mask_d = offs_d < HEAD_DIM
    m = tl.full([ROWS], float("-inf"), tl.float32)
    weight = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, COLS], tl.float32)
    for p0 in range(first, first + count, BLOCK_P):
        i = p0 + offs_p
        slot = (slot_a * i + slot_c + tl.where(i == first, slot_first_extra, 0)).to(tl.int64)
        mask_pr = (i < first + count)[:, None] & mask_r[None, :]
        row_index = slot[:, None] * SLOT_ROWS + offs_r[None, :]
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
        acc, weight = _add_sinks(acc, m, weight, sinks_ptr, h, row0, G, ROWS, MULTI_Q)
    _store_rows(out_ptr, stride_ob, stride_oh, q_start, q_len, total_q, h, row0, d0, acc, weight, G, ROWS, HEAD_DIM,
                COLS, MULTI_Q, HEAD_PACK)


@triton.jit
def _arrive_and_merge(o_part_ptr, lse_part_ptr, merge_counters_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr,
                      first_seg, first_seg_cta, first_seg_pieces, first_q_start, first_q_len,
                      last_seg, last_seg_cta, last_seg_pieces, last_q_start, last_q_len, total_q,
                      NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, SLOT_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, MERGE_ROWS: tl.constexpr, HAS_SINKS: tl.constexpr,
                      MULTI_Q: tl.constexpr, HEAD_PACK: tl.constexpr):
    """Arrive at this CTA's cut segments of few pieces (``first_seg`` / ``last_seg`` =
    b * Hkv + h, or -1 for none, with their requests' first q row and q_len), whose pieces
    it has stored, and merge into ``out`` each one at which it arrives last. A segment's
    pieces run on CTAs seg_cta .. seg_cta + pieces - 1; CTA c's is at slot 2c + (c == seg_cta).

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
    seg_q_start = tl.where(lane == 0, first_q_start, last_q_start)
    seg_q_len = tl.where(lane == 0, first_q_len, last_q_len)
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
            if MULTI_Q:
                q_start = tl.sum(tl.where(mine, seg_q_start, 0), 0)
            else:
                q_start = segment // NUM_KV_HEADS
            _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr,
                          q_start, tl.sum(tl.where(mine, seg_q_len, 0), 0), total_q,
                          segment % NUM_KV_HEADS, 0, 0, tl.sum(tl.where(mine, seg_cta, 0), 0),
                          tl.sum(tl.where(mine, pieces, 0), 0), 2, 0, 1, G, SLOT_ROWS, HEAD_DIM, MERGE_ROWS, BLOCK_D,
                          # One partial per step: a step of several reduces across them through
                          # shared memory, slower here than the extra dependent loads.
                          BLOCK_P=1, HAS_SINKS=HAS_SINKS, MULTI_Q=MULTI_Q, HEAD_PACK=HEAD_PACK)


@triton.jit
def _merge_shares(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start, q_len, total_q, h, t,
                  helpers, first_cta, pieces, G: tl.constexpr, SLOT_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, ROW_GROUP: tl.constexpr, ROW_P: tl.constexpr, CHUNK_D: tl.constexpr,
                  D_CHUNKS: tl.constexpr, CHUNK_P: tl.constexpr, HAS_SINKS: tl.constexpr, MULTI_Q: tl.constexpr,
                  HEAD_PACK: tl.constexpr):
    """Helper t of the ``helpers`` programs of a segment merges its share (``merge_stream_kernel``):
    groups t, t + helpers, ... of ROW_GROUP rows (pieces <= ROW_P), else (row, CHUNK_D columns)
    items so."""
    rows = _segment_rows(q_len, G, MULTI_Q)
    if pieces <= ROW_P:
        for group in range(t, tl.cdiv(rows, ROW_GROUP), helpers):
            _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start, q_len, total_q,
                          h, group * ROW_GROUP, 0, first_cta, pieces, 2, 0, 1, G, SLOT_ROWS, HEAD_DIM, ROW_GROUP,
                          BLOCK_D, ROW_P, HAS_SINKS, MULTI_Q, HEAD_PACK)
    else:
        for item in range(t, rows * D_CHUNKS, helpers):
            _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start, q_len, total_q,
                          h, item // D_CHUNKS, (item % D_CHUNKS) * CHUNK_D, first_cta, pieces, 2, 0, 1, G, SLOT_ROWS,
                          HEAD_DIM, 1, CHUNK_D, CHUNK_P, HAS_SINKS, MULTI_Q, HEAD_PACK)


@triton.jit(do_not_specialize=["window", "total_q"])
def merge_stream_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, active_req_ptr, cta_start_ptr, plan_scalars_ptr, sinks_ptr, stride_ob,
    stride_oh, window, total_q,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, SLOT_ROWS: tl.constexpr, WHOLE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WHOLE_P: tl.constexpr, ROW_GROUP: tl.constexpr,
    ROW_P: tl.constexpr, CHUNK_D: tl.constexpr, D_CHUNKS: tl.constexpr, CHUNK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    FUSED_MERGE_PIECES: tl.constexpr, USE_PDL: tl.constexpr, HAS_SINKS: tl.constexpr, MULTI_Q: tl.constexpr,
    HEAD_PACK: tl.constexpr,
):
    """Grid (C, S). Merges every segment cut into more than FUSED_MERGE_PIECES pieces (fewer
    are merged inside ``decode_stream_kernel``), with the programs of the CTA boundaries
    inside it: a segment of P pieces holds P - 1 boundaries (CTAs first_cta + 1 ..
    first_cta + P - 1 start inside its tiles), each with S programs (S > 1 for verify rows, whose
    segments have G rows per query token), and the t-th of those H = (P - 1) S helpers takes a
    share of the segment's [rows, HEAD_DIM] output sized so that each program takes one or a
    few steps:

    * P <= WHOLE_P (0 when a segment's rows make the step too large): the first one merges
      all rows in one [WHOLE_P, WHOLE_ROWS, BLOCK_D] step;
    * P <= ROW_P: groups t, t + H, ... of ROW_GROUP rows, one [ROW_P, ROW_GROUP, BLOCK_D] step each;
    * more: items t, t + H, ... of the rows * D_CHUNKS (row, CHUNK_D columns) items
      (D_CHUNKS = cdiv(HEAD_DIM, CHUNK_D)), each in cdiv(P, CHUNK_P) [CHUNK_P, 1, CHUNK_D] steps.

    The request at boundary j is the one CTA j starts in (``cta_start[j]``, ``active_req``).
    Plain decode rows' grid (S = 1) fits in one wave once the decode kernel's CTAs leave.

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
    seq_len = tl.load(cta_start_ptr + 4 * j + 2)
    req_lo = tl.load(cta_start_ptr + 4 * j + 3)
    x = j * piece
    if (j > 0) & (k < num_active) & (most_pieces > FUSED_MERGE_PIECES):
        if MULTI_Q:
            q_start = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * k + 2)
            q_len = tl.load(active_req_ptr + ACTIVE_REQ_FIELDS * k + 3)
            _, n_tiles = window_tiles(seq_len, row_window(window, q_len), BLOCK_N)
        else:
            q_start = b
            q_len = 1
            _, n_tiles = window_tiles(seq_len, window, BLOCK_N)
        h = (x - req_lo) // n_tiles
        first_tile = req_lo + h * n_tiles
        first_cta, pieces = _segment_span(first_tile, n_tiles, piece)
        if (first_tile < x) & (x < first_tile + n_tiles) & (pieces > FUSED_MERGE_PIECES):
            if USE_PDL:
                gdc_wait()
            # CTA c stored this segment at slot 2c, or 2c + 1 when c is the first CTA.
            t = j - first_cta - 1 + (pieces - 1) * tl.program_id(1)
            helpers = (pieces - 1) * tl.num_programs(1)
            if WHOLE_P > 0:
                if pieces <= WHOLE_P:
                    if t == 0:
                        _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start,
                                      q_len, total_q, h, 0, 0, first_cta, pieces, 2, 0, 1, G, SLOT_ROWS, HEAD_DIM,
                                      WHOLE_ROWS, BLOCK_D, WHOLE_P, HAS_SINKS, MULTI_Q, HEAD_PACK)
                else:
                    _merge_shares(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start, q_len,
                                  total_q, h, t, helpers, first_cta, pieces, G, SLOT_ROWS, HEAD_DIM, BLOCK_D, ROW_GROUP,
                                  ROW_P, CHUNK_D, D_CHUNKS, CHUNK_P, HAS_SINKS, MULTI_Q, HEAD_PACK)
            else:
                _merge_shares(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start, q_len,
                              total_q, h, t, helpers, first_cta, pieces, G, SLOT_ROWS, HEAD_DIM, BLOCK_D, ROW_GROUP,
                              ROW_P, CHUNK_D, D_CHUNKS, CHUNK_P, HAS_SINKS, MULTI_Q, HEAD_PACK)


@triton.jit(do_not_specialize=["stride_pt", "window", "num_pages", "max_q_len", "total_q"])
def decode_units_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, o_part_ptr, lse_part_ptr,
    seq_lens_ptr, cu_seqlens_ptr, tree_ptr, page_table_ptr, unit_req_ptr, unit_split_ptr, req_splits_ptr,
    req_tiles_per_split_ptr, num_units_ptr, queue_ptr, sinks_ptr, error_ptr,
    stride_qb, stride_qh, stride_k_slot, stride_k_page, stride_k_head, stride_v_slot, stride_v_page, stride_v_head,
    stride_ob, stride_oh, stride_pt, qk_scale, cap_scale, v_scale, window, num_pages, max_q_len, total_q,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, SLOT_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_GAP: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, PERSISTENT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr, MULTI_Q: tl.constexpr, TREE: tl.constexpr,
    HEAD_PACK: tl.constexpr, PACK_GAP: tl.constexpr,
):
    """Unit-queue decode. Unit u = (split j = u // Hkv, head h = u % Hkv); split j is
    split ``unit_split[j]`` of request ``unit_req[j]``.

    PERSISTENT: CTAs pull units from ``queue[0]`` (atomic); the last CTA to leave resets
    both queue words so the next launch (or graph replay) starts from zero.
    Otherwise program u runs unit u, and every request has exactly one split.
    A request with one split writes ``out``; split k of a longer one writes partial
    slot u, which ``merge_units_kernel`` reads back. Query rows: ``decode_query_rows``
    (the planner clamped seq_lens and flagged malformed query ranges).
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
        q_start, q_len, _ = decode_query_rows(cu_seqlens_ptr, b, b >= 0, seq_len, max_q_len, MULTI_Q)
        if MULTI_Q:
            if q_start + q_len > total_q:
                tl.atomic_or(error_ptr, QUERY_OUT_OF_RANGE, sem="relaxed")
            first_tok, n_tiles = window_tiles(seq_len, row_window(window, q_len), BLOCK_N)
        else:
            # A malformed plain row (q_len 0, flagged by the planner) attends to nothing: zeros.
            first_tok, n_tiles = window_tiles(tl.where(q_len > 0, seq_len, 0), window, BLOCK_N)
        # split is 0 whenever num_splits is 1, so tile_begin is 0 there.
        tile_begin = split * tiles_per_split
        tile_end = tl.where(num_splits == 1, n_tiles, tl.minimum(tile_begin + tiles_per_split, n_tiles))
        q = _load_q(q_ptr, stride_qb, stride_qh, q_start, q_len, total_q, h, G, ROWS, HEAD_DIM, BLOCK_D, KV_FP8,
                    MULTI_Q, HEAD_PACK)
        tree = _load_tree(tree_ptr, q_start, q_len, total_q, G, ROWS, TREE)
        acc, m, l = _attend_tiles(
            q, k_ptr, v_ptr, stride_k_slot, stride_k_page, stride_k_head, stride_v_slot, stride_v_page, stride_v_head,
            page_table_ptr + b.to(tl.int64) * stride_pt, h, seq_len, q_len, tree, window, first_tok, tile_begin,
            tile_end, num_pages, qk_scale, cap_scale, G, ROWS, PAGE_SIZE, PAGE_GAP, HEAD_DIM, BLOCK_D, BLOCK_N,
            NUM_STAGES, SOFTCAP, MULTI_Q, TREE, HEAD_PACK, PACK_GAP)
        if num_splits == 1:
            _store_whole(out_ptr, stride_ob, stride_oh, q_start, q_len, total_q, h, acc, m, l, sinks_ptr, v_scale, G,
                         ROWS, HEAD_DIM, BLOCK_D, HAS_SINKS, KV_FP8, MULTI_Q, HEAD_PACK)
        else:
            _store_partial(o_part_ptr, lse_part_ptr, unit, q_len, acc, m, l, v_scale, G, ROWS, SLOT_ROWS, HEAD_DIM,
                           BLOCK_D, KV_FP8, MULTI_Q)
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
def _units_merge_item(item, items, whole_items, list_last, merge_list_ptr, seq_lens_ptr, cu_seqlens_ptr,
                      req_splits_ptr, req_split_base_ptr, max_q_len, NUM_KV_HEADS: tl.constexpr,
                      SLOT_ROWS: tl.constexpr, CHUNK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
                      MULTI_Q: tl.constexpr):
    """What ``merge_units_kernel``'s item ``item`` merges: (whether it is of the whole class,
    KV head, row, first column, first q row, q_len, splits, first split). All its loads are
    masked off past the last item (``items``), where the fields are unused."""
    valid = item < items
    chunk_item = item - whole_items
    is_whole = chunk_item < 0
    seg_row = tl.where(is_whole, item, chunk_item // D_CHUNKS)
    seg = seg_row // SLOT_ROWS
    b = tl.load(merge_list_ptr + tl.where(is_whole, seg // NUM_KV_HEADS, list_last - seg // NUM_KV_HEADS),
                mask=valid, other=0)
    valid = valid & (b >= 0)
    q_start, q_len, _ = decode_query_rows(cu_seqlens_ptr, b, valid, tl.load(seq_lens_ptr + b, mask=valid, other=0),
                                          max_q_len, MULTI_Q)
    num_splits = tl.load(req_splits_ptr + b, mask=valid, other=0)
    base = tl.load(req_split_base_ptr + b, mask=valid, other=0)
    d0 = tl.where(is_whole, 0, (chunk_item % D_CHUNKS) * CHUNK_D)
    return is_whole, seg % NUM_KV_HEADS, seg_row % SLOT_ROWS, d0, q_start, q_len, num_splits, base


@triton.jit(do_not_specialize=["list_last", "max_q_len", "total_q"])
def merge_units_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, seq_lens_ptr, cu_seqlens_ptr, req_splits_ptr, req_split_base_ptr,
    merge_list_ptr, merge_count_ptr, sinks_ptr, stride_ob, stride_oh, list_last, max_q_len, total_q,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, SLOT_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, WHOLE_P: tl.constexpr, CHUNK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    CHUNK_P: tl.constexpr, HAS_SINKS: tl.constexpr, MULTI_Q: tl.constexpr, USE_PDL: tl.constexpr,
    HEAD_PACK: tl.constexpr,
):
    """Persistent grid of small programs: merge the splits of the requests that have more than
    one. Split k of (request b, KV head h) is at partial slot (req_split_base[b] + k) * Hkv + h.
    The planner lists the requests in two classes (``merge_list`` [>= list_last + 1] int32,
    ``merge_count`` [2] int32):

    * requests of 2 .. WHOLE_P splits (``merge_list[0 : merge_count[0]]``): an item is one row
      of a (request, head), all its columns, in one [WHOLE_P, 1, BLOCK_D] step;
    * requests of more (``merge_list[list_last - i]`` for i < merge_count[1]): an item is one
      row and CHUNK_D columns, in cdiv(splits, CHUNK_P) [CHUNK_P, 1, CHUNK_D] steps.

    An item is a short chain of dependent loads (the request, its split range, the partials),
    so the merge's time is the number of items over the items in flight: the programs are
    small (one warp, ``decode_launch.MERGE_UNITS_NUM_WARPS``) so that many are resident, and
    each loads the next item's fields before it merges the current one. The order of every
    reduction is fixed by the splits, never by the item's program. USE_PDL (programmatic
    dependent launch, sm90): the grid is launched while the decode kernel runs; the plan, which
    completed before that kernel started (it is launched in plain stream order), is read at
    once, the partials only after ``gdc_wait``. Rows past the request's own are skipped; a
    batch whose requests all have one split launches programs that find no item."""
    whole_items = tl.load(merge_count_ptr) * (NUM_KV_HEADS * SLOT_ROWS)
    items = whole_items + tl.load(merge_count_ptr + 1) * (NUM_KV_HEADS * SLOT_ROWS * D_CHUNKS)
    item = tl.program_id(0)
    is_whole, h, row, d0, q_start, q_len, num_splits, base = _units_merge_item(
        item, items, whole_items, list_last, merge_list_ptr, seq_lens_ptr, cu_seqlens_ptr, req_splits_ptr,
        req_split_base_ptr, max_q_len, NUM_KV_HEADS, SLOT_ROWS, CHUNK_D, D_CHUNKS, MULTI_Q)
    if USE_PDL:
        gdc_wait()
    while item < items:
        next_item = item + tl.num_programs(0)
        next_fields = _units_merge_item(
            next_item, items, whole_items, list_last, merge_list_ptr, seq_lens_ptr, cu_seqlens_ptr, req_splits_ptr,
            req_split_base_ptr, max_q_len, NUM_KV_HEADS, SLOT_ROWS, CHUNK_D, D_CHUNKS, MULTI_Q)
        if row < _segment_rows(q_len, G, MULTI_Q):
            if is_whole:
                _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start, q_len,
                              total_q, h, row, 0, base, num_splits, NUM_KV_HEADS, h, 0, G, SLOT_ROWS, HEAD_DIM, 1,
                              BLOCK_D, WHOLE_P, HAS_SINKS, MULTI_Q, HEAD_PACK)
            else:
                _merge_to_out(o_part_ptr, lse_part_ptr, out_ptr, stride_ob, stride_oh, sinks_ptr, q_start, q_len,
                              total_q, h, row, d0, base, num_splits, NUM_KV_HEADS, h, 0, G, SLOT_ROWS, HEAD_DIM, 1,
                              CHUNK_D, CHUNK_P, HAS_SINKS, MULTI_Q, HEAD_PACK)
        item = next_item
        is_whole, h, row, d0, q_start, q_len, num_splits, base = next_fields
