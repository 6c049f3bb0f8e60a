"""CPU-lane tests of speculative-verify decode rows (1 + draft tokens per request): every policy,
q lengths 2 to 16, tree masks, every layer term and an FP8 cache, against the fp32 reference
(``extend_reference`` with the same query rows), under the Triton interpreter; plus the
edge cases: rows of no query, padding rows, malformed query ranges, NaN, batch invariance,
and verify rows beside extend rows in one ``Attention`` batch."""

import dataclasses

import numpy as np
import pytest
import torch

import evenkv
from helpers import (K_SCALE, V_SCALE, assert_close_to_reference, assert_extend_close_to_reference, call_terms,
                     fp8_caches, make_paged_batch, max_error, stream_merge_path)

# (request lengths, query tokens of each): a long request cut across CTAs, a short one, one
# of a single token, a padding row (seq_len 0) that keeps two q rows, a request of no query.
LENS = [150, 9, 40, 0, 33]
Q_LENS = [4, 3, 1, 2, 0]


def verify_batch(lens, q_lens, hq, hkv, d, page_size, dtype, device, seed=0):
    """Paged caches, cu_seqlens_q [B + 1] int32 and q [sum(q_lens), Hq, D] of a verify batch."""
    _, kc, vc, seq_lens, pt = make_paged_batch(lens, hq, hkv, d, page_size, dtype, device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype).to(device)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
    return q, kc, vc, seq_lens, pt, cu


def _attn(device, hq, hkv, d, page_size, dtype, pt, policy="balanced", max_q_len=4, **kw):
    return evenkv.DecodeAttention(hq, hkv, d, page_size, dtype, device, 8, pt.shape[1], policy, num_ctas=5,
                                  max_q_len=max_q_len, **kw)


POLICY_CASES = [("balanced", None), ("fa3", None), ("none", None), ("balanced", True)]
POLICY_IDS = ["balanced", "fa3", "none", "deterministic"]


@pytest.mark.parametrize("policy,deterministic", POLICY_CASES, ids=POLICY_IDS)
@pytest.mark.parametrize("group,hkv,head_dim,page_size,dtype", [
    (4, 2, 64, 16, torch.float16), (8, 1, 64, 1, torch.bfloat16), (7, 1, 128, 16, torch.bfloat16),
    (1, 2, 96, 1, torch.float16)], ids=["g4-d64-p16", "g8-d64-p1", "g7-d128-p16", "g1-d96-p1"])
def test_verify_rows_match_reference(device, policy, deterministic, group, hkv, head_dim, page_size, dtype):
    hq = group * hkv
    q, kc, vc, seq_lens, pt, cu = verify_batch(LENS, Q_LENS, hq, hkv, head_dim, page_size, dtype, device)
    attn = _attn(device, hq, hkv, head_dim, page_size, dtype, pt, policy, deterministic=deterministic)
    plan = attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=4)
    out = torch.full_like(q, float("nan"))
    attn.run(plan, q, kc, vc, out=out)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, page_size)
    assert torch.all(out[int(cu[3]):int(cu[4])] == 0), "a padding row's query rows are zeros"
    # The same plan serves the next layer (new q, same rows).
    q2 = torch.randn_like(q)
    assert_extend_close_to_reference(attn.run(plan, q2, kc, vc), q2, kc, vc, cu, seq_lens, pt, page_size)


@pytest.mark.parametrize("max_q_len,q_lens", [(2, [2, 2, 1, 2, 2]), (5, [5, 1, 3, 0, 5]), (8, [8, 7, 2, 1, 6]),
                                              (16, [16, 9, 16, 2, 1])])
def test_q_length_buckets(device, max_q_len, q_lens):
    """Each bucket of q lengths (2, 3-4 ... 9-16 tokens) is its own kernel variant; rows of fewer
    tokens than the bucket's run in it too. G = 8: 16 to 128 tile rows."""
    hq, hkv, d, ps, dtype = 8, 1, 64, 16, torch.float16
    lens = [200, 30, 64, 17, 16]
    q, kc, vc, seq_lens, pt, cu = verify_batch(lens, q_lens, hq, hkv, d, ps, dtype, device, seed=max_q_len)
    attn = _attn(device, hq, hkv, d, ps, dtype, pt, max_q_len=max_q_len)
    out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=max_q_len), q, kc, vc)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, ps)


