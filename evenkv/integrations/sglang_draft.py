"""A draft model's decode steps on evenkv under SGLang's EAGLE-family speculation
(``--speculative-draft-attention-backend evenkv``; imported lazily by
``evenkv.integrations.sglang``).

SGLang's EAGLE worker drafts ``speculative_num_steps`` tokens a step. After the draft model's
extend (DRAFT_EXTEND_V2, on the draft model runner's own backend), it runs the draft model
``speculative_num_steps - 1`` times, step i on ``attn_backends[i]`` of a multi-step backend,
whose metadata it prepares once before the first step (``init_forward_metadata``, or the
out/in-graph pair of SGLang's draft CUDA-graph runner).

Each step grows ``speculative_eagle_topk`` (K) branches per request: query row b * K + k is
request b's branch k. SGLang has put the slots of all drafts in ``req_to_token`` after each
request's prefix (``assign_draft_cache_locs``), branch by branch: branch k's draft j at
position ``seq_lens[b] + k * S + j`` (S = ``speculative_num_steps``). Its own draft decode
kernels read, for row (b, k) at step i, the prefix and the slots of branch k's drafts 0..i
(``generate_draft_decode_kv_indices``), and so does this backend: row (b, k)'s page table is
the request's prefix followed by branch k's draft slots, and step i is a plain decode batch
of B x K rows over ``seq_lens + i + 1`` tokens of it. With K = 1 (a chain) that table is the
request's own ``req_to_token`` row, at any page size; with K > 1 the branches' slots are
token-granular, so trees need page size 1 (SGLang lays them out per page, the prefix's last
page copied per branch, for its own backends only; refused by the plugin's checks).

Step i writes its tokens' K/V to ``out_cache_loc`` (draft i's slots), then reads them with
the drafts before them. One page table is built for all steps before the first. An
``evenkv.Attention`` holds one plan at a time, so step i is planned at its first layer's
call, after step i - 1's layers have run: inside a draft graph that plan is recorded between
the two steps' layers, as it runs eagerly. A draft model on the hybrid SWA pool is refused.
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
        """q [R, Hq*D] (R: requests x topk rows, b-major); k, v [R, Hkv, D]. Returns [R, Hq*D]."""
        return self.drafts.backend.decode_rows(self.drafts.step_metadata(self.step), q, k, v, layer, forward_batch,
                                               save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise NotImplementedError(f"evenkv: a draft step runs decode rows; got forward mode "
                                  f"{forward_batch.forward_mode.name}")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.drafts.backend.get_cuda_graph_seq_len_fill_value()


@dataclass
class _DraftBatch:
    """What every step of one draft plans from. seq_lens: per step i, [R] int64 the rows'
    lengths with drafts 0..i (a tensor of its own: the plan kernels are built for 16-byte
    aligned lengths); tables: the rows' page tables [>= R, pages] int32 (one pool);
    seq_lens_cpu: [R] the rows' lengths before the drafts, or None."""

    seq_lens: list[torch.Tensor]
    tables: dict[bool, torch.Tensor]
    seq_lens_cpu: torch.Tensor | None


