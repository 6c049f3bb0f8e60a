"""Thin launchers for the decode, merge and KV-write kernels.

Each launcher sizes the grid, passes strides and compile-time constants, and
launches; it does not validate (``evenkv.DecodeAttention`` and ``evenkv.write_kv``
do) and it allocates nothing.
"""

import functools
from dataclasses import dataclass

import torch
import triton

from evenkv.checks import FP8_KV_DTYPES

from .decode import decode_stream_kernel, decode_units_kernel, merge_stream_kernel, merge_units_kernel
from .kv_write import kv_write_kernel
from .launching import launch_or_compile, score_scales
from .numerics import FP8_Q_PRESCALE

# A merge step's tile: [BLOCK_P partials, query rows, head-dim columns] of MERGE_TILE
# elements, 32 fp32 per thread at MERGE_NUM_WARPS warps. merge_stream_kernel runs one
# program per CTA boundary (one wave) and splits a segment of many pieces into items of one
# row and MERGE_CHUNK_D columns, so up to 128 pieces take one step (docs/tuning.md
# "Decode, the merge").
MERGE_TILE = 4096
MERGE_CHUNK_D = 32
MERGE_NUM_WARPS = 4
# merge_units_kernel runs one-warp programs, MERGE_UNITS_CTAS_PER_SM per SM, on steps of
# MERGE_UNITS_TILE elements (32 fp32 per thread): each item is a chain of dependent loads,
# and small programs keep many in flight (docs/tuning.md "Decode, deterministic mode").
MERGE_UNITS_TILE = 1024
MERGE_UNITS_NUM_WARPS = 1
MERGE_UNITS_CTAS_PER_SM = 32
# merge_stream_kernel merges a segment of at most MERGE_WHOLE_PIECES pieces in one program
# (all rows in one step); one of more pieces has at least that many programs to share it.
# Verify rows' segments (G rows per query token) are shared in groups of rows of up to
# MERGE_WHOLE_PIECES partials a step, by enough programs per CTA boundary that each takes one
# group (``merge_stream_grid``): a program's steps are a chain of dependent L2 round trips.
# merge_units_kernel merges a request of at most that many splits in items of all columns.
# (A [16 pieces, 4 rows, 64] step spilled on sm_80.)
MERGE_WHOLE_PIECES = 8
# The stream kernel merges a segment cut into at most FUSED_MERGE_PIECES pieces itself (its
# last piece to arrive), one partial ([G rows, head_dim]) per step; segments of more pieces
# go to merge_stream_kernel's grid (docs/tuning.md "Decode, the merge").
FUSED_MERGE_PIECES = 4
# The stream kernel loads the lengths of requests c, c + C, ..., c + (EMPTY_SCAN - 1) C at
# its start, in one vector load, to find the empty ones it writes zeros for; rows past
# that (B > EMPTY_SCAN * C) are scanned one by one.
EMPTY_SCAN = 16


@dataclass(frozen=True)
class QueryRows:
    """How a planned batch's decode rows hold their queries, as the decode kernels take it.

    max_q_len: the most query tokens of one row (1: plain decode, q row b; more: speculative
    verify rows, q rows from cu_seqlens_q); slot_rows: rows of one partial slot (G x the most
    query tokens a row of the planning object can have, G counting the query heads of a
    pack); tree: rows carry tree masks; head_pack: KV heads a segment reads as one (plain
    decode rows; ``evenkv.configs.kv_head_pack``): the kernels then see Hkv / head_pack heads
    of head_pack x D columns and G x head_pack query heads each."""

    max_q_len: int
    slot_rows: int
    tree: bool = False
    head_pack: int = 1

    @property
    def multi_q(self) -> bool:
        return self.max_q_len > 1


def tile_rows(group_size: int, max_q_len: int = 1) -> int:
    """Rows of the packed tile: G query heads x the query tokens of a row, for q_len rounded up
    to a power of two (so each bucket of q lengths is one kernel), padded to a power of two and
    to the 16-row MMA minimum."""
    return max(16, triton.next_power_of_2(group_size * triton.next_power_of_2(max_q_len)))


