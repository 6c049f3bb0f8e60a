"""FlashInfer's XQA decode (TensorRT-LLM's kernel), through
``flashinfer.decode.trtllm_batch_decode_with_kv_cache(..., backend="xqa")``: what vLLM's
FLASHINFER backend runs for decode on Hopper (always with an fp8 KV cache; with a bf16
one only for batches of <= 256 decode tokens, which ``describe`` reports).

Called with vLLM 0.26's arguments: the pool as ``(k_pages, v_pages)``, each
[num_pages, page_size, Hkv, D], ``kv_layout="NHD"`` (vLLM's default layout on Hopper; XQA
reads the strides, so the shared pool is used as is); ``block_tables`` = the
[B, max_pages] int32 page table; ``seq_lens`` [B] int32 (read as uint32); ``bmm1_scale`` =
softmax scale x k_scale, ``bmm2_scale`` = v_scale (XQA derives its q and KV scales from
them); a 394 MiB workspace zeroed once (vLLM's ``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``;
its first 8 MiB are the kernel's semaphores, which must start at zero); ``window_left`` =
W - 1 for a window W. There is no plan step: ``run`` is the whole call.

XQA takes pages of 16, 32, 64 or 128 tokens. One JIT module per (dtype, KV dtype, page
size, head_dim, G, window), prebuilt in the background.
"""

import torch

from . import Runner, feature_gaps, fi_jit, opt_in_only, try_import
from .flashinfer import version  # noqa: F401 - the adapter protocol's version()

FAMILY = "flashinfer_xqa"
MODULE = "flashinfer.decode"
PAGE_SIZES = (16, 32, 64, 128)
WORKSPACE_BYTES = 394 << 20
VLLM_BF16_MAX_TOKENS = 256  # vLLM picks XQA for a bf16 KV cache up to this many decode tokens


def available():
    mod, why = try_import(MODULE)
    if mod is None:
        return False, why
    if not hasattr(mod, "trtllm_batch_decode_with_kv_cache"):
        return False, "flashinfer.decode has no trtllm_batch_decode_with_kv_cache"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"XQA decode is FlashInfer's SM90 path; this GPU is sm_{major}{minor}"
    return True, ""


variants = opt_in_only


def supports(ctx) -> str:
    if ctx.page_size not in PAGE_SIZES:
        return f"pages of {', '.join(map(str, PAGE_SIZES))} tokens only, not {ctx.page_size}"
    return feature_gaps(ctx, fp8_kv=True, window=True)


def prebuild(variant, ctx) -> list:
    return fi_jit.start(fi_jit.xqa_spec(ctx))


class XQARunner(Runner):
    def __init__(self, variant, ctx):
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache
        if variant != "default":
            raise ValueError(f"flashinfer_xqa variant: expected 'default', got {variant!r}")
        self.fwd, self.ctx = trtllm_batch_decode_with_kv_cache, ctx
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.window_left = ctx.window - 1 if ctx.window else -1
        self.config = f"backend=xqa, NHD, window_left={self.window_left}"

    def prepare(self, batch):
        self.batch = batch
        self.bmm1_scale = self.ctx.sm_scale * batch.k_scale
        self.bmm2_scale = batch.v_scale

    def run(self):
        b = self.batch
        self.fwd(b.q, (b.k_pages, b.v_pages), self.workspace, b.page_table, b.seq_lens, b.max_len,
                 bmm1_scale=self.bmm1_scale, bmm2_scale=self.bmm2_scale, window_left=self.window_left, out=b.out,
                 kv_layout="NHD", backend="xqa")

    def describe(self):
        picked = self.ctx.kv_fp8 or self.batch.batch_size <= VLLM_BF16_MAX_TOKENS
        return f"{self.config}; vLLM would pick XQA here: {'yes' if picked else 'no'}"


def make(variant, ctx):
    return XQARunner(variant, ctx)
