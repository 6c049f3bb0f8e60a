"""Hostile batch data: page ids, slots and lengths that point outside the caches.

Without debug mode nothing is checked on the host, so these reach the kernels. Every
kernel must stay inside its tensors (under the interpreter an out-of-bounds access
crashes the process), the requests with good data must still be right, and the device's
error flag must name what was wrong (``evenkv.errors``)."""

import pytest
import torch

import evenkv
from evenkv import errors
from evenkv.kernels.reference import decode_reference, extend_reference
from helpers import assert_close_to_reference, make_paged_batch

HQ, HKV, D, PAGE = 8, 2, 64, 16
LENS = [90, 40, 33, 7]


@pytest.fixture(autouse=True)
def clean_flag(device):
    errors.error_flag(device).zero_()
    yield
    errors.error_flag(device).zero_()


def _flagged(device) -> set[str]:
    return set(errors.peek(device))


@pytest.mark.parametrize("page_id", [999, -3, 2**31 - 1])
@pytest.mark.parametrize("policy,deterministic", [("balanced", False), ("fa3", False), ("none", False),
                                                  ("balanced", True)])
def test_decode_bad_page_id(device, policy, deterministic, page_id):
    q, k, v, lens, pt = make_paged_batch(LENS, HQ, HKV, D, PAGE, torch.float16, device)
    bad = pt.clone()
    bad[0, 2] = page_id  # a used entry of request 0 (90 tokens: pages 0..5)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.float16, device, 4, pt.shape[1], policy,
                                  deterministic=deterministic, num_ctas=3)
    out = attn.run(attn.plan(lens, bad), q, k, v)
    assert torch.isfinite(out).all()
    good = torch.arange(1, 4)
    assert_close_to_reference(out[good], q[good], k, v, lens[good], pt[good], PAGE)
    assert _flagged(device) == {errors.REASONS[errors.PAGE_OUT_OF_RANGE]}
    with pytest.raises(errors.EvenKVError, match="page_table"):
        evenkv.check_errors(device)
    evenkv.check_errors(device)  # cleared


@pytest.mark.parametrize("policy", evenkv.POLICIES)
def test_decode_lengths_are_clamped(device, policy):
    """Negative lengths count as 0 (zeros out), lengths past the page table are clamped to it."""
    q, k, v, lens, pt = make_paged_batch(LENS, HQ, HKV, D, PAGE, torch.float16, device, garbage_tail=False)
    capacity = pt.shape[1] * PAGE
    hostile = torch.tensor([-5, 10**9, 33, 7], dtype=torch.int64, device=device)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.float16, device, 4, pt.shape[1], policy, num_ctas=3)
    out = attn.run(attn.plan(hostile, pt), q, k, v)
    assert torch.all(out[0] == 0)
    clamped = torch.tensor([0, capacity, 33, 7], dtype=torch.int32, device=device)
    assert_close_to_reference(out[1:], q[1:], k, v, clamped[1:], pt[1:], PAGE)
    assert errors.REASONS[errors.LENGTH_OUT_OF_RANGE] in _flagged(device)


def test_write_kv_slot_past_the_cache_is_skipped(device):
    kc = torch.zeros(32, HKV, D, dtype=torch.float16, device=device)
    vc = torch.zeros_like(kc)
    new = torch.ones(3, HKV, D, dtype=torch.float16, device=device)
    evenkv.write_kv(kc, vc, new, new, torch.tensor([10**6, 5, -1], device=device))
    assert torch.all(kc[5] == 1) and kc.sum() == HKV * D and vc.sum() == HKV * D
    assert _flagged(device) == {errors.REASONS[errors.SLOT_OUT_OF_RANGE]}


def _extend_batch(device, new_layout):
    q_lens, prefixes = [5, 9, 3], [40, 0, 17]
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    _, k, v, _, pt = make_paged_batch(seq, HQ, HKV, D, PAGE, torch.float16, device, seed=4)
    total = sum(q_lens)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(total, HQ, D, generator=gen).half().to(device)
    kn = torch.randn(total, HKV, D, generator=gen).half().to(device) if new_layout else None
    vn = torch.randn(total, HKV, D, generator=gen).half().to(device) if new_layout else None
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, kn=kn, vn=vn, cu=cu, seq=torch.tensor(seq, dtype=torch.int32, device=device), pt=pt)


