"""A draft model's decode steps on evenkv under SGLang's EAGLE-family speculation
(``--speculative-draft-attention-backend evenkv``; imported lazily by
``evenkv.integrations.sglang``).

SGLang's EAGLE worker drafts ``speculative_num_steps`` tokens a step. After the draft model's
extend (DRAFT_EXTEND_V2, on the draft model runner's own backend), it runs the draft model
``speculative_num_steps - 1`` times, step i on ``attn_backends[i]`` of a multi-step backend,
whose metadata it prepares once before the first step (``init_forward_metadata``, or the
out/in-graph pair of SGLang's draft CUDA-graph runner).

With ``speculative_eagle_topk`` 1 the drafts form a chain, and SGLang has already put their
slots in ``req_to_token`` after each request's prefix (``assign_draft_cache_locs``): request
b's draft j lies at position ``seq_lens[b] + j``, at any page size. So step i (0-based) is
a plain decode batch of B rows, one query token each, over ``seq_lens + i + 1`` tokens of
the same page table: step i writes its token's K/V to ``out_cache_loc`` (draft i's slot),
then reads it with the drafts before it. One page table is built for all steps (lengths of
the last) before the first. An ``evenkv.Attention`` holds one plan at a time, so step i is
planned at its first layer's call, after step i - 1's layers have run: inside a draft graph
that plan is recorded between the two steps' layers, as it runs eagerly.

Draft trees (topk > 1: each branch's drafts in a region of their own) and the hybrid SWA
pool are refused by the plugin's checks; SGLang's ``triton`` backend serves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from evenkv.integrations.sglang_backend import SGLANG_INDEX_DTYPE, EvenKVAttnBackend, ForwardMetadata


class DraftStepBackend(AttentionBackend):
    """Draft step ``step``'s backend (``EvenKVMultiStepDraftBackend.attn_backends[step]``): the
    draft model's layers call ``forward_decode`` on it; it runs them on the draft runner's
    kernels with the step's plan."""

    def __init__(self, drafts: "EvenKVMultiStepDraftBackend", step: int):
        super().__init__()
        self.drafts = drafts
        self.step = step

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """q [B, Hq*D]; k, v [B, Hkv, D]. Returns [B, Hq*D]."""
        return self.drafts.backend.decode_rows(self.drafts.step_metadata(self.step), q, k, v, layer, forward_batch,
                                               save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise NotImplementedError(f"evenkv: a draft step runs decode rows; got forward mode "
                                  f"{forward_batch.forward_mode.name}")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.drafts.backend.get_cuda_graph_seq_len_fill_value()


@dataclass
class _DraftBatch:
    """What every step of one draft plans from. seq_lens: per step i, [B] int64 the lengths
    with drafts 0..i (a tensor of its own: the plan kernels are built for 16-byte aligned
    lengths); tables: the page tables [>= B, pages] int32 (one pool); seq_lens_cpu: [B] the
    lengths before the drafts, or None."""

    seq_lens: list[torch.Tensor]
    tables: dict[bool, torch.Tensor]
    seq_lens_cpu: torch.Tensor | None


class EvenKVMultiStepDraftBackend:
    """SGLang's multi-step draft decode backend, on evenkv (EAGLE-family chains, topk 1).

    backend: the draft model runner's EvenKVAttnBackend, whose kernels every step shares.
    topk: SGLang's ``speculative_eagle_topk`` (1). num_steps: its ``speculative_num_steps``;
    ``attn_backends`` holds its - 1 steps.
    """

    needs_cpu_seq_lens: bool = True  # seq_lens_cpu narrows the page-table copy, as for decode

    def __init__(self, backend: EvenKVAttnBackend, topk: int, num_steps: int):
        if topk != 1:
            raise NotImplementedError(f"evenkv: draft trees (speculative_eagle_topk={topk}); evenkv drafts chains "
                                      "(topk 1)")
        if backend.swa_layer_ids:
            raise NotImplementedError("evenkv: a draft model on the hybrid SWA pool")
        if num_steps < 2:
            raise ValueError(f"evenkv: a multi-step draft backend needs speculative_num_steps >= 2, got {num_steps}")
        self.backend = backend
        self.device = backend.device
        self.attn_backends = [DraftStepBackend(self, step) for step in range(num_steps - 1)]
        self._batch: _DraftBatch | None = None
        self._planned: tuple[_DraftBatch, int, ForwardMetadata] | None = None  # (batch, step, its plans)
        self.cuda_graph_seq_lens: list[torch.Tensor] = []  # per step [max_bs], init_cuda_graph_state
        self.cuda_graph_page_tables: dict[bool, torch.Tensor] = {}

    @property
    def steps(self) -> int:
        return len(self.attn_backends)

    def step_metadata(self, step: int) -> ForwardMetadata:
        """Step ``step``'s plans for the current draft, made at its first layer's call."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("evenkv: a draft step's forward before its multi-step backend's init_forward_metadata")
        if self._planned is None or self._planned[0] is not batch or self._planned[1] != step:
            cpu = None if batch.seq_lens_cpu is None else batch.seq_lens_cpu + (step + 1)
            plans = _plan_step(self.backend, batch.seq_lens[step], batch.tables, cpu)
            self._planned = (batch, step, ForwardMetadata(plans, batch.seq_lens[step].shape[0], True))
        return self._planned[2]

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager: prepare this draft's steps (host work allowed). forward_batch: the DECODE batch
        of B requests, ``seq_lens`` [B] their lengths before the drafts."""
        backend = self.backend
        backend.errors.poll()
        bs = forward_batch.batch_size
        prefix = forward_batch.seq_lens[:bs].to(SGLANG_INDEX_DTYPE)
        lens = [prefix + (step + 1) for step in range(self.steps)]  # step i's own drafts: 0..i
        cpu = forward_batch.seq_lens_cpu
        cpu = cpu[:bs] if cpu is not None else None
        tables = backend._page_tables(forward_batch.req_pool_indices[:bs], lens[-1],
                                      backend._page_width(cpu, self.steps))
        self._batch = _DraftBatch(lens, tables, cpu)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed-address buffers for draft graphs of up to ``max_bs`` requests: each step's
        lengths [max_bs] int64 and one page table [max_bs, max_pages] int32."""
        if max_num_tokens != max_bs:
            raise NotImplementedError(f"evenkv: draft CUDA graphs with {max_num_tokens} tokens for {max_bs} "
                                      "requests; a chain drafts one token per request")
        pool_rows = next(iter(self.backend.attentions.values())).max_batch_size
        if max_bs > pool_rows:
            raise ValueError(f"evenkv: draft CUDA graphs of up to {max_bs} requests, but the request pool holds "
                             f"{pool_rows}")
        self.cuda_graph_seq_lens = [torch.zeros(max_bs, dtype=SGLANG_INDEX_DTYPE, device=self.device)
                                    for _ in range(self.steps)]
        self.cuda_graph_page_tables = {False: torch.zeros(max_bs, self.backend.max_pages, dtype=torch.int32,
                                                          device=self.device)}

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Before capture and before each replay: every step's lengths, and a snapshot of the
        page table (req_to_token may change while the graph runs; see EvenKVAttnBackend).
        Rows SGLang pads a replay with (request 0, its fill length) read the dummy page."""
        if not self.cuda_graph_seq_lens:
            raise RuntimeError("evenkv: init_cuda_graph_state must run before init_forward_metadata_out_graph")
        backend = self.backend
        backend.errors.poll()
        bs = forward_batch.batch_size
        for step, lens in enumerate(self.cuda_graph_seq_lens):
            torch.add(forward_batch.seq_lens[:bs], step + 1, out=lens[:bs])
        cpu = forward_batch.seq_lens_cpu
        width = backend._page_width(cpu[:bs] if cpu is not None else None, self.steps)
        backend._page_tables(forward_batch.req_pool_indices[:bs], self.cuda_graph_seq_lens[-1][:bs], width,
                             out=self.cuda_graph_page_tables)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Recorded into the graph (GPU work only): the steps plan on the fixed buffers, each at
        its first layer (``step_metadata``)."""
        bs = forward_batch.batch_size
        self._batch = _DraftBatch([lens[:bs] for lens in self.cuda_graph_seq_lens], self.cuda_graph_page_tables,
                                  None)


@torch.compiler.disable
def _plan_step(backend: EvenKVAttnBackend, seq_lens, tables, seq_lens_cpu):
    """A draft step's plans, called from inside the draft model's forward: kept out of a
    torch.compile'd graph, as the kernels' launches are."""
    return backend.decode_plans(seq_lens, tables, seq_lens_cpu)


__all__ = ["DraftStepBackend", "EvenKVMultiStepDraftBackend"]
