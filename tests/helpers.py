"""Shared test helpers: paged batches, the tolerance rule, a low-precision torch baseline,
ahead-of-time compiles for CUDA targets."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evenkv.kernels.reference import decode_reference, gather_request_kv

# Floor of the tolerance rule, per dtype: the smallest error we call "equal" when torch's
# own low-precision error happens to be ~0 (tiny batches).
TOLERANCE_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def lane_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a test can use in this lane. Triton 3.6's interpreter computes tl.dot on
    bf16 operands wrongly (errors of ~1e10 on a plain 16x16 dot), so under the
    interpreter bf16 cases run in fp16; on a GPU (either lane) bf16 runs as bf16."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return torch.float16 if interpreted and dtype == torch.bfloat16 else dtype


def make_paged_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, *,
                     extra_pages=3, seed=0, garbage_tail=True):
    """Random q, K/V caches and a page table with pages in random order.

    Returns q [B, Hq, D], k_cache/v_cache [num_slots, Hkv, D], seq_lens [B] int32,
    page_table [B, max_pages] int32. Unused page-table entries hold out-of-range
    garbage (garbage_tail) so a kernel that reads past seq_len fails loudly or
    reads the wrong thing.
    """
    gen = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in seq_lens]
    pages_per_req = [math.ceil(n / page_size) for n in lens]
    max_pages = max([1] + pages_per_req) + 1
    num_pages = sum(pages_per_req) + extra_pages
    perm = torch.randperm(num_pages, generator=gen)
    page_table = torch.full((len(lens), max_pages), 10**8 if garbage_tail else 0, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_req):
        page_table[b, :n] = perm[used:used + n].int()
        used += n
    num_slots = num_pages * page_size
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(dtype)
    to = dict(device=device)
    return (q.to(**to), k_cache.to(**to), v_cache.to(**to), torch.tensor(lens, dtype=torch.int32, **to),
            page_table.to(**to))


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


def assert_close_to_reference(out, q, k_cache, v_cache, seq_lens, page_table, page_size, sm_scale=None):
    """Tolerance rule: max|out - ref32| <= 2 * max|torch_lowp - ref32| + floor(dtype)."""
    ref = decode_reference(q, k_cache, v_cache, seq_lens, page_table, page_size, sm_scale)
    lowp = lowp_decode(q, k_cache, v_cache, seq_lens, page_table, page_size, sm_scale)
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    base = (lowp.float() - ref).abs().max().item() if out.numel() else 0.0
    bound = 2 * base + TOLERANCE_FLOOR[q.dtype]
    assert err <= bound, f"max abs error {err:.3e} > bound {bound:.3e} (torch {q.dtype} error {base:.3e})"
    return err, bound


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
