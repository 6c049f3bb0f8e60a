"""Extend / prefill attention (evenkv.extend) and mixed batches (evenkv.Attention).

CPU lane (default): Triton interpreter, tiny shapes. Tolerance rule:
max|out - ref32| <= 2 * max|torch_lowp - ref32| + floor(dtype), where torch_lowp is
extend_reference computed in the low dtype.
GPU lane (``pytest -m gpu``): prompts up to 32K tokens on prefixes up to 32K, bf16.

Caches are poisoned: slots a request does not own, slots past its seq_len and (SGLang
layout) the slots of its new tokens hold NaN, and page-table entries past a request's
pages hold an out-of-range page id, so reading anything the contract excludes shows.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenkv import Attention, ExtendConfig, errors, extend
from evenkv.kernels import extend_launch, plan_launch
from evenkv.kernels.reference import decode_reference, extend_reference, kv_write_reference
from evenkv.testing import GARBAGE_PAGE
from helpers import TOLERANCE_FLOOR, aot_compile

# Small tiles so tiny batches still span several query blocks and KV tiles (and so
# exercise the masked/unmasked tile split); the table's own configs run too.
SMALL = ExtendConfig("test-m16-n16", block_m=16, block_n=16, num_warps=4, num_stages=2)
SMALL32 = ExtendConfig("test-m32-n16", block_m=32, block_n=16, num_warps=4, num_stages=2)


def make_batch(q_lens, prefixes, hq, hkv, d, page_size, dtype, device, *, new_layout=False, seed=0, scale=1.0):
    """A varlen extend batch with pages in random order.

    Returns dict(q [T, Hq, D], k_cache/v_cache [num_slots, Hkv, D], cu_seqlens_q [B+1] int32,
    seq_lens [B] int32, page_table [B, max_pages] int32, k_new/v_new [T, Hkv, D] or None,
    max_q_len). new_layout (SGLang): the cache slots of the new tokens hold NaN and
    k_new/v_new carry them; otherwise (vLLM) the cache holds every token.
    """
    gen = torch.Generator().manual_seed(seed)
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    pages = [math.ceil(s / page_size) for s in seq]
    num_pages = sum(pages) + 3
    perm = torch.randperm(num_pages, generator=gen)
    page_table = torch.full((len(seq), max([1] + pages) + 1), GARBAGE_PAGE, dtype=torch.int32)
    nan = float("nan")
    k_cache = torch.full((num_pages * page_size, hkv, d), nan)
    v_cache = torch.full((num_pages * page_size, hkv, d), nan)
    used = 0
    for b, n in enumerate(pages):
        page_table[b, :n] = perm[used:used + n].int()
        used += n
        valid = prefixes[b] if new_layout else seq[b]
        tok = torch.arange(valid)
        slots = page_table[b, tok // page_size].long() * page_size + tok % page_size
        k_cache[slots] = torch.randn(valid, hkv, d, generator=gen)
        v_cache[slots] = torch.randn(valid, hkv, d, generator=gen)
    total_q = sum(q_lens)
    q = torch.randn(total_q, hq, d, generator=gen) * scale
    k_new = v_new = None
    if new_layout:
        k_new = torch.randn(total_q, hkv, d, generator=gen).to(dtype).to(device)
        v_new = torch.randn(total_q, hkv, d, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32)
    return dict(q=q.to(dtype).to(device), k_cache=k_cache.to(dtype).to(device), v_cache=v_cache.to(dtype).to(device),
                cu_seqlens_q=cu.to(device), seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
                page_table=page_table.to(device), k_new=k_new, v_new=v_new, max_q_len=max([0] + list(q_lens)))


def reference_pair(batch, page_size, **kw):
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_seqlens_q"], batch["seq_lens"],
            batch["page_table"], page_size)
    extra = dict(k_new=batch["k_new"], v_new=batch["v_new"], **kw)
    ref = extend_reference(*args, **extra)
    lowp = extend_reference(*args, compute_dtype=batch["q"].dtype, **extra)
    return ref, lowp


def assert_tolerance(out, ref, lowp, dtype, rows=None):
    """max|out - ref32| <= 2 * max|torch_lowp - ref32| + floor, over `rows` (default: all)."""
    if rows is not None:
        out, ref, lowp = out[rows], ref[rows], lowp[rows]
    assert torch.isfinite(out).all(), "non-finite values in the output"
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    base = (lowp.float() - ref).abs().max().item() if out.numel() else 0.0
    bound = 2 * base + TOLERANCE_FLOOR[dtype]
    assert err <= bound, f"max abs error {err:.3e} > bound {bound:.3e} (torch {dtype} error {base:.3e})"


def run_extend(batch, page_size, **kw):
    return extend(batch["q"], batch["k_cache"], batch["v_cache"], cu_seqlens_q=batch["cu_seqlens_q"],
                  seq_lens=batch["seq_lens"], page_table=batch["page_table"], page_size=page_size,
                  max_q_len=batch["max_q_len"], k_new=batch["k_new"], v_new=batch["v_new"], **kw)


# Varlen batch with an empty request, a q_len-1 row, prefixes on and off page boundaries.
Q_LENS = [5, 0, 37, 1, 19]
PREFIXES = [0, 3, 21, 40, 16]

# (G, Hkv, head_dim, page_size, new_layout, config)
CASES = [
    pytest.param(1, 2, 64, 16, False, SMALL, id="g1-d64-p16-vllm-small"),
    pytest.param(4, 2, 128, 1, True, None, id="g4-d128-p1-sglang-table"),
    pytest.param(7, 1, 64, 16, True, SMALL32, id="g7-d64-p16-sglang-small"),
    pytest.param(8, 2, 128, 16, False, None, id="g8-d128-p16-vllm-table"),
    pytest.param(5, 1, 96, 1, False, SMALL32, id="g5-d96-p1-vllm-small"),
    pytest.param(2, 1, 256, 32, True, None, id="g2-d256-p32-sglang-table"),
    # Pages larger than the tile: each tile reads one page-table entry.
    pytest.param(4, 2, 64, 64, False, SMALL, id="g4-d64-p64-vllm-small"),
]


@pytest.mark.parametrize("group,hkv,head_dim,page_size,new_layout,config", CASES)
def test_extend_matches_reference(device, group, hkv, head_dim, page_size, new_layout, config):
    dtype = torch.bfloat16 if head_dim == 128 else torch.float16
    batch = make_batch(Q_LENS, PREFIXES, group * hkv, hkv, head_dim, page_size, dtype, device, new_layout=new_layout)
    out = run_extend(batch, page_size, config=config)
    ref, lowp = reference_pair(batch, page_size)
    assert_tolerance(out, ref, lowp, dtype)


@pytest.mark.parametrize("window,cap,new_layout,config", [
    pytest.param(1, None, False, SMALL, id="w1"),
    pytest.param(13, None, True, SMALL, id="w13-sglang"),
    pytest.param(None, 1.5, False, None, id="cap"),
    pytest.param(9, 2.0, True, SMALL32, id="w9-cap-sglang"),
    pytest.param(40, None, False, SMALL, id="w40-wider-than-some-requests"),
])
def test_window_and_softcap(device, window, cap, new_layout, config):
    dtype = torch.float16
    # Larger scores so the soft-cap bites (|s| up to ~6 against caps of 1.5 and 2).
    batch = make_batch([6, 30, 1], [0, 33, 17], 4, 2, 64, 16, dtype, device, new_layout=new_layout, seed=1, scale=2.0)
    out = run_extend(batch, 16, sliding_window=window, logit_cap=cap, config=config)
    ref, lowp = reference_pair(batch, 16, sliding_window=window, logit_cap=cap)
    assert_tolerance(out, ref, lowp, dtype)


@pytest.mark.parametrize("new_layout", [False, True], ids=["vllm", "sglang"])
def test_non_causal(device, new_layout):
    dtype = torch.float16
    batch = make_batch([7, 20], [9, 0], 2, 1, 64, 16, dtype, device, new_layout=new_layout, seed=2)
    out = run_extend(batch, 16, causal=False, config=SMALL)
    ref, lowp = reference_pair(batch, 16, causal=False)
    assert_tolerance(out, ref, lowp, dtype)


def test_schedules_agree_bitwise(device):
    """The schedule only reorders programs; each block's arithmetic is the same."""
    batch = make_batch([3, 25, 9], [50, 0, 7], 4, 1, 64, 16, torch.float16, device, seed=3)
    a = run_extend(batch, 16, config=SMALL, schedule="lpt")
    b = run_extend(batch, 16, config=SMALL, schedule="ordered")
    assert torch.equal(a, b)


