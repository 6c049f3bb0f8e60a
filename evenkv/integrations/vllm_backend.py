"""evenkv as a vLLM v1 attention backend (selected as ``CUSTOM``; see ``evenkv.integrations.vllm``).

Three classes, as vLLM expects:

* ``EvenKVBackend`` declares what evenkv serves (dtypes, head sizes, page sizes, the KV
  layout) and refuses the rest in ``validate_configuration`` with every reason at once.
* ``EvenKVMetadataBuilder`` runs once per step and KV-cache group, outside any CUDA
  graph. vLLM orders the batch decode first (the builder asks for it with its reorder
  threshold; the V2 model runner always does it); ``build`` finds the split and plans the
  whole batch once per layer kind (``LayerKind``: sliding window, soft-cap, sinks; gpt-oss
  alternates two) with an ``evenkv.Attention`` each: decode rows on the balanced decode
  schedule, the other rows (prefill chunks) on the engine's FlashAttention or evenkv's
  extend kernel. Decode rows have one query token, or with speculative decoding up to
  1 + k (the verify rows of k draft tokens: the reorder threshold is then 1 + k). Every
  plan buffer is allocated in ``__init__``, sized from ``scheduler_config.max_num_seqs``
  and ``max_model_len``, and refilled in place. Drafting builds (``fast_build``: an
  EAGLE / MTP drafter's steps) are the same plan, without the step's error poll.
* ``EvenKVImpl`` (one per layer) writes the new K/V with evenkv's KV-write kernel in
  ``do_kv_cache_update`` (vLLM runs it before ``forward``) and runs the planned batch in
  ``forward``.

KV cache: vLLM's standard ``[num_blocks, Hkv, block_size, 2 * D]`` tensor (K and V
halves of the last dim) in whichever layout vLLM resolves (NHD by default, HND with
``VLLM_KV_CACHE_LAYOUT=HND`` or a connector that asks for it, a connector's cross-layer
allocation): each half views, without a copy, as the ``[num_blocks, block_size, Hkv, D]``
pages evenkv's kernels take with any strides (slot = block * block_size + offset, vLLM's
``slot_mapping``). With
``--kv-cache-dtype fp8`` (e4m3) vLLM allocates it as uint8, viewed here as
float8_e4m3fn, and passes each layer's per-tensor ``_k_scale_float`` / ``_v_scale_float``.

CUDA graphs: ``UNIFORM_SINGLE_TOKEN_DECODE``, or ``UNIFORM_BATCH`` with speculative
decoding (verify steps of 1 + k tokens per request). A uniform decode step (padded to a
capture size; padding requests have q_len 0 and seq_len 0 and are skipped by the
kernels) replays a FULL graph: ``build`` replans on the GPU into the same buffers before
the replay, and the captured kernels read those buffers plus vLLM's persistent block
table. Mixed steps run the attention eagerly (piecewise graphs or none).

Chunked-local layers (Llama 4's ``ChunkedLocalAttention``): vLLM wraps this backend
(``create_chunked_local_attention_backend``) in a builder subclass that declares no CUDA graphs
(the layers run eagerly) and hands ``build`` a virtual batch, one request per (request, chunk of
its query), each with its chunk's block table and length: evenkv plans it as any batch, its plan
buffers sized for the most virtual requests a step can make.

Start-up: the first call of each layer that holds the real tensors (vLLM's warm-up and
dummy runs, before it serves) compiles every kernel variant a later batch can launch,
for vLLM's int32 lengths (``Attention.warmup``), once per layer kind and builder.

Interfaces: vLLM 0.26.0 and 0.33.0 (``docs/design.md``, "Engines").
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers, split_decodes_and_prefills

from evenkv.configs import graph_capturing
from evenkv.decode_attention import MAX_DECODE_Q_LEN
from evenkv.errors import ErrorWatcher
from evenkv.integrations.prefill import vllm_flash_attention

if TYPE_CHECKING:
    from evenkv.attention import Attention, AttentionPlan

POLICY_ENV = "EVENKV_POLICY"
# Under vLLM's logger, whose handler prints INFO (an "evenkv" logger would only reach the root).
logger = logging.getLogger("vllm.evenkv")
# Pages evenkv's kernels take, restricted to what vLLM uses (its default block is 16).
# Listed as exact sizes, not MultipleOf(16): vLLM then splits a larger manager block
# (say 48 or 256) into kernel blocks of the largest size here that divides it.
KERNEL_BLOCK_SIZES = (16, 32, 64, 128)
# vLLM 0.26's KV cache layouts -> the physical order of the logical cache [blocks, Hkv,
# block_size, 2 * D] (False), and of a cross-layer allocation [layers, blocks, Hkv, block_size,
# 2 * D] (True): blocks outermost, so a block's bytes of every layer are together, which is
# what a KV connector asks that allocation for.
KV_CACHE_STRIDE_ORDERS = {"NHD": {False: (0, 2, 1, 3), True: (1, 0, 3, 2, 4)},
                          "HND": {False: (0, 1, 2, 3), True: (1, 2, 0, 3, 4)}}
# SM80: bf16 tensor-core dots (tl.dot) need Ampere or newer.
MIN_COMPUTE_CAPABILITY = (8, 0)
_MODEL_DTYPES = (torch.float16, torch.bfloat16)
_CACHE_DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# vLLM's names of an e4m3 cache (allocated as uint8).
_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# validate_configuration flags (vLLM 0.26 and 0.33) and why evenkv refuses each when set.
# Flags a later vLLM adds are refused by default (see validate_configuration).
_FLAG_REASONS = {
    "use_non_causal": "non-causal (bidirectional) decoder attention is not supported",
    "use_pcp": "prefill context parallelism is not supported",
    "use_dcp": "decode context parallelism is not supported: evenkv returns no LSE for the cross-rank merge",
    "use_adaptive_verification": "adaptive verification (DSpark) is not supported: evenkv picks each step's decode "
                                 "kernel from the host query lengths, which it trims on the device",
    "use_rswa": "reference sliding-window attention (R-SWA) is not supported",
}
# vLLM's seq_lens and query_start_loc are int32 in both model runners and their drafters:
# start-up compiles the kernels for int32 lengths only.
VLLM_INDEX_DTYPE = torch.int32
# KV connectors move whole blocks, in whichever layout vLLM resolves; batch-invariant mode
# selects evenkv's deterministic decode (the builder reads vLLM's switch); each layer's
# sliding window reaches its LayerKind.
_ACCEPTED_FLAGS = ("use_kv_connector", "use_batch_invariant", "has_sliding_window")


def _supported_head_dims() -> tuple[int, ...]:
    from evenkv.checks import SUPPORTED_HEAD_DIMS  # lazy: evenkv imports triton

    return tuple(SUPPORTED_HEAD_DIMS)


class EvenKVBackend(AttentionBackend):
    """evenkv decode attention (balanced persistent split-KV) + evenkv extend, for vLLM v1."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(_MODEL_DTYPES)
    # The cache holds K/V in the model dtype ("auto"; naming that dtype is the same) or in
    # FP8 e4m3 with per-tensor scales.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *_FP8_CACHE_DTYPES]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # must be an AttentionBackendEnum member name

    @staticmethod
    def get_impl_cls() -> type[EvenKVImpl]:
        return EvenKVImpl

    @staticmethod
    def get_builder_cls() -> type[EvenKVMetadataBuilder]:
        return EvenKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        # vLLM 0.33 passes the spec; 0.26 calls this with no argument.
        return list(KERNEL_BLOCK_SIZES)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """Logical shape (vLLM 0.26; 0.33 derives the same shape itself): K and V halves of the last dim."""
        if block_size not in KERNEL_BLOCK_SIZES:
            raise ValueError(f"block_size: evenkv takes kernel blocks of {KERNEL_BLOCK_SIZES} tokens, got {block_size}")
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """vLLM 0.26: the physical order of the logical ``[(layers,) blocks, Hkv, block_size, 2 * D]``
        cache, in the layout vLLM resolved (``VLLM_KV_CACHE_LAYOUT``, else the KV connector's, else
        NHD). The kernels take pages of any strides, so every layout works: NHD ``[blocks,
        block_size, Hkv, 2 * D]``, HND ``[blocks, Hkv, block_size, 2 * D]``, and with a layers
        dimension (a KV connector's cross-layer allocation) blocks outermost, each block's layers
        together."""
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        layout = get_kv_cache_layout()
        if layout not in KV_CACHE_STRIDE_ORDERS:
            raise ValueError(f"KV cache layout: expected one of {sorted(KV_CACHE_STRIDE_ORDERS)}, got {layout!r}")
        return KV_CACHE_STRIDE_ORDERS[layout][include_num_layers_dimension]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return None  # vLLM >= 0.33: the kernels take pages of any strides, so any layout

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(_supported_head_dims())

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or any(block_size % size == 0 for size in KERNEL_BLOCK_SIZES)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is None or (capability.major, capability.minor) >= MIN_COMPUTE_CAPABILITY

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # VLLM_BATCH_INVARIANT=1 runs evenkv's deterministic decode

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the decode/extend split is read from the host query_start_loc

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        cache_dtype = _CACHE_DTYPE_NAMES.get(kv_cache_dtype or "auto")
        if cache_dtype is not None and dtype in _MODEL_DTYPES and cache_dtype != dtype:
            return (f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {dtype}: evenkv reads a "
                    "16-bit cache in the model dtype (use kv_cache_dtype='auto' or 'fp8')")
        return None

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                               block_size: int | None, use_mla: bool, has_sink: bool, use_sparse: bool,
                               use_mm_prefix: bool, use_per_head_quant_scales: bool, device_capability,
                               attn_type: str, **flags: bool) -> list[str]:
        """Every reason evenkv cannot serve this configuration ([] = supported).

        ``flags`` are the boolean switches of vLLM's ``AttentionSelectorConfig``
        (``has_sliding_window``, ``use_dcp``, ...); a switch this module does not know (a
        later vLLM's) is refused when set rather than silently accepted.
        """
        reasons = []
        if not cls.supports_head_size(head_size):
            dims = ", ".join(map(str, _supported_head_dims()))
            reasons.append(f"head_size {head_size} not supported (evenkv: {dims})")
        if not cls.supports_dtype(dtype):
            reasons.append(f"dtype {dtype} not supported (evenkv: torch.float16, torch.bfloat16)")
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            reasons.append(f"kv_cache_dtype {kv_cache_dtype!r} not supported: evenkv keeps K/V in the model dtype "
                           "or in FP8 e4m3 with per-tensor scales; use kv_cache_dtype 'auto' or 'fp8'")
        if not cls.supports_block_size(block_size):
            reasons.append(f"block_size {block_size} not supported: evenkv takes kernel blocks of "
                           f"{', '.join(map(str, KERNEL_BLOCK_SIZES))} tokens, so the block size must be a multiple "
                           "of 16")
        if use_mla:
            reasons.append("MLA (latent attention) not supported: evenkv is MHA/GQA")
        if use_sparse:
            reasons.append("sparse attention not supported")
        if use_mm_prefix:
            reasons.append("bidirectional multimodal prefix attention not supported")
        if use_per_head_quant_scales:
            reasons.append("per-head quantization scales not supported (evenkv's FP8 cache has per-tensor scales)")
        if not cls.supports_compute_capability(device_capability):
            reasons.append(f"compute capability {device_capability.major}.{device_capability.minor} not supported "
                           f"(evenkv needs SM{MIN_COMPUTE_CAPABILITY[0]}{MIN_COMPUTE_CAPABILITY[1]} or newer)")
        if not cls.supports_attn_type(attn_type):
            reasons.append(f"attention type {attn_type} not supported: evenkv serves decoder self-attention only")
        for flag, value in flags.items():
            if value and flag not in _ACCEPTED_FLAGS:
                reasons.append(_FLAG_REASONS.get(flag, f"{flag} not supported (unknown to evenkv)"))
        combination = cls.supports_combination(head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                                               use_sparse, use_mm_prefix, device_capability)
        if combination is not None:
            reasons.append(combination)
        return reasons


