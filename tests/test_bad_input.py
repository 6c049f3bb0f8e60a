"""Every malformed input raises TypeError/ValueError naming the argument, the expected
and the actual value, before any kernel launches."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import evenkv
from helpers import make_paged_batch


def _attn(device, **kw):
    args = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float16, device=device,
                max_batch_size=4, max_pages_per_request=8)
    args.update(kw)
    return evenkv.DecodeAttention(**args)


@pytest.mark.parametrize("kw,exc,words", [
    (dict(num_q_heads=6, num_kv_heads=4), ValueError, ["num_q_heads", "multiple", "6"]),
    (dict(head_dim=100), ValueError, ["head_dim", "100"]),
    (dict(page_size=3), ValueError, ["page_size", "3"]),
    (dict(dtype=torch.float32), TypeError, ["dtype", "float32"]),
    (dict(policy="fast"), ValueError, ["policy", "fast"]),
    (dict(max_batch_size=0), ValueError, ["max_batch_size", "0"]),
    (dict(num_kv_heads=2.0), TypeError, ["num_kv_heads", "float"]),
    (dict(arch="sm70"), ValueError, ["arch", "sm70"]),
])
def test_constructor_rejects(device, kw, exc, words):
    with pytest.raises(exc) as err:
        _attn(device, **kw)
    for w in words:
        assert w in str(err.value)


def test_plan_rejects(device):
    attn = _attn(device)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    pt = torch.zeros(2, 8, dtype=torch.int32, device=device)
    cases = [
        (lambda: attn.plan(lens.float(), pt), TypeError, ["seq_lens", "float32"]),
        (lambda: attn.plan(lens[None], pt), ValueError, ["seq_lens", "1 dims"]),
        (lambda: attn.plan(lens, pt.long()), TypeError, ["page_table", "int64"]),
        (lambda: attn.plan(lens, pt[:1]), ValueError, ["seq_lens", "[1]", "(1, 8)", "(2,)"]),
        (lambda: attn.plan(torch.ones(5, dtype=torch.int32, device=device),
                           torch.zeros(5, 8, dtype=torch.int32, device=device)), ValueError, ["max_batch_size=4", "5"]),
        (lambda: attn.plan(lens, torch.zeros(2, 9, dtype=torch.int32, device=device)), ValueError,
         ["max_pages_per_request=8", "9"]),
        (lambda: attn.plan(lens, pt, seq_lens_cpu=torch.tensor([5, 129])), ValueError, ["seq_lens", "128", "129"]),
        (lambda: attn.plan(lens, pt, seq_lens_cpu=torch.tensor([-1, 3])), ValueError, ["seq_lens", ">= 0", "-1"]),
        (lambda: attn.plan([5, 9], pt), TypeError, ["seq_lens", "list"]),
    ]
    if device.type == "cuda":
        cases.append((lambda: attn.plan(lens.cpu(), pt), ValueError, ["seq_lens", "device"]))
    for fn, exc, words in cases:
        with pytest.raises(exc) as err:
            fn()
        for w in words:
            assert w in str(err.value), (str(err.value), w)


def test_debug_mode_checks_lengths_and_pages(device):
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    attn = _attn(device, debug=True)
    with pytest.raises(ValueError, match="seq_lens.*capacity"):
        attn.plan(torch.tensor([20, 10**6], dtype=torch.int32, device=device), pt)
    bad = pt.clone()
    bad[0, 1] = kc.shape[0] // 16  # one past the last page
    plan = attn.plan(lens, bad)
    with pytest.raises(ValueError, match=r"page_table: expected page ids in \[0, \d+\)"):
        attn.run(plan, q, kc, vc)
    bad[0, 1] = -1
    plan = attn.plan(lens, bad)
    with pytest.raises(ValueError, match="got -1"):
        attn.run(plan, q, kc, vc)


def test_debug_from_environment(device, monkeypatch):
    monkeypatch.setenv("EVENKV_DEBUG", "1")
    assert _attn(device).debug
    monkeypatch.setenv("EVENKV_DEBUG", "0")
    assert not _attn(device).debug


def test_run_rejects(device):
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    attn = _attn(device)
    with pytest.raises(TypeError, match="plan: expected the DecodePlan"):
        attn.run(None, q, kc, vc)
    stale = attn.plan(lens, pt)
    plan = attn.plan(lens, pt)
    other = _attn(device).plan(lens, pt)
    cases = [
        (lambda: attn.run(stale, q, kc, vc), ValueError, ["plan", "latest plan"]),
        (lambda: attn.run(other, q, kc, vc), ValueError, ["plan", "another DecodeAttention"]),
        (lambda: attn.run(plan, q[:1], kc, vc), ValueError, ["q", "[2, 8, 64]", "(1, 8, 64)"]),
        (lambda: attn.run(plan, q.view(2, 4, 128), kc, vc), ValueError, ["q", "[2, 8, 64]"]),
        (lambda: attn.run(plan, q.bfloat16(), kc, vc), TypeError, ["q", "bfloat16"]),
        (lambda: attn.run(plan, q, kc[:, :1], vc), ValueError, ["k_cache", "[..., Hkv=2, D=64]"]),
        (lambda: attn.run(plan, q, kc, vc[:-1]), ValueError, ["v_cache"]),
        (lambda: attn.run(plan, q, kc, vc.half().float()), TypeError, ["v_cache", "float32"]),
        (lambda: attn.run(plan, q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc), ValueError,
         ["k_cache", "unit stride"]),
        (lambda: attn.run(plan, q, kc, vc, out=torch.empty(2, 8, 64, device=device)), TypeError, ["out", "float32"]),
        (lambda: attn.run(plan, q, kc, vc, out=torch.empty(3, 8, 64, dtype=q.dtype, device=device)), ValueError,
         ["out"]),
        (lambda: attn.run(plan, q.numpy() if device.type == "cpu" else q.cpu().numpy(), kc, vc), TypeError,
         ["q", "ndarray"]),
        (lambda: attn.run(plan, q, kc, vc, sm_scale=-1.0), ValueError, ["sm_scale", "-1.0"]),
    ]
    for fn, exc, words in cases:
        with pytest.raises(exc) as err:
            fn()
        for w in words:
            assert w in str(err.value), (str(err.value), w)


def test_write_kv_rejects(device):
    kc = torch.zeros(32, 2, 64, dtype=torch.float16, device=device)
    new = torch.zeros(3, 2, 64, dtype=torch.float16, device=device)
    slots = torch.tensor([0, 5, -1], device=device)
    with pytest.raises(ValueError, match=r"k_new: expected shape \[3, 2, 64\]"):
        evenkv.write_kv(kc, kc.clone(), new[:, :1], new, slots)
    with pytest.raises(TypeError, match="slot_mapping.*float32"):
        evenkv.write_kv(kc, kc.clone(), new, new, slots.float())
    with pytest.raises(ValueError, match="v_cache"):
        evenkv.write_kv(kc, kc[:16].clone(), new, new, slots)
    # Views whose elements alias each other: heads expanded from one, pages that overlap.
    expanded = torch.zeros(32, 1, 64, dtype=torch.float16, device=device).expand(32, 2, 64)
    with pytest.raises(ValueError, match=r"k_cache: expected a tensor whose elements are distinct.*\(64, 0, 1\)"):
        evenkv.write_kv(expanded, kc.clone(), new, new, slots)
    overlapping = torch.zeros(40 * 128, dtype=torch.float16, device=device).as_strided((4, 16, 2, 64), (512, 64, 64, 1))
    with pytest.raises(ValueError, match=r"v_cache: expected a tensor whose elements are distinct"):
        evenkv.write_kv(overlapping.clone(), overlapping, new, new, slots)


def test_write_kv_debug_checks_slots(device, monkeypatch):
    monkeypatch.setenv("EVENKV_DEBUG", "1")
    kc = torch.zeros(32, 2, 64, dtype=torch.float16, device=device)
    new = torch.zeros(2, 2, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="slot_mapping: expected slots < num_slots=32, got 32"):
        evenkv.write_kv(kc, kc.clone(), new, new, torch.tensor([1, 32], device=device))


LAUNCHERS = {"decode_launch": ("launch_decode_stream", "launch_merge_stream", "launch_decode_units",
                               "launch_merge_units", "launch_kv_write"),
             "plan_launch": ("launch_plan_stream", "launch_audit_pages", "launch_guard_prefill_rows")}


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails the test: malformed input must be refused before launching."""
    from evenkv import kernels

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched for malformed input")

    for module, names in LAUNCHERS.items():
        for name in names:
            monkeypatch.setattr(getattr(kernels, module), name, refuse)


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.uint8]
dims = st.lists(st.integers(0, 9), min_size=0, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(q_shape=dims, q_dtype=st.sampled_from(DTYPES), k_shape=dims, k_dtype=st.sampled_from(DTYPES),
       lens_shape=dims, lens_dtype=st.sampled_from(DTYPES), pt_shape=dims, pt_dtype=st.sampled_from(DTYPES))
def test_fuzz_public_api_refuses_malformed_input(device, no_launch, q_shape, q_dtype, k_shape, k_dtype, lens_shape,
                                                 lens_dtype, pt_shape, pt_dtype):
    """Random shapes and dtypes for every tensor argument: each call either is well formed
    or raises TypeError/ValueError, and nothing is launched before that."""
    attn = _attn(device)
    well_formed_plan = (lens_dtype in (torch.int32, torch.int64) and len(lens_shape) == 1
                        and pt_dtype == torch.int32 and len(pt_shape) == 2 and pt_shape[0] == lens_shape[0]
                        and lens_shape[0] <= 4 and pt_shape[1] <= 8)
    lens = torch.zeros(lens_shape, dtype=lens_dtype, device=device)
    pt = torch.zeros(pt_shape, dtype=pt_dtype, device=device)
    if not well_formed_plan:
        with pytest.raises((TypeError, ValueError)):
            attn.plan(lens, pt)
        return
    if lens_shape[0] > 0:  # a real plan would launch the prepare kernel; the fuzz is about run()
        return
    plan = attn.plan(lens, pt)
    q = torch.zeros(q_shape, dtype=q_dtype, device=device)
    k = torch.zeros(k_shape, dtype=k_dtype, device=device)
    well_formed_run = (q_dtype == torch.float16 and tuple(q_shape) == (0, 8, 64) and k_dtype == torch.float16
                       and len(k_shape) == 3 and tuple(k_shape[1:]) == (2, 64))
    if well_formed_run:
        assert attn.run(plan, q, k, k).shape == (0, 8, 64)
    else:
        with pytest.raises((TypeError, ValueError)):
            attn.run(plan, q, k, k)


# -- one rule per argument, and messages that name it ---------------------------------------

SUPPORTED = "(64, 80, 96, 128, 256)"


def test_head_dim_is_one_rule(device):
    """An unsupported head dim is a ValueError naming head_dim and the supported values, from
    every entry point."""
    q = torch.zeros(3, 8, 100, dtype=torch.float16, device=device)
    k = torch.zeros(32, 2, 100, dtype=torch.float16, device=device)
    meta = dict(cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([3], dtype=torch.int32, device=device),
                page_table=torch.zeros(1, 1, dtype=torch.int32, device=device), page_size=16, max_q_len=3)
    calls = [lambda: _attn(device, head_dim=100),
             lambda: evenkv.Attention(8, 2, 100, 16, torch.float16, device, 4, 8),
             lambda: evenkv.extend(q, k, k, **meta),
             lambda: evenkv.decode(q, k, k, meta["seq_lens"].expand(3).contiguous(), meta["page_table"].expand(3, 1),
                                   16)]
    for call in calls:
        with pytest.raises(ValueError) as err:
            call()
        assert "head_dim" in str(err.value) and SUPPORTED in str(err.value) and "100" in str(err.value)


def test_messages_name_the_tensor(device):
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    with pytest.raises(TypeError, match=r"^q: expected dtype .*float16.*, got torch.float32"):
        evenkv.decode(q.float(), kc, vc, lens, pt, 16)
    meta = dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32, device=device), seq_lens=lens,
                page_table=pt, page_size=16, max_q_len=1)
    with pytest.raises(ValueError, match=r"^q: expected .*CUDA device.*, got meta"):
        evenkv.extend(q.to("meta"), kc, vc, **meta)
    with pytest.raises(ValueError, match=r"^q: expected .*CUDA device.*, got meta"):
        evenkv.decode(q.to("meta"), kc, vc, lens, pt, 16)
    new = torch.zeros(2, 2, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"^k_cache: expected .*CUDA device.*, got meta"):
        evenkv.write_kv(kc.to("meta"), vc.to("meta"), new, new, torch.tensor([0, 1], device=device))