def test_strided_inputs(device):
    """q / out row-strided, caches as vLLM's packed K|V halves ([pages, page, Hkv, 2D] split)
    and as an HND view, page_table with a row stride wider than its columns."""
    dtype, ps, hkv, d = torch.float16, 16, 2, 64
    batch = make_batch([4, 21], [13, 0], 4, hkv, d, ps, dtype, device, seed=4)
    ref, lowp = reference_pair(batch, ps)
    num_pages = batch["k_cache"].shape[0] // ps
    packed = torch.cat([batch["k_cache"], batch["v_cache"]], -1).view(num_pages, ps, hkv, 2 * d)
    k4, v4 = packed[..., :d], packed[..., d:]
    hnd = torch.stack([batch["k_cache"], batch["v_cache"]]).view(2, num_pages, ps, hkv, d).permute(0, 1, 3, 2, 4)
    hnd = hnd.contiguous().permute(0, 1, 3, 2, 4)  # physical [2, pages, Hkv, page, D], logical [.., page, Hkv, D]
    wide_q = torch.zeros(batch["q"].shape[0], 6, *batch["q"].shape[1:], dtype=dtype, device=device)
    wide_q[:, 2] = batch["q"]
    wide_pt = torch.full((2, batch["page_table"].shape[1] + 5), GARBAGE_PAGE, dtype=torch.int32, device=device)
    wide_pt[:, :batch["page_table"].shape[1]] = batch["page_table"]
    pt = wide_pt[:, :batch["page_table"].shape[1]]
    for k_cache, v_cache in ((k4, v4), (hnd[0], hnd[1])):
        out_buf = torch.full((batch["q"].shape[0], 3, *batch["q"].shape[1:]), float("nan"), dtype=dtype, device=device)
        out = extend(wide_q[:, 2], k_cache, v_cache, cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"],
                     page_table=pt, page_size=ps, max_q_len=batch["max_q_len"], out=out_buf[:, 1], config=SMALL32)
        assert out.data_ptr() == out_buf[:, 1].data_ptr()
        assert_tolerance(out, ref, lowp, dtype)


def test_int64_seq_lens_and_cu(device):
    batch = make_batch([3, 8], [5, 0], 2, 1, 64, 1, torch.float16, device, seed=5)
    out32 = run_extend(batch, 1)
    batch64 = dict(batch, seq_lens=batch["seq_lens"].long(), cu_seqlens_q=batch["cu_seqlens_q"].long())
    assert torch.equal(run_extend(batch64, 1), out32)