@pytest.mark.parametrize("new_layout", [False, True])
def test_extend_hostile_metadata(device, new_layout):
    """A bad page id, a seq_len below q_len, a query range past q and one longer than
    max_q_len: nothing outside q or the caches is touched, the bad page's tokens are left
    out of their request's attention, a seq_len below q_len is read as q_len, and the other
    request is right."""
    b = _extend_batch(device, new_layout)
    kw = dict(page_size=PAGE, k_new=b["kn"], v_new=b["vn"])
    want = extend_reference(b["q"], b["k"], b["v"], b["cu"], b["seq"], b["pt"], PAGE, k_new=b["kn"], v_new=b["vn"])
    pt, seq, cu = b["pt"].clone(), b["seq"].clone(), b["cu"].clone()
    pt[0, 1] = -7           # request 0: a bad page in its prefix
    seq[2] = 1              # request 2: seq_len < q_len
    out = torch.full_like(b["q"], float("nan"))
    evenkv.extend(b["q"], b["k"], b["v"], cu_seqlens_q=cu, seq_lens=seq, page_table=pt, max_q_len=9, out=out, **kw)
    torch.testing.assert_close(out[5:14].float(), want[5:14], atol=2e-2, rtol=0)
    # The oracle leaves tokens on pages outside the cache out, as the kernels do.
    raised = torch.maximum(seq, cu[1:] - cu[:-1])
    zeroed = extend_reference(b["q"], b["k"], b["v"], cu, raised, pt, PAGE, k_new=b["kn"], v_new=b["vn"])
    torch.testing.assert_close(out[:5].float(), zeroed[:5], atol=2e-2, rtol=0)
    torch.testing.assert_close(out[14:].float(), zeroed[14:], atol=2e-2, rtol=0)
    assert _flagged(device) == {errors.REASONS[errors.PAGE_OUT_OF_RANGE],
                                errors.REASONS[errors.SEQ_LEN_BELOW_Q_LEN]}
    errors.error_flag(device).zero_()
    cu = b["cu"].clone()
    cu[3] = 10**6           # request 2's rows run past q
    out = torch.full_like(b["q"], float("nan"))
    evenkv.extend(b["q"], b["k"], b["v"], cu_seqlens_q=cu, seq_lens=b["seq"], page_table=b["pt"], max_q_len=9,
                  out=out, **kw)
    torch.testing.assert_close(out[:14].float(), want[:14], atol=2e-2, rtol=0)
    assert errors.REASONS[errors.QUERY_OUT_OF_RANGE] in _flagged(device)


@pytest.mark.parametrize("new_layout", [False, True])
def test_extend_bad_page_in_a_tile_seen_in_full(device, new_layout):
    """16 x 16 tiles put the bad page (request 0's tokens 16..31) in a tile all its queries see
    in full, the kernel's unmasked loop: its tokens' K and V are zeros there too."""
    b = _extend_batch(device, new_layout)
    pt = b["pt"].clone()
    pt[0, 1] = 10**7
    small = evenkv.ExtendConfig("test-m16-n16", block_m=16, block_n=16, num_warps=4, num_stages=2)
    out = evenkv.extend(b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"], seq_lens=b["seq"], page_table=pt,
                        page_size=PAGE, max_q_len=9, k_new=b["kn"], v_new=b["vn"], config=small)
    want = extend_reference(b["q"], b["k"], b["v"], b["cu"], b["seq"], pt, PAGE, k_new=b["kn"], v_new=b["vn"])
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
    assert _flagged(device) == {errors.REASONS[errors.PAGE_OUT_OF_RANGE]}