def test_batch_size_mismatch_blames_seq_lens(device):
    """B is the page table's row count; seq_lens (and cu_seqlens_q) must match it, and the
    message names the mismatching argument and both shapes."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3, 9], 8, 2, 64, 16, torch.float16, device)
    cu = torch.arange(4, dtype=torch.int32, device=device)
    calls = [lambda: _attn(device).plan(lens[:2], pt),
             lambda: evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8).plan(cu, lens[:2], pt,
                                                                                     num_decodes=3, max_q_len=1),
             lambda: evenkv.extend(q, kc, vc, cu_seqlens_q=cu, seq_lens=lens[:2], page_table=pt, page_size=16,
                                   max_q_len=1),
             lambda: evenkv.decode(q, kc, vc, lens[:2], pt, 16)]
    for call in calls:
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith("seq_lens:") and "(2,)" in msg and str(tuple(pt.shape)) in msg, msg
    with pytest.raises(ValueError) as err:
        evenkv.extend(q, kc, vc, cu_seqlens_q=cu[:3], seq_lens=lens, page_table=pt, page_size=16, max_q_len=1)
    msg = str(err.value)
    assert msg.startswith("cu_seqlens_q: expected shape [4]") and "(3,)" in msg and str(tuple(pt.shape)) in msg, msg


def test_plan_of_another_object_says_so(device):
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    attn = _attn(device)
    plan = attn.plan(lens, pt)
    with pytest.raises(ValueError, match="plan: .*another DecodeAttention"):
        _attn(device).run(plan, q, kc, vc)
    attn.plan(lens, pt)
    with pytest.raises(ValueError, match="planned another batch since"):
        attn.run(plan, q, kc, vc)
    cu = torch.arange(3, dtype=torch.int32, device=device)
    mixed = [evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8) for _ in range(2)]
    plan = mixed[0].plan(cu, lens, pt, num_decodes=2, max_q_len=1)
    with pytest.raises(ValueError, match="plan: .*another Attention"):
        mixed[1].run(plan, q, kc, vc)
    mixed[0].plan(cu, lens, pt, num_decodes=2, max_q_len=1)
    with pytest.raises(ValueError, match="planned another batch since"):
        mixed[0].run(plan, q, kc, vc)


def test_4d_caches_are_one_rule(device):
    """[num_pages, page_size, Hkv, D] caches: every entry point takes them, and refuses a page
    size other than the object's."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    k4, v4 = kc.view(-1, 16, 2, 64), vc.view(-1, 16, 2, 64)
    attn = _attn(device)
    want = attn.run(attn.plan(lens, pt), q, kc, vc)
    assert torch.equal(attn.run(attn.plan(lens, pt), q, k4, v4), want)
    assert torch.equal(evenkv.decode(q, k4, v4, lens, pt, 16), evenkv.decode(q, kc, vc, lens, pt, 16))
    new = torch.randn(2, 2, 64, device=device).half()
    slots = torch.tensor([3, 17], device=device)
    k3, v3 = kc.clone(), vc.clone()
    evenkv.write_kv(k3, v3, new, new, slots)
    evenkv.write_kv(k4, v4, new, new, slots)
    assert torch.equal(kc, k3) and torch.equal(vc, v3)
    plan = attn.plan(lens, pt)
    with pytest.raises(ValueError, match=r"k_cache: expected \[num_pages, page_size=16, Hkv, D\]"):
        attn.run(plan, q, kc.view(-1, 8, 2, 64), vc.view(-1, 8, 2, 64))


