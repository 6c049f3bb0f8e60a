"""numpy oracle of evenkv's schedules, written independently of the GPU planners,
plus a simulator of what each CTA / unit of the decode kernels reads and writes.

The GPU plan must equal ``stream_plan`` / ``fa3_plan`` exactly; the simulator gives
the properties the hypothesis tests check.
"""

import numpy as np

FA3_MAX_SPLITS = 128


def cdiv(a, b):
    return -(-np.asarray(a, dtype=np.int64) // b)


def query_rows(cu_seqlens_q, lens, max_q_len):
    """(first q row, q_len, malformed) of verify rows from cu_seqlens_q [B + 1] and clamped
    lens: q_len clamped to [0, min(max_q_len, len)] (up to max_q_len for len 0), 0 for a row
    starting before row 0; None cu_seqlens_q = plain decode (q row b, one token)."""
    if cu_seqlens_q is None:
        b = np.arange(len(lens), dtype=np.int64)
        return b, np.ones_like(b), np.zeros(len(lens), dtype=bool)
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    start, raw = cu[:-1], cu[1:] - cu[:-1]
    cap = np.where(lens > 0, np.minimum(max_q_len, lens), max_q_len)
    q_len = np.where(start >= 0, np.minimum(np.maximum(raw, 0), cap), 0)
    return start, q_len, (q_len != raw) | (start < 0)


def stream_plan(seq_lens, capacity, num_ctas, num_kv_heads, block_n, cu_seqlens_q=None, max_q_len=1, window=0,
                chunking=None):
    """-> dict(seq_lens, req_cost_start [B+1], active_req [K], cta_start [C, 4], cta_pos [C + 1], piece,
    total, max_tiles, q_start [B], q_len [B], rows_end, malformed, tiles [B]; with chunking: chunk,
    chunks, chunk_base [B], merge_whole, merge_by_rows, overflow).

    cta_start[c] = (k, b, seq_lens[b], req_cost_start[b]) for b = active_req[k], the first
    request whose cost range ends after cta_pos[c] = c * piece; (K, B, 0, total) past the end.
    Verify rows (cu_seqlens_q given) cost the tiles of the keys their tokens see together: all
    of them, or under a window W the last W + q_len - 1; none when q_len is 0. chunking
    (deterministic mode): (min chunk tiles, max chunks, chunk capacity, most chunks merged
    whole); each CTA start moves up to its segment's next chunk boundary (its end at most)."""
    lens = np.clip(np.asarray(seq_lens, dtype=np.int64), 0, capacity)
    q_start, q_len, malformed = query_rows(cu_seqlens_q, lens, max_q_len)
    visible = np.minimum(lens, window + np.maximum(q_len, 1) - 1) if window else lens
    tiles = np.where(q_len > 0, cdiv(visible, block_n), 0)
    cost = tiles * num_kv_heads
    end = np.cumsum(cost)
    total = int(end[-1]) if len(end) else 0
    piece = max(-(-total // num_ctas), 1)
    starts = np.arange(num_ctas, dtype=np.int64) * piece
    active = np.flatnonzero(cost > 0)
    req_cost_start = np.concatenate([end - cost, [total]])
    plan = dict(seq_lens=lens, req_cost_start=req_cost_start, active_req=active, piece=piece, total=total,
                max_tiles=int(tiles.max()) if len(tiles) else 0, q_start=q_start, q_len=q_len,
                rows_end=int(np.max(np.where(q_len > 0, q_start + q_len, 0))) if len(lens) else 0,
                malformed=malformed, tiles=tiles, multi_q=cu_seqlens_q is not None, chunked=chunking is not None)
    starts = np.minimum(starts, total)
    if chunking is not None:
        *chunk_rule, whole_chunks = chunking
        chunk, count, base, overflow = chunks(tiles, *chunk_rule)
        plan.update(chunk=chunk, chunks=count, chunk_base=base, **merge_lists(count, whole_chunks),
                    overflow=overflow)
        for c, s in enumerate(starts):
            b = int(np.sum(end <= s))
            if b < len(lens):
                n = int(tiles[b])
                seg_lo = int(req_cost_start[b]) + (int(s) - int(req_cost_start[b])) // n * n
                starts[c] = seg_lo + min(-(-(int(s) - seg_lo) // int(chunk[b])) * int(chunk[b]), n)
    cta_start = []
    for s in starts:
        k = int(np.sum(end[active] <= s))
        b = int(active[k]) if k < len(active) else len(lens)
        cta_start.append((k, b, int(lens[b]) if b < len(lens) else 0, int(req_cost_start[b])))
    plan.update(cta_start=np.array(cta_start, dtype=np.int64).reshape(num_ctas, 4),
                cta_pos=np.concatenate([starts, [total]]))
    return plan


def fa3_plan(seq_lens, capacity, num_sms, num_kv_heads, block_n, unit_capacity):
    """-> dict(req_splits, req_tiles_per_split, req_split_base, unit_req, unit_split, num_units)."""
    lens = np.clip(np.asarray(seq_lens, dtype=np.int64), 0, capacity)
    tiles = cdiv(lens, block_n)
    total = int(tiles.sum())
    blocks_per_sm = max(-(-(total * 11 * num_kv_heads) // (10 * num_sms)), 1)
    return _unit_plan(tiles, np.clip(cdiv(tiles, blocks_per_sm), 1, FA3_MAX_SPLITS), num_kv_heads)


def chunks(tiles, min_chunk, max_chunks, capacity):
    """Deterministic mode's chunks of segments of ``tiles`` tiles: (chunk [B], chunks [B],
    first chunk [B], overflow). A chunk is max(min_chunk, ceil(tiles / max_chunks)) tiles, a
    function of the request's own length; when the chunks would not fit ``capacity``, chunks of
    at least the batch's tiles / (capacity - B) instead. An empty request has none."""
    tiles = np.asarray(tiles, dtype=np.int64)
    chunk = np.maximum(cdiv(tiles, max_chunks), min_chunk)
    overflow = int(cdiv(tiles, chunk).sum()) > capacity
    if overflow:
        chunk = np.maximum(chunk, -(-int(tiles.sum()) // max(capacity - len(tiles), 1)))
    count = cdiv(tiles, chunk)
    return chunk, count, np.cumsum(count) - count, overflow


def merge_lists(splits, whole_splits):
    """The requests ``merge_units_kernel`` merges, in request order: merge_whole (2 ..
    whole_splits splits) and merge_by_rows (more)."""
    splits = np.asarray(splits)
    return dict(merge_whole=np.flatnonzero((splits > 1) & (splits <= whole_splits)),
                merge_by_rows=np.flatnonzero(splits > whole_splits))


def _unit_plan(tiles, splits, num_kv_heads):
    per_split = np.where(tiles > 0, cdiv(tiles, splits), 1)
    splits = np.where(tiles > 0, cdiv(tiles, per_split), 1)
    order = np.argsort(-tiles, kind="stable")
    base = np.zeros(len(tiles), dtype=np.int64)
    unit_req, unit_split = [], []
    nxt = 0
    for b in order:
        base[b] = nxt
        for k in range(splits[b]):
            unit_req.append(b)
            unit_split.append(k)
        nxt += splits[b]
    return dict(req_splits=splits, req_tiles_per_split=per_split, req_split_base=base,
                unit_req=np.array(unit_req, dtype=np.int64), unit_split=np.array(unit_split, dtype=np.int64),
                num_units=nxt * num_kv_heads)


def simulate_stream(plan, num_ctas, num_kv_heads):
    """Walk each CTA exactly as decode_stream_kernel does.

    Returns (pieces, writes): pieces[c] = list of (b, h, tile_begin, tile_end);
    writes = list of (kind, b, h, slot) with kind 'out' or 'partial'.
    """
    start, cta_start, cta_pos = plan["req_cost_start"], plan["cta_start"], plan["cta_pos"]
    piece, active = plan["piece"], plan["active_req"]
    pieces, writes = [], []
    for c in range(num_ctas):
        pos, end, k = int(cta_pos[c]), int(cta_pos[c + 1]), int(cta_start[c, 0])
        mine = []
        while pos < end:
            b = int(active[k])
            n = int(plan["tiles"][b])
            h = (pos - int(start[b])) // n
            seg_lo = int(start[b]) + h * n
            t0, t1 = max(pos - seg_lo, 0), min(end - seg_lo, n)
            if t1 > t0:
                mine.append((b, h, t0, t1))
                if plan["chunked"]:
                    chunk = int(plan["chunk"][b])
                    for t in range(t0, t1):
                        if (t + 1) % chunk == 0 or t == n - 1:
                            assert t0 <= t - (t % chunk), "a CTA range cut a chunk"
                            writes.append(("out", b, h, None) if n <= chunk else
                                          ("partial", b, h, (int(plan["chunk_base"][b]) + t // chunk) * num_kv_heads + h))
                elif t0 == 0 and t1 == n:
                    writes.append(("out", b, h, None))
                else:
                    first_cta = seg_lo // piece
                    writes.append(("partial", b, h, 2 * c + int(c == first_cta)))
            pos = seg_lo + n
            if h == num_kv_heads - 1:
                k += 1
        pieces.append(mine)
    return pieces, writes


def stream_merge_reads(plan, num_kv_heads):
    """Partial slots of each cut segment, in merge order: {(b, h): [slots]}. Its pieces run
    on CTAs first .. last; CTA c's piece is at slot 2c + (c == first). A chunked
    (deterministic) plan: the segments of several chunks, chunk k at slot (base + k) * Hkv + h
    (``merge_units_kernel``)."""
    reads = {}
    piece = plan["piece"]
    for b, n in enumerate(plan["tiles"].tolist()):
        if n == 0:
            continue
        if plan["chunked"]:
            count, base = int(plan["chunks"][b]), int(plan["chunk_base"][b])
            reads.update({(b, h): [(base + k) * num_kv_heads + h for k in range(count)]
                          for h in range(num_kv_heads) if count > 1})
            continue
        for h in range(num_kv_heads):
            seg_lo = int(plan["req_cost_start"][b]) + h * n
            first, last = seg_lo // piece, (seg_lo + n - 1) // piece
            if last > first:
                reads[(b, h)] = [2 * c + int(c == first) for c in range(first, last + 1)]
    return reads


def stream_fused_merges(reads, fused_pieces):
    """Cut segments the decode kernel merges itself ({(b, h): arrival counter index}): those
    of at most ``fused_pieces`` pieces; the counter is the first CTA's index."""
    return {key: (slots[0] - 1) // 2 for key, slots in reads.items() if len(slots) <= fused_pieces}


def stream_merge_shares(plan, num_ctas, num_kv_heads, fused_pieces, consts, splits=1):
    """What each program (j, s) of merge_stream_kernel's grid (num_ctas, splits) merges (its
    selection and sharing rule, for the step shapes in ``consts``, from
    ``merge_stream_constants``): {(b, h): [(j, s, row, first column, end column)]}; a segment
    has G rows per query token."""
    piece, active, cta_start = plan["piece"], plan["active_req"], plan["cta_start"]
    group, head_dim, row_group = consts["G"], consts["HEAD_DIM"], consts["ROW_GROUP"]
    shares = {}
    if (plan["max_tiles"] - 1 + piece - 1) // piece + 1 <= fused_pieces:  # the kernel's early exit
        return shares
    for j in range(1, num_ctas):
        x, (k, b, _, req_lo) = j * piece, (int(v) for v in cta_start[j])
        if k >= len(active):
            continue
        n = int(plan["tiles"][b])
        rows = group * int(plan["q_len"][b]) if plan["multi_q"] else group
        h = (x - req_lo) // n
        first_tile = req_lo + h * n
        first_cta = first_tile // piece
        pieces = (first_tile + n - 1) // piece - first_cta + 1
        if not (first_tile < x < first_tile + n and pieces > fused_pieces):
            continue
        mine = shares.setdefault((b, h), [])
        helpers = (pieces - 1) * splits
        for s in range(splits):
            t = j - first_cta - 1 + (pieces - 1) * s
            if pieces <= consts["WHOLE_P"]:
                if t == 0:
                    mine += [(j, s, row, 0, head_dim) for row in range(rows)]
            elif pieces <= consts["ROW_P"]:
                mine += [(j, s, row, 0, head_dim) for g in range(t, -(-rows // row_group), helpers)
                         for row in range(g * row_group, min(g * row_group + row_group, rows))]
            else:
                chunk, chunks = consts["CHUNK_D"], consts["D_CHUNKS"]
                mine += [(j, s, item // chunks, item % chunks * chunk, min(item % chunks * chunk + chunk, head_dim))
                         for item in range(t, rows * chunks, helpers)]
    return shares
