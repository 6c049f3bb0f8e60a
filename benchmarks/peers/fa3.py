"""FlashAttention-3 as vLLM ships it: ``vllm.vllm_flash_attn.flash_attn_varlen_func``
with ``block_table`` and ``seqused_k``, the scheduler metadata precomputed by
``get_scheduler_metadata`` (vLLM's FlashAttentionMetadataBuilder does the same; that
prepare kernel is what ``plan`` times).

Variants: ``auto`` = num_splits 0 (FA3's own dynamic split), ``ns1`` = no split;
``max32`` (not run by default) = at most 32 splits, vLLM's cap under CUDA graphs. There is
no sorted variant: vLLM's build hard-codes ``varlen_sort_batches = false`` in
``mha_fwd``, and neither its ``get_scheduler_metadata`` nor its ``fwd`` takes a switch.

An fp8 KV pool runs as vLLM runs one: FA3 takes q, K and V in one dtype, so q is
quantized to float8_e4m3fn in ``prepare`` (untimed; vLLM does it in the attention layer,
before the backend) with vLLM's default q_scale 1.0, and ``q_descale`` / ``k_descale`` /
``v_descale`` are the scales expanded to [B, Hkv] fp32; the scheduler metadata is planned
for the fp8 dtype. FA3's fp8 kernel writes bf16 only. A window W is
``window_size = (W - 1, 0)``, in the metadata and in the call, as vLLM passes it.

Verify rows (1 + K query tokens per request) run as vLLM's FlashAttention backend runs a
speculative-decoding verify step: ``max_seqlen_q = 1 + K`` in the scheduler metadata and in
the call, the batch's ``cu_seqlens_q``, causal (FlashAttention aligns the queries with the
end of the keys, so token t sees keys up to seq_len - q_len + t).
"""

import torch

from . import Runner, module_version, try_import

FAMILY = "fa3"
MODULE = "vllm.vllm_flash_attn"
NUM_SPLITS = {"auto": 0, "ns1": 1, "max32": 32}
Q_SCALE = 1.0  # vLLM's layer q_scale unless a checkpoint calibrates it
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def available():
    mod, why = try_import(MODULE)
    if mod is None:
        return False, why
    supported = getattr(mod, "is_fa_version_supported", None)
    if supported is not None and not supported(3):
        reason = getattr(mod, "fa_version_unsupported_reason", lambda v: "")(3)
        return False, f"FA3 not supported here: {reason}"
    return True, ""


def version() -> str:
    return f"vllm {module_version('vllm')}"


def variants(ctx):
    return [("auto", True), ("ns1", True), ("max32", False)]


def supports(ctx) -> str:
    if ctx.kv_fp8 and ctx.dtype != torch.bfloat16:
        return "FA3's fp8 path writes bf16 output only"
    return ""


class FA3Runner(Runner):
    def __init__(self, variant, ctx):
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        if variant not in NUM_SPLITS:
            raise ValueError(f"fa3 variant: expected one of {tuple(NUM_SPLITS)}, got {variant!r}")
        self.fwd, self.meta_fn = flash_attn_varlen_func, get_scheduler_metadata
        self.ctx, self.num_splits = ctx, NUM_SPLITS[variant]
        self.window = (ctx.window - 1, 0) if ctx.window else (-1, -1)
        self.config = f"num_splits={self.num_splits}"

    def prepare(self, batch):
        self.batch = batch
        self.metadata = None
        self.q, self.descales = batch.q, {}
        if self.ctx.kv_fp8:
            self.q = (batch.q.float() / Q_SCALE).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            shape = (batch.batch_size, self.ctx.shape.num_kv_heads)
            self.descales = {name: torch.full((1,), scale, dtype=torch.float32, device=batch.q.device).expand(shape)
                             for name, scale in (("q_descale", Q_SCALE), ("k_descale", batch.k_scale),
                                                 ("v_descale", batch.v_scale))}

    def plan(self):
        b, s = self.batch, self.ctx.shape
        self.metadata = self.meta_fn(
            b.batch_size, b.q_len, b.max_len, s.num_q_heads, s.num_kv_heads, s.head_dim, cache_seqlens=b.seq_lens,
            qkv_dtype=self.ctx.cache_dtype, cu_seqlens_q=b.cu_seqlens_q, page_size=b.page_size, causal=True,
            window_size=self.window, num_splits=self.num_splits)

    def run(self):
        b = self.batch
        self.fwd(self.q, b.k_pages, b.v_pages, max_seqlen_q=b.q_len, cu_seqlens_q=b.cu_seqlens_q,
                 max_seqlen_k=b.max_len, seqused_k=b.seq_lens, softmax_scale=self.ctx.sm_scale, causal=True,
                 window_size=self.window, block_table=b.page_table, out=b.out, scheduler_metadata=self.metadata,
                 num_splits=self.num_splits, fa_version=3, **self.descales)


def make(variant, ctx):
    return FA3Runner(variant, ctx)