def test_named_q_lens_build_their_buckets_only(device):
    """q_lens=(1, 4) (SGLang: decode batches and 4-token verify batches) builds the buckets of 1
    and 4 tokens only; a batch whose rows have at most 2 tokens runs on the 4-token variant,
    bitwise as an object with every bucket runs it there."""
    hq, hkv, d, ps, dtype = 8, 2, 64, 16, torch.float16
    q_lens = [2, 1, 2, 0, 2]
    q, kc, vc, seq_lens, pt, cu = verify_batch(LENS, q_lens, hq, hkv, d, ps, dtype, device, seed=12)
    named = _attn(device, hq, hkv, d, ps, dtype, pt, max_q_len=4, q_lens=(4, 1, 4))
    assert named.q_lens == (1, 4)
    plan = named.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=2)
    assert plan.query.max_q_len == 4
    out = named.run(plan, q, kc, vc)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, ps)
    every = _attn(device, hq, hkv, d, ps, dtype, pt, max_q_len=4)
    assert every.q_lens == (1, 2, 3, 4)
    assert torch.equal(out, every.run(every.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=4), q, kc, vc))
    # max_q_len's bucket is always built: rows of 3 tokens on an object that names 1 and 2.
    short = _attn(device, hq, hkv, d, ps, dtype, pt, max_q_len=4, q_lens=(1, 2))
    assert short.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=3).query.max_q_len == 4


def _tree_masks(q_lens, seed):
    """A random tree over each request's new tokens (token 0 the root; each later token a child
    of an earlier one), as the rows' bit masks: token t sees itself and its ancestors."""
    rng = np.random.default_rng(seed)
    masks = []
    for n in q_lens:
        parent = [-1] + [int(rng.integers(0, t)) for t in range(1, n)]
        for t in range(n):
            bits, node = 0, t
            while node >= 0:
                bits |= 1 << node
                node = parent[node]
            masks.append(bits)
    return masks


@pytest.mark.parametrize("policy,deterministic", POLICY_CASES, ids=POLICY_IDS)
def test_tree_masks(device, policy, deterministic):
    """Tree-shaped drafts (SGLang's topk > 1 and n-gram trees): each token sees the prefix and its
    own branch; a chain-shaped mask equals the causal default bitwise."""
    hq, hkv, d, ps, dtype = 8, 2, 64, 16, torch.float16
    q_lens = [6, 3, 1, 2, 0]
    q, kc, vc, seq_lens, pt, cu = verify_batch(LENS, q_lens, hq, hkv, d, ps, dtype, device, seed=4)
    tree = torch.tensor(_tree_masks(q_lens, 4), dtype=torch.int32, device=device)
    attn = _attn(device, hq, hkv, d, ps, dtype, pt, policy, max_q_len=6, tree_masks=True,
                 deterministic=deterministic)
    out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=6, tree_mask=tree), q, kc, vc)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, ps, tree_mask=tree)
    chain = torch.tensor([(1 << (t + 1)) - 1 for n in q_lens for t in range(n)], dtype=torch.int32, device=device)
    by_chain = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=6, tree_mask=chain), q, kc, vc)
    causal_attn = _attn(device, hq, hkv, d, ps, dtype, pt, policy, max_q_len=6, deterministic=deterministic)
    causal = causal_attn.run(causal_attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=6), q, kc, vc)
    assert torch.equal(by_chain, causal)
    assert max_error(out, causal.float()) > 1e-2, "the tree mask changed nothing"


