"""Plain-torch fp32 oracles for every evenkv kernel, used by the tests and by the
benchmark's correctness check. Slow and simple on purpose: loops over requests,
no paging tricks.

FP8 caches hold stored values: real K = stored K * k_scale (V likewise). Sinks [Hq] are one
logit per query head (natural log, neither scaled nor capped) that joins the softmax
denominator: out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}) (gpt-oss).

The kernels' rules for odd data hold here too: a token whose page id lies outside the cache
is not read, its K and V taken as zeros; a query that sees no key (and has no sink) gives
zeros; a NaN in q or in a key a query sees makes that query's output NaN, as torch's softmax
does.
"""

import math

import torch

from evenkv.checks import FP8_KV_DTYPES


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
                     page_table: torch.Tensor, page_size: int, sm_scale: float | None = None, *,
                     sliding_window: int | None = None, logit_cap: float | None = None,
                     sinks: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Paged decode attention in fp32: ``extend_reference`` with one query per request, at
    position seq_len - 1 (with a window W it sees keys [seq_len - W, seq_len)).

    q [B, Hq, D]; k_cache/v_cache [num_slots, Hkv, D]; seq_lens [B] int;
    page_table [B, max_pages] int32. Returns [B, Hq, D] fp32 (zeros where seq_len is 0).
    """
    cu_seqlens_q = torch.arange(q.shape[0] + 1, device=q.device)
    return extend_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, page_size, sm_scale=sm_scale,
                            sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks, k_scale=k_scale,
                            v_scale=v_scale)


def merge_reference(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> torch.Tensor:
    """Merge partial attention results by log-sum-exp.

    o_parts [S, ..., D] (each normalised over its own keys); lse_parts [S, ...] natural-log
    LSE of each part. Returns the fp32 result over the union of the keys, [..., D].
    """
    weights = torch.softmax(lse_parts.float(), dim=0)
    return (weights.unsqueeze(-1) * o_parts.float()).sum(0)


def kv_write_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """In place: cache[slot_mapping[i]] = new[i] for slot >= 0. k_new/v_new [N, Hkv, D]. An FP8
    cache stores new / scale, saturated to its finite range and rounded to nearest even."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for cache, new, scale in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
        if cache.dtype in FP8_KV_DTYPES:
            top = torch.finfo(cache.dtype).max
            cache[slots] = (new[keep].float() / scale).clamp(-top, top).to(cache.dtype)
        else:
            cache[slots] = new[keep].to(cache.dtype)


