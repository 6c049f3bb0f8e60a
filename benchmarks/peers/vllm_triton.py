"""vLLM's Triton unified attention (``vllm.v1.attention.ops.triton_unified_attention``)
with the thresholds of vLLM's TritonAttentionBackend (eager mode): the 3D kernel with
16 softmax segments while B <= 128 // Hkv (MIN_LAUNCH_GRID_SIZE_2D // Hkv), the 2D
kernel (no split) above. Segment buffers are sized for that threshold, as vLLM does.
There is no plan step (vLLM's builder only packs metadata). Verify rows (1 + K query
tokens per request) are called as vLLM calls them, ``max_seqlen_q = 1 + K``: the kernel then
takes its 2D path whatever B is.
"""

import torch

from . import Runner, feature_gaps, module_version, try_import

FAMILY = "vllm_triton"
MODULE = "vllm.v1.attention.ops.triton_unified_attention"
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16


def available():
    mod, why = try_import(MODULE)
    return (False, why) if mod is None else (True, "")


def version() -> str:
    return f"vllm {module_version('vllm')}"


def variants(ctx):
    return [("default", True)]


def supports(ctx) -> str:
    return feature_gaps(ctx, fp8_kv=False, window=False, verify=True)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class VLLMTritonRunner(Runner):
    def __init__(self, variant, ctx):
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        if variant != "default":
            raise ValueError(f"vllm_triton variant: expected 'default', got {variant!r}")
        self.fwd, self.ctx = unified_attention, ctx
        s, f32 = ctx.shape, dict(dtype=torch.float32, device=ctx.device)
        self.threshold = MIN_LAUNCH_GRID_SIZE_2D // s.num_kv_heads
        seg, dpad = NUM_PAR_SOFTMAX_SEGMENTS, _next_pow2(s.head_dim)
        self.segm_output = torch.empty(self.threshold, s.num_q_heads, seg, dpad, **f32)
        self.segm_max = torch.empty(self.threshold, s.num_q_heads, seg, **f32)
        self.segm_expsum = torch.empty(self.threshold, s.num_q_heads, seg, **f32)
        self.one = torch.ones(1, **f32)
        self.config = f"3D ({seg} segments) for B <= {self.threshold}, else 2D"

    def prepare(self, batch):
        self.batch = batch
        # vLLM passes the layer's (scalar) k/v scales expanded to [B, Hkv].
        self.descale = self.one.expand(batch.batch_size, self.ctx.shape.num_kv_heads)

    def run(self):
        b = self.batch
        self.fwd(q=b.q, k=b.k_pages, v=b.v_pages, out=b.out, cu_seqlens_q=b.cu_seqlens_q, max_seqlen_q=b.q_len,
                 seqused_k=b.seq_lens, max_seqlen_k=b.max_len, softmax_scale=self.ctx.sm_scale, causal=True,
                 window_size=(-1, -1), block_table=b.page_table, softcap=0, q_descale=None,
                 k_descale=self.descale, v_descale=self.descale, seq_threshold_3D=self.threshold,
                 num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS, softmax_segm_output=self.segm_output,
                 softmax_segm_max=self.segm_max, softmax_segm_expsum=self.segm_expsum)

    def describe(self):
        three_d = self.batch.q_len == 1 and self.batch.batch_size <= self.threshold
        return "3D, 16 segments" if three_d else "2D, no split"


def make(variant, ctx):
    return VLLMTritonRunner(variant, ctx)
