"""CPU-lane decode tests: every policy x page size x G x head_dim x dtype against the
fp32 reference (tolerance rule in helpers.py), on batches with uniform, one-dominant
and empty-ish requests, plus plan reuse, arch tables and edge cases."""

import itertools

import pytest
import torch

import evenkv
from evenkv.kernels.plan_launch import PAGE_TABLE_BLOCK
from helpers import aot_compile, assert_close_to_reference, make_paged_batch, stream_merge_path

BATCHES = {
    "uniform": [40, 40, 40, 40],
    "one_dominant": [300, 3, 1, 7, 2],
    "empty_ish": [0, 1, 0, 17, 0],
}
GROUPS = {1: (2, 2), 4: (8, 2), 7: (7, 1), 8: (16, 2)}  # G -> (Hq, Hkv)


def _cases():
    # Full product of policy x page x G x head_dim; dtype and batch kind rotate so every
    # value of each meets every policy and page size (the interpreter is slow).
    kinds, dtypes = list(BATCHES), [torch.float16, torch.bfloat16]
    return [pytest.param(policy, page, g, d, dtypes[i % 2], kinds[i % 3],
                         id=f"{policy}-p{page}-g{g}-d{d}-{str(dtypes[i % 2])[6:]}-{kinds[i % 3]}")
            for i, (policy, page, g, d) in enumerate(itertools.product(evenkv.POLICIES, (1, 16), GROUPS, (64, 128)))]


@pytest.mark.parametrize("policy,page_size,group,head_dim,dtype,kind", _cases())
def test_decode_matches_reference(device, policy, page_size, group, head_dim, dtype, kind):
    hq, hkv = GROUPS[group]
    lens = BATCHES[kind]
    q, kc, vc, seq_lens, pt = make_paged_batch(lens, hq, hkv, head_dim, page_size, dtype, device, seed=len(lens))
    attn = evenkv.DecodeAttention(hq, hkv, head_dim, page_size, dtype, device, 8, pt.shape[1], policy, num_ctas=5)
    plan = attn.plan(seq_lens, pt)
    out = attn.run(plan, q, kc, vc)
    assert_close_to_reference(out, q, kc, vc, seq_lens, pt, page_size)
    assert torch.all(out[seq_lens == 0] == 0)


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_both_arch_tables(device, arch, monkeypatch):
    monkeypatch.setenv("EVENKV_ARCH", arch)
    q, kc, vc, seq_lens, pt = make_paged_batch([130, 2, 64], 8, 2, 64, 16, torch.float16, device)
    attn = evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 4, pt.shape[1], num_ctas=3)
    assert attn.arch == arch and attn.config.name.startswith(arch)
    plan = attn.plan(seq_lens, pt)
    assert_close_to_reference(attn.run(plan, q, kc, vc), q, kc, vc, seq_lens, pt, 16)


def test_plan_reuse_and_replan(device):
    """One plan serves several runs (layers); a new plan with other lengths replaces it."""
    q, kc, vc, seq_lens, pt = make_paged_batch([90, 5, 33], 8, 2, 64, 16, torch.float16, device)
    attn = evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 4, pt.shape[1], num_ctas=4)
    plan = attn.plan(seq_lens, pt)
    first = attn.run(plan, q, kc, vc)
    assert torch.equal(attn.run(plan, q, kc, vc), first)
    shorter = torch.tensor([3, 0, 20], dtype=torch.int32, device=device)
    plan = attn.plan(shorter, pt)
    assert_close_to_reference(attn.run(plan, q, kc, vc), q, kc, vc, shorter, pt, 16)


def test_many_splits_and_strided_inputs(device):
    """One long request cut into many pieces; q, out and the caches non-contiguous."""
    q, kc, vc, seq_lens, pt = make_paged_batch([700, 1], 8, 2, 64, 1, torch.float16, device)
    big = torch.zeros(kc.shape[0], 4, 64, dtype=kc.dtype, device=device)
    big[:, 1:3] = kc  # cache view with a head stride of 64 and a slot stride of 256
    kc_strided = big[:, 1:3]
    q_strided = torch.zeros(2, 16, 64, dtype=q.dtype, device=device)[:, ::2]
    q_strided.copy_(q)
    out = torch.empty(2, 8, 128, dtype=q.dtype, device=device)[..., :64]
    attn = evenkv.DecodeAttention(8, 2, 64, 1, torch.float16, device, 2, pt.shape[1], num_ctas=11)
    plan = attn.plan(seq_lens, pt)
    res = attn.run(plan, q_strided, kc_strided, vc, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert_close_to_reference(out, q, kc, vc, seq_lens, pt, 1)


def test_empty_batch(device):
    attn = evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 4, 4)
    plan = attn.plan(torch.zeros(0, dtype=torch.int32, device=device), torch.zeros(0, 4, dtype=torch.int32, device=device))
    q = torch.zeros(0, 8, 64, dtype=torch.float16, device=device)
    kc = torch.zeros(16, 2, 64, dtype=torch.float16, device=device)
    assert attn.run(plan, q, kc, kc).shape == (0, 8, 64)


