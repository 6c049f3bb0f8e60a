"""GPU lane (``pytest -m gpu``): realistic shapes, every policy and both arch tables,
page sizes 1 and 16, CUDA-graph capture of plan + run with replays on changed lengths.
Tolerance rule as in the CPU lane (helpers.assert_close_to_reference), checked on a
sample of requests because the fp32 reference loops in Python."""

import pytest
import torch

import evenkv
from evenkv.kernels.reference import decode_reference, extend_reference
from evenkv.testing import random_paged_batch
from helpers import TOLERANCE_FLOOR, assert_extend_close_to_reference, lowp_decode

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU lane: no CUDA device")]

HQ, HKV, D = 32, 4, 128


def skewed_lens(total, batch, share, gen):
    """`batch` lengths summing to `total`; request 0 holds `share` of it, the rest split evenly (>= 1 each)."""
    if batch == 1:
        return [total]
    long = int(total * share) if share else total // batch
    rest = total - long
    lens = [long] + [rest // (batch - 1)] * (batch - 1)
    for i in range(rest % (batch - 1)):
        lens[1 + i] += 1
    perm = torch.randperm(batch - 1, generator=gen).tolist()
    return [lens[0]] + [lens[1 + p] for p in perm]


def build(lens, page_size, dtype=torch.bfloat16, seed=0, hq=HQ, hkv=HKV, d=D):
    """q, k, v, seq_lens, page_table of a random batch on the GPU (``evenkv.testing``)."""
    return random_paged_batch(lens, hq, hkv, d, page_size, dtype, "cuda", seed=seed, spare_pages=8)


def check_sample(out, q, k, v, seq_lens, pt, page_size, rows):
    rows = torch.tensor(sorted({r for r in rows if 0 <= r < q.shape[0]}), device=q.device)
    sub = (q[rows], k, v, seq_lens[rows], pt[rows], page_size)
    ref = decode_reference(*sub)
    base = (lowp_decode(*sub).float() - ref).abs().max().item()
    err = (out[rows].float() - ref).abs().max().item()
    bound = 2 * base + TOLERANCE_FLOOR[q.dtype]
    assert err <= bound, f"error {err:.3e} > {bound:.3e} (torch lowp {base:.3e})"


CASES = [  # (total tokens, batch, long share)
    (262144, 1, 0.0), (262144, 8, 0.8), (262144, 64, 0.4), (262144, 512, 0.8), (262144, 2048, 0.0),
    (1048576, 2048, 0.6), (1048576, 3, 0.0),
]


@pytest.mark.parametrize("policy", evenkv.POLICIES)
@pytest.mark.parametrize("arch", ["sm90", "sm80"])
@pytest.mark.parametrize("page_size", [16, 1])
def test_realistic_shapes(policy, arch, page_size):
    gen = torch.Generator().manual_seed(1)
    for total, batch, share in CASES:
        lens = skewed_lens(total, batch, share, gen)
        q, k, v, seq_lens, pt = build(lens, page_size)
        attn = evenkv.DecodeAttention(HQ, HKV, D, page_size, q.dtype, "cuda", 2048, pt.shape[1], policy, arch=arch)
        plan = attn.plan(seq_lens, pt)
        out = attn.run(plan, q, k, v)
        check_sample(out, q, k, v, seq_lens, pt, page_size, [0, 1, batch // 2, batch - 1])


def fp8_copy(cache, scale):
    """cache (real values) stored as e4m3: real / scale, saturated (what write_kv stores)."""
    return (cache.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("name,shape,layer,fp8", [
    ("gpt-oss-window", (64, 8, 64), dict(sliding_window=128), True),
    ("gpt-oss-full", (64, 8, 64), dict(), True),
    ("gpt-oss-one-head", (64, 8, 64), dict(pack_kv_heads=False), True),
    ("qwen3-fp8", (HQ, HKV, D), dict(), True),
    ("qwen3-next-fp8", (16, 2, 256), dict(), True),
    ("gemma-like", (16, 8, 256), dict(sliding_window=4096, logit_cap=50.0), False),
])
@pytest.mark.parametrize("policy", evenkv.POLICIES)
def test_layer_features_realistic(name, shape, layer, fp8, policy):
    """Windows, soft-caps, sinks (gpt-oss shapes) and FP8 caches at serving sizes, skewed batches."""
    hq, hkv, d = shape
    layer = dict(layer)
    pack = layer.pop("pack_kv_heads", True)
    gen = torch.Generator().manual_seed(2)
    sinks = torch.randn(hq, generator=gen).cuda() if name.startswith("gpt-oss") else None
    for total, batch, share in ((262144, 64, 0.8), (262144, 512, 0.4), (65536, 1, 0.0)):
        lens = skewed_lens(total, batch, share, gen)
        q, k, v, seq_lens, pt = build(lens, 16, hq=hq, hkv=hkv, d=d)
        terms = {}
        if fp8:
            k, v = fp8_copy(k, 0.02), fp8_copy(v, 0.01)
            terms = dict(k_scale=0.02, v_scale=0.01)
        attn = evenkv.DecodeAttention(hq, hkv, d, 16, q.dtype, "cuda", 512, pt.shape[1], policy,
                                      kv_dtype=k.dtype, pack_kv_heads=pack, **layer)
        # head dim 64 over FP8 walks two KV heads as one unless told not to
        assert attn.head_pack == (2 if fp8 and d == 64 and pack else 1)
        out = attn.run(attn.plan(seq_lens, pt), q, k, v, sinks=sinks, **terms)
        rows = torch.tensor(sorted({r for r in (0, 1, batch // 2, batch - 1) if r < batch}), device="cuda")
        ref_terms = dict(layer, sinks=sinks, **terms)
        sub = (q[rows], k, v, seq_lens[rows], pt[rows], 16)
        cu = torch.arange(rows.numel() + 1, device="cuda")
        ref = decode_reference(*sub, **ref_terms)
        lowp = extend_reference(sub[0], k, v, cu, sub[3], sub[4], 16, compute_dtype=q.dtype, **ref_terms)
        err = (out[rows].float() - ref).abs().max().item()
        bound = 2 * (lowp.float() - ref).abs().max().item() + TOLERANCE_FLOOR[q.dtype]
        assert err <= bound, f"{name} {policy} B={batch}: error {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("shape,page_size", [((HQ, HKV, D), 16), ((32, 8, 64), 1)], ids=["d128-p16", "d64-p1"])
def test_many_segments_grid_switch(shape, page_size):
    """One DecodeAttention (sm90 table) plans B = 2048 with the many-segments row and its
    larger grid, B = 64 with the main row, then B = 2048 again: each run matches the
    reference (the workspaces hold the larger grid) and leaves the merge counters at 0.
    Qwen3-30B-A3B at page 16; Llama-3.2-1B (head_dim 64, whose row serves every page size) at page 1."""
    hq, hkv, d = shape
    gen = torch.Generator().manual_seed(5)
    attn = evenkv.DecodeAttention(hq, hkv, d, page_size, torch.bfloat16, "cuda", 2048, 262144 // page_size + 2,
                                  arch="sm90")
    many, _ = attn.launch_config(2048)
    assert many.name.endswith("-many") and attn.launch_config(64) == (attn.config, attn.num_ctas)
    for batch, share in ((2048, 0.4), (64, 0.8), (2048, 0.0)):
        lens = skewed_lens(262144, batch, share, gen)
        q, k, v, seq_lens, pt = build(lens, page_size, seed=batch, hq=hq, hkv=hkv, d=d)
        plan = attn.plan(seq_lens, pt)
        assert plan.config == (many if batch == 2048 else attn.config)
        out = attn.run(plan, q, k, v)
        check_sample(out, q, k, v, seq_lens, pt, page_size, [0, 1, batch // 2, batch - 1])
        assert int(attn._merge_counters.abs().sum()) == 0


def capture_plan_run(attn, q, k, v, seq_lens, pt, out):
    """Warm up (compile) outside the capture, then capture plan + run into one CUDA graph
    that reads seq_lens/pt/q and writes out in place."""
    plan = attn.plan(seq_lens, pt)
    attn.run(plan, q, k, v, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = attn.plan(seq_lens, pt)
        attn.run(plan, q, k, v, out=out)
    return graph


@pytest.mark.parametrize("policy", evenkv.POLICIES)
def test_cuda_graph_capture_and_replay(policy):
    """Capture plan + run once; replay with other lengths of the same batch size (incl.
    padding rows of length 0) and compare every replay with an eager run."""
    batch, page_size = 64, 16
    gen = torch.Generator().manual_seed(2)
    max_len = 4096
    q, k, v, _, pt = build([max_len] * batch, page_size, seed=3)
    seq_lens = torch.full((batch,), max_len, dtype=torch.int32, device="cuda")
    attn = evenkv.DecodeAttention(HQ, HKV, D, page_size, q.dtype, "cuda", batch, pt.shape[1], policy)
    eager = evenkv.DecodeAttention(HQ, HKV, D, page_size, q.dtype, "cuda", batch, pt.shape[1], policy)
    out = torch.empty_like(q)
    graph = capture_plan_run(attn, q, k, v, seq_lens, pt, out)
    for step in range(20):
        lens = torch.randint(0, max_len + 1, (batch,), generator=gen)
        if step % 3 == 0:
            lens[torch.randperm(batch, generator=gen)[:batch // 4]] = 0  # padded rows
        if step % 4 == 1:
            lens[:] = 1
            lens[0] = max_len  # one dominant request
        seq_lens.copy_(lens)
        graph.replay()
        plan = eager.plan(seq_lens, pt)
        want = eager.run(plan, q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {step} differs from the eager run"
        if step % 5 == 0:
            check_sample(out, q, k, v, seq_lens, pt, page_size, [0, 1, batch - 1])


def test_direct_launches_match_tritons_dispatch(monkeypatch):
    """After a specialization's first launch, the plan, decode and merge kernels launch
    without Triton's dispatch (``launching.DirectLaunches``): the same bits as launches
    through ``kernel[grid]``, and no dispatch at all."""
    from triton.runtime.jit import JITFunction

    from evenkv.kernels import launching

    lens = skewed_lens(262144, 64, 0.4, torch.Generator().manual_seed(4))
    q, k, v, seq_lens, pt = build(lens, 16, seed=5)
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, q.dtype, "cuda", 64, pt.shape[1])
    with monkeypatch.context() as through_triton:
        through_triton.setattr(launching.DirectLaunches, "__call__",
                               lambda self, grid, args, kwargs: self.kernel[grid](*args, **kwargs))
        want = attn.run(attn.plan(seq_lens, pt), q, k, v)
    attn.run(attn.plan(seq_lens, pt), q, k, v)  # each specialization's first launch: kept
    dispatched = []
    dispatch = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, **kwargs: dispatched.append(self.fn.__name__)
                        or dispatch(self, *args, **kwargs))
    got = attn.run(attn.plan(seq_lens, pt), q, k, v)
    torch.cuda.synchronize()
    assert dispatched == []
    assert torch.equal(got, want)


def test_large_cache_offsets_pass_int32():
    """Cache slots beyond 2**31 elements: slot * stride must be computed in int64."""
    hkv, d, page_size = 8, 128, 16
    slots = (2**31) // (hkv * d) + 4096  # ~2.1M slots, 4.3 GB per bf16 cache
    k = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16)
    num_pages = slots // page_size
    lens = [3000, 17]
    pt = torch.stack([torch.arange(num_pages - 200, num_pages - 200 + 190, dtype=torch.int32, device="cuda"),
                      torch.arange(0, 190, dtype=torch.int32, device="cuda")])
    q = torch.randn(2, 32, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = evenkv.decode(q, k, v, seq_lens, pt, page_size)
    check_sample(out, q, k, v, seq_lens, pt, page_size, [0, 1])


def test_deterministic_batch_invariance_50_batches():
    """deterministic=True: one request of 100K tokens in 50 random batches (B up to 2048,
    neighbours of 1-4K tokens, random position) gives bitwise identical bytes, under both decode
    rows: batches of 528+ requests (4 segments per CTA of the main grid) run the many-segments
    row, whose tile is the main row's."""
    gen = torch.Generator().manual_seed(4)
    pool = 2048
    pool_lens = [100_000] + [int(x) for x in torch.randint(1, 4_000, (pool - 1,), generator=gen)]
    q, k, v, seq_lens, pt = build(pool_lens, 16, seed=5)
    # The workspace is sized from the pool's tokens, as the engines size it.
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, q.dtype, "cuda", pool, pt.shape[1], deterministic=True,
                                  max_total_tokens=k.shape[0])
    plan = attn.plan(seq_lens[:1], pt[:1])
    want = attn.run(plan, q[:1], k, v)[0].clone()
    check_sample(attn.run(plan, q[:1], k, v), q[:1], k, v, seq_lens[:1], pt[:1], 16, [0])
    configs = {attn.launch_config(1)[0].name}
    for i in range(50):
        batch = pool if i == 0 else int(torch.randint(1, pool + 1, (1,), generator=gen))
        rows = (torch.randperm(pool - 1, generator=gen)[:batch - 1] + 1).tolist()
        pos = int(torch.randint(0, batch, (1,), generator=gen))
        rows.insert(pos, 0)
        idx = torch.tensor(rows, device="cuda")
        plan = attn.plan(seq_lens[idx], pt[idx])
        configs.add(plan.config.name)
        out = attn.run(plan, q[idx], k, v)
        assert torch.equal(out[pos], want), (batch, pos, plan.config.name)
    assert len(configs) == 2, configs


VERIFY_CASES = [  # (total tokens, batch, long share, query tokens per request)
    (262144, 1, 0.0, 4), (262144, 16, 0.8, 4), (262144, 256, 0.4, 6), (262144, 2048, 0.0, 8),
    (1048576, 64, 0.6, 16), (65536, 512, 0.8, 2),
]


def verify_queries(lens, q_len, hq, d, gen):
    """q [B * q_len, Hq, D] bf16 and cu_seqlens_q [B + 1] int32 of B requests of q_len tokens."""
    q = torch.randn(len(lens) * q_len, hq, d, generator=gen).to(torch.bfloat16).cuda()
    cu = torch.arange(0, len(lens) * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    return q, cu


def check_verify_sample(out, q, k, v, cu, seq_lens, pt, page_size, requests, **terms):
    """Tolerance rule on sampled requests' query rows, against extend_reference (causal)."""
    for b in sorted({r for r in requests if 0 <= r < seq_lens.shape[0]}):
        lo, hi = int(cu[b]), int(cu[b + 1])
        sub_cu = torch.tensor([0, hi - lo], dtype=torch.int32, device="cuda")
        assert_extend_close_to_reference(out[lo:hi], q[lo:hi], k, v, sub_cu, seq_lens[b:b + 1], pt[b:b + 1],
                                         page_size, **terms)


@pytest.mark.parametrize("policy,deterministic", [("balanced", False), ("balanced", True), ("fa3", False),
                                                  ("none", False)])
@pytest.mark.parametrize("page_size", [16, 1])
def test_verify_rows_realistic(policy, deterministic, page_size, no_tf32):
    """Speculative-verify rows (2 to 16 query tokens per request) on Qwen3-30B-A3B's attention
    shape, skewed batches up to B = 2048 and 1M tokens, every policy: the sampled requests'
    rows against the fp32 reference."""
    gen = torch.Generator().manual_seed(7)
    for total, batch, share, q_len in VERIFY_CASES:
        lens = skewed_lens(total, batch, share, gen)
        _, k, v, seq_lens, pt = build(lens, page_size)
        q, cu = verify_queries(lens, q_len, HQ, D, gen)
        attn = evenkv.DecodeAttention(HQ, HKV, D, page_size, q.dtype, "cuda", 2048, pt.shape[1], policy,
                                      max_q_len=q_len, deterministic=deterministic)
        out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=q_len), q, k, v)
        check_verify_sample(out, q, k, v, cu, seq_lens, pt, page_size, [0, 1, batch // 2, batch - 1])


@pytest.mark.parametrize("deterministic", [False, True], ids=["balanced", "deterministic"])
@pytest.mark.parametrize("hq,hkv,d", [(64, 8, 64), (16, 2, 256)], ids=["gpt-oss", "qwen3-next"])
def test_verify_rows_of_other_head_dims(hq, hkv, d, deterministic, no_tf32):
    """Verify rows of 4 and 8 tokens at head dims 64 and 256 (gpt-oss-20b's and Qwen3-Next's
    shapes: their own rows), a skewed batch of 16 on the main row and a batch of 2048 on the
    many-segments row where the row has one: the sampled requests' rows against the fp32 reference."""
    gen = torch.Generator().manual_seed(9)
    for total, batch, share in ((262144, 16, 0.8), (131072, 2048, 0.0)):
        lens = skewed_lens(total, batch, share, gen)
        _, k, v, seq_lens, pt = build(lens, 16, hq=hq, hkv=hkv, d=d, seed=batch)
        for q_len in (4, 8):
            q, cu = verify_queries(lens, q_len, hq, d, gen)
            attn = evenkv.DecodeAttention(hq, hkv, d, 16, q.dtype, "cuda", batch, pt.shape[1], max_q_len=q_len,
                                          deterministic=deterministic)
            out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=q_len), q, k, v)
            check_verify_sample(out, q, k, v, cu, seq_lens, pt, 16, [0, 1, batch // 2, batch - 1])


def test_verify_tree_masks_and_layer_terms(no_tf32):
    """Tree masks (a 7-token draft tree), alone and under a 128-token window (each tree token's
    window starting from its depth), and a 128-token window with sinks over an FP8 cache
    (gpt-oss's shape): verify rows against the reference."""
    gen = torch.Generator().manual_seed(8)
    lens = skewed_lens(131072, 64, 0.6, gen)
    tree_rows = [0b0000001, 0b0000011, 0b0000101, 0b0001011, 0b0010011, 0b0100101, 0b1000011]
    _, k, v, seq_lens, pt = build(lens, 16)
    q, cu = verify_queries(lens, 7, HQ, D, gen)
    tree = torch.tensor(tree_rows * len(lens), dtype=torch.int32, device="cuda")
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, q.dtype, "cuda", 64, pt.shape[1], max_q_len=7, tree_masks=True)
    out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=7, tree_mask=tree), q, k, v)
    check_verify_sample(out, q, k, v, cu, seq_lens, pt, 16, [0, 1, 63], tree_mask=tree)
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, q.dtype, "cuda", 64, pt.shape[1], max_q_len=7, tree_masks=True,
                                  sliding_window=128)
    out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=7, tree_mask=tree), q, k, v)
    check_verify_sample(out, q, k, v, cu, seq_lens, pt, 16, [0, 1, 63], tree_mask=tree, sliding_window=128)
    hq, hkv, d = 64, 8, 64
    _, k, v, seq_lens, pt = build(lens, 16, hq=hq, hkv=hkv, d=d, seed=3)
    q, cu = verify_queries(lens, 4, hq, d, gen)
    k8, v8 = fp8_copy(k, 0.05), fp8_copy(v, 0.04)
    sinks = torch.randn(hq, device="cuda")
    attn = evenkv.DecodeAttention(hq, hkv, d, 16, q.dtype, "cuda", 64, pt.shape[1], max_q_len=4,
                                  sliding_window=128, kv_dtype=torch.float8_e4m3fn)
    out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=4), q, k8, v8, sinks=sinks, k_scale=0.05,
                   v_scale=0.04)
    check_verify_sample(out, q, k8, v8, cu, seq_lens, pt, 16, [0, 1, 63], sliding_window=128, sinks=sinks,
                        k_scale=0.05, v_scale=0.04)


def test_deterministic_verify_rows_across_walks():
    """deterministic=True, verify rows of 4 tokens (Qwen3-30B-A3B: 32 tile rows): one request of
    100K tokens alone and in 12 random batches (B up to 2048) gives bitwise identical bytes,
    whether its batch runs the row that walks one loop per segment or, with many short
    segments, the one-loop row of the same tile."""
    gen = torch.Generator().manual_seed(12)
    pool, q_len = 2048, 4
    pool_lens = [100_000] + [int(x) for x in torch.randint(q_len, 4_000, (pool - 1,), generator=gen)]
    _, k, v, seq_lens, pt = build(pool_lens, 16, seed=13)
    q, _ = verify_queries(pool_lens, q_len, HQ, D, gen)
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, q.dtype, "cuda", pool, pt.shape[1], deterministic=True,
                                  max_q_len=q_len, max_total_tokens=k.shape[0])
    cu1 = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    want = attn.run(attn.plan(seq_lens[:1], pt[:1], cu_seqlens_q=cu1, q_len=q_len), q[:q_len], k, v).clone()
    check_verify_sample(want, q[:q_len], k, v, cu1, seq_lens[:1], pt[:1], 16, [0])
    walks = {attn.launch_config(1, q_len)[0].segment_loops}
    for i in range(12):
        batch = pool if i == 0 else int(torch.randint(1, pool + 1, (1,), generator=gen))
        rows = (torch.randperm(pool - 1, generator=gen)[:batch - 1] + 1).tolist()
        pos = int(torch.randint(0, batch, (1,), generator=gen))
        rows.insert(pos, 0)
        q_rows = torch.tensor([r * q_len + t for r in rows for t in range(q_len)], device="cuda")
        cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
        idx = torch.tensor(rows, device="cuda")
        plan = attn.plan(seq_lens[idx], pt[idx], cu_seqlens_q=cu, q_len=q_len)
        walks.add(plan.config.segment_loops)
        out = attn.run(plan, q[q_rows], k, v)
        assert torch.equal(out[pos * q_len:(pos + 1) * q_len], want), (batch, pos, plan.config.name)
    assert walks == {True, False}, walks


def test_verify_rows_under_cuda_graphs():
    """Plan + run of verify rows captured once and replayed with new lengths and new query rows
    (vLLM's uniform-batch full graphs): equal to eager runs, bitwise."""
    gen = torch.Generator().manual_seed(9)
    batch, q_len = 64, 4
    lens = skewed_lens(65536, batch, 0.5, gen)
    _, k, v, seq_lens, pt = build(lens, 16)
    q, cu = verify_queries(lens, q_len, HQ, D, gen)
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, q.dtype, "cuda", batch, pt.shape[1], max_q_len=q_len)
    lens_buf, out = seq_lens.clone(), torch.empty_like(q)
    attn.run(attn.plan(lens_buf, pt, cu_seqlens_q=cu, q_len=q_len), q, k, v, out=out)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(attn.plan(lens_buf, pt, cu_seqlens_q=cu, q_len=q_len), q, k, v, out=out)
    for step in range(5):
        new = torch.randint(q_len, int(seq_lens.max()), (batch,), generator=gen, dtype=torch.int32)
        lens_buf.copy_(torch.minimum(new.cuda(), seq_lens))
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype).cuda())
        graph.replay()
        eager = attn.run(attn.plan(lens_buf, pt, cu_seqlens_q=cu, q_len=q_len), q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), step
