"""Numerics under hostile values (CPU lane; on a GPU machine the same tests run compiled).

Decode (every policy, and deterministic=True) and extend against the fp32 oracles with
the project's tolerance rule, on requests built so that the right answer is
well-conditioned and the rule's bound stays small (so every check can fail):

* ``large``: scaled scores up to |q.k| * sm_scale = 1e4 (q = 1000 on one dim per query
  head, keys integers in [-40, 40] there); the best key appears twice (an exact tie, so
  the answer is the mean of two V rows), 250 above the next, which is past the softmax
  resolution of every implementation, while the unscaled dot (<= 4e4) still fits fp16,
  so torch's fp16 baseline is meaningful.
* ``one_finite``: every key but one has a dot product of -6e7 (-inf-like; torch's fp16
  baseline turns it into -inf), the finite one sits in the last tile.
* ``all_neg``: every key is the same -inf-like row: uniform weights, mean of V.
* ``overflow``: q and the two best keys hold 60000 on one dim: the product (3.6e9)
  overflows fp16 but not fp32 accumulation.
* padding rows (seq_len 0, q = NaN) must give zeros.

All values are integers small enough that every score is exact in fp32 (ties stay
bitwise ties in any reduction order). Every cache slot a request does not own, including
the unused tail of its last page, holds NaN / +Inf / -Inf, and page-table tails point at
a poisoned page or far out of range: none of it may reach the output.

Tolerance rule (helpers.py): max|out - ref32| <= 2 * max|torch_lowp - ref32| + floor,
applied per request (per query row for extend). Where torch's own fp16 run overflows (its
output is NaN) its error is unbounded; there we hold evenkv to the floor alone, which is
stricter than the rule.
Every bound is also checked to be below BOUND_MEANINGFUL: a wrong key choice moves the
output by ~|v| ~ 1, so it would fail.
"""

import itertools
import math

import pytest
import torch

import evenkv
from evenkv.configs import ExtendConfig
from evenkv.kernels.reference import decode_reference, extend_reference
from helpers import TOLERANCE_FLOOR, lowp_decode

HQ, HKV, D, PAGE = 8, 2, 64, 16
G = HQ // HKV
SM_SCALE = 0.25       # with q = 1000 and keys up to 40: scaled scores 1e4, unscaled 4e4 < fp16 max
BIG_Q, HOT = 1000.0, 40
NEG = -60000.0        # -inf-like key entry: dot = -6e7 (fp16 overflows to -inf, fp32 exact)
OVF = 60000.0         # fp16-overflow entry: 60000 * 60000 = 3.6e9 (fp32 exact)
BOUND_MEANINGFUL = 0.05
POISON = (float("nan"), float("inf"), float("-inf"))
FAR_PAGE = 2**30


