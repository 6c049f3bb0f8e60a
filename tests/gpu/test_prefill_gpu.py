"""GPU lane: extend rows on the engine's prefill kernel (vLLM's or SGLang's FA3) against evenkv's Triton
extend kernel and the fp32 reference, pages 16 (vLLM) and 1 (SGLang), mixed batches.

Needs ``vllm.vllm_flash_attn`` (the peers or vLLM device kit) or, for the FP8 case on SGLang's
FA3, the SGLang kit: each case is skipped, saying so, without its kernel.
"""

import pytest
import torch

import evenkv
import evenkv.errors
from evenkv.integrations.prefill import sglang_flash_attention, vllm_flash_attention
from test_extend import assert_tolerance, make_batch, reference_pair

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU lane: no CUDA device")]


@pytest.fixture(scope="module")
def fa():
    kernel = vllm_flash_attention("cuda")
    if kernel is None:
        pytest.skip("vllm.vllm_flash_attn is not importable here (source the peers or vLLM kit)")
    return kernel


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("num_decodes", [0, 40])
def test_engine_prefill_matches_triton_and_reference(fa, page_size, num_decodes):
    evenkv.errors.error_flag("cuda").zero_()
    hq, hkv, d, dtype = 32, 4, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(page_size + num_decodes)
    q_lens = [1] * num_decodes + [2048, 300, 7, 1000]
    prefixes = torch.randint(1, 6000, (num_decodes,), generator=gen).tolist() + [8000, 0, 3000, 17]
    batch = make_batch(q_lens, prefixes, hq, hkv, d, page_size, dtype, "cuda", seed=3)
    args = (batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"])
    kw = dict(num_decodes=num_decodes, max_q_len=2048, max_seq_len=max(p + n for p, n in zip(prefixes, q_lens)))
    outs = {}
    for name, kernel in (("fa3", fa), ("triton", None)):
        attn = evenkv.Attention(hq, hkv, d, page_size, dtype, "cuda", 64, batch["page_table"].shape[1],
                                prefill_kernel=kernel)
        assert (attn.prefill_kernel is None) == (kernel is None), attn.prefill_reason
        plan = attn.plan(*args, **kw)
        outs[name] = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"])
    ref, lowp = reference_pair(batch, page_size, max_scores=1 << 28)
    for out in outs.values():
        assert_tolerance(out, ref, lowp, dtype)
    evenkv.check_errors()


@pytest.mark.parametrize("terms", [dict(sliding_window=8), dict(sliding_window=300, sinks=True),
                                   dict(logit_cap=2.0, sinks=True), dict(sliding_window=64, logit_cap=5.0, sinks=True)],
                         ids=["window8", "window300-sinks", "softcap-sinks", "window64-softcap-sinks"])
def test_engine_prefill_with_layer_terms(fa, terms):
    """A layer's window, soft-cap and sinks reach the engine's FA3 as the reference defines them
    (window W: keys [p - W + 1, p]; sinks: natural-log logits added to each row's denominator),
    extend rows against the fp32 reference and evenkv's Triton extend, decode rows of the same
    batch on evenkv's kernels, vLLM's page size."""
    evenkv.errors.error_flag("cuda").zero_()
    hq, hkv, d, ps, dtype, nd = 32, 4, 128, 16, torch.bfloat16, 6
    q_lens, prefixes = [1] * nd + [700, 33, 1, 260], [900, 5, 300, 2000, 64, 40] + [1200, 0, 500, 9]
    batch = make_batch(q_lens, prefixes, hq, hkv, d, ps, dtype, "cuda", seed=13)
    # Sink logits exact in bf16, the dtype FA3 reads them in (VllmFlashAttention rounds others).
    sinks = torch.linspace(-2.0, 3.0, hq, device="cuda").bfloat16().float() if terms.get("sinks") else None
    layer = dict(sliding_window=terms.get("sliding_window"), logit_cap=terms.get("logit_cap"))
    outs = {}
    for name, kernel in (("fa3", fa), ("triton", None)):
        attn = evenkv.Attention(hq, hkv, d, ps, dtype, "cuda", 64, batch["page_table"].shape[1], prefill_kernel=kernel,
                                **layer)
        assert (attn.prefill_kernel is None) == (kernel is None), attn.prefill_reason
        plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=nd, max_q_len=700,
                         max_seq_len=2001)
        outs[name] = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"], sinks=sinks)
    ref, lowp = reference_pair(batch, ps, sinks=sinks, max_scores=1 << 28, **layer)
    for name, out in outs.items():
        try:
            assert_tolerance(out, ref, lowp, dtype)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
    evenkv.check_errors()


# FA3's 8-bit path rounds P to e4m3 in its PV dot: 2.7-3.0 % of the largest output's magnitude
# in docs/tuning.md's emulation ("What 8-bit dots cost in accuracy", random normal K and V).
FP8_P_ERROR = 0.05