def test_extend_length_reasons_say_what_happened(device):
    """seq_len 3 < q_len 5 has its own reason; a length past the page table keeps the other."""
    b = _extend_batch(device, False)
    kw = dict(cu_seqlens_q=b["cu"], page_table=b["pt"], page_size=PAGE, max_q_len=9)
    evenkv.extend(b["q"], b["k"], b["v"], seq_lens=torch.tensor([3, 9, 20], dtype=torch.int32, device=device), **kw)
    assert _flagged(device) == {errors.REASONS[errors.SEQ_LEN_BELOW_Q_LEN]}
    assert "q_len" in errors.REASONS[errors.SEQ_LEN_BELOW_Q_LEN]
    errors.error_flag(device).zero_()
    evenkv.extend(b["q"], b["k"], b["v"], seq_lens=torch.tensor([45, 9, 10**6], dtype=torch.int32, device=device),
                  **kw)
    flagged = _flagged(device)  # (the page bit too: clamped to the table, request 2 reaches its garbage tail)
    assert errors.REASONS[errors.LENGTH_OUT_OF_RANGE] in flagged
    assert errors.REASONS[errors.SEQ_LEN_BELOW_Q_LEN] not in flagged


def test_reference_zeros_tokens_on_bad_pages(device):
    """The oracle's rule for a page id outside the cache: those tokens' K and V are zeros."""
    from evenkv.kernels.reference import attention_reference, gather_request_kv
    q, k, v, lens, pt = make_paged_batch([40], HQ, HKV, D, PAGE, torch.float32, device, garbage_tail=False)
    bad = pt.clone()
    bad[0, 1] = k.shape[0] // PAGE  # one past the last page: tokens 16..31
    kk, vv = (gather_request_kv(c, pt[0], 40, PAGE).clone() for c in (k, v))
    kk[16:32] = 0
    vv[16:32] = 0
    want, _ = attention_reference(q[0], kk, vv, D ** -0.5)
    torch.testing.assert_close(decode_reference(q, k, v, lens, bad, PAGE)[0], want)


def test_attention_audits_once_per_plan(device):
    """evenkv.Attention flags a bad page of a decode row and of an extend row, once per plan."""
    b = _extend_batch(device, False)
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.float16, device, 4, b["pt"].shape[1])
    cu = torch.tensor([0, 1, 10, 13], dtype=torch.int32, device=device)
    q = b["q"][:13]
    plan = attn.plan(cu, b["seq"], b["pt"], num_decodes=1, max_q_len=9)
    attn.run(plan, q, b["k"], b["v"])
    assert not _flagged(device)
    pt = b["pt"].clone()
    pt[2, 0] = 10**7
    plan = attn.plan(cu, b["seq"], pt, num_decodes=1, max_q_len=9)
    out = attn.run(plan, q, b["k"], b["v"])
    assert torch.isfinite(out).all() and _flagged(device) == {errors.REASONS[errors.PAGE_OUT_OF_RANGE]}


