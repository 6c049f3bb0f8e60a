"""``Attention``: the one object both engine adapters drive, once per batch and per layer.

A batch is decode rows (q_len 1) first, then extend rows (prefill chunks, spec-verify
rows): requests ``[0, num_decodes)`` own q rows ``[0, num_decodes)``. vLLM orders its
batches that way; SGLang's batches are all decode (``num_decodes == B``) or all extend
(``num_decodes == 0``). ``plan`` plans both parts once per batch; ``run`` runs them per
layer and writes one output.

CUDA-graph contract: ``plan`` and ``run`` launch GPU work only (no ``.item()``,
``.cpu()``, host sync or data-dependent allocation; every buffer is allocated in
``__init__``), so both can be captured. The extend grid is sized from host ints
(``q.shape[0]``, ``max_q_len``, B, ``num_decodes``), so a captured run replays correctly
for any lengths within the captured values. Under graphs pass the same persistent
``cu_seqlens_q`` / ``seq_lens`` / ``page_table`` buffers to every ``plan`` and refill them
in place.
"""

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from evenkv.kernels import extend_launch, plan_launch
from evenkv.kernels.launching import parallel_compiles

from .checks import (INDEX_DTYPES, PlanRecord, check_attention_layout, check_batch_limits,
                     check_batch_metadata, check_head_dim, check_kv_caches, check_new_token_v_scale,
                     check_new_tokens, check_policy, check_positive_int, check_tensor, decode_caches,
                     normalize_logit_cap, normalize_window, output_like, resolve_device, resolve_kv_dtype,
                     resolve_sm_scale)
from .configs import ExtendConfig, debug_enabled, env_flag, extend_config, extend_configs, resolve_arch, sm_count
from .decode_attention import POLICIES, DecodeAttention, DecodePlan, check_max_q_len, check_pages
from .errors import error_flag
from .extend_attention import SCHEDULES, check_lengths_on_host, run_extend
from .planning import ExtendPlan, plan_extend


