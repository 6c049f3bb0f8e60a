"""Decode schedules (the plan's typed value) and the GPU planners that fill them.

Policies (docs/design.md, "Decode policies"):

* ``balanced`` -> :class:`StreamSchedule`: stream-K. All (request, KV head) segments
  lie end to end on one cost line (a segment of n tiles costs n); CTA c of
  C walks ``[c * piece, (c + 1) * piece)`` with ``piece = ceil(total / C)``. Balanced by
  construction for any length distribution and any batch size. Filled by one Triton
  prepare kernel (``evenkv.kernels.plan``).
* ``fa3`` -> :class:`UnitSchedule`: FlashAttention-3's dynamic split, re-implemented:
  ``blocks_per_sm = ceil(total_tiles * 1.1 * Hkv / num_sms)``,
  ``splits[b] = clamp(ceil(tiles[b] / blocks_per_sm), 1, max_splits)``, requests
  heaviest first, persistent CTAs pulling (request, split, head) units from an atomic
  counter. No batch-size cap (FA3's one-CTA prepare kernel stops splitting above 992).
  Filled by a few torch ops.
* ``none``: one program per (request, KV head), no split; no schedule tensors.
* ``deterministic=True`` (with ``balanced``) -> :class:`StreamSchedule` on the same cost
  line, with every segment cut into chunks whose size is a function of its request's own
  length: ``max(DETERMINISTIC_MIN_CHUNK_TOKENS, n / DETERMINISTIC_MAX_SPLITS)`` tokens
  (``kernels.plan.chunk_tiles``), and CTA starts moved up to chunk boundaries. Each chunk of
  a segment of several is stored from a fresh accumulator and the chunks are merged in a
  fixed order, so a request's output is bitwise the same whatever else shares the batch,
  while the walk keeps the balanced policy's single pipelined loop (a 256K-token request is
  512 chunks per KV head, so it still fills the GPU in pieces much shorter than a CTA's). The
  chunks are merged by ``decode.merge_units_kernel``, whose two item classes the plan lists
  apart (requests of a few chunks, and of more). The partial workspace holds
  ``deterministic_chunk_capacity`` chunks, sized from the most tokens a batch can hold.

Every planner works on device tensors only (no ``.item()``, no host sync) and writes
into buffers allocated once by ``evenkv.DecodeAttention``, so planning can be
captured in a CUDA graph. Worked example of the FA3 split (Hkv = 1, num_sms = 4,
tiles = [10, 2, 0]): total 12, blocks_per_sm = ceil(12 * 1.1 / 4) = 4, splits =
[3, 1, 1], tiles_per_split = [4, 2, 1]; order (heaviest first) = [0, 1, 2];
units j = 0..4 -> (request, split) = (0,0) (0,1) (0,2) (1,0) (2,0).
"""

from dataclasses import dataclass

import torch

from evenkv.kernels import plan_launch
from evenkv.kernels.decode_launch import QueryRows

from .configs import DecodeConfig, ExtendConfig
from .errors import error_flag

# FA3's "1.1" in blocks_per_sm, as an exact integer ratio so the numpy oracle matches.
FA3_SLACK_NUM, FA3_SLACK_DEN = 11, 10
FA3_MAX_SPLITS = 128
# Batch-invariant chunks: of at least DETERMINISTIC_MIN_CHUNK_TOKENS, at most
# DETERMINISTIC_MAX_SPLITS per request (longer requests get longer chunks). A CTA's range
# moves up to a chunk boundary, so a chunk much shorter than a CTA's piece keeps the grid
# balanced (up to 1M tokens a chunk is at most a quarter of an H200 CTA's piece); a chunk of
# at least a few tiles keeps the partials and their merge small (docs/tuning.md "Decode,
# deterministic mode").
DETERMINISTIC_MIN_CHUNK_TOKENS = 512
DETERMINISTIC_MAX_SPLITS = 512


# plan_scalars of the balanced plan: piece, total, active requests, the most tiles of one
# segment, the end of the last query row.
PLAN_SCALARS = 5


@dataclass(frozen=True)
class StreamSchedule:
    """``balanced`` plan over num_ctas CTAs (``evenkv.kernels.plan.plan_stream_kernel``).

    active_req [B, ACTIVE_REQ_FIELDS] int32: the non-empty requests in order (batch index,
    clamped length, first q row, q_len, deterministic chunk and first chunk); cta_start
    [>= num_ctas, 4] int32 (row c: the request CTA c starts in: its index into active_req,
    batch index, length, cost start; sized for the largest of the object's grids); cta_pos [>=
    num_ctas + 1] int32: where each CTA starts on the cost line (and the total); plan_scalars
    [PLAN_SCALARS] int32 (piece, total, active count, the most tiles of one segment: a sliding
    window counts its own; the end of the last query row). Deterministic mode's merge lists
    (``decode.merge_units_kernel``): req_chunks, req_chunk_base [B] int32 (a request's chunks
    and its first chunk's index), merge_list [B] int32 and merge_count [2] int32 (the
    requests of several chunks, in ``merge_units_kernel``'s two classes)."""

    active_req: torch.Tensor
    cta_start: torch.Tensor
    cta_pos: torch.Tensor
    plan_scalars: torch.Tensor
    req_chunks: torch.Tensor
    req_chunk_base: torch.Tensor
    merge_list: torch.Tensor
    merge_count: torch.Tensor
    num_ctas: int


