"""Thin launchers for the planning kernels (``evenkv.kernels.plan``): the guard of a batch's
query rows, the balanced decode plan, the page audit, the guard of an engine prefill kernel's
rows, the extend plan and the page tables built from a token table.

Each launcher sizes the grid, passes compile-time constants and launches; it does not
validate and it allocates nothing.
"""

import triton

from .launching import launch_or_compile
from .plan import (audit_pages_kernel, extend_plan_kernel, guard_prefill_rows_kernel, guard_query_rows_kernel,
                   page_table_from_tokens_kernel, plan_stream_kernel)

# The prepare kernel scans the batch in chunks of up to PLAN_MAX_BLOCK_B requests (one
# chunk per pass keeps the plan at two load latencies up to B = 2048); each program answers
# a few CTAs with a [CTAs, chunk] compare tile of at most PLAN_COMPARE_TILE elements, about
# one program per SM (docs/tuning.md "Decode, the plan kernel").
PLAN_MAX_BLOCK_B = 2048
PLAN_COMPARE_TILE = 16384
# Batches of up to PLAN_SMALL_BLOCK_B requests scan one small chunk; larger ones the chunk of
# the object's largest batch. Two compiled variants per plan kernel, not one per power of two:
# each variant is a compile at engine start-up, and a plan runs once per step, not per layer.
PLAN_SMALL_BLOCK_B = 128
# The plan kernel ranks PLAN_BLOCK_I requests per program against PLAN_BLOCK_J at a
# time (a [64, 128] compare tile per step).
PLAN_BLOCK_I = 64
PLAN_BLOCK_J = 128


def plan_block_b(batch_size: int, max_batch_size: int) -> int:
    """The plan and audit kernels' batch chunk: PLAN_SMALL_BLOCK_B for a batch of at most that
    many requests, else max_batch_size rounded up to a power of two (at most PLAN_MAX_BLOCK_B)."""
    if batch_size <= PLAN_SMALL_BLOCK_B:
        return PLAN_SMALL_BLOCK_B
    return min(max(triton.next_power_of_2(max_batch_size), PLAN_SMALL_BLOCK_B), PLAN_MAX_BLOCK_B)


def plan_block_buckets(max_batch_size: int) -> list[int]:
    """Every ``plan_block_b`` a batch of 1 .. max_batch_size requests can take."""
    return sorted({plan_block_b(1, max_batch_size), plan_block_b(max_batch_size, max_batch_size)})


