"""FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (NHD layout, CSR page indices)
with tensor cores off (``notc``: the CUDA-core decode kernel) and on (``tc``: the
prefill-template path SGLang picks for BF16 with G >= 4). ``plan`` is the wrapper's
``plan`` (host scheduling + copies); ``run`` is ``wrapper.run``. The workspace is 384 MiB,
SGLang's default FlashInfer workspace.

On a fresh machine each (head_dim, tensor cores) pair JIT-compiles a module (15-45 s).
``start_prebuild`` overlaps that with other work when the peers kit's ``fi_build.py``
is at hand; ``make`` waits for it.
"""

import os
import subprocess
import sys

import torch

from . import Runner, module_version, try_import

FAMILY = "flashinfer"
MODULE = "flashinfer"
WORKSPACE_BYTES = 384 << 20
_builds: dict = {}  # (head_dim, which) -> Popen, until waited for
_build_logs: dict = {}  # (head_dim, which) -> last line of the finished build


def available():
    mod, why = try_import(MODULE)
    if mod is None:
        return False, why
    if not hasattr(mod, "BatchDecodeWithPagedKVCacheWrapper"):
        return False, "flashinfer has no BatchDecodeWithPagedKVCacheWrapper"
    return True, ""


def version() -> str:
    return f"flashinfer {module_version('flashinfer')}"


def variants(ctx):
    return [("notc", True), ("tc", True)]


def start_prebuild(head_dims, dtype) -> list:
    """Start the JIT builds of the decode (tc off) and prefill (tc on) modules in the
    background, when the peers kit's fi_build.py exists. Returns what it started."""
    kit = os.environ.get("EVENKV_PEERS_KIT", "")
    script = os.path.join(kit, "fi_build.py")
    if not kit or not os.path.exists(script):
        return []
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    started = []
    for d in sorted(set(head_dims)):
        for which in ("decode", "prefill"):
            if (d, which) not in _builds and (d, which) not in _build_logs:
                _builds[(d, which)] = subprocess.Popen(
                    [sys.executable, script, which, "--head-dim", str(d), "--dtype", dt],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                started.append(f"{which} D={d}")
    return started


def wait_prebuild(head_dim: int, which: str) -> str:
    """Wait for a background build (once: later runners of the same module reuse its log)."""
    key = (head_dim, which)
    proc = _builds.pop(key, None)
    if proc is not None:
        out, _ = proc.communicate()
        lines = out.strip().splitlines()
        _build_logs[key] = lines[-1] if lines else f"fi_build {which} exited {proc.returncode}"
    return _build_logs.get(key, "")


class FlashInferRunner(Runner):
    def __init__(self, variant, ctx):
        import flashinfer
        if variant not in ("notc", "tc"):
            raise ValueError(f"flashinfer variant: expected 'notc' or 'tc', got {variant!r}")
        tc = variant == "tc"
        self.build_log = wait_prebuild(ctx.shape.head_dim, "prefill" if tc else "decode")
        self.ctx = ctx
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc)
        self.config = f"use_tensor_cores={tc}"

    def plan(self):
        b, s = self.batch, self.ctx.shape
        self.wrapper.plan(b.page_indptr, b.page_indices, b.last_page_len, s.num_q_heads, s.num_kv_heads, s.head_dim,
                          b.page_size, q_data_type=self.ctx.dtype, kv_data_type=self.ctx.dtype,
                          sm_scale=self.ctx.sm_scale)

    def run(self):
        b = self.batch
        self.wrapper.run(b.q, (b.k_pages, b.v_pages), out=b.out)


def make(variant, ctx):
    return FlashInferRunner(variant, ctx)