@dataclass(frozen=True)
class LayerKind:
    """What a layer adds to plain causal attention, as evenkv plans it: layers of one kind
    share a plan. window: sliding window W (HF's ``sliding_window``) or None; logit_cap: c
    or None; sinks: whether the layer has attention sinks."""

    window: int | None = None
    logit_cap: float | None = None
    sinks: bool = False


@dataclass
class EvenKVMetadata:
    """One step's attention metadata for one KV-cache group (shared by its layers).

    num_actual_tokens: rows of q/output to compute (vLLM may pad it; padding rows sit in
        no request and are not written).
    num_decodes / num_decode_tokens: requests [0, num_decodes) are decode rows, on q rows
        [0, num_decode_tokens) (vLLM's split; padding tokens count); num_prefills /
        num_prefill_tokens: the rest (the prefill kernel).
    decode_q_len: the most query tokens of one decode row this step (1; up to 1 + k for
        speculative verify rows), from the host query_start_loc.
    query_start_loc [B+1] int32, seq_lens [B] int32 (KV length including this step's
        tokens), block_table [B, max_pages] int32, slot_mapping [T] int64: vLLM's tensors.
    plans: per layer kind of the group, its ``evenkv.Attention`` and the plan ``build`` made,
        which every layer of that kind runs in ``forward`` (``Attention.run`` refuses a plan
        made stale by a later build).
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode_q_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    plans: dict[LayerKind, tuple[Attention, AttentionPlan]]


def spec_decode_q_len(vllm_config) -> int:
    """The most query tokens of a request vLLM counts as a decode under speculative decoding
    (1 without): 1 + k for a verify row of k draft tokens, 1 + 2k under V1's parallel
    drafting. vLLM 0.33 computes it (``max_decode_query_len``); 0.26 inlines its formula in
    ``_init_reorder_batch_threshold``, mirrored here."""
    try:
        from vllm.v1.attention.backend import max_decode_query_len
    except ImportError:  # vLLM 0.26
        spec = vllm_config.speculative_config
        if spec is None or spec.num_speculative_tokens is None:
            return 1
        return 1 + (2 if spec.parallel_drafting else 1) * spec.num_speculative_tokens
    return max_decode_query_len(vllm_config)


def verify_q_len(vllm_config) -> tuple[int, str]:
    """(q, why): with speculative decoding whose verify rows the decode kernels take, q = the
    most query tokens of one verify row (``spec_decode_q_len``); else q = 1 and the verify
    rows, if any, run with the prefill rows. ``why`` is the start-up log's line."""
    spec = vllm_config.speculative_config
    q_len = spec_decode_q_len(vllm_config)
    if q_len == 1:
        return 1, "no speculative decoding"
    if q_len > MAX_DECODE_Q_LEN:
        return 1, (f"speculative decoding ({spec.method}): verify rows of {q_len} query tokens run with the "
                   f"prefill rows (the decode kernels take up to {MAX_DECODE_Q_LEN}); full CUDA graphs for "
                   "single-token decode steps only")
    return q_len, (f"speculative decoding ({spec.method}, {spec.num_speculative_tokens} draft tokens): verify rows "
                   f"of up to {q_len} query tokens run on the decode kernels")