@dataclass(frozen=True)
class UnitSchedule:
    """``fa3`` plan. Units j < num_units / Hkv in execution order: request unit_req[j],
    split unit_split[j] ([U] int32 each). Per request ([B] int32): req_splits,
    req_tiles_per_split, req_split_base (index of its first split among all splits).
    num_units [1] int32 = Hkv * total splits; merge_list [B + 1] int32 and merge_count [2]
    int32: the requests of more than one split in ``merge_units_kernel``'s two classes (at most
    ``whole_splits`` splits from the front, more from entry B - 1 down; entry B is scratch);
    num_ctas: the persistent grid."""

    unit_req: torch.Tensor
    unit_split: torch.Tensor
    req_splits: torch.Tensor
    req_tiles_per_split: torch.Tensor
    req_split_base: torch.Tensor
    num_units: torch.Tensor
    merge_list: torch.Tensor
    merge_count: torch.Tensor
    num_ctas: int


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """One planned decode batch: what ``DecodeAttention.run`` executes.

    batch_size: B (host int, from the shape of seq_lens).
    seq_lens: [B] int32, the lengths clamped to [0, page_table capacity].
    page_table: [B, max_pages] int32, the caller's tensor (its address is used at run).
    schedule: StreamSchedule (balanced, deterministic or not), UnitSchedule (fa3) or None (none).
    config: the DecodeConfig the batch runs with (``DecodeAttention.launch_config``).
    cu_seqlens_q: [B + 1] int32, the requests' query rows (q row b for plain decode).
    tree_mask: [>= total_q] int32 tree masks, or a [1] placeholder (query.tree says which).
    query: the rows' shape as the kernels take it (``decode_launch.QueryRows``).
    q_len: host int, the most query tokens of one request.
    The schedule lives in the planning object's buffers, so a plan is valid until that
    object plans again; ``run`` refuses an older plan.
    """

    batch_size: int
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    schedule: StreamSchedule | UnitSchedule | None
    config: DecodeConfig
    cu_seqlens_q: torch.Tensor
    tree_mask: torch.Tensor
    query: QueryRows
    q_len: int


def decode_query_lens(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_q_len: int,
                      multi_q: bool, row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_len [B], malformed [B] bool) of decode requests from cu_seqlens_q [B + 1] and clamped
    seq_lens [B], as the kernels clamp them (``kernels.plan.decode_query_rows``): rows of several
    query tokens take q_len in [0, min(max_q_len, seq_len)] (up to max_q_len for padding rows,
    seq_len 0); a plain decode row q row b (q_len 1, or 0 if malformed; row_ids [>= B] holds
    0, 1, ...). GPU ops only."""
    start = cu_seqlens_q[:-1]
    raw = cu_seqlens_q[1:] - start
    if not multi_q:
        at_row = start == row_ids[:start.shape[0]]
        q_lens = (at_row & (raw == 1)).to(raw.dtype)
        return q_lens, ~(at_row & ((raw == 1) | ((raw == 0) & (seq_lens == 0))))
    cap = torch.where(seq_lens > 0, seq_lens.clamp(max=max_q_len), max_q_len)
    q_lens = torch.where(start >= 0, torch.minimum(raw.clamp(min=0), cap), 0)
    return q_lens, (q_lens != raw) | (start < 0)


def visible_keys(seq_lens: torch.Tensor, q_lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B]: the keys a decode row reads as a whole: all of its clamped seq_len, or with a sliding
    window W the last W + q_len - 1 (``kernels.plan.row_window``); none for a row of no query."""
    visible = seq_lens if window is None else torch.minimum(seq_lens, window + q_lens.clamp(min=1) - 1)
    return torch.where(q_lens > 0, visible, 0)


def fa3_unit_capacity(max_batch_size: int, num_sms: int) -> int:
    """Upper bound on the FA3 policy's total splits: sum ceil(n_b / bps) <= total / bps + B,
    and total / bps <= num_sms / (1.1 * Hkv) < num_sms."""
    return max_batch_size + num_sms


