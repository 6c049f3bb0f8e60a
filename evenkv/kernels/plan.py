"""Triton planning kernels: the guard of a batch's query rows, the decode stream plan, the page
audit, the extend plan, and the page tables an engine that keeps a token table (SGLang's
req_to_token) needs built each step.

``plan_stream_kernel``, the prepare kernel for the ``balanced`` (stream-K) decode
schedule, writes from device ``seq_lens``, with no host sync and into preallocated buffers:

* ``plan_seq_lens [B] int32``   lengths clamped to [0, capacity] (the page table's
  reach), so the decode kernel can never index past a page-table row; a length that
  needed the clamp sets LENGTH_OUT_OF_RANGE in the error flag;
* ``active_req [B, 4] int32``  the non-empty requests in batch order, each as (batch
  index, clamped length, first q row, q_len): the decode kernel walks this list, so it
  never steps over empty requests one by one, and reads a request's fields in independent
  loads (not a length load that waits for the index load). Query rows come from
  ``cu_seqlens [B + 1]`` (``decode_query_rows``): a speculative-verify row (MULTI_Q) has
  q_len 1..max_q_len tokens; a plain decode row's query is q row b;
* ``cta_start [C, 4] int32``  where CTA c starts walking: the first request whose cost
  range ends after ``c * piece``, as (its index into ``active_req``, its batch index,
  its clamped length, its cost start); (active count, B, 0, total) for a CTA past the
  end. The decode kernel reads these with its other scalars in one round trip instead
  of a chain of three dependent loads;
* ``plan_scalars [5] int32``  (piece, total, number of active requests, the most tiles
  of one request's segment, the end of the last query row) with ``piece = max(ceil(total /
  C), 1)``; the decode kernel checks the last against the rows of q it is given.

Worked example (Hkv = 1, BLOCK_N = 16, C = 4):
seq_lens = [100, 0, 20] -> tiles [7, 0, 2] -> costs [7, 0, 2], total 9, piece 3,
cost starts [0, 7, 7]; active_req = [[0, 100, 0, 1], [2, 20, 2, 1]]; CTA starts at cost 0, 3, 6, 9
-> cta_start = [[0, 0, 100, 0], [0, 0, 100, 0], [0, 0, 100, 0], [2, 3, 0, 9]]
(request 1 is empty and never visited; CTA 3 starts past the end).

Requests lie end to end on one cost line: a request of n tiles costs ``Hkv * n``; its cost
start is the exclusive prefix sum. With a sliding window W (``window`` > 0) a request's
tiles are those of its last min(seq_len, W) tokens, counted from the window's first token
(``window_tiles``): a 128K-token request under a 128-token window costs the tiles of 128
tokens, so windowed layers stay balanced. A verify row of q_len tokens costs the tiles of its
``row_window``: its tile count, like its bytes, does not grow with q_len.

Each program recomputes the (cheap, L2-resident) prefix sum and answers BLOCK_C CTAs
by counting ``req_cost_end <= c * piece`` instead of a serial binary search. Requests end
in batch order, so the ended ones are a prefix: the first request still open is the
count of ended ones, and its length and cost start are read off the same compare tile.
"""

import triton
import triton.language as tl

from .error_bits import (INVARIANCE_LOST, LENGTH_OUT_OF_RANGE, PAGE_OUT_OF_RANGE, QUERY_OUT_OF_RANGE,
                         SEQ_LEN_BELOW_Q_LEN)

# active_req's fields per request: batch index, clamped length, first q row, q_len, and in
# deterministic mode its chunk (tiles) and first chunk.
ACTIVE_REQ_FIELDS = tl.constexpr(6)


@triton.jit
def window_tiles(seq_len, window, BLOCK_N: tl.constexpr):
    """(first visible token, tiles of visible tokens) of a decode row of ``seq_len`` tokens:
    with a sliding window (``window`` W > 0) it sees its last min(seq_len, W) tokens, else all.
    A row of q_len query tokens passes ``row_window(window, q_len)``."""
    visible = tl.where(window > 0, tl.minimum(seq_len, window), seq_len)
    return seq_len - visible, tl.cdiv(visible, BLOCK_N)


@triton.jit
def row_window(window, q_len):
    """The window of keys a decode row of ``q_len`` query tokens reads as a whole: its first
    token sees W keys ending at itself, its last one q_len - 1 more (0 = no window)."""
    return tl.where(window > 0, window + tl.maximum(q_len, 1) - 1, 0)