class EvenKVMetadataBuilder(AttentionMetadataBuilder[EvenKVMetadata]):
    """Splits each batch into decode and extend rows and plans it once for all layers.

    Host work per step: the split and the decode rows' largest query length (from vLLM's
    host ``query_start_loc``) and a few tensor views; GPU work: evenkv's plan kernels (no
    sync, no allocation).
    """

    # Full graphs for uniform decode steps (get_cudagraph_support); mixed steps run attention eagerly.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """``UNIFORM_BATCH`` where verify rows are decode rows (a verify step of 1 + k tokens
        per request is one full graph), else ``UNIFORM_SINGLE_TOKEN_DECODE``."""
        if verify_q_len(vllm_config)[0] > 1:
            return AttentionCGSupport.UNIFORM_BATCH
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decode rows first: requests of at most reorder_batch_threshold query tokens, 1, or
        # 1 + k with speculative decoding (verify rows; short prefill chunks join them: causal
        # rows on a cached prefix, as verify rows are).
        verify, verify_reason = verify_q_len(vllm_config)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=verify > 1)
        from evenkv.attention import Attention  # lazy: the plugin's register() stays light
        from evenkv.configs import resolve_arch
        from evenkv.decode_attention import POLICIES, check_max_q_len

        model_config = vllm_config.model_config
        head_size = kv_cache_spec.head_size
        if getattr(kv_cache_spec, "head_size_v", head_size) != head_size:
            raise NotImplementedError(f"evenkv: K and V head sizes must match, got {head_size} and "
                                      f"{kv_cache_spec.head_size_v}")
        num_q_heads = (get_num_attention_heads_from_layers(vllm_config, layer_names)
                       or model_config.get_num_attention_heads(vllm_config.parallel_config))
        policy = os.environ.get(POLICY_ENV, "balanced")
        if policy not in POLICIES:
            raise ValueError(f"{POLICY_ENV}: expected one of {POLICIES}, got {policy!r}")
        self.page_size = kv_cache_spec.block_size
        self.max_pages = -(-model_config.max_model_len // self.page_size)
        scheduler = vllm_config.scheduler_config
        max_batch_size = scheduler.max_num_seqs
        chunk = getattr(kv_cache_spec, "attention_chunk_size", None)
        if chunk:
            # Chunked-local layers (Llama 4): vLLM's wrapper (create_chunked_local_attention_backend)
            # subclasses this builder and plans make_local_attention_virtual_batches' batch, one
            # virtual request per (request, chunk of C tokens its query touches). q >= 1 query
            # tokens cross at most ceil((q - 1) / C) chunk boundaries: at most 2 + q // C virtual
            # requests (a padding request, q = 0: one), so a step of at most max_num_seqs requests
            # and max_num_batched_tokens tokens makes at most 2 * max_num_seqs + tokens // C. The
            # spec also carries C for the full layers of a group vLLM merged (hybrid KV cache manager
            # off): they only get the larger bound. The page bound holds as it is: a local block
            # table has C / page_size columns, of which the first max_pages hold every key.
            max_batch_size = 2 * scheduler.max_num_seqs + scheduler.max_num_batched_tokens // chunk
        # vLLM allocates an FP8 cache as uint8 (the backend admits e4m3 only).
        fp8 = kv_cache_spec.dtype in (torch.uint8, torch.float8_e4m3fn)
        dtype = model_config.dtype if fp8 else kv_cache_spec.dtype  # a 16-bit cache is in the model dtype
        if self.reorder_batch_threshold > 1:
            # The speculative config is the one thing vLLM's selector does not validate.
            try:
                check_max_q_len(self.reorder_batch_threshold, num_q_heads // kv_cache_spec.num_kv_heads, head_size,
                                resolve_arch(None, torch.device(device)))
            except ValueError as err:
                raise NotImplementedError(f"evenkv: {verify_reason}, which its decode kernels cannot take for "
                                          f"{num_q_heads} query heads per {kv_cache_spec.num_kv_heads} KV heads of "
                                          f"{head_size}: {err}; use fewer speculative tokens") from err
        prefill = vllm_flash_attention(device)
        self.attentions = {}
        for kind, impls in layer_kinds(vllm_config, layer_names).items():
            attention = Attention(
                num_q_heads, kv_cache_spec.num_kv_heads, head_size, self.page_size, dtype, device,
                max_batch_size=max_batch_size, max_pages_per_request=self.max_pages,
                policy=policy, sliding_window=kind.window, logit_cap=kind.logit_cap,
                kv_dtype=torch.float8_e4m3fn if fp8 else None,
                prefill_kernel=prefill if prefill is not None and (not kind.sinks or prefill.takes_sinks(num_q_heads))
                else None,
                deterministic=True if vllm_batch_invariant() else None,
                max_total_tokens=kv_pool_tokens(vllm_config), max_decode_q_len=self.reorder_batch_threshold)
            self.attentions[kind] = attention
            for impl in impls.values():
                if impl is not None:
                    impl.bind_attention(attention)
            logger.info("evenkv: %d attention layer(s) of %s decode on evenkv's kernels (%s; %s); their prefill and "
                        "extend rows run on %s", len(impls), kind, attention.decode_reason, verify_reason,
                        attention.prefill_reason)
        self.errors = ErrorWatcher(device)  # polled once per step: logs bad batch data, never syncs
        self._query_dtype = model_config.dtype
        self._warmed_up = False  # every Attention of this builder warmed up (_warm_up_before_planning)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> EvenKVMetadata:
        if not self._warmed_up:
            self._warm_up_before_planning()
        if not fast_build:  # a drafter's builds come between two steps of the target, which poll
            self.errors.poll()
        cam = common_attn_metadata
        if cam.causal is not True:
            raise NotImplementedError("evenkv: only causal decoder attention is supported (got a non-causal batch)")
        for name, tensor in (("seq_lens", cam.seq_lens), ("query_start_loc", cam.query_start_loc)):
            if tensor.dtype != VLLM_INDEX_DTYPE:
                raise TypeError(f"common_attn_metadata.{name}: expected vLLM's {VLLM_INDEX_DTYPE} (start-up compiled "
                                f"the kernels for it), got {tensor.dtype}")
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold)
        # Host ints: vLLM's chunked-local wrapper passes numpy ones.
        max_q_len, max_seq_len = int(cam.max_query_len), int(cam.max_seq_len)
        decode_q_len, decode_tokens = self._decode_rows(cam, num_decodes, num_prefills, max_q_len)
        if decode_q_len == 1:
            # Plain decode rows: request b's query is q row b. Rows of q_len 0 only pad a batch
            # (vLLM puts them last, seq_len 0); should they ever outnumber the decode tokens,
            # the extra ones run as (empty) extend rows, which write nothing.
            num_decodes = min(num_decodes, num_decode_tokens)
        rows = {} if decode_q_len == 1 else dict(num_decode_tokens=decode_tokens)
        # Columns past max_model_len can hold no token of a request.
        block_table = cam.block_table_tensor[:, :self.max_pages]
        plans = {kind: (attention, attention.plan(cam.query_start_loc, cam.seq_lens, block_table,
                                                  num_decodes=num_decodes, max_q_len=max_q_len,
                                                  max_seq_len=max_seq_len, decode_q_len=decode_q_len, **rows))
                 for kind, attention in self.attentions.items()}
        return EvenKVMetadata(
            num_actual_tokens=cam.num_actual_tokens, max_query_len=max_q_len, max_seq_len=max_seq_len,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens, decode_q_len=decode_q_len, query_start_loc=cam.query_start_loc,
            seq_lens=cam.seq_lens, block_table=block_table, slot_mapping=cam.slot_mapping, plans=plans)

    def _warm_up_before_planning(self) -> None:
        """Warm up each Attention on a bound cache of its layers before its first plan. vLLM
        builds the metadata of its warm-up runs before their forward, and a plan before warm-up
        would build the decode kernels that set the grids alone, then warm-up the rest: one batch
        of builds instead of two at start-up. Layers not bound yet leave it to the forward."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase, self.layer_names).values()
        for kind, attention in self.attentions.items():
            for layer in layers:
                if attention.warmed_up:
                    break
                impl, cache = getattr(layer, "impl", None), getattr(layer, "kv_cache", None)
                cache = cache[0] if isinstance(cache, (list, tuple)) and cache else cache  # per virtual engine
                bound = isinstance(cache, torch.Tensor) and cache.numel() > 0
                if bound and isinstance(impl, EvenKVImpl) and impl.kind == kind:
                    query = torch.empty(1, impl.num_heads, impl.head_size, dtype=self._query_dtype,
                                        device=cache.device)
                    impl._warm_up([attention], query, cache, torch.empty_like(query))
        self._warmed_up = all(attention.warmed_up for attention in self.attentions.values())

    def _decode_rows(self, cam: CommonAttentionMetadata, num_decodes: int, num_prefills: int,
                     max_q_len: int) -> tuple[int, int]:
        """(the most query tokens of one of the first num_decodes requests, their query tokens),
        from the host query_start_loc: no sync. Without verify rows (reorder threshold 1), (1,
        num_decodes) with nothing read. max_q_len: the batch's, as a host int."""
        if self.reorder_batch_threshold == 1 or num_decodes == 0:
            return 1, num_decodes
        starts = cam.query_start_loc_cpu[:num_decodes + 1]
        if num_prefills == 0:  # every request is a decode row: vLLM's host bound serves
            q_len = min(max_q_len, self.reorder_batch_threshold)
        else:
            q_len = int((starts[1:] - starts[:-1]).max())
        return max(q_len, 1), int(starts[-1])

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> EvenKVMetadata:
        """As ``build``, for the uniform decode batch vLLM captures. Only the addresses matter
        to the graph: the decode plan lives in this builder's buffers and the block table in
        vLLM's persistent one, so every replay reads what the step's ``build`` wrote."""
        metadata = self.build(0, common_attn_metadata)
        if metadata.num_prefills:
            raise RuntimeError(f"evenkv: vLLM asked for a full CUDA graph of a batch with {metadata.num_prefills} "
                               f"requests of more than {self.reorder_batch_threshold} query tokens; this backend "
                               "declares full graphs of uniform decode batches only")
        return metadata