def test_empty_inputs(device):
    dtype = torch.float16
    q = torch.randn(0, 4, 64, dtype=dtype, device=device)
    cache = torch.randn(32, 2, 64, dtype=dtype, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    out = extend(q, cache, cache, cu_seqlens_q=torch.zeros(1, **i32), seq_lens=torch.zeros(0, **i32),
                 page_table=torch.zeros(0, 4, **i32), page_size=16, max_q_len=0)
    assert out.shape == (0, 4, 64)
    # Requests with q_len 0 only (and padded q rows past cu_seqlens_q[-1], left untouched).
    q = torch.randn(3, 4, 64, dtype=dtype, device=device)
    out = torch.full_like(q, 7.0)
    extend(q, cache, cache, cu_seqlens_q=torch.zeros(3, **i32), seq_lens=torch.tensor([5, 0], **i32),
           page_table=torch.zeros(2, 1, **i32), page_size=16, max_q_len=1, out=out)
    assert (out == 7.0).all()


def test_padding_rows_untouched(device):
    batch = make_batch([4, 6], [3, 0], 2, 1, 64, 16, torch.float16, device, seed=6)
    q = torch.cat([batch["q"], torch.randn(5, 2, 64, dtype=torch.float16, device=device)])
    out = torch.full_like(q, 7.0)
    extend(q, batch["k_cache"], batch["v_cache"], cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"],
           page_table=batch["page_table"], page_size=16, max_q_len=6, out=out)
    assert (out[10:] == 7.0).all()
    ref, lowp = reference_pair(batch, 16)
    assert_tolerance(out[:10], ref, lowp, torch.float16)


# -- the plan (request order and block offsets) --------------------------------------


def plan_oracle(q_lens, seq_lens, req_begin, group, block_m, lpt):
    """numpy mirror of extend_plan_kernel: (order, sorted_start)."""
    blocks = [(-(-n * group // block_m) if b >= req_begin else 0) for b, n in enumerate(q_lens)]
    keys = [(s if lpt else 0) if n > 0 else -1 for s, n in zip(seq_lens, blocks)]
    order = sorted(range(len(q_lens)), key=lambda i: (-keys[i], i))
    starts = np.concatenate([[0], np.cumsum([blocks[i] for i in order])[:-1]]).astype(np.int64)
    return np.array(order), starts


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_plan_matches_oracle(device, data):
    batch = data.draw(st.integers(1, 70))
    q_lens = data.draw(st.lists(st.integers(0, 300), min_size=batch, max_size=batch))
    seq_lens = [n + data.draw(st.integers(0, 5000)) for n in q_lens]
    req_begin = data.draw(st.integers(0, batch))
    group = data.draw(st.sampled_from([1, 2, 5, 7, 8, 16]))
    block_m = data.draw(st.sampled_from([16, 64, 128]))
    lpt = data.draw(st.booleans())
    i32 = dict(dtype=torch.int32, device=device)
    cu = torch.tensor([0] + np.cumsum(q_lens).tolist(), **i32)
    order = torch.full((batch,), -1, **i32)
    starts = torch.full((batch,), -1, **i32)
    errors = torch.zeros(1, **i32)
    plan_launch.launch_extend_plan(cu, torch.tensor(seq_lens, **i32), order, starts, errors, req_begin=req_begin,
                                     max_q_len=max(q_lens), group_size=group, block_m=block_m, lpt=lpt)
    assert int(errors) == 0
    want_order, want_starts = plan_oracle(q_lens, seq_lens, req_begin, group, block_m, lpt)
    np.testing.assert_array_equal(order.cpu().numpy(), want_order)
    np.testing.assert_array_equal(starts.cpu().numpy(), want_starts)


@settings(max_examples=200, deadline=None)
@given(q_lens=st.lists(st.integers(0, 5000), min_size=1, max_size=40), pad=st.integers(0, 100),
       group=st.sampled_from([1, 4, 5, 7, 8, 16]), block_m=st.sampled_from([16, 32, 64, 128]))
def test_grid_bound_covers_every_block(q_lens, pad, group, block_m):
    blocks = sum(-(-n * group // block_m) for n in q_lens)
    bound = extend_launch.num_query_blocks_bound(sum(q_lens) + pad, len(q_lens), max(q_lens), group, block_m)
    assert blocks <= bound


# -- mixed batches -------------------------------------------------------------------


def mixed_attention(device, batch, hq, hkv, d, ps, dtype, **kw):
    return Attention(hq, hkv, d, ps, dtype, device, max_batch_size=8,
                     max_pages_per_request=batch["page_table"].shape[1], **kw)


@pytest.mark.parametrize("num_decodes,q_lens,prefixes", [
    pytest.param(3, [1, 1, 1, 12, 5], [40, 7, 0, 9, 30], id="3-decodes-2-prefills"),
    pytest.param(4, [1, 1, 1, 1], [33, 2, 17, 60], id="decode-only"),
    pytest.param(0, [9, 2], [0, 21], id="extend-only"),
])
def test_mixed_matches_reference(device, num_decodes, q_lens, prefixes):
    dtype, hq, hkv, d, ps = torch.float16, 8, 2, 64, 16
    batch = make_batch(q_lens, prefixes, hq, hkv, d, ps, dtype, device, seed=7)
    attn = mixed_attention(device, batch, hq, hkv, d, ps, dtype, extend_config=SMALL)
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=num_decodes,
                     max_q_len=max(q_lens[num_decodes:], default=1))
    assert plan.num_decodes == num_decodes
    assert (plan.decode is None) == (num_decodes == 0)
    assert (plan.extend is None) == (num_decodes == len(q_lens))
    ref, lowp = reference_pair(batch, ps)
    out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"])
    assert_tolerance(out, ref, lowp, dtype)
    # Same plan, next layer: new q, same metadata.
    q2 = torch.randn_like(batch["q"])
    out2 = attn.run(plan, q2, batch["k_cache"], batch["v_cache"])
    ref2, lowp2 = reference_pair(dict(batch, q=q2), ps)
    assert_tolerance(out2, ref2, lowp2, dtype)


def test_mixed_sglang_layout_and_4d_cache(device):
    """Decode rows read the cache (which holds their token); extend rows take k_new/v_new."""
    dtype, hq, hkv, d, ps = torch.float16, 4, 1, 64, 16
    q_lens, prefixes = [1, 1, 7, 3], [20, 5, 11, 0]
    batch = make_batch(q_lens, prefixes, hq, hkv, d, ps, dtype, device, new_layout=True, seed=8)
    # The decode rows' own token is in the cache (SGLang writes every new token first).
    for b in range(2):
        pos = prefixes[b]
        slot = int(batch["page_table"][b, pos // ps]) * ps + pos % ps
        batch["k_cache"][slot] = batch["k_new"][b]
        batch["v_cache"][slot] = batch["v_new"][b]
    attn = mixed_attention(device, batch, hq, hkv, d, ps, dtype, extend_config=SMALL)
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=2, max_q_len=7)
    k4 = batch["k_cache"].view(-1, ps, hkv, d)
    v4 = batch["v_cache"].view(-1, ps, hkv, d)
    out = attn.run(plan, batch["q"], k4, v4, k_new=batch["k_new"], v_new=batch["v_new"])
    ref, lowp = reference_pair(batch, ps)
    assert_tolerance(out, ref, lowp, dtype)


def test_mixed_window_softcap_sinks_fp8(device):
    """A gpt-oss-like layer in a mixed batch: decode rows on the decode kernels and extend rows
    on the extend kernel, both with the layer's window, soft-cap, sinks and FP8 cache."""
    dtype, hq, hkv, d, ps = torch.float16, 4, 2, 64, 16
    batch = make_batch([1, 1, 10], [30, 3, 12], hq, hkv, d, ps, dtype, device, seed=9, scale=2.0)
    batch = quantized(batch, 0.05, 0.03)
    sinks = torch.tensor([1.0, -2.0, 0.5, 4.0], device=device)
    attn = mixed_attention(device, batch, hq, hkv, d, ps, dtype, sliding_window=8, logit_cap=2.0, kv_dtype=FP8,
                           extend_config=SMALL)
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=2, max_q_len=10)
    assert plan.decode is not None and plan.extend.req_begin == 2
    out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"], sinks=sinks, k_scale=0.05, v_scale=0.03)
    ref, lowp = reference_pair(batch, ps, sliding_window=8, logit_cap=2.0, sinks=sinks, k_scale=0.05, v_scale=0.03)
    assert_tolerance(out, ref, lowp, dtype)


# -- FP8 caches and attention sinks ---------------------------------------------------------

FP8 = torch.float8_e4m3fn


def quantized(batch, k_scale, v_scale):
    """``batch`` with its caches stored as FP8 by the reference write (stored = real / scale; the
    NaN poison stays NaN)."""
    k8 = torch.empty(batch["k_cache"].shape, dtype=FP8, device=batch["k_cache"].device)
    v8 = torch.empty_like(k8)
    slots = torch.arange(k8.shape[0], device=k8.device)
    kv_write_reference(k8, v8, batch["k_cache"], batch["v_cache"], slots, k_scale=k_scale, v_scale=v_scale)
    return dict(batch, k_cache=k8, v_cache=v8)


@pytest.mark.parametrize("dtype,group,page_size,new_layout,window,cap,scales,config", [
    pytest.param(torch.bfloat16, 4, 16, False, None, None, (0.05, 0.02), SMALL, id="bf16-g4-p16-vllm"),
    pytest.param(torch.float16, 2, 1, True, None, None, (0.5, 4.0), SMALL32, id="fp16-g2-p1-sglang-vscale4"),
    pytest.param(torch.bfloat16, 5, 16, True, 13, 2.0, (0.03, 0.02), SMALL, id="bf16-g5-p16-sglang-w13-cap"),
])
def test_fp8_cache_matches_reference(device, dtype, group, page_size, new_layout, window, cap, scales, config):
    """The reference reads the same stored FP8 values, so the only error left is the rounding of
    q, p and out in q's dtype: the usual rule holds."""
    batch = make_batch([6, 0, 30, 1], [0, 3, 33, 17], group * 2, 2, 64, page_size, dtype, device,
                       new_layout=new_layout, seed=10, scale=2.0)
    batch = quantized(batch, *scales)
    kw = dict(sliding_window=window, logit_cap=cap, k_scale=scales[0], v_scale=scales[1])
    out = run_extend(batch, page_size, config=config, **kw)
    ref, lowp = reference_pair(batch, page_size, **kw)
    assert_tolerance(out, ref, lowp, dtype)


@pytest.mark.parametrize("group,new_layout,window,cap,fp8,sink_dtype", [
    pytest.param(4, False, None, None, False, torch.float32, id="g4-vllm"),
    pytest.param(5, True, 9, 2.0, False, torch.bfloat16, id="g5-sglang-w9-cap-bf16-sinks"),
    pytest.param(2, True, None, None, True, torch.float16, id="g2-sglang-fp8-fp16-sinks"),
    pytest.param(3, False, 13, None, True, torch.float32, id="g3-vllm-w13-fp8"),
])
def test_sinks_match_reference(device, group, new_layout, window, cap, fp8, sink_dtype):
    dtype, hq = torch.float16, group * 2
    batch = make_batch([6, 0, 30, 1], [0, 3, 33, 17], hq, 2, 64, 16, dtype, device, new_layout=new_layout, seed=11,
                       scale=2.0)
    scales = (0.05, 0.03) if fp8 else (1.0, 1.0)
    if fp8:
        batch = quantized(batch, *scales)
    # Logits of the scores' size (|s * sm_scale| ~ 2), so the sinks take a real share.
    sinks = (2.0 * torch.randn(hq, generator=torch.Generator().manual_seed(11))).to(sink_dtype).to(device)
    kw = dict(sliding_window=window, logit_cap=cap, sinks=sinks, k_scale=scales[0], v_scale=scales[1])
    out = run_extend(batch, 16, config=SMALL, **kw)
    ref, lowp = reference_pair(batch, 16, **kw)
    assert_tolerance(out, ref, lowp, dtype)


def test_extreme_sinks(device):
    """A sink far above every score takes all the weight (zeros, exactly); one far below, or -inf,
    changes nothing (the same bits as without sinks). Mixed across heads, so each packed row must
    read its own query head's sink."""
    batch = make_batch([6, 30, 1], [0, 33, 17], 6, 2, 64, 16, torch.bfloat16, device, new_layout=True, seed=12)
    plain = run_extend(batch, 16, config=SMALL)
    sinks = torch.tensor([1e4, -math.inf, -1e4, -1e4, 1e4, -math.inf], device=device)
    out = run_extend(batch, 16, config=SMALL, sinks=sinks)
    big = sinks > 0
    assert (out[:, big] == 0).all()
    assert torch.equal(out[:, ~big], plain[:, ~big])


def test_rows_that_see_no_key_are_zeros_with_sinks(device):
    """A page table without columns leaves the vLLM-layout rows no key (lengths are clamped to its
    capacity, 0, and flagged): the sink alone makes their denominator, the output is zeros."""
    errors.error_flag(device).zero_()
    batch = make_batch([3, 2], [4, 0], 4, 2, 64, 16, torch.float16, device)
    batch["page_table"] = batch["page_table"][:, :0]
    out = run_extend(batch, 16, sinks=torch.tensor([0.0, -math.inf, 3.0, -math.inf], device=device))
    assert (out == 0).all()
    assert errors.REASONS[errors.LENGTH_OUT_OF_RANGE] in errors.peek(device)
    errors.error_flag(device).zero_()


def test_reference_conventions():
    """The oracles on one key: real K/V = stored x scale, out = v e^s / (e^s + e^sink); FP8
    writes divide by the scale, saturate to +-448 and round to nearest even."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 1, 64, generator=gen) for _ in range(3))
    k8, v8 = torch.empty(16, 1, 64, dtype=FP8), torch.empty(16, 1, 64, dtype=FP8)
    kv_write_reference(k8, v8, k[0], v[0], torch.tensor([0]), k_scale=0.02, v_scale=0.03)
    sink = torch.tensor([0.7])
    out = decode_reference(q, k8, v8, torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32), 16, 0.125,
                           sinks=sink, k_scale=0.02, v_scale=0.03)
    s = (q[0, 0] * k8[0, 0].float() * 0.02).sum() * 0.125
    want = v8[0, 0].float() * 0.03 * torch.exp(s) / (torch.exp(s) + torch.exp(sink))
    torch.testing.assert_close(out[0, 0], want)
    new = torch.tensor([1000.0, -1e4, 0.265625, 0.3])[:, None, None]  # 0.265625 and its half are ties
    kv_write_reference(k8, v8, new, new, torch.arange(4), k_scale=1.0, v_scale=2.0)
    assert k8[:4, 0, 0].float().tolist() == [448.0, -448.0, 0.25, 0.3125]
    assert v8[:4, 0, 0].float().tolist() == [448.0, -448.0, 0.125, 0.15625]


# -- bad inputs ------------------------------------------------------------------------


def _bad_cases():
    """(id, mutation of the kwargs, exception, fragment of the message)."""
    def f16(x):
        return x.to(torch.float16)
    return [
        ("q-not-tensor", lambda a: a.update(q=[1.0]), TypeError, "q"),
        ("q-fp32", lambda a: a.update(q=a["q"].float()), TypeError, "q"),
        ("q-2d", lambda a: a.update(q=a["q"][:, 0]), ValueError, "q"),
        ("q-last-dim-strided", lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
         ValueError, "q"),
        ("head-dim-192", lambda a: a.update(q=torch.zeros(a["q"].shape[0], 4, 192, dtype=torch.float16),
                                            k_cache=torch.zeros(32, 2, 192, dtype=torch.float16),
                                            v_cache=torch.zeros(32, 2, 192, dtype=torch.float16)),
         ValueError, r"head_dim \(q's last dim\): expected one of \(64, 80, 96, 128, 256\), got 192"),
        ("k-dtype", lambda a: a.update(k_cache=a["k_cache"].to(torch.bfloat16)), TypeError, "k_cache"),
        ("v-shape", lambda a: a.update(v_cache=a["v_cache"][:-1]), ValueError, "v_cache"),
        ("k-head-dim", lambda a: a.update(k_cache=a["k_cache"][..., :32]), ValueError, "k_cache"),
        ("heads-not-multiple", lambda a: a.update(q=f16(torch.zeros(a["q"].shape[0], 3, 64))), ValueError, "Hq"),
        ("no-q-heads", lambda a: a.update(q=f16(torch.zeros(a["q"].shape[0], 0, 64))), ValueError,
         "Hq a positive multiple.*got Hq=0"),
        ("k-4d-wrong-page", lambda a: a.update(k_cache=a["k_cache"].view(-1, 8, 2, 64)), ValueError, "k_cache"),
        ("cu-shape", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:-1]), ValueError, "cu_seqlens_q"),
        ("cu-float", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].float()), TypeError, "cu_seqlens_q"),
        ("seq-lens-2d", lambda a: a.update(seq_lens=a["seq_lens"][:, None]), ValueError, "seq_lens"),
        ("page-table-int64", lambda a: a.update(page_table=a["page_table"].long()), TypeError, "page_table"),
        ("page-table-rows", lambda a: a.update(page_table=a["page_table"][:1]), ValueError,
         r"seq_lens: expected shape \[1\].*page_table \(shape \(1, \d+\)\), got shape \(2,\)"),
        ("page-size-12", lambda a: a.update(page_size=12), ValueError, "page_size"),
        ("max-q-len-float", lambda a: a.update(max_q_len=4.0), TypeError, "max_q_len"),
        ("max-q-len-negative", lambda a: a.update(max_q_len=-1), ValueError, "max_q_len"),
        ("k-new-alone", lambda a: a.update(k_new=torch.zeros(a["q"].shape[0], 2, 64, dtype=torch.float16)),
         ValueError, "k_new"),
        ("k-new-shape", lambda a: a.update(k_new=torch.zeros(1, 2, 64, dtype=torch.float16),
                                           v_new=torch.zeros(1, 2, 64, dtype=torch.float16)), ValueError, "k_new"),
        ("window-negative", lambda a: a.update(sliding_window=-2), ValueError, "sliding_window"),
        ("window-float", lambda a: a.update(sliding_window=4.0), TypeError, "sliding_window"),
        ("window-non-causal", lambda a: a.update(sliding_window=4, causal=False), ValueError,
         "sliding_window.*causal=False"),
        ("cap-negative", lambda a: a.update(logit_cap=-1.0), ValueError, "logit_cap"),
        ("cap-inf", lambda a: a.update(logit_cap=math.inf), ValueError, "logit_cap"),
        ("scale-zero", lambda a: a.update(sm_scale=0.0), ValueError, "sm_scale"),
        ("causal-int", lambda a: a.update(causal=1), TypeError, "causal"),
        ("out-shape", lambda a: a.update(out=torch.zeros(1, 4, 64, dtype=torch.float16)), ValueError, "out"),
        ("schedule", lambda a: a.update(schedule="random"), ValueError, "schedule"),
        ("k-fp32", lambda a: a.update(k_cache=a["k_cache"].float()), TypeError, "k_cache.*float8_e4m3fn"),
        ("k-fp8-v-fp16", lambda a: a.update(k_cache=a["k_cache"].to(FP8)), TypeError, "v_cache"),
        ("k-new-fp8", lambda a: a.update(k_cache=a["k_cache"].to(FP8), v_cache=a["v_cache"].to(FP8),
                                         k_new=torch.zeros(a["q"].shape[0], 2, 64, dtype=FP8),
                                         v_new=torch.zeros(a["q"].shape[0], 2, 64, dtype=FP8)), TypeError, "k_new"),
        ("k-scale-tensor", lambda a: a.update(k_scale=torch.tensor(0.5)), TypeError, "k_scale"),
        ("k-scale-zero", lambda a: a.update(k_scale=0.0), ValueError, "k_scale"),
        ("v-scale-nan", lambda a: a.update(v_scale=math.nan), ValueError, "v_scale"),
        ("v-scale-unquantized-cache", lambda a: a.update(v_scale=0.5), ValueError, "v_scale"),
        ("sinks-length", lambda a: a.update(sinks=torch.zeros(3)), ValueError, "sinks"),
        ("sinks-int", lambda a: a.update(sinks=torch.zeros(4, dtype=torch.int32)), TypeError, "sinks"),
        ("sinks-device", lambda a: a.update(sinks=torch.zeros(4, device="meta")), ValueError, "sinks"),
        ("sinks-strided", lambda a: a.update(sinks=torch.zeros(8)[::2]), ValueError, "sinks"),
    ]


@pytest.mark.parametrize("mutate,exc,fragment", [pytest.param(m, e, f, id=i) for i, m, e, f in _bad_cases()])
def test_bad_inputs_raise(mutate, exc, fragment):
    batch = make_batch([3, 2], [4, 0], 4, 2, 64, 16, torch.float16, "cpu")
    args = dict(q=batch["q"], k_cache=batch["k_cache"], v_cache=batch["v_cache"], cu_seqlens_q=batch["cu_seqlens_q"],
                seq_lens=batch["seq_lens"], page_table=batch["page_table"], page_size=16, max_q_len=3)
    mutate(args)
    with pytest.raises(exc, match=fragment):
        extend(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def test_debug_checks_lengths():
    batch = make_batch([3, 2], [4, 0], 4, 2, 64, 16, torch.float16, "cpu")
    args = dict(cu_seqlens_q=batch["cu_seqlens_q"], page_table=batch["page_table"], page_size=16, debug=True)
    qkv = (batch["q"], batch["k_cache"], batch["v_cache"])
    with pytest.raises(ValueError, match="max_q_len"):
        extend(*qkv, seq_lens=batch["seq_lens"], max_q_len=2, **args)
    with pytest.raises(ValueError, match="seq_lens"):
        extend(*qkv, seq_lens=torch.tensor([7, 1], dtype=torch.int32), max_q_len=3, **args)
    with pytest.raises(ValueError, match="capacity"):
        extend(*qkv, seq_lens=torch.tensor([7, 500], dtype=torch.int32), max_q_len=3, **args)


def _flagged_and_refused(device, run) -> tuple[list, ValueError | None]:
    """What the kernels flag for ``run(debug=False)``, and the ValueError ``run(debug=True)`` raises."""
    errors.error_flag(device).zero_()
    run(False)
    flagged = errors.peek(device)
    errors.error_flag(device).zero_()
    try:
        run(True)
    except ValueError as refused:
        return flagged, refused
    finally:
        errors.error_flag(device).zero_()
    return flagged, None


@pytest.mark.parametrize("case", ["k_new-prefix-fills-the-table", "k_new-past-the-table", "no-k_new-past-the-table",
                                  "no-query-past-the-table", "below-q_len", "backwards"])
def test_debug_refuses_what_the_kernels_flag(device, case):
    """Debug mode's host checks and the error flag agree: refused exactly when flagged. With
    k_new the cache holds only the prefix, so seq_len may pass the table's capacity by q_len; a
    request of no query rows is never run, so its length is never read."""
    batch = make_batch([5, 0], [32, 32], 4, 2, 64, 16, torch.float16, device, new_layout=True, seed=2)
    pt = batch["page_table"][:, :2].contiguous()  # capacity 32: request 0's prefix fills it
    seq, cu, new = batch["seq_lens"].clone(), batch["cu_seqlens_q"].clone(), dict(k_new=batch["k_new"],
                                                                                  v_new=batch["v_new"])
    if case == "k_new-past-the-table":
        seq[0] += 1
    elif case == "no-k_new-past-the-table":
        new = {}
    elif case == "no-query-past-the-table":
        seq[1] = 10**6
    elif case == "below-q_len":
        seq[0] = 4
    elif case == "backwards":
        cu = torch.tensor([0, 5, 3], dtype=torch.int32, device=device)

    def run(debug):
        extend(batch["q"], batch["k_cache"], batch["v_cache"], cu_seqlens_q=cu, seq_lens=seq, page_table=pt,
               page_size=16, max_q_len=5, debug=debug, **new)

    flagged, refused = _flagged_and_refused(device, run)
    assert bool(flagged) == (refused is not None), (flagged, refused)
    assert bool(flagged) == (case not in ("k_new-prefix-fills-the-table", "no-query-past-the-table"))


def test_debug_takes_a_padding_decode_row_beside_extend_rows(device):
    """``Attention`` in debug mode: a padding decode row (seq_len 0, one query row) in a batch with
    extend rows is legal (zeros, no flag), so it is not refused."""
    batch = make_batch([1, 1, 5], [24, 0, 35], 4, 2, 64, 16, torch.float16, device, seed=4)
    seq = batch["seq_lens"].clone()
    seq[1] = 0

    def run(debug):
        attn = mixed_attention(device, batch, 4, 2, 64, 16, torch.float16, debug=debug)
        plan = attn.plan(batch["cu_seqlens_q"], seq, batch["page_table"], num_decodes=2, max_q_len=5)
        return attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"])

    assert _flagged_and_refused(device, run) == ([], None)
    out = run(True)
    assert torch.all(out[1] == 0)


def test_fp8_score_scale_outside_float32_is_refused(device):
    """sm_scale x k_scale folds into the FP8 cache's score scale, which must be a normal float32:
    the extend rows refuse it with decode's ValueError (evenkv.extend and Attention)."""
    batch = quantized(make_batch([3, 2], [4, 0], 4, 2, 64, 16, torch.float16, device), 1.0, 1.0)
    args = (batch["q"], batch["k_cache"], batch["v_cache"])
    with pytest.raises(ValueError, match="sm_scale, k_scale"):
        extend(*args, cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"], page_table=batch["page_table"],
               page_size=16, max_q_len=3, sm_scale=1e30, k_scale=1e30)
    attn = mixed_attention(device, batch, 4, 2, 64, 16, torch.float16, kv_dtype=FP8)
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=0, max_q_len=3)
    with pytest.raises(ValueError, match="sm_scale, k_scale"):
        attn.run(plan, *args, sm_scale=1e30, k_scale=1e30)


def test_mixed_bad_plan(device):
    batch = make_batch([1, 4], [3, 0], 4, 2, 64, 16, torch.float16, device)
    attn = mixed_attention(device, batch, 4, 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="num_decodes"):
        attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=3, max_q_len=4)
    with pytest.raises(TypeError, match="plan"):
        attn.run(None, batch["q"], batch["k_cache"], batch["v_cache"])
    old = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=1, max_q_len=4)
    attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=0, max_q_len=4)
    with pytest.raises(ValueError, match="latest plan"):
        attn.run(old, batch["q"], batch["k_cache"], batch["v_cache"])
    with pytest.raises(ValueError, match="head_dim|num_q_heads"):
        Attention(4, 3, 64, 16, torch.float16, device, 4, 4)


# -- ahead-of-time compile for Hopper (no GPU needed) ------------------------------------------

def test_sm90_table_config_compiles_without_spills():
    """The sm90 D=128 config compiles for sm_90a with no register spills, wgmma dots and
    cp.async-pipelined K/V loads, for the vLLM layout and for the SGLang layout with a
    window, a soft-cap and sinks (checked on the CPU with Triton's bundled ptxas)."""
    import dataclasses

    from evenkv.configs import extend_config
    cfg = dataclasses.asdict(extend_config("sm90", 128, 8, 4096))
    base = dict(NUM_KV_HEADS=4, G=8, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                PAGE_SIZE=16, CAUSAL=True, HAS_NEW=False, WINDOW=False, SOFTCAP=False, KV_FP8=False,
                HAS_SINKS=False, BLOCK_B=256, NUM_STAGES=cfg["num_stages"])
    variants = [{}, dict(HAS_NEW=True, PAGE_SIZE=1, WINDOW=True, SOFTCAP=True, HAS_SINKS=True)]
    results = aot_compile(dict(
        kernel="evenkv.kernels.extend:extend_kernel",
        bf16=["q_ptr", "k_ptr", "v_ptr", "k_new_ptr", "v_new_ptr", "out_ptr"], fp32_ptrs=["sinks_ptr"],
        fp32=["qk_scale", "cache_qk_scale", "cap_scale", "v_scale"], unaligned=["stride_pt"],
        variants=[dict(cap=90, consts={**base, **flags},
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])) for flags in variants]))
    for flags, r in zip(variants, results):
        assert r["stack"] == 0, f"{flags}: {r['stack']} bytes of stack (register spills)"
        assert r["wgmma"] and r["cp_async"], f"{flags}: expected wgmma dots and cp.async K/V loads"
        assert not r["stack_pointer_data_reads"], f"{flags}: miscompiled: {r['stack_pointer_data_reads']}"


