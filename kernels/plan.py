"""Triton prepare kernel for the ``balanced`` (stream-K) decode schedule.

From device ``seq_lens`` it writes, with no host sync and into preallocated buffers:

* ``plan_seq_lens [B] int32``   lengths clamped to [0, capacity] (the page table's
  reach), so the decode kernel can never index past a page-table row;
* ``req_cost_start [B + 1] int32``  exclusive prefix sum of request costs, where a
  request of n tiles costs ``Hkv * (n + SEGMENT_OVERHEAD)`` (0 when n == 0);
* ``active_req [B] int32``  the non-empty requests in batch order (the decode kernel
  walks this list, so it never steps over empty requests one by one);
* ``cta_first_req [C] int32``  for CTA c, the index into ``active_req`` of the first
  request whose cost range ends after ``c * piece``: where CTA c starts walking;
* ``plan_scalars [4] int32``  (piece, total, number of active requests, tiles of the
  longest request) with ``piece = max(ceil(total / C), 1)``.

Worked example (Hkv = 1, BLOCK_N = 16, SEGMENT_OVERHEAD = 1, C = 4):
seq_lens = [100, 0, 20] -> tiles [7, 0, 2] -> costs [8, 0, 3], total 11, piece 3,
req_cost_start = [0, 8, 8, 11]; active_req = [0, 2]; CTA starts at cost 0, 3, 6, 9
-> cta_first_req = [0, 0, 0, 1] (request 1 is empty and never visited).

Each program recomputes the (cheap, L2-resident) prefix sum and answers BLOCK_C CTAs
by counting ``req_cost_end <= c * piece`` instead of a serial binary search.
"""

import triton
import triton.language as tl


@triton.jit
def _request_cost(seq_lens_ptr, offs, batch_size, capacity,
                  NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT_OVERHEAD: tl.constexpr):
    mask = offs < batch_size
    # Clamp before narrowing: int64 lengths past 2**31 must not wrap.
    seq_len = tl.load(seq_lens_ptr + offs, mask=mask, other=0)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), capacity).to(tl.int32)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    cost = tl.where(n_tiles > 0, (n_tiles + SEGMENT_OVERHEAD) * NUM_KV_HEADS, 0)
    return seq_len, cost, mask


@triton.jit
def plan_stream_kernel(
    seq_lens_ptr, plan_seq_lens_ptr, req_cost_start_ptr, active_req_ptr, cta_first_req_ptr, plan_scalars_ptr,
    batch_size, capacity, num_ctas,
    NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT_OVERHEAD: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    total = tl.zeros([], tl.int32)
    max_len = tl.zeros([], tl.int32)
    for start in range(0, batch_size, BLOCK_B):
        seq_len, cost, _ = _request_cost(seq_lens_ptr, start + offs_b, batch_size, capacity,
                                         NUM_KV_HEADS, BLOCK_N, SEGMENT_OVERHEAD)
        total += tl.sum(cost, 0)
        max_len = tl.maximum(max_len, tl.max(seq_len, 0))
    piece = tl.maximum(tl.cdiv(total, num_ctas), 1)

    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    cta_pos = offs_c * piece
    first_req = tl.zeros([BLOCK_C], tl.int32)
    carry = tl.zeros([], tl.int32)
    active_carry = tl.zeros([], tl.int32)
    writer = pid == 0
    for start in range(0, batch_size, BLOCK_B):
        offs = start + offs_b
        seq_len, cost, mask = _request_cost(seq_lens_ptr, offs, batch_size, capacity,
                                            NUM_KV_HEADS, BLOCK_N, SEGMENT_OVERHEAD)
        cost_end = tl.cumsum(cost, 0) + carry
        tl.store(plan_seq_lens_ptr + offs, seq_len, mask=mask & writer)
        tl.store(req_cost_start_ptr + offs, cost_end - cost, mask=mask & writer)
        active = cost > 0
        rank = tl.cumsum(active.to(tl.int32), 0) - 1 + active_carry
        tl.store(active_req_ptr + rank, offs, mask=active & writer)
        ended = (cost_end[None, :] <= cta_pos[:, None]) & active[None, :]
        first_req += tl.sum(ended.to(tl.int32), 1)
        carry += tl.sum(cost, 0)
        active_carry += tl.sum(active.to(tl.int32), 0)
    tl.store(cta_first_req_ptr + offs_c, first_req, mask=offs_c < num_ctas)
    if writer:
        tl.store(req_cost_start_ptr + batch_size, total)
        tl.store(plan_scalars_ptr, piece)
        tl.store(plan_scalars_ptr + 1, total)
        tl.store(plan_scalars_ptr + 2, active_carry)
        tl.store(plan_scalars_ptr + 3, tl.cdiv(max_len, BLOCK_N))