class BoundsCheckingPrefill:
    """An engine prefill kernel that trusts its batch data, as FA3 does: it records every read
    or write its arguments would send outside q, out, the page table or the caches (q and out
    rows from cu_seqlens_q, page-table entries below each seq_len, the pages they name), then
    runs the reference on them."""

    name = "bounds-checking reference prefill"
    fp8_cache_dtypes = ()

    def __init__(self):
        self.violations, self.calls = [], []

    def takes_sinks(self, num_q_heads):
        return True

    def invariant(self):
        return None

    def __call__(self, q, k_cache, v_cache, out, *, cu_seqlens_q, seq_lens, page_table, max_q_len, max_seq_len,
                 sm_scale, sliding_window, logit_cap, sinks, k_scale=1.0, v_scale=1.0):
        cu, lens, page = cu_seqlens_q.tolist(), seq_lens.tolist(), k_cache.shape[1]
        self.calls.append(dict(cu=cu, lens=lens))
        if cu[0] < 0 or cu[-1] > q.shape[0] or any(a > b for a, b in zip(cu, cu[1:])):
            self.violations.append(f"q rows {cu} of {q.shape[0]}")
        for r, n in enumerate(lens):
            if not 0 <= n <= page_table.shape[1] * page:
                self.violations.append(f"request {r}: length {n} past the page table")
                continue
            pages = page_table[r, :-(-n // page)]
            if ((pages < 0) | (pages >= k_cache.shape[0])).any():
                self.violations.append(f"request {r}: pages {pages.tolist()} of {k_cache.shape[0]}")
        if self.violations:
            return
        ref = extend_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, page, sm_scale=sm_scale,
                               sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks)
        out[cu[0]:cu[-1]] = ref[cu[0]:cu[-1]].to(out.dtype)


@pytest.mark.parametrize("case", ["page", "page-before-window", "length", "max-seq-len", "rows", "order", "below",
                                  "negative", "first-row"])
def test_engine_prefill_kernel_gets_bounded_rows(device, case):
    """The extend rows ``Attention`` hands an engine's prefill kernel (FA3, which dereferences
    whatever its arguments say) are bounded as evenkv's own kernels bound theirs: q rows inside
    q, lengths raised to q_len, a request whose length passes the page table or the prefill's
    max_seq_len, or with a page id outside the cache, given no keys (zeros); each is flagged,
    and the other requests are right."""
    b = _extend_batch(device, False)
    window = 4 if case == "page-before-window" else None
    pt, seq, cu, q, num_decodes = b["pt"].clone(), b["seq"].clone(), b["cu"].clone(), b["q"], 0
    want = extend_reference(q, b["k"], b["v"], cu, seq, pt, PAGE, sliding_window=window)
    good, reason = [1, 2], errors.QUERY_OUT_OF_RANGE
    if case in ("page", "page-before-window"):
        pt[0, 0] = -7  # request 0 (45 tokens): under the 4-token window, a page its rows never see
        reason = errors.PAGE_OUT_OF_RANGE
    elif case == "length":
        seq[0] = 10**6  # past the page table, into its garbage tail: no keys either
        reason = errors.LENGTH_OUT_OF_RANGE
    elif case == "max-seq-len":
        reason = errors.LENGTH_OUT_OF_RANGE  # request 0's 45 tokens pass the bound given below
    elif case == "rows":
        cu[3] = 10**6
        good = [0, 1]
    elif case == "order":
        cu[2] = 3  # request 1 ends before it starts: it gets no rows, request 2 the rest
        good = [0]
    elif case in ("below", "negative"):
        seq[2] = 1 if case == "below" else -5
        good, reason = [0, 1], errors.SEQ_LEN_BELOW_Q_LEN
    else:  # a decode row whose q rows are not the ones the host count gives
        cu = torch.tensor([0, 2, 10, 13], dtype=torch.int32, device=device)
        q, num_decodes, good = q[:13], 1, []
    prefill = BoundsCheckingPrefill()
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.float16, device, 4, pt.shape[1], sliding_window=window,
                            prefill_kernel=prefill)
    assert attn.prefill_kernel is prefill
    bound = {"max_seq_len": 44} if case == "max-seq-len" else {}
    plan = attn.plan(cu, seq, pt, num_decodes=num_decodes, max_q_len=9, **bound)
    # (zeroed outputs: the first-row case's q row 1 lies in no bounded range and is not written)
    out = attn.run(plan, q, b["k"], b["v"], out=torch.zeros_like(q))
    out2 = attn.run(plan, q, b["k"], b["v"], out=torch.zeros_like(q))  # the next layer: the same rows
    assert prefill.violations == [] and len(prefill.calls) == 2 and prefill.calls[0] == prefill.calls[1]
    assert errors.REASONS[reason] in _flagged(device)
    assert torch.isfinite(out).all() and torch.equal(out, out2)
    rows = b["cu"].tolist()
    for r in good:
        torch.testing.assert_close(out[rows[r]:rows[r + 1]].float(), want[rows[r]:rows[r + 1]], atol=2e-2, rtol=0)
    if case in ("page", "page-before-window", "length", "max-seq-len"):
        assert prefill.calls[0]["lens"][0] == 0 and torch.all(out[:5] == 0)
    if case == "below":
        assert prefill.calls[0]["lens"][2] == 3  # raised to its q_len, as evenkv's extend kernel reads it