def test_all_padding_rows(device):
    """A batch of only seq_len-0 rows (a padded CUDA-graph batch) writes zeros."""
    q, kc, vc, seq_lens, pt = make_paged_batch([0, 0, 0], 8, 2, 64, 16, torch.float16, device)
    for policy in evenkv.POLICIES:
        attn = evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 4, pt.shape[1], policy, num_ctas=3)
        plan = attn.plan(seq_lens, pt)
        out = torch.full_like(q, float("nan"))
        attn.run(plan, q, kc, vc, out=out)
        assert torch.all(out == 0), policy


def test_functional_decode_and_head_dim_96(device):
    q, kc, vc, seq_lens, pt = make_paged_batch([50, 9], 4, 4, 96, 16, torch.float16, device)
    out = evenkv.decode(q, kc, vc, seq_lens, pt, 16, sm_scale=0.05, num_ctas=3)
    assert_close_to_reference(out, q, kc, vc, seq_lens, pt, 16, sm_scale=0.05)


def test_nan_in_unused_slots_does_not_leak(device):
    """NaN in the unused tail of a request's last page and in foreign pages never reaches the output."""
    q, kc, vc, seq_lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device, extra_pages=2)
    used = set()
    for b, n in enumerate(seq_lens.tolist()):
        for t in range(n):
            used.add(int(pt[b, t // 16]) * 16 + t % 16)
    unused = torch.tensor(sorted(set(range(kc.shape[0])) - used), device=device)
    kc_nan, vc_nan = kc.clone(), vc.clone()
    kc_nan[unused] = float("nan")
    vc_nan[unused] = float("nan")
    for policy in evenkv.POLICIES:
        attn = evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 2, pt.shape[1], policy, num_ctas=4)
        plan = attn.plan(seq_lens, pt)
        out = attn.run(plan, q, kc_nan, vc_nan)
        assert not torch.isnan(out).any(), policy
        assert_close_to_reference(out, q, kc, vc, seq_lens, pt, 16)


def test_deterministic_is_batch_invariant(device):
    """deterministic=True: one request (long enough to be split) placed in random batches at
    random positions gives bitwise identical output rows, and matches the reference."""
    gen = torch.Generator().manual_seed(7)
    target = 4500  # 71 tiles of 64: 9 pieces of at least 512 tokens
    lens = [target] + [int(x) for x in torch.randint(0, 300, (7,), generator=gen)]
    q, kc, vc, seq_lens, pt = make_paged_batch(lens, 8, 2, 64, 16, torch.float16, device)
    attn = evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 8, pt.shape[1], deterministic=True,
                                  num_ctas=3)
    plan = attn.plan(seq_lens, pt)
    first = attn.run(plan, q, kc, vc)
    assert_close_to_reference(first, q, kc, vc, seq_lens, pt, 16)
    for _ in range(6):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        others = torch.randperm(7, generator=gen)[:batch - 1] + 1
        rows = others.tolist()
        pos = int(torch.randint(0, batch, (1,), generator=gen))
        rows.insert(pos, 0)
        idx = torch.tensor(rows, device=device)
        sub_lens = seq_lens[idx].clone()
        sub_lens[[i for i, r in enumerate(rows) if r != 0]] //= int(torch.randint(1, 4, (1,), generator=gen))
        plan = attn.plan(sub_lens, pt[idx])
        out = attn.run(plan, q[idx], kc, vc)
        assert torch.equal(out[pos], first[0]), rows


def test_deterministic_refuses_fa3(device):
    with pytest.raises(ValueError, match="deterministic.*fa3"):
        evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 4, 4, "fa3", deterministic=True)


def test_deterministic_from_environment(device, monkeypatch):
    """EVENKV_DETERMINISTIC is the engine adapters' switch; an explicit argument wins."""
    monkeypatch.setenv("EVENKV_DETERMINISTIC", "1")
    assert evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 4, 4).deterministic
    assert not evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 4, 4, deterministic=False).deterministic
    monkeypatch.setenv("EVENKV_DETERMINISTIC", "0")
    assert not evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 4, 4).deterministic


def test_lse_merge_of_key_splits_equals_full_attention():
    """The identity every split-KV schedule relies on: attention over disjoint key ranges,
    merged by log-sum-exp, equals attention over all keys (incl. an empty range)."""
    from evenkv.kernels.reference import attention_reference, merge_reference
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(8, 64, generator=gen)
    k = torch.randn(300, 2, 64, generator=gen) * 3
    v = torch.randn(300, 2, 64, generator=gen)
    full, _ = attention_reference(q, k, v, 0.125)
    cuts = [0, 1, 1, 90, 299, 300]
    parts = [attention_reference(q, k[a:b], v[a:b], 0.125) for a, b in zip(cuts, cuts[1:])]
    merged = merge_reference(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy,lens,classes", [("fa3", [600, 5, 33], [1, 0]),
                                                  ("deterministic", [5000, 1500, 33], [1, 1])])
