"""A KV-cache write for vLLM's own backends where vLLM runs without its compiled ``_C``.

The device kit's vLLM replaces the compiled ``_C`` extension with PyTorch stand-ins
(``vllm._C_stable_libtorch``, which sets ``STUB = True``). Its ``reshape_and_cache_flash``
writes only a cache in the model dtype, so ``FLASH_ATTN`` (and every vLLM backend that writes
through that op) cannot start over an FP8 cache there. ``install_kv_write`` registers
``write_kv_cache`` in its place, in this process: the same scatter, plus vLLM's e4m3 write
(value / scale, saturated to the e4m3 range, rounded to nearest even), so the serving
benchmark can run the engine's default backend over the same FP8 cache as evenkv.

Like the kit's own stand-in it is a few PyTorch ops per layer where vLLM runs one fused
kernel, so the baseline's write costs more than in a full install. evenkv writes its cache
with its own kernel and never calls this op.
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
    or float8_e4m3fn cache. A slot of -1 (a padding token) is written to slot 0 instead, which
    lies in vLLM's reserved null block: no boolean masking, which would sync and break CUDA-graph
    capture."""
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype: expected 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")
    n = slot_mapping.numel()
    block_size = key_cache.shape[1]
    slots = slot_mapping.flatten().long().clamp(min=0)
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        if kv_cache_dtype == "auto":
            cache[blocks, offsets] = src[:n].to(cache.dtype)
            continue
        if cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
            raise ValueError(f"key_cache/value_cache: expected uint8 or float8_e4m3fn for kv_cache_dtype "
                             f"{kv_cache_dtype!r}, got {cache.dtype}")
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