# -- GPU lane: realistic shapes ------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU lane: no CUDA device")


def _gpu_check(batch, ps, dtype, rows=None, **kw):
    out = run_extend(batch, ps, **kw)
    for knob in ("config", "schedule", "arch"):
        kw.pop(knob, None)
    ref, lowp = reference_pair(batch, ps, max_scores=1 << 28, **kw)
    assert_tolerance(out, ref, lowp, dtype, rows=rows)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("prompt,prefix", [(32768, 0), (8192, 32768), (32768, 32768), (512, 32768)])
@pytest.mark.parametrize("page_size,new_layout", [(16, False), (1, True)], ids=["vllm-p16", "sglang-p1"])
def test_gpu_long_prefill(no_tf32, prompt, prefix, page_size, new_layout):
    """Qwen3-30B-A3B attention (Hq 32, Hkv 4, D 128, bf16), one long request."""
    batch = make_batch([prompt], [prefix], 32, 4, 128, page_size, torch.bfloat16, "cuda", new_layout=new_layout)
    _gpu_check(batch, page_size, torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group,hkv,head_dim,dtype", [
    (1, 8, 64, torch.bfloat16), (5, 2, 128, torch.float16), (7, 1, 128, torch.bfloat16),
    (16, 2, 128, torch.bfloat16), (2, 4, 256, torch.bfloat16), (4, 2, 96, torch.float16), (8, 1, 80, torch.bfloat16),
])
@pytest.mark.parametrize("schedule", ["lpt", "ordered"])
def test_gpu_skewed_varlen(no_tf32, group, hkv, head_dim, dtype, schedule):
    """A chunked-prefill batch: a long chunk on a long prefix next to short prompts,
    a decode-like row, a spec-verify row and an empty request."""
    q_lens = [2048, 1, 513, 0, 4, 8192, 17]
    prefixes = [32768, 40000, 0, 100, 3000, 1000, 5]
    batch = make_batch(q_lens, prefixes, group * hkv, hkv, head_dim, 16, dtype, "cuda", seed=11)
    _gpu_check(batch, 16, dtype, schedule=schedule)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("new_layout", [False, True], ids=["vllm", "sglang"])