def test_units_merge_item_classes(device, policy, lens, classes):
    """merge_units_kernel's two item classes: a request of 2 .. WHOLE_P (8) splits merged in
    items of one row and all columns, one of more (5000 tokens: 10 deterministic chunks) in
    items of one row and 32 columns. G = 7 and head_dim 80 mask rows and columns (BLOCK_D 128)."""
    dtype = torch.float16
    attn = evenkv.DecodeAttention(7, 1, 80, 16, dtype, device, 3, 400, "fa3" if policy == "fa3" else "balanced",
                                  num_ctas=6, deterministic=policy == "deterministic")
    q, k_cache, v_cache, seq_lens, page_table = make_paged_batch(lens, 7, 1, 80, 16, dtype, device)
    plan = attn.plan(seq_lens, page_table)
    assert plan.schedule.merge_count.tolist() == classes
    assert_close_to_reference(attn.run(plan, q, k_cache, v_cache), q, k_cache, v_cache, seq_lens, page_table, 16)


@pytest.mark.parametrize("num_kv_heads,head_dim,num_ctas,path", [
    (1, 80, 2, "fused"), (2, 80, 8, "fused"), (1, 64, 6, "whole"), (1, 80, 6, "rows"), (1, 80, 40, "rows"),
    (1, 80, 80, "chunks"), (1, 256, 25, "chunks")])
def test_stream_merges(device, num_kv_heads, head_dim, num_ctas, path):
    """Both merges of the balanced policy, on a long request cut into pieces: at most
    FUSED_MERGE_PIECES pieces (2 and 4 here) are merged by the last one inside the decode
    kernel, more by merge_stream_kernel in each of its step shapes: all rows in one step
    (5 pieces at head_dim 64), one row per step spread over the segment's boundaries (6
    and 24 pieces), and (row, column chunk) items (47 pieces at head_dim 80, 3 chunks; 24
    at head_dim 256, 8 chunks, 56 items over 23 programs). G = 7 and head_dim 80 mask rows
    and columns. A second run of the same plan must give the same bytes: the last arrivals
    reset their counters, so the next launch (a graph replay) starts from zero."""
    from evenkv.kernels.decode_launch import QueryRows, merge_stream_constants
    dtype = torch.float16
    lens = [3000, 5, 33, 0, 70]
    hq = 7 * num_kv_heads
    attn = evenkv.DecodeAttention(hq, num_kv_heads, head_dim, 16, dtype, device, len(lens), 200, num_ctas=num_ctas)
    q, k_cache, v_cache, seq_lens, page_table = make_paged_batch(lens, hq, num_kv_heads, head_dim, 16, dtype, device)
    plan = attn.plan(seq_lens, page_table)
    # Head 0 of request 0 spans cost [0, n).
    piece, n = int(plan.schedule.plan_scalars[0]), -(-3000 // attn.config.block_n)
    long_pieces = (n - 1) // piece + 1
    consts = merge_stream_constants(num_kv_heads, 7, head_dim, attn.config, False, QueryRows(1, 7))
    assert stream_merge_path(long_pieces, consts) == path, (long_pieces, piece)
    first = attn.run(plan, q, k_cache, v_cache)
    assert_close_to_reference(first, q, k_cache, v_cache, seq_lens, page_table, 16)
    assert int(attn._merge_counters.abs().sum()) == 0
    assert torch.equal(attn.run(plan, q, k_cache, v_cache), first)


# The page-id guard keeps the cache's page count live through the tile loop; where a row's
# register cap is tight, ptxas reloads up to this many loop-invariant values per iteration
# from local memory (L1 hits; docs/tuning.md, "The page-id guard"). Loop state never spills.
GUARD_RELOADS = 3
# Deterministic mode's walk keeps its chunk countdown, chunk lengths and first partial slot live
# as well: at the verify rows' 168-register cap ptxas reloads one more invariant value per
# iteration (the 32-row tile of 4 query tokens at head dim 128).
DETERMINISTIC_GUARD_RELOADS = 4
# Verify rows also keep the bounds of their mask-free tile test (decode._attend_tile) live: at
# the 168-register cap their deterministic and tree-mask builds reload up to this many
# loop-invariant values per iteration, against the ~100 mask instructions a prefix tile skips.
VERIFY_GUARD_RELOADS = 8
# One SM of an H100/H200 (sm90) and of an A100 (sm80): 64K registers, shared memory per SM.
SM_REGISTERS = 65536
SM_SHARED = {90: 228 * 1024, 80: 164 * 1024}


def _resident_ctas(result, num_warps, cap):
    """CTAs per SM allowed by registers (allocated per warp in units of 256) and shared
    memory (plus the 1 KiB the hardware reserves per CTA)."""
    regs_per_warp = -(-result["regs"] * 32 // 256) * 256
    return min(SM_REGISTERS // (regs_per_warp * num_warps), SM_SHARED[cap] // (result["shared"] + 1024))


@pytest.mark.parametrize("arch,cap", [("sm90", 90), ("sm80", 80)])
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 8, 4), (128, 4, 8), (256, 2, 8)],
                         ids=["d64", "d128", "d256"])
