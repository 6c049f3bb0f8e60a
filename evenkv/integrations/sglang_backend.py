"""evenkv as an SGLang attention backend (imported lazily by ``evenkv.integrations.sglang``).

What SGLang hands us, and what we make of it (SGLang 0.5.17 to 0.5.23):

- ``req_to_token`` int32 ``[pool_size + 1, max_context_len]``: slot of token i of request r,
  token-granular even for page_size P > 1 (slot = page * P + offset, pages aligned to
  positions). evenkv's page table ``[B, max_pages]`` int32 of request b is therefore
  ``req_to_token[req_pool_indices[b], ::P] // P`` (for P = 1 the slots themselves).
  Row 0 is SGLang's padding row (zeros -> the reserved dummy page 0).
- ``seq_lens`` int64 ``[B]``: KV length including this step's new tokens (a verify batch's
  exclude its draft tokens: evenkv's lengths add them).
- KV buffers ``[num_slots, Hkv, D]`` per layer (``MHATokenToKVPool``, NHD). New K/V are
  written with the pool's ``set_kv_buffer`` before attention, as every SGLang backend does.
- The hybrid pool (``SWAKVPool``, SGLang's default for models with window layers, such as
  Mellum): a full token pool for the full-attention layers and a smaller one for the
  sliding-window layers. ``req_to_token`` holds full-pool slots; a window layer's slot is
  ``full_to_swa_index_mapping[full slot]``, which SGLang zeroes (the dummy slot) once the
  token has left every window. Window layers plan on the translated page table and write
  through ``KVWriteLoc(loc, swa_loc)``; their decode reads only the window's pages, so the
  zeroed entries before it are never read (an extend tile across the window's left edge may
  load the dummy page, and masks it out), and the page audit sees valid ids there.

One ``evenkv.Attention`` per layer kind (``LayerKind``: sliding window, soft-cap, which token
pool; gpt-oss and Gemma alternate two) plans each batch once (``init_forward_metadata``) and
runs it for every layer of that kind: decode batches on the balanced decode kernels
(``num_decodes = B``); extend batches (prefill, chunked prefill, mixed) on SGLang's FA3 or
evenkv's extend kernel (``num_decodes = 0``), reading the cached prefix from the pool and
the new tokens' K/V from the layer's inputs. Speculative verify batches (``TARGET_VERIFY``,
which SGLang sends to ``forward_extend``) are decode rows too: each request's
``speculative_num_draft_tokens`` tokens attend to the cache (their own K/V just written),
causal for a chain, under a per-row tree mask for NGRAM and EAGLE with topk > 1 (on window
layers too: a tree token's window starts from its depth, as SGLang positions it).
Attention sinks come with each call (``sinks=``). An FP8 pool
(``--kv-cache-dtype fp8_e4m3``) is read with each layer's ``k_scale_float`` /
``v_scale_float``; its new tokens are read back from the pool, where SGLang has just
quantized them.

Tree masks: SGLang's ``spec_info.custom_mask`` is its FULL_MASK layout (the GPU default of
EAGLE's tree builder and NGRAM's only one): bools, per request b the D x (prefix_b + D)
rows of its draft tokens, requests back to back, so token i of request b sees draft j iff
``custom_mask[D * sum_{c<b}(prefix_c + D) + i * (prefix_b + D) + prefix_b + j]``.
``_fill_tree_mask`` gathers those D x D cells and packs row i into bit j of evenkv's
``tree_mask[b * D + i]``, with fixed-shape GPU ops.

CUDA graphs (SGLang's ``full`` decode graph runner: DECODE, or TARGET_VERIFY under
speculative decoding):

- ``init_cuda_graph_state(max_bs, max_num_tokens)`` allocates fixed-address buffers: seq_lens
  ``[max_bs]`` int64, a page table ``[max_bs, max_pages]`` int32 per token pool, the window
  layers' write slots ``[max_num_tokens]``; the verify query offsets and tree masks live in
  buffers sized at construction.
- ``init_forward_metadata_out_graph(fb)`` runs on the host before capture and before every
  replay. It refills those buffers in place: seq_lens (padded rows -> 0, so evenkv skips
  them; at capture every row holds SGLang's fill value), a snapshot of the page table
  taken from ``req_to_token`` (and its translation through the hybrid pool's mapping), the
  window layers' write slots, the tree masks. Snapshotting here, not reading
  ``req_to_token`` or the mapping inside the graph, is what keeps replay safe: on CUDA,
  SGLang's scheduler may overwrite them for the next batch as soon as this pre-replay step
  is recorded (the WAR-barrier event of decode_cuda_graph_runner), i.e. while the graph
  still runs. May allocate and read host data (``seq_lens_cpu`` narrows the copy to the
  live width).
- ``init_forward_metadata_in_graph(fb)`` is recorded into the graph: ``Attention.plan``
  on the fixed buffers (GPU work only, no sync, no allocation).
- ``update_verify_buffers_to_fill_after_draft`` refills the tree masks when SGLang planned
  a verify graph before its draft finished (``SGLANG_ENABLE_OVERLAP_PLAN_STREAM``).
- ``get_cuda_graph_seq_len_fill_value()`` is 1, as for SGLang's triton backend: a padded
  row at capture reads one token of the dummy page.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.runtime_context import get_parallel

from evenkv.attention import Attention, AttentionPlan
from evenkv.errors import ErrorWatcher
from evenkv.integrations.prefill import sglang_flash_attention
from evenkv.integrations.sglang import draft_topk, speculative_verify
from evenkv.kernels.launching import parallel_compiles
from evenkv.kernels.plan_launch import launch_page_tables

logger = logging.getLogger("evenkv")
# ForwardBatch.seq_lens' dtype. The adapter's own length buffers (verify lengths, CUDA-graph
# lengths) take it too, so every plan sees one length dtype and the warm-up compiles the plan
# and audit kernels for it alone.
SGLANG_INDEX_DTYPE = torch.int64


@dataclass(frozen=True)
class LayerKind:
    """What a layer adds to plain causal attention, as evenkv plans it: layers of one kind
    share a plan. window: W (SGLang's ``sliding_window_size`` + 1) or None; logit_cap: c or
    None; swa_pool: the layer's K/V live in the hybrid pool's sliding-window token pool."""

    window: int | None = None
    logit_cap: float | None = None
    swa_pool: bool = False

    @classmethod
    def of(cls, layer, swa_layer_ids: frozenset = frozenset()) -> "LayerKind":
        window = layer.sliding_window_size
        return cls(window + 1 if window is not None and window > -1 else None, layer.logit_cap or None,
                   layer.layer_id in swa_layer_ids)


@dataclass(frozen=True)
class ForwardMetadata:
    """One batch, as planned: an AttentionPlan per layer kind and what forward needs besides.

    num_tokens: query rows of the batch (B for decode, B x draft tokens for verify, sum of
        extend lengths for extend).
    decode_rows: every request is a decode row (decode, speculative verify): every key, the
        new tokens' included, is read from the cache.
    swa_out_cache_loc: [num_tokens] int64, the new tokens' slots in the hybrid pool's
        sliding-window token pool (None without one).
    """

    plans: dict[LayerKind, AttentionPlan]
    num_tokens: int
    decode_rows: bool
    swa_out_cache_loc: torch.Tensor | None = None


class EvenKVAttnBackend(AttentionBackend):
    """SGLang ``AttentionBackend`` running evenkv's decode and extend kernels.

    Build it through the registry (``--attention-backend evenkv``); the factory in
    ``evenkv.integrations.sglang`` has already refused unsupported configurations.
    Per-layer features evenkv does not have (encoder/cross attention, a soft-cap other than
    tanh, a layer of a kind the model did not declare) raise NotImplementedError at the
    layer's first call.
    """

    # seq_lens_cpu narrows the per-step page-table copy to the batch's live width.
    needs_cpu_seq_lens: bool = True

    def __init__(self, model_runner, policy: str = "balanced"):
        super().__init__()
        self.device = torch.device(model_runner.device)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = getattr(model_runner, "page_size", 1) or 1
        pool = self.token_to_kv_pool
        self.swa_layer_ids = hybrid_swa_layer_ids(pool)
        attn_tp = get_parallel().attn_tp_size
        total_q_heads = model_runner.model_config.get_max_num_attention_heads()
        if total_q_heads % attn_tp:
            raise ValueError(f"evenkv: {total_q_heads} attention heads do not split over attn_tp_size={attn_tp}")
        self.num_q_heads = total_q_heads // attn_tp
        self.num_kv_heads = pool.head_num
        self.head_dim = pool.head_dim
        self.kv_dtype = pool.dtype
        self.fp8 = pool.dtype == torch.float8_e4m3fn
        self.dtype = model_runner.dtype if self.fp8 else pool.dtype  # a 16-bit pool is in the model dtype
        # Widest page table a request can need: the req_to_token row, in pages.
        self.max_pages = math.ceil(self.req_to_token.shape[1] / self.page_size)
        # SGLang's EAGLE worker sizes a verify step's tree mask as B x this when the batch's
        # seq_lens_sum is unknown (after a request leaves or joins the batch).
        self.max_context_len = model_runner.model_config.context_len
        deterministic = bool(getattr(model_runner.server_args, "enable_deterministic_inference", False))
        # A draft model's backend (EAGLE family) sees prefill, DRAFT_EXTEND_V2 and, through
        # EvenKVMultiStepDraftBackend, decode rows: one per request and draft branch (topk of
        # each request in a draft tree); never a TARGET_VERIFY batch.
        self.is_draft = bool(getattr(model_runner, "is_draft_worker", False))
        self.draft_topk = draft_topk(model_runner.server_args) if self.is_draft else 1
        max_batch_size = max(1, model_runner.req_to_token_pool.size) * self.draft_topk
        # Speculative verify: D query tokens per request, as decode rows (tree-masked or causal).
        # Batches hold rows of 1 (decode) or D (verify) tokens: only those kernels are built.
        self.verify_q_len, self.tree_verify = (0, False) if self.is_draft else speculative_verify(
            model_runner.server_args)
        prefill = sglang_flash_attention(self.device)
        self.layer_kinds, self.sinks_dtype = model_layer_kinds(model_runner.model, self.swa_layer_ids)
        self.attentions = {}
        for kind in set(self.layer_kinds.values()) or {LayerKind()}:
            self.attentions[kind] = Attention(
                self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size, self.dtype, self.device,
                max_batch_size, self.max_pages, policy, sliding_window=kind.window, logit_cap=kind.logit_cap,
                kv_dtype=self.kv_dtype, prefill_kernel=prefill, deterministic=True if deterministic else None,
                max_total_tokens=int(getattr(pool, "size", 0)) or 1 << 21, max_decode_q_len=max(1, self.verify_q_len),
                q_lens=(1, self.verify_q_len) if self.verify_q_len else None, tree_masks=self.tree_verify)
            logger.info("evenkv: attention layers of %s decode on evenkv's kernels (%s); prefill and extend run on %s",
                        kind, self.attentions[kind].decode_reason, self.attentions[kind].prefill_reason)
        # Server flag or EVENKV_DETERMINISTIC, as the Attention objects resolved it.
        self.deterministic = next(iter(self.attentions.values())).deterministic
        self.errors = ErrorWatcher(self.device)  # polled once per step: logs bad batch data, never syncs
        start = time.perf_counter()
        self._warmup()
        logger.info("evenkv: kernels of %d attention object(s) built or loaded in %.2f s", len(self.attentions),
                    time.perf_counter() - start)
        i32 = dict(dtype=torch.int32, device=self.device)
        # cu_seqlens_q of every decode batch: request i owns q row i.
        self._decode_cu_seqlens = torch.arange(max_batch_size + 1, **i32)
        if self.verify_q_len:
            d = self.verify_q_len
            # Verify batches (eager and graphs): request i owns q rows [i * D, (i + 1) * D); its
            # evenkv length (SGLang's + D) and its tree mask rows live in these buffers.
            self._verify_cu_seqlens = torch.arange(max_batch_size + 1, **i32) * d
            self._verify_seq_lens = torch.zeros(max_batch_size, dtype=SGLANG_INDEX_DTYPE, device=self.device)
            self._draft_index = torch.arange(d, dtype=torch.int64, device=self.device)
            self._causal_rows = ((2 << self._draft_index) - 1).to(torch.int32)  # row i sees drafts 0..i
            self._tree_mask = torch.zeros(max_batch_size * d, **i32) if self.tree_verify else None
        self.forward_metadata: ForwardMetadata | None = None
        self._layer_kind: dict[int, LayerKind] = {}  # layer id -> its kind, once the layer is checked
        # CUDA-graph buffers (init_cuda_graph_state).
        self.cuda_graph_seq_lens: torch.Tensor | None = None
        self.cuda_graph_page_tables: dict[bool, torch.Tensor] = {}  # by LayerKind.swa_pool
        self.cuda_graph_swa_out_cache_loc: torch.Tensor | None = None

    def _warmup(self) -> None:
        """Compile every kernel variant a batch can need now, at start-up, on tensors laid out as
        forward will pass them (q, k, v as views of one qkv row; each kind's own pool)."""
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        qkv = torch.zeros(1, (hq + 2 * hkv) * d, dtype=self.dtype, device=self.device)
        q = qkv[:, :hq * d].view(-1, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
        sinks = None if self.sinks_dtype is None else torch.zeros(hq, dtype=self.sinks_dtype, device=self.device)
        # An FP8 pool's new tokens are read back from it (see forward_extend).
        new = {} if self.fp8 else dict(k_new=k, v_new=v)
        with parallel_compiles():  # the page tables' build joins the first attention object's batch
            one = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._page_tables(one, one, 1, warmup=True)
            for kind, attention in self.attentions.items():
                layer_id = min((i for i, k in self.layer_kinds.items() if k == kind), default=0)
                k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer_id)
                attention.warmup(q, k_cache, v_cache, out=torch.empty_like(q), sinks=sinks,
                                 index_dtypes=(SGLANG_INDEX_DTYPE,), **new)

    # -- metadata -----------------------------------------------------------------

    def _page_width(self, seq_lens_cpu, extra: int = 0) -> int:
        """Page-table columns the batch needs: from the host lengths (+ ``extra`` tokens each)
        if given, else all."""
        if seq_lens_cpu is None or len(seq_lens_cpu) == 0:
            return self.max_pages
        longest = int(max(seq_lens_cpu)) if not isinstance(seq_lens_cpu, torch.Tensor) else int(seq_lens_cpu.max())
        return min(self.max_pages, max(1, math.ceil((longest + extra) / self.page_size)))

    def _page_tables(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, width: int,
                     out: dict[bool, torch.Tensor] | None = None, warmup: bool = False) -> dict[bool, torch.Tensor]:
        """Page ids [B, width] int32 of the batch's requests (req_pool_indices [B], seq_lens [B]
        device lengths), from req_to_token, for each token pool the
        layers read (keyed like ``LayerKind.swa_pool``): the full pool's, and with a hybrid pool
        the sliding-window pool's, through its full->SWA mapping. One launch, no temporaries:
        at page 1 a table is as wide as the longest request, B x width entries.

        Each row holds the entries its length uses (``launch_page_tables``); the entries after
        them, uninitialized or stale, are never read by the kernels (they stop at
        ceil(seq_len / page_size) pages). With ``out`` (a [>= B, >= width] int32 buffer per
        pool) the tables are ``out[pool][:B, :width]``. A slot outside the mapping, or a row
        outside req_to_token, gives page id -1, which the page audit flags. ``warmup``: compile
        the launch, run nothing."""
        bs = req_pool_indices.shape[0]
        pools = (False, True) if self.swa_layer_ids else (False,)
        tables = {swa: torch.empty(bs, width, dtype=torch.int32, device=self.device) if out is None
                  else out[swa][:bs, :width] for swa in pools}
        if bs:
            mapping = self.token_to_kv_pool.full_to_swa_index_mapping if self.swa_layer_ids else None
            launch_page_tables(self.req_to_token, req_pool_indices.to(torch.int64), seq_lens.to(SGLANG_INDEX_DTYPE),
                               tables[False], page_size=self.page_size, swa_mapping=mapping,
                               swa_out=tables.get(True), warmup=warmup)
        return tables

    def _swa_out_cache_loc(self, forward_batch) -> torch.Tensor | None:
        """The new tokens' slots in the sliding-window pool (None without a hybrid pool)."""
        if not self.swa_layer_ids or forward_batch.out_cache_loc is None:
            return None
        return self.token_to_kv_pool.translate_loc_from_full_to_swa(forward_batch.out_cache_loc)

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager metadata (host work allowed): plan the batch once for every layer."""
        self.errors.poll()
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_decode():
            self._plan_decode(forward_batch)
            return
        self._refuse_mode(mode)
        if mode.is_target_verify():
            self._plan_verify(forward_batch)
        else:
            self._plan_extend(forward_batch)

    def _refuse_mode(self, mode) -> None:
        if mode.is_target_verify() and not self.verify_q_len:
            raise NotImplementedError("evenkv: a TARGET_VERIFY batch, but this backend was built without verify rows "
                                      "(no speculative decoding, or a draft model's backend)")
        if mode.is_draft_extend_v2() and not self.is_draft:
            raise NotImplementedError("evenkv: a DRAFT_EXTEND_V2 batch on a target model's backend")
        if mode.name in ("DLLM_EXTEND", "SPLIT_PREFILL"):
            raise NotImplementedError(f"evenkv: forward mode {mode.name} is not supported (no dLLM or PD "
                                      "multiplexing)")

    def _plan_decode(self, forward_batch) -> None:
        bs = forward_batch.batch_size
        seq_lens_cpu = forward_batch.seq_lens_cpu
        tables = self._page_tables(forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
                                   self._page_width(seq_lens_cpu))
        plans = self.decode_plans(forward_batch.seq_lens[:bs], tables,
                                  seq_lens_cpu[:bs] if seq_lens_cpu is not None else None)
        self.forward_metadata = ForwardMetadata(plans, bs, True, self._swa_out_cache_loc(forward_batch))

    def decode_plans(self, seq_lens: torch.Tensor, tables: dict[bool, torch.Tensor],
                     seq_lens_cpu: torch.Tensor | None = None) -> dict[LayerKind, AttentionPlan]:
        """Plans of B decode rows, one query token each: seq_lens [B] int64 (on the device; the
        host copy, if given, narrows the plan), tables [>= B, pages] int32 per token pool (as
        ``_page_tables`` gives them). GPU work only without ``seq_lens_cpu``."""
        bs = seq_lens.shape[0]
        return {kind: attention.plan(self._decode_cu_seqlens[:bs + 1], seq_lens, tables[kind.swa_pool][:bs],
                                     num_decodes=bs, max_q_len=1, seq_lens_cpu=seq_lens_cpu)
                for kind, attention in self.attentions.items()}

    def _plan_verify(self, forward_batch) -> None:
        """TARGET_VERIFY: request b verifies D tokens at positions seq_lens[b] .. + D - 1, their
        K/V written into req_to_token's slots there before attention."""
        bs, d = forward_batch.batch_size, self.verify_q_len
        spec_info = self._check_verify_input(forward_batch.spec_info)
        seq_lens = self._verify_seq_lens[:bs]
        seq_lens.copy_(forward_batch.seq_lens[:bs])
        seq_lens.add_(d)
        prefix_cpu = forward_batch.seq_lens_cpu
        tables = self._page_tables(forward_batch.req_pool_indices[:bs], seq_lens, self._page_width(prefix_cpu, d))
        tree_mask = None
        if self.tree_verify:
            if prefix_cpu is not None:
                _check_full_mask_size(spec_info.custom_mask, int(prefix_cpu[:bs].sum()), bs, d)
            tree_mask = self._tree_mask[: bs * d]
            self._fill_tree_mask(spec_info.custom_mask, forward_batch.seq_lens[:bs], tree_mask)
        plans = {kind: attention.plan(self._verify_cu_seqlens[:bs + 1], seq_lens, tables[kind.swa_pool],
                                      num_decodes=bs, max_q_len=d, decode_q_len=d, num_decode_tokens=bs * d,
                                      tree_mask=tree_mask,
                                      seq_lens_cpu=None if prefix_cpu is None else prefix_cpu[:bs] + d)
                 for kind, attention in self.attentions.items()}
        self.forward_metadata = ForwardMetadata(plans, bs * d, True, self._swa_out_cache_loc(forward_batch))

    def _check_verify_input(self, spec_info):
        """The verify batch's SpecInput, checked against what this backend planned for."""
        if spec_info is None:
            raise ValueError("evenkv: a TARGET_VERIFY batch without spec_info")
        width = getattr(spec_info, "draft_token_num", None)
        if width is not None and int(width) != self.verify_q_len:
            raise ValueError(f"evenkv: spec_info.draft_token_num={width}, but the server verifies "
                             f"speculative_num_draft_tokens={self.verify_q_len} tokens per request")
        if getattr(spec_info, "ragged_verify_layout", None) is not None:
            raise NotImplementedError("evenkv: ragged verify batches (SGLANG_RAGGED_VERIFY_MODE) are not supported")
        if self.tree_verify and getattr(spec_info, "custom_mask", None) is None:
            raise ValueError("evenkv: a tree verify batch without spec_info.custom_mask")
        return spec_info

    def _fill_tree_mask(self, custom_mask: torch.Tensor, prefix_lens: torch.Tensor, out: torch.Tensor,
                        rows_valid: torch.Tensor | None = None) -> None:
        """Pack SGLang's FULL_MASK tree (see the module docstring) into evenkv's tree mask.

        custom_mask: [cells] bool (or 0/1). prefix_lens: [B] int, SGLang's seq_lens (without the
        drafts). out: [B * D] int32, bit j of out[b * D + i] = draft i of request b sees draft j.
        rows_valid: [B] bool or None (all): rows marked False (padding) get a causal mask.
        Fixed-shape GPU ops, no sync; cells past the mask (padding rows) are clamped, not read.
        """
        d, j = self.verify_q_len, self._draft_index
        prefix = prefix_lens.to(torch.int64)
        row_len = prefix + d  # columns of one mask row of request b
        first = d * (torch.cumsum(row_len, 0) - row_len)  # request b's first cell
        cells = (first[:, None, None] + j[None, :, None] * row_len[:, None, None] + prefix[:, None, None]
                 + j[None, None, :])  # [B, D (row i), D (draft j)]
        seen = custom_mask.reshape(-1)[cells.clamp_(0, max(custom_mask.numel() - 1, 0))] != 0
        bits = (seen.to(torch.int32) << j.to(torch.int32)).sum(-1, dtype=torch.int32)  # [B, D]
        if rows_valid is not None:
            bits = torch.where(rows_valid[:, None], bits, self._causal_rows[None, :])
        out.copy_(bits.reshape(-1))

    def _plan_extend(self, forward_batch) -> None:
        """Prefill, chunked prefill and mixed batches; a draft model's DRAFT_EXTEND_V2 (each
        request's drafts after its prefix, SGLang's lengths including them) is one too."""
        bs = forward_batch.batch_size
        ext_lens = forward_batch.extend_seq_lens[:bs]
        ext_lens_cpu = forward_batch.extend_seq_lens_cpu
        if ext_lens_cpu is not None:
            max_q_len, total_q = int(max(ext_lens_cpu, default=0)), int(sum(ext_lens_cpu))
        else:  # one sync; SGLang's scheduler normally provides the host lengths
            max_q_len, total_q = int(ext_lens.max()) if bs else 0, int(ext_lens.sum())
        seq_lens_cpu = forward_batch.seq_lens_cpu
        if seq_lens_cpu is None and forward_batch.extend_prefix_lens_cpu is not None and ext_lens_cpu is not None:
            seq_lens_cpu = [a + b for a, b in zip(forward_batch.extend_prefix_lens_cpu, ext_lens_cpu)]
        cu_seqlens_q = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
        cu_seqlens_q[1:] = torch.cumsum(ext_lens, dim=0)
        tables = self._page_tables(forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
                                   self._page_width(seq_lens_cpu))
        max_seq_len = int(max(seq_lens_cpu)) if seq_lens_cpu is not None and len(seq_lens_cpu) else None
        plans = {kind: attention.plan(cu_seqlens_q, forward_batch.seq_lens[:bs], tables[kind.swa_pool],
                                      num_decodes=0, max_q_len=max_q_len, max_seq_len=max_seq_len)
                 for kind, attention in self.attentions.items()}
        self.forward_metadata = ForwardMetadata(plans, total_q, False, self._swa_out_cache_loc(forward_batch))

    # -- CUDA graphs (decode, target verify) --------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed-address buffers for graphs of up to ``max_bs`` requests, each with one token
        (decode) or the verify width's (target verify)."""
        width = self.verify_q_len or 1
        if max_num_tokens != max_bs * width:
            raise NotImplementedError(f"evenkv: CUDA graphs with {max_num_tokens} tokens for {max_bs} requests; "
                                      f"expected {width} per request (" + ("the verify width" if self.verify_q_len
                                                                          else "decode") + ")")
        pool_rows = next(iter(self.attentions.values())).max_batch_size
        if max_bs > pool_rows:
            raise ValueError(f"evenkv: CUDA graphs of up to {max_bs} requests, but the request pool holds {pool_rows}")
        i32 = dict(dtype=torch.int32, device=self.device)
        self.cuda_graph_seq_lens = torch.zeros(max_bs, dtype=SGLANG_INDEX_DTYPE, device=self.device)
        pools = (False, True) if self.swa_layer_ids else (False,)
        self.cuda_graph_page_tables = {swa: torch.zeros(max_bs, self.max_pages, **i32) for swa in pools}
        if self.swa_layer_ids:
            self.cuda_graph_swa_out_cache_loc = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def _graph_width(self, mode) -> int:
        """Query tokens per request of a graph in ``mode`` (1 for decode and idle)."""
        if mode.is_decode_or_idle():
            return 1
        if mode.is_target_verify() and self.verify_q_len:
            return self.verify_q_len
        # Prefill graph runners call init_forward_metadata; anything else is refused here.
        raise NotImplementedError(f"evenkv: CUDA graphs for forward mode {mode.name} are not supported")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Host side of a graph step (before capture and before each replay): refill the
        fixed buffers in place. ``forward_batch`` is a ForwardBatch at capture and a
        SimpleNamespace view at replay (padded: ``batch_size``, ``req_pool_indices``,
        ``seq_lens``, ``seq_lens_cpu``, ``num_padding``; unpadded ``out_cache_loc``)."""
        self.errors.poll()
        width = self._graph_width(forward_batch.forward_mode)
        if self.cuda_graph_seq_lens is None:
            raise RuntimeError("evenkv: init_cuda_graph_state must run before init_forward_metadata_out_graph")
        bs = forward_batch.batch_size
        padding = int(getattr(forward_batch, "num_padding", 0) or 0)
        seq_lens = self.cuda_graph_seq_lens[:bs]
        seq_lens.copy_(forward_batch.seq_lens[:bs])
        if width > 1:
            seq_lens.add_(width)  # SGLang's verify lengths exclude the drafts
        if padding:
            seq_lens[bs - padding:].zero_()  # padded rows: no work, zero output
        seq_lens_cpu = forward_batch.seq_lens_cpu
        live_cpu = seq_lens_cpu[: bs - padding] if seq_lens_cpu is not None else None
        width_pages = self._page_width(live_cpu, width if width > 1 else 0)  # verify lengths exclude the drafts
        self._page_tables(forward_batch.req_pool_indices[:bs], seq_lens, width_pages, out=self.cuda_graph_page_tables)
        if self.tree_verify and width > 1:
            tree_mask = self._tree_mask[: bs * width]
            if in_capture:  # the capture batch's mask is a placeholder: causal rows
                tree_mask.view(bs, width).copy_(self._causal_rows)
            else:
                spec_info = self._check_verify_input(forward_batch.spec_info)
                if live_cpu is not None:
                    _check_full_mask_size(spec_info.custom_mask, int(live_cpu.sum()), bs - padding, width)
                self._fill_tree_mask(spec_info.custom_mask, forward_batch.seq_lens[:bs], tree_mask,
                                     rows_valid=seq_lens > 0)
        if self.cuda_graph_swa_out_cache_loc is not None:
            loc = self._swa_out_cache_loc(forward_batch)
            n = 0 if loc is None else loc.shape[0]
            if n:
                self.cuda_graph_swa_out_cache_loc[:n].copy_(loc)
            self.cuda_graph_swa_out_cache_loc[n:].zero_()  # padded tokens write the dummy slot

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Recorded into the graph: plan on the fixed buffers (GPU work only)."""
        width = self._graph_width(forward_batch.forward_mode)
        bs = forward_batch.batch_size
        tables = self.cuda_graph_page_tables
        if width == 1:
            plans = self.decode_plans(self.cuda_graph_seq_lens[:bs], tables)
        else:
            plans = {kind: attention.plan(self._verify_cu_seqlens[:bs + 1], self.cuda_graph_seq_lens[:bs],
                                          tables[kind.swa_pool][:bs], num_decodes=bs, max_q_len=width,
                                          decode_q_len=width, num_decode_tokens=bs * width,
                                          tree_mask=self._tree_mask[: bs * width] if self.tree_verify else None)
                     for kind, attention in self.attentions.items()}
        swa_loc = self.cuda_graph_swa_out_cache_loc
        self.forward_metadata = ForwardMetadata(plans, bs * width, True,
                                                None if swa_loc is None else swa_loc[: bs * width])

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs: int | None) -> None:
        """SGLang planned this verify step before its draft finished (overlap plan stream): the
        tree masks were read too early. A graph step refills its buffer from the finished mask;
        an eager one is planned again at its forward, after the draft."""
        if not self.tree_verify or cuda_graph_bs is None:
            return
        seq_lens = self.cuda_graph_seq_lens[:cuda_graph_bs]
        self._fill_tree_mask(self._check_verify_input(spec_info).custom_mask,
                             (seq_lens - self.verify_q_len).clamp_(min=0),
                             self._tree_mask[: cuda_graph_bs * self.verify_q_len], rows_valid=seq_lens > 0)

    # -- forward ------------------------------------------------------------------------

    def _check_layer(self, layer, kwargs: dict) -> None:
        """Refuse per-layer features evenkv lacks (each layer checked once; score_mod every call)."""
        if kwargs.get("score_mod") is not None:
            raise NotImplementedError(f"evenkv: score_mod (layer {layer.layer_id}) is not supported")
        if layer.layer_id in self._layer_kind:
            return
        problems = []
        kind = LayerKind.of(layer, self.swa_layer_ids)
        if kind not in self.attentions:
            problems.append(f"{kind} is not among the model's layer kinds {list(self.attentions)}")
        if (layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim) != \
                (self.num_q_heads, self.num_kv_heads, self.head_dim):
            problems.append(f"heads/head_dim (Hq, Hkv, D) = ({layer.tp_q_head_num}, {layer.tp_k_head_num}, "
                            f"{layer.qk_head_dim}) differ from the KV pool's ({self.num_q_heads}, "
                            f"{self.num_kv_heads}, {self.head_dim})")
        if layer.v_head_dim != layer.qk_head_dim:
            problems.append(f"v_head_dim {layer.v_head_dim} != qk_head_dim {layer.qk_head_dim}")
        if layer.logit_cap and getattr(layer, "logit_capping_method", "tanh") != "tanh":
            problems.append(f"logit capping method {layer.logit_capping_method!r} (evenkv: tanh)")
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            problems.append(f"attention type {layer.attn_type.value}"
                            f"{' (cross attention)' if layer.is_cross_attention else ''}")
        for name in ("k_scale_float", "v_scale_float"):
            scale = getattr(layer, name, None)
            if not self.fp8 and scale is not None and scale != 1.0:
                problems.append(f"{name}={scale} on a {self.kv_dtype} KV cache (scales belong to an FP8 cache)")
        if getattr(layer, "xai_temperature_len", -1) > 0:
            problems.append("xai temperature scaling")
        if problems:
            raise NotImplementedError(f"evenkv: layer {layer.layer_id} uses features evenkv does not support: "
                                      + "; ".join(problems))
        self._layer_kind[layer.layer_id] = kind

    def _save_kv(self, layer, forward_batch, meta: ForwardMetadata, k, v) -> None:
        loc = forward_batch.out_cache_loc
        if meta.swa_out_cache_loc is not None:  # the hybrid pool writes a window layer's token there
            loc = KVWriteLoc(loc, meta.swa_out_cache_loc)
        if layer.k_scale is None:
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        else:
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """q [B, Hq*D] (or [B, Hq, D]); k, v [B, Hkv, D] or None (shared KV). Returns [B, Hq*D]."""
        return self.decode_rows(self.forward_metadata, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def decode_rows(self, meta: ForwardMetadata | None, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                    **kwargs):
        """forward_decode on the batch ``meta`` plans (this backend's, or a draft step's): writes
        k, v [B, Hkv, D] to ``forward_batch.out_cache_loc``, then q [B, Hq*D] attends to the
        cache. Returns [B, Hq*D]."""
        self._check_layer(layer, kwargs)
        if meta is None or not meta.decode_rows:
            raise RuntimeError("evenkv: forward_decode without a planned decode batch (init_forward_metadata)")
        if save_kv_cache and k is not None:
            self._save_kv(layer, forward_batch, meta, k, v)
        q3 = q.reshape(-1, self.num_q_heads, self.head_dim)
        out = q3.new_empty(q3.shape)
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        self._run(layer, meta, q3, k_cache, v_cache, out, None, None, kwargs.get("sinks"))
        return out.view(-1, self.num_q_heads * self.head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """q [T, Hq*D]; k, v [T, Hkv, D] or None (shared KV: read from the pool). T may exceed
        the batch's tokens (padded prefill graphs): those rows of the result are zeros.
        Returns [T, Hq*D], in ``forward_batch._attn_output`` when the runner provides one
        (SGLang's prefill-graph path; [T, Hq*D] or [T, Hq, D], contiguous). Verify batches
        come here too (SGLang sends TARGET_VERIFY to forward_extend), planned as decode rows."""
        meta = self._metadata(layer, kwargs)
        if (k is None) != (v is None):
            raise ValueError("evenkv: forward_extend got only one of k and v")
        if save_kv_cache and k is not None:
            self._save_kv(layer, forward_batch, meta, k, v)
        hq, d = self.num_q_heads, self.head_dim
        q3 = q.reshape(-1, hq, d)
        out = getattr(forward_batch, "_attn_output", None)
        if out is None:
            out = q3.new_empty(q3.shape[0], hq * d)
        out3 = out.view(-1, hq, d)
        n = meta.num_tokens
        if q3.shape[0] < n:
            raise ValueError(f"evenkv: forward_extend got {q3.shape[0]} query rows for a batch of {n} tokens")
        if q3.shape[0] > n:
            out3[n:].zero_()
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        # SGLang's layout: the cache holds the prefix (and, once written, the new tokens);
        # the new tokens' K/V come row-aligned with q. Without k/v (shared KV) the new
        # tokens are read back from the cache, as decode rows always read them.
        # Deterministic mode reads the new tokens back from the cache too (they were just
        # written): then a prompt's tiles do not depend on how it was chunked. So does an FP8
        # pool: its new tokens are read as quantized, as decode will read them (and SGLang
        # divided k and v by the scales in place when it wrote them). So does an engine prefill
        # kernel (SGLang's FA3), which holds them there: written above, or by the model itself
        # where it passes save_kv_cache=False.
        delegated = self.attentions[self._layer_kind[layer.layer_id]].prefill_kernel is not None
        from_cache = (k is None or meta.decode_rows or delegated
                      or (save_kv_cache and (self.deterministic or self.fp8)))
        k_new = None if from_cache else k.reshape(-1, self.num_kv_heads, d)[:n]
        v_new = None if from_cache else v.reshape(-1, self.num_kv_heads, d)[:n]
        self._run(layer, meta, q3[:n], k_cache, v_cache, out3[:n], k_new, v_new, kwargs.get("sinks"))
        return out.view(-1, hq * d)

    def _run(self, layer, meta: ForwardMetadata, q, k_cache, v_cache, out, k_new, v_new, sinks) -> None:
        kind = self._layer_kind[layer.layer_id]
        scales = {}
        if self.fp8:
            scales = dict(k_scale=float(layer.k_scale_float or 1.0), v_scale=float(layer.v_scale_float or 1.0))
        _run(self.attentions[kind], meta.plans[kind], q, k_cache, v_cache, out, k_new, v_new, layer.scaling, sinks,
             scales)

    def _metadata(self, layer, kwargs: dict) -> ForwardMetadata:
        self._check_layer(layer, kwargs)
        if self.forward_metadata is None:
            raise RuntimeError("evenkv: forward without a planned batch (init_forward_metadata)")
        return self.forward_metadata


def _check_full_mask_size(custom_mask: torch.Tensor, prefix_total: int, batch: int, q_len: int) -> None:
    """Refuse a tree mask too small for SGLang's FULL_MASK layout of this batch (another
    layout, e.g. QLEN_ONLY, would be read as the wrong cells)."""
    need = q_len * prefix_total + q_len * q_len * batch
    if custom_mask.numel() < need:
        raise ValueError(f"evenkv: spec_info.custom_mask has {custom_mask.numel()} cells; SGLang's FULL_MASK layout "
                         f"of this batch ({batch} requests, {prefix_total} cached tokens, {q_len} drafts each) has "
                         f"{need}")


def hybrid_swa_layer_ids(pool) -> frozenset:
    """Ids of the layers whose K/V live in a hybrid ``SWAKVPool``'s sliding-window pool
    (empty for any other pool)."""
    if not isinstance(pool, SWAKVPool):
        return frozenset()
    return frozenset(layer_id for layer_id, (_, is_swa) in pool.layers_mapping.items() if is_swa)


def model_layer_kinds(model, swa_layer_ids: frozenset = frozenset()) -> tuple[dict[int, LayerKind], torch.dtype | None]:
    """The kind of each of ``model``'s attention layers (by layer id), and the dtype of its
    attention sinks (a ``sinks`` parameter, as gpt-oss's attention blocks hold; None without):
    start-up compiles the kernels for the sinks the layers will pass."""
    from sglang.srt.layers.radix_attention import RadixAttention

    kinds = {m.layer_id: LayerKind.of(m, swa_layer_ids) for m in model.modules() if isinstance(m, RadixAttention)}
    sinks = [p.dtype for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"]
    return kinds, sinks[0] if sinks else None


@torch.compiler.disable
def _run(attention: Attention, plan: AttentionPlan, q, k_cache, v_cache, out, k_new, v_new, sm_scale: float,
         sinks, scales: dict) -> None:
    attention.run(plan, q, k_cache, v_cache, k_new=k_new, v_new=v_new, out=out, sm_scale=sm_scale, sinks=sinks,
                  **scales)


__all__ = ["EvenKVAttnBackend", "ForwardMetadata", "LayerKind", "hybrid_swa_layer_ids", "model_layer_kinds"]