@triton.jit
def decode_query_rows(cu_seqlens_ptr, offs, mask, seq_len, max_q_len, MULTI_Q: tl.constexpr):
    """(first q row, q_len, whether the query range is malformed) of decode requests ``offs``.

    MULTI_Q (speculative verify): q_len = cu[b + 1] - cu[b], clamped to [0, min(max_q_len,
    seq_len)] (the new tokens are among the keys; a padding row, seq_len 0, keeps up to
    max_q_len rows, which get zeros); a row starting before q row 0 gets q_len 0.
    Plain decode: request b's query is q row b, so cu[b] = b and q_len 1 (or 0 for a padding
    row, seq_len 0); any other range is malformed and gets q_len 0. Either way a malformed
    range is reported, never run as something else."""
    q_start = tl.load(cu_seqlens_ptr + offs, mask=mask, other=0)
    raw = tl.load(cu_seqlens_ptr + offs + 1, mask=mask, other=0) - q_start
    if MULTI_Q:
        cap = tl.where(seq_len > 0, tl.minimum(max_q_len, seq_len), max_q_len)
        q_len = tl.minimum(tl.maximum(raw, 0), cap)
        q_len = tl.where(q_start >= 0, q_len, 0)
        bad = mask & ((q_len != raw) | (q_start < 0))
    else:
        at_row = q_start == offs
        q_len = tl.where(at_row & (raw == 1), 1, 0)
        bad = mask & ~(at_row & ((raw == 1) | ((raw == 0) & (seq_len == 0))))
        q_start = offs
    return q_start.to(tl.int32), q_len.to(tl.int32), bad


@triton.jit
def _request_cost(seq_lens_ptr, cu_seqlens_ptr, offs, batch_size, capacity, window, max_q_len,
                  NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, MULTI_Q: tl.constexpr):
    """(clamped length, cost, in batch, first q row, q_len, how many lengths needed the clamp,
    how many query ranges are malformed) of requests ``offs``. A row with no query token
    (a malformed plain decode row included) costs nothing."""
    mask = offs < batch_size
    # Clamp before narrowing: int64 lengths past 2**31 must not wrap.
    raw = tl.load(seq_lens_ptr + offs, mask=mask, other=0)
    seq_len = tl.minimum(tl.maximum(raw, 0), capacity).to(tl.int32)
    q_start, q_len, bad_q = decode_query_rows(cu_seqlens_ptr, offs, mask, seq_len, max_q_len, MULTI_Q)
    if MULTI_Q:
        _, tiles = window_tiles(seq_len, row_window(window, q_len), BLOCK_N)
    else:
        _, tiles = window_tiles(seq_len, window, BLOCK_N)
    tiles = tl.where(q_len > 0, tiles, 0)
    bad_len = tl.sum(((raw < 0) | (raw > capacity)).to(tl.int32), 0)
    return seq_len, tiles * NUM_KV_HEADS, mask, q_start, q_len, bad_len, tl.sum(bad_q.to(tl.int32), 0)


