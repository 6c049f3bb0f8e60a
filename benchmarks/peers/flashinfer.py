"""FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (NHD layout, CSR page indices)
with tensor cores off (``notc``: the CUDA-core decode kernel) and on (``tc``: the
prefill-template path SGLang picks for BF16 with G >= 4). ``plan`` is the wrapper's
``plan`` (host scheduling + copies); ``run`` is ``wrapper.run``. The workspace is 384 MiB,
SGLang's default FlashInfer workspace.

An fp8 KV pool runs with ``kv_data_type`` float8_e4m3fn and the pool's scales passed to
``run`` as SGLang's FlashInfer backend passes a layer's: k_scale folded into the softmax
scale, v_scale applied to the output afterwards (a separate multiply, part of the timed
call). A window W is ``window_left = W - 1`` (the key at ``len - W`` is the first read).

On a fresh machine each module (head_dim, tensor cores, KV dtype, window) is JIT-compiled
(15-45 s); ``prebuild`` starts that in the background (``fi_jit``).
"""

import torch

from . import Runner, feature_gaps, fi_jit, module_version, try_import

FAMILY = "flashinfer"
MODULE = "flashinfer"
WORKSPACE_BYTES = 384 << 20


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


def supports(ctx) -> str:
    return feature_gaps(ctx, fp8_kv=True, window=True)


def prebuild(variant, ctx) -> list:
    return fi_jit.start(fi_jit.decode_spec(ctx, tensor_cores=variant == "tc"))


class FlashInferRunner(Runner):
    def __init__(self, variant, ctx):
        import flashinfer
        if variant not in ("notc", "tc"):
            raise ValueError(f"flashinfer variant: expected 'notc' or 'tc', got {variant!r}")
        tc = variant == "tc"
        self.ctx = ctx
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc)
        self.config = f"use_tensor_cores={tc}"

    def prepare(self, batch):
        self.batch = batch
        # Scales only for an fp8 pool: with None the wrapper runs exactly its bf16/fp16 path.
        self.scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale} if self.ctx.kv_fp8 else {}

    def plan(self):
        b, s = self.batch, self.ctx.shape
        self.wrapper.plan(b.page_indptr, b.page_indices, b.last_page_len, s.num_q_heads, s.num_kv_heads, s.head_dim,
                          b.page_size, window_left=self.ctx.window - 1 if self.ctx.window else -1,
                          q_data_type=self.ctx.dtype, kv_data_type=self.ctx.cache_dtype, sm_scale=self.ctx.sm_scale)

    def run(self):
        b = self.batch
        self.wrapper.run(b.q, (b.k_pages, b.v_pages), out=b.out, **self.scales)


def make(variant, ctx):
    return FlashInferRunner(variant, ctx)