def test_arch_table_compiles_for_its_target(arch, cap, head_dim, num_kv_heads, group):
    """Each arch table row's decode and merge kernels compile for that target (sm_90a /
    sm_80, on the CPU with Triton's bundled ptxas) for a model of its head-dim class
    (Llama-3.2-1B, Qwen3-30B-A3B, Qwen3-Next); the persistent decode kernel fits the row's
    resident CTAs per SM, the merge kernels spill nothing. sm90 caps registers (112 at
    head_dim 64 and 128 at 128 for 4 CTAs/SM, 168 for 3 at 256; the compiler alone takes
    more, 2-3 CTAs/SM): the few registers that spills must stay out of the tile loop (SASS: no
    LDL/STL in the innermost loop with an MMA; an 80-register build, which does spill
    there, shows the check can fail); sm80 fits 2 CTAs/SM in an A100's 164 KiB without
    spills. sm90 head_dim 256 has a second row for page sizes >= 16 (2 stages, 128
    registers, 4 CTAs/SM), checked the same way."""
    from evenkv.configs import decode_config
    rows = {decode_config(arch, head_dim, page) for page in (1, 16)}
    assert len(rows) == (2 if (arch, head_dim) == ("sm90", 256) else 1)
    for cfg in rows:
        _check_row_compiles(cfg, cap, head_dim, num_kv_heads, group)


# Rows that spill in an FP8 tile loop and still ran faster over an FP8 cache than the same
# tiles at more registers and fewer CTAs per SM (docs/tuning.md "Decode, FP8 caches").
FP8_SPILLING_ROWS = {"sm90-d<=128-r16", "sm90-d<=128-r32"}


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 8, 8), (128, 4, 8), (256, 2, 8)],
                         ids=["gpt-oss", "qwen3", "qwen3-next"])
def test_verify_rows_compile(head_dim, num_kv_heads, group, kv_fp8):
    """Each sm90 verify row (16 to 128 tile rows: G = 8 query heads x 2 to 16 tokens) and its
    many-segments row, over a bf16 or an FP8 cache, with tree masks and with every layer term,
    fits its resident CTAs per SM with no local memory in the tile loop (over an FP8 cache,
    except FP8_SPILLING_ROWS), and its merge kernels spill nothing (the many-segments
    row's deterministic build where deterministic mode runs it: the same tile)."""
    from evenkv.configs import decode_config, many_segments_config, max_tile_rows, same_tile
    from evenkv.kernels.decode_launch import QueryRows, tile_rows
    for q_len in (2, 4, 8, 16):
        rows = tile_rows(group, q_len)
        if rows > max_tile_rows("sm90", head_dim):
            continue
        cfg = decode_config("sm90", head_dim, 16, kv_fp8, rows=rows)
        many = many_segments_config("sm90", head_dim, 16, kv_fp8, rows=rows)
        for tree, terms in ((False, False), (True, False), (False, True)):
            query = QueryRows(q_len, group * q_len, tree)
            _check_row_compiles(cfg, 90, head_dim, num_kv_heads, group, layer_terms=terms, kv_fp8=kv_fp8,
                                query=query, spills=kv_fp8 and cfg.name in FP8_SPILLING_ROWS)
            if many is not None:
                _check_row_compiles(many, 90, head_dim, num_kv_heads, group, layer_terms=terms, kv_fp8=kv_fp8,
                                    query=query, deterministic=same_tile(cfg, many),
                                    spills=kv_fp8 and many.name in FP8_SPILLING_ROWS)


@pytest.mark.parametrize("head_dim,num_kv_heads,group,ctas,min_page", [(64, 8, 4, 8, 1), (128, 4, 8, 5, 16)],
                         ids=["d64", "d128"])
def test_many_segments_row_compiles(head_dim, num_kv_heads, group, ctas, min_page):
    """The sm90 many-segments rows (head_dim 64 at every page size: 8 CTAs per SM at 64
    registers; head_dim 128 at page size >= 16: 5 at 96) meet the same checks: their CTAs
    fit the register cap and the shared memory, with no local memory in the tile loop.
    There is no such row for sm80, head_dim 256, or head_dim 128 at page size 1."""
    from evenkv.configs import decode_config, many_segments_config, same_tile
    cfg = many_segments_config("sm90", head_dim, 16)
    assert cfg is not None and cfg.max_ctas_per_sm == ctas
    assert many_segments_config("sm90", head_dim, 1) == (cfg if min_page == 1 else None)
    assert many_segments_config("sm80", head_dim, 16) is None and many_segments_config("sm90", 256, 16) is None
    _check_row_compiles(cfg, 90, head_dim, num_kv_heads, group,
                        deterministic=same_tile(cfg, decode_config("sm90", head_dim, 16)))


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 8, 8), (128, 4, 8), (256, 2, 8)],
                         ids=["gpt-oss", "qwen3", "qwen3-next"])
