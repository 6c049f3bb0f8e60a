"""FlashInfer's ``BatchAttention``, the "holistic" persistent kernel: its host plan cuts
every (request, KV head) into chunks of one length (the batch's KV per CTA, rounded up to
256 tokens), deals them to persistent CTAs (2 per SM, 1 at head_dim 256) least-loaded
first, and merges the partial states of cut requests in a second stage.

Called as FlashInfer's own tests call it for decode: NHD layout over the shared pool,
``qo_indptr`` = the batch's query rows (0..B for one query token per request; steps of
1 + K for verify rows of K draft tokens), FlashInfer's CSR page indices
(``page_indptr`` / ``page_indices``) and the token lengths ``kv_len_arr`` [B] int32,
``causal=True`` (FlashInfer aligns the queries with the end of the keys; with one query
token, the same as no mask). ``plan`` is
``BatchAttention.plan``: it copies the indptrs and lengths to the host, synchronizes, and
writes the schedule into the wrapper's workspaces (384 MiB float, 8 MiB int, allocated by
the wrapper itself). ``run`` is ``BatchAttention.run`` into ``batch.out`` with a
preallocated LSE buffer (else ``run`` allocates one per call).

No fp8 KV cache and no sliding window here: the wrapper's plan has no window argument,
and fp8 is not wired. One JIT module per (dtype, head_dim), prebuilt in the background.
"""

import torch

from . import Runner, feature_gaps, fi_jit, opt_in_only, try_import
from .flashinfer import version  # noqa: F401 - the adapter protocol's version()

FAMILY = "flashinfer_holistic"
MODULE = "flashinfer"


def available():
    mod, why = try_import(MODULE)
    if mod is None:
        return False, why
    if not hasattr(mod, "BatchAttention"):
        return False, f"flashinfer {getattr(mod, '__version__', '?')} has no BatchAttention"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, ""


variants = opt_in_only


def supports(ctx) -> str:
    return feature_gaps(ctx, fp8_kv=False, window=False, verify=True)


def prebuild(variant, ctx) -> list:
    return fi_jit.start(fi_jit.holistic_spec(ctx))


class HolisticRunner(Runner):
    def __init__(self, variant, ctx):
        import flashinfer
        if variant != "default":
            raise ValueError(f"flashinfer_holistic variant: expected 'default', got {variant!r}")
        self.ctx = ctx
        self.wrapper = flashinfer.BatchAttention(kv_layout="NHD", device=str(ctx.device))
        self.lse = torch.empty(ctx.max_batch * ctx.max_q_len, ctx.shape.num_q_heads, dtype=torch.float32,
                               device=ctx.device)
        self.config = "BatchAttention (persistent, NHD)"

    def prepare(self, batch):
        self.batch = batch
        self.lse_b = self.lse[: batch.q.shape[0]]

    def plan(self):
        b, s = self.batch, self.ctx.shape
        self.wrapper.plan(b.cu_seqlens_q, b.page_indptr, b.page_indices, b.seq_lens, s.num_q_heads, s.num_kv_heads,
                          s.head_dim, s.head_dim, b.page_size, causal=True, sm_scale=self.ctx.sm_scale,
                          q_data_type=self.ctx.dtype, kv_data_type=self.ctx.dtype)

    def run(self):
        b = self.batch
        self.wrapper.run(b.q, (b.k_pages, b.v_pages), out=b.out, lse=self.lse_b)


def make(variant, ctx):
    return HolisticRunner(variant, ctx)