def plan_fa3_units(seq_lens: torch.Tensor, sched: UnitSchedule, *, block_n: int, num_kv_heads: int,
                   num_sms: int, whole_splits: int, max_splits: int = FA3_MAX_SPLITS) -> None:
    """Fill ``sched`` (buffers sized for max batch) from clamped ``seq_lens [B] int32``
    with FA3's dynamic split (depends on the batch's total work); whole_splits: the most splits
    ``merge_units_kernel`` merges in items of all head-dim columns."""
    tiles = (seq_lens + (block_n - 1)) // block_n
    total = tiles.sum(dtype=torch.int64)
    per_sm = FA3_SLACK_DEN * num_sms
    blocks_per_sm = torch.clamp((total * (FA3_SLACK_NUM * num_kv_heads) + per_sm - 1) // per_sm, min=1)
    splits = torch.clamp((tiles + blocks_per_sm - 1) // blocks_per_sm, 1, max_splits)
    _fill_units(tiles, splits, sched, num_kv_heads, whole_splits)


def deterministic_chunk_capacity(max_batch_size: int, max_total_tokens: int) -> int:
    """Chunks the deterministic plan can need for a batch of at most max_total_tokens: a
    request of n tokens has at most n / DETERMINISTIC_MIN_CHUNK_TOKENS + 1 chunks."""
    return max_batch_size + -(-max_total_tokens // DETERMINISTIC_MIN_CHUNK_TOKENS)


def _fill_units(tiles: torch.Tensor, splits: torch.Tensor, sched: UnitSchedule, num_kv_heads: int,
                whole_splits: int) -> None:
    """Write the unit list for per-request split counts ``splits`` ([B], >= 1).

    Splits are re-derived from tiles_per_split so that none is empty; an empty request
    gets one split of zero tiles (its unit writes zeros). Requests run heaviest first.
    """
    batch = tiles.shape[0]
    tiles_per_split = torch.where(tiles > 0, (tiles + splits - 1) // splits, 1)
    splits = torch.where(tiles > 0, (tiles + tiles_per_split - 1) // tiles_per_split, 1)
    order = torch.sort(tiles, descending=True, stable=True).indices
    sorted_splits = splits[order]
    split_end = torch.cumsum(sorted_splits, 0, dtype=torch.int32)
    split_begin = split_end - sorted_splits.to(torch.int32)
    sched.req_splits[:batch].copy_(splits)
    sched.req_tiles_per_split[:batch].copy_(tiles_per_split)
    sched.req_split_base[:batch].index_copy_(0, order, split_begin)
    # The requests the merge kernel visits, compacted in request order: those merged whole
    # from the front, the others from the last entry before the scratch one down (the
    # requests of one split write to the scratch entry, which is never read).
    scratch = sched.merge_list.shape[0] - 1
    whole = (splits > 1) & (splits <= whole_splits)
    by_rows = splits > whole_splits
    where = torch.where(whole, torch.cumsum(whole, 0, dtype=torch.int32) - 1, scratch)
    where = torch.where(by_rows, scratch - torch.cumsum(by_rows, 0, dtype=torch.int32), where)
    sched.merge_list.scatter_(0, where.to(torch.int64), torch.arange(batch, device=tiles.device, dtype=torch.int32))
    sched.merge_count.copy_(torch.stack([whole.sum(dtype=torch.int32), by_rows.sum(dtype=torch.int32)]))
    j = torch.arange(sched.unit_req.shape[0], device=tiles.device, dtype=torch.int32)
    rank = torch.searchsorted(split_end, j, right=True).clamp_(max=batch - 1)
    sched.unit_req.copy_(order[rank])
    sched.unit_split.copy_(j - split_begin[rank])
    sched.num_units.copy_(split_end[-1:] * num_kv_heads)


@dataclass(frozen=True)
class ExtendPlan:
    """What ``run_extend`` executes: one batch's request order and block offsets.

    batch_size: B (host int). req_begin: requests [0, req_begin) are skipped (decode
    rows another kernel handles). max_q_len: host upper bound of q lengths.
    cu_seqlens_q [B+1], seq_lens [B], page_table [B, max_pages]: the caller's tensors.
    order [B] int32: requests in execution order (LPT: by decreasing seq_len).
    sorted_start [B] int32: first query-block index of order[r]; non-decreasing from 0.
    errors [1] int32: the device's error flag (``evenkv.errors``).
    """

    batch_size: int
    req_begin: int
    max_q_len: int
    page_size: int
    group_size: int
    schedule: str
    config: ExtendConfig
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    order: torch.Tensor
    sorted_start: torch.Tensor
    errors: torch.Tensor


def plan_extend(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, *, page_size: int,
                group_size: int, max_q_len: int, config: ExtendConfig, schedule: str = "lpt", req_begin: int = 0,
                order: torch.Tensor | None = None, sorted_start: torch.Tensor | None = None) -> ExtendPlan:
    """Order the batch for the extend kernel (one tiny GPU kernel, no host sync).

    Inputs are assumed validated (``extend`` / ``Attention.plan`` do it).
    order / sorted_start: optional preallocated int32 buffers of at least B entries.
    """
    batch = seq_lens.shape[0]
    dev = seq_lens.device
    order = order[:batch] if order is not None else torch.empty(batch, dtype=torch.int32, device=dev)
    sorted_start = (sorted_start[:batch] if sorted_start is not None
                    else torch.empty(batch, dtype=torch.int32, device=dev))
    errors = error_flag(dev)
    if batch > 0:
        plan_launch.launch_extend_plan(cu_seqlens_q, seq_lens, order, sorted_start, errors, req_begin=req_begin,
                                       max_q_len=max_q_len, group_size=group_size, block_m=config.block_m,
                                       lpt=schedule == "lpt")
    return ExtendPlan(batch, req_begin, max_q_len, page_size, group_size, schedule, config, cu_seqlens_q, seq_lens,
                      page_table, order, sorted_start, errors)