def test_layer_terms_compile_within_the_rows(head_dim, num_kv_heads, group, kv_fp8):
    """With a soft-cap and bf16 sinks, over a bf16 or an FP8 cache, the sm90 rows a layer
    can run at page size 16 (an FP8 cache has its own rows; its only many-segments row is head
    dim 128's, the same tile in one loop across segments) still fit their CTAs per SM and keep
    local memory out of the tile loop, except FP8_SPILLING_ROWS over an FP8 cache (gpt-oss's,
    Qwen3-30B-A3B's and Qwen3-Next's attention shapes); their deterministic builds too where
    deterministic mode runs the many-segments row (the same tile)."""
    from evenkv.configs import decode_config, many_segments_config, same_tile
    main = decode_config("sm90", head_dim, 16, kv_fp8)
    many = many_segments_config("sm90", head_dim, 16, kv_fp8)
    assert (many is None) == (head_dim == 256 or (kv_fp8 and head_dim == 64))
    if kv_fp8 and many is not None:
        assert main.segment_loops and not many.segment_loops and same_tile(main, many)
    for cfg in {main, many} - {None}:
        _check_row_compiles(cfg, 90, head_dim, num_kv_heads, group, layer_terms=True, kv_fp8=kv_fp8,
                            spills=kv_fp8 and cfg.name in FP8_SPILLING_ROWS)


def test_stack_pointer_data_reads_flags_the_miscompile():
    """The SASS check every compile test applies: the ptxas miscompile seen with Triton 3.6 (an
    e4m3 unpack reading R1, the stack pointer, in place of a packed pair), or any conversion or
    arithmetic reading R1, is flagged; R1 as a local-memory address base or in an address
    computation, registers R10-R19 and the uniform UR1 are not."""
    import aot_compile
    lines = ["LDC R1, c[0x0][0x28]", "STL [R1+0x8], R5", "LDL R4, [R1+0x10]", "IADD3 R2, R1, 0x10, RZ",
             "F2FP.F16.E4M3.UNPACK_B R10, R11", "F2FP.F16.E4M3.UNPACK_B R12, R13.H1", "HADD2.F32 R8, -RZ, R13.H0_H0",
             "FADD R3, R10, UR1", "F2FP.F16.E4M3.UNPACK_B R57, R1", "@!P4 FMUL R5, -R1.reuse, R2"]
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {line} ;  /* 0x0 */" for i, line in enumerate(lines))
    assert aot_compile.stack_pointer_data_reads(sass) == ["F2FP.F16.E4M3.UNPACK_B R57, R1",
                                                         "@!P4 FMUL R5, -R1.reuse, R2"]


@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 8, 8), (128, 4, 8), (256, 2, 8)],
                         ids=["gpt-oss", "qwen3", "qwen3-next"])
def test_fp8_rows_compile_over_head_major_pages(head_dim, num_kv_heads, group):
    """Over pages that are not page_size offsets apart (PAGE_GAP: vLLM's HND pages, a KV
    connector's cross-layer allocation), the FP8 main rows, layer terms on, still fit their CTAs
    per SM and keep local memory out of the tile loop, their deterministic builds too."""
    from evenkv.configs import decode_config
    _check_row_compiles(decode_config("sm90", head_dim, 16, True), 90, head_dim, num_kv_heads, group,
                        layer_terms=True, kv_fp8=True, page_gap=True)


@pytest.mark.parametrize("layer_terms,gap", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "terms", "gap", "terms-gap"])
def test_packed_kv_heads_compile_within_the_rows(layer_terms, gap):
    """gpt-oss-20b's plain decode rows over an FP8 cache (8 KV heads of 64, G = 8) walk packs of
    two heads as 4 heads of 128 columns with 16 query rows each, on head dim 128's sm90 FP8 rows
    (main and many-segments): those builds, with the heads of a pack side by side or a head
    stride apart (PACK_GAP, over HND pages), still fit their CTAs per SM with no local memory in
    the tile loop."""
    from evenkv.configs import decode_config, kv_head_pack, many_segments_config
    from evenkv.kernels.decode_launch import QueryRows
    pack = kv_head_pack("sm90", 64, 8, 64, 1, False, kv_fp8=True)
    assert pack == 2
    query = QueryRows(1, 8 * pack, head_pack=pack)
    rows = {decode_config("sm90", 64 * pack, 16, True), many_segments_config("sm90", 64 * pack, 16, True)}
    for cfg in rows - {None}:
        _check_row_compiles(cfg, 90, 64 * pack, 8 // pack, 8 * pack, layer_terms=layer_terms, kv_fp8=True,
                            query=query, deterministic=False, page_gap=gap, pack_gap=gap)