def launch_plan_stream(seq_lens, cu_seqlens, plan_seq_lens, schedule, errors, capacity: int, window: int,
                       max_q_len: int, multi_q: bool, num_sms: int, num_kv_heads: int, block_n: int,
                       max_batch_size: int, compare_ctas: int, chunking: tuple | None = None,
                       warmup: bool = False):
    """seq_lens [B] int32/int64, cu_seqlens [B + 1] int32 -> ``schedule``'s buffers (a
    ``evenkv.planning.StreamSchedule``; see ``evenkv.kernels.plan``); errors [1] int32; window:
    sliding window W, 0 for none; max_q_len: the most query tokens of a row; multi_q: rows of
    several query tokens; chunking: deterministic mode's (min chunk tiles, max chunks, chunk
    capacity, most chunks merged whole), or None.

    The chunk is ``plan_block_b(B, max_batch_size)``: batch sizes share two compiled variants,
    both built at start-up (``Attention.warmup``). Each program answers
    ceil(compare_ctas / num_sms) CTAs (rounded up to a power of two), fewer if the compare
    tile would pass PLAN_COMPARE_TILE elements. compare_ctas: the caller's main grid, the same
    for all its plans, so that the grid C (not specialized) picks no variant: plans of its
    other grids (the many-segments row, verify buckets) share the compiled kernel."""
    s, num_ctas = schedule, schedule.num_ctas
    block_b = plan_block_b(seq_lens.shape[0], max_batch_size)
    block_c = min(triton.next_power_of_2(triton.cdiv(compare_ctas, num_sms)), PLAN_COMPARE_TILE // block_b)
    min_chunk, max_chunks, chunk_capacity, whole_chunks = chunking or (1, 1, 0, 0)
    return launch_or_compile(
        plan_stream_kernel, (triton.cdiv(num_ctas, block_c),), warmup,
        seq_lens, cu_seqlens, plan_seq_lens, s.active_req, s.cta_start, s.cta_pos, s.plan_scalars, s.req_chunks,
        s.req_chunk_base, s.merge_list, s.merge_count, errors, seq_lens.shape[0], capacity, window, max_q_len, num_ctas,
        chunk_capacity, max_batch_size - 1,
        NUM_KV_HEADS=num_kv_heads, BLOCK_N=block_n, BLOCK_B=block_b, BLOCK_C=block_c, MULTI_Q=multi_q,
        DETERMINISTIC=chunking is not None, MIN_CHUNK_TILES=min_chunk, MAX_CHUNKS=max_chunks,
        WHOLE_CHUNKS=whole_chunks,
        num_warps=8 if block_b >= 1024 else 4)


# The page audit checks the used entries in loads of AUDIT_BLOCK_E.
AUDIT_BLOCK_E = 256


def launch_audit_pages(seq_lens, cu_seqlens, page_table, errors, num_pages: int, page_size: int, grid: int,
                       max_batch_size: int, window: int = 0, bad_row_lens=None, warmup: bool = False):
    """seq_lens [B] int32/int64, cu_seqlens [B + 1] int32/int64 (the batch's query rows), page_table
    [B, max_pages] int32 -> PAGE_OUT_OF_RANGE in errors [1] int32 if a used entry (with a window
    ``window`` > 0, of the keys its rows see) lies outside [0, num_pages), and such a request's
    entry of ``bad_row_lens`` [B] int32 set to 0 where it is given (see ``audit_pages_kernel``).
    max_batch_size: the caller's largest batch (the chunk, as ``launch_plan_stream``'s)."""
    zero = bad_row_lens is not None
    return launch_or_compile(
        audit_pages_kernel, (grid,), warmup,
        seq_lens, cu_seqlens, page_table, errors, bad_row_lens if zero else errors, seq_lens.shape[0],
        page_table.shape[1] * page_size, window, page_table.stride(0), num_pages, PAGE_SIZE=page_size,
        BLOCK_B=plan_block_b(seq_lens.shape[0], max_batch_size), BLOCK_E=AUDIT_BLOCK_E, ZERO_BAD_ROWS=zero,
        num_warps=4)


# The query-row guard scans cu_seqlens in chunks of GUARD_BLOCK entries (8 per thread): one
# pass up to B = 1023 requests, three at 2048; one compiled variant per index dtype.
GUARD_BLOCK = 1024


def launch_guard_query_rows(cu_seqlens, cu_out, errors, warmup: bool = False):
    """cu_seqlens [B + 1] int32/int64 -> cu_out [B + 1] int32, non-decreasing (see
    ``guard_query_rows_kernel``); errors [1] int32. One program."""
    return launch_or_compile(
        guard_query_rows_kernel, (1,), warmup, cu_seqlens, cu_out, errors, cu_seqlens.shape[0], BLOCK=GUARD_BLOCK,
        num_warps=4)


def launch_guard_prefill_rows(cu_seqlens, seq_lens, cu_out, lens_out, lens_audit, errors, *, first_row: int,
                              total_rows: int, max_q_len: int, capacity: int, warmup: bool = False):
    """cu_seqlens [E + 1] int32, seq_lens [E] int32/int64 -> cu_out [E + 1], lens_out [E], lens_audit
    [E] int32 (see ``guard_prefill_rows_kernel``); errors [1] int32. One program, scanning the rows
    in chunks of PLAN_SMALL_BLOCK_B at any E: one compiled variant per length dtype."""
    return launch_or_compile(
        guard_prefill_rows_kernel, (1,), warmup,
        cu_seqlens, seq_lens, cu_out, lens_out, lens_audit, errors, seq_lens.shape[0], first_row, total_rows,
        max_q_len, capacity, BLOCK_B=PLAN_SMALL_BLOCK_B, num_warps=4)


def launch_extend_plan(cu_seqlens_q, seq_lens, order, sorted_start, errors, *, req_begin: int, max_q_len: int,
                       group_size: int, block_m: int, lpt: bool, warmup: bool = False):
    """cu_seqlens_q [B+1], seq_lens [B] -> order [B] int32, sorted_start [B] int32 (see the
    kernel); errors [1] int32."""
    batch = seq_lens.shape[0]
    return launch_or_compile(
        extend_plan_kernel, (max(triton.cdiv(batch, PLAN_BLOCK_I), 1),), warmup,
        cu_seqlens_q, seq_lens, order, sorted_start, errors, batch, req_begin, max_q_len,
        G=group_size, BLOCK_M=block_m, LPT=lpt, BLOCK_I=PLAN_BLOCK_I, BLOCK_J=PLAN_BLOCK_J, num_warps=4)


# Page-table entries per program of the token-table gather (32 per thread at 4 warps).
PAGE_TABLE_BLOCK = 4096


def launch_page_tables(token_table, row_ids, seq_lens, out, *, page_size: int, swa_mapping=None, swa_out=None,
                       warmup: bool = False):
    """token_table [rows, columns] int32 (slot of each token of a request row), row_ids [B] and
    seq_lens [B] int64 -> out [B, width] int32 page ids of the entries each request's
    seq_len tokens use; with swa_mapping [slots] int64, those slots mapped into
    swa_out [B, width] int32 too (see ``page_table_from_tokens_kernel``). B >= 1."""
    batch, width = out.shape
    swa = swa_mapping is not None
    return launch_or_compile(
        page_table_from_tokens_kernel, (batch, max(triton.cdiv(width, PAGE_TABLE_BLOCK), 1)), warmup,
        token_table, row_ids, seq_lens, out, swa_mapping if swa else token_table, swa_out if swa else out,
        token_table.shape[0], token_table.shape[1], token_table.stride(0), width, out.stride(0),
        swa_mapping.shape[0] if swa else 0, swa_out.stride(0) if swa else 0,
        PAGE_SIZE=page_size, SWA=swa, BLOCK=PAGE_TABLE_BLOCK, num_warps=4)
