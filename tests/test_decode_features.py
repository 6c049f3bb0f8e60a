"""CPU-lane tests of what a layer adds to plain decode: a sliding window, a logit soft-cap,
attention sinks and an FP8 (e4m3) KV cache, alone and together, on every policy, against the
fp32 reference over the same (dequantized) cache; the FP8 KV write against torch's cast;
and the window's plan: a request costs the tiles of its window only."""

import pytest
import torch

import evenkv
from evenkv.kernels.reference import kv_write_reference
from helpers import K_SCALE, V_SCALE, assert_close_to_reference, call_terms, fp8_caches, make_paged_batch

FP8 = torch.float8_e4m3fn
HQ, HKV, D, PAGE = 4, 2, 64, 16
# A long request cut across CTAs, a page-boundary one, one inside any window, an empty row.
LENS = [150, 32, 5, 0, 77]
FEATURES = {
    "window": dict(sliding_window=40),
    "window_1": dict(sliding_window=1),
    "cap": dict(logit_cap=2.0),
    "sinks": dict(sinks=True),
    "fp8": dict(fp8=True),
    "all": dict(sliding_window=24, logit_cap=3.0, sinks=True, fp8=True),
}


def _run_case(device, policy, features, *, dtype=torch.bfloat16, deterministic=None):
    q, kc, vc, seq_lens, pt = make_paged_batch(LENS, HQ, HKV, D, PAGE, dtype, device, seed=3)
    layer = dict(sliding_window=features.get("sliding_window"), logit_cap=features.get("logit_cap"))
    kc, vc, run = call_terms(features, kc, vc, device)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, dtype, device, 8, pt.shape[1], policy, num_ctas=5,
                                  kv_dtype=kc.dtype, deterministic=deterministic, **layer)
    out = attn.run(attn.plan(seq_lens, pt), q, kc, vc, **run)
    assert_close_to_reference(out, q, kc, vc, seq_lens, pt, PAGE, **layer, **run)
    assert torch.all(out[seq_lens == 0] == 0)
    return out


@pytest.mark.parametrize("feature", list(FEATURES))
def test_balanced_decode_features(device, feature):
    _run_case(device, "balanced", FEATURES[feature])


@pytest.mark.parametrize("policy,deterministic", [("fa3", None), ("none", None), ("balanced", True)],
                         ids=["fa3", "none", "deterministic"])
def test_every_policy_with_all_features(device, policy, deterministic):
    _run_case(device, policy, FEATURES["all"], deterministic=deterministic)


# gpt-oss-20b's grouping (G = 8) at head dim 64, on fewer heads.
PACK_HQ, PACK_HKV = 16, 2


@pytest.mark.parametrize("policy", ["balanced", "fa3", "none"])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_packed_kv_heads_match_the_reference(device, policy, features):
    """Over an FP8 cache head dim 64 walks two KV heads as one of 128 columns (G = 8: both
    heads' 8 query rows fill the 16-row tile): every row against its own head's keys only, with
    each layer term, within the tolerance of the reference, as the one-head walk is."""
    terms = FEATURES["all"] if features == "all" else FEATURES["fp8"]
    q, kc, vc, seq_lens, pt = make_paged_batch(LENS, PACK_HQ, PACK_HKV, D, PAGE, torch.bfloat16, device, seed=5)
    layer = dict(sliding_window=terms.get("sliding_window"), logit_cap=terms.get("logit_cap"))
    kc, vc, run = call_terms(terms, kc, vc, device)
    if "sinks" in run:
        run["sinks"] = torch.linspace(-2.0, 3.0, PACK_HQ, device=device)
    for pack in (True, False):
        attn = evenkv.DecodeAttention(PACK_HQ, PACK_HKV, D, PAGE, torch.bfloat16, device, 8, pt.shape[1], policy,
                                      num_ctas=5, kv_dtype=kc.dtype, pack_kv_heads=pack, **layer)
        assert attn.head_pack == (2 if pack else 1)
        out = attn.run(attn.plan(seq_lens, pt), q, kc, vc, **run)
        assert_close_to_reference(out, q, kc, vc, seq_lens, pt, PAGE, **layer, **run)
        assert torch.all(out[seq_lens == 0] == 0)