def _raises(call, exc, *words):
    with pytest.raises(exc) as err:
        call()
    for w in words:
        assert w in str(err.value), (str(err.value), w)


def test_index_tensors_must_be_contiguous(device):
    """Lengths, query offsets, slots and tree masks are read by the kernels as dense arrays (no
    strides are passed): a strided view (every other entry) would be read as its neighbours."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    every_other = torch.tensor([20, 16, 3, 16], dtype=torch.int32, device=device)[::2]
    cu_strided = torch.tensor([0, 9, 1, 9, 2], dtype=torch.int32, device=device)[::2]
    cu = torch.arange(3, dtype=torch.int32, device=device)
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8)
    _raises(lambda: _attn(device).plan(every_other, pt), ValueError, "seq_lens", "contiguous", "(2,)")
    _raises(lambda: attention.plan(cu, every_other, pt, num_decodes=2, max_q_len=1), ValueError, "seq_lens",
            "contiguous")
    _raises(lambda: attention.plan(cu_strided, lens, pt, num_decodes=2, max_q_len=1), ValueError, "cu_seqlens_q",
            "contiguous")
    _raises(lambda: evenkv.extend(q, kc, vc, cu_seqlens_q=cu_strided, seq_lens=lens, page_table=pt, page_size=16,
                                  max_q_len=1), ValueError, "cu_seqlens_q", "contiguous")
    _raises(lambda: evenkv.extend(q, kc, vc, cu_seqlens_q=cu, seq_lens=every_other, page_table=pt, page_size=16,
                                  max_q_len=1), ValueError, "seq_lens", "contiguous")
    new = torch.zeros(2, 2, 64, dtype=torch.float16, device=device)
    slots = torch.tensor([3, 9, 7, 10], device=device)[::2]
    _raises(lambda: evenkv.write_kv(kc, vc, new, new, slots), ValueError, "slot_mapping", "contiguous")
    verify = _attn(device, max_q_len=2, tree_masks=True)
    tree = torch.tensor([1, 0, 3, 0, 1, 0, 3, 0], dtype=torch.int32, device=device)[::2]
    _raises(lambda: verify.plan(lens + 2, pt, cu_seqlens_q=cu * 2, q_len=2, tree_mask=tree), ValueError, "tree_mask",
            "contiguous")


def test_tree_mask_must_cover_the_query_rows(device):
    """Each query row reads its own tree-mask entry: a shorter mask would be read past its end."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    short = torch.tensor([1], dtype=torch.int32, device=device)
    verify = _attn(device, max_q_len=2, tree_masks=True)
    plan = verify.plan(lens + 2, pt, cu_seqlens_q=cu, q_len=2, tree_mask=short)
    q4 = torch.zeros(4, 8, 64, dtype=torch.float16, device=device)
    _raises(lambda: verify.run(plan, q4, kc, vc), ValueError, "tree_mask", "4 rows", "(1,)")
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8, max_decode_q_len=2, tree_masks=True)
    _raises(lambda: attention.plan(cu, lens + 2, pt, num_decodes=2, max_q_len=1, decode_q_len=2,
                                   num_decode_tokens=4, tree_mask=short), ValueError, "tree_mask",
            "num_decode_tokens=4", "(1,)")


