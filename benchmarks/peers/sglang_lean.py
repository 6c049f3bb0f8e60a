"""SGLang's Lean Attention decode (``_decode_lean_attention_fwd``, SGLang 0.5.23): a
persistent Triton kernel (one CTA per SM) that cuts the batch's KV tiles (64 tokens x one
KV head) into equal pieces, stream-K style; the CTA that holds a segment's first tile
waits on spin locks for the partial states of the CTAs holding the rest and merges them.
Upstream enables it on AMD only (``decode_attention_fwd`` takes it under ``is_hip()``), so
this adapter calls the kernel's wrapper directly, as that dispatch would.

The repository holds none of its source. Copy SGLang 0.5.23's kernel file into the
git-ignored ``.kits/lean/`` (or the folder ``EVENKV_LEAN_DIR`` names): from the repository
root, with ``python`` the interpreter of an install of SGLang 0.5.23 (it imports the module
to find it),

    mkdir -p .kits/lean && cp "$(python -c 'import sglang.kernels.ops.attention.decode_attention as m; print(m.__file__)')" .kits/lean/

The file is loaded under its own module name, so it does not replace the peers kit's
``sglang.kernels.ops.attention.decode_attention`` (SGLang 0.5.17's, which the
``sglang_triton`` adapter runs); its imports (``sglang.kernels.ops.attention.score_mod``,
``sglang.srt.environ.envs``, ``sglang.srt.utils``) resolve to the peers kit's sglang stand-in.

Called as SGLang's ``TritonAttnBackend`` calls it, its dispatch forced on: token-level
``kv_indptr`` [B + 1] int32 and ``kv_indices`` [T] int64 (token slots over the same page
placement; ``page_size`` is passed for the kernel's address math); the persistent grid
from ``_lean_decode_launch_params`` (SM count x ``SGLANG_FORCE_LEAN_GRID_CU_MULT``, 1.0);
the partial-state buffers Mp / Lp [grid, 16] and Op [grid, 16, D] fp32 and the locks
[grid] int32 allocated once, as the backend does for CUDA graphs; the softmax scale (with
k_scale 1.0 folded in) and v_scale 1.0, a bf16/fp16 cache's. ``plan`` is the backend's
host-side gate ``lean_decode_seqlen_gate``: whether SGLang would pick Lean for this batch
(``describe`` reports it; the kernel runs regardless). The kernel derives its tile
schedule on the device, so ``run`` holds all the GPU work, including the wrapper's
per-call lock reset and cumulative tile count (small torch ops that SGLang also runs per
layer). It is compiled per batch size (B is a compile-time constant), and it spin-waits
across CTAs, so it needs a GPU: the interpreter runs programs one by one and would hang.

Not run: head_dim above 128 (SGLang's ``_lean_head_dim_ok`` falls back to the standard
kernel there), an fp8 KV cache, a sliding window.
"""

import functools
import importlib.util
import os
from pathlib import Path

import torch

from . import Runner, feature_gaps, opt_in_only

FAMILY = "sglang_lean"
SGLANG_VERSION = "0.5.23"
KERNEL_FILE = "decode_attention.py"
MODULE_NAME = "evenkv_bench_sglang_lean"


def lean_dir() -> Path:
    """``EVENKV_LEAN_DIR``, else ``.kits/lean`` of this checkout."""
    env = os.environ.get("EVENKV_LEAN_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".kits" / "lean"


@functools.lru_cache(maxsize=None)
def load_kernel(path: str):
    """The copied kernel file, imported as its own module."""
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kernel():
    return load_kernel(str(lean_dir() / KERNEL_FILE))


def available():
    path = lean_dir() / KERNEL_FILE
    if not path.is_file():
        return False, (f"{path} missing: copy SGLang {SGLANG_VERSION}'s sglang/kernels/ops/attention/{KERNEL_FILE} "
                       f"there (the command is in benchmarks/peers/sglang_lean.py)")
    if not torch.cuda.is_available():
        return False, "no CUDA device (the kernel spin-waits across CTAs)"
    try:
        mod = _kernel()
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return False, f"loading {path} failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if not hasattr(mod, "_decode_lean_attention_fwd"):
        return False, f"{path} has no _decode_lean_attention_fwd (not SGLang {SGLANG_VERSION}'s file?)"
    return True, ""


def version() -> str:
    return f"sglang {SGLANG_VERSION} (copied kernel file)"


variants = opt_in_only


def supports(ctx) -> str:
    d = ctx.shape.head_dim
    if not _kernel()._lean_head_dim_ok(d, d):
        return f"head_dim {d}: SGLang runs its standard kernel there (_lean_head_dim_ok)"
    return feature_gaps(ctx, fp8_kv=False, window=False)


class LeanRunner(Runner):
    def __init__(self, variant, ctx):
        if variant != "default":
            raise ValueError(f"sglang_lean variant: expected 'default', got {variant!r}")
        k, s = _kernel(), ctx.shape
        self.fwd, self.gate, self.ctx = k._decode_lean_attention_fwd, k.lean_decode_seqlen_gate, ctx
        self.grid, self.xcd_remap, self.num_xcds = k._lean_decode_launch_params(s.num_kv_heads, s.group)
        f32 = dict(dtype=torch.float32, device=ctx.device)
        self.mp = torch.empty(self.grid, k._LEAN_BLOCK_M, **f32)
        self.lp = torch.empty(self.grid, k._LEAN_BLOCK_M, **f32)
        self.op = torch.empty(self.grid, k._LEAN_BLOCK_M, s.head_dim, **f32)
        self.locks = torch.zeros(self.grid, dtype=torch.int32, device=ctx.device)
        self.config = f"lean, {self.grid} persistent CTAs"

    def prepare(self, batch):
        self.batch = batch
        indptr, slots = batch.token_indices()
        self.kv_indptr, self.kv_indices = indptr, slots.long()  # SGLang's kv_indices are int64
        self.k, self.v = batch.k_slots, batch.v_slots

    def plan(self):
        b, s = self.batch, self.ctx.shape
        self.sglang_picks = self.gate(s.num_q_heads, s.group, b.batch_size, b.total_tokens)

    def run(self):
        b = self.batch
        self.fwd(b.q, self.k, self.v, b.out, self.kv_indptr, self.kv_indices, self.grid, self.ctx.sm_scale, 1.0,
                 self.xcd_remap, self.num_xcds, self.mp, self.lp, self.op, self.locks, page_size=b.page_size)

    def describe(self):
        return f"{self.config}; SGLang's gate would pick lean: {'yes' if self.sglang_picks else 'no'}"


def make(variant, ctx):
    return LeanRunner(variant, ctx)
