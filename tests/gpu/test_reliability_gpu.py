"""GPU lane (``pytest -m gpu``): extreme sizes and long CUDA-graph soaks.

* B = 16384 short requests; one request of 4M tokens alone and beside 1000 short ones.
* Offsets past 2**31 elements for write_kv (int32 and int64 slot mappings, skipped
  slots) and extend/decode reading what it wrote (decode alone: test_decode_gpu.py).
* head_dim 256 with G = 16 (decode on both arch tables, and extend).
* CUDA graphs: one capture at max batch replayed 1000 times on growing requests whose
  finished rows become padding (length 0), each replay bitwise equal to an eager run;
  one graph per capture size, batches padded up to the next capture size.

Correctness on sampled rows with the fp32 reference and the tolerance rule
(test_decode_gpu.check_sample, test_extend.assert_tolerance). Memory stays below ~60 GiB
(the 4M-token reference is checked per KV head, on two query heads, to bound it).
"""

import itertools
import math

import pytest
import torch

import evenkv
from evenkv.kernels.reference import extend_reference
from evenkv.testing import GARBAGE_PAGE, random_paged_batch
from test_decode_gpu import capture_plan_run, check_sample
from test_extend import assert_tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU lane: no CUDA device")]

HQ, HKV, D = 32, 4, 128  # Qwen3-30B-A3B attention
VARIANTS = [("balanced", False), ("fa3", False), ("none", False), ("balanced", True)]
VARIANT_IDS = [f"{p}{'-det' if d else ''}" for p, d in VARIANTS]


def build(lens, page_size, *, hq=HQ, hkv=HKV, d=D, dtype=torch.bfloat16, seed=0, spare_cols=1):
    """q [B, hq, d], k/v [num_slots, hkv, d], seq_lens [B] int32, page_table [B, max_pages +
    spare_cols] int32 of a random batch on the GPU (``evenkv.testing``), pages in random order,
    GARBAGE_PAGE tails."""
    return random_paged_batch(lens, hq, hkv, d, page_size, dtype, "cuda", seed=seed, spare_pages=8,
                              spare_cols=spare_cols, tail=GARBAGE_PAGE)


def check_heads(out, q, k, v, seq_lens, pt, page_size, rows, kv_heads):
    """check_sample restricted to KV head h and its first and last query head: bounds the
    fp32 reference's memory (it expands K/V to every query head) for multi-million-token rows."""
    group = q.shape[1] // k.shape[1]
    for h in kv_heads:
        qh = [h * group, h * group + group - 1]
        check_sample(out[:, qh], q[:, qh], k[:, h:h + 1], v[:, h:h + 1], seq_lens, pt, page_size, rows)


def decode_once(policy, deterministic, q, k, v, seq_lens, pt, page_size, max_batch, **kw):
    attn = evenkv.DecodeAttention(q.shape[1], k.shape[1], q.shape[2], page_size, q.dtype, "cuda", max_batch,
                                  pt.shape[1], policy, deterministic=deterministic, max_total_tokens=k.shape[0], **kw)
    plan = attn.plan(seq_lens, pt)
    return attn.run(plan, q, k, v)


# -- extreme sizes ------------------------------------------------------------------


@pytest.mark.parametrize("policy,deterministic", VARIANTS, ids=VARIANT_IDS)
def test_b16384_short_requests(policy, deterministic):
    """16384 requests of 0-512 tokens (about 4.2M tokens, 8.6 GB of K/V)."""
    gen = torch.Generator().manual_seed(10)
    lens = torch.randint(1, 513, (16384,), generator=gen)
    lens[torch.randperm(16384, generator=gen)[:512]] = 0  # padding rows
    q, k, v, seq_lens, pt = build(lens.tolist(), 16, seed=10)
    out = decode_once(policy, deterministic, q, k, v, seq_lens, pt, 16, 16384)
    rows = [0, 1, 2, 4095, 8191, 12000, 16382, 16383] + torch.randint(0, 16384, (8,), generator=gen).tolist()
    check_sample(out, q, k, v, seq_lens, pt, 16, rows)
    assert torch.all(out[seq_lens == 0] == 0)


