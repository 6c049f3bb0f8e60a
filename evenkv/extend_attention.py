"""The public extend / prefill API: ``extend`` (one call per layer) and the extend plan.

Extend attention is what the engines run for every step that is not pure decode: a
prompt's prefill (often chunked, on top of a cached prefix), speculative-verify rows
(q_len > 1) and the prefill part of mixed batches (``evenkv.Attention``).

CUDA-graph contract: ``plan_extend`` and ``run_extend`` launch GPU work only (no
``.item()``, ``.cpu()``, host sync or data-dependent allocation); the grid is sized
from host ints (``q.shape[0]``, ``max_q_len``, the batch size), so a captured launch
replays correctly for any lengths within those bounds. ``extend`` allocates its small
plan buffers (and ``out`` unless given) on each call: serving code keeps an
``evenkv.Attention``, which plans once per batch and reuses its buffers across layers and
under graphs.
"""


import torch

from evenkv.kernels import plan_launch
from evenkv.kernels import extend_launch as launch

from .checks import (FP8_KV_DTYPES, PAGE_SIZES, SUPPORTED_DTYPES, as_pages, check_batch_metadata, check_fp8_capable,
                     check_head_dim, check_kv_caches, check_kv_scale, check_new_token_v_scale, check_new_tokens,
                     check_positive_int, check_sinks, check_tensor, normalize_logit_cap, normalize_window,
                     output_like, resolve_device, resolve_sm_scale)
from .configs import ExtendConfig, debug_enabled, extend_config, resolve_arch, sm_count
from .errors import error_flag
from .planning import ExtendPlan, plan_extend

SCHEDULES = ("lpt", "ordered")


def run_extend(plan: ExtendPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor, *, k_new: torch.Tensor | None, v_new: torch.Tensor | None, sm_scale: float,
               causal: bool, sliding_window: int | None, logit_cap: float | None, sinks: torch.Tensor | None = None,
               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Launch the extend kernel for ``plan`` (inputs assumed validated, as ``extend``'s; the caches
    as [num_pages, page_size, Hkv, D], ``checks.as_pages``); returns out."""
    c = plan.config
    bound = launch.num_query_blocks_bound(q.shape[0], plan.batch_size, plan.max_q_len, plan.group_size, c.block_m)
    launch.launch_extend(q, k_cache, v_cache, k_new, v_new, out, plan.cu_seqlens_q, plan.seq_lens, plan.page_table,
                         plan.order, plan.sorted_start, plan.errors, num_programs_bound=bound,
                         req_begin=plan.req_begin, max_q_len=plan.max_q_len, page_size=plan.page_size,
                         sm_scale=sm_scale, causal=causal, window=sliding_window, logit_cap=logit_cap,
                         block_m=c.block_m, block_n=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
                         sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    return out


# -- validation -------------------------------------------------------------------


def check_lengths_on_host(cu_seqlens_q, seq_lens, *, max_q_len: int, total_q: int, capacity: int,
                          req_begin: int = 0, has_new: bool = False) -> None:
    """Debug-mode data checks (syncs): raise ValueError for the batch data the kernels flag in the
    error flag, and only for it. Requests [0, req_begin) are decode rows (``evenkv.Attention``),
    the others extend rows; has_new: their new tokens' K/V come as k_new / v_new, so the cache
    holds only each extend row's prefix and its seq_len may pass capacity by its q_len."""
    cu = cu_seqlens_q.cpu().long()
    lens = seq_lens.cpu().long()
    if cu.numel() == 0:
        return
    q_lens = cu[1:] - cu[:-1]
    # A range that starts before row 0 or before an earlier range's end is flagged (it may write
    # another request's rows); a cu that goes back anywhere has such a range.
    if int(cu[0]) < 0 or (q_lens < 0).any():
        raise ValueError(f"cu_seqlens_q: expected a non-decreasing sequence from >= 0, got {cu.tolist()[:16]}")
    past = (q_lens > 0) & (cu[1:] > total_q)
    if past.any():
        b = _first(past)
        raise ValueError(f"cu_seqlens_q: expected every query range inside the {total_q} rows of q, got request "
                         f"{b}'s rows {int(cu[b])}..{int(cu[b + 1]) - 1}")
    extend_lens = q_lens[req_begin:]
    if extend_lens.numel() and int(extend_lens.max()) > max_q_len:
        raise ValueError(f"max_q_len: expected >= every q length, got {max_q_len} < {int(extend_lens.max())}")
    decode = torch.arange(lens.numel()) < req_begin
    # A decode row of seq_len 0 is padding (zeros out, whatever its q_len); an extend row's seq_len
    # is read only if it has query rows.
    below = torch.where(decode, lens > 0, q_lens > 0) & (lens < q_lens)
    if below.any():
        b = _first(below)
        raise ValueError(f"seq_lens: expected seq_lens[b] >= q_len[b] (seq_lens include the new tokens), "
                         f"got seq_lens[{b}]={int(lens[b])} < q_len {int(q_lens[b])}")
    # With k_new an extend row's new tokens are not in the cache: only its prefix must fit.
    bound = capacity + q_lens if has_new else torch.full_like(q_lens, capacity)
    beyond = torch.where(decode, (lens < 0) | (lens > capacity), (q_lens > 0) & (lens > bound))
    if beyond.any():
        b = _first(beyond)
        if decode[b]:
            expected = f"in [0, {capacity}], the page_table's capacity (max_pages x page_size)"
        elif has_new:
            expected = (f"<= {int(bound[b])}, the page_table's capacity {capacity} (max_pages x page_size) + its "
                        f"q_len (k_new holds the new tokens)")
        else:
            expected = f"<= {capacity}, the page_table's capacity (max_pages x page_size)"
        raise ValueError(f"seq_lens: expected seq_lens[{b}] {expected}, got {int(lens[b])}")


def _first(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask)[0])