@pytest.mark.parametrize("policy,deterministic", POLICY_CASES, ids=POLICY_IDS)
@pytest.mark.parametrize("terms", [dict(), dict(logit_cap=3.0, sinks=True, fp8=True)], ids=["plain", "all"])
def test_tree_masks_under_a_window(device, policy, deterministic, terms):
    """Tree drafts beside sliding-window layers (SGLang's NGRAM and EAGLE trees on Mistral-style
    windows and the hybrid SWA pool): a tree token sits at the prefix's end plus its depth, as the
    engine places it, and its window bounds the prefix from there (the reference places the new
    tokens at their depths too). A window of 20 cuts the 150- and 40-token requests' prefixes, at
    keys that a token's index instead of its depth would place otherwise; with a window shorter
    than the rows' tokens a tree token's ancestors could fall out of it, which is refused."""
    hq, hkv, d, ps, dtype = 4, 2, 64, 16, torch.bfloat16
    q_lens, window = [6, 3, 5, 2, 0], 20
    q, kc, vc, seq_lens, pt, cu = verify_batch(LENS, q_lens, hq, hkv, d, ps, dtype, device, seed=9)
    masks = _tree_masks(q_lens, 9)
    depths = [bin(m).count("1") - 1 for m in masks]  # each new token's depth in its tree
    index = [t for n in q_lens for t in range(n)]
    assert any(dp < t for dp, t in zip(depths, index)), "no token whose depth differs from its index"
    tree = torch.tensor(masks, dtype=torch.int32, device=device)
    kc, vc, run = call_terms(terms, kc, vc, device)
    attn = _attn(device, hq, hkv, d, ps, dtype, pt, policy, max_q_len=6, tree_masks=True, deterministic=deterministic,
                 kv_dtype=kc.dtype, sliding_window=window, logit_cap=terms.get("logit_cap"))
    out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=6, tree_mask=tree), q, kc, vc, **run)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, ps, tree_mask=tree, sliding_window=window,
                                     logit_cap=terms.get("logit_cap"), **run)
    with pytest.raises(ValueError, match=r"sliding_window: expected >= max_q_len=6 with tree_masks .* got 5"):
        _attn(device, hq, hkv, d, ps, dtype, pt, policy, max_q_len=6, tree_masks=True, sliding_window=5)


@pytest.mark.parametrize("policy,deterministic", POLICY_CASES, ids=POLICY_IDS)
@pytest.mark.parametrize("terms", [dict(sliding_window=20), dict(sliding_window=1), dict(sliding_window=130),
                                   dict(logit_cap=2.0), dict(sinks=True), dict(fp8=True),
                                   dict(sliding_window=12, logit_cap=3.0, sinks=True, fp8=True)],
                         ids=["window", "window-1", "window-past-a-tile", "cap", "sinks", "fp8", "all"])
def test_layer_terms(device, policy, deterministic, terms):
    """Each query token has its own window (keys > its position - W); soft-cap, sinks and an FP8
    cache as for decode rows. A window of 130 makes the 150-token request's first 128-token tile
    end before its new tokens yet start inside the first token's window, not the last one's."""
    hq, hkv, d, ps, dtype = 4, 2, 64, 16, torch.bfloat16
    q, kc, vc, seq_lens, pt, cu = verify_batch(LENS, Q_LENS, hq, hkv, d, ps, dtype, device, seed=6)
    layer = dict(sliding_window=terms.get("sliding_window"), logit_cap=terms.get("logit_cap"))
    kc, vc, run = call_terms(terms, kc, vc, device)
    attn = _attn(device, hq, hkv, d, ps, dtype, pt, policy, deterministic=deterministic, kv_dtype=kc.dtype, **layer)
    out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=4), q, kc, vc, **run)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, ps, **layer, **run)