def test_gpu_window_softcap(no_tf32, arch, new_layout):
    """Gemma-2-like: D 256, G 2, window 4096, soft-cap 50, over an 8K chunk on a 4K prefix."""
    batch = make_batch([8192, 300], [4096, 9000], 16, 8, 256, 16, torch.bfloat16, "cuda", new_layout=new_layout,
                       seed=12, scale=3.0)
    _gpu_check(batch, 16, torch.bfloat16, sliding_window=4096, logit_cap=50.0, arch=arch)


@pytest.mark.gpu
@needs_cuda
def test_gpu_int64_offsets(no_tf32):
    """A cache of more than 2**31 elements with the request's pages at its far end."""
    hkv, d, ps = 8, 128, 16
    num_pages = (2**31 // (hkv * d)) // ps + 64
    dtype, dev = torch.bfloat16, "cuda"
    k_cache = torch.empty(num_pages * ps, hkv, d, dtype=dtype, device=dev)
    v_cache = torch.empty(num_pages * ps, hkv, d, dtype=dtype, device=dev)
    q_len, prefix = 300, 400
    seq = q_len + prefix
    pages = torch.arange(num_pages - math.ceil(seq / ps), num_pages, dtype=torch.int32, device=dev)
    page_table = pages[None]
    tok = torch.arange(seq, device=dev)
    slots = pages[tok // ps].long() * ps + tok % ps
    k_cache[slots] = torch.randn(seq, hkv, d, device=dev).to(dtype)
    v_cache[slots] = torch.randn(seq, hkv, d, device=dev).to(dtype)
    # The request's q rows start past 2**31 elements of q too (cu_seqlens_q[0] > 0).
    first = 2**31 // (32 * d) + 8
    q = torch.empty(first + q_len + 8, 32, d, dtype=dtype, device=dev)
    q[first:first + q_len] = torch.randn(q_len, 32, d, device=dev).to(dtype)
    batch = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                 cu_seqlens_q=torch.tensor([first, first + q_len], dtype=torch.int32, device=dev),
                 seq_lens=torch.tensor([seq], dtype=torch.int32, device=dev), page_table=page_table, k_new=None,
                 v_new=None, max_q_len=q_len)
    _gpu_check(batch, ps, dtype, rows=slice(first, first + q_len))
    del k_cache, v_cache, q


@pytest.mark.gpu
@needs_cuda
def test_gpu_mixed_batch_and_graph(no_tf32):
    """vLLM-ordered mixed batch (decode rows first), then a decode-only batch captured in a
    CUDA graph and replayed on changed lengths."""
    hq, hkv, d, ps, dtype = 32, 4, 128, 16, torch.bfloat16
    q_lens = [1] * 48 + [2048, 300, 7]
    prefixes = [int(x) for x in torch.randint(1, 9000, (48,), generator=torch.Generator().manual_seed(0))]
    prefixes += [16000, 0, 4000]
    batch = make_batch(q_lens, prefixes, hq, hkv, d, ps, dtype, "cuda", seed=13)
    attn = Attention(hq, hkv, d, ps, dtype, "cuda", max_batch_size=64,
                     max_pages_per_request=batch["page_table"].shape[1])
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=48, max_q_len=2048)
    out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"])
    ref, lowp = reference_pair(batch, ps, max_scores=1 << 28)
    assert_tolerance(out, ref, lowp, dtype)

    # Decode-only graph: persistent metadata buffers, refilled in place before each replay.
    nd = 48
    cu = batch["cu_seqlens_q"][:nd + 1].clone()
    seq_lens = batch["seq_lens"][:nd].clone()
    page_table = batch["page_table"][:nd].clone()
    q = batch["q"][:nd].clone()
    out = torch.empty_like(q)
    plan = attn.plan(cu, seq_lens, page_table, num_decodes=nd, max_q_len=1)
    attn.run(plan, q, batch["k_cache"], batch["v_cache"], out=out)  # warm up (compile) outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = attn.plan(cu, seq_lens, page_table, num_decodes=nd, max_q_len=1)
        attn.run(plan, q, batch["k_cache"], batch["v_cache"], out=out)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        new_lens = torch.randint(1, 9000, (nd,), generator=gen).to(torch.int32)
        new_lens = torch.minimum(new_lens, torch.tensor(prefixes[:nd]) + 1).to(torch.int32)
        seq_lens.copy_(new_lens.cuda())
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype).cuda())
        graph.replay()
        torch.cuda.synchronize()
        sub = dict(batch, q=q, cu_seqlens_q=cu, seq_lens=seq_lens, page_table=page_table, max_q_len=1)
        ref, lowp = reference_pair(sub, ps, max_scores=1 << 28)
        assert_tolerance(out, ref, lowp, dtype)