# -- public API ---------------------------------------------------------------------


def extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
           seq_lens: torch.Tensor, page_table: torch.Tensor, page_size: int, max_q_len: int,
           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, sm_scale: float | None = None,
           causal: bool = True, sliding_window: int | None = None, logit_cap: float | None = None,
           out: torch.Tensor | None = None, schedule: str = "lpt", config: ExtendConfig | None = None,
           arch: str | None = None, debug: bool | None = None, sinks: torch.Tensor | None = None,
           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Varlen extend (prefill) attention over a paged KV cache, causal by default.

    Args (B requests, total_q query rows, G = Hq / Hkv):
        q: [total_q, Hq, D] fp16/bf16, any row/head strides, unit stride in D. Rows of
            request b are ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``.
        k_cache, v_cache: [num_pages, page_size, Hkv, D] or [num_slots, Hkv, D] (slot = page *
            page_size + offset), dtype of q or torch.float8_e4m3fn (both the same), any
            strides but unit stride in D (vLLM's packed K|V halves and HND views both work).
        cu_seqlens_q: [B + 1] int32 (or int64), device; cu_seqlens_q[-1] <= total_q.
        seq_lens: [B] int32/int64, device: the total KV length of each request
            INCLUDING its new tokens (vLLM ``seq_lens``, SGLang ``seq_lens``).
        page_table: [B, max_pages] int32, any row stride: page ids of each request.
        page_size: 1, 8, 16, 32, 64 or 128: the page size the cache and page_table were
            written with. A 4-D cache must show it (shape[1]); nothing can check it against a
            3-D cache, where another page size silently reads the wrong slots.
        max_q_len: host int >= every q length (vLLM ``max_query_len``, SGLang
            ``max(extend_seq_lens_cpu)``); sizes the grid, so no host sync.
        k_new, v_new: None (the new tokens' K/V are already in the cache at positions
            seq_len - q_len .. seq_len - 1: vLLM) or [total_q, Hkv, D] (the cache holds
            only the prefix, positions < seq_len - q_len, and the new tokens' K/V are
            row-aligned with q: SGLang's forward_extend).
        sm_scale: softmax scale, default 1/sqrt(D).
        causal: query i of request b sits at position seq_len - q_len + i and sees
            positions <= its own. causal=False: every query sees all seq_len keys.
        sliding_window: None or 0 (none), or W >= 1: a query at position p sees keys in
            [p - W + 1, p] (W keys, itself included; HF's ``config.sliding_window``).
            vLLM: pass the impl's ``sliding_window`` int as is (vLLM stores it as
            ``(W - 1, 0)`` for FA). SGLang: pass ``layer.sliding_window_size + 1``
            (SGLang stores W - 1, and -1 for none, which maps to 0 = none).
        logit_cap: None or 0 (none), or c > 0: scores s * sm_scale become
            c * tanh(s * sm_scale / c) before softmax (vLLM ``logits_soft_cap``,
            SGLang ``layer.logit_cap``).
        out: optional [total_q, Hq, D] output, dtype of q, unit stride in D.
        schedule: ``"lpt"`` (default: heaviest requests first) or ``"ordered"``
            (request order); both run heaviest query block first inside a request.
        config: an ``ExtendConfig`` to force (tuning, tests); default from the table.
        arch: ``"sm80"``/``"sm90"`` table; default from the device (EVENKV_ARCH).
        debug: check lengths on the host first (syncs); default EVENKV_DEBUG.
        sinks: None or [Hq] float32/bf16/fp16, contiguous: one logit per query head (natural
            log, not scaled by sm_scale nor capped) added to its softmax denominator:
            out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sinks[h]}) (gpt-oss).
        k_scale, v_scale: host floats > 0, an FP8 cache's per-tensor dequantization scales
            (real K = stored K * k_scale); 1.0 for a cache of q's dtype. k_new/v_new hold
            real values and are not scaled.

    Returns:
        out [total_q, Hq, D], dtype of q. Rows past cu_seqlens_q[-1] are not written.

    Raises:
        TypeError / ValueError naming the argument, for malformed inputs and for unsupported
        values (head_dim outside 64/80/96/128/256, a sliding window without causal masking).
    """
    check_tensor("q", q, shape=(None, None, None), dtypes=SUPPORTED_DTYPES, last_dim_contiguous=True)
    total_q, num_q_heads, head_dim = q.shape
    dev = resolve_device(q.device, "q")
    check_head_dim(head_dim, " (q's last dim)")
    check_positive_int("page_size", page_size, allowed=PAGE_SIZES)
    check_kv_caches(k_cache, v_cache, page_size=page_size, dtypes=(q.dtype, *FP8_KV_DTYPES), device=dev,
                    head_dim=head_dim)
    num_kv_heads = k_cache.shape[-2]
    if num_kv_heads < 1:
        raise ValueError(f"k_cache: expected at least one KV head, got shape {tuple(k_cache.shape)}")
    check_fp8_capable(k_cache.dtype, dev, "k_cache")
    k_scale, v_scale = check_kv_scale("k_scale", k_scale), check_kv_scale("v_scale", v_scale)
    check_new_token_v_scale(v_scale, q.dtype, k_cache.dtype, k_new is not None)
    if k_cache.dtype not in FP8_KV_DTYPES:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value != 1.0:
                raise ValueError(f"{name}: expected 1.0 for a {k_cache.dtype} cache (scales dequantize FP8 caches), "
                                 f"got {value}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q: expected Hq a positive multiple of Hkv={num_kv_heads} (k_cache), got Hq={num_q_heads}")
    sinks = check_sinks(sinks, num_q_heads, dev)
    batch = check_batch_metadata(seq_lens, page_table, dev, cu_seqlens_q, cu_required=True)
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int):
        raise TypeError(f"max_q_len: expected a host int, got {type(max_q_len).__name__}")
    if max_q_len < 0:
        raise ValueError(f"max_q_len: expected >= 0, got {max_q_len}")
    check_new_tokens(k_new, v_new, total_q, num_kv_heads, head_dim, q.dtype, dev)
    scale = resolve_sm_scale(sm_scale, head_dim)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected bool, got {type(causal).__name__}")
    window = normalize_window(sliding_window)
    cap = normalize_logit_cap(logit_cap)
    if window is not None and not causal:
        raise ValueError(f"sliding_window: expected None or 0 with causal=False (a window needs causal masking), "
                         f"got {sliding_window}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if config is not None and not isinstance(config, ExtendConfig):
        raise TypeError(f"config: expected ExtendConfig or None, got {type(config).__name__}")
    out = output_like(q, out)
    if batch == 0 or total_q == 0:
        return out
    # A batch of no query tokens may say max_q_len 0; one with tokens is planned for at least
    # one, so the plan flags every longer range (``evenkv.check_errors``) instead of skipping it.
    max_q_len = max(max_q_len, 1)
    if debug_enabled(debug):
        check_lengths_on_host(cu_seqlens_q, seq_lens, max_q_len=max_q_len, total_q=total_q,
                              capacity=page_table.shape[1] * page_size, has_new=k_new is not None)
    group = num_q_heads // num_kv_heads
    if config is None:
        config = extend_config(resolve_arch(arch, dev), head_dim, group, max_q_len)
    # The kernels read the guarded copy: int32, non-decreasing (flagged where not).
    rows = torch.empty(batch + 1, dtype=torch.int32, device=dev)
    plan_launch.launch_guard_query_rows(cu_seqlens_q, rows, error_flag(dev))
    plan = plan_extend(rows, seq_lens, page_table, page_size=page_size, group_size=group,
                       max_q_len=max_q_len, config=config, schedule=schedule)
    k_cache, v_cache = as_pages(k_cache, page_size), as_pages(v_cache, page_size)
    plan_launch.launch_audit_pages(seq_lens, rows, page_table, plan.errors, k_cache.shape[0], page_size,
                                   sm_count(dev), batch)
    return run_extend(plan, q, k_cache, v_cache, out, k_new=k_new, v_new=v_new, sm_scale=scale, causal=causal,
                      sliding_window=window, logit_cap=cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)


__all__ = ["extend", "run_extend", "SCHEDULES"]