def test_window_costs_the_keys_of_the_rows(device):
    """Under a window W a row of q_len tokens reads (and the plan costs) the last W + q_len - 1
    keys only: a 100-token request under W = 10 with 4 tokens is one 16-token tile, not 7."""
    attn = evenkv.DecodeAttention(2, 1, 64, 16, torch.float16, device, 2, 8, num_ctas=3, max_q_len=4,
                                  sliding_window=10)
    plan = attn.plan(torch.tensor([100, 0], device=device), torch.zeros(2, 8, dtype=torch.int32, device=device),
                     cu_seqlens_q=torch.tensor([0, 4, 4], dtype=torch.int32, device=device), q_len=4)
    block_n = plan.config.block_n
    assert int(plan.schedule.plan_scalars[1]) == -(-13 // block_n)


def test_deterministic_rows_are_batch_invariant(device):
    """A verify row gives the same bits alone and among other rows of other lengths."""
    hq, hkv, d, ps, dtype = 8, 2, 64, 16, torch.bfloat16
    q, kc, vc, seq_lens, pt, cu = verify_batch([700, 9, 40], [4, 2, 3], hq, hkv, d, ps, dtype, device, seed=8)
    attn = _attn(device, hq, hkv, d, ps, dtype, pt, deterministic=True)
    together = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=4), q, kc, vc)
    alone = attn.run(attn.plan(seq_lens[:1], pt[:1], cu_seqlens_q=cu[:2], q_len=4), q[:4], kc, vc)
    assert torch.equal(alone, together[:4])


def test_rows_past_q_and_malformed_ranges_are_flagged(device):
    """Query ranges that break the plan's bounds are clamped and flagged, never read or written
    outside q and out: a q_len above the plan's (5 > 4), more query tokens than keys (3 > 2),
    and rows past q's rows."""
    from evenkv import errors

    hq, hkv, d, ps, dtype = 4, 1, 64, 16, torch.float16
    q, kc, vc, seq_lens, pt, cu = verify_batch([40, 2, 30], [5, 3, 2], hq, hkv, d, ps, dtype, device)
    for policy in evenkv.POLICIES:
        errors.error_flag(device).zero_()
        attn = _attn(device, hq, hkv, d, ps, dtype, pt, policy)
        attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=4), q, kc, vc)
        assert errors.peek(device) == [errors.REASONS[errors.QUERY_OUT_OF_RANGE]], policy
        errors.error_flag(device).zero_()
        plan = attn.plan(seq_lens[2:], pt[2:], cu_seqlens_q=torch.tensor([8, 10], dtype=torch.int32, device=device),
                         q_len=4)
        out = torch.zeros(9, hq, d, dtype=dtype, device=device)
        attn.run(plan, q[:9], kc, vc, out=out)  # rows 8 and 9: row 9 is past q
        assert errors.peek(device) == [errors.REASONS[errors.QUERY_OUT_OF_RANGE]], policy
        assert torch.isfinite(out).all() and torch.all(out[:8] == 0) and out[8].abs().sum() > 0
    errors.error_flag(device).zero_()


@pytest.mark.parametrize("policy", evenkv.POLICIES)
@pytest.mark.parametrize("q_len", [1, 3])
def test_nan_in_q_propagates(device, policy, q_len):
    """A NaN in one query row makes that row's output NaN (as exact softmax attention does),
    and only that row's: plain and verify rows."""
    hq, hkv, d, ps, dtype = 4, 2, 64, 16, torch.float16
    q_lens = [q_len] * 3
    q, kc, vc, seq_lens, pt, cu = verify_batch([90, 20, 7], q_lens, hq, hkv, d, ps, dtype, device, seed=2)
    q[q_len, 1, 5] = float("nan")  # request 1's first token, query head 1
    attn = _attn(device, hq, hkv, d, ps, dtype, pt, policy, max_q_len=q_len)
    plan = attn.plan(seq_lens, pt, cu_seqlens_q=cu if q_len > 1 else None, q_len=q_len)
    out = attn.run(plan, q, kc, vc)
    assert torch.isnan(out[q_len, 1]).all()
    nan_rows = torch.isnan(out).any(dim=-1)
    assert int(nan_rows.sum()) == 1


