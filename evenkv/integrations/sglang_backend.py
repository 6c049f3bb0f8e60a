"""evenkv as an SGLang attention backend (imported lazily by ``evenkv.integrations.sglang``).

What SGLang hands us, and what we make of it (SGLang 0.5.17 to 0.5.23):

- ``req_to_token`` int32 ``[pool_size + 1, max_context_len]``: slot of token i of request r,
  token-granular even for page_size P > 1 (slot = page * P + offset, pages aligned to
  positions). evenkv's page table ``[B, max_pages]`` int32 of request b is therefore
  ``req_to_token[req_pool_indices[b], ::P] // P`` (for P = 1 the slots themselves).
  Row 0 is SGLang's padding row (zeros -> the reserved dummy page 0).
- ``seq_lens`` int64 ``[B]``: KV length including this step's new tokens.
- KV buffers ``[num_slots, Hkv, D]`` per layer (``MHATokenToKVPool``, NHD). New K/V are
  written with the pool's ``set_kv_buffer`` before attention, as every SGLang backend does.

One ``evenkv.Attention`` per layer kind (``LayerKind``: sliding window, soft-cap; gpt-oss
and Gemma alternate two) plans each batch once (``init_forward_metadata``) and runs it for
every layer of that kind: decode batches on the balanced decode kernels (``num_decodes =
B``); extend batches (prefill, chunked prefill, mixed) on SGLang's FA3 or evenkv's extend
kernel (``num_decodes = 0``), reading the cached prefix from the pool and the new tokens'
K/V from the layer's inputs. Attention sinks come with each call (``sinks=``). An FP8 pool
(``--kv-cache-dtype fp8_e4m3``) is read with each layer's ``k_scale_float`` /
``v_scale_float``; its new tokens are read back from the pool, where SGLang has just
quantized them.

CUDA graphs (decode; SGLang's ``full`` decode graph runner):

- ``init_cuda_graph_state(max_bs, ...)`` allocates fixed-address buffers: seq_lens
  ``[max_bs]`` int32 and a page table ``[max_bs, max_pages]`` int32.
- ``init_forward_metadata_out_graph(fb)`` runs on the host before capture and before every
  replay. It refills those buffers in place: seq_lens (padded rows -> 0, so evenkv skips
  them; at capture every row holds SGLang's fill value), and a snapshot of the page table
  taken from ``req_to_token``. Snapshotting here, not reading ``req_to_token`` inside the
  graph, is what keeps replay safe: on CUDA, SGLang's scheduler may overwrite
  ``req_to_token`` for the next batch as soon as this pre-replay step is recorded (the
  WAR-barrier event of decode_cuda_graph_runner), i.e. while the graph still runs.
  May allocate and read host data (``seq_lens_cpu`` narrows the copy to the live width).
- ``init_forward_metadata_in_graph(fb)`` is recorded into the graph: ``Attention.plan``
  on the fixed buffers (GPU work only, no sync, no allocation).
- ``get_cuda_graph_seq_len_fill_value()`` is 1, as for SGLang's triton backend: a padded
  row at capture reads one token of the dummy page.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.runtime_context import get_parallel

from evenkv.attention import Attention, AttentionPlan
from evenkv.errors import ErrorWatcher
from evenkv.integrations.prefill import sglang_flash_attention

logger = logging.getLogger("evenkv")


@dataclass(frozen=True)
class LayerKind:
    """What a layer adds to plain causal attention, as evenkv plans it: layers of one kind
    share a plan. window: W (SGLang's ``sliding_window_size`` + 1) or None; logit_cap: c or None."""

    window: int | None = None
    logit_cap: float | None = None

    @classmethod
    def of(cls, layer) -> "LayerKind":
        window = layer.sliding_window_size
        return cls(window + 1 if window is not None and window > -1 else None, layer.logit_cap or None)


@dataclass(frozen=True)
class ForwardMetadata:
    """One batch, as planned: an AttentionPlan per layer kind and the host ints forward needs.

    num_tokens: query rows of the batch (B for decode, sum of extend lengths for extend).
    decode: True for a decode batch (num_decodes = B).
    """

    plans: dict[LayerKind, AttentionPlan]
    num_tokens: int
    decode: bool


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
        max_batch_size = max(1, model_runner.req_to_token_pool.size)
        deterministic = bool(getattr(model_runner.server_args, "enable_deterministic_inference", False))
        prefill = sglang_flash_attention(self.device)
        layer_kinds, self.sinks_dtype = model_layer_kinds(model_runner.model)
        self.attentions = {}
        for kind in set(layer_kinds.values()) or {LayerKind()}:
            self.attentions[kind] = Attention(
                self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size, self.dtype, self.device,
                max_batch_size, self.max_pages, policy, sliding_window=kind.window, logit_cap=kind.logit_cap,
                kv_dtype=self.kv_dtype, prefill_kernel=prefill, deterministic=True if deterministic else None,
                max_total_tokens=int(getattr(pool, "size", 0)) or 1 << 21)
            logger.info("evenkv: attention layers of %s decode on evenkv's balanced kernels; prefill and extend run "
                        "on %s", kind, self.attentions[kind].prefill_reason)
        # Server flag or EVENKV_DETERMINISTIC, as the Attention objects resolved it.
        self.deterministic = next(iter(self.attentions.values())).deterministic
        self.errors = ErrorWatcher(self.device)  # polled once per step: logs bad batch data, never syncs
        self._warmup()
        # cu_seqlens_q of every decode batch: request i owns q row i.
        self._decode_cu_seqlens = torch.arange(max_batch_size + 1, dtype=torch.int32, device=self.device)
        self.forward_metadata: ForwardMetadata | None = None
        self._layer_kind: dict[int, LayerKind] = {}  # layer id -> its kind, once the layer is checked
        # CUDA-graph buffers (init_cuda_graph_state).
        self.cuda_graph_seq_lens: torch.Tensor | None = None
        self.cuda_graph_page_table: torch.Tensor | None = None

    def _warmup(self) -> None:
        """Compile every kernel variant a batch can need now, at start-up, on tensors laid out as
        forward will pass them (q, k, v as views of one qkv row; the pool's caches)."""
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        qkv = torch.zeros(1, (hq + 2 * hkv) * d, dtype=self.dtype, device=self.device)
        q = qkv[:, :hq * d].view(-1, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(0)
        sinks = None if self.sinks_dtype is None else torch.zeros(hq, dtype=self.sinks_dtype, device=self.device)
        # An FP8 pool's new tokens are read back from it (see forward_extend).
        new = {} if self.fp8 else dict(k_new=k, v_new=v)
        for attention in self.attentions.values():
            attention.warmup(q, k_cache, v_cache, out=torch.empty_like(q), sinks=sinks, **new)

    # -- metadata -----------------------------------------------------------------

    def _page_width(self, seq_lens_cpu) -> int:
        """Page-table columns the batch needs: from the host lengths if given, else all."""
        if seq_lens_cpu is None or len(seq_lens_cpu) == 0:
            return self.max_pages
        longest = int(max(seq_lens_cpu)) if not isinstance(seq_lens_cpu, torch.Tensor) else int(seq_lens_cpu.max())
        return min(self.max_pages, max(1, math.ceil(longest / self.page_size)))

    def _gather_page_table(self, req_pool_indices: torch.Tensor, width: int,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        """Page ids [B, width] int32 of the batch's requests, from req_to_token.

        With ``out`` (a [>= B, >= width] int32 buffer) the result is written into
        ``out[:B, :width]`` and that view returned; columns past ``width`` keep stale values,
        which the kernels never read (they stop at ceil(seq_len / page_size) pages).
        """
        p = self.page_size
        first_slots = self.req_to_token[:, : width * p : p]  # [rows, width]: slot of each page's first token
        rows = first_slots.index_select(0, req_pool_indices.to(torch.int64))
        if out is None:
            return rows // p if p > 1 else rows
        view = out[: rows.shape[0], :width]
        if p > 1:
            torch.floor_divide(rows, p, out=view)
        else:
            view.copy_(rows)
        return view

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
        self._plan_extend(forward_batch)

    @staticmethod
    def _refuse_mode(mode) -> None:
        if mode.is_target_verify() or mode.is_draft_extend_v2() or mode.name in ("DLLM_EXTEND", "SPLIT_PREFILL"):
            raise NotImplementedError(f"evenkv: forward mode {mode.name} is not supported (no speculative decoding, "
                                      "dLLM or PD multiplexing)")

    def _plan_decode(self, forward_batch) -> None:
        bs = forward_batch.batch_size
        seq_lens_cpu = forward_batch.seq_lens_cpu
        page_table = self._gather_page_table(forward_batch.req_pool_indices[:bs], self._page_width(seq_lens_cpu))
        plans = {kind: attention.plan(self._decode_cu_seqlens[:bs + 1], forward_batch.seq_lens[:bs], page_table,
                                      num_decodes=bs, max_q_len=1,
                                      seq_lens_cpu=seq_lens_cpu[:bs] if seq_lens_cpu is not None else None)
                 for kind, attention in self.attentions.items()}
        self.forward_metadata = ForwardMetadata(plans, bs, decode=True)

    def _plan_extend(self, forward_batch) -> None:
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
        page_table = self._gather_page_table(forward_batch.req_pool_indices[:bs], self._page_width(seq_lens_cpu))
        max_seq_len = int(max(seq_lens_cpu)) if seq_lens_cpu is not None and len(seq_lens_cpu) else None
        plans = {kind: attention.plan(cu_seqlens_q, forward_batch.seq_lens[:bs], page_table, num_decodes=0,
                                      max_q_len=max_q_len, max_seq_len=max_seq_len)
                 for kind, attention in self.attentions.items()}
        self.forward_metadata = ForwardMetadata(plans, total_q, decode=False)

    # -- CUDA graphs (decode) --------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed-address decode buffers for batches up to ``max_bs`` requests (1 token each)."""
        if max_num_tokens != max_bs:
            raise NotImplementedError(f"evenkv: decode CUDA graphs with {max_num_tokens} tokens for {max_bs} requests "
                                      "(more than one query token per request) are not supported")
        pool_rows = next(iter(self.attentions.values())).max_batch_size
        if max_bs > pool_rows:
            raise ValueError(f"evenkv: CUDA graphs of up to {max_bs} requests, but the request pool holds {pool_rows}")
        self.cuda_graph_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self.cuda_graph_page_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int32, device=self.device)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Host side of a graph step (before capture and before each replay): refill the
        fixed buffers in place. ``forward_batch`` is a ForwardBatch at capture and a
        SimpleNamespace view at replay (padded: ``batch_size``, ``req_pool_indices``,
        ``seq_lens``, ``seq_lens_cpu``, ``num_padding``)."""
        self.errors.poll()
        mode = forward_batch.forward_mode
        if not mode.is_decode_or_idle():
            # Prefill graph runners call init_forward_metadata; anything else here is a
            # speculative graph, which the factory refused.
            raise NotImplementedError(f"evenkv: CUDA graphs for forward mode {mode.name} are not supported")
        if self.cuda_graph_seq_lens is None:
            raise RuntimeError("evenkv: init_cuda_graph_state must run before init_forward_metadata_out_graph")
        bs = forward_batch.batch_size
        padding = int(getattr(forward_batch, "num_padding", 0) or 0)
        seq_lens = self.cuda_graph_seq_lens[:bs]
        seq_lens.copy_(forward_batch.seq_lens[:bs])
        if padding:
            seq_lens[bs - padding:].zero_()  # padded rows: no work, zero output
        seq_lens_cpu = forward_batch.seq_lens_cpu
        width = self._page_width(seq_lens_cpu[: bs - padding] if seq_lens_cpu is not None else None)
        self._gather_page_table(forward_batch.req_pool_indices[:bs], width, out=self.cuda_graph_page_table)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Recorded into the graph: plan on the fixed buffers (GPU work only)."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError(f"evenkv: CUDA graphs for forward mode {forward_batch.forward_mode.name} "
                                      "are not supported")
        bs = forward_batch.batch_size
        plans = {kind: attention.plan(self._decode_cu_seqlens[:bs + 1], self.cuda_graph_seq_lens[:bs],
                                      self.cuda_graph_page_table[:bs], num_decodes=bs, max_q_len=1)
                 for kind, attention in self.attentions.items()}
        self.forward_metadata = ForwardMetadata(plans, bs, decode=True)

    # -- forward ------------------------------------------------------------------------

    def _check_layer(self, layer, kwargs: dict) -> None:
        """Refuse per-layer features evenkv lacks (each layer checked once; score_mod every call)."""
        if kwargs.get("score_mod") is not None:
            raise NotImplementedError(f"evenkv: score_mod (layer {layer.layer_id}) is not supported")
        if layer.layer_id in self._layer_kind:
            return
        problems = []
        kind = LayerKind.of(layer)
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

    def _save_kv(self, layer, forward_batch, k, v) -> None:
        if layer.k_scale is None:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        else:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale,
                                                layer.v_scale)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """q [B, Hq*D] (or [B, Hq, D]); k, v [B, Hkv, D] or None (shared KV). Returns [B, Hq*D]."""
        meta = self._metadata(layer, kwargs, decode=True)
        if save_kv_cache and k is not None:
            self._save_kv(layer, forward_batch, k, v)
        q3 = q.reshape(-1, self.num_q_heads, self.head_dim)
        out = q3.new_empty(q3.shape)
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        self._run(layer, meta, q3, k_cache, v_cache, out, None, None, kwargs.get("sinks"))
        return out.view(-1, self.num_q_heads * self.head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """q [T, Hq*D]; k, v [T, Hkv, D] or None (shared KV: read from the pool). T may exceed
        the batch's tokens (padded prefill graphs): those rows of the result are zeros.
        Returns [T, Hq*D], in ``forward_batch._attn_output`` when the runner provides one
        (SGLang's prefill-graph path; [T, Hq*D] or [T, Hq, D], contiguous)."""
        meta = self._metadata(layer, kwargs, decode=False)
        if (k is None) != (v is None):
            raise ValueError("evenkv: forward_extend got only one of k and v")
        if save_kv_cache and k is not None:
            self._save_kv(layer, forward_batch, k, v)
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
        # tokens are read back from the cache.
        # Deterministic mode reads the new tokens back from the cache too (they were just
        # written): then a prompt's tiles do not depend on how it was chunked. So does an FP8
        # pool: its new tokens are read as quantized, as decode will read them (and SGLang
        # divided k and v by the scales in place when it wrote them).
        from_cache = k is None or (save_kv_cache and (self.deterministic or self.fp8))
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

    def _metadata(self, layer, kwargs: dict, *, decode: bool) -> ForwardMetadata:
        self._check_layer(layer, kwargs)
        meta = self.forward_metadata
        if meta is None or meta.decode != decode:
            raise RuntimeError(f"evenkv: forward_{'decode' if decode else 'extend'} without a planned "
                               f"{'decode' if decode else 'extend'} batch (init_forward_metadata)")
        return meta


def model_layer_kinds(model) -> tuple[dict[int, LayerKind], torch.dtype | None]:
    """The kind of each of ``model``'s attention layers (by layer id), and the dtype of its
    attention sinks (a ``sinks`` parameter, as gpt-oss's attention blocks hold; None without):
    start-up compiles the kernels for the sinks the layers will pass."""
    from sglang.srt.layers.radix_attention import RadixAttention

    kinds = {m.layer_id: LayerKind.of(m) for m in model.modules() if isinstance(m, RadixAttention)}
    sinks = [p.dtype for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"]
    return kinds, sinks[0] if sinks else None


@torch.compiler.disable
def _run(attention: Attention, plan: AttentionPlan, q, k_cache, v_cache, out, k_new, v_new, sm_scale: float,
         sinks, scales: dict) -> None:
    attention.run(plan, q, k_cache, v_cache, k_new=k_new, v_new=v_new, out=out, sm_scale=sm_scale, sinks=sinks,
                  **scales)


__all__ = ["EvenKVAttnBackend", "ForwardMetadata", "LayerKind", "model_layer_kinds"]