@pytest.fixture(scope="module")
def four_m_batch():
    """Request 0: 4M tokens; requests 1..1000: 1-2000 tokens (about 5.2M tokens, 10.7 GB of K/V)."""
    gen = torch.Generator().manual_seed(11)
    lens = [4 * 2**20] + torch.randint(1, 2001, (1000,), generator=gen).tolist()
    batch = build(lens, 16, seed=11)
    yield batch
    del batch
    torch.cuda.empty_cache()


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-1000"])
@pytest.mark.parametrize("policy,deterministic", VARIANTS, ids=VARIANT_IDS)
def test_4m_token_request(four_m_batch, policy, deterministic, beside):
    q, k, v, seq_lens, pt = four_m_batch
    batch = q.shape[0] if beside else 1
    q, seq_lens, pt = q[:batch], seq_lens[:batch], pt[:batch]
    out = decode_once(policy, deterministic, q, k, v, seq_lens, pt, 16, 1001)
    check_heads(out, q, k, v, seq_lens, pt, 16, [0], kv_heads=[0, HKV - 1])
    if beside:
        check_sample(out, q, k, v, seq_lens, pt, 16, [1, 2, 500, 999, 1000])


def test_offsets_past_int32_write_kv_extend_decode():
    """write_kv into slots whose element offset passes 2**31 (int32 and int64 slot
    mappings, skipped slots carrying NaN), then extend and decode over those tokens."""
    hkv, d, ps, dtype, dev = 8, 128, 16, torch.bfloat16, "cuda"
    num_pages = (2**31 // (hkv * d)) // ps + 64  # 4.3 GB per cache
    k_cache = torch.zeros(num_pages * ps, hkv, d, dtype=dtype, device=dev)
    v_cache = torch.zeros(num_pages * ps, hkv, d, dtype=dtype, device=dev)
    prefix, q_len = 400, 300
    seq = prefix + q_len
    npages = math.ceil(seq / ps)
    # The request's pages end one page before the cache's last: a skipped slot that
    # wrapped to index -1 would show in that last page.
    pages = torch.arange(num_pages - 1 - npages, num_pages - 1, dtype=torch.int32, device=dev)
    assert int(pages[0]) * ps * hkv * d > 2**31
    tok = torch.arange(seq, device=dev)
    slots = pages[tok // ps].long() * ps + tok % ps
    gen = torch.Generator(device=dev).manual_seed(12)
    k_tok = torch.randn(seq, hkv, d, device=dev, generator=gen).to(dtype)
    v_tok = torch.randn(seq, hkv, d, device=dev, generator=gen).to(dtype)
    # Two writes (prefix with int32 slots, new tokens with int64), each with skipped rows.
    for lo, hi, idx_dtype in ((0, prefix, torch.int32), (prefix, seq, torch.int64)):
        n = hi - lo
        skip = torch.zeros(n + 37, dtype=torch.bool, device=dev)
        skip[torch.randperm(n + 37, generator=gen, device=dev)[:37]] = True
        mapping = torch.full((n + 37,), -1, dtype=idx_dtype, device=dev)
        mapping[~skip] = slots[lo:hi].to(idx_dtype)
        k_new = torch.full((n + 37, hkv, d), float("nan"), dtype=dtype, device=dev)
        v_new = torch.full((n + 37, hkv, d), float("nan"), dtype=dtype, device=dev)
        k_new[~skip], v_new[~skip] = k_tok[lo:hi], v_tok[lo:hi]
        evenkv.write_kv(k_cache, v_cache, k_new, v_new, mapping)
    torch.cuda.synchronize()
    assert torch.equal(k_cache[slots], k_tok) and torch.equal(v_cache[slots], v_tok)
    last = slice((num_pages - 1) * ps, num_pages * ps)
    assert not k_cache[last].any() and not v_cache[last].any(), "a skipped slot (-1) was written"

    # Extend: the last q_len tokens are new (vLLM layout: already in the cache).
    q = torch.randn(q_len, 32, d, device=dev, generator=gen).to(dtype)
    batch = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                 cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32, device=dev),
                 seq_lens=torch.tensor([seq], dtype=torch.int32, device=dev), page_table=pages[None])
    out = evenkv.extend(q, k_cache, v_cache, cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"],
                        page_table=batch["page_table"], page_size=ps, max_q_len=q_len)
    args = (q, k_cache, v_cache, batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], ps)
    assert_tolerance(out, extend_reference(*args), extend_reference(*args, compute_dtype=dtype), dtype)

    # Decode: the request's last token attends to all 700.
    qd = q[-1:].contiguous()
    for policy, deterministic in VARIANTS:
        outd = decode_once(policy, deterministic, qd, k_cache, v_cache, batch["seq_lens"], pages[None], ps, 1)
        check_sample(outd, qd, k_cache, v_cache, batch["seq_lens"], pages[None], ps, [0])
    del k_cache, v_cache
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
@pytest.mark.parametrize("policy,deterministic", VARIANTS, ids=VARIANT_IDS)
def test_head_dim_256_group_16_decode(policy, deterministic, arch):
    """Hq 32, Hkv 2, D 256: a 256K request among 127 of 0-8K tokens."""
    gen = torch.Generator().manual_seed(13)
    lens = [262144] + torch.randint(0, 8193, (127,), generator=gen).tolist()
    q, k, v, seq_lens, pt = build(lens, 16, hq=32, hkv=2, d=256, seed=13)
    out = decode_once(policy, deterministic, q, k, v, seq_lens, pt, 16, 128, arch=arch)
    check_sample(out, q, k, v, seq_lens, pt, 16, [0, 1, 64, 127])