def _request(kind, length, gen, hot_end=None):
    """q row [Hq, D] and K/V rows [L, Hkv, D] (fp32, exact in fp16) of one request; the
    best keys of ``large`` / ``overflow`` lie just before ``hot_end`` (default: the end)."""
    noise = lambda *s: torch.randint(-2, 3, s, generator=gen).float()  # noqa: E731
    q = noise(HQ, D)
    q[:, :G] = 0
    scale = OVF if kind == "overflow" else BIG_Q
    for hq in range(HQ):
        q[hq, hq % G] = scale  # query head h*G + g reads dim g of its KV head's keys
    k = noise(length, HKV, D)
    k[:, :, :G] = torch.randint(-HOT, HOT, (length, HKV, G), generator=gen).float()  # <= 39
    v = torch.randn(length, HKV, D, generator=gen)
    if kind in ("one_finite", "all_neg"):
        k[:, :, :] = 0
        k[:, :, :G] = NEG
        if kind == "one_finite":
            k[length - 4] = noise(HKV, D)
            k[length - 4, :, :G] = torch.randint(-HOT, HOT, (HKV, G), generator=gen).float()
    if kind in ("large", "overflow"):
        if kind == "large":
            k[: min(64, length // 3), :, :G] = NEG  # a whole first tile of -inf-like keys
            k[: min(64, length // 3), :, G:] = 0
        # per (kv head, g): the best key twice (tokens t, t + 1), late in the request
        end = length if hot_end is None else hot_end
        for h in range(HKV):
            for g in range(G):
                t = end - 2 - 2 * (h * G + g)
                k[t, h, g] = HOT if kind == "large" else OVF
                if kind == "overflow":
                    k[t, h, G:] = 0  # 3.6e9 + small integers would round in fp32
                k[t + 1, h] = k[t, h]
    return q, k, v


def _poisoned_cache(num_slots, used_slots, dtype):
    """[num_slots, Hkv, D] caches whose unused slots cycle through NaN, +Inf, -Inf."""
    cache = torch.empty(num_slots, HKV, D)
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[used_slots] = False
    idx = torch.nonzero(unused).flatten()
    for i, val in enumerate(POISON):
        cache[idx[i::3]] = val
    return cache.to(dtype), cache.clone().to(dtype)


def _page_table(lengths, gen):
    """Pages in random order, one spare poisoned page; tails alternate that page and FAR_PAGE."""
    pages = [math.ceil(n / PAGE) for n in lengths]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages, generator=gen)
    poison_page = int(perm[-1])
    pt = torch.empty(len(lengths), max([1] + pages) + 2, dtype=torch.int32)
    pt[:, 0::2], pt[:, 1::2] = poison_page, FAR_PAGE
    used = 0
    for b, n in enumerate(pages):
        pt[b, :n] = perm[used:used + n].int()
        used += n
    return pt, num_pages


def _slots(pt_row, length):
    tok = torch.arange(length)
    return pt_row[tok // PAGE].long() * PAGE + tok % PAGE


def decode_batch(kinds_lens, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [n for _, n in kinds_lens]
    pt, num_pages = _page_table(lengths, gen)
    q = torch.full((len(lengths), HQ, D), float("nan"))
    rows = {}
    for b, (kind, n) in enumerate(kinds_lens):
        if n:
            q[b], kb, vb = _request(kind, n, gen)
            rows[b] = (_slots(pt[b], n), kb, vb)
    used = torch.cat([s for s, _, _ in rows.values()])
    kc, vc = _poisoned_cache(num_pages * PAGE, used, torch.float32)
    for s, kb, vb in rows.values():
        kc[s], vc[s] = kb, vb
    to = lambda t: t.to(dtype).to(device)  # noqa: E731
    return to(q), to(kc), to(vc), torch.tensor(lengths, dtype=torch.int32, device=device), pt.to(device)


def check_rule(out, ref, lowp, dtype, what):
    """The tolerance rule for one request; returns the bound."""
    assert torch.isfinite(ref).all(), f"{what}: the fp32 oracle is not finite (test bug)"
    assert torch.isfinite(out).all(), f"{what}: non-finite values in the output"
    err = (out.float() - ref).abs().max().item()
    lowp_err = (lowp.float() - ref).abs()
    # torch's fp16 run overflowed (NaN): its error is then unbounded, floor alone.
    overflowed = not torch.isfinite(lowp_err).all()
    base = 0.0 if overflowed else lowp_err.max().item()
    bound = 2 * base + TOLERANCE_FLOOR[dtype]
    assert bound < BOUND_MEANINGFUL, f"{what}: bound {bound:.3e} too loose to catch a wrong key (test bug)"
    assert err <= bound, f"{what}: max abs error {err:.3e} > bound {bound:.3e} (torch {dtype} error {base:.3e})"
    return bound


def check_decode(out, q, kc, vc, seq_lens, pt, kinds, sm_scale=SM_SCALE):
    for b, kind in enumerate(kinds):
        n = int(seq_lens[b])
        if n == 0:
            assert torch.all(out[b] == 0), f"row {b}: a padding row (seq_len 0, q NaN) must be zeros"
            continue
        sub = (q[b:b + 1], kc, vc, seq_lens[b:b + 1], pt[b:b + 1], PAGE, sm_scale)
        check_rule(out[b:b + 1], decode_reference(*sub), lowp_decode(*sub), q.dtype, f"row {b} ({kind}, {n} tokens)")


# The long request is cut by every policy with num_ctas=5 and, at 2100 tokens, into two
# 2048-token chunks by deterministic mode: its best keys sit in the last piece, after a
# first piece whose LSE is dominated by -inf-like keys.
DECODE_BATCH = [("large", 2100), ("one_finite", 70), ("pad", 0), ("overflow", 37), ("all_neg", 21), ("large", 45)]
VARIANTS = [("balanced", False), ("fa3", False), ("none", False), ("balanced", True)]


@pytest.mark.parametrize("policy,deterministic", VARIANTS, ids=[f"{p}{'-det' if d else ''}" for p, d in VARIANTS])
def test_decode_hostile_values(device, policy, deterministic):
    dtype = torch.float16
    q, kc, vc, seq_lens, pt = decode_batch(DECODE_BATCH, dtype, device)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, dtype, device, 8, pt.shape[1], policy, sm_scale=SM_SCALE,
                                  num_ctas=5, deterministic=deterministic)
    plan = attn.plan(seq_lens, pt)
    out = attn.run(plan, q, kc, vc)
    check_decode(out, q, kc, vc, seq_lens, pt, [k for k, _ in DECODE_BATCH])


def test_decode_default_scale_overflow_inputs(device):
    """fp16-overflow and -inf-like rows at the default sm_scale (1/sqrt(D))."""
    batch = [("overflow", 33), ("one_finite", 19), ("large", 80)]
    q, kc, vc, seq_lens, pt = decode_batch(batch, torch.float16, device, seed=1)
    out = evenkv.decode(q, kc, vc, seq_lens, pt, PAGE, num_ctas=3)
    check_decode(out, q, kc, vc, seq_lens, pt, [k for k, _ in batch], sm_scale=1 / math.sqrt(D))


def test_decode_fp16_q_overflow_with_unit_scale(device):
    """|q| * sm_scale * log2(e) > 65504: decode must scale the fp32 scores, not q in fp16
    (it once did, and this case returned an error of 2.1)."""
    batch = [("overflow", 33)]
    q, kc, vc, seq_lens, pt = decode_batch(batch, torch.float16, device, seed=2)
    out = evenkv.decode(q, kc, vc, seq_lens, pt, PAGE, sm_scale=1.0, num_ctas=3)
    check_decode(out, q, kc, vc, seq_lens, pt, ["overflow"], sm_scale=1.0)


# -- extend -------------------------------------------------------------------------

SMALL = ExtendConfig("test-m16-n16", block_m=16, block_n=16, num_warps=4, num_stages=2)
# (kind, prefix, q_len): causal, the new tokens are the last q_len keys of the request.
EXTEND_BATCH = [("large", 90, 7), ("one_finite", 40, 5), ("pad", 0, 0), ("overflow", 30, 3), ("all_neg", 12, 9)]


def extend_batch(spec, dtype, device, *, new_layout, seed=0):
    """vLLM layout (cache holds every token) or SGLang layout (cache holds the prefix; the
    new tokens' slots are poisoned and their K/V come as k_new / v_new)."""
    gen = torch.Generator().manual_seed(seed)
    seq = [p + n for _, p, n in spec]
    pt, num_pages = _page_table(seq, gen)
    qs, reqs = [], []
    for b, (kind, prefix, q_len) in enumerate(spec):
        if seq[b] == 0:
            continue
        q_row, kb, vb = _request(kind, seq[b], gen, hot_end=prefix)  # best keys visible to every query
        qs.append(q_row.expand(q_len, HQ, D))
        reqs.append((b, prefix, q_len, kb, vb))
    stored = [(_slots(pt[b], prefix if new_layout else prefix + n), kb, vb) for b, prefix, n, kb, vb in reqs]
    kc, vc = _poisoned_cache(num_pages * PAGE, torch.cat([s for s, _, _ in stored]), torch.float32)
    for s, kb, vb in stored:
        kc[s], vc[s] = kb[:len(s)], vb[:len(s)]
    k_new = v_new = None
    if new_layout:
        k_new = torch.cat([kb[p:] for _, p, _, kb, _ in reqs]).to(dtype).to(device)
        v_new = torch.cat([vb[p:] for _, p, _, _, vb in reqs]).to(dtype).to(device)
    cu = torch.tensor(list(itertools.accumulate([n for _, _, n in spec], initial=0)), dtype=torch.int32)
    to = lambda t: t.to(dtype).to(device)  # noqa: E731
    return dict(q=to(torch.cat(qs)), k_cache=to(kc), v_cache=to(vc), cu_seqlens_q=cu.to(device),
                seq_lens=torch.tensor(seq, dtype=torch.int32, device=device), page_table=pt.to(device),
                k_new=k_new, v_new=v_new, max_q_len=max(n for _, _, n in spec))


@pytest.mark.parametrize("new_layout", [False, True], ids=["vllm", "sglang"])
@pytest.mark.parametrize("sm_scale", [SM_SCALE, 1.0], ids=["scale0.25", "scale1"])
def test_extend_hostile_values(device, new_layout, sm_scale):
    dtype = torch.float16
    bt = extend_batch(EXTEND_BATCH, dtype, device, new_layout=new_layout)
    args = (bt["q"], bt["k_cache"], bt["v_cache"])
    meta = dict(cu_seqlens_q=bt["cu_seqlens_q"], seq_lens=bt["seq_lens"], page_table=bt["page_table"])
    out = evenkv.extend(*args, **meta, page_size=PAGE, max_q_len=bt["max_q_len"], k_new=bt["k_new"],
                        v_new=bt["v_new"], sm_scale=sm_scale, config=SMALL)
    kw = dict(k_new=bt["k_new"], v_new=bt["v_new"], sm_scale=sm_scale)
    ref = extend_reference(*args, **meta, page_size=PAGE, **kw)
    lowp = extend_reference(*args, **meta, page_size=PAGE, compute_dtype=dtype, **kw)
    cu = bt["cu_seqlens_q"].tolist()
    for b, (kind, prefix, q_len) in enumerate(EXTEND_BATCH):
        rows = slice(cu[b], cu[b + 1])
        for i in range(q_len):  # per query row: causal rows see different key sets
            r = slice(cu[b] + i, cu[b] + i + 1)
            check_rule(out[r], ref[r], lowp[r], dtype, f"request {b} ({kind}) query {i}")
        assert torch.isfinite(out[rows]).all()


def test_extend_nan_in_q_propagates(device):
    """A NaN in q makes its (row, head) output NaN, as torch's softmax does, and nothing else;
    a row that sees no key is zeros, NaN in q or not. The oracle follows the same rule."""
    from helpers import make_paged_batch

    dtype, q_lens, prefixes = torch.float16, [5, 3], [20, 0]
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    _, kc, vc, lens, pt = make_paged_batch(seq, HQ, HKV, D, PAGE, dtype, device, seed=3)
    q = torch.randn(sum(q_lens), HQ, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    q[1, 5, 7] = float("nan")   # request 0, query 1, head 5
    q[6, 0, :] = float("nan")   # request 1, query 1, head 0
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    meta = dict(cu_seqlens_q=cu, seq_lens=lens, page_table=pt, page_size=PAGE)
    out = evenkv.extend(q, kc, vc, **meta, max_q_len=5, config=SMALL)
    ref = extend_reference(q, kc, vc, **meta)
    lowp = extend_reference(q, kc, vc, **meta, compute_dtype=dtype)
    nan_at = torch.zeros(out.shape[:2], dtype=torch.bool, device=device)
    nan_at[1, 5] = nan_at[6, 0] = True
    for name, t in (("extend", out), ("extend_reference", ref)):
        assert torch.equal(torch.isnan(t).all(-1), nan_at), f"{name}: NaN rows are not exactly the NaN queries"
        assert not torch.isnan(t[~nan_at]).any(), f"{name}: NaN spread past its (row, head)"
    err = (out.float() - ref)[~nan_at].abs().max().item()
    assert err <= 2 * (lowp.float() - ref)[~nan_at].abs().max().item() + TOLERANCE_FLOOR[dtype]
    # Rows that see no key: a page table without columns leaves the vLLM-layout queries none.
    out = evenkv.extend(q, kc, vc, **dict(meta, page_table=pt[:, :0]), max_q_len=5, config=SMALL)
    ref = extend_reference(q, kc, vc, **dict(meta, page_table=pt[:, :0], seq_lens=torch.zeros_like(lens)))
    assert (out == 0).all() and (ref == 0).all()
    flag = evenkv.errors.error_flag(device)
    assert int(flag.item()) & evenkv.errors.LENGTH_OUT_OF_RANGE, "lengths past a table of no columns are flagged"
    flag.zero_()
