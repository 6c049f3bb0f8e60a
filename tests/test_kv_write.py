"""KV-write kernel vs the torch reference."""

import pytest
import torch

import evenkv
from evenkv.kernels.reference import kv_write_reference


@pytest.mark.parametrize("hkv,d,dtype", [(2, 64, torch.float16), (1, 128, torch.bfloat16), (3, 96, torch.float16)])
def test_write_kv_matches_reference(device, hkv, d, dtype):
    gen = torch.Generator().manual_seed(hkv)
    kc = torch.randn(40, hkv, d, generator=gen).to(dtype).to(device)
    vc = torch.randn(40, hkv, d, generator=gen).to(dtype).to(device)
    k_new = torch.randn(6, hkv, d, generator=gen).to(device)  # fp32 in, cast to the cache dtype
    v_new = torch.randn(6, hkv, d, generator=gen).to(dtype).to(device)
    slots = torch.tensor([3, -1, 39, 0, -5, 17], device=device)
    k_ref, v_ref = kc.clone(), vc.clone()
    kv_write_reference(k_ref, v_ref, k_new, v_new, slots)
    evenkv.write_kv(kc, vc, k_new, v_new, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)


def test_write_kv_into_strided_cache_view(device):
    """vLLM-style combined cache [2, slots, Hkv, D]: write through the K and V views."""
    kv = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=device)
    new = torch.randn(2, 2, 64, device=device).half()
    evenkv.write_kv(kv[0], kv[1], new, new * 2, torch.tensor([4, 9], dtype=torch.int32, device=device))
    assert torch.equal(kv[0, 4], new[0]) and torch.equal(kv[1, 9], new[1] * 2)
    assert kv[:, [i for i in range(16) if i not in (4, 9)]].abs().sum() == 0


def test_write_kv_empty(device):
    kc = torch.zeros(4, 1, 64, dtype=torch.float16, device=device)
    e = torch.zeros(0, 1, 64, dtype=torch.float16, device=device)
    evenkv.write_kv(kc, kc.clone(), e, e, torch.zeros(0, dtype=torch.int64, device=device))