def _shape_constants(num_kv_heads: int, group_size: int, head_dim: int, query: QueryRows) -> dict:
    return dict(NUM_KV_HEADS=num_kv_heads, G=group_size, ROWS=tile_rows(group_size, query.max_q_len),
                SLOT_ROWS=query.slot_rows, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                MULTI_Q=query.multi_q, TREE=query.tree, HEAD_PACK=query.head_pack)


def packed_geometry(q: torch.Tensor, k_cache: torch.Tensor, query: QueryRows) -> tuple[int, int, int]:
    """(KV heads, G, head dim) as the decode kernels walk them: packs of query.head_pack
    neighbouring KV heads of the cache ([num_pages, page_size, Hkv, D]) and q ([*, Hq, D])."""
    num_kv_heads = k_cache.shape[2] // query.head_pack
    return num_kv_heads, q.shape[1] // num_kv_heads, k_cache.shape[3] * query.head_pack


@functools.cache  # built once per shape: launches unpack the dict and never change it
def merge_units_constants(num_kv_heads: int, group_size: int, head_dim: int, query: QueryRows) -> dict:
    """Compile-time constants of ``merge_units_kernel``: its two item shapes, steps of
    MERGE_UNITS_TILE elements: one row of up to WHOLE_P partials, and one row's MERGE_CHUNK_D
    columns of CHUNK_P partials."""
    block_d = triton.next_power_of_2(head_dim)
    chunk_d = min(MERGE_CHUNK_D, block_d)
    return dict(NUM_KV_HEADS=num_kv_heads, G=group_size, SLOT_ROWS=query.slot_rows, HEAD_DIM=head_dim,
                BLOCK_D=block_d, WHOLE_P=max(2, min(MERGE_WHOLE_PIECES, MERGE_UNITS_TILE // block_d)),
                CHUNK_D=chunk_d, D_CHUNKS=triton.cdiv(head_dim, chunk_d), CHUNK_P=MERGE_UNITS_TILE // chunk_d,
                MULTI_Q=query.multi_q, HEAD_PACK=query.head_pack)


def merge_row_group(block_d: int, group_size: int, query: QueryRows) -> int:
    """Rows of one step of merge_stream_kernel's row path: 1 for plain decode rows; for verify
    rows (group_size x query.max_q_len rows a segment at most) as many as a step of
    MERGE_WHOLE_PIECES partials of block_d columns holds."""
    if not query.multi_q:
        return 1
    rows = triton.next_power_of_2(group_size * query.max_q_len)
    return max(1, min(rows, MERGE_TILE // (MERGE_WHOLE_PIECES * block_d)))


def merge_stream_grid(num_ctas: int, group_size: int, head_dim: int, query: QueryRows) -> tuple[int, int]:
    """merge_stream_kernel's grid (C, S): S programs per CTA boundary, so that a segment of the
    fewest pieces it merges (FUSED_MERGE_PIECES + 1, FUSED_MERGE_PIECES boundaries) gives
    each program one group of merge_row_group rows."""
    if not query.multi_q:
        return num_ctas, 1
    row_group = merge_row_group(triton.next_power_of_2(head_dim), group_size, query)
    return num_ctas, triton.cdiv(triton.cdiv(group_size * query.max_q_len, row_group), FUSED_MERGE_PIECES)


@functools.cache  # built once per shape: launches unpack the dict and never change it
def merge_stream_constants(num_kv_heads: int, group_size: int, head_dim: int, config, use_pdl: bool,
                           query: QueryRows, has_sinks: bool = False) -> dict:
    """Compile-time constants of ``merge_stream_kernel``: its three step shapes, each of at most
    MERGE_TILE elements (all of a segment's rows, WHOLE_P = 0 where they do not fit; ROW_GROUP
    rows, one for plain decode rows; one row's MERGE_CHUNK_D columns)."""
    block_d = triton.next_power_of_2(head_dim)
    whole_rows = triton.next_power_of_2(query.slot_rows)
    chunk_d = min(MERGE_CHUNK_D, block_d)
    row_group = merge_row_group(block_d, group_size, query)
    return dict(NUM_KV_HEADS=num_kv_heads, G=group_size, SLOT_ROWS=query.slot_rows, WHOLE_ROWS=whole_rows,
                HEAD_DIM=head_dim, BLOCK_D=block_d, WHOLE_P=min(MERGE_WHOLE_PIECES, MERGE_TILE // (whole_rows * block_d)),
                ROW_GROUP=row_group, ROW_P=MERGE_TILE // (row_group * block_d), CHUNK_D=chunk_d,
                D_CHUNKS=triton.cdiv(head_dim, chunk_d),
                CHUNK_P=MERGE_TILE // chunk_d, BLOCK_N=config.block_n, FUSED_MERGE_PIECES=FUSED_MERGE_PIECES,
                USE_PDL=use_pdl, HAS_SINKS=has_sinks, MULTI_Q=query.multi_q, HEAD_PACK=query.head_pack)


@functools.cache  # built once per shape: launches unpack the dict and never change it
def stream_constants(num_kv_heads: int, group_size: int, head_dim: int, page_size: int, config,
                     use_pdl: bool, query: QueryRows) -> dict:
    """Compile-time constants of ``decode_stream_kernel``. Its own merge takes all of a
    segment's rows (MERGE_ROWS, a partial slot's rows padded to a power of two) of one
    partial per step."""
    return dict(_shape_constants(num_kv_heads, group_size, head_dim, query), PAGE_SIZE=page_size,
                BLOCK_N=config.block_n, NUM_STAGES=config.num_stages, FUSED_MERGE_PIECES=FUSED_MERGE_PIECES,
                MERGE_ROWS=triton.next_power_of_2(query.slot_rows), EMPTY_SCAN=EMPTY_SCAN, USE_PDL=use_pdl,
                SEGMENT_LOOPS=config.segment_loops)


def _strides(q, k_cache, v_cache, out, page_table):
    """q's, the caches' (offset, page, head: the decode kernels address a token as a slot of the
    offset stride, ``decode._token_rows``) and out's strides and the page table's row stride,
    as the decode kernels take them."""
    return (q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(0), k_cache.stride(2), v_cache.stride(1),
            v_cache.stride(0), v_cache.stride(2), out.stride(0), out.stride(1), page_table.stride(0))


def pack_gap(k_cache, v_cache, query: QueryRows) -> bool:
    """Whether a packed segment's KV heads are not stored side by side in a cache (a head
    stride other than the head dim: vLLM's K and V halves, HND pages): the decode kernels'
    PACK_GAP."""
    head_dim = k_cache.shape[3]
    return query.head_pack > 1 and (k_cache.stride(2) != head_dim or v_cache.stride(2) != head_dim)


def page_gap(k_cache, v_cache) -> bool:
    """Whether a cache's pages are not page_size offsets apart (HND pages, the pages of a
    cross-layer allocation): the decode kernels' PAGE_GAP."""
    k_strides, v_strides = k_cache.stride(), v_cache.stride()
    return k_strides[0] != k_cache.shape[1] * k_strides[1] or v_strides[0] != v_cache.shape[1] * v_strides[1]


@dataclass(frozen=True)
class LayerTerms:
    """What a layer adds to plain softmax attention, as the decode launchers take it.

    sm_scale: softmax scale; logit_cap: soft-cap c (None = off); window: sliding window W
    (0 = off); sinks: [Hq] sink logits or None; k_scale, v_scale: an FP8 cache's
    dequantization scales (real = stored * scale; 1.0 otherwise)."""

    sm_scale: float
    logit_cap: float | None = None
    window: int = 0
    sinks: torch.Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def kernel_args(self, q: torch.Tensor, k_cache: torch.Tensor) -> tuple:
        """(sinks pointer, qk_scale, cap_scale, v_scale, window); q stands in for absent sinks.
        Against an FP8 cache the kernels prescale q (``numerics.FP8_Q_PRESCALE``): qk_scale undoes it."""
        k_scale = self.k_scale / FP8_Q_PRESCALE.value if k_cache.dtype in FP8_KV_DTYPES else self.k_scale
        qk_scale, cap_scale = score_scales(self.sm_scale, self.logit_cap, k_scale)
        sinks = self.sinks if self.sinks is not None else q
        return sinks, qk_scale, cap_scale, self.v_scale, self.window

    def constants(self, k_cache: torch.Tensor) -> dict:
        return dict(SOFTCAP=bool(self.logit_cap), HAS_SINKS=self.sinks is not None,
                    KV_FP8=k_cache.dtype in FP8_KV_DTYPES)


def launch_decode_stream(q, k_cache, v_cache, out, o_part, lse_part, merge_counters, seq_lens, cu_seqlens, tree,
                         page_table, schedule, errors, terms: LayerTerms, query: QueryRows, page_size: int, config,
                         use_pdl: bool, deterministic: bool = False, warmup: bool = False):
    """Persistent balanced decode over ``schedule.num_ctas`` CTAs (shapes: see
    ``decode_stream_kernel``; ``schedule`` an ``evenkv.planning.StreamSchedule``; o_part/lse_part
    hold 2 * num_ctas slots of query.slot_rows rows, or a slot per chunk and KV head when
    ``deterministic``; merge_counters [num_ctas] int32 zeros; cu_seqlens [B + 1] and tree
    [total_q] int32). use_pdl: let the next launch (``launch_merge_stream``, or in deterministic
    mode ``launch_merge_units``, with use_pdl) start early (sm90)."""
    num_kv_heads, group, head_dim = packed_geometry(q, k_cache, query)
    sinks, qk_scale, cap_scale, v_scale, window = terms.kernel_args(q, k_cache)
    s = schedule
    return launch_or_compile(
        decode_stream_kernel, (s.num_ctas,), warmup,
        q, k_cache, v_cache, out, o_part, lse_part, merge_counters, seq_lens, cu_seqlens, tree, page_table,
        s.active_req, s.cta_start, s.cta_pos, s.plan_scalars, sinks, errors,
        *_strides(q, k_cache, v_cache, out, page_table), qk_scale, cap_scale, v_scale, window, seq_lens.shape[0],
        k_cache.shape[0], query.max_q_len, q.shape[0],
        **stream_constants(num_kv_heads, group, head_dim, page_size, config, use_pdl, query), **terms.constants(k_cache),
        PAGE_GAP=page_gap(k_cache, v_cache), PACK_GAP=pack_gap(k_cache, v_cache, query), DETERMINISTIC=deterministic,
        num_warps=config.num_warps, maxnreg=config.max_registers)


def launch_merge_stream(o_part, lse_part, out, schedule, terms: LayerTerms, query: QueryRows, num_kv_heads: int,
                        config, use_pdl: bool, warmup: bool = False):
    """Grid (C, S): S programs per CTA boundary of ``schedule`` (see merge_stream_kernel,
    ``merge_stream_grid``); num_kv_heads counts the packs (``packed_geometry``). use_pdl:
    launched as a programmatic dependent of the decode kernel (sm90 only)."""
    pdl = dict(launch_pdl=True) if use_pdl else {}
    sinks = terms.sinks if terms.sinks is not None else out
    s = schedule
    group, head_dim = out.shape[1] // num_kv_heads, out.shape[2] * query.head_pack
    return launch_or_compile(
        merge_stream_kernel, merge_stream_grid(s.num_ctas, group, head_dim, query), warmup,
        o_part, lse_part, out, s.active_req, s.cta_start, s.plan_scalars, sinks, out.stride(0), out.stride(1),
        terms.window, out.shape[0],
        **merge_stream_constants(num_kv_heads, group, head_dim, config, use_pdl, query, terms.sinks is not None),
        num_warps=MERGE_NUM_WARPS, **pdl)


def launch_decode_units(q, k_cache, v_cache, out, o_part, lse_part, seq_lens, cu_seqlens, tree, page_table,
                        unit_req, unit_split, req_splits, req_tiles_per_split, num_units, queue, errors,
                        terms: LayerTerms, query: QueryRows, grid: int, persistent: bool, page_size: int, config,
                        warmup: bool = False):
    """Unit-queue decode: ``grid`` persistent CTAs, or one program per (request, KV head)."""
    num_kv_heads, group, head_dim = packed_geometry(q, k_cache, query)
    sinks, qk_scale, cap_scale, v_scale, window = terms.kernel_args(q, k_cache)
    return launch_or_compile(
        decode_units_kernel, (grid,), warmup,
        q, k_cache, v_cache, out, o_part, lse_part, seq_lens, cu_seqlens, tree, page_table,
        unit_req, unit_split, req_splits, req_tiles_per_split, num_units, queue, sinks, errors,
        *_strides(q, k_cache, v_cache, out, page_table), qk_scale, cap_scale, v_scale, window,
        k_cache.shape[0], query.max_q_len, q.shape[0],
        **_shape_constants(num_kv_heads, group, head_dim, query),
        PAGE_SIZE=page_size, PAGE_GAP=page_gap(k_cache, v_cache), PACK_GAP=pack_gap(k_cache, v_cache, query),
        BLOCK_N=config.block_n, NUM_STAGES=config.num_stages, PERSISTENT=persistent, **terms.constants(k_cache),
        num_warps=config.num_warps, maxnreg=config.max_registers)


def launch_merge_units(o_part, lse_part, out, seq_lens, cu_seqlens, req_splits, req_split_base, merge_list,
                       merge_count, sinks: torch.Tensor | None, query: QueryRows, num_kv_heads: int, grid: int,
                       list_last: int, use_pdl: bool = False, warmup: bool = False):
    """Persistent merge over ``grid`` programs of the requests listed in merge_list [>= list_last
    + 1] int32, merge_count [2] int32 (see ``merge_units_kernel``); sinks [Hq] or None;
    num_kv_heads counts the packs (``packed_geometry``). use_pdl: launched as a programmatic
    dependent of the decode kernel (sm90 only)."""
    group, head_dim = out.shape[1] // num_kv_heads, out.shape[2] * query.head_pack
    pdl = dict(launch_pdl=True) if use_pdl else {}
    return launch_or_compile(
        merge_units_kernel, (grid,), warmup,
        o_part, lse_part, out, seq_lens, cu_seqlens, req_splits, req_split_base, merge_list, merge_count,
        sinks if sinks is not None else out, out.stride(0), out.stride(1), list_last, query.max_q_len, out.shape[0],
        HAS_SINKS=sinks is not None, USE_PDL=use_pdl, num_warps=MERGE_UNITS_NUM_WARPS,
        **merge_units_constants(num_kv_heads, group, head_dim, query), **pdl)


def launch_kv_write(k_cache, v_cache, k_new, v_new, slot_mapping, errors, k_scale: float = 1.0,
                    v_scale: float = 1.0, warmup: bool = False):
    """k_new/v_new [N, Hkv, D] -> caches [num_pages, page_size, Hkv, D] (any strides) at
    slot_mapping [N] (slot = page x page_size + offset; negative = skip; past the cache: skipped
    and flagged in errors [1] int32). An FP8 cache stores new / scale."""
    num_tokens, num_kv_heads, head_dim = k_new.shape
    num_pages, page_size = k_cache.shape[:2]
    return launch_or_compile(
        kv_write_kernel, (num_tokens,), warmup,
        k_new, v_new, k_cache, v_cache, slot_mapping, errors, num_pages * page_size, k_scale, v_scale,
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], PAGE_SIZE=page_size,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=k_cache.dtype in FP8_KV_DTYPES, num_warps=4)


def resident_ctas_per_sm(compiled, device: torch.device) -> int:
    """CTAs of a compiled kernel that fit on one SM at once, from its registers and shared memory.

    Registers are allocated per warp in units of 256; the hardware reserves 1 KiB of
    shared memory per CTA on SM80 and later.
    """
    props = torch.cuda.get_device_properties(device)
    compiled._init_handles()  # loads the binary: its register count is known from then on
    num_warps = compiled.metadata.num_warps
    regs_per_warp = triton.cdiv(max(compiled.n_regs, 1) * 32, 256) * 256
    by_regs = (props.regs_per_multiprocessor // regs_per_warp) // num_warps
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    smem_per_sm = props.shared_memory_per_multiprocessor
    by_smem = smem_per_sm // (compiled.metadata.shared + 1024)
    return max(1, min(by_regs, by_threads, by_smem, 32))