# -- an engine's prefill kernel for the extend rows ---------------------------------------------


class ReferencePrefill:
    """A PrefillKernel made of the fp32 reference: records each call's arguments."""

    def __init__(self, invariant: bool | None = None, fp8_cache_dtypes: tuple = ()):
        """invariant: None, a kernel with no invariant form; False, one that has one; True, that form."""
        self.calls = []
        self.has_invariant, self.is_invariant = invariant is not None, bool(invariant)
        self.fp8_cache_dtypes = fp8_cache_dtypes
        self.name = "invariant reference prefill" if self.is_invariant else "reference prefill"

    def takes_sinks(self, num_q_heads):
        return True

    def invariant(self):
        return ReferencePrefill(invariant=True, fp8_cache_dtypes=self.fp8_cache_dtypes) if self.has_invariant else None

    def __call__(self, q, k_cache, v_cache, out, *, cu_seqlens_q, seq_lens, page_table, max_q_len, max_seq_len,
                 sm_scale, sliding_window, logit_cap, sinks, k_scale=1.0, v_scale=1.0):
        self.calls.append(dict(rows=q.shape[0], cu=cu_seqlens_q.tolist(), lens=seq_lens.tolist(),
                               pages=page_table.shape, max_q_len=max_q_len, max_seq_len=max_seq_len,
                               sm_scale=sm_scale, cache=tuple(k_cache.shape), window=sliding_window, cap=logit_cap,
                               sinks=sinks, kv_dtype=k_cache.dtype, scales=(k_scale, v_scale)))
        ref = extend_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, k_cache.shape[1],
                               sm_scale=sm_scale, sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks,
                               k_scale=k_scale, v_scale=v_scale)
        n = int(cu_seqlens_q[-1])
        out[:n] = ref[:n].to(out.dtype)