@pytest.mark.parametrize("delegated", [False, True], ids=["triton-extend", "engine-prefill"])
def test_attention_mixes_verify_and_extend_rows(device, delegated):
    """Attention runs decode rows of several tokens on the decode kernels and the rest of the
    batch (prefill chunks) on the extend kernel or an engine's prefill kernel, whose rows start
    at num_decode_tokens."""
    from test_extend import ReferencePrefill

    hq, hkv, d, ps, dtype = 8, 2, 64, 16, torch.float16
    lens, q_lens = [60, 20, 9, 40, 12], [3, 1, 4, 13, 12]
    q, kc, vc, seq_lens, pt, cu = verify_batch(lens, q_lens, hq, hkv, d, ps, dtype, device, seed=3)
    prefill = ReferencePrefill() if delegated else None
    attn = evenkv.Attention(hq, hkv, d, ps, dtype, device, 8, pt.shape[1], max_decode_q_len=4,
                            prefill_kernel=prefill)
    plan = attn.plan(cu, seq_lens, pt, num_decodes=3, max_q_len=13, decode_q_len=4, num_decode_tokens=8)
    out = attn.run(plan, q, kc, vc)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, ps)
    if delegated:
        assert prefill.calls[0]["cu"] == [0, 13, 25] and prefill.calls[0]["rows"] == sum(q_lens) - 8