def extend_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seq_lens: torch.Tensor, page_table: torch.Tensor, page_size: int, *,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     sm_scale: float | None = None, causal: bool = True, sliding_window: int | None = None,
                     logit_cap: float | None = None, sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, tree_mask: torch.Tensor | None = None,
                     compute_dtype: torch.dtype = torch.float32, max_scores: int = 1 << 26) -> torch.Tensor:
    """Varlen paged extend attention, the same contract as ``evenkv.extend``.

    q [total_q, Hq, D]; k_cache/v_cache [num_slots, Hkv, D] or [num_pages, page_size, Hkv, D],
    q's dtype or FP8 (real K = k_cache.float() * k_scale, V likewise); cu_seqlens_q [B+1];
    seq_lens [B] (KV length including the new tokens); page_table [B, max_pages]; k_new/v_new
    None (new tokens already in the cache) or [total_q, Hkv, D] real values (cache holds
    positions < seq_len - q_len only). Query i of request b is at position seq_len - q_len + i; causal:
    sees keys <= its position; sliding_window W >= 1: keys in [p - W + 1, p]; logit_cap c > 0:
    scores -> c * tanh(scores / c). None or 0 disables window and cap. sinks: None or [Hq]
    (see the module docstring). tree_mask: None or [total_q] int (with causal): bit j of
    tree_mask[i] says whether query row i sees its request's new token j instead of the causal
    rule among the new tokens; the prefix is always seen. A tree's new token sits at position
    seq_len - q_len + its depth (its row's bits among the first q_len, less one: its ancestors
    and itself), for the sliding window too.

    compute_dtype: fp32 (the oracle) or the inputs' low dtype (torch's own low-precision
    baseline for the tolerance rule: scores, softmax and PV rounded to that dtype).
    max_scores: queries are processed in chunks of at most this many score entries, so
    realistic shapes (32K queries x 64K keys) fit in memory. TF32 must be off (torch's default).
    Returns [total_q, Hq, D] in compute_dtype; rows past cu_seqlens_q[-1] are zeros; a row
    that sees no key is zeros.
    """
    if k_cache.dim() == 4:
        k_cache = k_cache.reshape(-1, *k_cache.shape[2:])
        v_cache = v_cache.reshape(-1, *v_cache.shape[2:])
    total_q, hq, d = q.shape
    hkv = k_cache.shape[1]
    num_pages = k_cache.shape[0] // page_size
    group = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    out = torch.zeros(total_q, hq, d, dtype=compute_dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_len = cu[b], cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        prefix = seq_len - q_len
        cached = seq_len if k_new is None else prefix
        tok = torch.arange(cached, device=q.device)
        pages = page_table[b, tok // page_size].long()
        on_cache = (pages >= 0) & (pages < num_pages)  # the other tokens' K and V are zeros
        slots = torch.where(on_cache, pages, 0) * page_size + tok % page_size
        k = k_cache[slots].float().masked_fill(~on_cache[:, None, None], 0.0) * k_scale
        v = v_cache[slots].float().masked_fill(~on_cache[:, None, None], 0.0) * v_scale
        if k_new is not None:
            k = torch.cat([k, k_new[q_begin:q_begin + q_len].float()])
            v = torch.cat([v, v_new[q_begin:q_begin + q_len].float()])
        k = k.to(compute_dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.to(compute_dtype).repeat_interleave(group, dim=1)
        key_pos = torch.arange(seq_len, device=q.device)
        chunk = max(1, max_scores // max(1, hq * seq_len))
        for i0 in range(0, q_len, chunk):
            i1 = min(q_len, i0 + chunk)
            qb = q[q_begin + i0:q_begin + i1].to(compute_dtype)  # [n, Hq, D]
            scores = torch.einsum("nhd,lhd->hnl", qb, k) * sm_scale
            if logit_cap:
                scores = logit_cap * torch.tanh(scores / logit_cap)
            q_pos = prefix + torch.arange(i0, i1, device=q.device)
            key_at = key_pos  # the keys' positions (a tree's new tokens sit at their depths)
            seen = torch.ones(i1 - i0, seq_len, dtype=torch.bool, device=q.device)
            if causal and tree_mask is not None:
                rows = tree_mask[q_begin:q_begin + q_len].long() & ((1 << q_len) - 1)
                depth = sum((rows >> j) & 1 for j in range(q_len)) - 1
                if prefix >= 0:  # (a padding row, seq_len 0 < q_len, has no key)
                    key_at = torch.cat([key_pos[:prefix], prefix + depth])
                q_pos = prefix + depth[i0:i1]
                rel = (key_pos - prefix).clamp(min=0)
                named = ((rows[i0:i1, None] >> rel[None, :]) & 1).bool()
                seen &= (key_pos[None, :] < prefix) | named
            elif causal:
                seen &= key_pos[None, :] <= q_pos[:, None]
            if sliding_window:
                seen &= key_at[None, :] > q_pos[:, None] - sliding_window
            scores = scores.masked_fill(~seen[None], -math.inf)
            if sinks is not None:  # one more logit per head, with no value
                scores = torch.cat([scores, sinks.to(compute_dtype)[:, None, None].expand(-1, i1 - i0, 1)], -1)
            probs = torch.softmax(scores, dim=-1)
            # Only -inf logits (no key seen, no sink or a -inf one): softmax gives NaN, the
            # contract zeros. A NaN from the data stays.
            no_key = ~seen.any(-1)[None, :, None]
            if sinks is not None:
                no_key = no_key & (sinks == -math.inf)[:, None, None]
            probs = probs.masked_fill(no_key, 0.0)
            if sinks is not None:
                probs = probs[..., :-1]
            out[q_begin + i0:q_begin + i1] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out