@triton.jit
def chunk_tiles(tiles, fit, MIN_CHUNK_TILES: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """Deterministic mode's chunk of a segment of ``tiles`` tiles: at least MIN_CHUNK_TILES, at
    most MAX_CHUNKS chunks, a function of the request's own length (``fit`` is 0 unless the
    batch overflows the partial workspace; then a chunk of the batch's total, see
    ``plan_stream_kernel``). Example (MIN 8, MAX 128): 100 tiles -> 8 (13 chunks); 8192 -> 64."""
    return tl.maximum(tl.maximum(tl.cdiv(tiles, MAX_CHUNKS), MIN_CHUNK_TILES), fit)


@triton.jit
def _count_starts(seq_lens_ptr, cu_seqlens_ptr, positions, batch_size, capacity, window, max_q_len, total, fit,
                  NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                  BLOCK_C: tl.constexpr, MULTI_Q: tl.constexpr, MIN_CHUNK_TILES: tl.constexpr,
                  MAX_CHUNKS: tl.constexpr):
    """For each cost-line position in ``positions`` ([BLOCK_C]), the request it falls in (the
    first whose cost range ends after it): (its index among the active requests, batch index,
    clamped length, cost start, tiles of one segment, deterministic chunk). Requests end in
    batch order, so the ended ones are a prefix: the first request still open is the count
    of ended ones, and its fields are read off the same compare tile."""
    offs_b = tl.arange(0, BLOCK_B)
    first_active = tl.zeros([BLOCK_C], tl.int32)
    first_req = tl.zeros([BLOCK_C], tl.int32)
    first_len = tl.zeros([BLOCK_C], tl.int32)
    first_cost_start = tl.zeros([BLOCK_C], tl.int32)
    first_tiles = tl.zeros([BLOCK_C], tl.int32)
    carry = tl.zeros([], tl.int32)
    for start in range(0, batch_size, BLOCK_B):
        offs = start + offs_b
        seq_len, cost, mask, _, _, _, _ = _request_cost(
            seq_lens_ptr, cu_seqlens_ptr, offs, batch_size, capacity, window, max_q_len, NUM_KV_HEADS, BLOCK_N,
            MULTI_Q)
        cost_end = tl.cumsum(cost, 0) + carry
        ended = (cost_end[None, :] <= positions[:, None]) & mask[None, :]
        first_active += tl.sum((ended & (cost > 0)[None, :]).to(tl.int32), 1)
        first_req += tl.sum(ended.to(tl.int32), 1)
        # The first open request is request first_req once every chunk is counted; it
        # is in this chunk iff it is there after this chunk's count.
        is_first = (offs[None, :] == first_req[:, None]) & mask[None, :]
        first_len += tl.sum(tl.where(is_first, seq_len[None, :], 0), 1)
        first_cost_start += tl.sum(tl.where(is_first, (cost_end - cost)[None, :], 0), 1)
        first_tiles += tl.sum(tl.where(is_first, (cost // NUM_KV_HEADS)[None, :], 0), 1)
        carry += tl.sum(cost, 0)
    first_cost_start = tl.where(first_req < batch_size, first_cost_start, total)
    return (first_active, first_req, first_len, first_cost_start, first_tiles,
            chunk_tiles(first_tiles, fit, MIN_CHUNK_TILES, MAX_CHUNKS))


@triton.jit(do_not_specialize=["batch_size", "capacity", "window", "max_q_len", "num_ctas", "chunk_capacity",
                             "list_last"])
def plan_stream_kernel(
    seq_lens_ptr, cu_seqlens_ptr, plan_seq_lens_ptr, active_req_ptr, cta_start_ptr, cta_pos_ptr, plan_scalars_ptr,
    req_chunks_ptr, req_chunk_base_ptr, merge_list_ptr, merge_count_ptr, error_ptr,
    batch_size, capacity, window, max_q_len, num_ctas, chunk_capacity, list_last,
    NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
    MULTI_Q: tl.constexpr, DETERMINISTIC: tl.constexpr, MIN_CHUNK_TILES: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    WHOLE_CHUNKS: tl.constexpr,
):
    """The balanced plan (module docstring). DETERMINISTIC: every segment is cut into chunks of
    ``chunk_tiles`` (a function of its own length), which the decode kernel walks and stores one
    by one, and CTA starts are moved up to the next chunk boundary, so no CTA range cuts a
    chunk: a request's partials, and their merge, are then the same bits whatever else is in
    the batch. Per request it also writes its chunk count and first chunk (``req_chunks``,
    ``req_chunk_base`` [B] int32; a chunk's partial slot is (base + chunk) * Hkv + head) and
    the requests of several chunks for ``decode.merge_units_kernel``, in its two classes:
    those of at most WHOLE_CHUNKS chunks from the front of ``merge_list`` ([list_last + 1]
    int32), the others from entry list_last down, and their counts (``merge_count`` [2]).
    A batch of more chunks than the workspace holds
    (``chunk_capacity``; only where requests share prefix pages) takes larger chunks from its
    total tiles, still correct but no longer invariant: INVARIANCE_LOST is set. ``cta_pos``
    [C + 1] int32: where each CTA starts (and the total)."""
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    total = tl.zeros([], tl.int32)
    max_cost = tl.zeros([], tl.int32)
    clamped = tl.zeros([], tl.int32)
    malformed = tl.zeros([], tl.int32)
    rows_end = tl.zeros([], tl.int32)
    chunks_total = tl.zeros([], tl.int32)
    for start in range(0, batch_size, BLOCK_B):
        _, cost, _, q_start, q_len, bad_len, bad_q = _request_cost(
            seq_lens_ptr, cu_seqlens_ptr, start + offs_b, batch_size, capacity, window, max_q_len, NUM_KV_HEADS,
            BLOCK_N, MULTI_Q)
        total += tl.sum(cost, 0)
        max_cost = tl.maximum(max_cost, tl.max(cost, 0))
        clamped += bad_len
        malformed += bad_q
        rows_end = tl.maximum(rows_end, tl.max(tl.where(q_len > 0, q_start + q_len, 0), 0))
        if DETERMINISTIC:
            tiles = cost // NUM_KV_HEADS
            chunks_total += tl.sum(tl.cdiv(tiles, chunk_tiles(tiles, 0, MIN_CHUNK_TILES, MAX_CHUNKS)), 0)
    piece = tl.maximum(tl.cdiv(total, num_ctas), 1)
    overflow = chunks_total > chunk_capacity
    # Chunks of the batch's total tiles fit the workspace (sum cdiv(n_b, c) <= total / c + B).
    room = tl.maximum(chunk_capacity - batch_size, 1)
    fit = tl.where(overflow, tl.cdiv(total // NUM_KV_HEADS, room), 0)

    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    positions = tl.minimum(offs_c * piece, total)
    writer = pid == 0
    active_carry = tl.zeros([], tl.int32)
    chunk_carry = tl.zeros([], tl.int32)
    whole_carry = tl.zeros([], tl.int32)
    rows_carry = tl.zeros([], tl.int32)
    for start in range(0, batch_size, BLOCK_B):
        offs = start + offs_b
        seq_len, cost, mask, q_start, q_len, _, _ = _request_cost(
            seq_lens_ptr, cu_seqlens_ptr, offs, batch_size, capacity, window, max_q_len, NUM_KV_HEADS, BLOCK_N,
            MULTI_Q)
        tl.store(plan_seq_lens_ptr + offs, seq_len, mask=mask & writer)
        active = cost > 0
        rank = tl.cumsum(active.to(tl.int32), 0) - 1 + active_carry
        row = active_req_ptr + ACTIVE_REQ_FIELDS * rank
        tl.store(row, offs, mask=active & writer)
        tl.store(row + 1, seq_len, mask=active & writer)
        tl.store(row + 2, q_start, mask=active & writer)
        tl.store(row + 3, q_len, mask=active & writer)
        if DETERMINISTIC:
            tiles = cost // NUM_KV_HEADS
            chunk = chunk_tiles(tiles, fit, MIN_CHUNK_TILES, MAX_CHUNKS)
            chunks = tl.cdiv(tiles, chunk)
            chunk_base = tl.cumsum(chunks, 0) - chunks + chunk_carry
            tl.store(row + 4, chunk, mask=active & writer)
            tl.store(row + 5, chunk_base, mask=active & writer)
            tl.store(req_chunks_ptr + offs, chunks, mask=mask & writer)
            tl.store(req_chunk_base_ptr + offs, chunk_base, mask=mask & writer)
            whole = (chunks > 1) & (chunks <= WHOLE_CHUNKS)
            by_rows = chunks > WHOLE_CHUNKS
            whole_rank = tl.cumsum(whole.to(tl.int32), 0) - 1 + whole_carry
            rows_rank = tl.cumsum(by_rows.to(tl.int32), 0) - 1 + rows_carry
            tl.store(merge_list_ptr + whole_rank, offs, mask=whole & writer)
            tl.store(merge_list_ptr + list_last - rows_rank, offs, mask=by_rows & writer)
            chunk_carry += tl.sum(chunks, 0)
            whole_carry += tl.sum(whole.to(tl.int32), 0)
            rows_carry += tl.sum(by_rows.to(tl.int32), 0)
        active_carry += tl.sum(active.to(tl.int32), 0)
    first_active, first_req, first_len, first_cost_start, first_tiles, first_chunk = _count_starts(
        seq_lens_ptr, cu_seqlens_ptr, positions, batch_size, capacity, window, max_q_len, total, fit, NUM_KV_HEADS,
        BLOCK_N, BLOCK_B, BLOCK_C, MULTI_Q, MIN_CHUNK_TILES, MAX_CHUNKS)
    if DETERMINISTIC:
        # Move each start up to its segment's next chunk boundary (the segment's end at most,
        # which is where the next segment starts), then find the request it falls in.
        seg_lo = first_cost_start + (positions - first_cost_start) // tl.maximum(first_tiles, 1) * first_tiles
        inside = tl.cdiv(positions - seg_lo, first_chunk) * first_chunk
        positions = tl.where(first_req < batch_size, seg_lo + tl.minimum(inside, first_tiles), total)
        first_active, first_req, first_len, first_cost_start, _, _ = _count_starts(
            seq_lens_ptr, cu_seqlens_ptr, positions, batch_size, capacity, window, max_q_len, total, fit,
            NUM_KV_HEADS, BLOCK_N, BLOCK_B, BLOCK_C, MULTI_Q, MIN_CHUNK_TILES, MAX_CHUNKS)
    cta_mask = offs_c < num_ctas
    tl.store(cta_start_ptr + 4 * offs_c, first_active, mask=cta_mask)
    tl.store(cta_start_ptr + 4 * offs_c + 1, first_req, mask=cta_mask)
    tl.store(cta_start_ptr + 4 * offs_c + 2, first_len, mask=cta_mask)
    tl.store(cta_start_ptr + 4 * offs_c + 3, first_cost_start, mask=cta_mask)
    tl.store(cta_pos_ptr + offs_c, positions, mask=cta_mask)
    if writer & (clamped > 0):
        tl.atomic_or(error_ptr, LENGTH_OUT_OF_RANGE, sem="relaxed")
    if writer & (malformed > 0):
        tl.atomic_or(error_ptr, QUERY_OUT_OF_RANGE, sem="relaxed")
    if writer & overflow:
        tl.atomic_or(error_ptr, INVARIANCE_LOST, sem="relaxed")
    if writer:
        tl.store(cta_pos_ptr + num_ctas, total)
        tl.store(plan_scalars_ptr, piece)
        tl.store(plan_scalars_ptr + 1, total)
        tl.store(plan_scalars_ptr + 2, active_carry)
        tl.store(plan_scalars_ptr + 3, max_cost // NUM_KV_HEADS)
        tl.store(plan_scalars_ptr + 4, rows_end)
        if DETERMINISTIC:
            tl.store(merge_count_ptr, whole_carry)
            tl.store(merge_count_ptr + 1, rows_carry)


@triton.jit
def _used_entries(seq_lens_ptr, cu_seqlens_ptr, offs, mask, capacity, window, PAGE_SIZE: tl.constexpr):
    """(first entry, number of entries) of requests ``offs``' page-table rows that hold
    their visible tokens (lengths clamped to [0, capacity]; with a window, the keys of
    ``row_window``: the first of its q_len query tokens sees W, the last q_len - 1 more)."""
    lens = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + offs, mask=mask, other=0), 0), capacity).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + offs + 1, mask=mask, other=0) - tl.load(cu_seqlens_ptr + offs, mask=mask,
                                                                             other=0)
    first_tok, _ = window_tiles(lens, row_window(window, tl.minimum(q_len, lens)), 1)
    first = first_tok // PAGE_SIZE
    return first, tl.cdiv(lens, PAGE_SIZE) - first


# The page table may be a slice from any row (an engine prefill kernel's rows): its alignment
# picks no variant, so no slice compiles one after start-up.
@triton.jit(do_not_specialize=["batch_size", "capacity", "window", "stride_pt", "num_pages"],
            do_not_specialize_on_alignment=["page_table_ptr"])
def audit_pages_kernel(
    seq_lens_ptr, cu_seqlens_ptr, page_table_ptr, error_ptr, bad_row_lens_ptr, batch_size, capacity, window,
    stride_pt, num_pages,
    PAGE_SIZE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, ZERO_BAD_ROWS: tl.constexpr,
):
    """Set PAGE_OUT_OF_RANGE if a page-table entry a request uses lies outside [0, num_pages);
    with ZERO_BAD_ROWS also set such a request's entry of ``bad_row_lens [B]`` int32 to 0 (the
    lengths an engine's prefill kernel reads, so that it reads none of that request's pages;
    a buffer apart from ``seq_lens``, which every program reads to find its entries).

    ``cu_seqlens [B + 1]``: the batch's query rows (a request of q_len tokens reads
    ``row_window`` keys under a window). The attention kernels never dereference such an id
    (its tokens' K and V read as zeros); this kernel, run once per plan, is what reports it, so their tile
    loops carry nothing for the check. A request uses the entries of its visible tokens
    (``_used_entries``: with a sliding window, engines may free or reuse the pages before
    it). The used entries of all requests lie end to end; program p of P checks
    entries [p * E, (p + 1) * E), E = ceil(total / P): it finds its first request by counting
    (as ``plan_stream_kernel`` does), then walks requests, BLOCK_E entries per load.
    """
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    total = tl.zeros([], tl.int32)
    for start in range(0, batch_size, BLOCK_B):
        _, entries = _used_entries(seq_lens_ptr, cu_seqlens_ptr, start + offs_b, start + offs_b < batch_size, capacity,
                                   window, PAGE_SIZE)
        total += tl.sum(entries, 0)
    per = tl.cdiv(total, tl.num_programs(0))
    lo = pid * per
    hi = tl.minimum(lo + per, total)
    # The first request whose entries end after lo, and where its entries start.
    req = tl.zeros([], tl.int32)
    req_lo = tl.zeros([], tl.int32)
    carry = tl.zeros([], tl.int32)
    for start in range(0, batch_size, BLOCK_B):
        offs = start + offs_b
        _, entries = _used_entries(seq_lens_ptr, cu_seqlens_ptr, offs, offs < batch_size, capacity, window, PAGE_SIZE)
        ends = tl.cumsum(entries, 0) + carry
        ended = (ends <= lo) & (offs < batch_size)
        req += tl.sum(ended.to(tl.int32), 0)
        req_lo = tl.maximum(req_lo, tl.max(tl.where(ended, ends, 0), 0))
        carry += tl.sum(entries, 0)
    offs_e = tl.arange(0, BLOCK_E)
    bad = tl.zeros([BLOCK_E], tl.int1)
    pos = lo
    while (pos < hi) & (req < batch_size):
        first, n = _used_entries(seq_lens_ptr, cu_seqlens_ptr, req, req < batch_size, capacity, window, PAGE_SIZE)
        row = page_table_ptr + req.to(tl.int64) * stride_pt + first
        stop = tl.minimum(hi, req_lo + n)
        row_bad = tl.zeros([BLOCK_E], tl.int1)
        for e in range(pos - req_lo, stop - req_lo, BLOCK_E):
            entry = e + offs_e
            page = tl.load(row + entry, mask=entry < stop - req_lo, other=0)
            row_bad = row_bad | (page.to(tl.uint32, bitcast=True) >= num_pages)
        bad = bad | row_bad
        if ZERO_BAD_ROWS:
            if tl.max(row_bad.to(tl.int32), 0) > 0:
                tl.store(bad_row_lens_ptr + req, 0)
        pos = stop
        req_lo += n
        req += 1
    if tl.max(bad.to(tl.int32), 0) > 0:
        tl.atomic_or(error_ptr, PAGE_OUT_OF_RANGE, sem="relaxed")


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["num_entries"], do_not_specialize_on_alignment=["cu_seqlens_ptr"])
def guard_query_rows_kernel(cu_seqlens_ptr, cu_out_ptr, error_ptr, num_entries, BLOCK: tl.constexpr):
    """One program: the batch's query rows as every later kernel of the batch reads them.

    cu_seqlens [num_entries] int32/int64 (request b's rows cu[b] .. cu[b + 1] - 1) -> cu_out
    [num_entries] int32: each entry clamped to [-1, 2**31 - 1] (an int64 offset must not wrap into
    a well-formed row) and raised to the largest entry before it, setting QUERY_OUT_OF_RANGE where
    that changed an entry. A range that goes back before an earlier request's end so keeps only
    its rows past that end (none where it ends before it): no request's rows are another's, so a
    malformed range cannot overwrite a well-formed request's output. Example: cu = [0, 5, 10, 3, 8]
    -> [0, 5, 10, 10, 10]: requests 0 and 1 keep rows 0..9, requests 2 and 3 run on none."""
    offs = tl.arange(0, BLOCK)
    carry = tl.full([], -1, tl.int32)
    changed = tl.zeros([BLOCK], tl.int1)
    for start in range(0, num_entries, BLOCK):
        idx = start + offs
        mask = idx < num_entries
        raw = tl.load(cu_seqlens_ptr + idx, mask=mask, other=0).to(tl.int64)
        clamped = tl.minimum(tl.maximum(raw, -1), 2147483647).to(tl.int32)
        # Lanes past num_entries come after every real entry (and only in the last chunk), so
        # they raise none of them.
        rows = tl.maximum(tl.associative_scan(clamped, 0, _running_max), carry)
        tl.store(cu_out_ptr + idx, rows, mask=mask)
        changed = changed | (mask & (rows != raw))
        carry = tl.max(rows, 0)
    if tl.max(changed.to(tl.int32), 0) > 0:
        tl.atomic_or(error_ptr, QUERY_OUT_OF_RANGE, sem="relaxed")


@triton.jit(do_not_specialize=["num_rows", "first_row", "total_rows", "max_q_len", "capacity"],
            do_not_specialize_on_alignment=["cu_seqlens_ptr", "seq_lens_ptr"])
def guard_prefill_rows_kernel(
    cu_seqlens_ptr, seq_lens_ptr, cu_out_ptr, lens_out_ptr, lens_audit_ptr, error_ptr,
    num_rows, first_row, total_rows, max_q_len, capacity,
    BLOCK_B: tl.constexpr,
):
    """One program: the extend rows an engine's prefill kernel runs, bounded so that it reads
    and writes only rows of q and out, entries of the page table and (after the page audit)
    pages of the cache, whatever the batch data says; each bound that changes a value sets its
    bit in the error flag.

    cu_seqlens [E + 1] int32 (the batch's, from the first extend request on; absolute q rows),
    seq_lens [E] int32/int64 -> cu_out [E + 1] int32: rows rebased at ``first_row`` (where the
    caller's q and out views start), clamped to [0, total_rows] and made non-decreasing
    (QUERY_OUT_OF_RANGE where that changed an entry, where the first is not ``first_row``, or
    where a request has more than ``max_q_len`` rows, of which the kernel computes
    ``max_q_len``); lens_out, lens_audit [E] int32: seq_len raised to the request's q_len
    (SEQ_LEN_BELOW_Q_LEN, as evenkv's extend kernel does), or 0 (no keys) past ``capacity``,
    the page table's reach or the prefill's length bound (LENGTH_OUT_OF_RANGE): a request the
    prefill cannot read whole is not run on part of its keys. ``lens_audit`` is the page
    audit's copy to read while it zeroes requests of ``lens_out``."""
    offs = tl.arange(0, BLOCK_B)
    carry = tl.zeros([], tl.int32)
    query_bad = tl.zeros([BLOCK_B], tl.int1)
    below = tl.zeros([BLOCK_B], tl.int1)
    beyond = tl.zeros([BLOCK_B], tl.int1)
    for start in range(0, num_rows + 1, BLOCK_B):
        idx = start + offs
        in_cu = idx <= num_rows
        raw = tl.load(cu_seqlens_ptr + idx, mask=in_cu, other=0).to(tl.int64) - first_row
        clamped = tl.minimum(tl.maximum(raw, 0), total_rows).to(tl.int32)
        begin = tl.maximum(tl.associative_scan(clamped, 0, _running_max), carry)
        tl.store(cu_out_ptr + idx, begin, mask=in_cu)
        query_bad = query_bad | (in_cu & ((begin != raw) | ((idx == 0) & (raw != 0))))
        # A request's end is the next entry of cu_out: the running max one entry further.
        in_req = idx < num_rows
        raw_end = tl.load(cu_seqlens_ptr + idx + 1, mask=in_req, other=0).to(tl.int64) - first_row
        q_len = tl.maximum(begin, tl.minimum(tl.maximum(raw_end, 0), total_rows).to(tl.int32)) - begin
        query_bad = query_bad | (in_req & (q_len > max_q_len))
        raw_len = tl.load(seq_lens_ptr + idx, mask=in_req, other=0)
        raised = tl.maximum(raw_len, q_len)
        lens = tl.where(raised > capacity, 0, raised).to(tl.int32)
        below = below | (in_req & (raw_len < q_len))
        beyond = beyond | (in_req & (raised > capacity))
        tl.store(lens_out_ptr + idx, lens, mask=in_req)
        tl.store(lens_audit_ptr + idx, lens, mask=in_req)
        carry = tl.max(tl.where(in_cu, begin, 0), 0)
    if tl.max(query_bad.to(tl.int32), 0) > 0:
        tl.atomic_or(error_ptr, QUERY_OUT_OF_RANGE, sem="relaxed")
    if tl.max(below.to(tl.int32), 0) > 0:
        tl.atomic_or(error_ptr, SEQ_LEN_BELOW_Q_LEN, sem="relaxed")
    if tl.max(beyond.to(tl.int32), 0) > 0:
        tl.atomic_or(error_ptr, LENGTH_OUT_OF_RANGE, sem="relaxed")


@triton.jit(do_not_specialize=["batch_size", "req_begin", "max_q_len"])
def extend_plan_kernel(
    cu_seqlens_ptr, seq_lens_ptr, order_ptr, sorted_start_ptr, error_ptr,
    batch_size, req_begin, max_q_len,
    G: tl.constexpr, BLOCK_M: tl.constexpr, LPT: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """Order the requests and give each its first query-block index, with no host sync.

    A request's key is its seq_len (LPT) or 0 (request order); requests with no
    blocks (q_len 0, or index < req_begin: rows another kernel handles) get key -1
    and go last. Query lengths are clamped to [0, max_q_len] (the grid's bound) as the
    extend kernel clamps them; one outside sets QUERY_OUT_OF_RANGE. Request i precedes j when key_i > key_j, or the keys tie and i < j.
    Program p ranks requests [p*BLOCK_I, (p+1)*BLOCK_I) by counting predecessors
    (a BLOCK_I x BLOCK_J compare tile per step), and writes
    ``order[rank_i] = i`` and ``sorted_start[rank_i] = sum of predecessors' blocks``.

    Worked example (G = 1, BLOCK_M = 16, LPT): q_lens [40, 0, 10], seq_lens
    [40, 5, 90] -> blocks [3, 0, 1], keys [40, -1, 90] -> order [2, 0, 1],
    sorted_start [0, 1, 4].
    """
    pid = tl.program_id(0)
    offs_i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < batch_size
    key_i, _blocks_i, bad_i = _request_key(cu_seqlens_ptr, seq_lens_ptr, offs_i, mask_i, req_begin, max_q_len, G,
                                           BLOCK_M, LPT)
    if tl.sum(bad_i.to(tl.int32), 0) > 0:
        tl.atomic_or(error_ptr, QUERY_OUT_OF_RANGE, sem="relaxed")
    rank = tl.zeros([BLOCK_I], tl.int32)
    start = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, batch_size, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        mask_j = offs_j < batch_size
        key_j, blocks_j, _bad_j = _request_key(cu_seqlens_ptr, seq_lens_ptr, offs_j, mask_j, req_begin, max_q_len, G,
                                               BLOCK_M, LPT)
        before = (key_j[None, :] > key_i[:, None]) | ((key_j[None, :] == key_i[:, None]) & (offs_j[None, :] < offs_i[:, None]))
        before = before & mask_j[None, :]
        rank += tl.sum(before.to(tl.int32), 1)
        start += tl.sum(tl.where(before, blocks_j[None, :], 0), 1)
    tl.store(order_ptr + rank, offs_i, mask=mask_i)
    tl.store(sorted_start_ptr + rank, start, mask=mask_i)


@triton.jit
def _request_key(cu_seqlens_ptr, seq_lens_ptr, offs, mask, req_begin, max_q_len,
                 G: tl.constexpr, BLOCK_M: tl.constexpr, LPT: tl.constexpr):
    """(key, query blocks, whether the query range needed a clamp) of requests ``offs``."""
    extend = offs >= req_begin
    _, q_len, bad = query_range(cu_seqlens_ptr, offs, mask, max_q_len)
    blocks = tl.where(extend, tl.cdiv(q_len * G, BLOCK_M), 0)
    bad = bad & extend
    if LPT:
        key = tl.load(seq_lens_ptr + offs, mask=mask, other=0).to(tl.int32)
    else:
        key = tl.zeros_like(blocks)
    key = tl.where(blocks > 0, key, -1)
    return key, blocks, bad


@triton.jit
def query_range(cu_seqlens_ptr, b, mask, max_q_len):
    """(first row, q_len, needed a clamp) of requests ``b``, q_len clamped to [0, max_q_len]
    (the plan and the extend kernel count a request's blocks from this q_len)."""
    q_begin = tl.load(cu_seqlens_ptr + b, mask=mask, other=0)
    raw_len = tl.load(cu_seqlens_ptr + b + 1, mask=mask, other=0) - q_begin
    q_len = tl.minimum(tl.maximum(raw_len, 0), max_q_len)
    bad = mask & ((q_len != raw_len) | (q_begin < 0))
    return q_begin, q_len.to(tl.int32), bad


# SGLang's width is the batch's longest request, in pages (up to its context length at page 1),
# so the grid's column blocks are large and the rows' own lengths bound what is written.
@triton.jit(do_not_specialize=["num_table_rows", "table_columns", "stride_table", "width", "stride_out",
                               "mapping_len", "stride_swa_out"])
def page_table_from_tokens_kernel(
    token_table_ptr, row_ids_ptr, seq_lens_ptr, out_ptr, swa_mapping_ptr, swa_out_ptr,
    num_table_rows, table_columns, stride_table, width, stride_out, mapping_len, stride_swa_out,
    PAGE_SIZE: tl.constexpr, SWA: tl.constexpr, BLOCK: tl.constexpr,
):
    """Request b's page ids from its row of a token table (the slot of each of its tokens):
    ``out[b, j] = token_table[row_ids[b], j * PAGE_SIZE] // PAGE_SIZE`` for the
    ``min(ceil(seq_lens[b] / PAGE_SIZE), width)`` entries its length uses, and with
    SWA the same slots through ``swa_mapping`` (a hybrid pool's full -> sliding-window slots)
    into ``swa_out``. Entries past a request's length are not written (no kernel reads them).

    Program (b, i) fills entries [i * BLOCK, (i + 1) * BLOCK) of request b (requests on the
    grid's first dimension, which has no 65535 limit). A row id outside the table, a column
    past it, a negative slot or one outside the mapping gives page id -1, which the page
    audit flags and the attention kernels never dereference: nothing is read
    outside the token table or the mapping, whatever the batch data says."""
    b = tl.program_id(0)
    first = tl.program_id(1) * BLOCK
    # Clamped before the division: a length near the int64 limit must not wrap.
    n = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b).to(tl.int64), 0), width.to(tl.int64) * PAGE_SIZE)
    used = tl.cdiv(n, PAGE_SIZE)
    if first < used:
        cols = first + tl.arange(0, BLOCK)
        mask = cols < used
        row = tl.load(row_ids_ptr + b).to(tl.int64)
        token = cols.to(tl.int64) * PAGE_SIZE
        inside = (row >= 0) & (row < num_table_rows) & (token < table_columns)
        slot = tl.load(token_table_ptr + row * stride_table + token, mask=mask & inside, other=-1).to(tl.int64)
        page = tl.where(slot >= 0, slot // PAGE_SIZE, -1)
        tl.store(out_ptr + b.to(tl.int64) * stride_out + cols, page.to(tl.int32), mask=mask)
        if SWA:
            mapped = tl.load(swa_mapping_ptr + slot, mask=mask & (slot >= 0) & (slot < mapping_len), other=-1)
            swa_page = tl.where(mapped >= 0, mapped // PAGE_SIZE, -1)
            tl.store(swa_out_ptr + b.to(tl.int64) * stride_swa_out + cols, swa_page.to(tl.int32), mask=mask)