def test_attention_verify_plan_arguments(device):
    pt = torch.zeros(2, 4, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    lens = torch.tensor([9, 9], dtype=torch.int32, device=device)
    attn = evenkv.Attention(4, 2, 64, 16, torch.float16, device, 2, 4, max_decode_q_len=4)
    with pytest.raises(ValueError, match="num_decode_tokens: decode rows of up to decode_q_len=2"):
        attn.plan(cu, lens, pt, num_decodes=2, max_q_len=1, decode_q_len=2)
    with pytest.raises(ValueError, match="decode_q_len: expected 1 to max_decode_q_len=4, got 5"):
        attn.plan(cu, lens, pt, num_decodes=2, max_q_len=1, decode_q_len=5, num_decode_tokens=4)
    with pytest.raises(ValueError, match="num_decode_tokens: expected 2 to 4"):
        attn.plan(cu, lens, pt, num_decodes=2, max_q_len=1, decode_q_len=2, num_decode_tokens=5)
    with pytest.raises(ValueError, match="tree_mask: expected None"):
        attn.plan(cu, lens, pt, num_decodes=2, max_q_len=1, decode_q_len=2, num_decode_tokens=4,
                  tree_mask=torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="max_q_len: expected 1 to 16"):
        evenkv.DecodeAttention(4, 2, 64, 16, torch.float16, device, 2, 4, max_q_len=17)
    with pytest.raises(ValueError, match="max_q_len: 16 query tokens x G=16 heads make 256 tile rows"):
        evenkv.DecodeAttention(16, 1, 64, 16, torch.float16, device, 2, 4, max_q_len=16)
    with pytest.raises(ValueError, match=r"q_lens: expected query-token counts in 1..max_q_len=4, got \[1, 5\]"):
        evenkv.DecodeAttention(4, 2, 64, 16, torch.float16, device, 2, 4, max_q_len=4, q_lens=(1, 5))
    with pytest.raises(TypeError, match="q_lens: expected a non-empty sequence of ints"):
        evenkv.DecodeAttention(4, 2, 64, 16, torch.float16, device, 2, 4, max_q_len=4, q_lens=())
    tree = evenkv.DecodeAttention(4, 2, 64, 16, torch.float16, device, 2, 4, max_q_len=4, tree_masks=True)
    with pytest.raises(ValueError, match=r"tree_mask: expected \[>= total_q\] int32 .* for rows of q_len=2, got None"):
        tree.plan(lens, pt, cu_seqlens_q=cu, q_len=2)
    with pytest.raises(ValueError, match="tree_mask: expected None for rows of q_len=1, got a tensor"):
        tree.plan(lens, pt, q_len=1, tree_mask=torch.zeros(2, dtype=torch.int32, device=device))
    decode = evenkv.DecodeAttention(4, 2, 64, 16, torch.float16, device, 2, 4, max_q_len=4)
    with pytest.raises(ValueError, match="cu_seqlens_q: rows of up to q_len=2 query tokens need cu_seqlens_q"):
        decode.plan(lens, pt, q_len=2)
    with pytest.raises(ValueError, match="q_len: expected at most this object's max_q_len=4, got 8"):
        decode.plan(lens, pt, cu_seqlens_q=cu, q_len=8)


@pytest.mark.parametrize("deterministic", [False, True], ids=["balanced", "deterministic"])
@pytest.mark.parametrize("segment_loops", [False, True], ids=["one-loop", "segment-loops"])
def test_both_stream_walks(device, segment_loops, deterministic):
    """The balanced walk in one loop across segments and in one loop per segment
    (``DecodeConfig.segment_loops``: the tables give it to the verify rows) both run plain decode
    and verify rows, with a small grid's range cuts, chunks and merges, to the reference; in
    deterministic mode a request gets the same bits alone."""
    hq, hkv, d, ps, dtype = 8, 2, 64, 16, torch.bfloat16
    config = dataclasses.replace(evenkv.decode_config("sm90", d, ps, rows=16), segment_loops=segment_loops)
    lens = [700, 9, 40, 0, 33]
    q, kc, vc, seq_lens, pt, cu = verify_batch(lens, Q_LENS, hq, hkv, d, ps, dtype, device, seed=9)
    attn = _attn(device, hq, hkv, d, ps, dtype, pt, config=config, deterministic=deterministic)
    out = attn.run(attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=4), q, kc, vc)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, ps)
    q1 = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(10)).to(dtype).to(device)
    out1 = attn.run(attn.plan(seq_lens, pt), q1, kc, vc)
    assert_close_to_reference(out1, q1, kc, vc, seq_lens, pt, ps)
    if deterministic:
        alone = attn.run(attn.plan(seq_lens[:1], pt[:1], cu_seqlens_q=cu[:2], q_len=4), q[:4], kc, vc)
        assert torch.equal(alone, out[:4])


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["balanced", "deterministic"])
def test_many_segments_verify_rows(device, deterministic, kv_fp8):
    """Verify rows whose row walks one loop per segment (sm90 head dim 128, 4 tokens at G = 8:
    32 tile rows) run batches of >= MANY_SEGMENTS_PER_CTA segments per CTA on the table's
    one-loop row (over an FP8 cache on the main row still), smaller ones on the main row, both
    to the reference; deterministic mode keeps the one-loop row only where its tile is
    the main row's (32 rows: a request gets the same bits in either), not for 64 rows (8 tokens),
    whose one-loop row has 32-token tiles."""
    from evenkv.configs import MANY_SEGMENTS_PER_CTA, decode_config, many_segments_config
    hq, hkv, d, ps, dtype = 8, 1, 128, 16, torch.bfloat16
    main, many = decode_config("sm90", d, ps, kv_fp8, 32), many_segments_config("sm90", d, ps, kv_fp8, 32)
    if kv_fp8:
        assert many is None  # an FP8 cache keeps the main row for every batch
        many = main
    else:
        assert main.segment_loops and not many.segment_loops and (many.block_n, many.num_warps) == (main.block_n,
                                                                                                       main.num_warps)
    kv_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    probe = evenkv.DecodeAttention(hq, hkv, d, ps, dtype, device, 1, 8, max_q_len=4, arch="sm90", kv_dtype=kv_dtype)
    threshold = -(-MANY_SEGMENTS_PER_CTA * probe.launch_config(1, 4)[1] // hkv)
    lens = [int(x) for x in torch.randint(4, 40, (threshold,), generator=torch.Generator().manual_seed(11))]
    lens[0] = 300
    q_lens = [4] * threshold
    q, kc, vc, seq_lens, pt, cu = verify_batch(lens, q_lens, hq, hkv, d, ps, dtype, device, seed=11)
    scales = {}
    if kv_fp8:
        kc, vc = fp8_caches(kc, vc, K_SCALE, V_SCALE)
        scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    attn = evenkv.DecodeAttention(hq, hkv, d, ps, dtype, device, threshold, pt.shape[1], max_q_len=4, arch="sm90",
                                  deterministic=deterministic, kv_dtype=kv_dtype)
    plan = attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=4)
    assert plan.config == many
    out = attn.run(plan, q, kc, vc, **scales)
    assert_extend_close_to_reference(out, q, kc, vc, cu, seq_lens, pt, ps, **scales)
    alone = attn.plan(seq_lens[:1], pt[:1], cu_seqlens_q=cu[:2], q_len=4)
    assert alone.config == main
    out_alone = attn.run(alone, q[:4], kc, vc, **scales)
    if deterministic:
        assert torch.equal(out_alone, out[:4])
    wide = evenkv.DecodeAttention(hq, hkv, d, ps, dtype, device, threshold, pt.shape[1], max_q_len=8, arch="sm90",
                                  deterministic=deterministic, kv_dtype=kv_dtype)
    expected = decode_config("sm90", d, ps, kv_fp8, 64) if deterministic else \
        many_segments_config("sm90", d, ps, kv_fp8, 64)
    assert wide.launch_config(threshold, 8)[0] == expected