def test_error_watcher_reports_without_waiting(device, caplog):
    watcher = errors.ErrorWatcher(device)
    assert watcher.poll() == []
    errors.error_flag(device).fill_(errors.SLOT_OUT_OF_RANGE)
    found = []
    for _ in range(50):  # on a GPU the first polls may find the copy not back yet
        found = watcher.poll()
        if found:
            break
        if device.type == "cuda":
            torch.cuda.synchronize()
    assert found == [errors.REASONS[errors.SLOT_OUT_OF_RANGE]]
    assert "slot_mapping" in caplog.text and int(errors.error_flag(device)) == 0


def test_reference_of_clamped_decode_matches(device):
    """The clamp rule the kernels follow, on the reference: a length past the page table reads
    the table's full capacity."""
    q, k, v, lens, pt = make_paged_batch([16, 5], HQ, HKV, D, PAGE, torch.float16, device, garbage_tail=False)
    full = torch.tensor([pt.shape[1] * PAGE, 5], dtype=torch.int32, device=device)
    out = evenkv.decode(q, k, v, torch.tensor([10**6, 5], device=device), pt, PAGE)
    torch.testing.assert_close(out.float(), decode_reference(q, k, v, full, pt, PAGE), atol=3e-3, rtol=0)


@pytest.mark.parametrize("cu", [[0, 0, 1, 3], [0, 1, 1, 2]], ids=["shifted", "empty-row"])
@pytest.mark.parametrize("policy,deterministic", [("balanced", False), ("fa3", False), ("none", False),
                                                  ("balanced", True)])
def test_plain_decode_rows_off_their_row_are_flagged(device, cu, policy, deterministic):
    """A plain decode request b's query is q row b: query offsets that put it elsewhere, or give
    a request with keys no query, are flagged and never run on another request's row (those
    rows of out are left as they were: zeros here); the well-formed requests are right."""
    lens_list = [20, 5, 9]
    q, k, v, lens, pt = make_paged_batch(lens_list, HQ, HKV, D, PAGE, torch.float16, device)
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.float16, device, 4, pt.shape[1], policy,
                            deterministic=deterministic)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    out = attn.run(attn.plan(cu_t, lens, pt, num_decodes=3, max_q_len=1), q, k, v, out=torch.zeros_like(q))
    assert errors.REASONS[errors.QUERY_OUT_OF_RANGE] in _flagged(device)
    good = [b for b in range(3) if cu[b] == b and cu[b + 1] == b + 1]
    bad = [b for b in range(3) if b not in good]
    assert torch.all(out[bad] == 0)
    assert_close_to_reference(out[good], q[good], k, v, lens[good], pt[good], PAGE)


def test_extend_max_q_len_zero_with_tokens(device):
    """max_q_len=0 for a batch that has query tokens: rows of one token are run (correct), longer
    ones flagged, none left silently unwritten."""
    b = _extend_batch(device, False)
    out = evenkv.extend(b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"], seq_lens=b["seq"], page_table=b["pt"],
                        page_size=PAGE, max_q_len=0, out=torch.zeros_like(b["q"]))
    assert errors.REASONS[errors.QUERY_OUT_OF_RANGE] in _flagged(device)
    assert torch.isfinite(out).all()
    errors.error_flag(device).zero_()
    one = dict(cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=device), seq_lens=b["seq"][:1].clone(),
               page_table=b["pt"][:1], page_size=PAGE)
    single = evenkv.extend(b["q"][:1], b["k"], b["v"], max_q_len=0, **one)
    assert not _flagged(device)
    assert torch.equal(single, evenkv.extend(b["q"][:1], b["k"], b["v"], max_q_len=1, **one))