def test_outputs_and_caches_must_not_alias(device):
    """An output whose rows share memory (an expanded view) would have its rows overwrite each
    other; K and V caches that are one tensor would have V overwrite K."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    shared = torch.empty(1, 8, 64, dtype=torch.float16, device=device).expand(2, 8, 64)
    attn = _attn(device)
    _raises(lambda: attn.run(attn.plan(lens, pt), q, kc, vc, out=shared), ValueError, "out", "distinct")
    cu = torch.arange(3, dtype=torch.int32, device=device)
    _raises(lambda: evenkv.extend(q, kc, vc, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, page_size=16,
                                  max_q_len=1, out=shared), ValueError, "out", "distinct")
    new = torch.zeros(2, 2, 64, dtype=torch.float16, device=device)
    _raises(lambda: evenkv.write_kv(kc, kc, new, new, torch.tensor([0, 1], device=device)), ValueError,
            "v_cache, k_cache", "no element in common")


def test_outputs_must_not_overlap_what_the_kernels_read(device):
    """An output that shares elements with q (other than q itself, in place), the caches or the
    new tokens' K/V would overwrite values a kernel has yet to read; K and V caches that share
    elements would have one token's V overwrite another's K. Views of one buffer that share
    none (vLLM's K and V halves of each row) pass."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    buf = torch.zeros(3, 8, 64, dtype=torch.float16, device=device)
    buf[:2] = q
    q_view, shifted = buf[:2], buf[1:]  # shifted: one row past q, over q's second row
    attn = _attn(device)
    plan = attn.plan(lens, pt)
    want = attn.run(plan, q, kc, vc)
    _raises(lambda: attn.run(plan, q_view, kc, vc, out=shifted), ValueError, "out, q", "no element in common")
    torch.testing.assert_close(attn.run(plan, q_view, kc, vc, out=q_view), want)  # in place
    cu = torch.arange(3, dtype=torch.int32, device=device)
    _raises(lambda: evenkv.extend(q_view, kc, vc, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, page_size=16,
                                  max_q_len=1, out=shifted), ValueError, "out, q")
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8)
    aplan = attention.plan(cu, lens, pt, num_decodes=2, max_q_len=1)
    _raises(lambda: attention.run(aplan, q_view, kc, vc, out=shifted), ValueError, "out, q")
    inside_cache = kc.view(-1)[:2 * 8 * 64].view(2, 8, 64)
    _raises(lambda: attention.run(aplan, q, kc, vc, out=inside_cache), ValueError, "out, k_cache")
    rows = torch.zeros(32, 2, 2 * 64, dtype=torch.float16, device=device)  # each row: K | V
    new = torch.randn(2, 2, 64, device=device).half()
    evenkv.write_kv(rows[..., :64], rows[..., 64:], new, -new, torch.tensor([0, 5], device=device))
    assert torch.equal(rows[5, :, 64:], -new[1]) and torch.equal(rows[5, :, :64], new[1])
    flat = torch.zeros(33 * 2 * 64, dtype=torch.float16, device=device)
    k_over, v_over = flat[:32 * 128].view(32, 2, 64), flat[128:].view(32, 2, 64)  # V's slot 0 is K's slot 1
    _raises(lambda: evenkv.write_kv(k_over, v_over, new, new, torch.tensor([0, 1], device=device)), ValueError,
            "v_cache, k_cache", "no element in common")


