"""The engines' own prefill kernels, as ``evenkv.attention.PrefillKernel`` objects.

With these, a batch's extend rows (prefill, chunked prefill) run where the engine's default
backend runs them, FA3 on Hopper, while decode rows stay on evenkv's balanced kernels:
Triton 3.6 does not generate the warp-specialized WGMMA pipelines that let FA3 hide the
softmax on SM90, so evenkv's own extend kernel stays behind it there. Each finder returns
None where the kernel is not there (then evenkv's Triton extend kernel runs) and imports its
engine lazily; ``EVENKV_PREFILL=triton`` turns them off. Over an FP8 cache they run FA3's
8-bit path with q cast to e4m3, as the engines' default backends run it.
"""

import logging

import torch

from evenkv.attention import engine_prefill_wanted

logger = logging.getLogger("evenkv")

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
# FA3's 8-bit path writes its output in bf16 only.
FA3_FP8_DTYPES = (torch.bfloat16,)
# vLLM's FA3 runs attention sinks (s_aux) for at most this many query heads; a layer with more
# runs its extend rows on evenkv's Triton kernel.
FA3_MAX_SINK_HEADS = 64


def fa3_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sink logits ([Hq]) in bf16, the one dtype FA3 reads them in (vLLM's build refuses another;
    SGLang's models hold them in bf16 for its fa3 backend): a model's bf16 sinks pass as they
    are, float32 or fp16 sinks are rounded."""
    return None if sinks is None else sinks.to(torch.bfloat16)


def fp8_operands(q: torch.Tensor, k_cache: torch.Tensor, k_scale: float, v_scale: float, rows: int) -> tuple:
    """For FA3 over an FP8 (e4m3) cache, as the engines' default backends run it: (q [T, Hq, D]
    cast to e4m3 with saturation, q's scale 1; k_descale, v_descale [rows, Hkv] fp32, the
    cache's per-tensor scales broadcast). Over a 16-bit cache: (q, None, None)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return q, None, None
    hkv = k_cache.shape[-2]
    k_descale, v_descale = (torch.full((1, 1), scale, dtype=torch.float32, device=q.device).expand(rows, hkv)
                            for scale in (k_scale, v_scale))
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), k_descale, v_descale


# FA3 with one KV split walks each query block's keys in one fixed order, so a query row's
# result depends only on its own request's keys: bitwise the same alone or in any batch, and
# prefilled in one chunk or several (tests/gpu/test_prefill_invariance.py).
# With its own split count it is batch invariant but not chunking invariant.
INVARIANT_NUM_SPLITS = 1


class VllmFlashAttention:
    """vLLM's own FlashAttention (``vllm.vllm_flash_attn``: FA3 on Hopper, FA2 elsewhere, what
    its FLASH_ATTN backend runs) as evenkv's prefill kernel (``evenkv.attention.PrefillKernel``).
    num_splits: FA's KV splits, 0 = its own choice."""

    def __init__(self, varlen, fa_version: int, num_splits: int = 0):
        self.varlen, self.fa_version, self.num_splits = varlen, fa_version, num_splits
        self.name = f"FA{fa_version} (vllm.vllm_flash_attn{', one KV split' if num_splits == 1 else ''})"
        self.fp8_cache_dtypes = FA3_FP8_DTYPES if fa_version >= 3 else ()  # FA2 has no FP8 path

    def takes_sinks(self, num_q_heads: int) -> bool:
        """FA3 takes sinks (``s_aux``) for up to 64 query heads; FA2 has no sink term."""
        return self.fa_version >= 3 and num_q_heads <= FA3_MAX_SINK_HEADS

    def invariant(self) -> "VllmFlashAttention | None":
        """This kernel made batch and chunking invariant (FA3 with one KV split), or None (FA2:
        not checked)."""
        return VllmFlashAttention(self.varlen, 3, INVARIANT_NUM_SPLITS) if self.fa_version == 3 else None

    def __call__(self, q, k_cache, v_cache, out, *, cu_seqlens_q, seq_lens, page_table, max_q_len, max_seq_len,
                 sm_scale, sliding_window=None, logit_cap=None, sinks=None, k_scale=1.0, v_scale=1.0):
        q, k_descale, v_descale = fp8_operands(q, k_cache, k_scale, v_scale, seq_lens.shape[0])
        self.varlen(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q_len,
                    seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=sm_scale, causal=True,
                    window_size=fa_window(sliding_window), softcap=logit_cap or 0.0, s_aux=fa3_sinks(sinks),
                    block_table=page_table, fa_version=self.fa_version, num_splits=self.num_splits,
                    k_descale=k_descale, v_descale=v_descale)