def layer_kinds(vllm_config, layer_names: list[str]) -> dict[LayerKind, dict[str, EvenKVImpl | None]]:
    """The group's layers by kind: name -> the layer's EvenKVImpl (None for a layer of another
    backend); one plain kind for all, with no impls, where vLLM has not registered the layers
    (a builder made before the model)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    kinds: dict[LayerKind, dict[str, EvenKVImpl | None]] = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names).items():
        impl = getattr(layer, "impl", None)
        impl = impl if isinstance(impl, EvenKVImpl) else None
        kinds.setdefault(impl.kind if impl is not None else LayerKind(), {})[name] = impl
    return kinds or {LayerKind(): dict.fromkeys(layer_names)}


def kv_pool_tokens(vllm_config) -> int:
    """Tokens the KV cache holds (vLLM sets num_gpu_blocks before it builds the backends), or
    2**21 where it is not known yet."""
    cache = vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else 1 << 21


def vllm_batch_invariant() -> bool:
    """vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1)."""
    import vllm.envs

    return bool(getattr(vllm.envs, "VLLM_BATCH_INVARIANT", False))


def kv_cache_page_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``[num_blocks, Hkv, block_size, 2 * D]`` cache (logical shape; any layout in memory)
    as evenkv's ``k_cache, v_cache [num_blocks, block_size, Hkv, D]`` views, the two halves of
    the last dim, without a copy; a uint8 (FP8) cache is viewed as float8_e4m3fn."""
    if kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"kv_cache: expected [num_blocks, Hkv, block_size, 2*{head_size}], "
                         f"got shape {tuple(kv_cache.shape)}")
    pages = kv_cache.transpose(1, 2)
    return pages[..., :head_size], pages[..., head_size:]