def test_extend_rows_run_on_the_engine_prefill_kernel(device):
    """Decode rows on evenkv's decode plan, extend rows on the given prefill kernel, one plan,
    every layer; the kernel sees only the extend rows, cu_seqlens_q rebased at 0, int32 lengths
    and the paged [num_pages, page_size, Hkv, D] view of the cache."""
    dtype, hq, hkv, d, ps = torch.float16, 8, 2, 64, 16
    q_lens, prefixes = [1, 1, 1, 12, 5], [40, 7, 0, 9, 30]
    batch = make_batch(q_lens, prefixes, hq, hkv, d, ps, dtype, device, seed=7)
    prefill = ReferencePrefill()
    attn = mixed_attention(device, batch, hq, hkv, d, ps, dtype, prefill_kernel=prefill)
    assert attn.prefill_kernel is prefill and "reference prefill" in attn.prefill_reason
    seq_lens = batch["seq_lens"].long()  # SGLang's dtype: the kernel still gets int32
    plan = attn.plan(batch["cu_seqlens_q"], seq_lens, batch["page_table"], num_decodes=3, max_q_len=12,
                     max_seq_len=35)
    assert plan.extend is None and plan.delegated.first_row == 3
    ref, lowp = reference_pair(batch, ps)
    for sm_scale in (None, 0.2):
        out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"], sm_scale=sm_scale)
        if sm_scale is None:
            assert_tolerance(out, ref, lowp, dtype)
    call = prefill.calls[0]
    assert call["cu"] == [0, 12, 17] and call["lens"] == [21, 35] and call["rows"] == sum(q_lens) - 3
    assert call["pages"][0] == 2 and call["max_q_len"] == 12 and call["max_seq_len"] == 35
    assert call["cache"][1:] == (ps, hkv, d) and prefill.calls[1]["sm_scale"] == 0.2


