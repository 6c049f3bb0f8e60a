"""Writing new tokens into the paged KV cache: ``write_kv`` (and its start-up compile,
``warmup_write_kv``)."""

import torch

from evenkv.kernels import decode_launch as launch

from .checks import (FP8_KV_DTYPES, INDEX_DTYPES, SUPPORTED_DTYPES, as_pages, check_distinct_elements,
                     check_fp8_capable, check_kv_caches, check_kv_scale, check_no_shared_elements, check_tensor,
                     resolve_device)
from .configs import debug_enabled
from .errors import error_flag


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new tokens into the paged cache, in place.

    k_cache, v_cache: [num_pages, page_size, Hkv, D] (slot = page x page_size + offset) or
    [num_slots, Hkv, D], any strides but a unit stride in D (NHD or HND pages alike) that do
    not alias one element to another; float16/bfloat16 or float8_e4m3fn. k_new, v_new: [N, Hkv, D]
    (float16/bfloat16/float32, cast to the cache's; an FP8 cache stores new / k_scale and
    new / v_scale, saturated to +-448 and rounded to nearest even). slot_mapping: [N]
    int32/int64, slot of each token, negative = skip (padding). A slot >= num_slots (num_pages x
    page_size) is not written and sets the device's error flag (``evenkv.check_errors``); with EVENKV_DEBUG=1
    slots are checked on the host first.
    """
    dev = check_kv_caches(k_cache, v_cache, page_size=None, dtypes=SUPPORTED_DTYPES + FP8_KV_DTYPES, device=None)
    check_distinct_elements("k_cache", k_cache)
    check_distinct_elements("v_cache", v_cache)
    check_no_shared_elements("v_cache", v_cache, "k_cache", k_cache)
    check_fp8_capable(k_cache.dtype, dev, "k_cache")
    k_cache, v_cache = slot_pages(k_cache), slot_pages(v_cache)
    num_pages, page_size, hkv, d = k_cache.shape
    if hkv < 1 or d < 1:
        raise ValueError(f"k_cache: expected at least one KV head and a head dim >= 1, got [.., Hkv={hkv}, D={d}]")
    num_slots = num_pages * page_size
    k_scale, v_scale = check_kv_scale("k_scale", k_scale), check_kv_scale("v_scale", v_scale)
    if k_cache.dtype not in FP8_KV_DTYPES and (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError(f"k_scale, v_scale: a {k_cache.dtype} cache holds real values, so both scales must be 1.0; "
                         f"got {k_scale} and {v_scale}")
    check_tensor("slot_mapping", slot_mapping, shape=(None,), dtypes=INDEX_DTYPES, device=dev, contiguous=True)
    n = slot_mapping.shape[0]
    check_tensor("k_new", k_new, shape=(n, hkv, d), dtypes=SUPPORTED_DTYPES + (torch.float32,), device=dev,
                 last_dim_contiguous=True)
    check_tensor("v_new", v_new, shape=(n, hkv, d), dtypes=SUPPORTED_DTYPES + (torch.float32,), device=dev,
                 last_dim_contiguous=True)
    if n == 0:
        return
    if debug_enabled(None):
        hi = int(slot_mapping.max())
        if hi >= num_slots:
            raise ValueError(f"slot_mapping: expected slots < num_slots={num_slots}, got {hi}")
    launch.launch_kv_write(k_cache, v_cache, k_new, v_new, slot_mapping, error_flag(dev), k_scale, v_scale)


def warmup_write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    index_dtypes: tuple = INDEX_DTYPES) -> None:
    """Compile, without running, ``write_kv``'s kernel for tensors laid out like these
    (``write_kv``'s shapes), for slot mappings of each dtype in ``index_dtypes``."""
    dev = resolve_device(k_cache.device, "k_cache")
    k_cache, v_cache = slot_pages(k_cache), slot_pages(v_cache)
    for dtype in index_dtypes:
        launch.launch_kv_write(k_cache, v_cache, k_new, v_new, torch.zeros(1, dtype=dtype, device=dev),
                               error_flag(dev), warmup=True)


def slot_pages(cache: torch.Tensor) -> torch.Tensor:
    """A checked cache as the KV-write kernel takes it: a 4-D cache as it is, a 3-D one as pages of
    one slot (``as_pages``), since finding a slot never needs a 3-D cache's page size."""
    return as_pages(cache, 1)


__all__ = ["write_kv", "warmup_write_kv"]