class EvenKVImpl(AttentionImpl[EvenKVMetadata]):
    """One attention layer: KV write (``do_kv_cache_update``) and attention (``forward``)."""

    supports_dcp: bool = False  # 0.26 defaults to True; evenkv returns no LSE
    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **extra: Any) -> None:
        # Everything the kernels would silently ignore is refused here, where the model's
        # layers are built: these switches do not reach validate_configuration.
        reasons = []
        if alibi_slopes is not None:
            reasons.append("ALiBi slopes")
        if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != num_heads):
            reasons.append(f"attention sinks of shape {tuple(sinks.shape)} (expected [{num_heads}], one per head)")
        if attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {attn_type}")
        if kv_cache_dtype not in EvenKVBackend.supported_kv_cache_dtypes:
            reasons.append(f"kv_cache_dtype {kv_cache_dtype!r}")
        if head_size not in _supported_head_dims():
            reasons.append(f"head_size {head_size}")
        # Extra switches vLLM passes for other backends; their "off" values are accepted.
        for name, value in extra.items():
            if value is not None and value is not False and not (name == "chunk_lookback" and value == -1):
                reasons.append(f"{name}={value!r}")
        if reasons:
            raise NotImplementedError("evenkv attention backend (CUSTOM) does not support: " + "; ".join(reasons))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self._write_warmed_up = False
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.sinks = sinks
        self.kind = LayerKind(sliding_window, self.logits_soft_cap, sinks is not None)
        self.alibi_slopes = None
        # The Attention objects that plan for this layer (its group's builders', a drafter's),
        # which bind themselves here so that a dummy run can warm them up (_warm_up).
        self.attentions: list[Attention] = []

    def bind_attention(self, attention: Attention) -> None:
        """Called by each builder whose plans this layer runs."""
        if all(attention is not bound for bound in self.attentions):
            self.attentions.append(attention)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value [T, Hkv, D] -> cache slots ``slot_mapping`` [N] (N <= T; -1 = padding, skipped)."""
        from evenkv.kv_cache import warmup_write_kv, write_kv

        if kv_cache.numel() == 0:  # the placeholder a layer holds before vLLM binds its cache
            return
        k_cache, v_cache = kv_cache_page_views(kv_cache, self.head_size)
        if not self._write_warmed_up and not graph_capturing():
            # For vLLM's slot_mapping dtype only (int64 in both runners and the drafters).
            warmup_write_kv(k_cache, v_cache, key, value, index_dtypes=(slot_mapping.dtype,))
            self._write_warmed_up = True
        n = min(slot_mapping.shape[0], key.shape[0])
        write_kv(k_cache, v_cache, key[:n], value[:n], slot_mapping[:n], **self._kv_scales(layer, k_cache))

    @staticmethod
    def _kv_scales(layer, k_cache: torch.Tensor) -> dict:
        """The layer's per-tensor K/V scales for an FP8 cache (vLLM keeps host copies)."""
        if k_cache.dtype != torch.float8_e4m3fn:
            return {}
        return dict(k_scale=float(layer._k_scale_float), v_scale=float(layer._v_scale_float))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: EvenKVMetadata | None, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D], kv_cache [num_blocks, Hkv, block_size, 2*D] -> output [T, Hq, D] (in place).

        The new tokens' K/V are already in the cache (``do_kv_cache_update`` ran first), so
        ``key``/``value`` are not read. Rows past ``num_actual_tokens`` are left as they are.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("evenkv: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / dummy run: no batch to attend over
            if kv_cache.numel():  # the cache is bound (not the profiling run's placeholder)
                self._warm_up(self.attentions, query, kv_cache, output)
            return output.fill_(0)
        md = attn_metadata
        if self.kind not in md.plans:
            raise RuntimeError(f"evenkv: no plan for this layer's kind {self.kind} (planned: {list(md.plans)})")
        attention, plan = md.plans[self.kind]
        if not attention.warmed_up:
            self._warm_up([attention], query, kv_cache, output)
        k_cache, v_cache = kv_cache_page_views(kv_cache, self.head_size)
        n = md.num_actual_tokens
        attention.run(plan, query[:n], k_cache, v_cache, out=output[:n], sm_scale=self.scale, sinks=self.sinks,
                      **self._kv_scales(layer, k_cache))
        return output

    def _warm_up(self, attentions: list[Attention], query: torch.Tensor, kv_cache: torch.Tensor,
                 output: torch.Tensor) -> None:
        """The first call that holds the real tensors (vLLM's warm-up and dummy runs, before it
        serves) compiles, for their layout, every kernel variant a later batch can launch: once
        per Attention (layers of one kind share it), never while a graph is being captured."""
        pending = [attention for attention in attentions if not attention.warmed_up]
        if not pending or graph_capturing():
            return
        k_cache, v_cache = kv_cache_page_views(kv_cache, self.head_size)
        start = time.perf_counter()
        for attention in pending:
            attention.warmup(query, k_cache, v_cache, out=output, sinks=self.sinks, index_dtypes=(VLLM_INDEX_DTYPE,))
        logger.info("evenkv: kernels of %d attention object(s) built or loaded in %.2f s", len(pending),
                    time.perf_counter() - start)


__all__ = ["EvenKVBackend", "EvenKVImpl", "EvenKVMetadata", "EvenKVMetadataBuilder", "LayerKind",
           "kv_cache_page_views", "spec_decode_q_len", "verify_q_len", "KERNEL_BLOCK_SIZES", "KV_CACHE_STRIDE_ORDERS",
           "POLICY_ENV", "VLLM_INDEX_DTYPE"]
