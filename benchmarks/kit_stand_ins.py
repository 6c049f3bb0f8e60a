"""A KV-cache write for vLLM's own backends where vLLM runs without its compiled ``_C``.

The device kit's vLLM replaces the compiled ``_C`` extension with PyTorch stand-ins
(``vllm._C_stable_libtorch``, which sets ``STUB = True``). Its ``reshape_and_cache_flash`` is a
handful of PyTorch ops per layer (index arithmetic and two scatters), where a full install runs
one fused kernel, and it writes only a cache in the model dtype. So on the kit ``FLASH_ATTN``
would pay a KV write that evenkv, which writes with its own kernel, does not, and
could not start over an FP8 cache at all. ``install_kv_write`` registers ``write_kv_cache`` in
its place, in this process: on CUDA tensors it is vLLM's own fused Triton write
(``triton_reshape_and_cache_flash``, the one vLLM's ``TRITON_ATTN`` backend writes with), one
kernel per layer that reads the scales on the device, for model-dtype and e4m3 caches alike; on
CPU tensors, where that kernel cannot run, the same scatter in PyTorch.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
KV_WRITE_OP = "reshape_and_cache_flash"


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor,
                   v_scale: torch.Tensor) -> None:
    """vLLM's ``_C_cache_ops::reshape_and_cache_flash``: token i of ``key`` / ``value`` ([>= N, Hkv, D],
    model dtype; vLLM pads them past the N tokens of ``slot_mapping``) to slot ``slot_mapping[i]``
    (int64 [N]; slot = block * block_size + offset) of
    ``key_cache`` / ``value_cache`` ([blocks, block_size, Hkv, D] views of any strides). ``kv_cache_dtype``
    ``auto``: stored as they are (cast to the cache's dtype); ``fp8`` / ``fp8_e4m3``: stored as
    e4m3 of value / scale (``k_scale``, ``v_scale``: float32 tensors of one element) in a uint8
    or float8_e4m3fn cache (saturated to +-448, rounded to nearest even). A slot of -1 (a
    padding token): vLLM's write skips it on CUDA; the CPU scatter writes it to slot 0 instead,
    which lies in vLLM's reserved null block (no boolean masking, which would sync)."""
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype: expected 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto" and key_cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"key_cache/value_cache: expected uint8 or float8_e4m3fn for kv_cache_dtype "
                         f"{kv_cache_dtype!r}, got {key_cache.dtype}")
    if key_cache.is_cuda:
        from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

        triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                       v_scale)
        return
    n = slot_mapping.numel()
    block_size = key_cache.shape[1]
    slots = slot_mapping.flatten().long().clamp(min=0)
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        if kv_cache_dtype == "auto":
            cache[blocks, offsets] = src[:n].to(cache.dtype)
            continue
        quantized = (src[:n].float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        cache.view(torch.float8_e4m3fn)[blocks, offsets] = quantized


def runs_on_stand_ins() -> bool:
    """Whether this process's vLLM runs on the device kit's PyTorch stand-ins for ``_C``."""
    try:
        import vllm._C_stable_libtorch as compiled_ops
    except ImportError:
        return False
    return bool(getattr(compiled_ops, "STUB", False))


_registrations: torch.library.Library | None = None  # a registration lasts while its library lives


def install_kv_write() -> None:
    """Registers ``write_kv_cache`` as ``_C_cache_ops::reshape_and_cache_flash`` for CUDA and CPU
    tensors in this process, once (the op must be defined already, as the kit's stand-ins define
    it). Processes this one spawns do not inherit it: with tensor parallelism > 1 vLLM's workers
    keep the kit's write."""
    global _registrations
    if _registrations is None:
        library = torch.library.Library("_C_cache_ops", "IMPL")
        for dispatch_key in ("CUDA", "CPU"):
            # The kit registered its write from Python too, which torch 2.11 (the device's)
            # refuses to override unless asked; 2.13 allows it by default.
            library.impl(KV_WRITE_OP, write_kv_cache, dispatch_key, allow_override=True)
        _registrations = library
