"""Shared test helpers: paged batches, the tolerance rule, a low-precision torch baseline,
ahead-of-time compiles for CUDA targets, the launch recorder (``Recorder``). The data builders and the rule itself live in
``evenkv.testing`` (the benchmarks and the demo use them too)."""

import contextlib
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evenkv.kernels.reference import decode_reference, extend_reference, gather_request_kv, kv_write_reference
from evenkv.testing import GARBAGE_PAGE, TOLERANCE_FLOOR, max_error, random_paged_batch, tolerance  # noqa: F401


def make_paged_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, *, extra_pages=3,
                     seed=0, garbage_tail=True):
    """``evenkv.testing.random_paged_batch``: q [B, Hq, D], k_cache/v_cache [num_slots, Hkv, D],
    seq_lens [B] int32, page_table [B, max_pages] int32 (unused entries hold GARBAGE_PAGE,
    or page 0 without ``garbage_tail``)."""
    return random_paged_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, seed=seed,
                              spare_pages=extra_pages, tail=GARBAGE_PAGE if garbage_tail else 0)


def lowp_decode(q, k_cache, v_cache, seq_lens, page_table, page_size, sm_scale=None):
    """The same decode computed by torch in q's dtype (scores, softmax and PV in low precision)."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k = gather_request_kv(k_cache, page_table[b], n, page_size).repeat_interleave(group, dim=1)
        v = gather_request_kv(v_cache, page_table[b], n, page_size).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * sm_scale
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def assert_close_to_reference(out, q, k_cache, v_cache, seq_lens, page_table, page_size, sm_scale=None, **terms):
    """Tolerance rule (evenkv.testing.tolerance) against torch's own low-precision decode.
    terms: a layer's sliding_window / logit_cap / sinks / k_scale / v_scale (decode_reference's);
    with them the low-precision baseline is the reference computed in q's dtype."""
    ref = decode_reference(q, k_cache, v_cache, seq_lens, page_table, page_size, sm_scale, **terms)
    if terms:
        cu = torch.arange(q.shape[0] + 1, device=q.device)
        lowp = extend_reference(q, k_cache, v_cache, cu, seq_lens, page_table, page_size, sm_scale=sm_scale,
                                compute_dtype=q.dtype, **terms)
    else:
        lowp = lowp_decode(q, k_cache, v_cache, seq_lens, page_table, page_size, sm_scale)
    err, bound = max_error(out, ref), tolerance(ref, lowp, q.dtype)
    assert err <= bound, f"max abs error {err:.3e} > bound {bound:.3e} ({q.dtype})"
    return err, bound


def assert_extend_close_to_reference(out, q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, page_size,
                                     **terms):
    """Tolerance rule for rows of several query tokens (q [total_q, Hq, D], cu_seqlens_q [B + 1]):
    against ``extend_reference`` in fp32, with the same reference in q's dtype as the baseline.
    terms: extend_reference's (sliding_window, logit_cap, sinks, k_scale, v_scale, tree_mask, ...)."""
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, page_size)
    ref = extend_reference(*args, **terms)
    lowp = extend_reference(*args, compute_dtype=q.dtype, **terms)
    err, bound = max_error(out, ref), tolerance(ref, lowp, q.dtype)
    assert err <= bound, f"max abs error {err:.3e} > bound {bound:.3e} ({q.dtype})"
    return err, bound


# The per-tensor scales of the tests' FP8 caches (real = stored x scale).
K_SCALE, V_SCALE = 0.05, 0.04


def stream_merge_path(pieces, consts):
    """Which of merge_stream_kernel's step shapes (``consts``, from ``merge_stream_constants``)
    a segment of ``pieces`` pieces takes: ``whole``, ``rows`` (ROW_GROUP rows a step) or
    ``chunks``; ``fused``: merged inside the decode kernel."""
    from evenkv.kernels.decode_launch import FUSED_MERGE_PIECES
    if pieces <= FUSED_MERGE_PIECES:
        return "fused"
    return "whole" if pieces <= consts["WHOLE_P"] else "rows" if pieces <= consts["ROW_P"] else "chunks"


def call_terms(terms: dict, k_cache, v_cache, device):
    """The per-call side of a test's layer ``terms``: "sinks" (logits for 4 query heads) and
    "fp8" (the caches quantized to e4m3 with K_SCALE and V_SCALE). Returns (k_cache, v_cache,
    the run's keywords)."""
    run = {}
    if terms.get("sinks"):
        run["sinks"] = torch.tensor([0.5, -1.0, 3.0, 0.0], device=device)
    if terms.get("fp8"):
        k_cache, v_cache = fp8_caches(k_cache, v_cache, K_SCALE, V_SCALE)
        run.update(k_scale=K_SCALE, v_scale=V_SCALE)
    return k_cache, v_cache, run


def fp8_caches(k_cache, v_cache, k_scale: float, v_scale: float):
    """The same caches quantized to e4m3 (stored = real / scale), as write_kv stores them."""
    k8 = torch.empty_like(k_cache, dtype=torch.float8_e4m3fn)
    v8 = torch.empty_like(v_cache, dtype=torch.float8_e4m3fn)
    slots = torch.arange(k_cache.shape[0], device=k_cache.device)
    kv_write_reference(k8, v8, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    return k8, v8


def aot_compile(spec: dict) -> list:
    """Compile a kernel for CUDA targets on this machine (tests/aot_compile.py, in a fresh
    interpreter without TRITON_INTERPRET); one dict per variant (regs, stack, shared,
    wgmma, cp_async). Skips when this Triton build has no CUDA toolchain."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("aot_compile.py")
    proc = subprocess.run([sys.executable, str(script), json.dumps(spec)], capture_output=True, text=True, env=env)
    if proc.returncode != 0 and ("ptxas" in proc.stderr or "cuobjdump" in proc.stderr):
        pytest.skip(f"no CUDA toolchain in this Triton build: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def specialization_key(kernel, args, kwargs) -> tuple:
    """What Triton keys a compiled variant of ``kernel`` on, for this launch."""
    fn = getattr(kernel, "fn", kernel)
    options = getattr(kernel, "kwargs", None) or {}
    dont = set(options.get("do_not_specialize") or getattr(kernel, "do_not_specialize", None) or ())
    unaligned = set(options.get("do_not_specialize_on_alignment")
                    or getattr(kernel, "do_not_specialize_on_alignment", None) or ())
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    parts = []
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation):
            parts.append((name, value))
        elif isinstance(value, torch.Tensor):
            parts.append((name, value.dtype) if name in unaligned else (name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or value is None:
            parts.append((name, value))
        elif isinstance(value, int):
            width = "i32" if -2**31 <= value < 2**31 else "i64"
            parts.append((name, width) if name in dont else (name, width, value == 1, value % 16 == 0))
        elif isinstance(value, float):
            parts.append((name, "fp32"))
        else:
            raise TypeError(f"{name}: {type(value).__name__}")
    launch_options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return fn.__name__, tuple(parts), launch_options


class Recorder:
    """Stands in for ``launch_or_compile``: records each launch's key, runs nothing."""

    def __init__(self):
        self.compiled, self.launched = set(), []

    def __call__(self, kernel, grid, warmup, *args, **kwargs):
        key = specialization_key(kernel, args, kwargs)
        (self.compiled.add(key) if warmup else self.launched.append(key))


@contextlib.asynccontextmanager
async def local_http_server(routes: dict):
    """An aiohttp server on 127.0.0.1 and a free port answering POST ``routes`` {path: handler};
    yields its base URL and stops it on exit."""
    from aiohttp import web

    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