def _check_row_compiles(cfg, cap, head_dim, num_kv_heads, group, layer_terms=False, kv_fp8=False, query=None,
                        deterministic=True, spills=False, page_gap=False, pack_gap=False):
    """The stream decode kernel of ``cfg`` (for ``query``'s rows; default plain decode) fits the row's
    resident CTAs per SM with no local memory in its tile loop (unless ``spills``: a row timed
    faster with its spills), and so does its deterministic variant (``deterministic``: for the
    rows deterministic mode runs); the merge kernels spill nothing."""
    from evenkv.kernels.decode_launch import (MERGE_NUM_WARPS, MERGE_UNITS_NUM_WARPS, QueryRows,
                                              merge_stream_constants, merge_units_constants, stream_constants)
    query = query or QueryRows(1, group)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.max_registers is not None:
        options["maxnreg"] = cfg.max_registers
    terms = dict(SOFTCAP=layer_terms, HAS_SINKS=layer_terms, KV_FP8=kv_fp8, PAGE_GAP=page_gap, PACK_GAP=pack_gap)
    cache = dict(fp8=["k_ptr", "v_ptr"], bf16=["q_ptr", "out_ptr", "sinks_ptr"]) if kv_fp8 else \
        dict(bf16=["q_ptr", "k_ptr", "v_ptr", "out_ptr", "sinks_ptr"])
    common = dict(cache, fp32_ptrs=["o_part_ptr", "lse_part_ptr"], fp32=["qk_scale", "cap_scale", "v_scale"],
                  unaligned=["stride_pt", "window", "batch_size"])
    stream_consts = dict(stream_constants(num_kv_heads, group, head_dim, 16, cfg, cfg.programmatic_launch, query),
                         **terms)
    modes = [dict(stream_consts, DETERMINISTIC=det) for det in ((False, True) if deterministic else (False,))]
    variants = [dict(cap=cap, consts=consts, options=options) for consts in modes]
    starved_check = cfg.max_registers is not None and head_dim == 128 and not layer_terms and not query.multi_q
    if starved_check:
        variants.append(dict(cap=cap, consts=modes[0], options=dict(options, maxnreg=80)))
    results = aot_compile(dict(common, kernel="evenkv.kernels.decode:decode_stream_kernel", variants=variants))
    for r in results:
        assert not r["stack_pointer_data_reads"], f"miscompiled: {r['stack_pointer_data_reads']}"
    for consts, stream in zip(modes, results):
        assert _resident_ctas(stream, cfg.num_warps, cap) >= cfg.max_ctas_per_sm, stream
        assert not stream["wgmma_serialized"], f"ptxas serialized the wgmma dots: {stream}"
        if cfg.max_registers is None:
            assert stream["stack"] == 0, f"register spills: {stream}"
        else:
            guard = VERIFY_GUARD_RELOADS if query.multi_q else \
                DETERMINISTIC_GUARD_RELOADS if consts["DETERMINISTIC"] else GUARD_RELOADS
            if not spills:
                assert stream["mma_loop_spills"] == 0, f"register spills in the tile loop: {stream}"
                assert stream["mma_loop_reloads"] <= guard, f"local-memory reloads in the tile loop: {stream}"
    if starved_check:
        assert results[-1]["mma_loop_spills"] > 0, f"the spill check missed an 80-register build: {results[-1]}"
    for name, consts, warps in [
            ("merge_stream_kernel",
             merge_stream_constants(num_kv_heads, group, head_dim, cfg, cfg.programmatic_launch, query, layer_terms),
             MERGE_NUM_WARPS),
            ("merge_units_kernel", dict(merge_units_constants(num_kv_heads, group, head_dim, query),
                                        HAS_SINKS=layer_terms, USE_PDL=cfg.programmatic_launch),
             MERGE_UNITS_NUM_WARPS)]:
        (r,) = aot_compile(dict(common, kernel=f"evenkv.kernels.decode:{name}",
                                variants=[dict(cap=cap, consts=consts, options=dict(num_warps=warps))]))
        # A verify row's stream merge with sinks keeps one 8-byte value on the stack (its
        # all-rows step is [2, 16, 128] at G = 8, q_len 2); it runs once per segment, not per tile.
        # So does the packed rows' (two heads' 8 query rows: [2, 16, 128] too).
        allowed = 8 if ((query.multi_q or query.head_pack > 1) and layer_terms and name == "merge_stream_kernel") \
            else 0
        assert r["stack"] <= allowed, f"{name}: {r}"
        assert not r["stack_pointer_data_reads"], f"{name} miscompiled: {r['stack_pointer_data_reads']}"