def test_attention_runs_only_its_own_decode_plan(device):
    """A batch planned on ``Attention.decode`` directly overwrites the decode schedule of the
    Attention's own plan: running that plan then is refused, not run on the other schedule."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8)
    plan = attention.plan(torch.arange(3, dtype=torch.int32, device=device), lens, pt, num_decodes=2, max_q_len=1)
    attention.decode.plan(lens.flip(0).contiguous(), pt)
    _raises(lambda: attention.run(plan, q, kc, vc), ValueError, "plan", "latest plan")


def test_attention_arguments_are_named(device):
    """Attention's own argument names, not those of the DecodeAttention it builds."""
    for value, exc, words in ((0, ValueError, ("max_decode_q_len", "0")), (2.0, TypeError, ("max_decode_q_len",)),
                              (17, ValueError, ("max_decode_q_len", "17"))):
        _raises(lambda: evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8, max_decode_q_len=value), exc,
                *words)
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8, max_decode_q_len=2, tree_masks=True)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    _raises(lambda: attention.plan(cu, lens + 2, pt, num_decodes=2, max_q_len=1, decode_q_len=2, num_decode_tokens=4,
                                   tree_mask=torch.tensor(3, dtype=torch.int32, device=device)), ValueError,
            "tree_mask", "1 dims")
    _raises(lambda: evenkv.decode(q, kc[:, :0], vc[:, :0], lens, pt, 16), ValueError, "k_cache", "KV head")
    _raises(lambda: evenkv.decode(q[:, :3], kc, vc, lens, pt, 16), ValueError, "q", "Hkv=2", "Hq=3")
    _raises(lambda: attention.plan(cu, lens + 2, pt, num_decodes=0, max_q_len=2, seq_lens_cpu=torch.tensor([1.0])),
            ValueError, "seq_lens_cpu", "[2]")


