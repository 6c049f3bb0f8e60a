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
        (lambda: attn.plan(lens, pt[:1]), ValueError, ["page_table", "[2, *]", "(1, 8)"]),
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
        (lambda: attn.run(other, q, kc, vc), ValueError, ["plan", "latest plan"]),
        (lambda: attn.run(plan, q[:1], kc, vc), ValueError, ["q", "[2, 8, 64]", "(1, 8, 64)"]),
        (lambda: attn.run(plan, q.view(2, 4, 128), kc, vc), ValueError, ["q", "[2, 8, 64]"]),
        (lambda: attn.run(plan, q.bfloat16(), kc, vc), TypeError, ["q", "bfloat16"]),
        (lambda: attn.run(plan, q, kc[:, :1], vc), ValueError, ["k_cache", "[*, 2, 64]"]),
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


def test_write_kv_debug_checks_slots(device, monkeypatch):
    monkeypatch.setenv("EVENKV_DEBUG", "1")
    kc = torch.zeros(32, 2, 64, dtype=torch.float16, device=device)
    new = torch.zeros(2, 2, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="slot_mapping: expected slots < num_slots=32, got 32"):
        evenkv.write_kv(kc, kc.clone(), new, new, torch.tensor([1, 32], device=device))


LAUNCHERS = {"decode_launch": ("launch_decode_stream", "launch_merge_stream", "launch_decode_units",
                               "launch_merge_units", "launch_kv_write"),
             "plan_launch": ("launch_plan_stream", "launch_audit_pages")}


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
