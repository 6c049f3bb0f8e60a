"""Adapters that run one decode-attention implementation on the benchmark's common batch.

One small module per implementation; each is imported lazily and exposes

    FAMILY: str                         the ``impl`` column of the CSV
    available() -> (bool, str)          can it run here? the reason when not
    version() -> str                    for the CSV ("" when unknown)
    variants(ctx) -> [(variant, default)]  the variants it offers; default ones run
                                        unless ``--impls`` names others
    make(variant, ctx) -> Runner        one runner per (shape, T, page size), for batches of
                                        up to ctx.max_q_len query tokens per request

and optionally

    supports(ctx) -> str                why it cannot run this context (page size, head dim,
                                        KV dtype, window, verify rows), "" when it can; groups
                                        it cannot run are left out of the sweep with that reason
    prebuild(variant, ctx) -> [str]     start background builds of the JIT modules it will
                                        load (``start_background``); what it started

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
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Adapter modules in the order the sweep runs them at each point. FlashInfer's come
# last: on a fresh machine their first use waits for a JIT build.
MODULES = ("evenkv_impl", "fa3", "sglang_triton", "sglang_lean", "vllm_triton", "flashinfer",
           "flashinfer_holistic", "flashinfer_xqa")


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
    kv_dtype: torch.dtype | None = None   # the KV pool's dtype; None: the same as dtype
    window: int = 0         # sliding window: a decode row reads keys [len - window, len); 0: none
    max_q_len: int = 1      # query tokens per request of the batches it runs: 1 (plain decode) or up
                            # to 1 + K (speculative verify of K draft tokens)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def kv_fp8(self) -> bool:
        return self.cache_dtype == torch.float8_e4m3fn


def feature_gaps(ctx: Context, fp8_kv: bool, window: bool, verify: bool = False) -> str:
    """``supports`` helper: why an implementation without an fp8 KV cache (``fp8_kv``
    False), without a sliding window (``window`` False) or without rows of several query
    tokens (``verify`` False) cannot run ``ctx``; "" if it can."""
    gaps = []
    if ctx.kv_fp8 and not fp8_kv:
        gaps.append("no fp8 KV cache")
    if ctx.window and not window:
        gaps.append("no sliding window")
    if ctx.max_q_len > 1 and not verify:
        gaps.append("no verify rows")
    return "; ".join(gaps)


@dataclass
class Batch:
    """One sweep point, in every index format the implementations use.

    seq_lens [B] int32 and seq_lens_host (list); page_table [B, max_pages] int32 (rows
    padded with 0); page_indptr [B + 1] / page_indices [sum pages] / last_page_len [B]
    int32 (FlashInfer's CSR form of the same placement); k_pages / v_pages
    [num_pages, page_size, Hkv, D] (the pool, shared by every point; bf16/fp16, or
    float8_e4m3fn holding real / k_scale and real / v_scale); q / out [B * q_len, Hq, D]
    (the model dtype): request b's q_len query tokens are rows b * q_len .. (b + 1) * q_len - 1,
    at positions seq_len - q_len .. seq_len - 1 (q_len 1: plain decode; 1 + K: speculative
    verify of K draft tokens, causal among them). Token-level indices (SGLang) are derived
    on first use.
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
    k_scale: float = 1.0
    v_scale: float = 1.0
    q_len: int = 1
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
        """[B + 1] int32 = 0, q_len, 2 q_len, ..., B q_len (request b's query rows)."""
        if "cu_q" not in self._cache:
            self._cache["cu_q"] = torch.arange(0, self.batch_size * self.q_len + 1, self.q_len, dtype=torch.int32,
                                               device=self.q.device)
        return self._cache["cu_q"]

    def query_rows(self, request: int) -> slice:
        """The rows of q and out that hold ``request``'s query tokens."""
        return slice(request * self.q_len, (request + 1) * self.q_len)

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


REPO = Path(__file__).resolve().parents[2]
_background: dict = {}  # key -> Popen of a job an adapter started (a JIT build)


def start_background(key, argv) -> bool:
    """Run ``argv`` in the background from the repository root (so ``python -m benchmarks...``
    works), once per ``key``, output discarded (a failed build shows again, with its
    message, when the peer builds the module itself). True if started now."""
    if key in _background:
        return False
    # Its own process group, so that stop_background also ends the compilers it starts.
    _background[key] = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
    return True


def stop_background() -> None:
    """End the background jobs still running, with their children, and forget them (a later
    run starts them again); finished ones stay, done."""
    for key, proc in list(_background.items()):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            del _background[key]


def opt_in_only(ctx):
    """``variants`` of a peer that runs only when ``--impls`` names it: its one variant,
    "default", is not in the default sweep, which keeps the published peers."""
    return [("default", False)]


def module_version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001
        return ""
    shim = " (kit shim)" if getattr(mod, "EVENKV_SHIM", False) else ""
    return f"{getattr(mod, '__version__', '?')}{shim}"
