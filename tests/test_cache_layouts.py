"""Page layouts: every entry point reads and writes a [num_pages, page_size, Hkv, D] cache with
any page, offset and head strides (NHD pages, HND pages, the pages of a cross-layer
allocation, head-outermost), bitwise as it does the same cache stored as contiguous slots."""

import pytest
import torch

import evenkv
from helpers import K_SCALE, V_SCALE, fp8_caches
from test_verify import verify_batch

HQ, HKV, D, PAGE = 8, 2, 64, 16
LAYOUTS = ["nhd", "hnd", "cross-layer", "head-outer", "vllm-hnd-halves"]


def laid_out(k_slots: torch.Tensor, v_slots: torch.Tensor, layout: str) -> tuple:
    """[num_slots, Hkv, D] K and V caches -> the same pages as [num_pages, PAGE, Hkv, D] views,
    stored in ``layout``:
    nhd: [pages, PAGE, Hkv, D]; hnd: [pages, Hkv, PAGE, D]; cross-layer: layer 1 of a
    [pages, 3 layers, PAGE, Hkv, D] allocation (each page's layers together); head-outer:
    [Hkv, pages, PAGE, D]; vllm-hnd-halves: vLLM's HND cache [pages, Hkv, PAGE, 2 * D] with K
    and V the two halves of the last dim."""
    pages = k_slots.shape[0] // PAGE
    k4, v4 = (c[:pages * PAGE].view(pages, PAGE, HKV, D) for c in (k_slots, v_slots))
    if layout == "nhd":
        return k4.clone(), v4.clone()
    if layout == "hnd":
        return tuple(c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k4, v4))
    if layout == "cross-layer":
        out = []
        for c in (k4, v4):
            buf = torch.full((pages, 3, PAGE, HKV, D), float("nan"), device=c.device).to(c.dtype)
            buf[:, 1] = c
            out.append(buf[:, 1])
        return tuple(out)
    if layout == "head-outer":
        return tuple(c.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for c in (k4, v4))
    assert layout == "vllm-hnd-halves"
    buf = torch.cat([k4, v4], dim=-1).transpose(1, 2).contiguous()  # [pages, Hkv, PAGE, 2 * D]
    return buf.transpose(1, 2)[..., :D], buf.transpose(1, 2)[..., D:]


def _caches(kc, vc, kv_dtype):
    if kv_dtype == "fp8":
        return (*fp8_caches(kc, vc, K_SCALE, V_SCALE), dict(k_scale=K_SCALE, v_scale=V_SCALE))
    return kc, vc, {}


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_reads_every_page_layout(device, layout, kv_dtype):
    """Plain decode rows (a request cut across CTAs, a short one, a padding row)."""
    q, kc, vc, seq_lens, pt, _ = verify_batch([150, 9, 0, 33], [1] * 4, HQ, HKV, D, PAGE, torch.bfloat16, device)
    kc, vc, scales = _caches(kc, vc, kv_dtype)
    kl, vl = laid_out(kc, vc, layout)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.bfloat16, device, 4, pt.shape[1], num_ctas=5,
                                  kv_dtype=kc.dtype)
    plan = attn.plan(seq_lens, pt)
    want = attn.run(plan, q, kc, vc, **scales).clone()
    assert torch.equal(attn.run(plan, q, kl, vl, **scales), want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_kv_heads_read_every_page_layout(device, layout):
    """Two KV heads walked as one (head dim 64 over an FP8 cache): side by side in the slot
    cache, a head stride apart in the other layouts (vLLM's K and V halves among them), bitwise
    the same result."""
    q, kc, vc, seq_lens, pt, _ = verify_batch([150, 9, 0, 33], [1] * 4, HQ, HKV, D, PAGE, torch.bfloat16, device)
    kc, vc, scales = _caches(kc, vc, "fp8")
    kl, vl = laid_out(kc, vc, layout)
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.bfloat16, device, 4, pt.shape[1], num_ctas=5,
                                  kv_dtype=kc.dtype, pack_kv_heads=True)
    assert attn.head_pack == 2
    plan = attn.plan(seq_lens, pt)
    want = attn.run(plan, q, kc, vc, **scales).clone()
    assert torch.equal(attn.run(plan, q, kl, vl, **scales), want)