class PrefillKernel(Protocol):
    """An engine's own paged prefill kernel (FA3 on Hopper, say), which ``Attention`` runs for
    the extend rows of a batch instead of evenkv's Triton extend kernel (``prefill_kernel=``).

    Called once per layer with the batch's extend rows only, causal, every position read
    from the cache (both engines write the new tokens' K/V before attention), on rows evenkv
    has bounded (``Attention._guard_prefill_rows``: q rows inside q, lengths at least the q
    length and inside the page table, every page below a length inside the cache):
    q, out [T, Hq, D]; k_cache, v_cache [num_pages, page_size, Hkv, D] in q's dtype (any
    strides, unit stride in D), or float8_e4m3fn where q's dtype is in ``fp8_cache_dtypes``;
    cu_seqlens_q [E + 1] int32 from 0; seq_lens [E] int32 (KV length including the new
    tokens); page_table [E, max_pages] int32; max_q_len, max_seq_len: host bounds; sm_scale:
    the layer's softmax scale; sliding_window (W or None, ``evenkv.extend``'s convention),
    logit_cap (c or None) and sinks ([Hq] or None) as the layer has them; k_scale, v_scale:
    an FP8 cache's per-tensor scales (host floats, 1.0 for a 16-bit cache). Writes out rows
    [0, cu_seqlens_q[E]).
    """

    name: str
    # The q / out dtypes with which it also reads an FP8 (e4m3) cache, q cast to e4m3 as the
    # engine's default backend does: FA3's 8-bit path writes bf16 only; FA2 has none, ().
    fp8_cache_dtypes: tuple

    def takes_sinks(self, num_q_heads: int) -> bool:
        """Whether it runs a layer of ``num_q_heads`` query heads with attention sinks."""

    def invariant(self) -> "PrefillKernel | None":
        """The same kernel in a form whose result for a query row depends on its own request's
        keys only, bitwise (batch and chunking invariant), for deterministic mode; None if it
        has none."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, *,
                 cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, max_q_len: int,
                 max_seq_len: int, sm_scale: float, sliding_window: int | None, logit_cap: float | None,
                 sinks: torch.Tensor | None, k_scale: float = 1.0, v_scale: float = 1.0) -> None: ...


PREFILL_ENV = "EVENKV_PREFILL"
PREFILL_CHOICES = ("auto", "triton")


def engine_prefill_wanted() -> bool:
    """Whether the engine adapters should hand extend rows to the engine's own prefill kernel:
    ``EVENKV_PREFILL=auto`` (default) where there is one, over an FP8 cache too where it reads
    one (q cast to e4m3, the engine's default backend's accuracy); ``triton`` never (evenkv's
    Triton extend, q in 16 bits over an FP8 cache)."""
    value = os.environ.get(PREFILL_ENV, "auto") or "auto"
    if value not in PREFILL_CHOICES:
        raise ValueError(f"{PREFILL_ENV}: expected one of {PREFILL_CHOICES}, got {value!r}")
    return value == "auto"


@dataclass(frozen=True, eq=False)
class DelegatedExtend:
    """The extend rows [first_row, ...) of a batch, as the prefill kernel takes them:
    cu_seqlens_q [E + 1] int32 from 0, seq_lens [E] int32 (both written, bounded, at the plan's
    first run), page_table [E, max_pages] int32, host bounds max_q_len and max_seq_len."""

    first_row: int
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    max_q_len: int
    max_seq_len: int


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """One planned batch: what ``Attention.run`` executes.

    batch_size: B. num_decodes: requests [0, num_decodes) are decode rows, on q rows [0,
    num_decode_tokens). decode: their plan on the decode kernels, or None (no decode rows).
    extend: the extend kernel's plan for the other rows, or delegated: those rows for the
    engine's prefill kernel (both None when every request is a decode row).
    seq_lens [B], page_table [B, max_pages]: the caller's tensors; cu_seqlens_q [B + 1] int32:
    the caller's, as int32. Valid until the ``Attention`` that made it plans again.
    """

    batch_size: int
    num_decodes: int
    num_decode_tokens: int
    decode: DecodePlan | None
    extend: ExtendPlan | None
    delegated: DelegatedExtend | None
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor


class Attention:
    """Paged attention for batches of decode rows followed by extend rows.

    Args:
        num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, max_batch_size,
        max_pages_per_request, policy: as ``evenkv.DecodeAttention`` (policy applies to
            the decode rows).
        sm_scale: default softmax scale of ``run`` (1/sqrt(D) if None).
        sliding_window, logit_cap: as ``evenkv.extend`` (None/0 = off), for decode and extend rows.
        kv_dtype: the caches' dtype, None (= dtype) or torch.float8_e4m3fn (``run`` takes its
            k_scale / v_scale).
        schedule, extend_config: the extend kernel's schedule and config (see ``extend``).
        prefill_kernel: an engine's prefill kernel (``PrefillKernel``) for the extend rows, or
            None for evenkv's Triton extend kernel. An FP8 cache keeps the Triton kernel
            unless dtype is in the kernel's ``fp8_cache_dtypes``; deterministic mode takes the
            kernel's batch- and chunking-invariant form (``PrefillKernel.invariant``) or, where
            it has none, the Triton kernel (``prefill_reason`` says which runs and why;
            ``decode_reason`` which of evenkv's decode kernels the decode rows run on). The page
            audit still reports bad page ids, but memory safety against them is then the engine
            kernel's.
        arch, debug: as ``evenkv.DecodeAttention``.
        max_decode_q_len: the most query tokens one decode row may have (1 + speculative draft
            tokens, up to 16; ``DecodeAttention``'s max_q_len).
        tree_masks: decode rows of several query tokens carry tree masks (``plan``'s
            tree_mask, required for them then).
        decode_kwargs: passed on to ``DecodeAttention`` (``num_ctas``, ``deterministic``,
            ``q_lens``, ...).
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 device, max_batch_size: int, max_pages_per_request: int, policy: str = "balanced", *,
                 sm_scale: float | None = None, sliding_window: int | None = None, logit_cap: float | None = None,
                 kv_dtype: torch.dtype | None = None, schedule: str = "lpt", extend_config: ExtendConfig | None = None,
                 prefill_kernel: PrefillKernel | None = None, arch: str | None = None, debug: bool | None = None,
                 max_decode_q_len: int = 1, tree_masks: bool = False, **decode_kwargs):
        check_attention_layout(num_q_heads, num_kv_heads, page_size, dtype, max_batch_size, max_pages_per_request)
        check_head_dim(head_dim)
        check_policy(policy, POLICIES)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
        if extend_config is not None and not isinstance(extend_config, ExtendConfig):
            raise TypeError(f"extend_config: expected ExtendConfig or None, got {type(extend_config).__name__}")
        self.device = resolve_device(device)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group_size = num_q_heads // num_kv_heads
        self.page_size, self.dtype = page_size, dtype
        self.max_batch_size, self.max_pages_per_request = max_batch_size, max_pages_per_request
        self.sm_scale = resolve_sm_scale(sm_scale, head_dim)
        self.sliding_window = normalize_window(sliding_window)
        self.logit_cap = normalize_logit_cap(logit_cap)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, dtype)
        self.schedule = schedule
        self.arch = resolve_arch(arch, self.device)
        self._extend_config = extend_config
        self.debug = debug_enabled(debug)
        check_positive_int("max_decode_q_len", max_decode_q_len)
        check_max_q_len(max_decode_q_len, self.group_size, head_dim, self.arch, name="max_decode_q_len")
        self.decode = DecodeAttention(
            num_q_heads, num_kv_heads, head_dim, page_size, dtype, self.device, max_batch_size,
            max_pages_per_request, policy, sm_scale=self.sm_scale, arch=self.arch, debug=debug,
            sliding_window=self.sliding_window, logit_cap=self.logit_cap, kv_dtype=self.kv_dtype,
            max_q_len=max_decode_q_len, tree_masks=tree_masks, **decode_kwargs)
        self.max_decode_q_len = max_decode_q_len
        i32 = dict(dtype=torch.int32, device=self.device)
        # The batch's cu_seqlens_q as int32 (the decode and audit kernels take one index dtype).
        self._cu = torch.zeros(max_batch_size + 1, **i32)
        self._order = torch.zeros(max_batch_size, **i32)
        self._sorted_start = torch.zeros(max_batch_size, **i32)
        self.deterministic = env_flag("EVENKV_DETERMINISTIC", decode_kwargs.get("deterministic"))
        self.prefill_kernel, self.prefill_reason = self._choose_prefill(prefill_kernel)
        self.decode_reason = self._describe_decode()
        if self.prefill_kernel is not None:
            # The prefill kernel's rows and lengths (``guard_prefill_rows_kernel``), and the
            # page audit's copy of the lengths.
            self._cu_extend = torch.zeros(max_batch_size + 1, **i32)
            self._lens_extend = torch.zeros(max_batch_size, **i32)
            self._lens_extend_audit = torch.zeros(max_batch_size, **i32)
        self._guarded: tuple | None = None  # (q rows, cache pages) the latest plan's prefill rows were bounded for
        self._plan: AttentionPlan | None = None
        self._plans = PlanRecord("Attention")
        self.warmed_up = False  # set by warmup()
        self._audited_pages = None  # the cache size the latest plan's page ids were audited against
        self._errors = error_flag(self.device)
        self._audit_grid = sm_count(self.device)

    def _describe_decode(self) -> str:
        """Which of evenkv's decode kernels the decode rows run on, as the adapters log it."""
        d = self.decode
        how = {"balanced": "the balanced plan", "fa3": "FA3-style split units", "none": "one CTA per request and head"}
        line = f"{d.policy}: {how[d.policy]}"
        if d.deterministic:
            line += "; deterministic: each request cut into chunks of its own length, merged in a fixed order"
        if d.head_pack > 1:
            line += f"; KV heads walked {d.head_pack} at a time, as one head of {d.head_pack * d.head_dim} columns"
        return line

    def _choose_prefill(self, kernel: PrefillKernel | None) -> tuple:
        """(the prefill kernel extend rows run on, or None for evenkv's Triton kernel; why)."""
        if kernel is None:
            if not engine_prefill_wanted():
                return None, f"evenkv's Triton extend kernel ({PREFILL_ENV}=triton)"
            return None, "evenkv's Triton extend kernel (no engine prefill kernel given)"
        if not callable(kernel) or not all(hasattr(kernel, a) for a in ("name", "fp8_cache_dtypes")):
            raise TypeError(f"prefill_kernel: expected None or a PrefillKernel (callable, with a name and "
                            f"fp8_cache_dtypes), got {type(kernel).__name__}")
        fp8_query = ""
        if self.kv_dtype != self.dtype:
            if self.dtype not in kernel.fp8_cache_dtypes:
                return None, (f"evenkv's Triton extend kernel: {kernel.name} reads a {self.kv_dtype} cache with "
                              f"q and out in {kernel.fp8_cache_dtypes or 'no dtype'}, and the model is {self.dtype}")
            fp8_query = (f", over the FP8 cache with q cast to e4m3 as the engine's default backend runs it; "
                         f"{PREFILL_ENV}=triton keeps q in 16 bits")
        if self.deterministic:
            invariant = kernel.invariant()
            if invariant is None:
                return None, (f"evenkv's Triton extend kernel: deterministic mode needs a prefill that is batch "
                              f"and chunking invariant, which {kernel.name} is not known to be")
            return invariant, f"{invariant.name} (the engine's prefill kernel, batch and chunking invariant{fp8_query})"
        return kernel, f"{kernel.name} (the engine's prefill kernel{fp8_query})"

    def warmup(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
               k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, out: torch.Tensor | None = None,
               sinks: torch.Tensor | None = None, index_dtypes: tuple = INDEX_DTYPES) -> None:
        """Compile, without running anything, every kernel variant ``plan`` and ``run`` can launch
        for tensors laid out like these (dtypes, strides, alignment), whatever the batch: the
        decode kernels (``DecodeAttention.warmup``), the page audit, and the extend plan and
        extend kernels of every extend config a batch can pick (``configs.extend_configs``),
        with new tokens in ``k_new``/``v_new`` iff they are given (SGLang) or read from the
        cache (vLLM), with sinks iff ``sinks`` is given. Lengths may come in each dtype of
        ``index_dtypes``. Engines call it once, when they first hold these tensors; after it no
        batch compiles a kernel.

        Shapes as ``run``'s. Under the Triton interpreter nothing is compiled.
        """
        self.decode.check_warmup_tensors(q, k_cache, v_cache, out, sinks, index_dtypes)
        check_new_tokens(k_new, v_new, None, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        k_cache, v_cache = decode_caches(k_cache, v_cache, self.page_size)
        with parallel_compiles():
            self._warmup(q, k_cache, v_cache, k_new, v_new, out if out is not None else q, sinks, index_dtypes)
        self.warmed_up = True

    def _warmup(self, q, k_cache, v_cache, k_new, v_new, out, sinks, index_dtypes) -> None:
        dev, i32 = self.device, dict(dtype=torch.int32, device=self.device)
        page_table, cu = torch.zeros(1, 1, **i32), torch.zeros(2, **i32)
        for dtype in index_dtypes:
            plan_launch.launch_guard_query_rows(cu.to(dtype), self._cu, self._errors, warmup=True)
        configs = ([] if self.prefill_kernel is not None else [self._extend_config]
                   if self._extend_config is not None else extend_configs(self.arch, self.head_dim, self.group_size))
        for block_b in plan_launch.plan_block_buckets(self.max_batch_size):
            for dtype in index_dtypes:
                lens = torch.zeros(block_b, dtype=dtype, device=dev)
                plan_launch.launch_audit_pages(lens, self._cu, page_table, self._errors, 1, self.page_size,
                                               self._audit_grid, self.max_batch_size, warmup=True)
            if self.prefill_kernel is not None:
                plan_launch.launch_audit_pages(self._lens_extend_audit[:block_b], self._cu_extend, page_table,
                                               self._errors, 1, self.page_size, self._audit_grid,
                                               self.max_batch_size, bad_row_lens=self._lens_extend, warmup=True)
        for dtype in index_dtypes if self.prefill_kernel is not None else ():
            plan_launch.launch_guard_prefill_rows(
                self._cu, torch.zeros(1, dtype=dtype, device=dev), self._cu_extend, self._lens_extend,
                self._lens_extend_audit, self._errors, first_row=0, total_rows=1, max_q_len=1, capacity=1,
                warmup=True)
        for config in configs:
            for dtype in index_dtypes:
                lens = torch.zeros(1, dtype=dtype, device=dev)
                plan_launch.launch_extend_plan(cu, lens, self._order, self._sorted_start, self._errors, req_begin=0,
                                                 max_q_len=1, group_size=self.group_size, block_m=config.block_m,
                                                 lpt=self.schedule == "lpt", warmup=True)
                extend_launch.launch_extend(
                    q, k_cache, v_cache, k_new, v_new, out, cu, lens, page_table, self._order, self._sorted_start,
                    self._errors, num_programs_bound=1, req_begin=0, max_q_len=1, page_size=self.page_size,
                    sm_scale=self.sm_scale, causal=True, window=self.sliding_window, logit_cap=self.logit_cap,
                    block_m=config.block_m, block_n=config.block_n, num_warps=config.num_warps,
                    num_stages=config.num_stages, sinks=sinks, warmup=True)
        # Last: its grids need its decode kernels built, which builds everything held so far.
        self.decode.warmup(q, k_cache, v_cache, out=out, sinks=sinks, index_dtypes=index_dtypes)

    def plan(self, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, *,
             num_decodes: int, max_q_len: int, max_seq_len: int | None = None,
             seq_lens_cpu: torch.Tensor | None = None, decode_q_len: int = 1, num_decode_tokens: int | None = None,
             tree_mask: torch.Tensor | None = None) -> AttentionPlan:
        """Plan one batch. The returned plan is what ``run`` takes, for every layer; it stays
        valid until this object plans again.

        cu_seqlens_q: [B + 1] int32/int64 on this device: request b's query tokens are q rows
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1.
        seq_lens: [B] int32/int64 on this device, KV length including the new tokens.
        page_table: [B, max_pages] int32 on this device, unit stride in the last dim.
        num_decodes: host int in [0, B] (vLLM ``split_decodes_and_prefills``): requests [0,
            num_decodes) are decode rows, on q rows [0, num_decode_tokens), each of 1 to
            decode_q_len query tokens (1: plain decode; more: speculative verify). A decode row
            whose q length breaks that is flagged on the device (``evenkv.check_errors``),
            never run as something else.
        max_q_len: host int >= every q length of requests [num_decodes, B) (1 if none).
        max_seq_len: host int >= every seq_len (the prefill kernel's bound); default the page
            table's capacity.
        seq_lens_cpu: optional host copy of seq_lens ([B]); the decode rows' lengths are
            then checked against the page table with no sync.
        decode_q_len: host int, the most query tokens of one decode row (1 to max_decode_q_len).
        num_decode_tokens: host int, the decode rows' query tokens (cu_seqlens_q[num_decodes]);
            default num_decodes, required when decode_q_len > 1.
        tree_mask: [>= num_decode_tokens] int32 exactly when decode_q_len > 1 and the object has
            tree_masks (else None: causal among a decode row's tokens): each decode query row's
            tree mask over its request's new tokens (``DecodeAttention.plan``).
        """
        batch = check_batch_metadata(seq_lens, page_table, self.device, cu_seqlens_q, cu_required=True)
        check_batch_limits(batch, page_table, self.max_batch_size, self.max_pages_per_request)
        for name, value in (("num_decodes", num_decodes), ("max_q_len", max_q_len)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected a host int, got {type(value).__name__}")
        if not 0 <= num_decodes <= batch:
            raise ValueError(f"num_decodes: expected an int in [0, B={batch}], got {num_decodes}")
        if max_q_len < 0:
            raise ValueError(f"max_q_len: expected >= 0, got {max_q_len}")
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or max_seq_len < 1):
            raise ValueError(f"max_seq_len: expected None or a host int >= 1 (>= every seq_len), got {max_seq_len!r}")
        num_decode_tokens = self._decode_tokens(num_decodes, decode_q_len, num_decode_tokens)
        if seq_lens_cpu is not None:
            check_tensor("seq_lens_cpu", seq_lens_cpu, shape=(batch,), dtypes=INDEX_DTYPES, device=torch.device("cpu"))
        if isinstance(tree_mask, torch.Tensor) and tree_mask.dim() == 1 and tree_mask.shape[0] < num_decode_tokens:
            raise ValueError(f"tree_mask: expected an entry for each of the num_decode_tokens={num_decode_tokens} "
                             f"decode query rows, got shape {tuple(tree_mask.shape)}")
        if self.debug and decode_q_len == 1:
            cu = cu_seqlens_q[:num_decodes + 1].cpu()
            if not torch.equal(cu.long(), torch.arange(num_decodes + 1)):
                raise ValueError(f"cu_seqlens_q: expected the first num_decodes={num_decodes} requests to have "
                                 f"q_len 1, got cu_seqlens_q[:{num_decodes + 1}]={cu.tolist()}")
        # Every kernel of the batch reads the guarded copy: int32, non-decreasing (flagged where not).
        cu32 = self._cu[:batch + 1]
        plan_launch.launch_guard_query_rows(cu_seqlens_q, cu32, self._errors)
        use_decode = num_decodes > 0
        decode_plan = None
        if use_decode:
            decode_plan = self.decode._plan_batch(
                seq_lens[:num_decodes], page_table[:num_decodes], cu32[:num_decodes + 1], decode_q_len, tree_mask,
                None if seq_lens_cpu is None else seq_lens_cpu[:num_decodes], guard_rows=False)
        elif tree_mask is not None:
            raise ValueError("tree_mask: expected None for a batch with no decode rows (num_decodes=0)")
        extend_plan = delegated = None
        req_begin = num_decodes if use_decode else 0
        if req_begin < batch and self.prefill_kernel is not None:
            rows = batch - req_begin
            bound = max_seq_len if max_seq_len is not None else page_table.shape[1] * self.page_size
            # Filled at the first run (``_guard_prefill_rows``), which knows q's rows and the cache's pages.
            delegated = DelegatedExtend(num_decode_tokens, self._cu_extend[:rows + 1], self._lens_extend[:rows],
                                        page_table[req_begin:], max(max_q_len, 1), bound)
        elif req_begin < batch:
            # Planned for one token at least, so a longer range is flagged, never skipped (as ``extend``).
            q_bound = max(max_q_len, 1)
            config = self._extend_config or extend_config(self.arch, self.head_dim, self.group_size, q_bound)
            extend_plan = plan_extend(cu32, seq_lens, page_table, page_size=self.page_size,
                                      group_size=self.group_size, max_q_len=q_bound, config=config,
                                      schedule=self.schedule, req_begin=req_begin, order=self._order,
                                      sorted_start=self._sorted_start)
        self._plan = self._plans.add(AttentionPlan(batch, num_decodes, num_decode_tokens, decode_plan, extend_plan,
                                                   delegated, seq_lens, page_table, cu32))
        self._audited_pages = None
        self._guarded = None
        return self._plan

    def _decode_tokens(self, num_decodes: int, decode_q_len, num_decode_tokens) -> int:
        """The decode rows' query tokens, checked against their count and decode_q_len (host ints)."""
        if isinstance(decode_q_len, bool) or not isinstance(decode_q_len, int):
            raise TypeError(f"decode_q_len: expected a host int, got {type(decode_q_len).__name__}")
        if num_decode_tokens is not None and (isinstance(num_decode_tokens, bool)
                                              or not isinstance(num_decode_tokens, int)):
            raise TypeError(f"num_decode_tokens: expected a host int, got {type(num_decode_tokens).__name__}")
        if not 1 <= decode_q_len <= self.max_decode_q_len:
            raise ValueError(f"decode_q_len: expected 1 to max_decode_q_len={self.max_decode_q_len}, "
                             f"got {decode_q_len}")
        if num_decode_tokens is None:
            if decode_q_len > 1 and num_decodes > 0:
                raise ValueError(f"num_decode_tokens: decode rows of up to decode_q_len={decode_q_len} tokens need "
                                 "their token count (cu_seqlens_q[num_decodes], a host int), got None")
            return num_decodes
        if not num_decodes <= num_decode_tokens <= num_decodes * decode_q_len:
            raise ValueError(f"num_decode_tokens: expected {num_decodes} to {num_decodes * decode_q_len} for "
                             f"num_decodes={num_decodes} rows of up to {decode_q_len} tokens, got {num_decode_tokens}")
        return num_decode_tokens

    def run(self, plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
            k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, out: torch.Tensor | None = None,
            sm_scale: float | None = None, sinks: torch.Tensor | None = None, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """Attention for the batch ``plan`` describes (this object's latest plan).

        q: [total_q, Hq, D] (dtype of this object; unit stride in D); rows [0,
            num_decode_tokens) are the decode rows'.
        k_cache, v_cache: as ``DecodeAttention.run`` takes them ([num_pages, page_size, Hkv, D],
            any strides but a unit stride in D, or [num_slots, Hkv, D]), of ``kv_dtype``.
        k_new, v_new: None or [total_q, Hkv, D], as ``evenkv.extend`` (used by the extend
            rows; decode rows always read the cache, which must then hold their token).
        out: optional [total_q, Hq, D]. sm_scale: this call's (a layer's) softmax scale,
            default the constructor's. sinks, k_scale, v_scale: as ``DecodeAttention.run``.
        Returns out; rows past cu_seqlens_q[-1] are not written.
        """
        self._plans.check(plan, AttentionPlan, self._plan)
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        check_tensor("q", q, shape=(None, hq, d), dtypes=(self.dtype,), device=self.device, last_dim_contiguous=True)
        total_q = q.shape[0]
        if total_q < plan.num_decode_tokens:
            raise ValueError(f"q: expected at least num_decode_tokens={plan.num_decode_tokens} rows, got {total_q}")
        check_kv_caches(k_cache, v_cache, page_size=self.page_size, dtypes=(self.kv_dtype,), device=self.device,
                        num_kv_heads=hkv, head_dim=d)
        k_cache, v_cache = decode_caches(k_cache, v_cache, self.page_size)
        check_new_tokens(k_new, v_new, total_q, hkv, d, self.dtype, self.device)
        if k_new is not None and plan.delegated is not None:
            raise ValueError(f"k_new, v_new: this batch's extend rows run on {self.prefill_kernel.name} (the engine's "
                             "prefill kernel), which reads the new tokens' K/V from the cache: write them there and "
                             "pass None")
        terms = self.decode.layer_terms(sm_scale, sinks, k_scale, v_scale)
        check_new_token_v_scale(terms.v_scale, self.dtype, self.kv_dtype, k_new is not None)
        out = output_like(q, out, (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)))
        if plan.batch_size == 0 or total_q == 0:
            return out
        ext = plan.extend
        if self.debug and ext is not None:
            check_lengths_on_host(ext.cu_seqlens_q, ext.seq_lens, max_q_len=ext.max_q_len, total_q=total_q,
                                  capacity=ext.page_table.shape[1] * self.page_size, req_begin=ext.req_begin,
                                  has_new=k_new is not None)
        if self.debug:
            # The engine's prefill kernel may load keys before a window (it masks them), so its rows'
            # pages are checked whole.
            q_lens = (plan.cu_seqlens_q[1:] - plan.cu_seqlens_q[:-1]).clamp(min=1)
            for rows, window in ((slice(0, plan.num_decodes), self.sliding_window),
                                 (slice(plan.num_decodes, None), None if plan.delegated else self.sliding_window)):
                check_pages(plan.page_table[rows], plan.seq_lens[rows], self.page_size, k_cache.shape[0], window,
                            q_lens[rows])
        if self._audited_pages != k_cache.shape[0]:  # once per plan and cache size
            plan_launch.launch_audit_pages(plan.seq_lens, plan.cu_seqlens_q, plan.page_table, self._errors,
                                           k_cache.shape[0], self.page_size, self._audit_grid, self.max_batch_size)
            self._audited_pages = k_cache.shape[0]
        if plan.decode is not None:
            self.decode.check_plan(plan.decode)  # planning on ``self.decode`` directly would overwrite it
            nd = plan.num_decode_tokens
            self.decode.run_unchecked(plan.decode, q[:nd], k_cache, v_cache, out[:nd], terms)
        if ext is not None:
            run_extend(ext, q, k_cache, v_cache, out, k_new=k_new, v_new=v_new, sm_scale=terms.sm_scale, causal=True,
                       sliding_window=self.sliding_window, logit_cap=self.logit_cap, sinks=terms.sinks,
                       k_scale=terms.k_scale, v_scale=terms.v_scale)
        if plan.delegated is not None:
            d = plan.delegated
            if self._guarded != (total_q, k_cache.shape[0]):
                self._guard_prefill_rows(plan, total_q, k_cache.shape[0])
            self.prefill_kernel(q[d.first_row:], k_cache, v_cache, out[d.first_row:], cu_seqlens_q=d.cu_seqlens_q,
                                seq_lens=d.seq_lens, page_table=d.page_table, max_q_len=d.max_q_len,
                                max_seq_len=d.max_seq_len, sm_scale=terms.sm_scale, sliding_window=self.sliding_window,
                                logit_cap=self.logit_cap, sinks=terms.sinks, k_scale=terms.k_scale,
                                v_scale=terms.v_scale)
        return out

    def _guard_prefill_rows(self, plan: AttentionPlan, total_q: int, num_pages: int) -> None:
        """Bound the extend rows the engine's prefill kernel takes (whose own kernels trust their
        batch data) as evenkv's kernels bound theirs, on the device: q rows inside q's
        ``total_q``, lengths raised to their q lengths, and a request whose length passes the page
        table or ``max_seq_len`` (the prefill's bound), or with a page id outside the cache's
        ``num_pages``, given no keys, each flagged in the
        error flag (``guard_prefill_rows_kernel``). The audit here checks every entry below a
        request's length, window or not: the prefill kernel may load keys before a window it
        then masks. Once per plan, q size and cache size."""
        d, begin = plan.delegated, plan.num_decodes
        rows = plan.batch_size - begin
        capacity = min(d.page_table.shape[1] * self.page_size, d.max_seq_len)
        lens_audit = self._lens_extend_audit[:rows]
        plan_launch.launch_guard_prefill_rows(
            plan.cu_seqlens_q[begin:], plan.seq_lens[begin:], d.cu_seqlens_q, d.seq_lens, lens_audit, self._errors,
            first_row=d.first_row, total_rows=total_q - d.first_row, max_q_len=d.max_q_len, capacity=capacity)
        plan_launch.launch_audit_pages(lens_audit, d.cu_seqlens_q, d.page_table, self._errors, num_pages,
                                       self.page_size, self._audit_grid, self.max_batch_size,
                                       bad_row_lens=d.seq_lens)
        self._guarded = (total_q, num_pages)


__all__ = ["Attention", "AttentionPlan", "PrefillKernel", "PREFILL_ENV", "engine_prefill_wanted"]