@pytest.mark.parametrize("kw,words", [
    (dict(sm_scale=1e39), ["sm_scale", "1e+39", "float32"]),
    (dict(sm_scale=1e-46), ["sm_scale", "1e-46"]),
    (dict(sm_scale=1e30, k_scale=1e30), ["sm_scale, k_scale, logit_cap", "score scale"]),
    (dict(k_scale=1e39), ["k_scale", "1e+39"]),
    (dict(v_scale=1e-300), ["v_scale", "1e-300"]),
])
def test_scales_must_be_normal_float32(device, kw, words):
    """The kernels multiply by the scales (and their folded product) in float32: one that
    overflows to inf or underflows to 0 there is refused, naming it."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    fp8 = dict(kv_dtype=torch.float8_e4m3fn)
    attn = _attn(device, **fp8)
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    _raises(lambda: attn.run(attn.plan(lens, pt), q, k8, v8, **kw), ValueError, *words)


def test_logit_cap_and_write_scales_must_be_normal_float32(device):
    _raises(lambda: _attn(device, logit_cap=1e39), ValueError, "logit_cap", "1e+39")
    kc = torch.zeros(32, 2, 64, dtype=torch.float8_e4m3fn, device=device)
    new = torch.zeros(2, 2, 64, dtype=torch.float16, device=device)
    for scale in (1e-46, 1e39):
        _raises(lambda: evenkv.write_kv(kc, kc.clone(), new, new, torch.tensor([0, 1], device=device),
                                        k_scale=scale), ValueError, "k_scale", repr(scale))


def test_required_metadata_and_host_ints(device):
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    _raises(lambda: evenkv.extend(q, kc, vc, cu_seqlens_q=None, seq_lens=lens, page_table=pt, page_size=16,
                                  max_q_len=1), TypeError, "cu_seqlens_q", "NoneType")
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8)
    _raises(lambda: attention.plan(None, lens, pt, num_decodes=2, max_q_len=1), TypeError, "cu_seqlens_q",
            "NoneType")
    cu = torch.arange(3, dtype=torch.int32, device=device)
    _raises(lambda: attention.plan(cu, lens, pt, num_decodes=2, max_q_len=1, decode_q_len=None), TypeError,
            "decode_q_len", "NoneType")


def test_host_arguments_are_checked(device):
    """Host-side arguments named in the message: the host copy of the lengths, an engine prefill
    kernel, the prefill's length bound, the debug and deterministic flags, config tile sizes,
    and caches without a KV head."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    attn = _attn(device)
    _raises(lambda: attn.plan(lens, pt, seq_lens_cpu=[20, 3]), TypeError, "seq_lens_cpu", "list")
    _raises(lambda: attn.plan(lens, pt, seq_lens_cpu=torch.tensor([20])), ValueError, "seq_lens_cpu", "[2]")
    _raises(lambda: attn.plan(lens, pt, seq_lens_cpu=torch.tensor([20.0, 3.0])), TypeError, "seq_lens_cpu",
            "float32")
    _raises(lambda: evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8, prefill_kernel="fa3"), TypeError,
            "prefill_kernel", "str")
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
    _raises(lambda: attention.plan(cu, lens, pt, num_decodes=1, max_q_len=3, max_seq_len=-5), ValueError,
            "max_seq_len", "-5")
    _raises(lambda: evenkv.DecodeAttention(8, 2, 64, 16, torch.float16, "gpu", 4, 8), ValueError, "device", "'gpu'")
    _raises(lambda: attn.warmup(q, [1], vc), TypeError, "k_cache", "list")
    _raises(lambda: attn.warmup(q.float(), kc, vc), TypeError, "q", "float32")
    _raises(lambda: attn.warmup(q, kc, vc, index_dtypes=(torch.float32,)), TypeError, "index_dtypes")
    _raises(lambda: attention.warmup(q, kc, vc, k_new=q), ValueError, "k_new, v_new")
    _raises(lambda: _attn(device, debug="no"), TypeError, "debug", "'no'")
    _raises(lambda: _attn(device, deterministic="yes"), TypeError, "deterministic", "'yes'")
    _raises(lambda: evenkv.ExtendConfig("x", block_m=3, block_n=16, num_warps=4, num_stages=2), ValueError,
            "ExtendConfig.block_m", "power of two", "3")
    _raises(lambda: evenkv.DecodeConfig("x", block_n=64, num_warps=4, num_stages=0, max_ctas_per_sm=1), ValueError,
            "DecodeConfig.num_stages", "0")
    empty = torch.zeros(32, 0, 64, dtype=torch.float16, device=device)
    _raises(lambda: evenkv.extend(q, empty, empty, cu_seqlens_q=torch.arange(3, dtype=torch.int32, device=device),
                                  seq_lens=lens, page_table=pt, page_size=16, max_q_len=1), ValueError, "k_cache",
            "KV head")
    new = torch.zeros(2, 0, 64, dtype=torch.float16, device=device)
    _raises(lambda: evenkv.write_kv(empty, empty.clone(), new, new, torch.tensor([0, 1], device=device)), ValueError,
            "k_cache", "KV head")