@pytest.mark.parametrize("q_len,max_q_len,head_dim,num_ctas,path", [
    (8, 8, 64, 3, "fused"), (8, 8, 64, 6, "rows"), (2, 2, 64, 6, "rows"), (2, 16, 64, 6, "rows"),
    (8, 8, 128, 8, "rows"), (5, 5, 80, 7, "rows"), (8, 8, 64, 14, "chunks")])
def test_verify_merges(device, q_len, max_q_len, head_dim, num_ctas, path):
    """Verify rows (G = 8: 8 x q_len rows a segment) of a long request cut into pieces, merged
    inside the decode kernel (few pieces) or by merge_stream_kernel, whose S programs per CTA
    boundary share a segment's rows in groups (ROW_GROUP rows a step: 8 at head dim 64, 4 at
    128) or in (row, column chunk) items, to the reference; head dim 80 and q_len 5 mask columns
    and rows of a group; rows of 2 tokens in an object of up to 16 take their own bucket's
    groups and grid (partial slots of 128 rows). A second run of the plan gives the same bytes
    (the fused merges' counters are reset)."""
    from evenkv.kernels.decode_launch import FUSED_MERGE_PIECES, QueryRows, merge_stream_constants, merge_stream_grid
    hq, hkv, ps, dtype = 8, 1, 16, torch.bfloat16
    lens, q_lens = [1200, 5, 0, 70], [q_len, 2, 1, q_len]
    q, kc, vc, seq_lens, pt, cu = verify_batch(lens, q_lens, hq, hkv, head_dim, ps, dtype, device, seed=5)
    attn = evenkv.DecodeAttention(hq, hkv, head_dim, ps, dtype, device, len(lens), pt.shape[1], num_ctas=num_ctas,
                                  max_q_len=max_q_len)
    plan = attn.plan(seq_lens, pt, cu_seqlens_q=cu, q_len=q_len)
    config = attn.launch_config(len(lens), q_len)[0]
    piece, n = int(plan.schedule.plan_scalars[0]), -(-lens[0] // config.block_n)
    query = QueryRows(q_len, 8 * q_len)
    consts = merge_stream_constants(hkv, 8, head_dim, config, False, query)
    assert stream_merge_path((n - 1) // piece + 1, consts) == path, ((n - 1) // piece + 1, consts["ROW_P"])
    # The fewest programs per boundary that leave one row group to each helper of a segment of
    # FUSED_MERGE_PIECES + 1 pieces.
    splits, groups = merge_stream_grid(num_ctas, 8, head_dim, query)[1], -(-8 * q_len // consts["ROW_GROUP"])
    assert (splits - 1) * FUSED_MERGE_PIECES < groups <= splits * FUSED_MERGE_PIECES
    first = attn.run(plan, q, kc, vc)
    assert_extend_close_to_reference(first, q, kc, vc, cu, seq_lens, pt, ps)
    assert int(attn._merge_counters.abs().sum()) == 0
    assert torch.equal(attn.run(plan, q, kc, vc), first)
