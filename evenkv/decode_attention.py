"""Decode attention (rows of one query token, or of 1 + draft tokens for speculative
verify): ``DecodeAttention`` plans once per batch and runs once per layer; ``decode`` is
the one-shot helper.

CUDA-graph contract: ``plan`` and ``run`` launch GPU work only (no ``.item()``, no
``.cpu()``, no host sync, no allocation that depends on data), so both can be captured.
A plan records the addresses of ``seq_lens`` and ``page_table``; under graphs pass the
same persistent buffers each time and refill them in place. Host-side checks that need
data (lengths against the page table, page indices against the cache) run only when the
lengths are already on the host (``seq_lens_cpu=``) or in debug mode (``debug=True`` or
``EVENKV_DEBUG=1``), which syncs. Without them the kernels stay inside the caches anyway:
lengths are clamped to the page table, page ids outside the cache are never dereferenced,
and each such case sets the device's error flag (``evenkv.errors``).
"""

import dataclasses
from collections.abc import Sequence

import torch

from evenkv.kernels import decode_launch as launch
from evenkv.kernels import plan_launch
from evenkv.kernels.plan import ACTIVE_REQ_FIELDS
from evenkv.kernels.launching import compiled_kernel, parallel_compiles

from .checks import (FP8_KV_DTYPES, INDEX_DTYPES, SUPPORTED_DTYPES, PlanRecord, check_attention_layout,
                     check_batch_limits, check_batch_metadata, check_cache, check_fp8_capable, check_head_dim,
                     check_kv_caches, check_kv_scale, check_policy, check_positive_int, check_sinks, check_tensor,
                     decode_caches, normalize_logit_cap, normalize_window, output_like, resolve_device,
                     resolve_kv_dtype, resolve_sm_scale)
from .configs import (MANY_SEGMENTS_PER_CTA, DecodeConfig, debug_enabled, decode_config, env_flag, is_interpreter,
                      kv_head_pack, many_segments_config, max_tile_rows, resolve_arch, same_tile, sm_count)
from .errors import LENGTH_OUT_OF_RANGE, QUERY_OUT_OF_RANGE, error_flag
from .planning import (DETERMINISTIC_MAX_SPLITS, DETERMINISTIC_MIN_CHUNK_TOKENS, PLAN_SCALARS, DecodePlan,
                       StreamSchedule, UnitSchedule, decode_query_lens, deterministic_chunk_capacity,
                       fa3_unit_capacity, plan_fa3_units, visible_keys)

POLICIES = ("balanced", "fa3", "none")
# The most query tokens of one decode row (speculative verify: 1 + draft tokens); a tree mask
# holds one bit per new token in an int32.
MAX_DECODE_Q_LEN = 16
# Resident CTAs per (fake) SM under the interpreter.
INTERPRETER_CTAS_PER_SM = 2