@pytest.mark.parametrize("case,ctor,packs", [
    ("gpt-oss", dict(num_q_heads=64, num_kv_heads=8), True),
    ("bf16 cache", dict(num_q_heads=64, num_kv_heads=8, kv_dtype=torch.bfloat16), False),
    ("G 2", dict(num_q_heads=4, num_kv_heads=2), True),
    ("G 16: 32 rows", dict(num_q_heads=32, num_kv_heads=2), False),
    ("odd Hkv", dict(num_q_heads=24, num_kv_heads=3), False),
    ("head dim 128", dict(num_q_heads=64, num_kv_heads=8, head_dim=128), False),
    ("verify rows", dict(num_q_heads=64, num_kv_heads=8, max_q_len=2), False),
    ("deterministic", dict(num_q_heads=64, num_kv_heads=8, deterministic=True), False),
    ("sm80 table", dict(num_q_heads=64, num_kv_heads=8, arch="sm80"), False),
    ("told not to", dict(num_q_heads=64, num_kv_heads=8, pack_kv_heads=False), False),
], ids=lambda x: x if isinstance(x, str) else "")
def test_which_batches_pack_kv_heads(device, case, ctor, packs):
    """Unless told not to (``pack_kv_heads=False``), an object packs plain decode rows of head dim
    64 over an FP8 cache whose two heads' query rows fit 16, on a table with an FP8 row of head
    dim 128 (sm90), outside deterministic mode; each plans on the table row of the head dim it walks."""
    kw = dict(head_dim=D, page_size=PAGE, dtype=torch.bfloat16, device=device, max_batch_size=4,
              max_pages_per_request=8, kv_dtype=FP8) | ctor
    attn = evenkv.DecodeAttention(**kw)
    pack = 2 if packs else 1
    assert attn.head_pack == pack
    assert attn.config == evenkv.decode_config(attn.arch, pack * kw["head_dim"], PAGE, kv_fp8=kw["kv_dtype"] == FP8)


def test_sink_limits(device):
    """A sink far above every score takes all the weight (output ~0); one far below takes
    none (the output is the no-sink output, bitwise: its exp2 underflows to 0)."""
    q, kc, vc, seq_lens, pt = make_paged_batch([70, 9], HQ, HKV, D, PAGE, torch.float16, device, seed=1)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.float16, device, 2, pt.shape[1], num_ctas=3)
    plan = attn.plan(seq_lens, pt)
    plain = attn.run(plan, q, kc, vc)
    low = attn.run(plan, q, kc, vc, sinks=torch.full((HQ,), -1e4, device=device))
    high = attn.run(plan, q, kc, vc, sinks=torch.full((HQ,), 1e4, device=device))
    assert torch.equal(low, plain)
    assert high.abs().max().item() == 0


def test_window_plan_costs_window_tiles(device):
    """The balanced plan puts a request of n tokens under window W at cost ceil(min(n, W) /
    BLOCK_N) per KV head: a 128K-token request under a 128-token window costs 128 tokens' tiles."""
    lens = torch.tensor([131072, 100, 0, 3000], dtype=torch.int32, device=device)
    pt = torch.zeros(4, 131072 // PAGE, dtype=torch.int32, device=device)
    for window in (None, 128):
        attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.bfloat16, device, 4, pt.shape[1], num_ctas=4,
                                      sliding_window=window)
        plan = attn.plan(lens, pt)
        block_n = plan.config.block_n
        visible = lens.clamp(max=window) if window else lens
        tiles = (visible + block_n - 1) // block_n
        assert int(plan.schedule.plan_scalars[1]) == int(tiles.sum()) * HKV
        assert int(plan.schedule.plan_scalars[3]) == int(tiles.max())