def test_k_and_v_in_different_layouts(device):
    """K stored NHD beside V stored HND: each cache is addressed with its own strides."""
    q, kc, vc, seq_lens, pt, _ = verify_batch([150, 9, 33], [1] * 3, HQ, HKV, D, PAGE, torch.bfloat16, device)
    k_nhd, _ = laid_out(kc, vc, "nhd")
    _, v_hnd = laid_out(kc, vc, "hnd")
    attn = evenkv.DecodeAttention(HQ, HKV, D, PAGE, torch.bfloat16, device, 4, pt.shape[1], num_ctas=5)
    plan = attn.plan(seq_lens, pt)
    want = attn.run(plan, q, kc, vc).clone()
    assert torch.equal(attn.run(plan, q, k_nhd, v_hnd), want)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_attention_mixes_verify_and_extend_rows_over_hnd_pages(device, kv_dtype):
    """evenkv.Attention over vLLM's HND cache: verify rows on the decode kernels, prefill rows on
    the extend kernel, both bitwise as over the slot cache."""
    lens, q_lens = [60, 20, 9, 40, 12], [3, 1, 4, 13, 12]
    q, kc, vc, seq_lens, pt, cu = verify_batch(lens, q_lens, HQ, HKV, D, PAGE, torch.bfloat16, device, seed=3)
    kc, vc, scales = _caches(kc, vc, kv_dtype)
    kl, vl = laid_out(kc, vc, "vllm-hnd-halves")
    attn = evenkv.Attention(HQ, HKV, D, PAGE, torch.bfloat16, device, 8, pt.shape[1], max_decode_q_len=4,
                            kv_dtype=kc.dtype)
    plan = attn.plan(cu, seq_lens, pt, num_decodes=3, max_q_len=13, decode_q_len=4, num_decode_tokens=8)
    want = attn.run(plan, q, kc, vc, **scales).clone()
    assert torch.equal(attn.run(plan, q, kl, vl, **scales), want)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_kv_into_every_page_layout(device, layout, kv_dtype):
    """write_kv lands each token at its (page, offset) whatever the layout, and nowhere else."""
    _, kc, vc, _, _, _ = verify_batch([40], [1], HQ, HKV, D, PAGE, torch.bfloat16, device)
    kc, vc, scales = _caches(kc, vc, kv_dtype)
    kl, vl = laid_out(kc, vc, layout)
    gen = torch.Generator().manual_seed(7)
    k_new, v_new = (torch.randn(3, HKV, D, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    slots = torch.tensor([2 * PAGE + 5, -1, 17], dtype=torch.int64, device=device)
    evenkv.write_kv(kc, vc, k_new, v_new, slots, **scales)
    evenkv.write_kv(kl, vl, k_new, v_new, slots, **scales)
    want_k, want_v = laid_out(kc, vc, "nhd")
    assert torch.equal(kl.view(torch.uint8) if kv_dtype == "fp8" else kl,
                       want_k.view(torch.uint8) if kv_dtype == "fp8" else want_k)
    assert torch.equal(vl.view(torch.uint8) if kv_dtype == "fp8" else vl,
                       want_v.view(torch.uint8) if kv_dtype == "fp8" else want_v)


def test_extend_reads_hnd_pages(device):
    """evenkv.extend over HND pages equals extend over the slot cache."""
    lens, q_lens = [60, 20, 9], [13, 1, 9]
    q, kc, vc, seq_lens, pt, cu = verify_batch(lens, q_lens, HQ, HKV, D, PAGE, torch.bfloat16, device, seed=5)
    kl, vl = laid_out(kc, vc, "hnd")
    batch = dict(cu_seqlens_q=cu, seq_lens=seq_lens, page_table=pt, page_size=PAGE, max_q_len=13)
    assert torch.equal(evenkv.extend(q, kl, vl, **batch), evenkv.extend(q, kc, vc, **batch))