def fa_window(sliding_window: int | None) -> tuple[int, int]:
    """FlashAttention's (left, right) window of a causal layer with window W (keys [p - W + 1,
    p]): (W - 1, 0); (-1, -1) without one."""
    return (sliding_window - 1, 0) if sliding_window else (-1, -1)


def vllm_flash_attention(device) -> VllmFlashAttention | None:
    """vLLM's FlashAttention for ``device`` (FA3 on SM90, else FA2), or None (then evenkv's Triton
    extend kernel runs): EVENKV_PREFILL=triton, no CUDA device, or no build that imports."""
    device = torch.device(device)
    if not engine_prefill_wanted() or device.type != "cuda":
        return None
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func, is_fa_version_supported
    except ImportError as err:
        logger.info("evenkv: vllm.vllm_flash_attn does not import (%s)", err)
        return None
    major, _ = torch.cuda.get_device_capability(device)
    for version in ((3, 2) if major == 9 else (2,)):
        if is_fa_version_supported(version):
            return VllmFlashAttention(flash_attn_varlen_func, version)
    return None


class SGLangFlashAttention:
    """SGLang's own FA3 (``flash_attn_with_kvcache``, what its ``fa3`` backend runs on Hopper) as
    evenkv's prefill kernel (``evenkv.attention.PrefillKernel``)."""

    fp8_cache_dtypes = FA3_FP8_DTYPES

    def __init__(self, with_kvcache, num_splits: int = 0):
        self.with_kvcache, self.num_splits = with_kvcache, num_splits
        self.name = f"FA3 (SGLang's flash_attn_with_kvcache{', one KV split' if num_splits == 1 else ''})"

    def takes_sinks(self, num_q_heads: int) -> bool:
        """As SGLang's ``fa3`` backend, which hands it every layer with sinks."""
        return True

    def invariant(self) -> "SGLangFlashAttention":
        """This kernel made batch and chunking invariant: FA3 with one KV split."""
        return SGLangFlashAttention(self.with_kvcache, INVARIANT_NUM_SPLITS)

    def __call__(self, q, k_cache, v_cache, out, *, cu_seqlens_q, seq_lens, page_table, max_q_len, max_seq_len,
                 sm_scale, sliding_window=None, logit_cap=None, sinks=None, k_scale=1.0, v_scale=1.0):
        q, k_descale, v_descale = fp8_operands(q, k_cache, k_scale, v_scale, seq_lens.shape[0])
        self.with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cache_seqlens=seq_lens,
                          cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q_len, softmax_scale=sm_scale, causal=True,
                          window_size=fa_window(sliding_window), softcap=logit_cap or 0.0, sinks=fa3_sinks(sinks),
                          out=out, num_splits=self.num_splits, k_descale=k_descale, v_descale=v_descale)


def sglang_flash_attention(device) -> SGLangFlashAttention | None:
    """SGLang's FA3 on an SM90 device, or None (then evenkv's Triton extend kernel runs):
    EVENKV_PREFILL=triton, another GPU, or no FA3 build SGLang can load."""
    device = torch.device(device)
    if not engine_prefill_wanted() or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    try:
        from sglang.kernels.ops.attention import flash_attention_v3 as fa3

        fa3._load_fa3_kernels()  # where the FA3 build comes from (sgl_kernel or a kernel cache)
    except Exception as err:  # noqa: BLE001 - any failure to load means: no FA3 here
        logger.info("evenkv: SGLang's FA3 does not load (%s: %s)", type(err).__name__, err)
        return None
    return SGLangFlashAttention(fa3.flash_attn_with_kvcache)


__all__ = ["SGLangFlashAttention", "VllmFlashAttention", "fp8_operands", "sglang_flash_attention",
           "vllm_flash_attention"]
