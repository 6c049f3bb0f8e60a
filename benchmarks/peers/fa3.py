"""FlashAttention-3 as vLLM ships it: ``vllm.vllm_flash_attn.flash_attn_varlen_func``
with ``block_table`` and ``seqused_k``, the scheduler metadata precomputed by
``get_scheduler_metadata`` (vLLM's FlashAttentionMetadataBuilder does the same; that
prepare kernel is what ``plan`` times).

Variants: ``auto`` = num_splits 0 (FA3's own dynamic split), ``ns1`` = no split;
``max32`` (not run by default) = at most 32 splits, vLLM's cap under CUDA graphs.
"""

from . import Runner, module_version, try_import

FAMILY = "fa3"
MODULE = "vllm.vllm_flash_attn"
NUM_SPLITS = {"auto": 0, "ns1": 1, "max32": 32}


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


class FA3Runner(Runner):
    def __init__(self, variant, ctx):
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        if variant not in NUM_SPLITS:
            raise ValueError(f"fa3 variant: expected one of {tuple(NUM_SPLITS)}, got {variant!r}")
        self.fwd, self.meta_fn = flash_attn_varlen_func, get_scheduler_metadata
        self.ctx, self.num_splits = ctx, NUM_SPLITS[variant]
        self.config = f"num_splits={self.num_splits}"

    def prepare(self, batch):
        self.batch = batch
        self.metadata = None

    def plan(self):
        b, s = self.batch, self.ctx.shape
        self.metadata = self.meta_fn(
            b.batch_size, 1, b.max_len, s.num_q_heads, s.num_kv_heads, s.head_dim, cache_seqlens=b.seq_lens,
            qkv_dtype=self.ctx.dtype, cu_seqlens_q=b.cu_seqlens_q, page_size=b.page_size, causal=True,
            window_size=(-1, -1), num_splits=self.num_splits)

    def run(self):
        b = self.batch
        self.fwd(b.q, b.k_pages, b.v_pages, max_seqlen_q=1, cu_seqlens_q=b.cu_seqlens_q, max_seqlen_k=b.max_len,
                 seqused_k=b.seq_lens, softmax_scale=self.ctx.sm_scale, causal=True, block_table=b.page_table,
                 out=b.out, scheduler_metadata=self.metadata, num_splits=self.num_splits, fa_version=3)


def make(variant, ctx):
    return FA3Runner(variant, ctx)
