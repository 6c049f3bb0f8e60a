"""GPU lane, with vLLM installed: the serving benchmark's KV write for vLLM's own backends
(``benchmarks.kit_stand_ins.write_kv_cache``) runs vLLM's fused Triton write on CUDA tensors;
it must store what the PyTorch scatter of the CPU path stores, bit for bit, in model-dtype and
e4m3 caches of both page layouts, and leave skipped (slot -1) and untouched slots alone.
"""

import pytest
import torch

from benchmarks.kit_stand_ins import write_kv_cache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU lane: no CUDA device")]

BLOCKS, BLOCK_SIZE, HKV, D = 64, 16, 8, 128  # Qwen3-8B's KV heads


def _case(cache_dtype, layout, tokens=300, padded=320):
    """key/value [padded, HKV, D] bf16 (vLLM pads past the slot mapping's tokens), caches
    [BLOCKS, BLOCK_SIZE, HKV, D] views (HND: head-major storage), an int64 slot mapping of
    ``tokens`` distinct slots outside block 0 with a few -1 (padding) among them."""
    generator = torch.Generator().manual_seed(0)
    key, value = (torch.randn(padded, HKV, D, generator=generator).to(torch.bfloat16) * 64 for _ in range(2))
    key[1, 0, 0] = 1e4  # beyond e4m3's range once divided by the scale
    shape = (BLOCKS, HKV, BLOCK_SIZE, D) if layout == "HND" else (BLOCKS, BLOCK_SIZE, HKV, D)
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
    if layout == "HND":
        caches = [c.transpose(1, 2) for c in caches]
    slots = BLOCK_SIZE + torch.randperm((BLOCKS - 1) * BLOCK_SIZE, generator=generator)[:tokens]
    slots[::37] = -1
    return key, value, caches, slots


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype, kv_cache_dtype", [(torch.bfloat16, "auto"), (torch.uint8, "fp8"),
                                                         (torch.float8_e4m3fn, "fp8_e4m3")])
def test_fused_write_stores_what_the_cpu_scatter_stores(cache_dtype, kv_cache_dtype, layout):
    pytest.importorskip("vllm.v1.attention.ops.triton_reshape_and_cache_flash",
                        reason="vLLM's fused KV write comes with vLLM (the vLLM kit), not with the peers kit")
    key, value, (k_cpu, v_cpu), slots = _case(cache_dtype, layout)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([2.0])  # powers of two: exact divisions either way
    write_kv_cache(key, value, k_cpu, v_cpu, slots, kv_cache_dtype, k_scale, v_scale)
    k_gpu, v_gpu = (torch.zeros_like(c, device="cuda") for c in (k_cpu, v_cpu))
    if layout == "HND":
        k_gpu, v_gpu = (torch.zeros(BLOCKS, HKV, BLOCK_SIZE, D, dtype=cache_dtype, device="cuda").transpose(1, 2)
                        for _ in range(2))
    write_kv_cache(key.cuda(), value.cuda(), k_gpu, v_gpu, slots.cuda(), kv_cache_dtype, k_scale.cuda(),
                   v_scale.cuda())
    torch.cuda.synchronize()
    written = sorted(slots[slots >= 0].tolist())
    for cpu, gpu in ((k_cpu, k_gpu), (v_cpu, v_gpu)):
        cpu_bits, gpu_bits = (c.view(torch.uint8) if c.element_size() == 1 else c.view(torch.int16)
                              for c in (cpu, gpu.cpu()))
        # Slot 0 holds what the CPU scatter writes for a slot of -1; vLLM's write skips it.
        assert torch.equal(gpu_bits[1:], cpu_bits[1:])
        slot_rows = gpu_bits.reshape(BLOCKS * BLOCK_SIZE, HKV * D)
        assert slot_rows.ne(0).any(dim=1).nonzero().flatten().tolist() == written
