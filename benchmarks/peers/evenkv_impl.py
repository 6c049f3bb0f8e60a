"""evenkv itself: ``evenkv.DecodeAttention`` for each policy and arch table.

Variant names: ``<policy>`` uses the arch table evenkv picks for this device (the one
the headline numbers are about); ``<policy>@sm80`` / ``<policy>@sm90`` force a table
(skipped where it is the one picked anyway); ``balanced-det`` is the batch-invariant mode;
``balanced-tree`` runs verify rows as tree-masked ones (``tree_masks=True``), each planned
with a chain mask, which is how SGLang's n-gram and EAGLE topk > 1 verify steps reach evenkv:
the same causal rows as ``balanced``, on the tree-mask kernel variants (plain decode rows are
the same kernels either way); ``balanced-onehead`` walks each KV head alone where evenkv's
default walks two heads of 64 as one over an FP8 cache (``pack_kv_heads=False``; elsewhere the
same as ``balanced``).
Every variant runs verify rows (1 + K query tokens per request, K <= 15): ``DecodeAttention``
built with ``max_q_len=1 + K`` and planned with the batch's ``cu_seqlens_q`` and ``q_len``;
a run's verify objects compile their kernels ahead, in background processes (``prebuild``).

An fp8 KV pool or a window reaches ``DecodeAttention`` as ``kv_dtype=`` / ``sliding_window=``
and the pool's scales as ``run(..., k_scale=, v_scale=)``; a default run passes none of
them, so it needs nothing of the library beyond bf16/fp16 decode. A library without them
raises at construction, and every row of the run says so (status ``error``).
"""

import math
import sys

import torch

from . import Context, Runner, Shape, start_background
from .fi_jit import DTYPES, dtype_name

FAMILY = "evenkv"
POLICIES = ("balanced", "fa3", "none")
ARCHES = ("sm80", "sm90")


def available():
    try:
        import evenkv  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, f"import evenkv failed: {type(e).__name__}: {e}"
    return True, ""


def version() -> str:
    import evenkv
    return getattr(evenkv, "__version__", "")


def variants(ctx):
    import evenkv
    auto = evenkv.resolve_arch(None, ctx.device)
    out = []
    for policy in POLICIES:
        out.append((policy, True))
        out += [(f"{policy}@{arch}", True) for arch in ARCHES if arch != auto]
    out.append(("balanced-det", True))
    out.append(("balanced-tree", False))
    out.append(("balanced-onehead", False))
    return out


def parse_variant(variant: str) -> tuple[str, str | None, bool, bool, bool]:
    """'fa3@sm80' -> ('fa3', 'sm80', False, False, False); 'balanced-det' -> ('balanced', None,
    True, False, False); 'balanced-tree' -> ('balanced', None, False, True, False);
    'balanced-onehead' -> ('balanced', None, False, False, True); the last field: walk each KV
    head alone."""
    name, _, arch = variant.partition("@")
    det, tree, one_head = name.endswith("-det"), name.endswith("-tree"), name.endswith("-onehead")
    policy = name.rsplit("-", 1)[0] if det or tree or one_head else name
    if policy not in POLICIES or (arch and arch not in ARCHES):
        raise ValueError(f"evenkv variant: expected <policy>[-det|-tree|-onehead][@arch] with policy in {POLICIES} "
                         f"and arch in {ARCHES}, got {variant!r}")
    return policy, arch or None, det, tree, one_head


def feature_kwargs(ctx) -> dict:
    """``DecodeAttention`` keywords for the run's KV dtype and window; none for the defaults."""
    kwargs = {}
    if ctx.cache_dtype != ctx.dtype:
        kwargs["kv_dtype"] = ctx.cache_dtype
    if ctx.window:
        kwargs["sliding_window"] = ctx.window
    return kwargs