def test_head_dim_256_group_16_extend():
    """Extend with Hq 32, Hkv 2, D 256: a 2K chunk on a 30K prefix, a decode-like row, a short prompt."""
    q_lens, prefixes = [2048, 1, 37], [30000, 100, 0]
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    _, k, v, seq_lens, pt = build(seq, 16, hq=32, hkv=2, d=256, seed=14)
    gen = torch.Generator(device="cuda").manual_seed(14)
    q = torch.randn(sum(q_lens), 32, 256, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.tensor(list(itertools.accumulate(q_lens, initial=0)), dtype=torch.int32, device="cuda")
    out = evenkv.extend(q, k, v, cu_seqlens_q=cu, seq_lens=seq_lens, page_table=pt, page_size=16,
                        max_q_len=max(q_lens))
    args = (q, k, v, cu, seq_lens, pt, 16)
    ref = extend_reference(*args, max_scores=1 << 28)
    lowp = extend_reference(*args, compute_dtype=torch.bfloat16, max_scores=1 << 28)
    assert_tolerance(out, ref, lowp, torch.bfloat16)


# -- CUDA graphs --------------------------------------------------------------------

GRAPH_MAX_BATCH, GRAPH_MAX_LEN, GRAPH_PAGE = 256, 4096, 16


@pytest.fixture(scope="module")
def graph_pool():
    """Caches and a page table for GRAPH_MAX_BATCH requests of up to GRAPH_MAX_LEN tokens (2.1 GB)."""
    return build([GRAPH_MAX_LEN] * GRAPH_MAX_BATCH, GRAPH_PAGE, seed=15)


def _attn(policy, deterministic, pt):
    return evenkv.DecodeAttention(HQ, HKV, D, GRAPH_PAGE, torch.bfloat16, "cuda", GRAPH_MAX_BATCH, pt.shape[1],
                                  policy, deterministic=deterministic)


@pytest.mark.parametrize("policy,deterministic", VARIANTS, ids=VARIANT_IDS)
def test_cuda_graph_1000_replays_growing_requests(graph_pool, policy, deterministic):
    """One capture at max batch; 1000 replays of a decode loop: every live request grows
    by one token per step, a request that reaches its end finishes and its row becomes
    padding (length 0) for a few steps, then a new request takes the row. q changes every
    step. Each replay equals an eager plan + run bitwise; sampled rows meet the rule."""
    q0, k, v, _, pt = graph_pool
    b = GRAPH_MAX_BATCH
    gen = torch.Generator().manual_seed(16)
    q = q0.clone()
    seq_lens = torch.full((b,), GRAPH_MAX_LEN, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    graph = capture_plan_run(_attn(policy, deterministic, pt), q, k, v, seq_lens, pt, out)
    eager = _attn(policy, deterministic, pt)

    lens = torch.randint(1, GRAPH_MAX_LEN // 2, (b,), generator=gen)
    ends = torch.minimum(lens + torch.randint(1, 2000, (b,), generator=gen), torch.tensor(GRAPH_MAX_LEN))
    idle = torch.zeros(b, dtype=torch.int64)  # steps a finished row stays padding
    padded_steps = 0
    for step in range(1000):
        seq_lens.copy_(lens)
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        graph.replay()
        plan = eager.plan(seq_lens, pt)
        want = eager.run(plan, q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {step} differs from the eager run"
        assert torch.all(out[seq_lens == 0] == 0), f"replay {step}: a padding row is not zeros"
        if step % 100 == 0:
            check_sample(out, q, k, v, seq_lens, pt, GRAPH_PAGE, [0, 1, b // 2, b - 1])
        padded_steps += int((lens == 0).any())
        # advance the decode loop
        live = lens > 0
        lens[live] += 1
        done = live & (lens >= ends)
        lens[done] = 0
        idle[done] = torch.randint(1, 6, (int(done.sum()),), generator=gen)
        waiting = ~live & ~done
        idle[waiting] -= 1
        start = waiting & (idle <= 0)
        lens[start] = torch.randint(1, 64, (int(start.sum()),), generator=gen)
        ends[start] = torch.minimum(lens[start] + torch.randint(1, 3000, (int(start.sum()),), generator=gen),
                                    torch.tensor(GRAPH_MAX_LEN))
    assert padded_steps > 100, f"only {padded_steps} steps had padding rows: the soak did not exercise them"


CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@pytest.mark.parametrize("policy,deterministic", VARIANTS, ids=VARIANT_IDS)
def test_cuda_graph_replays_across_capture_sizes(graph_pool, policy, deterministic):
    """One graph per capture size over shared buffers (one DecodeAttention, as an engine
    does); 300 batches of random size n run on the graph of the smallest capture size
    >= n, rows [n, size) padded (length 0, q garbage). Each replay equals an eager run of
    the padded batch bitwise and its padding rows are zeros; the real rows equal an eager
    run of the unpadded batch bitwise under deterministic=True, else meet the rule."""
    q0, k, v, _, pt = graph_pool
    gen = torch.Generator().manual_seed(17)
    q = q0.clone()
    seq_lens = torch.full((GRAPH_MAX_BATCH,), GRAPH_MAX_LEN, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    attn = _attn(policy, deterministic, pt)
    graphs = {s: capture_plan_run(attn, q[:s], k, v, seq_lens[:s], pt[:s], out[:s]) for s in CAPTURE_SIZES}
    eager = _attn(policy, deterministic, pt)
    used = set()
    for step in range(300):
        if step < len(CAPTURE_SIZES):  # every capture size first, then random sizes
            lo = CAPTURE_SIZES[step - 1] + 1 if step else 1
            n = int(torch.randint(lo, CAPTURE_SIZES[step] + 1, (1,), generator=gen))
        else:
            n = int(torch.randint(1, GRAPH_MAX_BATCH + 1, (1,), generator=gen))
        size = next(s for s in CAPTURE_SIZES if s >= n)
        used.add(size)
        lens = torch.zeros(GRAPH_MAX_BATCH, dtype=torch.int32)
        lens[:n] = torch.randint(1, GRAPH_MAX_LEN + 1, (n,), generator=gen)
        seq_lens.copy_(lens)
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        q[n:size] = float("nan")  # padded rows' q is garbage in an engine
        graphs[size].replay()
        plan = eager.plan(seq_lens[:size], pt[:size])
        want = eager.run(plan, q[:size], k, v)
        plan = eager.plan(seq_lens[:n], pt[:n])
        unpadded = eager.run(plan, q[:n], k, v)
        torch.cuda.synchronize()
        assert torch.equal(out[:size], want), f"step {step}: replay (n={n}, size={size}) differs from eager"
        assert torch.all(out[n:size] == 0), f"step {step}: padding rows are not zeros"
        if deterministic:
            assert torch.equal(out[:n], unpadded), f"step {step}: padding changed the real rows' bits"
        elif step % 30 == 0:
            check_sample(out[:size], q[:size], k, v, seq_lens[:size], pt[:size], GRAPH_PAGE, [0, n // 2, n - 1])
            check_sample(unpadded, q[:n], k, v, seq_lens[:n], pt[:n], GRAPH_PAGE, [0, n - 1])
    assert used == set(CAPTURE_SIZES), f"capture sizes never used: {set(CAPTURE_SIZES) - used}"