class DecodeAttention:
    """Paged GQA decode attention with a load-balanced persistent schedule: rows of one query
    token (decode) or of up to ``max_q_len`` (speculative verify: 1 + draft tokens).

    Args:
        num_q_heads, num_kv_heads: Hq and Hkv (Hq a multiple of Hkv; G = Hq / Hkv).
        head_dim: D, one of 64, 80, 96, 128, 256.
        page_size: tokens per page (1 = SGLang's token pool; 16/32/64 = vLLM blocks), the one
            the caches and page tables were written with: a 4-D cache must show it, a 3-D one
            cannot, so nothing checks it there (another page size reads the wrong slots).
        dtype: torch.float16 or torch.bfloat16 (q and output; the caches too unless kv_dtype).
        device: the CUDA device every workspace lives on (or the CPU under the Triton
            interpreter, ``TRITON_INTERPRET=1``).
        max_batch_size: largest B that ``plan`` accepts; sizes the workspaces.
        max_pages_per_request: largest page-table width ``plan`` accepts.
        policy: ``"balanced"`` (default), ``"fa3"`` or ``"none"`` (``evenkv.planning``).
        sm_scale: default softmax scale of ``run``, 1/sqrt(D) if None.
        arch: ``"sm80"`` or ``"sm90"`` config table; default from the device (or EVENKV_ARCH).
        num_ctas: persistent grid size; default SM count x the resident CTAs per SM of the
            built decode kernel, set by ``warmup`` (or the first plan; until then, and in
            ``self.num_ctas``, the config's cap).
        config: a DecodeConfig replacing the arch table's (tuning and tests).
            Unless ``config`` or ``num_ctas`` is given, the balanced policy plans batches of
            many short segments with the table's second row and its own grid
            (``evenkv.configs.many_segments_config``; ``launch_config`` says which).
        deterministic: batch-invariant results (``balanced`` or ``none``): a request is cut
            into chunks by its own length only and its chunks are merged in a fixed order,
            with one kernel tile for every batch, so its output is bitwise the same whatever
            else is in the batch. Default: EVENKV_DETERMINISTIC.
        max_total_tokens: the most KV tokens a batch can hold (an engine's KV pool size);
            sizes deterministic mode's partial workspace (one [G x max_q_len, D] fp32 slot
            per 512 tokens and KV head, plus one per request). Default: 2**21.
        debug: validate lengths and page indices on the host before each launch (syncs).
        sliding_window: None or 0 (none), or W >= 1: a query at position p attends to keys
            [p - W + 1, p] (the extend convention, ``evenkv.extend``); the plan counts only
            those tokens' tiles, so time follows the window's bytes.
        logit_cap: None or 0 (none), or c > 0: scores s * sm_scale become c * tanh(s * sm_scale / c).
        kv_dtype: the caches' dtype: None (= dtype) or torch.float8_e4m3fn, dequantized in
            registers with the per-tensor ``k_scale`` / ``v_scale`` that ``run`` takes.
        max_q_len: the most query tokens one row can have, 1 to MAX_DECODE_Q_LEN (speculative
            verify: 1 + draft tokens); sizes the partial workspace. Every row reads each KV
            byte once for all its tokens.
        q_lens: the query-token counts plans will name (``plan``'s q_len), when the caller
            knows them (SGLang: 1 for decode batches, 1 + draft tokens for verify ones): only
            their q-length buckets and max_q_len's are built, and a plan of another count runs
            on the next larger built one. Default: every count up to max_q_len.
        tree_masks: rows of several query tokens carry tree masks (``plan``'s ``tree_mask``,
            required then; a chain ``(1 << (t + 1)) - 1`` gives causal rows), so only the
            tree-masked variants of their buckets are built. A tree token sits at the prefix's
            end plus its depth (its mask's bits less one), where a sliding window, which must
            then be at least max_q_len, starts from.
        pack_kv_heads: walk plain decode rows of head dim 64 over an FP8 cache as packs of two
            neighbouring KV heads, each pack one head of 128 columns, where
            ``evenkv.configs.kv_head_pack`` allows it (``self.head_pack``); ``config`` then names
            a row of the packed head dim (docs/tuning.md, "Two KV heads of 64 as one"). On by
            default; False walks each head alone.
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 device, max_batch_size: int, max_pages_per_request: int, policy: str = "balanced", *,
                 sm_scale: float | None = None, arch: str | None = None, num_ctas: int | None = None,
                 config: DecodeConfig | None = None, deterministic: bool | None = None,
                 max_total_tokens: int = 1 << 21, debug: bool | None = None, sliding_window: int | None = None,
                 logit_cap: float | None = None, kv_dtype: torch.dtype | None = None, max_q_len: int = 1,
                 q_lens: Sequence[int] | None = None, tree_masks: bool = False, pack_kv_heads: bool = True):
        check_attention_layout(num_q_heads, num_kv_heads, page_size, dtype, max_batch_size, max_pages_per_request)
        self.sliding_window = normalize_window(sliding_window)
        self.logit_cap = normalize_logit_cap(logit_cap)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, dtype)
        check_head_dim(head_dim)
        check_policy(policy, POLICIES)
        if num_ctas is not None:
            check_positive_int("num_ctas", num_ctas)
        check_positive_int("max_total_tokens", max_total_tokens)
        self.max_q_len = check_positive_int("max_q_len", max_q_len)
        self.q_lens = check_q_lens(q_lens, self.max_q_len)
        if not isinstance(tree_masks, bool):
            raise TypeError(f"tree_masks: expected bool, got {type(tree_masks).__name__}")
        if tree_masks and self.sliding_window is not None and self.sliding_window < self.max_q_len:
            raise ValueError(f"sliding_window: expected >= max_q_len={self.max_q_len} with tree_masks (a tree "
                             f"token's ancestors must lie in its window), got {self.sliding_window}")
        self.tree_masks = tree_masks
        self.max_total_tokens = max_total_tokens
        if config is not None and not isinstance(config, DecodeConfig):
            raise TypeError(f"config: expected DecodeConfig or None, got {type(config).__name__}")
        deterministic = env_flag("EVENKV_DETERMINISTIC", deterministic)
        if deterministic and policy == "fa3":
            raise ValueError("deterministic: expected policy 'balanced' or 'none', got 'fa3' (its splits depend "
                             "on the whole batch's work, so a request's result would depend on its neighbours)")
        # How the work is scheduled: a stream-K cost line, a queue of (request, split, head)
        # units, or one program per (request, head).
        self._kind = {"none": "direct", "fa3": "units"}.get(policy, "stream")
        self.deterministic = deterministic
        self.device = resolve_device(device)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group_size = num_q_heads // num_kv_heads
        self.page_size, self.dtype, self.policy = page_size, dtype, policy
        self.max_batch_size, self.max_pages_per_request = max_batch_size, max_pages_per_request
        self.sm_scale = resolve_sm_scale(sm_scale, head_dim)
        self.arch = resolve_arch(arch, self.device)
        check_max_q_len(max_q_len, self.group_size, head_dim, self.arch)
        self._fp8 = self.kv_dtype in FP8_KV_DTYPES
        if not isinstance(pack_kv_heads, bool):
            raise TypeError(f"pack_kv_heads: expected bool, got {type(pack_kv_heads).__name__}")
        # The geometry the kernels walk: packs of head_pack KV heads (``QueryRows.head_pack``).
        self.head_pack = kv_head_pack(self.arch, num_q_heads, num_kv_heads, head_dim, self.max_q_len,
                                      deterministic, self._fp8) if pack_kv_heads else 1
        self._walk_kv_heads = num_kv_heads // self.head_pack
        self._walk_group = self.group_size * self.head_pack
        self._walk_head_dim = head_dim * self.head_pack
        self._forced_config = config
        self.config = config if config is not None else decode_config(self.arch, self._walk_head_dim, page_size,
                                                                      self._fp8)
        self.debug = debug_enabled(debug)
        self._on_gpu = self.device.type == "cuda" and not is_interpreter()
        check_fp8_capable(self.kv_dtype, self.device)
        self.num_sms = sm_count(self.device)
        # Programmatic dependent launch of the merge: where a config asks for it and the GPU has it (sm90+).
        self._pdl_capable = self._on_gpu and torch.cuda.get_device_capability(self.device)[0] >= 9
        self._plan: DecodePlan | None = None
        self._plans = PlanRecord("DecodeAttention")
        i32 = dict(dtype=torch.int32, device=self.device)
        self._plan_seq_lens = torch.zeros(max_batch_size, **i32)
        # Plain decode rows: request b's query is q row b (the plan's cu_seqlens when none is given).
        self._row_per_request = torch.arange(max_batch_size + 1, **i32)
        # A caller's cu_seqlens_q as the kernels read it (``plan_launch.launch_guard_query_rows``).
        self._guarded_rows = torch.zeros(max_batch_size + 1, **i32)
        self._no_tree = torch.zeros(1, **i32)
        self._errors = error_flag(self.device)
        self._audited_pages = None  # the cache size the latest plan's page ids were audited against
        self.warmed_up = False  # set by warmup()
        # Each q-length bucket's (config, grid) and, where the table has one, its many-segments
        # row and grid for batches of many short segments (see launch_config).
        self._slot_rows = self._walk_group * self.max_q_len
        self._variants = {}
        # Deterministic mode runs every batch on one q-length variant, that of the longest rows:
        # its tile (rows, block_n, warps) sets the arithmetic. The chunks do not depend on the
        # grid, so the many-segments row, which differs only in CTAs, stages, registers and
        # walk, keeps the same bits where its tile is the main row's.
        buckets = [q_len_bucket(self.max_q_len)] if deterministic else sorted(
            {q_len_bucket(n) for n in self.q_lens + (self.max_q_len,)})
        configs = [self._bucket_config(bucket) for bucket in buckets]
        many_configs = [None] * len(buckets)
        if self._kind == "stream" and self._forced_config is None and num_ctas is None:
            many_configs = [self._many_segments_config(bucket, config, deterministic)
                            for bucket, config in zip(buckets, configs)]
        # (bucket, main row, many-segments row or None) per q-length bucket, and the rows whose
        # decode kernel sets a grid: the main rows, then the many-segments rows.
        self._rows = list(zip(buckets, configs, many_configs))
        self._probes = [(config, self._probe_query(bucket)) for bucket, config, _ in self._rows]
        self._probes += [(many, self._probe_query(bucket)) for bucket, _, many in self._rows if many is not None]
        # A variant's persistent grid is SMs x the resident CTAs per SM of its decode kernel,
        # known once the kernel is built. Until warmup (or the first plan) builds it, each grid
        # is its config's cap, which also sizes the buffers: the built kernel's grid is never
        # larger. So a start-up builds every kernel in one batch, not the decode kernels first.
        if num_ctas is not None:
            grids = [num_ctas] * len(self._probes)
        elif not self._on_gpu:
            grids = [self.num_sms * INTERPRETER_CTAS_PER_SM] * len(self._probes)
        else:
            grids = [self.num_sms * config.max_ctas_per_sm for config, _ in self._probes]
        self._grids_resolved = num_ctas is not None or not self._on_gpu
        self._max_ctas = max(grids)
        self._schedule = self._allocate_schedule()
        self._set_grids(grids)
        self._merge_units_grid = self.num_sms * launch.MERGE_UNITS_CTAS_PER_SM
        # The most splits (chunks) of a request merge_units_kernel merges in items of all its
        # head-dim columns; the planners list requests of more apart.
        self._whole_merge_splits = launch.merge_units_constants(self._walk_kv_heads, self._walk_group,
                                                                self._walk_head_dim, self._query(1))["WHOLE_P"]
        slots = self._partial_slots()
        self._o_part = torch.empty(slots * self._slot_rows * self._walk_head_dim, dtype=torch.float32,
                                   device=self.device)
        self._lse_part = torch.empty(slots * self._slot_rows, dtype=torch.float32, device=self.device)

    # -- workspaces and variants ---------------------------------------------------

    def _query(self, bucket: int, tree: bool = False) -> launch.QueryRows:
        return launch.QueryRows(bucket, self._slot_rows, tree, self.head_pack)

    def _probe_query(self, bucket: int) -> launch.QueryRows:
        """The rows of the bucket's kernel that sets its grid: tree-masked where the object's
        rows of several tokens carry tree masks (the variant those batches launch)."""
        return self._query(bucket, self.tree_masks and bucket > 1)

    def _set_grids(self, grids: list[int]) -> None:
        """Give each variant its persistent grid: ``grids`` [len(self._probes)], the main rows'
        in bucket order, then the many-segments rows'."""
        many_grids = iter(grids[len(self._rows):])
        self._grids = list(grids)
        self._variants = {bucket: (config, grid, None if many is None else (many, next(many_grids)))
                          for (bucket, config, many), grid in zip(self._rows, grids)}
        self.num_ctas = grids[0]
        if self._schedule is not None:
            self._schedule = dataclasses.replace(self._schedule, num_ctas=self.num_ctas)
        # The stream plan's view of the shared buffers for each grid, made once (plan is a hot path).
        self._grid_schedules = {c: dataclasses.replace(self._schedule, num_ctas=c)
                                for c in set(grids)} if self._kind == "stream" else {}

    def _resolve_grids(self, kernels: list | None = None) -> bool:
        """Set each variant's grid from its built decode kernel: SMs x its resident CTAs per SM,
        at most its config's cap. kernels: [len(self._probes)] as ``_compile`` returned them
        (possibly held builds), or None to build them here for a one-page layout. Once per
        object; returns whether a grid changed."""
        if self._grids_resolved:
            return False
        if kernels is None:
            t = self._dummy_inputs()
            with parallel_compiles():
                kernels = [self._compile(config, t, query) for config, query in self._probes]
        grids = [self.num_sms * min(launch.resident_ctas_per_sm(compiled_kernel(kernel), self.device),
                                    config.max_ctas_per_sm) for kernel, (config, _) in zip(kernels, self._probes)]
        self._grids_resolved = True
        if grids == self._grids:
            return False
        self._set_grids(grids)
        return True

    def _bucket_config(self, bucket: int) -> DecodeConfig:
        """The config of rows of up to ``bucket`` query tokens: the table's decode row for plain
        decode, its verify row for their tile rows else (or the config given)."""
        if self._forced_config is not None or bucket == 1:
            return self.config
        return decode_config(self.arch, self.head_dim, self.page_size, self._fp8,
                             rows=launch.tile_rows(self.group_size, bucket))

    def _many_segments_config(self, bucket: int, config: DecodeConfig, deterministic: bool) -> DecodeConfig | None:
        """The many-segments row of a q-length bucket whose main row is ``config``, or None
        (none in the table, or, in deterministic mode, one of another tile)."""
        rows = launch.tile_rows(self.group_size, bucket) if bucket > 1 else None
        many = many_segments_config(self.arch, self._walk_head_dim, self.page_size, self._fp8, rows)
        return None if many is None or (deterministic and not same_tile(many, config)) else many

    def _allocate_schedule(self):
        i32 = dict(dtype=torch.int32, device=self.device)
        b = self.max_batch_size
        if self._kind == "stream":
            # Arrival counters of the in-kernel merge; each is back at 0 when a launch ends.
            self._merge_counters = torch.zeros(self._max_ctas, **i32)
            return StreamSchedule(torch.zeros(b, ACTIVE_REQ_FIELDS.value, **i32), torch.zeros(self._max_ctas, 4, **i32),
                                  torch.zeros(self._max_ctas + 1, **i32), torch.zeros(PLAN_SCALARS, **i32),
                                  torch.zeros(b, **i32), torch.zeros(b, **i32), torch.zeros(b, **i32),
                                  torch.zeros(2, **i32), self._max_ctas)
        if self._kind == "units":
            units = fa3_unit_capacity(b, self.num_sms)
            # queue [2] int32: next unit, CTAs done; the kernel's last CTA resets both to 0.
            self._queue = torch.zeros(2, **i32)
            return UnitSchedule(torch.zeros(units, **i32), torch.zeros(units, **i32), torch.zeros(b, **i32),
                                torch.zeros(b, **i32), torch.zeros(b, **i32), torch.zeros(1, **i32),
                                torch.zeros(b + 1, **i32), torch.zeros(2, **i32), self._max_ctas)
        return None

    def _partial_slots(self) -> int:
        """Partial (O, LSE) slots: two per CTA for the stream (its first and last segment
        may be cut; for the largest of its grids), or one per chunk and KV head in
        deterministic mode; one per (split, head) unit for the unit queue, none for direct."""
        if self._kind == "stream" and self.deterministic:
            return self._chunking()[2] * self._walk_kv_heads
        if self._kind == "stream":
            return 2 * self._max_ctas
        if self._kind == "units":
            return self._schedule.unit_req.shape[0] * self._walk_kv_heads
        return 0

    def _chunking(self, config: DecodeConfig | None = None) -> tuple[int, int, int, int]:
        """Deterministic mode's (min chunk tiles, most chunks of a request, chunk capacity, most
        chunks the merge takes whole)."""
        block_n = (config or self.config).block_n
        return (-(-DETERMINISTIC_MIN_CHUNK_TOKENS // block_n), DETERMINISTIC_MAX_SPLITS,
                deterministic_chunk_capacity(self.max_batch_size, self.max_total_tokens), self._whole_merge_splits)

    def _use_pdl(self, config: DecodeConfig) -> bool:
        return config.programmatic_launch and self._pdl_capable

    def launch_config(self, batch_size: int, q_len: int = 1) -> tuple[DecodeConfig, int]:
        """(config, persistent grid) that ``plan`` uses for a batch of ``batch_size`` requests of
        up to ``q_len`` query tokens: the q-length bucket's many-segments row where it has one
        and the batch has at least MANY_SEGMENTS_PER_CTA (request, KV head) segments per CTA of
        the main grid; else the bucket's row. Before ``warmup``, the first call builds the decode
        kernels that set the grids."""
        self._resolve_grids()
        config, grid, many = self._variants[self._bucket(q_len)]
        if many is not None and batch_size * self._walk_kv_heads >= MANY_SEGMENTS_PER_CTA * grid:
            return many
        return config, grid

    def _bucket(self, q_len: int) -> int:
        """The q-length bucket (kernel variant) of rows of up to q_len query tokens; the one
        variant in deterministic mode."""
        if self.deterministic:
            return next(iter(self._variants))
        return next(bucket for bucket in self._variants if bucket >= q_len)

    def _dummy_inputs(self) -> dict:
        """Tensors shaped like a one-request batch: q [1, Hq, D], caches of one token-major page
        [1, page_size, Hkv, D] as the launchers take them (``checks.as_pages``)."""
        dev, d = self.device, self.head_dim
        cache = torch.zeros(1, self.page_size, self.num_kv_heads, d, dtype=self.kv_dtype, device=dev)
        q = torch.zeros(1, self.num_q_heads, d, dtype=self.dtype, device=dev)
        return dict(q=q, k_cache=cache, v_cache=cache, out=torch.empty_like(q),
                    page_table=torch.zeros(1, 1, dtype=torch.int32, device=dev))

    def _terms(self, sm_scale: float, sinks: torch.Tensor | None = None, k_scale: float = 1.0,
               v_scale: float = 1.0) -> launch.LayerTerms:
        return launch.LayerTerms(sm_scale, self.logit_cap, self.sliding_window or 0, sinks, k_scale, v_scale)

    def _compile(self, config: DecodeConfig, t: dict, query: launch.QueryRows, merge: bool = False):
        """Compile (without launching) this policy's decode kernel for ``config`` and ``query``'s
        rows on tensors laid out like ``t``'s (with sinks iff ``t["sinks"]`` is a tensor), and
        with ``merge`` its merge kernel; returns the compiled decode kernel."""
        terms = self._terms(1.0, t.get("sinks"))
        i32 = dict(dtype=torch.int32, device=self.device)
        lens = torch.zeros(1, **i32)
        scratch = torch.empty(1, dtype=torch.float32, device=self.device)
        if self._kind == "stream":
            pdl = self._use_pdl(config)
            # Any int32 buffers: a compile reads only their dtypes and alignment.
            schedule = StreamSchedule(*[lens] * 8, num_ctas=1)
            if merge and self.deterministic:
                launch.launch_merge_units(scratch, scratch, t["out"], lens, lens, lens, lens, lens, lens, terms.sinks,
                                          query, self._walk_kv_heads, 1, 0, pdl, warmup=True)
            elif merge:
                launch.launch_merge_stream(scratch, scratch, t["out"], schedule, terms, query, self._walk_kv_heads,
                                           config, pdl, warmup=True)
            return launch.launch_decode_stream(t["q"], t["k_cache"], t["v_cache"], t["out"], scratch, scratch, lens,
                                               lens, lens, lens, t["page_table"], schedule, self._errors, terms, query,
                                               self.page_size, config, pdl, self.deterministic, warmup=True)
        if merge and self._kind == "units":
            launch.launch_merge_units(scratch, scratch, t["out"], lens, lens, lens, lens, lens, lens, terms.sinks,
                                      query, self._walk_kv_heads, 1, 0, warmup=True)
        return launch.launch_decode_units(t["q"], t["k_cache"], t["v_cache"], t["out"], scratch, scratch, lens, lens,
                                          lens, t["page_table"], lens, lens, lens, lens, lens, torch.zeros(2, **i32),
                                          self._errors, terms, query, 1, self._kind == "units", self.page_size, config,
                                          warmup=True)

    def _compile_plans(self, page_table: torch.Tensor, index_dtypes: tuple) -> None:
        """Compile the query-row guard, the page-audit kernel and (stream) every variant's plan
        kernel, for each batch-size bucket and length dtype in ``index_dtypes``, at the variants'
        current grids. page_table: [1, 1] int32."""
        plans = [(config, grid, bucket > 1) for bucket, (config, grid, _) in self._variants.items()]
        plans += [(many[0], many[1], bucket > 1) for bucket, (_, _, many) in self._variants.items() if many]
        plan_launch.launch_guard_query_rows(self._row_per_request, self._guarded_rows, self._errors, warmup=True)
        for block_b in plan_launch.plan_block_buckets(self.max_batch_size):
            for dtype in index_dtypes:
                lens = torch.zeros(block_b, dtype=dtype, device=self.device)
                plan_launch.launch_audit_pages(lens, self._row_per_request, page_table, self._errors, 1,
                                               self.page_size, self.num_sms, self.max_batch_size,
                                               self.sliding_window or 0, warmup=True)
                for config, ctas, multi_q in plans if self._kind == "stream" else []:
                    plan_launch.launch_plan_stream(
                        lens, self._row_per_request, self._plan_seq_lens, self._grid_schedules[ctas], self._errors, 1,
                        self.sliding_window or 0, 1, multi_q, self.num_sms, self._walk_kv_heads, config.block_n,
                        self.max_batch_size, self.num_ctas, self._chunking(config) if self.deterministic else None,
                        warmup=True)

    def warmup(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
               out: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
               index_dtypes: tuple = INDEX_DTYPES) -> None:
        """Compile, without running anything, every kernel variant ``plan`` and ``run`` can launch
        for tensors laid out like these (dtypes, strides, alignment; any batch size): each
        built q-length bucket's and each config's decode and merge kernels (tree-masked for
        rows of several tokens on an object with tree_masks), and the plan and page-audit
        kernels for every batch-size bucket and each length dtype in ``index_dtypes``.
        Per-batch integers never specialize a kernel, so after this no batch compiles one.
        Engines call it at start-up.

        q: [*, Hq, D]; k_cache, v_cache: as ``run`` takes them; out: [*, Hq, D] (default: like q);
        sinks: the [Hq] sinks ``run`` will take, or None.
        Under the Triton interpreter nothing is compiled (the launches are no-ops).
        """
        self.check_warmup_tensors(q, k_cache, v_cache, out, sinks, index_dtypes)
        k_pages, v_pages = decode_caches(k_cache, v_cache, self.page_size)
        t = dict(q=q, k_cache=k_pages, v_cache=v_pages,
                 out=out if out is not None else q, sinks=sinks,
                 page_table=torch.zeros(1, 1, dtype=torch.int32, device=self.device))
        # Every count a plan may name lands in some bucket; rows of several tokens carry tree
        # masks where the object takes them.
        counts = range(1, self.max_q_len + 1)
        kernels = {}  # (config, query rows) -> its decode kernel, as _compile returned it
        with parallel_compiles():
            for bucket, (config, _, many) in self._variants.items():
                for row_config in [config] + ([many[0]] if many is not None else []):
                    for tree in sorted({self.tree_masks and n > 1 for n in counts if self._bucket(n) == bucket}):
                        query = self._query(bucket, tree)
                        kernels[row_config, query] = self._compile(row_config, t, query, merge=True)
            self._compile_plans(t["page_table"], index_dtypes)
        # Inside an enclosing parallel_compiles (Attention.warmup) the builds are still held:
        # asking for the grids' kernels runs every held build, in one batch.
        if self._resolve_grids([kernels[probe] for probe in self._probes]):
            with parallel_compiles():  # the plan kernels were built for the caps' grids
                self._compile_plans(t["page_table"], index_dtypes)
        self.warmed_up = True

    def check_warmup_tensors(self, q, k_cache, v_cache, out, sinks, index_dtypes) -> None:
        """``warmup``'s arguments, checked as ``run`` checks its own (any number of q rows)."""
        hq, d = self.num_q_heads, self.head_dim
        check_tensor("q", q, shape=(None, hq, d), dtypes=(self.dtype,), device=self.device, last_dim_contiguous=True)
        check_kv_caches(k_cache, v_cache, page_size=self.page_size, dtypes=(self.kv_dtype,), device=self.device,
                        num_kv_heads=self.num_kv_heads, head_dim=d)
        if out is not None:
            check_tensor("out", out, shape=(None, hq, d), dtypes=(self.dtype,), device=self.device,
                         last_dim_contiguous=True)
        check_sinks(sinks, hq, self.device)
        if not isinstance(index_dtypes, tuple) or not index_dtypes or any(t not in INDEX_DTYPES for t in index_dtypes):
            raise TypeError(f"index_dtypes: expected a non-empty tuple of {INDEX_DTYPES}, got {index_dtypes!r}")

    # -- plan -------------------------------------------------------------------

    def plan(self, seq_lens: torch.Tensor, page_table: torch.Tensor, *, cu_seqlens_q: torch.Tensor | None = None,
             q_len: int = 1, tree_mask: torch.Tensor | None = None,
             seq_lens_cpu: torch.Tensor | None = None) -> DecodePlan:
        """Plan one batch. The returned plan is what ``run`` takes; it stays valid until
        this object plans again (its schedule lives in this object's buffers).

        seq_lens: [B] int32/int64 on this device, KV tokens of each request including its
            query tokens (0 = padding row).
        page_table: [B, max_pages] int32 on this device, unit stride in the last dim; page ids.
        cu_seqlens_q: [B + 1] int32 on this device: request b's query tokens are q rows
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1; default (plain decode) q row b. Query
            token t of request b sits at position seq_len - q_len + t and sees the keys up to
            it (causal among the request's new tokens). A malformed range (q_len past
            ``q_len``, a q_len above 1 for plain decode rows, a range going back before an
            earlier request's end) is flagged on the device (``evenkv.check_errors``) and never
            run as something else; no request's rows are another's.
        q_len: host int, the most query tokens of one request (1 to this object's max_q_len):
            picks the kernel variant, the smallest built q-length bucket that holds it.
        tree_mask: [>= cu_seqlens_q[B]] int32 on this device exactly when q_len > 1 and the
            object has ``tree_masks=True``, else None: bit j of tree_mask[i] says whether query
            row i sees its request's new token j (the prefix is always seen); bit t of token t
            must be set.
        seq_lens_cpu: optional host copy of seq_lens; if given, lengths are checked against
            the page table with no sync.
        """
        return self._plan_batch(seq_lens, page_table, cu_seqlens_q, q_len, tree_mask, seq_lens_cpu, guard_rows=True)

    def _plan_batch(self, seq_lens, page_table, cu_seqlens_q, q_len, tree_mask, seq_lens_cpu,
                    guard_rows: bool) -> DecodePlan:
        """``plan``; with guard_rows False a given cu_seqlens_q is already non-decreasing
        (``Attention``'s guarded copy) and is read as it is."""
        batch = check_batch_metadata(seq_lens, page_table, self.device)
        check_batch_limits(batch, page_table, self.max_batch_size, self.max_pages_per_request)
        check_positive_int("q_len", q_len)
        if q_len > self.max_q_len:
            raise ValueError(f"q_len: expected at most this object's max_q_len={self.max_q_len}, got {q_len}")
        if cu_seqlens_q is None:
            if q_len > 1:
                raise ValueError(f"cu_seqlens_q: rows of up to q_len={q_len} query tokens need cu_seqlens_q "
                                 f"[B + 1] int32, got None")
            cu_seqlens_q = self._row_per_request[:batch + 1]
        else:
            check_tensor("cu_seqlens_q", cu_seqlens_q, shape=(batch + 1,), dtypes=(torch.int32,), device=self.device,
                         contiguous=True)
            if guard_rows:
                guarded = self._guarded_rows[:batch + 1]
                plan_launch.launch_guard_query_rows(cu_seqlens_q, guarded, self._errors)
                cu_seqlens_q = guarded
        tree = tree_mask is not None
        if tree != (self.tree_masks and q_len > 1):
            expected = "[>= total_q] int32 (this object has tree_masks=True)" if not tree else "None"
            raise ValueError(f"tree_mask: expected {expected} for rows of q_len={q_len}, got "
                             f"{'None' if not tree else 'a tensor'} (tree masks go with tree_masks=True and rows "
                             f"of several query tokens)")
        if tree:
            check_tensor("tree_mask", tree_mask, shape=(None,), dtypes=(torch.int32,), device=self.device,
                         contiguous=True)
        capacity = page_table.shape[1] * self.page_size
        if seq_lens_cpu is not None:
            check_tensor("seq_lens_cpu", seq_lens_cpu, shape=(batch,), dtypes=INDEX_DTYPES, device=torch.device("cpu"))
            check_lengths(seq_lens_cpu, capacity)
        elif self.debug:
            check_lengths(seq_lens.cpu(), capacity)
        plan_seq_lens = self._plan_seq_lens[:batch]
        config, ctas = self.launch_config(batch, q_len)
        schedule = self._schedule
        bucket = self._bucket(q_len)
        if batch > 0 and self._kind == "stream":
            schedule = self._grid_schedules[ctas]
            plan_launch.launch_plan_stream(seq_lens, cu_seqlens_q, plan_seq_lens, schedule, self._errors, capacity,
                                           self.sliding_window or 0, q_len, bucket > 1, self.num_sms,
                                           self._walk_kv_heads, config.block_n, self.max_batch_size, self.num_ctas,
                                           self._chunking(config) if self.deterministic else None)
        elif batch > 0:
            plan_seq_lens.copy_(seq_lens.clamp(0, capacity))
            clamped = ((seq_lens < 0) | (seq_lens > capacity)).any()
            self._errors.bitwise_or_(clamped.to(torch.int32) * LENGTH_OUT_OF_RANGE)
            q_lens, malformed = decode_query_lens(cu_seqlens_q, plan_seq_lens, q_len, bucket > 1,
                                                  self._row_per_request)
            self._errors.bitwise_or_(malformed.any().to(torch.int32) * QUERY_OUT_OF_RANGE)
            if self._kind == "units":
                # The units are split by the tiles each row reads (a window's, ``row_window``).
                plan_fa3_units(visible_keys(plan_seq_lens, q_lens, self.sliding_window), self._schedule,
                               block_n=config.block_n, num_kv_heads=self._walk_kv_heads, num_sms=self.num_sms,
                               whole_splits=self._whole_merge_splits)
        query = self._query(bucket, tree)
        self._plan = self._plans.add(DecodePlan(batch, plan_seq_lens, page_table, schedule, config, cu_seqlens_q,
                                                tree_mask if tree else self._no_tree, query, q_len))
        self._audited_pages = None
        return self._plan

    # -- run --------------------------------------------------------------------

    def run(self, plan: DecodePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
            out: torch.Tensor | None = None, sm_scale: float | None = None, sinks: torch.Tensor | None = None,
            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Decode attention for the batch ``plan`` describes (the last one planned).

        q: [B, Hq, D] for plain decode rows, [total_q, Hq, D] for rows of several query tokens
            (the rows cu_seqlens_q names; dtype of this object; unit stride in D).
        k_cache, v_cache: [num_pages, page_size, Hkv, D] of ``kv_dtype`` with any strides but a
            unit stride in D (NHD or HND pages alike; an FP8 cache's strides even), or
            [num_slots, Hkv, D] (slot = page * page_size + offset).
        out: optional output shaped like q (dtype of q).
        sm_scale: softmax scale of this call (a layer's); default the constructor's.
        sinks: None or [Hq] float32/bfloat16/float16 sink logits (gpt-oss): head h's softmax
            denominator gains exp(sinks[h]) (natural log, not scaled by sm_scale).
        k_scale, v_scale: an FP8 cache's per-tensor dequantization scales (host floats; real =
            stored * scale); 1.0 for a cache in q's dtype.
        Returns out; rows of requests with seq_len 0 are zeros; q rows in no request are not written.
        """
        self.check_plan(plan)
        b, hq, hkv, d = plan.batch_size, self.num_q_heads, self.num_kv_heads, self.head_dim
        rows = b if plan.query.max_q_len == 1 else None
        check_tensor("q", q, shape=(rows, hq, d), dtypes=(self.dtype,), device=self.device, last_dim_contiguous=True)
        check_kv_caches(k_cache, v_cache, page_size=self.page_size, dtypes=(self.kv_dtype,), device=self.device,
                        num_kv_heads=hkv, head_dim=d)
        k_cache, v_cache = decode_caches(k_cache, v_cache, self.page_size)
        terms = self.layer_terms(sm_scale, sinks, k_scale, v_scale)
        if plan.tree_mask is not self._no_tree and plan.tree_mask.shape[0] < q.shape[0]:
            raise ValueError(f"tree_mask: expected an entry for each of q's {q.shape[0]} rows, got shape "
                             f"{tuple(plan.tree_mask.shape)}")
        out = output_like(q, out, (("k_cache", k_cache), ("v_cache", v_cache)))
        if b == 0 or q.shape[0] == 0:
            return out
        if self.debug:
            cu = plan.cu_seqlens_q
            check_pages(plan.page_table, plan.seq_lens, self.page_size, k_cache.shape[0], self.sliding_window,
                        (cu[1:] - cu[:-1]).clamp(min=1))
        if self._audited_pages != k_cache.shape[0]:
            self.audit_pages(plan, k_cache.shape[0])
        return self.run_unchecked(plan, q, k_cache, v_cache, out, terms)

    def layer_terms(self, sm_scale: float | None, sinks: torch.Tensor | None, k_scale: float,
                    v_scale: float) -> launch.LayerTerms:
        """``run``'s per-call arguments, checked, as the launchers take them."""
        scale = self.sm_scale if sm_scale is None else resolve_sm_scale(sm_scale, self.head_dim)
        sinks = check_sinks(sinks, self.num_q_heads, self.device)
        k_scale, v_scale = check_kv_scale("k_scale", k_scale), check_kv_scale("v_scale", v_scale)
        if self.kv_dtype not in FP8_KV_DTYPES and (k_scale, v_scale) != (1.0, 1.0):
            raise ValueError(f"k_scale, v_scale: a {self.kv_dtype} cache holds real values, so both scales must be "
                             f"1.0; got {k_scale} and {v_scale} (scales belong to an FP8 cache: kv_dtype="
                             f"{FP8_KV_DTYPES[0]})")
        return self._terms(scale, sinks, k_scale, v_scale)

    def audit_pages(self, plan: DecodePlan, num_pages: int) -> None:
        """Once per plan and cache size (``run``): flag used page ids outside a cache of
        ``num_pages`` pages in the error flag (the kernels never dereference them)."""
        plan_launch.launch_audit_pages(plan.seq_lens, plan.cu_seqlens_q, plan.page_table, self._errors,
                                       num_pages, self.page_size, self.num_sms, self.max_batch_size,
                                       self.sliding_window or 0)
        self._audited_pages = num_pages

    def run_unchecked(self, plan: DecodePlan, q, k_cache, v_cache, out, terms: launch.LayerTerms) -> torch.Tensor:
        """``run`` after its checks and the page audit (``evenkv.Attention`` calls this)."""
        hkv = self._walk_kv_heads
        s, query, cu, tree = plan.schedule, plan.query, plan.cu_seqlens_q, plan.tree_mask
        errors = self._errors
        if self._kind == "stream":
            pdl = self._use_pdl(plan.config)
            launch.launch_decode_stream(q, k_cache, v_cache, out, self._o_part, self._lse_part, self._merge_counters,
                                        plan.seq_lens, cu, tree, plan.page_table, s, errors, terms, query,
                                        self.page_size, plan.config, pdl, self.deterministic)
            if self.deterministic:
                launch.launch_merge_units(self._o_part, self._lse_part, out, plan.seq_lens, cu, s.req_chunks,
                                          s.req_chunk_base, s.merge_list, s.merge_count, terms.sinks, query, hkv,
                                          self._merge_units_grid, self.max_batch_size - 1, pdl)
            else:
                launch.launch_merge_stream(self._o_part, self._lse_part, out, s, terms, query, hkv, plan.config, pdl)
        elif self._kind == "units":
            launch.launch_decode_units(q, k_cache, v_cache, out, self._o_part, self._lse_part, plan.seq_lens, cu,
                                       tree, plan.page_table, s.unit_req, s.unit_split, s.req_splits,
                                       s.req_tiles_per_split, s.num_units, self._queue, errors, terms, query,
                                       s.num_ctas, True, self.page_size, plan.config)
            launch.launch_merge_units(self._o_part, self._lse_part, out, plan.seq_lens, cu, s.req_splits,
                                      s.req_split_base, s.merge_list, s.merge_count, terms.sinks, query, hkv,
                                      self._merge_units_grid, self.max_batch_size - 1)
        else:
            # One program per (request, head): the unit-queue arguments are unused, pass any int32 tensor.
            lens = plan.seq_lens
            launch.launch_decode_units(q, k_cache, v_cache, out, self._o_part, self._lse_part, lens, cu, tree,
                                       plan.page_table, lens, lens, lens, lens, lens, lens, errors, terms, query,
                                       plan.batch_size * hkv, False, self.page_size, plan.config)
        return out

    def check_plan(self, plan) -> None:
        """``plan`` must be this object's latest plan: older plans' schedules are overwritten."""
        self._plans.check(plan, DecodePlan, self._plan)


def check_max_q_len(max_q_len: int, group_size: int, head_dim: int, arch: str, name: str = "max_q_len") -> None:
    """Raise ValueError unless decode rows of up to ``max_q_len`` query tokens (1 + draft tokens)
    fit the decode kernels: at most MAX_DECODE_Q_LEN, and G x max_q_len tile rows within what a
    ``head_dim`` tile takes on ``arch`` (``configs.max_tile_rows``); ``name``: the caller's
    argument."""
    if max_q_len > MAX_DECODE_Q_LEN:
        raise ValueError(f"{name}: expected 1 to {MAX_DECODE_Q_LEN} query tokens per row, got {max_q_len}")
    rows, most = launch.tile_rows(group_size, max_q_len), max_tile_rows(arch, head_dim)
    if max_q_len > 1 and rows > most:
        raise ValueError(f"{name}: {max_q_len} query tokens x G={group_size} heads make {rows} tile rows, "
                         f"past the {most} a head dim {head_dim} tile takes: use {name} <= "
                         f"{max(1, most // group_size)}")


def check_q_lens(q_lens, max_q_len: int) -> tuple[int, ...]:
    """The distinct query-token counts of ``q_lens`` (a non-empty sequence of ints in 1 ..
    max_q_len), ascending; every count up to max_q_len for None."""
    if q_lens is None:
        return tuple(range(1, max_q_len + 1))
    if isinstance(q_lens, (str, bytes)) or not isinstance(q_lens, Sequence) or not q_lens or any(
            isinstance(n, bool) or not isinstance(n, int) for n in q_lens):
        raise TypeError(f"q_lens: expected a non-empty sequence of ints, got {q_lens!r}")
    if not all(1 <= n <= max_q_len for n in q_lens):
        raise ValueError(f"q_lens: expected query-token counts in 1..max_q_len={max_q_len}, got {list(q_lens)}")
    return tuple(sorted(set(q_lens)))


def q_len_bucket(q_len: int) -> int:
    """The bucket of rows of up to q_len query tokens: q_len rounded up to a power of two."""
    return 1 << (q_len - 1).bit_length()


def check_lengths(seq_lens_cpu: torch.Tensor, capacity: int) -> None:
    """Host lengths [B] must lie in [0, capacity] (the page table's reach)."""
    if seq_lens_cpu.numel() == 0:
        return
    lo, hi = int(seq_lens_cpu.min()), int(seq_lens_cpu.max())
    if lo < 0:
        raise ValueError(f"seq_lens: expected lengths >= 0, got {lo}")
    if hi > capacity:
        raise ValueError(f"seq_lens: expected lengths <= page_table capacity {capacity} "
                         f"(max_pages x page_size), got {hi}")


def check_pages(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_pages: int,
                sliding_window: int | None = None, q_lens: torch.Tensor | None = None) -> None:
    """Debug (syncs): every page a request reads ([B, max_pages] table, [B] clamped lengths;
    with a window W only the tokens its first query row sees, from seq_len - q_len + 1 - W for
    [B] ``q_lens``, default 1) must lie inside a cache of ``num_pages`` pages."""
    entry = torch.arange(page_table.shape[1], device=page_table.device)[None, :]
    if sliding_window:
        first_tok = (seq_lens - sliding_window + (0 if q_lens is None else 1 - q_lens)).clamp(min=0)
    else:
        first_tok = torch.zeros_like(seq_lens)
    used = (entry < ((seq_lens + page_size - 1) // page_size)[:, None]) & (entry >= (first_tok // page_size)[:, None])
    pages = page_table[used]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        bad = pages[(pages < 0) | (pages >= num_pages)][0].item()
        raise ValueError(f"page_table: expected page ids in [0, {num_pages}) for a cache of {num_pages} pages "
                         f"of {page_size} tokens, got {bad}")


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
           page_table: torch.Tensor, page_size: int, *, policy: str = "balanced", sm_scale: float | None = None,
           out: torch.Tensor | None = None, sinks: torch.Tensor | None = None, k_scale: float = 1.0,
           v_scale: float = 1.0, **kwargs) -> torch.Tensor:
    """One-shot decode for scripts: builds a DecodeAttention, plans and runs once.

    q [B, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D] or [num_slots, Hkv, D]
    (q's dtype or FP8; as ``DecodeAttention.run``); seq_lens [B] int; page_table [B,
    max_pages] int32; sinks, k_scale, v_scale as ``DecodeAttention.run``;
    kwargs as its constructor (sliding_window, logit_cap, ...). Returns [B, Hq, D]. Serving
    code should keep one DecodeAttention and reuse it (this allocates workspaces and
    compiles on first use).
    """
    check_tensor("q", q, shape=(None, None, None), dtypes=SUPPORTED_DTYPES)
    device = resolve_device(q.device, "q")
    check_cache("k_cache", k_cache, page_size=None, dtypes=None, device=device)
    num_kv_heads = k_cache.shape[-2]
    if num_kv_heads < 1:
        raise ValueError(f"k_cache: expected at least one KV head, got shape {tuple(k_cache.shape)}")
    if q.shape[1] < 1 or q.shape[1] % num_kv_heads:
        raise ValueError(f"q: expected Hq a positive multiple of Hkv={num_kv_heads} (k_cache), got Hq={q.shape[1]}")
    batch = check_batch_metadata(seq_lens, page_table, device)
    attn = DecodeAttention(q.shape[1], k_cache.shape[-2], q.shape[2], page_size, q.dtype, device,
                           max(batch, 1), max(page_table.shape[1], 1), policy, sm_scale=sm_scale,
                           kv_dtype=k_cache.dtype if k_cache.dtype in FP8_KV_DTYPES else None, **kwargs)
    return attn.run(attn.plan(seq_lens, page_table), q, k_cache, v_cache, out=out, sinks=sinks, k_scale=k_scale,
                    v_scale=v_scale)


__all__ = ["DecodeAttention", "DecodePlan", "decode", "check_max_q_len", "POLICIES", "MAX_DECODE_Q_LEN"]
