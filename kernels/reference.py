"""Plain-torch fp32 oracles for every evenkv kernel, used by the tests and by the
benchmark's correctness check. Slow and simple on purpose: loops over requests,
no paging tricks.
"""

import math

import torch


def gather_request_kv(cache: torch.Tensor, page_table_row: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Rows of one request from a paged cache.

    cache [num_slots, Hkv, D]; page_table_row [max_pages] int; returns [seq_len, Hkv, D]
    (same dtype as cache), slot of token t = page_table_row[t // page_size] * page_size + t % page_size.
    """
    tok = torch.arange(seq_len, device=cache.device)
    pages = page_table_row[tok // page_size].long()
    return cache[pages * page_size + tok % page_size]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax attention of one request.

    q [Hq, D], k/v [L, Hkv, D] -> (out [Hq, D] fp32, lse [Hq] fp32, natural log).
    Query head j reads KV head j // (Hq // Hkv). L == 0 gives zeros and lse = -inf.
    """
    hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] == 0:
        return torch.zeros(hq, d, dtype=torch.float32, device=q.device), torch.full((hq,), -math.inf, device=q.device)
    group = hq // hkv
    kf = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.float(), kf) * sm_scale
    lse = torch.logsumexp(scores, dim=1)
    out = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=1), vf)
    return out, lse


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     page_table: torch.Tensor, page_size: int, sm_scale: float | None = None) -> torch.Tensor:
    """Paged decode attention in fp32.

    q [B, Hq, D]; k_cache/v_cache [num_slots, Hkv, D]; seq_lens [B] int;
    page_table [B, max_pages] int32. Returns [B, Hq, D] fp32 (zeros where seq_len is 0).
    """
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k = gather_request_kv(k_cache, page_table[b], seq_len, page_size)
        v = gather_request_kv(v_cache, page_table[b], seq_len, page_size)
        out[b] = attention_reference(q[b], k, v, sm_scale)[0]
    return out


def merge_reference(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> torch.Tensor:
    """Merge partial attention results by log-sum-exp.

    o_parts [S, ..., D] (each normalised over its own keys); lse_parts [S, ...] natural-log
    LSE of each part. Returns the fp32 result over the union of the keys, [..., D].
    """
    weights = torch.softmax(lse_parts.float(), dim=0)
    return (weights.unsqueeze(-1) * o_parts.float()).sum(0)


def kv_write_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """In place: cache[slot_mapping[i]] = new[i] for slot >= 0. k_new/v_new [N, Hkv, D]."""
    keep = slot_mapping >= 0
    k_cache[slot_mapping[keep].long()] = k_new[keep].to(k_cache.dtype)
    v_cache[slot_mapping[keep].long()] = v_new[keep].to(v_cache.dtype)
