"""Adapters that run one decode-attention implementation on the benchmark's common batch.

One small module per implementation; each is imported lazily and exposes

    FAMILY: str                         the ``impl`` column of the CSV
    available() -> (bool, str)          can it run here? the reason when not
    version() -> str                    for the CSV ("" when unknown)
    variants(ctx) -> [(variant, default)]  the variants it offers; default ones run
                                        unless ``--impls`` names others
    make(variant, ctx) -> Runner        one runner per (shape, T, page size)

A ``Runner`` owns its workspaces (allocated once, at most ``ctx.max_batch`` requests)
and is driven per sweep point as

    runner.prepare(batch)   untimed host work: index formats, views, buffers
    runner.plan()           timed on its own (host and device time); may do nothing
    runner.run()            timed: GPU work only, writes ``batch.out``
    runner.describe()       untimed, after the timing: the config it resolved to

so every implementation reads the same data, in the same page placement, through its
own usual index format. Peers are imported by their normal module paths (on the H200
the device kit of peers provides them); no peer source lives in this repo.
"""

import functools
import importlib
from dataclasses import dataclass, field

import torch

# Adapter modules in the order the sweep runs them at each point. FlashInfer comes
# last: on a fresh machine its first use waits for a JIT build.
MODULES = ("evenkv_impl", "fa3", "sglang_triton", "vllm_triton", "flashinfer")


@dataclass(frozen=True)
class Shape:
    """Attention geometry of one model (per tensor-parallel rank)."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    note: str = ""

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class Context:
    """What a runner is built for: one shape, one page size, one KV pool."""

    shape: Shape
    dtype: torch.dtype
    device: torch.device
    page_size: int
    max_batch: int          # largest B of the sweep
    max_pages: int          # widest page-table row the sweep can produce
    sm_scale: float
    num_sms: int


@dataclass
class Batch:
    """One sweep point, in every index format the implementations use.

    seq_lens [B] int32 and seq_lens_host (list); page_table [B, max_pages] int32 (rows
    padded with 0); page_indptr [B + 1] / page_indices [sum pages] / last_page_len [B]
    int32 (FlashInfer's CSR form of the same placement); k_pages / v_pages
    [num_pages, page_size, Hkv, D] (the pool, shared by every point); q / out [B, Hq, D].
    Token-level indices (SGLang) are derived on first use.
    """

    seq_lens_host: list
    seq_lens: torch.Tensor
    page_size: int
    page_table: torch.Tensor
    page_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_len: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_len(self) -> int:
        return max(self.seq_lens_host)

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens_host)

    @property
    def k_slots(self) -> torch.Tensor:
        """[num_slots, Hkv, D] view of the K pool (slot = page * page_size + offset)."""
        return self.k_pages.view(-1, *self.k_pages.shape[2:])

    @property
    def v_slots(self) -> torch.Tensor:
        return self.v_pages.view(-1, *self.v_pages.shape[2:])

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """[B + 1] int32 = 0..B (one query token per request)."""
        if "cu_q" not in self._cache:
            self._cache["cu_q"] = torch.arange(self.batch_size + 1, dtype=torch.int32, device=self.q.device)
        return self._cache["cu_q"]

    def token_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_indptr [B + 1] int32, token slots [T] int32) for SGLang's token pool:
        token t of request b sits in slot page_table[b, t // P] * P + t % P."""
        if "tok" not in self._cache:
            dev, p = self.q.device, self.page_size
            lens = self.seq_lens.long()
            indptr = torch.zeros(self.batch_size + 1, dtype=torch.long, device=dev)
            indptr[1:] = torch.cumsum(lens, 0)
            req = torch.repeat_interleave(torch.arange(self.batch_size, device=dev), lens)
            tok = torch.arange(self.total_tokens, device=dev) - indptr[req]
            page = self.page_indices.long()[self.page_indptr.long()[req] + tok // p]
            slots = (page * p + tok % p).to(torch.int32)
            self._cache["tok"] = (indptr.to(torch.int32), slots)
        return self._cache["tok"]


class Runner:
    """Base runner: see the module docstring. ``config`` is fixed at construction."""

    config = ""

    def prepare(self, batch: Batch) -> None:
        self.batch = batch

    def plan(self) -> None:
        pass

    def run(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return self.config


@functools.lru_cache(maxsize=None)
def load(module: str):
    """The adapter module ``module`` (one of MODULES)."""
    return importlib.import_module(f"{__name__}.{module}")


def try_import(name: str):
    """(module, "") or (None, reason): a peer that is missing is skipped, with the reason."""
    try:
        return importlib.import_module(name), ""
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"import {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def module_version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001
        return ""
    shim = " (kit shim)" if getattr(mod, "EVENKV_SHIM", False) else ""
    return f"{getattr(mod, '__version__', '?')}{shim}"
