"""SGLang's Triton decode kernel (``sglang.kernels.ops.attention.decode_attention``),
called as SGLang's ``TritonAttnBackend`` calls it: a token-level index list
(``kv_indptr`` / ``kv_indices`` = token slots, over the same page placement), fp32
split buffers sized for the largest batch, ``max_kv_splits`` = 8 (SGLang's default
``--triton-attention-num-kv-splits``), and the per-request split counts from SGLang's
own heuristic kernel ``get_num_kv_splits_triton`` (``MAX_NUM_SEQ`` = 256, or the next
power of two of B from 256 on, as the backend does). The peers kit carries only the
kernel files, so that backend logic is re-created here (as in peers/check.py).

Variants: ``auto8`` (the heuristic, max 8 splits; SGLang's default). Not run by
default: ``fix8`` / ``fix16`` = every request split 8 / 16 ways (``--triton-attention-
num-kv-splits`` with static splits).
"""

import inspect

import torch

from . import Runner, feature_gaps, module_version, try_import

FAMILY = "sglang_triton"
MODULE = "sglang.kernels.ops.attention.decode_attention"
META_MODULE = "sglang.kernels.ops.attention.metadata"
SPLITS = {"auto8": (8, False), "fix8": (8, True), "fix16": (16, True)}


def available():
    for name in (MODULE, META_MODULE):
        mod, why = try_import(name)
        if mod is None:
            return False, why
    return True, ""


def version() -> str:
    return f"sglang {module_version('sglang')}"


def variants(ctx):
    return [("auto8", True), ("fix8", False), ("fix16", False)]


def supports(ctx) -> str:
    return feature_gaps(ctx, fp8_kv=False, window=False)


def _arg_names(fn) -> list:
    names = getattr(fn, "arg_names", None)
    if names:
        return list(names)
    return list(inspect.signature(getattr(fn, "fn", fn)).parameters)


def schedule_seq(batch_size: int) -> int:
    """TritonAttnBackend.get_num_kv_splits: MAX_NUM_SEQ of the heuristic kernel."""
    return 256 if batch_size < 256 else 1 << (batch_size - 1).bit_length()


class SGLangRunner(Runner):
    def __init__(self, variant, ctx):
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton
        if variant not in SPLITS:
            raise ValueError(f"sglang_triton variant: expected one of {tuple(SPLITS)}, got {variant!r}")
        self.fwd, self.heuristic = decode_attention_fwd, get_num_kv_splits_triton
        self.ctx = ctx
        self.max_splits, self.fixed = SPLITS[variant]
        s, dev = ctx.shape, ctx.device
        i32, f32 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.float32, device=dev)
        self.num_kv_splits = torch.empty(ctx.max_batch, **i32)
        self.attn_logits = torch.empty(ctx.max_batch, s.num_q_heads, self.max_splits, s.head_dim, **f32)
        self.attn_lse = torch.empty(ctx.max_batch, s.num_q_heads, self.max_splits, **f32)
        # SGLang >= 0.5.18 has a HIP-only uneven_batch argument; 0.5.17 lacks it.
        self.heur_kw = ({"uneven_batch_ptr": torch.zeros(1, **i32)}
                        if "uneven_batch_ptr" in _arg_names(get_num_kv_splits_triton) else {})
        self.fwd_kw = ({"uneven_batch": torch.zeros(1, **i32)}
                       if "uneven_batch" in inspect.signature(decode_attention_fwd).parameters else {})
        self.config = (f"max_kv_splits={self.max_splits} fixed" if self.fixed
                       else f"max_kv_splits={self.max_splits} heuristic")

    def prepare(self, batch):
        self.batch = batch
        self.kv_indptr, self.kv_indices = batch.token_indices()
        self.k, self.v = batch.k_slots, batch.v_slots

    def plan(self):
        b, s = self.batch, self.ctx.shape
        if self.fixed:
            self.num_kv_splits[: b.batch_size].fill_(self.max_splits)
        else:
            self.heuristic[(1,)](self.num_kv_splits, b.seq_lens, b.batch_size, 1, s.num_q_heads, s.num_kv_heads,
                                 self.max_splits, self.ctx.num_sms, MAX_NUM_SEQ=schedule_seq(b.batch_size),
                                 **self.heur_kw)

    def run(self):
        b = self.batch
        self.fwd(b.q, self.k, self.v, b.out, self.kv_indptr, self.kv_indices, self.attn_logits, self.attn_lse,
                 self.num_kv_splits, self.max_splits, self.ctx.sm_scale, 1.0, 1.0, **self.fwd_kw)

    def describe(self):
        if self.fixed:
            return self.config
        n = self.num_kv_splits[: self.batch.batch_size]
        return f"{self.config}; splits req0={int(n[0])} min={int(n.min())} max={int(n.max())}"


def make(variant, ctx):
    return SGLangRunner(variant, ctx)