def test_new_tokens_beside_an_engine_prefill_kernel_are_refused(device):
    """The engine's prefill kernel reads the new tokens' K/V from the cache: k_new / v_new given
    with it would be dropped, so they are refused."""
    b = _extend_batch(device, True)
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.float16, device, 4, b["pt"].shape[1],
                            prefill_kernel=BoundsCheckingPrefill())
    plan = attn.plan(b["cu"], b["seq"], b["pt"], num_decodes=0, max_q_len=9)
    with pytest.raises(ValueError, match="k_new, v_new: .*bounds-checking reference prefill.*pass None"):
        attn.run(plan, b["q"], b["k"], b["v"], k_new=b["kn"], v_new=b["vn"])


def _misplaced_batch(device, prefixes, q_lens, seed):
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    _, k, v, _, pt = make_paged_batch(seq, HQ, HKV, D, PAGE, torch.float16, device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).half().to(device)
    return q, k, v, torch.tensor(seq, dtype=torch.int32, device=device), pt


@pytest.mark.parametrize("schedule", ["lpt", "ordered"])
def test_extend_range_before_row_0_writes_no_other_rows(device, schedule):
    """A query range that starts before row 0 is flagged and run on no rows: clamped to row 0 it
    would write over the first request's rows. Request 0 claims rows [-4, 0); it is the shorter,
    so LPT runs it after request 1."""
    q, k, v, seq, pt = _misplaced_batch(device, [2, 40], [0, 6], seed=3)
    want = extend_reference(q, k, v, torch.tensor([0, 0, 6], dtype=torch.int32, device=device), seq, pt, PAGE)
    out = evenkv.extend(q, k, v, cu_seqlens_q=torch.tensor([-4, 0, 6], dtype=torch.int32, device=device),
                        seq_lens=seq, page_table=pt, page_size=PAGE, max_q_len=6, schedule=schedule,
                        out=torch.zeros_like(q))
    assert _flagged(device) == {errors.REASONS[errors.QUERY_OUT_OF_RANGE]}
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)  # request 1's rows, all of q



def test_attention_audits_each_cache_size(device):
    """A plan's page audit runs again when a later layer brings a cache of another size: a page
    id inside the first cache but past the second is flagged there, not read as zeros silently."""
    q, k, v, lens, _ = make_paged_batch([40, 20], HQ, HKV, D, PAGE, torch.float16, device, seed=3)  # 8 pages
    pt = torch.tensor([[0, 1, 6], [2, 3, 0]], dtype=torch.int32, device=device)
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.float16, device, 4, pt.shape[1])
    plan = attn.plan(torch.arange(3, dtype=torch.int32, device=device), lens, pt, num_decodes=2, max_q_len=1)
    attn.run(plan, q, k, v)
    assert not _flagged(device)
    attn.run(plan, q, k[:6 * PAGE], v[:6 * PAGE])  # the next layer's cache holds pages 0-5 only
    assert _flagged(device) == {errors.REASONS[errors.PAGE_OUT_OF_RANGE]}


def test_attention_int64_query_offsets_past_int32_are_flagged(device):
    """Attention narrows an int64 cu_seqlens_q to int32 for its decode and audit kernels: offsets
    past 2**31 are clamped (flagged as query rows outside q), never wrapped into rows of q."""
    q, k, v, lens, pt = make_paged_batch([20, 5, 9], HQ, HKV, D, PAGE, torch.float16, device)
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.float16, device, 4, pt.shape[1])
    cu = torch.tensor([0, 1, 2**32 + 2, 2**32 + 3], dtype=torch.int64, device=device)  # wraps to [0, 1, 2, 3]
    out = attn.run(attn.plan(cu, lens, pt, num_decodes=3, max_q_len=1), q, k, v, out=torch.zeros_like(q))
    assert _flagged(device) == {errors.REASONS[errors.QUERY_OUT_OF_RANGE]}
    assert_close_to_reference(out[:1], q[:1], k, v, lens[:1], pt[:1], PAGE)