class EvenKVMultiStepDraftBackend:
    """SGLang's multi-step draft decode backend, on evenkv (EAGLE family).

    backend: the draft model runner's EvenKVAttnBackend, whose kernels every step shares (its
    Attention objects take ``topk`` rows per request). topk: SGLang's ``speculative_eagle_topk``
    (1: chains, any page size; more: trees, page size 1). num_steps: its
    ``speculative_num_steps``; ``attn_backends`` holds its - 1 steps.
    """

    needs_cpu_seq_lens: bool = True  # seq_lens_cpu narrows the page-table copy, as for decode

    def __init__(self, backend: EvenKVAttnBackend, topk: int, num_steps: int):
        if backend.swa_layer_ids:
            raise NotImplementedError("evenkv: a draft model on the hybrid SWA pool")
        if topk != backend.draft_topk:
            raise ValueError(f"evenkv: draft steps of topk={topk}, but the draft runner's backend was built for "
                             f"speculative_eagle_topk={backend.draft_topk}")
        if topk > 1 and backend.page_size > 1:
            raise NotImplementedError(f"evenkv: draft trees (topk={topk}) on pages of {backend.page_size} tokens")
        if num_steps < 2:
            raise ValueError(f"evenkv: a multi-step draft backend needs speculative_num_steps >= 2, got {num_steps}")
        self.backend = backend
        self.device = backend.device
        self.topk = topk
        self.attn_backends = [DraftStepBackend(self, step) for step in range(num_steps - 1)]
        # Where branch k's draft j lies after its request's prefix in req_to_token: k * S + j.
        i64 = dict(dtype=torch.int64, device=self.device)
        self._branch_offsets = (torch.arange(topk, **i64)[:, None] * num_steps
                                + torch.arange(num_steps, **i64)[None, :])  # [K, S]
        self._draft_index = torch.arange(num_steps, **i64)
        self._batch: _DraftBatch | None = None
        self._planned: tuple[_DraftBatch, int, ForwardMetadata] | None = None  # (batch, step, its plans)
        self.cuda_graph_seq_lens: list[torch.Tensor] = []  # per step [max_bs * topk], init_cuda_graph_state
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

    def _rows(self, forward_batch):
        """(req_to_token row [R], length before the drafts [R] int64, its host copy or None) of
        each query row: request b's K branches, b-major."""
        bs, k = forward_batch.batch_size, self.topk
        rows = forward_batch.req_pool_indices[:bs].to(torch.int64)
        prefix = forward_batch.seq_lens[:bs].to(SGLANG_INDEX_DTYPE)
        cpu = forward_batch.seq_lens_cpu
        cpu = cpu[:bs] if cpu is not None else None
        if k > 1:
            rows, prefix = rows.repeat_interleave(k), prefix.repeat_interleave(k)
            cpu = cpu.repeat_interleave(k) if cpu is not None else None
        return rows, prefix, cpu

    def _page_tables(self, rows, prefix, cpu, out=None) -> dict[bool, torch.Tensor]:
        """The rows' page tables, wide enough for every step: the prefix's pages, then (trees)
        each branch's draft slots in place of the chain's (page size 1: page ids are slots)."""
        backend = self.backend
        width = backend._page_width(cpu, self.steps)
        tables = backend._page_tables(rows, prefix + self.steps, width, out=out)
        if self.topk > 1:
            table, token_table = tables[False], backend.req_to_token
            columns = prefix[:, None] + self._draft_index[None, : self.steps]  # [R, steps]
            branch = self._branch_offsets.repeat(rows.shape[0] // self.topk, 1)[:, : self.steps]
            source = (prefix[:, None] + branch).clamp_(max=token_table.shape[1] - 1)
            table.scatter_(1, columns.clamp_(max=table.shape[1] - 1), token_table[rows[:, None], source])
        return tables

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager: prepare this draft's steps (host work allowed). forward_batch: the DECODE batch
        of B requests, ``seq_lens`` [B] their lengths before the drafts."""
        self.backend.errors.poll()
        rows, prefix, cpu = self._rows(forward_batch)
        lens = [prefix + (step + 1) for step in range(self.steps)]  # step i's own drafts: 0..i
        self._batch = _DraftBatch(lens, self._page_tables(rows, prefix, cpu), cpu)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed-address buffers for draft graphs of up to ``max_bs`` requests (``max_bs`` x topk
        rows): each step's lengths [rows] int64 and one page table [rows, max_pages] int32."""
        rows = max_bs * self.topk
        if max_num_tokens != rows:
            raise NotImplementedError(f"evenkv: draft CUDA graphs with {max_num_tokens} tokens for {max_bs} "
                                      f"requests; a draft step runs {self.topk} per request")
        pool_rows = next(iter(self.backend.attentions.values())).max_batch_size
        if rows > pool_rows:
            raise ValueError(f"evenkv: draft CUDA graphs of {rows} rows, but the draft backend plans for {pool_rows}")
        self.cuda_graph_seq_lens = [torch.zeros(rows, dtype=SGLANG_INDEX_DTYPE, device=self.device)
                                    for _ in range(self.steps)]
        self.cuda_graph_page_tables = {False: torch.zeros(rows, self.backend.max_pages, dtype=torch.int32,
                                                          device=self.device)}

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Before capture and before each replay: every step's lengths, and a snapshot of the
        page tables (req_to_token may change while the graph runs; see EvenKVAttnBackend).
        Rows SGLang pads a replay with (request 0, its fill length) read the dummy page."""
        if not self.cuda_graph_seq_lens:
            raise RuntimeError("evenkv: init_cuda_graph_state must run before init_forward_metadata_out_graph")
        self.backend.errors.poll()
        rows, prefix, cpu = self._rows(forward_batch)
        n = rows.shape[0]
        for step, lens in enumerate(self.cuda_graph_seq_lens):
            torch.add(prefix, step + 1, out=lens[:n])
        self._page_tables(rows, prefix, cpu, out=self.cuda_graph_page_tables)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Recorded into the graph (GPU work only): the steps plan on the fixed buffers, each at
        its first layer (``step_metadata``)."""
        n = forward_batch.batch_size * self.topk
        self._batch = _DraftBatch([lens[:n] for lens in self.cuda_graph_seq_lens], self.cuda_graph_page_tables,
                                  None)


@torch.compiler.disable
def _plan_step(backend: EvenKVAttnBackend, seq_lens, tables, seq_lens_cpu):
    """A draft step's plans, called from inside the draft model's forward: kept out of a
    torch.compile'd graph, as the kernels' launches are."""
    return backend.decode_plans(seq_lens, tables, seq_lens_cpu)


__all__ = ["DraftStepBackend", "EvenKVMultiStepDraftBackend"]