def test_prefill_kernel_gets_the_layer_terms(device):
    """A layer's window, soft-cap and sinks reach the engine's prefill kernel with its extend rows."""
    dtype, hq, hkv, d, ps = torch.float16, 4, 2, 64, 16
    batch = make_batch([1, 9], [20, 4], hq, hkv, d, ps, dtype, device, seed=4, scale=2.0)
    prefill = ReferencePrefill()
    attn = mixed_attention(device, batch, hq, hkv, d, ps, dtype, sliding_window=6, logit_cap=3.0,
                           prefill_kernel=prefill)
    assert attn.prefill_kernel is prefill
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0], device=device)
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=1, max_q_len=9)
    out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"], sinks=sinks)
    call = prefill.calls[0]
    assert call["window"] == 6 and call["cap"] == 3.0 and call["sinks"] is sinks
    ref, lowp = reference_pair(batch, ps, sliding_window=6, logit_cap=3.0, sinks=sinks)
    assert_tolerance(out, ref, lowp, dtype)


@pytest.mark.parametrize("kw,why", [(dict(kv_dtype=FP8), "no dtype"), (dict(deterministic=True), "deterministic")])
def test_layers_the_prefill_kernel_does_not_take(device, kw, why):
    """An FP8 cache on a kernel without an FP8 path (FA2), deterministic mode on one without an
    invariant form: evenkv's Triton extend, saying why."""
    batch = make_batch([1, 6], [9, 4], 4, 2, 64, 16, torch.float16, device)
    attn = mixed_attention(device, batch, 4, 2, 64, 16, torch.float16, prefill_kernel=ReferencePrefill(), **kw)
    assert attn.prefill_kernel is None and why in attn.prefill_reason and "Triton" in attn.prefill_reason


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_fp8_cache_extend_rows_on_a_kernel_that_reads_fp8(device, deterministic):
    """A prefill kernel that reads an FP8 cache with the model's dtype (the engines' FA3, bf16)
    takes the extend rows over an FP8 cache too, in deterministic mode its invariant form, and
    gets the cache as stored with the layer's k_scale and v_scale; decode rows stay on evenkv."""
    hq, hkv, d, ps, dtype = 4, 2, 64, 16, torch.bfloat16
    batch = quantized(make_batch([1, 1, 6], [30, 9, 4], hq, hkv, d, ps, dtype, device, seed=3), 0.05, 0.04)
    kernel = ReferencePrefill(invariant=False if deterministic else None, fp8_cache_dtypes=(torch.bfloat16,))
    attn = mixed_attention(device, batch, hq, hkv, d, ps, dtype, prefill_kernel=kernel, kv_dtype=FP8,
                           deterministic=deterministic)
    assert attn.prefill_kernel is not None and "q cast to e4m3" in attn.prefill_reason
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=2, max_q_len=6)
    assert plan.delegated is not None and plan.extend is None
    out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"], k_scale=0.05, v_scale=0.04)
    (call,) = attn.prefill_kernel.calls
    assert call["kv_dtype"] == FP8 and call["scales"] == (0.05, 0.04) and call["rows"] == 6
    assert_tolerance(out, *reference_pair(batch, ps, k_scale=0.05, v_scale=0.04), dtype)


def test_fp8_cache_of_an_fp16_model_keeps_the_triton_extend(device):
    """FA3's 8-bit path writes bf16 only: an fp16 model over an FP8 cache keeps evenkv's Triton
    extend, saying why."""
    batch = make_batch([1, 6], [9, 4], 4, 2, 64, 16, torch.float16, device)
    attn = mixed_attention(device, batch, 4, 2, 64, 16, torch.float16, kv_dtype=FP8,
                           prefill_kernel=ReferencePrefill(fp8_cache_dtypes=(torch.bfloat16,)))
    assert attn.prefill_kernel is None and "the model is torch.float16" in attn.prefill_reason


def test_deterministic_mode_takes_the_invariant_prefill(device):
    """Deterministic mode runs extend rows on the engine kernel's batch- and chunking-invariant
    form (FA3 with one KV split) where it has one, and says so."""
    batch = make_batch([1, 6], [9, 4], 4, 2, 64, 16, torch.float16, device)
    attn = mixed_attention(device, batch, 4, 2, 64, 16, torch.float16, prefill_kernel=ReferencePrefill(invariant=False),
                           deterministic=True)
    assert attn.prefill_kernel.is_invariant and "batch and chunking invariant" in attn.prefill_reason
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=1, max_q_len=6)
    out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"])
    assert attn.prefill_kernel.calls and assert_tolerance(out, *reference_pair(batch, 16), torch.float16) is None


@pytest.mark.parametrize("policy,deterministic,words", [
    ("balanced", False, "balanced: the balanced plan"),
    ("balanced", True, "deterministic: each request cut into chunks of its own length"),
    ("fa3", False, "fa3: FA3-style split units"),
    ("none", False, "none: one CTA per request and head")])
def test_decode_reason_names_the_policy_and_mode(device, policy, deterministic, words):
    """``decode_reason``, the adapters' start-up line, says which decode kernels run, and
    whether in deterministic mode (which ``decode_reason`` of a default object never claims)."""
    attn = Attention(4, 2, 64, 16, torch.float16, device, 4, 8, policy, deterministic=deterministic)
    assert words in attn.decode_reason
    assert ("deterministic" in attn.decode_reason) == deterministic
    assert "walked" not in attn.decode_reason


def test_decode_reason_names_packed_kv_heads(device):
    attn = Attention(16, 2, 64, 16, torch.bfloat16, device, 4, 8, kv_dtype=torch.float8_e4m3fn)  # the default
    assert "KV heads walked 2 at a time, as one head of 128 columns" in attn.decode_reason


def test_prefill_switch(monkeypatch):
    from evenkv.attention import engine_prefill_wanted

    monkeypatch.delenv("EVENKV_PREFILL", raising=False)
    assert engine_prefill_wanted()
    monkeypatch.setenv("EVENKV_PREFILL", "triton")
    assert not engine_prefill_wanted()
    attn = Attention(4, 2, 64, 16, torch.float16, "cpu", 4, 8)
    assert attn.prefill_kernel is None and "(EVENKV_PREFILL=triton)" in attn.prefill_reason
    monkeypatch.setenv("EVENKV_PREFILL", "engine")
    with pytest.raises(ValueError, match="EVENKV_PREFILL.*auto.*engine"):
        engine_prefill_wanted()


@pytest.mark.parametrize("chunks", [2, 4])
def test_chunked_prefill_is_invariant_to_the_chunking(device, chunks):
    """A prompt prefilled in one go or in ``chunks`` chunks (each on the cache the earlier ones
    wrote, vLLM's layout) gives the same bits at every query position: each row's keys are
    walked in the same tiles, in the same order, whatever its query block holds."""
    dtype, hq, hkv, d, ps, n = torch.float16, 8, 2, 64, 16, 96
    batch = make_batch([n], [0], hq, hkv, d, ps, dtype, device, seed=5)
    one = extend(batch["q"], batch["k_cache"], batch["v_cache"], cu_seqlens_q=batch["cu_seqlens_q"],
                 seq_lens=batch["seq_lens"], page_table=batch["page_table"], page_size=ps, max_q_len=n)
    c = n // chunks
    for i in range(chunks):
        rows = slice(i * c, (i + 1) * c)
        part = extend(batch["q"][rows], batch["k_cache"], batch["v_cache"],
                      cu_seqlens_q=torch.tensor([0, c], dtype=torch.int32, device=device),
                      seq_lens=torch.tensor([(i + 1) * c], dtype=torch.int32, device=device),
                      page_table=batch["page_table"], page_size=ps, max_q_len=c)
        assert torch.equal(part, one[rows]), f"chunk {i} of {chunks}"