def test_fp8_cache_with_new_tokens_bounds_v_scale_for_fp16(device):
    """Over an FP8 cache the new tokens' probabilities enter the stored-V accumulator as p /
    v_scale in q's dtype: below 1 / 65504 that overflows fp16 (NaN out), so it is refused, by
    extend and Attention alike; bf16 queries, or no k_new, take it."""
    q, kc, vc, lens, pt = make_paged_batch([20, 3], 8, 2, 64, 16, torch.float16, device)
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    new = torch.zeros(2, 2, 64, dtype=torch.float16, device=device)
    cu = torch.arange(3, dtype=torch.int32, device=device)
    kw = dict(cu_seqlens_q=cu, seq_lens=lens, page_table=pt, page_size=16, max_q_len=1)
    _raises(lambda: evenkv.extend(q, k8, v8, k_new=new, v_new=new, v_scale=1e-5, **kw), ValueError, "v_scale",
            "65504", "1e-05")
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8, kv_dtype=torch.float8_e4m3fn)
    plan = attention.plan(cu, lens, pt, num_decodes=0, max_q_len=1)
    _raises(lambda: attention.run(plan, q, k8, v8, k_new=new, v_new=new, v_scale=1e-5), ValueError, "v_scale")
    assert torch.isfinite(evenkv.extend(q.bfloat16(), k8, v8, k_new=new.bfloat16(), v_new=new.bfloat16(),
                                        v_scale=1e-5, **kw)).all()
    assert torch.isfinite(evenkv.extend(q, k8, v8, v_scale=1e-5, **kw)).all()


def test_attention_debug_mode_checks_page_ids(device):
    """EVENKV_DEBUG: Attention.run refuses a page id outside the cache on the host, for a decode
    row and for an extend row, as DecodeAttention.run does."""
    q, kc, vc, lens, pt = make_paged_batch([40, 20], 8, 2, 64, 16, torch.float16, device)
    attention = evenkv.Attention(8, 2, 64, 16, torch.float16, device, 4, 8, debug=True)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    for row in (0, 1):
        bad = pt.clone()
        bad[row, 1] = kc.shape[0] // 16  # one past the last page
        plan = attention.plan(cu, lens, bad, num_decodes=1, max_q_len=1)
        _raises(lambda: attention.run(plan, q, kc, vc), ValueError, "page_table", "got")