class EvenkvRunner(Runner):
    """One ``DecodeAttention`` per query length it is given, built on first use (untimed):
    ``max_q_len=1`` for plain decode rows, ``max_q_len=1 + K`` for verify rows of K draft
    tokens, as an engine serving K draft tokens builds it. One that fails to build fails
    every batch of its query length with the same error, and no other."""

    def __init__(self, variant, ctx):
        self.policy, arch, det, tree, one_head = parse_variant(variant)
        self.ctx = ctx
        self.kwargs = {"arch": arch, "deterministic": det, "tree_masks": tree, "pack_kv_heads": not one_head,
                       **feature_kwargs(ctx)}
        self.fp8 = ctx.kv_fp8
        self.objects = {}  # q_len -> DecodeAttention, or the exception building it raised

    def decode_attention(self, q_len: int):
        import evenkv
        if q_len not in self.objects:
            c, s = self.ctx, self.ctx.shape
            try:
                self.objects[q_len] = evenkv.DecodeAttention(
                    s.num_q_heads, s.num_kv_heads, s.head_dim, c.page_size, c.dtype, c.device, c.max_batch,
                    c.max_pages, self.policy, sm_scale=c.sm_scale, max_q_len=q_len, **self.kwargs)
            except Exception as e:  # noqa: BLE001 - kept, and raised again for every batch of this q_len
                self.objects[q_len] = e
        attn = self.objects[q_len]
        if isinstance(attn, Exception):
            raise attn
        return attn

    def prepare(self, batch):
        self.attn = self.decode_attention(batch.q_len)
        # The balanced policy picks its config by batch size and q_len (DecodeAttention.launch_config).
        config, num_ctas = self.attn.launch_config(batch.batch_size, batch.q_len)
        self.config = f"{self.attn.arch}:{config.name} ctas={num_ctas}"
        self.config_repr = repr(config)
        self.batch = batch
        self.k, self.v = batch.k_slots, batch.v_slots
        self.scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale} if self.fp8 else {}
        self.rows = {"cu_seqlens_q": batch.cu_seqlens_q, "q_len": batch.q_len} if batch.q_len > 1 else {}
        if batch.q_len > 1 and self.attn.tree_masks:
            self.rows["tree_mask"] = chain_mask(batch.cu_seqlens_q)

    def plan(self):
        self.decode_plan = self.attn.plan(self.batch.seq_lens, self.batch.page_table, **self.rows)

    def run(self):
        self.attn.run(self.decode_plan, self.batch.q, self.k, self.v, out=self.batch.out, **self.scales)


def chain_mask(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """[cu_seqlens_q[-1]] int32 tree mask of chains: query token t of each request sees its
    new tokens 0..t, bits (1 << (t + 1)) - 1 (causal rows)."""
    cu = cu_seqlens_q.to(torch.int64)
    rows = torch.arange(int(cu[-1]), device=cu.device)
    token = rows - cu[:-1].repeat_interleave(cu.diff())
    return ((1 << (token + 1)) - 1).to(torch.int32)


def make(variant, ctx):
    return EvenkvRunner(variant, ctx)


def build_spec(variant, ctx) -> tuple:
    """The object ``EvenkvRunner`` builds for ``ctx``'s max_q_len, as ``build`` takes it:
    (variant, Hq, Hkv, D, page size, dtype, KV dtype, window, q_len, max batch) strings."""
    s = ctx.shape
    return (variant, str(s.num_q_heads), str(s.num_kv_heads), str(s.head_dim), str(ctx.page_size),
            dtype_name(ctx.dtype), dtype_name(ctx.cache_dtype), str(ctx.window), str(ctx.max_q_len), str(ctx.max_batch))


def prebuild(variant, ctx) -> list:
    """For verify rows (``ctx.max_q_len`` > 1): compile the kernels of ``variant``'s object in a
    background process (``build``), into Triton's disk cache, where this process finds them.
    Building an object of max_q_len N compiles one decode kernel per q-length bucket up to N,
    one after another: the objects of a ``--verify`` run build side by side this way. Plain
    decode objects (two kernels) build in the run itself."""
    if ctx.device.type != "cuda" or ctx.max_q_len == 1:
        return []
    spec = build_spec(variant, ctx)
    started = start_background(("evenkv",) + spec, [sys.executable, "-m", __name__, *spec])
    return [f"evenkv {' '.join(spec)}"] if started else []


def build(spec: tuple, device="cuda"):
    """Build the object of ``spec`` (``build_spec``) on ``device``, compile every kernel it can
    launch (``DecodeAttention.warmup``, int32 lengths as the benchmark's) and return it."""
    variant, hq, hkv, d, page, dtype, kv_dtype, window, q_len, max_batch = spec
    shape = Shape("build", int(hq), int(hkv), int(d))
    ctx = Context(shape, DTYPES[dtype], torch.device(device), int(page), int(max_batch), 1, 1.0 / math.sqrt(int(d)), 1,
                  kv_dtype=DTYPES[kv_dtype], window=int(window), max_q_len=int(q_len))
    attn = EvenkvRunner(variant, ctx).decode_attention(ctx.max_q_len)
    cache = torch.zeros(ctx.page_size, shape.num_kv_heads, shape.head_dim, dtype=ctx.cache_dtype, device=ctx.device)
    q = torch.zeros(1, shape.num_q_heads, shape.head_dim, dtype=ctx.dtype, device=ctx.device)
    attn.warmup(q, cache, cache, index_dtypes=(torch.int32,))
    return attn


if __name__ == "__main__":
    build(tuple(sys.argv[1:]))