def test_window_reads_no_page_before_it(device):
    """Pages before a request's window are never read: with them pointing outside the cache,
    the result is exact and the page audit flags nothing."""
    q, kc, vc, seq_lens, pt = make_paged_batch([100, 40], HQ, HKV, D, PAGE, torch.float16, device, seed=2)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.float16, device, 2, pt.shape[1], num_ctas=3,
                                  sliding_window=16)
    out = attn.run(attn.plan(seq_lens, pt), q, kc, vc)
    assert_close_to_reference(out, q, kc, vc, seq_lens, pt, PAGE, sliding_window=16)
    evicted = pt.clone()
    evicted[:, 0] = 1 << 30  # tokens 0..15 of each request: before a 16-token window of both
    evenkv.check_errors(device)
    assert torch.equal(attn.run(attn.plan(seq_lens, evicted), q, kc, vc), out)
    assert evenkv.errors.peek(device) == []


def test_fp8_write_kv_matches_torch_cast(device):
    """write_kv into an FP8 cache stores new / scale rounded to nearest even and saturated to
    +-448, bit for bit as torch's cast of the clamped quotient (normal, subnormal and
    out-of-range values, ties included)."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = 64
    k_new = torch.randn(n, HKV, D, generator=gen, device=device) * 3
    v_new = torch.randn(n, HKV, D, generator=gen, device=device)
    k_new[0, 0, :9] = torch.tensor([1000.0, -1000.0, 449.0, 2 ** -8, 2 ** -10, 2 ** -7 * 1.0625, 0.0, -0.0, -2 ** -12])
    v_new[1, 1, :4] = torch.tensor([1.0625, 1.1875, 2 ** -9 * 1.5, -2 ** -9 * 2.5])  # ties to even
    slots = torch.randperm(2 * n, generator=torch.Generator().manual_seed(1))[:n].to(device)
    slots[3] = -1
    k8, v8 = torch.zeros(2 * n, HKV, D, dtype=FP8, device=device), torch.zeros(2 * n, HKV, D, dtype=FP8, device=device)
    rk, rv = k8.clone(), v8.clone()
    evenkv.write_kv(k8, v8, k_new, v_new, slots, k_scale=0.5, v_scale=1.0)
    kv_write_reference(rk, rv, k_new, v_new, slots, k_scale=0.5, v_scale=1.0)
    assert torch.equal(k8.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), rv.view(torch.uint8))


@pytest.mark.parametrize("run_kwargs,error,fragment", [
    (dict(sinks=torch.zeros(HQ + 1)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(HQ, dtype=torch.int32)), TypeError, "sinks"),
    (dict(sinks=[0.0] * HQ), TypeError, "sinks"),
    (dict(k_scale=torch.tensor(0.5)), TypeError, "k_scale"),
    (dict(k_scale=0.0), ValueError, "k_scale"),
    (dict(v_scale=float("nan")), ValueError, "v_scale"),
    (dict(k_scale=0.5), ValueError, "scales must be 1.0"),
])
def test_bad_layer_arguments(device, run_kwargs, error, fragment):
    q, kc, vc, seq_lens, pt = make_paged_batch([20], HQ, HKV, D, PAGE, torch.float16, device)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.float16, device, 1, pt.shape[1])
    plan = attn.plan(seq_lens, pt)
    run_kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in run_kwargs.items()}
    with pytest.raises(error, match=fragment):
        attn.run(plan, q, kc, vc, **run_kwargs)


@pytest.mark.parametrize("ctor_kwargs,error,fragment", [
    (dict(sliding_window=-1), ValueError, "sliding_window"),
    (dict(sliding_window=2.5), TypeError, "sliding_window"),
    (dict(logit_cap=-1.0), ValueError, "logit_cap"),
    (dict(kv_dtype=torch.float32), TypeError, "kv_dtype"),
    (dict(kv_dtype=torch.float8_e5m2), TypeError, "kv_dtype"),
])
def test_bad_layer_constructor_arguments(device, ctor_kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.float16, device, 1, 4, **ctor_kwargs)


def test_cache_dtype_must_match_kv_dtype(device):
    q, kc, vc, seq_lens, pt = make_paged_batch([20], HQ, HKV, D, PAGE, torch.bfloat16, device)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.bfloat16, device, 1, pt.shape[1], kv_dtype=FP8)
    plan = attn.plan(seq_lens, pt)
    with pytest.raises(TypeError, match="k_cache"):
        attn.run(plan, q, kc, vc)
    k8, v8 = fp8_caches(kc, vc, K_SCALE, V_SCALE)
    with pytest.raises(TypeError, match="v_cache"):
        attn.run(plan, q, k8, vc)


def test_fp8_cache_read_in_pairs_needs_even_strides(device):
    """Decode reads an FP8 cache two elements at a time: a cache view with an odd head stride or
    an odd start is refused naming the cache, before any kernel runs."""
    q, kc, vc, seq_lens, pt = make_paged_batch([20], HQ, HKV, D, PAGE, torch.bfloat16, device)
    k8, v8 = fp8_caches(kc, vc, K_SCALE, V_SCALE)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.bfloat16, device, 1, pt.shape[1], kv_dtype=FP8)
    plan = attn.plan(seq_lens, pt)
    wide = torch.zeros(k8.shape[0], HKV, D + 1, dtype=FP8, device=device)
    wide[..., :D] = k8
    with pytest.raises(ValueError, match=rf"k_cache: .*two elements at a time.*strides \(\d+, \d+, {D + 1}, 1\)"):
        attn.run(plan, q, wide[..., :D], v8, k_scale=K_SCALE, v_scale=V_SCALE)
    shifted = torch.zeros(v8.numel() + 1, dtype=FP8, device=device)[1:].view(v8.shape)
    with pytest.raises(ValueError, match="v_cache: .*2-byte aligned"):
        attn.run(plan, q, k8, shifted, k_scale=K_SCALE, v_scale=V_SCALE)


def test_fp8_needs_sm89(monkeypatch):
    """An FP8 cache is refused on GPUs older than SM89 (Triton cannot widen e4m3 there), with
    the capability in the message; a bf16 cache is not."""
    from evenkv import checks

    monkeypatch.setattr(checks, "is_interpreter", lambda: False)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="kv_dtype.*8.9.*got 8.0"):
        checks.check_fp8_capable(FP8, gpu)
    checks.check_fp8_capable(torch.bfloat16, gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    checks.check_fp8_capable(FP8, gpu)


def test_fp8_writes_and_extends_check_the_gpu(monkeypatch, device):
    """write_kv and extend over an FP8 cache ask check_fp8_capable about their cache's dtype and
    device (an A100 cannot store or widen e4m3), naming k_cache."""
    from evenkv import extend_attention, kv_cache

    asked = []

    def refuse(dtype, dev, name="kv_dtype"):
        asked.append((dtype, dev.type, name))
        raise ValueError(f"{name}: refused")

    monkeypatch.setattr(kv_cache, "check_fp8_capable", refuse)
    monkeypatch.setattr(extend_attention, "check_fp8_capable", refuse)
    k8 = torch.zeros(32, 2, 64, dtype=FP8, device=device)
    new = torch.zeros(1, 2, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="k_cache: refused"):
        evenkv.write_kv(k8, k8.clone(), new, new, torch.zeros(1, dtype=torch.int32, device=device))
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_cache: refused"):
        evenkv.extend(q, k8, k8.clone(), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=device),
                      seq_lens=one, page_table=torch.zeros(1, 2, dtype=torch.int32, device=device), page_size=16,
                      max_q_len=1)
    assert asked == [(FP8, device.type, "k_cache")] * 2