@pytest.mark.parametrize("case", ["page", "length", "rows"])
def test_engine_prefill_gets_bounded_rows(fa, case):
    """FA3 dereferences whatever its arguments say: a page id far outside the cache, a length
    past the page table or query rows past q would read (and for rows, write) outside their
    tensors, a fault or a silent wrong answer. evenkv bounds them first: the batch runs, the
    device flag names the fault, and the requests with good data match the reference."""
    evenkv.errors.error_flag("cuda").zero_()
    hq, hkv, d, dtype, ps, nd = 32, 4, 128, torch.bfloat16, 16, 4
    q_lens, prefixes = [1] * nd + [700, 300, 40], [900] * nd + [2000, 0, 5000]
    batch = make_batch(q_lens, prefixes, hq, hkv, d, ps, dtype, "cuda", seed=9)
    ref, lowp = reference_pair(batch, ps, max_scores=1 << 28)
    cu, seq, pt = batch["cu_seqlens_q"].clone(), batch["seq_lens"].clone(), batch["page_table"].clone()
    rows = batch["cu_seqlens_q"].tolist()
    good = [nd + 1, nd + 2]  # the extend requests left alone (request nd is the bad one)
    if case == "page":
        pt[nd, 3] = 10**8
        reason = evenkv.errors.PAGE_OUT_OF_RANGE
    elif case == "length":
        seq[nd] = 10**8
        reason = evenkv.errors.LENGTH_OUT_OF_RANGE
    else:
        cu[-1] = 10**8  # the last request's rows run past q (and out)
        good, reason = [nd, nd + 1], evenkv.errors.QUERY_OUT_OF_RANGE
    attn = evenkv.Attention(hq, hkv, d, ps, dtype, "cuda", 64, pt.shape[1], prefill_kernel=fa)
    plan = attn.plan(cu, seq, pt, num_decodes=nd, max_q_len=700, max_seq_len=5100)
    out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"])
    torch.cuda.synchronize()
    assert evenkv.errors.REASONS[reason] in evenkv.errors.peek("cuda")
    for r in list(range(nd)) + good:
        assert_tolerance(out[rows[r]:rows[r + 1]], ref[rows[r]:rows[r + 1]], lowp[rows[r]:rows[r + 1]], dtype)
    evenkv.errors.error_flag("cuda").zero_()


@pytest.mark.parametrize("finder, ps", [(vllm_flash_attention, 16), (sglang_flash_attention, 1)],
                         ids=["vllm-page16", "sglang-page1"])
def test_engine_prefill_over_an_fp8_cache(monkeypatch, finder, ps):
    """Extend rows over an FP8 cache on the engine's FA3 8-bit path (q cast to e4m3, the cache's
    scales as descales), within FA3's e4m3-P error of the fp32 reference over the e4m3 q and the
    dequantized cache; decode rows of the same batch stay on evenkv (q in 16 bits), within the
    usual rule of the full-precision reference."""
    from test_extend import quantized

    monkeypatch.delenv("EVENKV_PREFILL", raising=False)
    kernel = finder("cuda")
    if kernel is None or not kernel.fp8_cache_dtypes:
        pytest.skip(f"{finder.__name__}: this engine's FA3 is not importable here (source its device kit)")
    hq, hkv, d, dtype, nd = 32, 4, 128, torch.bfloat16, 8
    q_lens, prefixes = [1] * nd + [1500, 200, 9], [3000] * nd + [4000, 0, 700]
    batch = quantized(make_batch(q_lens, prefixes, hq, hkv, d, ps, dtype, "cuda", seed=5), 0.05, 0.04)
    attn = evenkv.Attention(hq, hkv, d, ps, dtype, "cuda", 64, batch["page_table"].shape[1], prefill_kernel=kernel,
                            kv_dtype=torch.float8_e4m3fn)
    assert attn.prefill_kernel is kernel, attn.prefill_reason
    plan = attn.plan(batch["cu_seqlens_q"], batch["seq_lens"], batch["page_table"], num_decodes=nd, max_q_len=1500,
                     max_seq_len=5500)
    out = attn.run(plan, batch["q"], batch["k_cache"], batch["v_cache"], k_scale=0.05, v_scale=0.04)
    scales = dict(k_scale=0.05, v_scale=0.04, max_scores=1 << 28)
    ref, lowp = reference_pair(batch, ps, **scales)
    assert_tolerance(out[:nd], ref[:nd], lowp[:nd], dtype)
    q8 = batch["q"].float().clamp(-448, 448).to(torch.float8_e4m3fn).to(dtype)
    ref8, _ = reference_pair(dict(batch, q=q8), ps, **scales)
    err = (out[nd:].float() - ref8[nd:]).abs().max().item()
    assert err <= FP8_P_ERROR * ref8[nd:].abs().max().item(), err


@pytest.mark.parametrize("chunks", [4])
def test_chunked_prefill_bitwise_invariant(chunks):
    """An 8K-token prompt prefilled at once or in 4 chunks of 2K (vLLM's layout, evenkv's Triton
    extend kernel, as deterministic mode runs it): the same bits at every query position."""
    hq, hkv, d, ps, n = 32, 4, 128, 16, 8192
    batch = make_batch([n], [0], hq, hkv, d, ps, torch.bfloat16, "cuda", seed=9)
    args = dict(k_cache=batch["k_cache"], v_cache=batch["v_cache"], page_table=batch["page_table"], page_size=ps)
    i32 = dict(dtype=torch.int32, device="cuda")
    one = evenkv.extend(batch["q"], cu_seqlens_q=torch.tensor([0, n], **i32), seq_lens=torch.tensor([n], **i32),
                        max_q_len=n, **args)
    c = n // chunks
    for i in range(chunks):
        part = evenkv.extend(batch["q"][i * c:(i + 1) * c], cu_seqlens_q=torch.tensor([0, c], **i32),
                             seq_lens=torch.tensor([(i + 1) * c], **i32), max_q_len=c, **args)
        assert torch.equal(part, one[i * c:(i + 1) * c]), f"chunk {i}"
