"""evenkv itself: ``evenkv.DecodeAttention`` for each policy and arch table.

Variant names: ``<policy>`` uses the arch table evenkv picks for this device (the one
the headline numbers are about); ``<policy>@sm80`` / ``<policy>@sm90`` force a table
(skipped where it is the one picked anyway); ``balanced-det`` is the batch-invariant mode.

An fp8 KV pool or a window reaches ``DecodeAttention`` as ``kv_dtype=`` / ``sliding_window=``
and the pool's scales as ``run(..., k_scale=, v_scale=)``; a default run passes none of
them, so it needs nothing of the library beyond bf16/fp16 decode. A library without them
raises at construction, and every row of the run says so (status ``error``).
"""

from . import Runner

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
    return out


def parse_variant(variant: str) -> tuple[str, str | None, bool]:
    """'fa3@sm80' -> ('fa3', 'sm80', False); 'balanced-det' -> ('balanced', None, True)."""
    name, _, arch = variant.partition("@")
    det = name.endswith("-det")
    policy = name[: -len("-det")] if det else name
    if policy not in POLICIES or (arch and arch not in ARCHES):
        raise ValueError(f"evenkv variant: expected <policy>[-det][@arch] with policy in {POLICIES} "
                         f"and arch in {ARCHES}, got {variant!r}")
    return policy, arch or None, det


def feature_kwargs(ctx) -> dict:
    """``DecodeAttention`` keywords for the run's KV dtype and window; none for the defaults."""
    kwargs = {}
    if ctx.cache_dtype != ctx.dtype:
        kwargs["kv_dtype"] = ctx.cache_dtype
    if ctx.window:
        kwargs["sliding_window"] = ctx.window
    return kwargs


class EvenkvRunner(Runner):
    def __init__(self, variant, ctx):
        import evenkv
        policy, arch, det = parse_variant(variant)
        kwargs = {"arch": arch, "deterministic": det, **feature_kwargs(ctx)}
        self.fp8 = ctx.kv_fp8
        s = ctx.shape
        self.attn = evenkv.DecodeAttention(s.num_q_heads, s.num_kv_heads, s.head_dim, ctx.page_size, ctx.dtype,
                                           ctx.device, ctx.max_batch, ctx.max_pages, policy,
                                           sm_scale=ctx.sm_scale, **kwargs)
        self._describe(self.attn.config, self.attn.num_ctas)

    def _describe(self, config, num_ctas):
        self.config = f"{self.attn.arch}:{config.name} ctas={num_ctas}"
        self.config_repr = repr(config)

    def prepare(self, batch):
        # The balanced policy picks its config by batch size (DecodeAttention.launch_config).
        self._describe(*self.attn.launch_config(batch.q.shape[0]))
        self.batch = batch
        self.k, self.v = batch.k_slots, batch.v_slots
        self.scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale} if self.fp8 else {}

    def plan(self):
        self.decode_plan = self.attn.plan(self.batch.seq_lens, self.batch.page_table)

    def run(self):
        self.attn.run(self.decode_plan, self.batch.q, self.k, self.v, out=self.batch.out, **self.scales)


def make(variant, ctx):
    return EvenkvRunner(variant, ctx)