@pytest.mark.parametrize("head_dim,page_size", [(128, 16), (64, 1)], ids=["d128-p16", "d64-p1"])
def test_many_segments_config_by_batch(device, head_dim, page_size):
    """The balanced policy plans a batch of >= MANY_SEGMENTS_PER_CTA (request, KV head)
    segments per CTA of its main grid with the many-segments row, a smaller one with the
    main row, and each plan runs with its own config; a fixed grid or config turns the
    choice off, as does page size 1 at head_dim 128 (head_dim 64's row serves page 1)."""
    from evenkv.configs import MANY_SEGMENTS_PER_CTA, decode_config, many_segments_config, same_tile
    hq, hkv, d, page = 8, 2, head_dim, page_size
    main, many = decode_config("sm90", d, page), many_segments_config("sm90", d, page)
    gen = torch.Generator().manual_seed(3)
    max_pages = -(-100 // page) + 1  # lengths < 100, plus make_paged_batch's spare column
    # The main grid (so the threshold) depends on the device: size the batch limit from it.
    main_ctas = evenkv.DecodeAttention(hq, hkv, d, page, torch.float16, device, 1, max_pages, arch="sm90").num_ctas
    threshold = -(-MANY_SEGMENTS_PER_CTA * main_ctas // hkv)
    attn = evenkv.DecodeAttention(hq, hkv, d, page, torch.float16, device, threshold, max_pages, arch="sm90")
    for batch in (threshold - 1, threshold, 3):
        lens = torch.randint(1, 100, (batch,), generator=gen).tolist()
        lens[0] = 0
        q, kc, vc, seq_lens, pt = make_paged_batch(lens, hq, hkv, d, page, torch.float16, device, seed=batch)
        plan = attn.plan(seq_lens, pt)
        assert plan.config == (many if batch >= threshold else main)
        out = attn.run(plan, q, kc, vc)
        assert_close_to_reference(out, q, kc, vc, seq_lens, pt, page)
        assert torch.all(out[0] == 0)
    others = [(dict(num_ctas=attn.num_ctas), page), (dict(config=main), page)]
    if d == 128:
        others.append(({}, 1))
    for kwargs, other_page in others:
        other = evenkv.DecodeAttention(hq, hkv, d, other_page, torch.float16, device, threshold, max_pages,
                                       arch="sm90", **kwargs)
        assert other.launch_config(threshold) == (main, other.num_ctas)
    # Deterministic mode keeps the many-segments row where its tile is the main row's (head_dim
    # 128): a request's bytes in such a batch are those it has alone, under the main row.
    det = evenkv.DecodeAttention(hq, hkv, d, page, torch.float16, device, threshold, max_pages, arch="sm90",
                                 deterministic=True)
    keeps_many = many is not None and same_tile(many, main)
    assert keeps_many == (d == 128 and page == 16)
    lens = torch.randint(1, 100, (threshold,), generator=gen).tolist()
    q, kc, vc, seq_lens, pt = make_paged_batch(lens, hq, hkv, d, page, torch.float16, device, seed=1)
    plan = det.plan(seq_lens, pt)
    assert plan.config == (many if keeps_many else main)
    in_batch = det.run(plan, q, kc, vc)[-1].clone()
    alone = det.plan(seq_lens[-1:], pt[-1:])
    assert alone.config == main
    assert torch.equal(in_batch, det.run(alone, q[-1:], kc, vc)[0])


def test_fp8_many_segments_row_by_batch(device):
    """Over an FP8 cache head_dim 128 walks one loop per segment, and a batch of >=
    MANY_SEGMENTS_PER_CTA segments per CTA of that grid takes the FP8 many-segments row (the same
    tile in one loop across segments), deterministic mode too; each plan's output matches the
    reference over the dequantized cache."""
    from evenkv.configs import MANY_SEGMENTS_PER_CTA, decode_config, many_segments_config
    from helpers import fp8_caches
    hq, hkv, d, page, fp8 = 8, 2, 128, 16, torch.float8_e4m3fn
    main, many = decode_config("sm90", d, page, True), many_segments_config("sm90", d, page, True)
    assert main.segment_loops and not many.segment_loops
    max_pages = -(-100 // page) + 1
    main_ctas = evenkv.DecodeAttention(hq, hkv, d, page, torch.bfloat16, device, 1, max_pages, arch="sm90",
                                       kv_dtype=fp8).num_ctas
    threshold = -(-MANY_SEGMENTS_PER_CTA * main_ctas // hkv)
    gen = torch.Generator().manual_seed(5)
    for deterministic in (False, True):
        attn = evenkv.DecodeAttention(hq, hkv, d, page, torch.bfloat16, device, threshold, max_pages, arch="sm90",
                                      kv_dtype=fp8, deterministic=deterministic)
        for batch in (threshold - 1, threshold):
            lens = torch.randint(1, 100, (batch,), generator=gen).tolist()
            q, kc, vc, seq_lens, pt = make_paged_batch(lens, hq, hkv, d, page, torch.bfloat16, device, seed=batch)
            k8, v8 = fp8_caches(kc, vc, 0.5, 0.25)
            plan = attn.plan(seq_lens, pt)
            assert plan.config == (many if batch >= threshold else main)
            out = attn.run(plan, q, k8, v8, k_scale=0.5, v_scale=0.25)
            assert_close_to_reference(out, q, k8, v8, seq_lens, pt, page, k_scale=0.5, v_scale=0.25)


PLANNING_KERNELS = [
    ("evenkv.kernels.plan:plan_stream_kernel", dict(NUM_KV_HEADS=4, BLOCK_N=64, BLOCK_B=2048, BLOCK_C=8, MULTI_Q=False,
                                                    DETERMINISTIC=False, MIN_CHUNK_TILES=1, MAX_CHUNKS=1,
                                                    WHOLE_CHUNKS=0), 8),
    ("evenkv.kernels.plan:plan_stream_kernel", dict(NUM_KV_HEADS=4, BLOCK_N=64, BLOCK_B=2048, BLOCK_C=8, MULTI_Q=True,
                                                    DETERMINISTIC=True, MIN_CHUNK_TILES=8, MAX_CHUNKS=512,
                                                    WHOLE_CHUNKS=8), 8),
    ("evenkv.kernels.plan:audit_pages_kernel", dict(PAGE_SIZE=16, BLOCK_B=128, BLOCK_E=256, ZERO_BAD_ROWS=False), 4),
    ("evenkv.kernels.plan:audit_pages_kernel", dict(PAGE_SIZE=16, BLOCK_B=2048, BLOCK_E=256, ZERO_BAD_ROWS=True), 4),
    ("evenkv.kernels.plan:guard_prefill_rows_kernel", dict(BLOCK_B=128), 4),
    ("evenkv.kernels.plan:extend_plan_kernel", dict(G=8, BLOCK_M=128, LPT=True, BLOCK_I=64, BLOCK_J=128), 4),
    ("evenkv.kernels.kv_write:kv_write_kernel",
     dict(PAGE_SIZE=16, NUM_KV_HEADS=4, HEAD_DIM=128, BLOCK_H=4, BLOCK_D=128, KV_FP8=False), 4),
]


def test_fp8_kv_write_compiles_for_sm90():
    """The FP8 KV write (e4m3 cache, IEEE division by the scales) compiles for sm_90a."""
    (r,) = aot_compile(dict(kernel="evenkv.kernels.kv_write:kv_write_kernel", bf16=["k_new_ptr", "v_new_ptr"],
                            fp8=["k_cache_ptr", "v_cache_ptr"], fp32=["k_scale", "v_scale"],
                            variants=[dict(cap=90, consts=dict(PAGE_SIZE=1, NUM_KV_HEADS=4, HEAD_DIM=128, BLOCK_H=4,
                                                               BLOCK_D=128, KV_FP8=True), options=dict(num_warps=4))]))
    assert r["stack"] == 0, r
    assert not r["stack_pointer_data_reads"], r


@pytest.mark.parametrize("cap", [90, 80])
@pytest.mark.parametrize("kernel,consts,warps", PLANNING_KERNELS,
                         ids=[k.split(":")[1] + ("-det" if c.get("DETERMINISTIC") else "")
                              + ("-zero" if c.get("ZERO_BAD_ROWS") else "") for k, c, _ in PLANNING_KERNELS])
def test_planning_and_write_kernels_compile_for_cuda(kernel, consts, warps, cap):
    """The kernels around the attention ones compile for sm_90a and sm_80 (on the CPU, with
    Triton's bundled ptxas): the interpreter runs Python, and accepts code the compiler does not."""
    (r,) = aot_compile(dict(kernel=kernel, bf16=["k_new_ptr", "v_new_ptr", "k_cache_ptr", "v_cache_ptr"],
                            variants=[dict(cap=cap, consts=consts, options=dict(num_warps=warps))]))
    assert r["stack"] == 0, r
    assert not r["stack_pointer_data_reads"], r


@pytest.mark.parametrize("cap", [90, 80])
@pytest.mark.parametrize("consts", [dict(PAGE_SIZE=1, SWA=True, BLOCK=PAGE_TABLE_BLOCK),
                                    dict(PAGE_SIZE=16, SWA=False, BLOCK=PAGE_TABLE_BLOCK)], ids=["page1-hybrid-pool", "page16"])
def test_page_table_kernel_compiles_for_cuda(consts, cap):
    """SGLang's per-step page tables (int64 request rows, lengths and window-pool mapping)
    compile for sm_90a and sm_80 without a stack."""
    (r,) = aot_compile(dict(kernel="evenkv.kernels.plan:page_table_from_tokens_kernel",
                            i64_ptrs=["row_ids_ptr", "seq_lens_ptr", "swa_mapping_ptr"],
                            variants=[dict(cap=cap, consts=consts, options=dict(num_warps=4))]))
    assert r["stack"] == 0, r
    assert not r["stack_pointer_data_reads"], r


def test_deterministic_invariance_to_position_batch_size_and_padding(device):
    """deterministic=True: the same request gives the same bits at any position, in batches on
    both sides of 992 requests (where FA3's prepare kernel stops splitting), and beside
    padding rows of length 0."""
    gen = torch.Generator().manual_seed(11)
    target = 3000
    q, kc, vc, seq_lens, pt = make_paged_batch([target] + [1] * 1100, 8, 2, 64, 16, torch.float16, device)
    attn = evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, device, 1101, pt.shape[1], deterministic=True)
    first = attn.run(attn.plan(seq_lens[:1], pt[:1]), q[:1], kc, vc)[0].clone()
    assert_close_to_reference(first[None], q[:1], kc, vc, seq_lens[:1], pt[:1], 16)
    for batch, pos, pad in ((2, 1, 0), (994, 993, 0), (600, 0, 599)):
        rows = torch.randperm(1100, generator=gen)[:batch - 1] + 1
        rows = torch.cat([rows[:pos], torch.zeros(1, dtype=torch.long), rows[pos:]])
        lens = seq_lens[rows].clone()
        if pad:
            pad_rows = [i for i in range(batch) if i != pos][:pad]
            lens[pad_rows] = 0
        out = attn.run(attn.plan(lens, pt[rows]), q[rows], kc, vc)
        assert torch.equal(out[pos], first), (batch, pos, pad)
        if pad:
            assert torch.all(out[pad_rows] == 0)
