"""Test data and the tolerance rule, shared by the tests, the benchmarks and the demo.

* ``random_page_table`` / ``random_paged_batch``: requests whose pages lie in random order
  in a pool, with out-of-range page ids past each request's pages (a kernel that reads past
  a request's length reads the wrong memory, or faults, instead of passing by luck).
* ``tolerance``: ``max|out - ref32| <= 2 * max|baseline - ref32| + floor(dtype)``, where the
  baseline is the same computation in the low dtype (torch's own rounding) and the floor
  covers tiny batches whose baseline error happens to be ~0.
"""

import torch

# Page id written past each request's pages: far outside any test pool.
GARBAGE_PAGE = 2**30
TOLERANCE_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def random_page_table(seq_lens, page_size: int, *, spare_pages: int = 3, spare_cols: int = 1,
                      tail: int = GARBAGE_PAGE, generator: torch.Generator | None = None,
                      device=None) -> tuple[torch.Tensor, int]:
    """Pages for requests of ``seq_lens`` tokens, in random order over a pool of
    ``sum(pages) + spare_pages`` pages.

    Returns (page_table [B, max_pages + spare_cols] int32 on ``device``, whose entries past a
    request's pages hold ``tail``; num_pages in the pool).
    """
    lens = torch.as_tensor(seq_lens, dtype=torch.int64).reshape(-1)
    pages = (lens.clamp(min=0) + page_size - 1) // page_size
    num_pages = int(pages.sum()) + spare_pages
    perm = torch.randperm(max(num_pages, 1), generator=generator)
    cols = torch.arange((int(pages.max()) if pages.numel() else 0) + spare_cols)
    first = torch.cumsum(pages, 0) - pages
    idx = (first[:, None] + cols[None, :]).clamp(max=max(num_pages - 1, 0))
    table = torch.where(cols[None, :] < pages[:, None], perm[idx], tail).to(torch.int32)
    return table.to(device).contiguous(), num_pages


def random_paged_batch(seq_lens, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                       dtype: torch.dtype, device, *, seed: int = 0, spare_pages: int = 3, spare_cols: int = 1,
                       tail: int = GARBAGE_PAGE):
    """A random decode batch over a paged cache; the random data is drawn on ``device``.

    Returns q [B, Hq, D], k_cache / v_cache [num_slots, Hkv, D] (dtype, on device),
    seq_lens [B] int32 and page_table [B, max_pages + spare_cols] int32 (``random_page_table``).
    """
    device = torch.device(device)
    page_table, num_pages = random_page_table(seq_lens, page_size, spare_pages=spare_pages, spare_cols=spare_cols,
                                              tail=tail, generator=torch.Generator().manual_seed(seed),
                                              device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    num_slots = num_pages * page_size
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(page_table.shape[0], num_q_heads, head_dim, generator=gen, device=device, dtype=dtype)
    lens = torch.as_tensor(seq_lens, dtype=torch.int32).reshape(-1).to(device)
    return q, k_cache, v_cache, lens, page_table


def tolerance(ref: torch.Tensor, baseline: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest error the rule allows against ``ref`` (fp32), given ``baseline`` (the
    same result computed in ``dtype``; ``ref.to(dtype)`` for the rounding alone)."""
    base = (baseline.float() - ref).abs().max().item() if ref.numel() else 0.0
    return 2.0 * base + TOLERANCE_FLOOR[dtype]


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in fp32 (NaN if any entry of out is NaN)."""
    if not out.numel():
        return 0.0
    diff = (out.float() - ref).abs()
    return float("nan") if torch.isnan(diff).any() else diff.max().item()


__all__ = ["GARBAGE_PAGE", "TOLERANCE_FLOOR", "random_page_table", "random_paged_batch", "tolerance", "max_error"]