def test_attention_plans_extend_rows_for_one_token_at_least(device):
    """Attention.plan with max_q_len=0 (no decode rows) still computes 1-token extend rows, as
    extend does, instead of planning them for none."""
    q, k, v, lens, pt = make_paged_batch([20, 5], HQ, HKV, D, PAGE, torch.float16, device)
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.float16, device, 4, pt.shape[1])
    cu = torch.arange(3, dtype=torch.int32, device=device)
    out = attn.run(attn.plan(cu, lens, pt, num_decodes=0, max_q_len=0), q, k, v, out=torch.zeros_like(q))
    assert_close_to_reference(out, q, k, v, lens, pt, PAGE)


def _rows(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("policy,deterministic", [("balanced", False), ("fa3", False), ("none", False),
                                                  ("balanced", True)])
def test_verify_rows_going_back_write_none_of_an_earlier_request(device, policy, deterministic):
    """Verify rows under every policy, cu going back: request 1 ends at row 3, inside request 0's
    rows 0..4, and request 2 starts there. Both keep no rows (each ends at or before request 0's
    end), so request 0's rows and request 3's are right and the batch is flagged."""
    q, k, v, seq, pt = _misplaced_batch(device, [40, 5, 3, 4], [5, 0, 0, 3], seed=6)
    want = extend_reference(q, k, v, _rows([0, 5, 5, 5, 8], device), seq, pt, PAGE)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.float16, device, 4, pt.shape[1], policy,
                                  deterministic=deterministic, max_q_len=8)
    plan = attn.plan(seq, pt, cu_seqlens_q=_rows([0, 5, 3, 5, 8], device), q_len=8)
    out = attn.run(plan, q, k, v, out=torch.zeros_like(q))
    assert _flagged(device) == {errors.REASONS[errors.QUERY_OUT_OF_RANGE]}
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)


@pytest.mark.parametrize("schedule", ["lpt", "ordered"])
def test_extend_range_going_back_keeps_only_its_rows_past_the_earlier_end(device, schedule):
    """evenkv.extend, cu = [0, 5, 3, 8]: request 1's range goes back, and request 2's [3, 8) starts
    inside request 0's [0, 5). Request 2 keeps its rows 5..7, its last three tokens (where its
    query rows put them), and request 0's rows are its own: all 8 rows as the ranges [0, 5), [5, 5),
    [5, 8) give them, flagged."""
    q, k, v, seq, pt = _misplaced_batch(device, [40, 3, 2], [5, 0, 3], seed=3)
    want = extend_reference(q, k, v, _rows([0, 5, 5, 8], device), seq, pt, PAGE)
    out = evenkv.extend(q, k, v, cu_seqlens_q=_rows([0, 5, 3, 8], device), seq_lens=seq, page_table=pt,
                        page_size=PAGE, max_q_len=6, schedule=schedule, out=torch.zeros_like(q))
    assert _flagged(device) == {errors.REASONS[errors.QUERY_OUT_OF_RANGE]}
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)


def test_attention_extend_range_going_back_into_the_decode_rows_writes_none_of_theirs(device):
    """``Attention``, two verify decode rows of 3 tokens (rows 0..5), then extend rows whose cu
    goes back: request 2 ends at row 2 and request 3 covers rows 2..5 of the decode rows. Both keep
    no rows; the decode rows and request 4's rows 6..8 are right, flagged."""
    q, k, v, seq, pt = _misplaced_batch(device, [30, 20, 6, 9, 12], [3, 3, 0, 0, 3], seed=8)
    want = extend_reference(q, k, v, _rows([0, 3, 6, 6, 6, 9], device), seq, pt, PAGE)
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.float16, device, 5, pt.shape[1], max_decode_q_len=4)
    plan = attn.plan(_rows([0, 3, 6, 2, 6, 9], device), seq, pt, num_decodes=2, max_q_len=4, decode_q_len=3,
                     num_decode_tokens=6)
    out = attn.run(plan, q, k, v, out=torch.zeros_like(q))
    assert _flagged(device) == {errors.REASONS[errors.QUERY_OUT_OF_RANGE]}
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
