"""SGLang integration (evenkv.integrations.sglang*) against the real SGLang classes.

CPU lane: needs SGLang installed (``bash tests/envs/sglang.sh VENV``); skipped, saying so,
when ``sglang`` is not importable. Kernels run in the Triton interpreter, tiny shapes. Real ``ReqToTokenPool`` / ``MHATokenToKVPool`` objects, real
``ForwardBatch`` / ``RadixAttention`` / ``HybridAttnBackend``; the model runner is a
stand-in carrying the attributes a backend reads. Expected outputs come from the fp32
oracles of ``evenkv.kernels.reference`` on a page table built from the test's own page
allocation (not from ``req_to_token``), with the tolerance rule of helpers.py.

GPU lane (``pytest -m gpu``, e.g. with the SGLang kit sourced): the same pools at realistic
sizes, page size 1 (SGLang's token pool) and 16, a real CUDA graph capture/replay.

SGLang imports the CUDA-linked torchvision at import time; with a CPU torch (or no
torchvision) the inert stub in tests/stubs is put first on sys.path for this module.
"""

import argparse
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed; the SGLang lane needs `bash tests/envs/sglang.sh VENV` "
                "(sglang 0.5.17 + CPU torch) and that venv's python", allow_module_level=True)

_STUBS = str(Path(__file__).resolve().parent.parent / "stubs")
if (torch.version.cuda is None or importlib.util.find_spec("torchvision") is None) and _STUBS not in sys.path:
    sys.path.insert(0, _STUBS)

import sglang  # noqa: E402
from sglang.srt.configs.model_config import AttentionArch  # noqa: E402
from sglang.srt.layers.attention import attention_registry  # noqa: E402
from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel, get_server_args  # noqa: E402
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, ServerArgs  # noqa: E402
from sglang.srt.speculative.ngram_info import NgramVerifyInput  # noqa: E402

from evenkv.integrations import sglang as plugin  # noqa: E402
from evenkv.integrations.sglang_backend import EvenKVAttnBackend, LayerKind  # noqa: E402
from evenkv import errors  # noqa: E402
from evenkv.configs import is_interpreter  # noqa: E402
from evenkv.kernels.reference import extend_reference  # noqa: E402
from helpers import TOLERANCE_FLOOR, assert_close_to_reference  # noqa: E402

GARBAGE_SLOT = 10**8  # req_to_token entries past a request's tokens: out of range if ever read


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    """What every SGLang process does first: load the general plugins (evenkv's entry point)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture(autouse=True)
def scheduler_context():
    """What a tp=1 scheduler process has published: its ServerArgs (a real, resolved one,
    through SGLang's own test override) and a single attention rank."""
    with get_context().override_server_args(attention_backend=plugin.NAME), \
            get_parallel().override(attn_tp_size=1, attn_tp_rank=0, attn_dcp_size=1, attn_dcp_rank=0, attn_cp_size=1):
        yield


@pytest.fixture(scope="module")
def lane():
    """(device, dtype) of this lane: the CPU under the interpreter, else CUDA; bf16."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    return torch.device("cpu"), torch.bfloat16


# -- a model runner stand-in with real pools ------------------------------------------


class World:
    """Real SGLang pools plus the attributes of ``ModelRunner`` an attention backend reads.

    Pages are handed out in random order from 1.. (page 0 is SGLang's reserved dummy page);
    ``pages[r]`` is the test's own record of request r's pages, from which the reference
    page table is built. ``req_to_token`` rows hold the slots (token-granular, as SGLang
    writes them) and GARBAGE_SLOT past each request's capacity; row 0 stays zeros.

    ``swa_layers``: SGLang's hybrid pool (``SWAKVPool``, with its real allocator owning the
    full->SWA mapping): those layers' K/V live in a second, smaller token pool whose pages
    its allocator hands out in its own order (``swa_pages[r]``), so a full slot read as a
    sliding-window one reads the wrong token.
    """

    def __init__(self, page_size, device, dtype, *, hq=None, hkv=None, d=None, layers=2, max_reqs=6, ctx=96,
                 num_pages=None, seed=0, layer_kw=None, kv_dtype=None, swa_layers=None, total_q_heads=None):
        if device.type == "cuda":
            # Hkv * D * 2 bytes = 1024: the row width of the SGLang kit's pre-built store_cache
            # kernel (set_kv_buffer), so the GPU lane compiles nothing with nvcc.
            hq, hkv, d = hq or 8, hkv or 4, d or 128
        else:
            hq, hkv, d = hq or 4, hkv or 2, d or 64
        self.page_size, self.device, self.dtype = page_size, device, dtype
        self.hq, self.hkv, self.d = hq, hkv, d
        self.gen = torch.Generator().manual_seed(seed)  # host: page order
        self.dev_gen = torch.Generator(device=device).manual_seed(seed)  # data, drawn where it lives
        self.req_pool = ReqToTokenPool(size=max_reqs, max_context_len=ctx, device=str(device),
                                       enable_memory_saver=False)
        num_pages = num_pages or max_reqs * math.ceil(ctx / page_size) + 2
        self.swa_layers = frozenset(swa_layers or ())
        if swa_layers is None:
            self.kv_pool = MHATokenToKVPool(size=num_pages * page_size, page_size=page_size, dtype=kv_dtype or dtype,
                                            head_num=hkv, head_dim=d, layer_num=layers, device=str(device),
                                            enable_memory_saver=False, enable_alt_stream=False)
        else:
            num_swa_pages = num_pages - 1  # its own size: slot numbers differ between the pools
            self.kv_pool = SWAKVPool(size=num_pages * page_size, size_swa=num_swa_pages * page_size,
                                     page_size=page_size, dtype=kv_dtype or dtype, head_num=hkv, head_dim=d,
                                     swa_attention_layer_ids=sorted(self.swa_layers),
                                     full_attention_layer_ids=[i for i in range(layers) if i not in self.swa_layers],
                                     device=str(device), enable_alt_stream=False)
            self.allocator = SWATokenToKVPoolAllocator(num_pages * page_size, num_swa_pages * page_size, page_size,
                                                       kv_dtype or dtype, str(device), self.kv_pool, need_sort=False)
        self.swa_pages: dict[int, list[int]] = {}
        for layer in range(layers):
            for buf in self.kv_pool.get_kv_buffer(layer):
                buf.copy_(self.randn(*buf.shape))
        self.free_pages = (torch.randperm(num_pages, generator=self.gen) + 1).tolist()
        self.pages: dict[int, list[int]] = {}
        self.next_req = 1
        # layer_kw: per-layer RadixAttention keywords (sliding_window_size, logit_cap, ...).
        self.layers = [RadixAttention(hq, d, d ** -0.5, hkv, layer_id=i, **(layer_kw[i] if layer_kw else {}))
                       for i in range(layers)]
        # total_q_heads: the model's, split over attention TP ranks (hq per rank).
        model_config = SimpleNamespace(context_len=ctx, attention_arch=AttentionArch.MHA, is_encoder_decoder=False,
                                       get_max_num_attention_heads=lambda: total_q_heads or hq,
                                       get_num_kv_heads=lambda tp: hkv)
        self.runner = SimpleNamespace(device=str(device), gpu_id=0, req_to_token_pool=self.req_pool,
                                      token_to_kv_pool=self.kv_pool, token_to_kv_pool_allocator=None,
                                      kv_index_translator=None, model_config=model_config,
                                      server_args=get_server_args(), page_size=page_size, sliding_window_size=None,
                                      is_draft_worker=False, use_mla_backend=False, dtype=dtype, kv_cache_dtype=dtype,
                                      model=torch.nn.ModuleList(self.layers))

    def add_request(self, capacity: int) -> int:
        """A request slot with pages for ``capacity`` tokens; returns its req_pool index."""
        r = self.next_req
        self.next_req += 1
        n = math.ceil(capacity / self.page_size)
        self.pages[r], self.free_pages = self.free_pages[:n], self.free_pages[n:]
        row = self.req_pool.req_to_token[r]
        row.fill_(GARBAGE_SLOT)
        row[:capacity] = self.slots(r, 0, capacity)
        if self.swa_layers:
            # Sliding-window slots from the pool's own allocator (whose free_swa takes them
            # back), in its order: not the full pool's.
            swa = self.allocator.swa_attn_allocator.alloc(n * self.page_size)
            self.swa_pages[r] = (swa[::self.page_size] // self.page_size).tolist()
            swa_slots = self.slots(r, 0, capacity, swa=True)
            self.allocator.set_full_to_swa_mapping(self.slots(r, 0, capacity), swa_slots)
            for layer in self.swa_layers:  # the request's own tokens (a slot freed before may hold NaN)
                for buf in self.kv_pool.get_kv_buffer(layer):
                    buf[swa_slots] = self.randn(capacity, *buf.shape[1:])
        return r

    def slots(self, r: int, begin: int, end: int, *, swa: bool = False) -> torch.Tensor:
        """Slots of request r's positions [begin, end): in the full pool, or (swa) in the hybrid
        pool's sliding-window pool, as allocated (a position evicted since keeps its record)."""
        pos = torch.arange(begin, end)
        pages = torch.tensor((self.swa_pages if swa else self.pages)[r], dtype=torch.int64)
        return (pages[pos // self.page_size] * self.page_size + pos % self.page_size).to(self.device)

    def layer_slots(self, r: int, layer_id: int, positions) -> list[int]:
        """Slots, in layer layer_id's own pool, of request r's positions."""
        swa = layer_id in self.swa_layers
        return [int(self.slots(r, p, p + 1, swa=swa)) for p in positions]

    def evict_window(self, r: int, end: int, dummy: float = float("nan")) -> None:
        """What SGLang does once positions [0, end) (whole pages) have left every window: free
        their sliding-window slots (the mapping reads the dummy slot 0 for them). The freed
        slots are then filled with NaN, and the sliding-window pool's dummy page with
        ``dummy``: NaN proves nothing reads there, a large finite value that whatever reads
        there only loads it and masks it out (SGLang's dummy page holds finite values)."""
        if end <= 0:
            return
        self.allocator.free_swa(self.slots(r, 0, end))
        for layer in self.swa_layers:
            for buf in self.kv_pool.get_kv_buffer(layer):
                buf[self.slots(r, 0, end, swa=True)] = float("nan")
                buf[: self.page_size] = dummy

    def page_table(self, reqs) -> torch.Tensor:
        """Reference page table [B, max_pages] int32 from the test's own allocation."""
        width = max(len(self.pages[r]) for r in reqs)
        pt = torch.zeros(len(reqs), width, dtype=torch.int32)
        for b, r in enumerate(reqs):
            pt[b, :len(self.pages[r])] = torch.tensor(self.pages[r], dtype=torch.int32)
        return pt.to(self.device)

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.dev_gen, device=self.device).to(self.dtype)

    def qkv(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random q [tokens, Hq * D], k and v [tokens, Hkv, D], as a layer's forward takes them."""
        return (self.randn(tokens, self.hq * self.d), self.randn(tokens, self.hkv, self.d),
                self.randn(tokens, self.hkv, self.d))

    def decode_batch(self, reqs, cached, *, with_cpu_lens=True) -> ForwardBatch:
        """One decode step: request reqs[b] has cached[b] tokens; its new token goes at that position."""
        seq = torch.tensor([c + 1 for c in cached], dtype=torch.int64)
        loc = torch.cat([self.slots(r, c, c + 1) for r, c in zip(reqs, cached)])
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(reqs),
                            input_ids=torch.zeros(len(reqs), dtype=torch.int64, device=self.device),
                            req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=self.device),
                            seq_lens=seq.to(self.device), out_cache_loc=loc, seq_lens_sum=int(seq.sum()),
                            seq_lens_cpu=seq.clone() if with_cpu_lens else None,
                            positions=(seq - 1).to(self.device))

    def extend_batch(self, reqs, prefix, new, mode=ForwardMode.EXTEND) -> ForwardBatch:
        """Prefill/extend: request reqs[b] has prefix[b] cached tokens and new[b] new ones."""
        seq = torch.tensor([p + n for p, n in zip(prefix, new)], dtype=torch.int64)
        loc = torch.cat([self.slots(r, p, p + n) for r, p, n in zip(reqs, prefix, new)])
        ext = torch.tensor(new, dtype=torch.int32)
        start = torch.cumsum(ext, 0) - ext
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)])
        dev = self.device
        return ForwardBatch(forward_mode=mode, batch_size=len(reqs),
                            input_ids=torch.zeros(int(ext.sum()), dtype=torch.int64, device=dev),
                            req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=dev), seq_lens=seq.to(dev),
                            out_cache_loc=loc, seq_lens_sum=int(seq.sum()), seq_lens_cpu=seq.clone(),
                            positions=positions.to(dev), extend_num_tokens=int(ext.sum()),
                            extend_seq_lens=ext.to(dev), extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32,
                                                                                         device=dev),
                            extend_start_loc=start.to(dev), extend_prefix_lens_cpu=list(prefix),
                            extend_seq_lens_cpu=list(new))

    def verify_batch(self, reqs, cached, q_len, masks=None) -> ForwardBatch:
        """TARGET_VERIFY: request reqs[b] has cached[b] tokens and verifies q_len more after them
        (slots already in req_to_token, as SGLang allocates them); masks[b] [q_len, q_len] bool,
        the draft tree (None: a causal chain). SGLang's lengths exclude the drafts; spec_info
        carries the FULL_MASK layout (``full_mask``)."""
        seq = torch.tensor(cached, dtype=torch.int64)
        masks = masks or [chain_mask(q_len)] * len(reqs)
        loc = torch.cat([self.slots(r, c, c + q_len) for r, c in zip(reqs, cached)])
        positions = torch.cat([c + m.sum(1) - 1 for c, m in zip(cached, masks)])  # a token's depth in its tree
        args = self.runner.server_args
        spec_info = verify_input(getattr(args, "speculative_algorithm", None), full_mask(cached, masks).to(self.device),
                                 q_len, getattr(args, "speculative_eagle_topk", None) or 1)
        dev = self.device
        return ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(reqs),
                            input_ids=torch.zeros(len(reqs) * q_len, dtype=torch.int64, device=dev),
                            req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=dev), seq_lens=seq.to(dev),
                            out_cache_loc=loc, seq_lens_sum=int(seq.sum()),
                            seq_lens_cpu=seq.clone(), positions=positions.to(dev),
                            spec_info=spec_info)

    def backend(self) -> EvenKVAttnBackend:
        """Built the way SGLang's model runner builds a backend from --attention-backend."""
        from sglang.srt.model_executor.model_runner_components.attention_backend_setup import \
            _build_full_attention_backend_from_str

        return _build_full_attention_backend_from_str(model_runner=self.runner, backend_str=plugin.NAME,
                                                      init_new_workspace=False)


def layer_terms(layer, sinks=None) -> dict:
    """What a layer adds, in the references' keywords (SGLang's window W - 1 -> W)."""
    terms = {}
    if layer.sliding_window_size > -1:
        terms["sliding_window"] = layer.sliding_window_size + 1
    if layer.logit_cap:
        terms["logit_cap"] = layer.logit_cap
    if sinks is not None:
        terms["sinks"] = sinks
    if layer.k_scale_float is not None:
        terms.update(k_scale=layer.k_scale_float, v_scale=layer.v_scale_float)
    return terms


def check_decode(world, out, q, fb, layer_id=0, sinks=None):
    """out [B, Hq*D] against the fp32 decode oracle over the cache as it is now."""
    reqs = fb.req_pool_indices.tolist()
    k_cache, v_cache = world.kv_pool.get_kv_buffer(layer_id)
    b, hq, d = len(reqs), world.hq, world.d
    assert out.shape == (b, hq * d)
    assert_close_to_reference(out.view(b, hq, d), q.view(b, hq, d), k_cache, v_cache, fb.seq_lens,
                              world.page_table(reqs), world.page_size, d ** -0.5,
                              **layer_terms(world.layers[layer_id], sinks))


def check_extend(world, out, q, fb, layer_id=0, sinks=None):
    """out [T, Hq*D] against the fp32 extend oracle (cache already holds the new tokens)."""
    reqs = fb.req_pool_indices.tolist()
    k_cache, v_cache = world.kv_pool.get_kv_buffer(layer_id)
    t, hq, d = q.shape[0], world.hq, world.d
    cu = torch.zeros(len(reqs) + 1, dtype=torch.int32, device=q.device)
    cu[1:] = torch.cumsum(fb.extend_seq_lens, 0)
    args = (q.view(t, hq, d), k_cache, v_cache, cu, fb.seq_lens, world.page_table(reqs), world.page_size)
    terms = layer_terms(world.layers[layer_id], sinks)
    ref = extend_reference(*args, sm_scale=d ** -0.5, **terms)
    lowp = extend_reference(*args, sm_scale=d ** -0.5, compute_dtype=q.dtype, **terms)
    err = (out.view(t, hq, d).float() - ref).abs().max().item()
    base = (lowp.float() - ref).abs().max().item()
    bound = 2 * base + TOLERANCE_FLOOR[q.dtype]
    assert err <= bound, f"max abs error {err:.3e} > bound {bound:.3e} (torch {q.dtype} error {base:.3e})"


def attention_of(backend):
    """The backend's Attention of plain layers (the worlds' default layers)."""
    return backend.attentions[LayerKind()]


def verify_input(algorithm, custom_mask, q_len, topk):
    """The SpecInput SGLang's worker for ``algorithm`` hands a verify batch (EAGLE's for the
    EAGLE family, NGRAM's otherwise), carrying custom_mask and q_len draft tokens."""
    if algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        return EagleVerifyInput(draft_token=None, custom_mask=custom_mask, positions=None, retrieve_index=None,
                                retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None,
                                spec_steps=q_len - 1, topk=topk, draft_token_num=q_len, capture_hidden_mode=None,
                                seq_lens_sum=None, seq_lens_cpu=None)
    return NgramVerifyInput(custom_mask=custom_mask, draft_token_num=q_len)


def chain_mask(q_len: int) -> torch.Tensor:
    """[q_len, q_len] bool: draft i sees drafts 0..i (EAGLE with topk 1)."""
    return torch.ones(q_len, q_len, dtype=torch.bool).tril()


def random_tree_mask(q_len: int, gen: torch.Generator) -> torch.Tensor:
    """[q_len, q_len] bool of a random draft tree rooted at draft 0: draft i sees itself and
    its ancestors (what SGLang's tree builders write)."""
    mask = torch.eye(q_len, dtype=torch.bool)
    for i in range(1, q_len):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] |= mask[parent]
    return mask


def branches(masks) -> bool:
    """Whether some draft tree is not a chain: a token deeper in the list than in its tree."""
    return any(int(m[j].sum()) - 1 < j for m in masks for j in range(m.shape[0]))


def full_mask(cached, masks) -> torch.Tensor:
    """SGLang's FULL_MASK custom_mask: per request the q_len x (cached + q_len) rows of its
    drafts (every cached token visible, then the tree), flattened, requests back to back."""
    return torch.cat([torch.cat([torch.ones(m.shape[0], c, dtype=torch.bool), m], 1).flatten()
                      for c, m in zip(cached, masks)])


def visible_slots(world, layer, reqs, starts, q_lens, masks=None) -> list[list[int]]:
    """Per query row, the slots (in the layer's own pool) of the keys it attends to: query i of
    request reqs[b] sees every earlier position and the new tokens masks[b] allows (None:
    causal), all within the layer's window. New token j sits at position starts[b] + its depth
    (j in a chain; in a tree, masks[b][j]'s count less one, SGLang's positions). From the
    test's own slot records, not from req_to_token or the pool's mapping."""
    window = layer.sliding_window_size + 1 if layer.sliding_window_size > -1 else None
    rows = []
    for b, (r, start, q_len) in enumerate(zip(reqs, starts, q_lens)):
        depth = list(range(q_len)) if masks is None else [int(masks[b][j].sum()) - 1 for j in range(q_len)]
        for i in range(q_len):
            pos = start + depth[i]
            keys = [(p, p) for p in range(start)] + [
                (start + j, start + depth[j]) for j in range(q_len) if (j <= i if masks is None else bool(masks[b][i, j]))]
            seen = [p for p, at in keys if window is None or at > pos - window]
            rows.append(world.layer_slots(r, layer.layer_id, seen))
    return rows


def check_against_slots(world, out, q, rows, layer, sinks=None):
    """out, q [R, Hq*D]: row i against the fp32 oracle over exactly the keys rows[i] lists
    (slot ids of the layer's pool, read as a page-size-1 cache), the layer's soft-cap and
    sinks, the tolerance rule of helpers.py."""
    k_cache, v_cache = world.kv_pool.get_kv_buffer(layer.layer_id)
    hq, d = world.hq, world.d
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int32, device=q.device)
    table = torch.zeros(len(rows), max(1, int(lens.max())), dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    terms = {k: v for k, v in layer_terms(layer, sinks).items() if k != "sliding_window"}  # rows hold the window
    assert out.shape == (len(rows), hq * d)
    assert_close_to_reference(out.view(-1, hq, d), q.view(-1, hq, d), k_cache, v_cache, lens, table.to(q.device), 1,
                              d ** -0.5, **terms)


# -- registration and selection --------------------------------------------------------


def test_entry_point_is_declared_and_loaded():
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == plugin.NAME]
    assert len(eps) == 1, "evenkv's sglang.srt.plugins entry point is not installed (pip install -e .)"
    assert eps[0].value == "evenkv.integrations.sglang:register"
    assert eps[0].load() is plugin.register
    # The plugins_loaded fixture ran sglang.srt.plugins.load_plugins(), nothing else registered.
    assert plugin.NAME in ATTENTION_BACKEND_CHOICES
    assert attention_registry.ATTENTION_BACKENDS[plugin.NAME] is plugin.create_backend


def test_register_is_idempotent():
    plugin.register()
    plugin.register()
    assert ATTENTION_BACKEND_CHOICES.count(plugin.NAME) == 1
    assert attention_registry.ATTENTION_BACKENDS[plugin.NAME] is plugin.create_backend


@pytest.mark.parametrize("argv", [
    ["--attention-backend", "evenkv"],
    ["--prefill-attention-backend", "torch_native", "--decode-attention-backend", "evenkv"],
    ["--attention-backend", "triton", "--decode-attention-backend", "evenkv"],
    ["--attention-backend", "evenkv", "--speculative-draft-attention-backend", "evenkv"],
])
def test_cli_accepts_evenkv(argv):
    plugin.register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "unused"] + argv)
    given = dict(zip(argv[::2], argv[1::2]))
    for flag, value in given.items():
        assert getattr(args, flag[2:].replace("-", "_")) == value


def test_cli_rejects_unknown_backend():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "unused", "--attention-backend", "evenkv-not-a-backend"])


def test_registry_builds_backend(lane):
    plugin.register()
    world = World(1, *lane)
    backend = world.backend()
    assert isinstance(backend, EvenKVAttnBackend)
    assert (backend.num_q_heads, backend.num_kv_heads, backend.head_dim) == (world.hq, world.hkv, world.d)
    assert attention_of(backend).decode.policy == "balanced"
    assert backend.get_cuda_graph_seq_len_fill_value() == 1


def test_policy_from_environment(lane, monkeypatch):
    monkeypatch.setenv(plugin.POLICY_ENV, "fa3")
    assert attention_of(World(1, *lane).backend()).decode.policy == "fa3"
    monkeypatch.setenv(plugin.POLICY_ENV, "fastest")
    with pytest.raises(NotImplementedError, match="EVENKV_POLICY"):
        World(1, *lane).backend()


@pytest.mark.parametrize("overrides,fragment", [
    (dict(use_mla_backend=True), "MLA"),
    (dict(page_size=3), "page size 3"),
    (dict(is_draft_worker=True), "a draft model under speculative algorithm None"),
    # Llama 4: SGLang sets it from the model config; its own check misses a decode-only evenkv.
    (dict(attention_chunk_size=8192), "chunked local attention"),
])
def test_refuses_unsupported_runner(lane, overrides, fragment):
    world = World(1, *lane)
    for key, value in overrides.items():
        setattr(world.runner, key, value)
    with pytest.raises(NotImplementedError, match=fragment):
        world.backend()


def test_refusal_lists_every_reason(lane):
    world = World(1, *lane)
    # A resolved ServerArgs is read-only; the factory reads these three fields.
    world.runner.server_args = SimpleNamespace(speculative_algorithm="DFLASH", enable_pdmux=True, dllm_algorithm=None)
    world.runner.model_config.is_encoder_decoder = True
    with pytest.raises(NotImplementedError) as info:
        world.backend()
    for fragment in ("speculative decoding with DFLASH", "PD multiplexing", "encoder-decoder"):
        assert fragment in str(info.value)


def test_refuses_fp8_e5m2_kv_cache(lane):
    device, dtype = lane
    world = World(1, device, dtype)
    world.runner.token_to_kv_pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float8_e5m2,
                                                     head_num=world.hkv, head_dim=world.d, layer_num=1,
                                                     device=str(device),
                                                     enable_memory_saver=False, enable_alt_stream=False)
    with pytest.raises(NotImplementedError, match="KV cache dtype"):
        world.backend()


@pytest.mark.parametrize("layer_kw,kwargs,fragment", [
    (dict(logit_cap=30.0), {}, "not among the model's layer kinds"),
    (dict(sliding_window_size=127), {}, "not among the model's layer kinds"),
    (dict(logit_cap=30.0, logit_capping_method="gelu"), {}, "logit capping method"),
    (dict(is_cross_attention=True), {}, "cross attention"),
])
def test_refuses_unsupported_layer(lane, layer_kw, kwargs, fragment):
    world = World(1, *lane)
    backend = world.backend()
    r = world.add_request(8)
    fb = world.decode_batch([r], [5])
    backend.init_forward_metadata(fb)
    layer = RadixAttention(world.hq, world.d, world.d ** -0.5, world.hkv, layer_id=0, **layer_kw)
    with pytest.raises(NotImplementedError, match=fragment):
        backend.forward(world.randn(1, world.hq * world.d), world.randn(1, world.hkv, world.d),
                        world.randn(1, world.hkv, world.d), layer, fb, **kwargs)


# -- eager decode and extend ------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("with_cpu_lens", [True, False])
def test_decode_matches_reference(lane, page_size, with_cpu_lens):
    world = World(page_size, *lane)
    backend = world.backend()
    cached = [0, 40, 3, 17]  # a one-token request, a long one, and odd lengths
    reqs = [world.add_request(c + 1) for c in cached]
    fb = world.decode_batch(reqs, cached, with_cpu_lens=with_cpu_lens)
    backend.init_forward_metadata(fb)
    for layer in world.layers:  # one plan, every layer
        q, k, v = (world.randn(len(reqs), world.hq * world.d), world.randn(len(reqs), world.hkv, world.d),
                   world.randn(len(reqs), world.hkv, world.d))
        out = backend.forward(q, k, v, layer, fb)
        k_cache, v_cache = world.kv_pool.get_kv_buffer(layer.layer_id)
        assert torch.equal(k_cache[fb.out_cache_loc], k) and torch.equal(v_cache[fb.out_cache_loc], v)
        check_decode(world, out, q, fb, layer.layer_id)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_matches_reference(lane, page_size):
    world = World(page_size, *lane)
    backend = world.backend()
    prefix, new = [0, 21, 16, 5], [13, 7, 1, 30]  # fresh prompt, chunked prefill on a prefix, a 1-token extend
    reqs = [world.add_request(p + n) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new)
    backend.init_forward_metadata(fb)
    t = sum(new)
    for layer in world.layers:
        q, k, v = world.qkv(t)
        out = backend.forward(q, k, v, layer, fb)
        k_cache = world.kv_pool.get_key_buffer(layer.layer_id)
        assert torch.equal(k_cache[fb.out_cache_loc], k)
        check_extend(world, out, q, fb, layer.layer_id)


GPT_OSS_LIKE = [dict(sliding_window_size=15), {}]  # alternating 16-token window and full layers


@pytest.mark.parametrize("layer_kw,sinks", [(GPT_OSS_LIKE, True), ([dict(logit_cap=5.0)] * 2, False)],
                         ids=["window+sinks", "softcap"])
def test_layer_kinds_decode_and_extend(lane, layer_kw, sinks):
    """Layers of two kinds (window and full, with sinks; or soft-capped): one plan per kind
    and batch, each layer's result against the reference with its own window, cap and sinks."""
    world = World(16, *lane, layer_kw=layer_kw)
    backend = world.backend()
    assert set(backend.attentions) == {LayerKind.of(layer) for layer in world.layers}
    prefix, new = [0, 40, 7], [23, 9, 30]
    reqs = [world.add_request(p + n + 1) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new)
    backend.init_forward_metadata(fb)
    t = sum(new)
    for layer in world.layers:
        sink = torch.randn(world.hq, device=world.device) if sinks else None
        q, k, v = world.qkv(t)
        out = backend.forward(q, k, v, layer, fb, sinks=sink)
        check_extend(world, out, q, fb, layer.layer_id, sink)
    cached = [p + n for p, n in zip(prefix, new)]
    fb = world.decode_batch(reqs, cached)
    backend.init_forward_metadata(fb)
    for layer in world.layers:
        sink = torch.randn(world.hq, device=world.device) if sinks else None
        q, k, v = (world.randn(len(reqs), world.hq * world.d), world.randn(len(reqs), world.hkv, world.d),
                   world.randn(len(reqs), world.hkv, world.d))
        out = backend.forward(q, k, v, layer, fb, sinks=sink)
        check_decode(world, out, q, fb, layer.layer_id, sink)


def test_fp8_kv_pool(lane, monkeypatch):
    """--kv-cache-dtype fp8_e4m3: SGLang quantizes on write (new / k_scale); evenkv reads the
    pool with the layer's scales, and reads an extend's new tokens back from it. Extend rows on
    evenkv's Triton extend (q in 16 bits, this file's tolerance): on a GPU with SGLang's FA3 they
    would run its 8-bit path, which tests/gpu/test_prefill_gpu.py checks to its own tolerance."""
    monkeypatch.setenv("EVENKV_PREFILL", "triton")
    device, dtype = lane
    world = World(16, device, dtype, kv_dtype=torch.float8_e4m3fn)
    for layer in world.layers:
        layer.k_scale = layer.k_scale_float = 0.5
        layer.v_scale = layer.v_scale_float = 0.25
    backend = world.backend()
    assert attention_of(backend).kv_dtype == torch.float8_e4m3fn and attention_of(backend).dtype == dtype
    prefix, new = [0, 33], [20, 5]
    reqs = [world.add_request(p + n + 1) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new)
    backend.init_forward_metadata(fb)
    layer = world.layers[1]
    q, k, v = world.randn(25, world.hq * world.d), world.randn(25, world.hkv, world.d), world.randn(25, world.hkv,
                                                                                                     world.d)
    check_extend(world, backend.forward(q, k, v, layer, fb), q, fb, layer.layer_id)
    fb = world.decode_batch(reqs, [p + n for p, n in zip(prefix, new)])
    backend.init_forward_metadata(fb)
    q, k, v = world.randn(2, world.hq * world.d), world.randn(2, world.hkv, world.d), world.randn(2, world.hkv, world.d)
    check_decode(world, backend.forward(q, k, v, layer, fb), q, fb, layer.layer_id)


def test_extend_shared_kv_reads_cache(lane):
    """k = v = None (a layer reusing another layer's KV): the new tokens come from the cache."""
    world = World(1, *lane)
    backend = world.backend()
    prefix, new = [9, 0], [6, 11]
    reqs = [world.add_request(p + n) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new)
    backend.init_forward_metadata(fb)
    layer = world.layers[1]
    world.kv_pool.set_kv_buffer(layer, fb.out_cache_loc, world.randn(17, world.hkv, world.d),
                                world.randn(17, world.hkv, world.d))
    q = world.randn(17, world.hq * world.d)
    out = backend.forward(q, None, None, layer, fb, save_kv_cache=False)
    check_extend(world, out, q, fb, layer.layer_id)


def test_mixed_batch_and_padded_rows(lane):
    """MIXED (chunked prefill + decode rows) goes through extend; q rows past the batch's
    tokens (padded prefill graphs) come back as zeros, written into _attn_output."""
    world = World(16, *lane)
    backend = world.backend()
    prefix, new = [30, 12, 0], [1, 1, 19]
    reqs = [world.add_request(p + n) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new, mode=ForwardMode.MIXED)
    backend.init_forward_metadata(fb)
    t, pad = sum(new), 5
    q = world.randn(t + pad, world.hq * world.d)
    k, v = world.randn(t + pad, world.hkv, world.d), world.randn(t + pad, world.hkv, world.d)
    fb._attn_output = torch.full((t + pad, world.hq * world.d), float("nan"), dtype=q.dtype, device=q.device)
    fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=torch.int64, device=q.device)])
    out = backend.forward(q, k, v, world.layers[0], fb)
    assert out.data_ptr() == fb._attn_output.data_ptr()
    assert torch.count_nonzero(out[t:]) == 0
    fb.out_cache_loc = fb.out_cache_loc[:t]
    check_extend(world, out[:t], q[:t], fb)


def test_refuses_verify_and_draft_batches_it_was_not_built_for(lane):
    """A verify batch for a backend built without speculative decoding, and a draft model's
    DRAFT_EXTEND_V2 batch on a target model's backend, are refused by name."""
    world = World(1, *lane)
    backend = world.backend()
    r = world.add_request(8)
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY"):
        backend.init_forward_metadata(world.verify_batch([r], [3], 2))
    with pytest.raises(NotImplementedError, match="DRAFT_EXTEND_V2"):
        backend.init_forward_metadata(world.extend_batch([r], [3], [2], mode=ForwardMode.DRAFT_EXTEND_V2))


def test_bad_page_in_the_request_pool_is_logged_at_a_later_step(lane, caplog):
    """A slot past the KV pool in req_to_token: the decode reads nothing there, flags it on
    the device, and the backend's per-step poll logs it (without a sync on the GPU: there it
    arrives one poll later) and clears the flag."""

    errors.check_errors(lane[0])  # start clean: earlier tests may have left bits
    world = World(1, *lane)
    backend = world.backend()
    r = world.add_request(8)
    world.req_pool.req_to_token[r, 2] = world.kv_pool.size + 10**6  # page id = slot at page size 1
    fb = world.decode_batch([r], [5])
    backend.init_forward_metadata(fb)
    out = backend.forward(world.randn(1, world.hq * world.d), world.randn(1, world.hkv, world.d),
                          world.randn(1, world.hkv, world.d), world.layers[0], fb)
    assert torch.isfinite(out).all()
    with caplog.at_level(logging.ERROR, logger="evenkv"):
        for _ in range(3):
            backend.init_forward_metadata(world.decode_batch([r], [5]))
            if lane[0].type == "cuda":
                torch.cuda.synchronize()
    assert "page_table: a page id outside the KV cache" in caplog.text
    assert errors.peek(lane[0]) == []


# -- CUDA-graph metadata sequence ----------------------------------------------------------


class GraphDriver:
    """Drives a backend through SGLang's decode graph runner sequence (SGLang 0.5.17,
    decode_cuda_graph_runner.py), for DECODE graphs (one token per request) or, with
    ``q_len`` > 1, the TARGET_VERIFY graphs of speculative decoding: init_cuda_graph_state;
    per captured bs, out_graph(fb, in_capture=True) then the captured body (in_graph + forward
    per layer) on static buffers filled with the fill value (a verify capture's spec_info
    holds a placeholder mask, as the runner's does); per replay, refill the static buffers
    (padded rows: req_pool_indices 0, seq_lens = fill value, out_cache_loc 0),
    out_graph(SimpleNamespace view with the batch's own spec_info and unpadded
    out_cache_loc), replay.

    On the GPU the body is a real torch.cuda.CUDAGraph. On the CPU "replay" runs the
    body again on the same buffers, which is what the graph would execute.
    """

    def __init__(self, world, backend, bs, q_len=1):
        self.world, self.backend, self.bs, self.q_len = world, backend, bs, q_len
        self.mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
        dev, hq, hkv, d = world.device, world.hq, world.hkv, world.d
        tokens = bs * q_len
        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=tokens)
        self.fill = backend.get_cuda_graph_seq_len_fill_value()
        self.req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((bs,), self.fill, dtype=torch.int64, device=dev)
        self.seq_lens_cpu = torch.full((bs,), self.fill, dtype=torch.int64)
        self.out_cache_loc = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.q = torch.zeros(tokens, hq * d, dtype=world.dtype, device=dev)
        self.k = torch.zeros(tokens, hkv, d, dtype=world.dtype, device=dev)
        self.v = torch.zeros(tokens, hkv, d, dtype=world.dtype, device=dev)
        spec_info = None
        if q_len > 1:
            spec_info = NgramVerifyInput(custom_mask=torch.ones(tokens * (self.fill + q_len), dtype=torch.bool,
                                                                device=dev), draft_token_num=q_len)
        self.fb = ForwardBatch(forward_mode=self.mode, batch_size=bs,
                               input_ids=torch.zeros(tokens, dtype=torch.int64, device=dev),
                               req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
                               out_cache_loc=self.out_cache_loc, seq_lens_sum=bs * self.fill,
                               seq_lens_cpu=self.seq_lens_cpu, spec_info=spec_info)
        self.outs = None
        self.graph = None

    def body(self):
        self.backend.init_forward_metadata_in_graph(self.fb)
        return [self.backend.forward(self.q, self.k, self.v, layer, self.fb) for layer in self.world.layers]

    def capture(self):
        self.backend.init_forward_metadata_out_graph(self.fb, in_capture=True)
        if self.world.device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.body()  # warm-up (compiles), as SGLang's runner does before capture
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outs = self.body()
        else:
            self.outs = self.body()

    def replay(self, reqs, cached, *, masks=None, with_cpu_lens=True, after_out_graph=None):
        """Real requests reqs (cached[b] tokens each, plus q_len new ones) padded to bs;
        masks: the verify trees (None: chains). after_out_graph(real fb) runs between the
        host step and the replay. Returns (outs, q, real fb)."""
        w, raw, n = self.world, len(reqs), len(reqs) * self.q_len
        real = (w.decode_batch(reqs, cached) if self.q_len == 1
                else w.verify_batch(reqs, cached, self.q_len, masks))
        self.req_pool_indices.zero_()[:raw] = real.req_pool_indices
        self.seq_lens.fill_(self.fill)[:raw] = real.seq_lens
        self.seq_lens_cpu.fill_(self.fill)[:raw] = real.seq_lens_cpu
        self.out_cache_loc.zero_()[:n] = real.out_cache_loc
        self.q.copy_(w.randn(*self.q.shape))
        self.k.copy_(w.randn(*self.k.shape))
        self.v.copy_(w.randn(*self.v.shape))
        view = SimpleNamespace(batch_size=self.bs, forward_mode=self.mode, actual_forward_mode=self.mode,
                               input_ids=self.fb.input_ids, positions=None, req_pool_indices=self.req_pool_indices,
                               seq_lens=self.seq_lens,
                               seq_lens_sum=real.seq_lens_sum + (self.bs - raw) * self.fill,
                               seq_lens_cpu=self.seq_lens_cpu if with_cpu_lens else None, num_padding=self.bs - raw,
                               encoder_lens=None, out_cache_loc=real.out_cache_loc, spec_info=real.spec_info)
        self.backend.init_forward_metadata_out_graph(view)
        if after_out_graph is not None:
            after_out_graph(real)
        if self.graph is not None:
            self.graph.replay()
            outs = self.outs
        else:
            outs = self.body()
        return [o.clone() for o in outs], self.q.clone(), real


def overwrite_shared_state(world):
    """What SGLang's scheduler may write for its next batch while a graph replays (the WAR
    hazard): req_to_token, the hybrid pool's mapping and the draft trees' masks. A backend
    must have snapshotted what it needs in out_graph."""

    def overwrite(real):
        world.req_pool.req_to_token[1:].fill_(GARBAGE_SLOT)
        if world.swa_layers:
            world.kv_pool.full_to_swa_index_mapping[:-1].fill_(1)
        if real.spec_info is not None:
            real.spec_info.custom_mask.fill_(True)

    return overwrite


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_sequence_with_padded_rows(lane, page_size):
    world = World(page_size, *lane, max_reqs=8)
    backend = world.backend()
    driver = GraphDriver(world, backend, bs=4)
    driver.capture()
    caps = [48, 20, 70, 9, 33]
    reqs = [world.add_request(c) for c in caps]
    saved_rows = world.req_pool.req_to_token.clone()
    for batch, cached, cpu_lens in [(reqs[:2], [40, 3], True), (reqs[2:5], [69, 0, 32], True),
                                    (reqs[1:2], [19], False)]:
        world.req_pool.req_to_token.copy_(saved_rows)
        outs, q, real = driver.replay(batch, cached, with_cpu_lens=cpu_lens,
                                      after_out_graph=overwrite_shared_state(world))
        raw = len(batch)
        for layer, out in zip(world.layers, outs):
            assert torch.count_nonzero(out[raw:]) == 0, "padded rows must come back as zeros"
            check_decode(world, out[:raw], q[:raw], real, layer.layer_id)


def test_init_cuda_graph_state_refuses_multi_token_decode(lane):
    backend = World(1, *lane).backend()
    with pytest.raises(NotImplementedError, match="8 tokens for 4 requests"):
        backend.init_cuda_graph_state(max_bs=4, max_num_tokens=8)


# -- SGLang's hybrid SWA pool -----------------------------------------------------------------

WINDOW_AND_FULL = [dict(sliding_window_size=15), {}]  # layer 0: a 16-token window (SWA pool); layer 1: full


def hybrid_world(page_size, lane, **kw):
    """Layer 0 windowed, in the hybrid pool's sliding-window pool; layer 1 full-attention."""
    return World(page_size, *lane, layer_kw=WINDOW_AND_FULL, swa_layers=[0], **kw)


def test_hybrid_pool_is_accepted_with_a_kind_per_pool(lane):
    world = hybrid_world(1, lane)
    assert plugin.unsupported_reasons(world.runner) == []
    backend = world.backend()
    assert set(backend.attentions) == {LayerKind(window=16, swa_pool=True), LayerKind()}


def test_hybrid_pool_refusals(lane):
    """A hybrid pool without its full->SWA mapping (SGLang's unified pools keep none) is
    refused by name."""
    world = hybrid_world(1, lane)
    world.kv_pool.full_to_swa_index_mapping = None
    with pytest.raises(NotImplementedError, match="no full->SWA index mapping"):
        world.backend()


def test_hybrid_pool_bad_slot_is_flagged(lane):
    """A req_to_token slot past the full pool reads the mapping's trailing -1 for the window
    layer: a page id the audit flags, never an out-of-bounds gather."""
    errors.check_errors(lane[0])
    world = hybrid_world(1, lane)
    backend = world.backend()
    r = world.add_request(8)
    world.req_pool.req_to_token[r, 6] = world.kv_pool.size + 10**6
    fb = world.decode_batch([r], [6])
    backend.init_forward_metadata(fb)
    out = backend.forward(world.randn(1, world.hq * world.d), world.randn(1, world.hkv, world.d),
                          world.randn(1, world.hkv, world.d), world.layers[0], fb)
    assert torch.isfinite(out).all()
    with pytest.raises(errors.EvenKVError, match="page id outside the KV cache"):
        errors.check_errors(lane[0])  # raises and clears


@pytest.mark.parametrize("page_size", [1, 16])
def test_hybrid_pool_extend_then_decode(lane, page_size):
    """Chunked prefill and decode on SGLang's SWAKVPool: the window layer reads and writes the
    sliding-window pool through the full->SWA mapping, the full layer the full pool; tokens
    that have left the window are freed (mapping -> the dummy slot) and poisoned with NaN,
    and no result or page audit touches them (the decode reads only the window's pages: a
    NaN dummy page stays out of its results)."""
    errors.check_errors(lane[0])  # start clean
    world = hybrid_world(page_size, lane, ctx=128)
    backend = world.backend()
    prefix, new = [0, 40, 33], [21, 9, 30]
    reqs = [world.add_request(p + n + 1) for p, n in zip(prefix, new)]
    # SGLang frees what no query of this step can see: whole pages before every window. The
    # extend kernel loads the tile across a window's left edge and masks the keys before it,
    # which may be the (finite) dummy page.
    for r, p in zip(reqs, prefix):
        world.evict_window(r, (p - 16) // page_size * page_size, dummy=1e3)
    fb = world.extend_batch(reqs, prefix, new)
    backend.init_forward_metadata(fb)
    t = sum(new)
    for layer in world.layers:
        q, k, v = world.qkv(t)
        out = backend.forward(q, k, v, layer, fb)
        k_cache = world.kv_pool.get_key_buffer(layer.layer_id)
        written = torch.cat([torch.tensor(world.layer_slots(r, layer.layer_id, range(p, p + n)))
                             for r, p, n in zip(reqs, prefix, new)])
        assert torch.equal(k_cache[written.to(k.device)], k), "new tokens go to the layer's own pool"
        check_against_slots(world, out, q, visible_slots(world, layer, reqs, prefix, new), layer)
    cached = [p + n for p, n in zip(prefix, new)]
    for r, c in zip(reqs, cached):
        world.evict_window(r, (c - 15) // page_size * page_size)
    fb = world.decode_batch(reqs, cached)
    backend.init_forward_metadata(fb)
    for layer in world.layers:
        q, k, v = (world.randn(3, world.hq * world.d), world.randn(3, world.hkv, world.d),
                   world.randn(3, world.hkv, world.d))
        out = backend.forward(q, k, v, layer, fb)
        check_against_slots(world, out, q, visible_slots(world, layer, reqs, cached, [1] * 3), layer)
    assert errors.peek(lane[0]) == [], "the freed entries before the window read as valid (never audited as bad)"


@pytest.mark.parametrize("page_size", [1, 16])
def test_hybrid_pool_cuda_graph_sequence(lane, page_size):
    """Decode graphs on the hybrid pool: the translated page table and the window layer's
    write slots are snapshotted before replay; req_to_token and the mapping overwritten
    between out_graph and replay change nothing."""
    world = hybrid_world(page_size, lane, max_reqs=8, ctx=128)
    backend = world.backend()
    driver = GraphDriver(world, backend, bs=4)
    driver.capture()
    caps = [60, 20, 90]
    reqs = [world.add_request(c) for c in caps]
    saved_rows = world.req_pool.req_to_token.clone()
    for batch, cached in [(reqs[:2], [50, 3]), (reqs, [59, 19, 80])]:
        world.req_pool.req_to_token.copy_(saved_rows)
        for r, c in zip(batch, cached):
            world.evict_window(r, (c - 15) // page_size * page_size)
        saved_mapping = world.kv_pool.full_to_swa_index_mapping.clone()
        outs, q, _ = driver.replay(batch, cached, after_out_graph=overwrite_shared_state(world))
        world.kv_pool.full_to_swa_index_mapping.copy_(saved_mapping)
        raw = len(batch)
        for layer, out in zip(world.layers, outs):
            assert torch.count_nonzero(out[raw:]) == 0, "padded rows must come back as zeros"
            check_against_slots(world, out[:raw], q[:raw], visible_slots(world, layer, batch, cached, [1] * raw),
                                layer)
        k_swa = world.kv_pool.get_key_buffer(0)
        new_slots = torch.tensor([world.layer_slots(r, 0, [c])[0] for r, c in zip(batch, cached)])
        assert torch.equal(k_swa[new_slots.to(k_swa.device)], driver.k[:raw]), "the window layer's writes"


class FreshTensors(TorchDispatchMode):
    """Records (op, element count) of every tensor an op allocates (a result that aliases no
    argument): views and in-place writes are not allocations."""

    def __init__(self):
        super().__init__()
        self.allocated = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ret, value in zip(func._schema.returns, out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(value, torch.Tensor) and ret.alias_info is None:
                self.allocated.append((str(func), value.numel()))
        return out


def test_graph_refill_allocates_nothing_table_sized(lane, monkeypatch):
    """At page 1 a page table is as wide as the batch's longest request: the graph refill
    before each replay writes the tables of both pools in place, allocating nothing near
    B x width (at a thousand requests of 100K+ tokens that is gigabytes a step), and the
    replay is right."""
    world = hybrid_world(1, lane, ctx=2048, max_reqs=4)
    backend = world.backend()
    driver = GraphDriver(world, backend, bs=4)
    driver.capture()
    reqs = [world.add_request(c) for c in (2000, 12, 30)]
    cached = [1990, 5, 29]
    refill, fresh = backend.init_forward_metadata_out_graph, FreshTensors()

    def recorded(*args, **kwargs):
        with fresh:
            return refill(*args, **kwargs)

    monkeypatch.setattr(backend, "init_forward_metadata_out_graph", recorded)
    outs, q, _ = driver.replay(reqs, cached)
    largest = max(fresh.allocated, key=lambda a: a[1], default=("none", 0))
    assert fresh.allocated and largest[1] < 256, f"the refill allocated {largest[1]} elements in {largest[0]}"
    for layer, out in zip(world.layers, outs):
        check_against_slots(world, out[:3], q[:3], visible_slots(world, layer, reqs, cached, [1] * 3), layer)


# -- speculative decoding: target verify ---------------------------------------------------------


def speculative_world(page_size, lane, algorithm, q_len, topk=1, **kw):
    """A world whose server runs ``algorithm`` speculation with q_len verify tokens per request."""
    world = World(page_size, *lane, **kw)
    world.runner.server_args = _WithFlags(world.runner.server_args, speculative_algorithm=algorithm,
                                          speculative_num_draft_tokens=q_len, speculative_eagle_topk=topk)
    return world


@pytest.mark.parametrize("kw,expected", [
    (dict(attention_backend=plugin.NAME, speculative_algorithm="EAGLE"), "triton"),
    (dict(decode_attention_backend=plugin.NAME, prefill_attention_backend="triton", speculative_algorithm="NEXTN"),
     "triton"),
    (dict(attention_backend=plugin.NAME, speculative_algorithm="EAGLE", speculative_draft_attention_backend="flashinfer"),
     "flashinfer"),  # the operator's choice stays
    (dict(attention_backend=plugin.NAME, speculative_algorithm="EAGLE", speculative_draft_attention_backend=plugin.NAME),
     plugin.NAME),  # evenkv for the draft's chains too
    (dict(attention_backend="triton", speculative_algorithm="EAGLE"), None),  # not evenkv's target
], ids=["eagle", "nextn-decode-only", "named", "named-evenkv", "other-target"])
def test_draft_model_attention_defaults_to_triton_under_an_evenkv_target(kw, expected, tmp_path):
    """SGLang builds a draft model's attention from its own table, which has no evenkv: with evenkv
    as the target's backend and no --speculative-draft-attention-backend, the plugin's hook before
    a ServerArgs is resolved (applied by load_plugins, as in every SGLang process) names triton,
    so EAGLE starts with one flag. A real ServerArgs, built and resolved as the CLI and Engine
    do (0.5.17 resolves in __post_init__, 0.5.23 in resolve_once)."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    target = plugin.server_args_resolution()
    assert target in HookRegistry._patched
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)))
    args = ServerArgs(model_path=str(model), speculative_draft_model_path=str(model), speculative_num_steps=3,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=4, skip_tokenizer_init=True, device="cpu",
                      **kw)
    if hasattr(args, "resolve_once"):
        args.resolve_once()
    assert args.speculative_draft_attention_backend == expected
    plugin.register()  # idempotent: one hook however often SGLang loads the plugin
    assert [h for _, h, _ in HookRegistry._hooks[target]].count(plugin.default_draft_attention) == 1


def test_speculative_verify_config():
    base = SimpleNamespace(speculative_algorithm=None)
    assert plugin.speculative_verify(base) == (0, False)
    eagle = SimpleNamespace(speculative_algorithm="EAGLE", speculative_num_draft_tokens=4, speculative_eagle_topk=1)
    assert plugin.speculative_verify(eagle) == (4, False)
    tree = SimpleNamespace(speculative_algorithm="EAGLE", speculative_num_draft_tokens=8, speculative_eagle_topk=4)
    assert plugin.speculative_verify(tree) == (8, True)
    ngram = SimpleNamespace(speculative_algorithm="NGRAM", speculative_num_draft_tokens=12, speculative_eagle_topk=1)
    assert plugin.speculative_verify(ngram) == (12, True)


def test_eagle_can_size_its_verify_mask_from_the_backend(lane):
    """SGLang's EAGLE worker sizes a verify step's FULL_MASK tree mask as B x the target
    backend's max_context_len when the batch's seq_lens_sum is unknown (after filter_batch or
    merge_batch)."""
    world = speculative_world(1, lane, "EAGLE", 4, topk=2, ctx=96)
    backend = world.backend()
    assert backend.max_context_len == world.runner.model_config.context_len == 96


@pytest.mark.parametrize("overrides,fragment", [
    (dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=4), "speculative decoding with DFLASH"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=17), "speculative_num_draft_tokens=17"),
])
def test_refuses_unsupported_speculation(lane, overrides, fragment):
    world = World(1, *lane)
    world.runner.server_args = _WithFlags(world.runner.server_args, speculative_eagle_topk=1, **overrides)
    with pytest.raises(NotImplementedError, match=fragment):
        world.backend()


def test_refuses_eagle_trees_with_pages_or_short_windows(lane):
    """EAGLE trees on pages of several tokens are refused (NGRAM's are not: its drafts take the
    slots after the prefix at any page size); under a window, only one shorter than the verify
    rows (a tree token's ancestors must lie in it)."""
    world = speculative_world(16, lane, "EAGLE", 4, topk=2)
    with pytest.raises(NotImplementedError, match="EAGLE draft trees .* page size 16"):
        world.backend()
    assert plugin.unsupported_reasons(speculative_world(16, lane, "NGRAM", 4).runner) == []
    world = speculative_world(1, lane, "EAGLE", 4, topk=2, layer_kw=[dict(sliding_window_size=2), {}])
    with pytest.raises(NotImplementedError, match=r"draft trees \(EAGLE\) of 4 tokens under sliding windows of \[3\]"):
        world.backend()
    assert plugin.unsupported_reasons(speculative_world(1, lane, "EAGLE", 4, topk=2, layer_kw=WINDOW_AND_FULL).runner) == []


@pytest.mark.parametrize("algorithm,topk,page_size,layer_kw,sinks", [
    ("EAGLE", 1, 1, None, False),  # a chain: causal rows
    ("EAGLE", 1, 16, [dict(sliding_window_size=5), dict(logit_cap=5.0)], True),  # chain, window, soft-cap, sinks
    ("NGRAM", 1, 1, None, False),  # NGRAM trees
    ("EAGLE", 4, 1, [dict(logit_cap=5.0)] * 2, True),  # EAGLE trees, soft-cap and sinks
    ("NGRAM", 1, 1, [dict(sliding_window_size=5), dict(logit_cap=5.0)], True),  # trees under a window
    ("NGRAM", 1, 16, [dict(sliding_window_size=20), {}], False),  # trees on pages of 16, under a window
], ids=["eagle-chain", "eagle-chain-p16-window-cap-sinks", "ngram-tree", "eagle-tree-cap-sinks",
        "ngram-tree-window-cap-sinks", "ngram-tree-p16-window"])
def test_target_verify_matches_reference(lane, algorithm, topk, page_size, layer_kw, sinks):
    """TARGET_VERIFY through forward_extend, as SGLang sends it: each request's draft tokens
    are written to their slots, then attend to the cache as decode rows (chain: causal;
    trees: SGLang's FULL_MASK custom mask)."""
    q_len = 4
    world = speculative_world(page_size, lane, algorithm, q_len, topk, layer_kw=layer_kw)
    backend = world.backend()
    cached = [0, 37, 5, 20]  # a request with no cache yet, one past a page boundary
    reqs = [world.add_request(c + q_len) for c in cached]
    tree = backend.tree_verify
    masks = [random_tree_mask(q_len, world.gen) for _ in reqs] if tree else None
    assert not tree or branches(masks), "every draw a chain: the trees test nothing a chain does not"
    fb = world.verify_batch(reqs, cached, q_len, masks)
    backend.init_forward_metadata(fb)
    t = len(reqs) * q_len
    for layer in world.layers:
        sink = torch.randn(world.hq, device=world.device) if sinks else None
        q, k, v = world.qkv(t)
        out = backend.forward(q, k, v, layer, fb, sinks=sink)
        k_cache = world.kv_pool.get_key_buffer(layer.layer_id)
        assert torch.equal(k_cache[fb.out_cache_loc], k)
        check_against_slots(world, out, q, visible_slots(world, layer, reqs, cached, [q_len] * len(reqs), masks),
                            layer, sink)


@pytest.mark.parametrize("algorithm,topk", [("EAGLE", 1), ("NGRAM", 1)], ids=["chain", "tree"])
def test_target_verify_on_the_hybrid_pool(lane, algorithm, topk):
    """Verify with a window layer in the sliding-window pool (gpt-oss-like): EAGLE chains, and
    NGRAM trees, whose tokens' windows start from their depths."""
    q_len = 3
    world = hybrid_world(1, lane, ctx=128)
    world.runner.server_args = _WithFlags(world.runner.server_args, speculative_algorithm=algorithm,
                                          speculative_num_draft_tokens=q_len, speculative_eagle_topk=topk)
    backend = world.backend()
    cached = [30, 2, 60]
    reqs = [world.add_request(c + q_len) for c in cached]
    for r, c in zip(reqs, cached):
        world.evict_window(r, c - 15)
    masks = [random_tree_mask(q_len, world.gen) for _ in reqs] if backend.tree_verify else None
    assert masks is None or branches(masks), "every draw a chain: the window starts where a chain's would"
    fb = world.verify_batch(reqs, cached, q_len, masks)
    backend.init_forward_metadata(fb)
    t = len(reqs) * q_len
    for layer in world.layers:
        q, k, v = world.qkv(t)
        out = backend.forward(q, k, v, layer, fb)
        check_against_slots(world, out, q, visible_slots(world, layer, reqs, cached, [q_len] * 3, masks), layer)


def test_refuses_a_mask_in_another_layout(lane):
    """A QLEN_ONLY-sized custom_mask (q_len x q_len per request) is not read as FULL_MASK."""
    world = speculative_world(1, lane, "NGRAM", 3)
    backend = world.backend()
    r = world.add_request(20)
    fb = world.verify_batch([r], [10], 3)
    fb.spec_info.custom_mask = chain_mask(3).flatten().to(world.device)
    with pytest.raises(ValueError, match="FULL_MASK"):
        backend.init_forward_metadata(fb)


@pytest.mark.parametrize("algorithm,topk,page_size", [("EAGLE", 1, 1), ("NGRAM", 1, 1), ("NGRAM", 1, 16)],
                         ids=["chain", "tree", "tree-p16"])
def test_target_verify_cuda_graph_sequence(lane, algorithm, topk, page_size):
    """TARGET_VERIFY graphs (max_num_tokens = max_bs x draft tokens): page table and tree
    masks snapshotted before replay (req_to_token and the custom mask overwritten between
    out_graph and replay change nothing), padded rows give zeros; and a step planned before
    its draft finished (SGLang's overlap plan stream) is corrected by
    update_verify_buffers_to_fill_after_draft."""
    q_len = 3
    world = speculative_world(page_size, lane, algorithm, q_len, topk, max_reqs=8)
    backend = world.backend()
    driver = GraphDriver(world, backend, bs=4, q_len=q_len)
    driver.capture()
    cached = [30, 0, 12]
    reqs = [world.add_request(c + q_len) for c in cached]
    saved_rows = world.req_pool.req_to_token.clone()
    tree = backend.tree_verify
    for batch, lens in [(reqs[:2], cached[:2]), (reqs, cached)]:
        world.req_pool.req_to_token.copy_(saved_rows)
        masks = [random_tree_mask(q_len, world.gen) for _ in batch] if tree else None
        outs, q, real = driver.replay(batch, lens, masks=masks, after_out_graph=overwrite_shared_state(world))
        n = len(batch) * q_len
        for layer, out in zip(world.layers, outs):
            assert torch.count_nonzero(out[n:]) == 0, "padded rows must come back as zeros"
            check_against_slots(world, out[:n], q[:n], visible_slots(world, layer, batch, lens, [q_len] * len(batch),
                                                                     masks), layer)
    if not tree:
        return
    world.req_pool.req_to_token.copy_(saved_rows)
    masks = [random_tree_mask(q_len, world.gen) for _ in reqs]

    def draft_finishes_late(real):
        # out_graph read a mask the draft had not written yet; SGLang then calls the hook.
        real.spec_info.custom_mask.copy_(full_mask(cached, masks).to(world.device))
        backend.update_verify_buffers_to_fill_after_draft(real.spec_info, driver.bs)

    stale = [torch.ones(q_len, q_len, dtype=torch.bool)] * len(reqs)
    outs, q, _ = driver.replay(reqs, cached, masks=stale, after_out_graph=draft_finishes_late)
    n = len(reqs) * q_len
    for layer, out in zip(world.layers, outs):
        check_against_slots(world, out[:n], q[:n], visible_slots(world, layer, reqs, cached, [q_len] * 3, masks),
                            layer)


# -- the draft model of EAGLE-family speculation ---------------------------------------------

DRAFT_STEPS = 3  # speculative_num_steps: the draft model's decode runs steps 0 and 1


def draft_world(page_size, lane, topk=1, **kw):
    """A draft model runner's world (EAGLE, DRAFT_STEPS steps, topk ``topk``) whose server names
    evenkv for the draft model's attention (--speculative-draft-attention-backend evenkv)."""
    world = World(page_size, *lane, **kw)
    world.runner.server_args = _WithFlags(world.runner.server_args, speculative_algorithm="EAGLE",
                                          speculative_num_steps=DRAFT_STEPS, speculative_eagle_topk=topk,
                                          speculative_num_draft_tokens=DRAFT_STEPS + 1,
                                          speculative_draft_attention_backend=plugin.NAME)
    world.runner.is_draft_worker = True
    world.runner.draft_attention_backend = plugin.NAME  # 0.5.23: the draft runner's own backend name
    return world


def draft_factory(runner, topk, num_steps):
    """SGLang's DraftBackendFactory for ``runner`` (0.5.17 also takes the server args; 0.5.23
    reads the backend name from the runner)."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    if "server_args" in inspect.signature(DraftBackendFactory).parameters:
        return DraftBackendFactory(runner.server_args, runner, topk, num_steps)
    return DraftBackendFactory(runner, topk, num_steps)


def draft_backends(world, topk=1):
    """What SGLang's EAGLE worker builds for its draft model runner: the runner's backend (from
    the registry, as for any model runner), then SGLang's DraftBackendFactory's decode and
    draft-extend backends (with the plugin's hooks applied, as load_plugins applies them)."""
    world.runner.attn_backend = world.backend()
    factory = draft_factory(world.runner, topk, DRAFT_STEPS)
    return world.runner.attn_backend, factory.create_decode_backend(), factory.create_draft_extend_backend()


def draft_batch(world, reqs, cached, step, topk=1):
    """Draft step ``step``'s DECODE batch: request reqs[b] has cached[b] committed tokens (SGLang's
    seq_lens) and the slots of its topk x DRAFT_STEPS drafts after them in req_to_token, branch
    by branch; this step writes each branch's draft ``step`` (query row b * topk + k)."""
    seq = torch.tensor(cached, dtype=torch.int64)
    loc = torch.cat([world.slots(r, c + k * DRAFT_STEPS + step, c + k * DRAFT_STEPS + step + 1)
                     for r, c in zip(reqs, cached) for k in range(topk)])
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(reqs),
                        input_ids=torch.zeros(len(reqs) * topk, dtype=torch.int64, device=world.device),
                        req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=world.device),
                        seq_lens=seq.to(world.device), out_cache_loc=loc, seq_lens_sum=int(seq.sum()),
                        seq_lens_cpu=seq.clone(), positions=(seq + step).repeat_interleave(topk).to(world.device))


def draft_step_slots(world, layer, reqs, cached, step, topk=1) -> list[list[int]]:
    """Per query row (b * topk + k) of draft step ``step``, the slots it attends to: request b's
    prefix, then branch k's drafts 0..step (draft j at position cached[b] + j, its slot at
    req_to_token position cached[b] + k * DRAFT_STEPS + j), within the layer's window."""
    window = layer.sliding_window_size + 1 if layer.sliding_window_size > -1 else None
    rows = []
    for r, c in zip(reqs, cached):
        for k in range(topk):
            keys = [(p, p) for p in range(c)] + [(c + k * DRAFT_STEPS + j, c + j) for j in range(step + 1)]
            seen = [at for at, pos in keys if window is None or pos > c + step - window]
            rows.append(world.layer_slots(r, layer.layer_id, seen))
    return rows


def check_draft_step(world, out, q, reqs, cached, step, layer, sinks=None, topk=1):
    """out, q [B * topk, Hq*D] of draft step ``step`` against the fp32 oracle (draft_step_slots)."""
    check_against_slots(world, out, q, draft_step_slots(world, layer, reqs, cached, step, topk), layer, sinks)


def test_draft_backends_come_from_sglangs_factory(lane):
    """--speculative-draft-attention-backend evenkv: SGLang's DraftBackendFactory (through the
    plugin's hooks) gives a multi-step decode backend of speculative_num_steps - 1 steps on the
    draft runner's own backend, which also takes the draft-extend batches; another name still
    reaches SGLang's own table."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from evenkv.integrations.sglang_draft import DraftStepBackend, EvenKVMultiStepDraftBackend

    for method in ("create_decode_backend", "create_draft_extend_backend"):
        assert f"{plugin.DRAFT_BACKEND_FACTORY}.{method}" in HookRegistry._patched
    world = draft_world(1, lane)
    runner_backend, multi, extend = draft_backends(world)
    assert isinstance(runner_backend, EvenKVAttnBackend) and runner_backend.is_draft
    assert runner_backend.verify_q_len == 0, "a draft model never verifies: no verify kernels are built"
    assert isinstance(multi, EvenKVMultiStepDraftBackend) and multi.backend is runner_backend
    assert len(multi.attn_backends) == DRAFT_STEPS - 1
    assert [(type(step), step.drafts, step.step) for step in multi.attn_backends] == \
        [(DraftStepBackend, multi, i) for i in range(DRAFT_STEPS - 1)]
    assert extend is runner_backend
    assert draft_factory(world.runner, 1, 1).create_decode_backend() is None  # SGLang's rule: one step, no decode
    world.runner.server_args = _WithFlags(world.runner.server_args, speculative_draft_attention_backend="no-such")
    world.runner.draft_attention_backend = "no-such"
    with pytest.raises(ValueError, match="no-such"):
        draft_factory(world.runner, 1, DRAFT_STEPS).create_draft_extend_backend()


def test_draft_model_refusals(lane):
    """Draft trees on pages of several tokens, a draft model on the hybrid pool and a draft
    window the draft's layers do not carry are refused, naming the flag that serves them; a
    TARGET_VERIFY batch never reaches a draft model's backend."""
    with pytest.raises(NotImplementedError, match=r"draft trees \(speculative_eagle_topk=4\) in the draft model "
                                                  r"with page size 16.*--speculative-draft-attention-backend triton"):
        draft_world(16, lane, topk=4).backend()
    assert plugin.unsupported_reasons(draft_world(1, lane, topk=4).runner) == []
    world = hybrid_world(1, lane)
    world.runner.server_args = _WithFlags(world.runner.server_args, speculative_algorithm="EAGLE",
                                          speculative_eagle_topk=1)
    world.runner.is_draft_worker = True
    assert any("hybrid SWA pool" in reason for reason in plugin.unsupported_reasons(world.runner))
    world = draft_world(1, lane)
    world.runner.server_args = _WithFlags(world.runner.server_args, speculative_draft_window_size=8)
    with pytest.raises(NotImplementedError, match="speculative_draft_window_size=8 on a draft model whose layers"):
        world.backend()
    windowed = draft_world(1, lane, layer_kw=[dict(sliding_window_size=8)] * 2)  # Llama EAGLE-3 takes the flag so
    windowed.runner.server_args = _WithFlags(windowed.runner.server_args, speculative_draft_window_size=8)
    assert plugin.unsupported_reasons(windowed.runner) == []
    world = draft_world(1, lane)
    backend = world.backend()
    r = world.add_request(12)
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY"):
        backend.init_forward_metadata(world.verify_batch([r], [3], 2))


@pytest.mark.parametrize("page_size,topk,layer_kw,sinks", [
    (1, 1, None, False),
    (16, 1, None, False),
    (16, 1, [dict(sliding_window_size=5), dict(logit_cap=5.0)], True),
    (1, 3, None, False),
    (1, 2, [dict(sliding_window_size=5), dict(logit_cap=5.0)], True),
], ids=["chain-p1", "chain-p16", "chain-p16-window-cap-sinks", "tree-p1", "tree-p1-window-cap-sinks"])
def test_draft_decode_steps_match_reference(lane, page_size, topk, layer_kw, sinks):
    """The draft model's decode steps, prepared at once by the multi-step backend: step i writes
    each branch's draft i to its slot, then row (b, k) reads request b's prefix and branch k's
    drafts 0..i."""
    world = draft_world(page_size, lane, topk=topk, layer_kw=layer_kw)
    _, multi, _ = draft_backends(world, topk)
    cached = [1, 37, 5, 20]  # one past a page boundary
    reqs = [world.add_request(c + topk * DRAFT_STEPS) for c in cached]
    multi.init_forward_metadata(draft_batch(world, reqs, cached, 0, topk))
    for step, step_backend in enumerate(multi.attn_backends):
        fb = draft_batch(world, reqs, cached, step, topk)
        for layer in world.layers:
            sink = torch.randn(world.hq, device=world.device) if sinks else None
            q, k, v = world.qkv(len(reqs) * topk)
            out = step_backend.forward(q, k, v, layer, fb, sinks=sink)
            assert torch.equal(world.kv_pool.get_key_buffer(layer.layer_id)[fb.out_cache_loc], k)
            check_draft_step(world, out, q, reqs, cached, step, layer, sink, topk)


def test_draft_extend_v2_matches_reference(lane):
    """DRAFT_EXTEND_V2 (the draft model over each request's verified drafts, SGLang's lengths
    including them) runs as an extend batch on the draft runner's backend."""
    world = draft_world(16, lane)
    backend, _, extend = draft_backends(world)
    d = DRAFT_STEPS + 1
    cached = [30, 2, 17]
    reqs = [world.add_request(c + d) for c in cached]
    fb = world.extend_batch(reqs, cached, [d] * len(reqs), mode=ForwardMode.DRAFT_EXTEND_V2)
    extend.init_forward_metadata(fb)
    for layer in world.layers:
        q, k, v = world.qkv(d * len(reqs))
        out = extend.forward(q, k, v, layer, fb)
        check_extend(world, out, q, fb, layer.layer_id)


@pytest.mark.parametrize("page_size,topk", [(16, 1), (1, 2)], ids=["chain-p16", "tree-p1"])
def test_draft_decode_cuda_graph_sequence(lane, page_size, topk):
    """SGLang's draft graph runner: init_cuda_graph_state(max_bs, max_bs x topk); at capture the
    out-of-graph step on fill-value rows, then the body (in-graph step, then each draft step's
    layers, the first of which plans the step); per replay the padded batch (request 0, fill
    length) refilled, the out-of-graph step, req_to_token overwritten (the next batch's), the
    body again (on the GPU, a real graph's replay)."""
    world = draft_world(page_size, lane, topk=topk, max_reqs=8)
    _, multi, _ = draft_backends(world, topk)
    bs, dev = 4, world.device
    n = bs * topk
    multi.init_cuda_graph_state(bs, n)
    fill = multi.attn_backends[0].get_cuda_graph_seq_len_fill_value()
    req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=dev)
    seq_lens = torch.full((bs,), fill, dtype=torch.int64, device=dev)
    seq_lens_cpu = torch.full((bs,), fill, dtype=torch.int64)
    out_cache_loc = torch.zeros(DRAFT_STEPS, n, dtype=torch.int64, device=dev)  # per step, rows b * topk + k
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs,
                      input_ids=torch.zeros(n, dtype=torch.int64, device=dev), req_pool_indices=req_pool_indices,
                      seq_lens=seq_lens, out_cache_loc=out_cache_loc.view(-1), seq_lens_sum=bs * fill,
                      seq_lens_cpu=seq_lens_cpu)
    qkv = [world.qkv(n) for _ in range((DRAFT_STEPS - 1) * len(world.layers))]

    def body():
        multi.init_forward_metadata_in_graph(fb)
        outs = []
        for step, step_backend in enumerate(multi.attn_backends):
            fb.out_cache_loc = out_cache_loc[step]
            for j, layer in enumerate(world.layers):
                q, k, v = qkv[step * len(world.layers) + j]
                outs.append(step_backend.forward(q, k, v, layer, fb))
        fb.out_cache_loc = out_cache_loc.view(-1)
        return outs

    multi.init_forward_metadata_out_graph(fb, in_capture=True)
    graph = None
    if dev.type == "cuda":  # as GraphDriver: a warm-up on a side stream, then a real capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = body()
    else:
        body()
    cached = [40, 3, 17]
    reqs = [world.add_request(c + topk * DRAFT_STEPS) for c in cached]
    saved_rows = world.req_pool.req_to_token.clone()
    for batch, lens in [(reqs[:2], cached[:2]), (reqs, cached)]:
        world.req_pool.req_to_token.copy_(saved_rows)
        raw = len(batch) * topk
        req_pool_indices.zero_()[:len(batch)] = torch.tensor(batch, device=dev)
        seq_lens.fill_(fill)[:len(batch)] = torch.tensor(lens, device=dev)
        seq_lens_cpu.fill_(fill)[:len(batch)] = torch.tensor(lens)
        out_cache_loc.zero_()
        for step in range(DRAFT_STEPS):
            out_cache_loc[step, :raw] = draft_batch(world, batch, lens, step, topk).out_cache_loc
        for q, k, v in qkv:
            for t in (q, k, v):
                t.copy_(world.randn(*t.shape))
        multi.init_forward_metadata_out_graph(fb)
        world.req_pool.req_to_token[1:].fill_(GARBAGE_SLOT)  # the next batch's rows, written during the replay
        if graph is not None:
            graph.replay()
            outs = captured
        else:
            outs = body()
        for step in range(DRAFT_STEPS - 1):
            for j, layer in enumerate(world.layers):
                q = qkv[step * len(world.layers) + j][0]
                check_draft_step(world, outs[step * len(world.layers) + j][:raw], q[:raw], batch, lens, step, layer,
                                 topk=topk)


@pytest.mark.skipif(not is_interpreter(), reason="the recorder stands in for compiles under the interpreter; on "
                    "the GPU the serving benchmark counts real ones")
def test_startup_compiles_what_every_step_launches(lane, recorder):
    """The backend's start-up compiles each plan and audit kernel for SGLang's int64 lengths
    only (its own verify and CUDA-graph length buffers are int64 too), one variant per batch
    chunk; eager decode, extend and verify steps, verify graph replays and (without
    speculation) decode graph replays then launch nothing it did not compile. The recorder runs nothing: only the launches count."""
    import collections

    from evenkv.kernels.plan_launch import plan_block_buckets

    q_len = 3
    world = speculative_world(1, lane, "NGRAM", q_len, max_reqs=8)  # NGRAM: tree-masked verify rows
    backend = world.backend()
    length_dtypes = {dict((p[0], p[1]) for p in key)["seq_lens_ptr"]
                     for name, key, _ in recorder.compiled if name in ("plan_stream_kernel", "audit_pages_kernel")}
    assert length_dtypes == {torch.int64}
    compiled = collections.Counter(name for name, _, _ in recorder.compiled)
    assert compiled["audit_pages_kernel"] == len(plan_block_buckets(backend.attentions[LayerKind()].max_batch_size))
    reqs = [world.add_request(c) for c in (40, 9, 25)]
    steps = [world.decode_batch(reqs, [30, 5, 20]), world.extend_batch(reqs, [10, 0, 4], [6, 9, 12]),
             world.verify_batch(reqs, [30, 5, 20], q_len)]
    for fb in steps:
        backend.init_forward_metadata(fb)
        backend.forward(*world.qkv(fb.out_cache_loc.shape[0]), world.layers[0], fb)
    driver = GraphDriver(world, backend, bs=4, q_len=q_len)
    driver.capture()
    driver.replay(reqs, [30, 5, 20])
    plain = World(1, *lane, max_reqs=8)  # decode graphs: a server without speculation
    driver = GraphDriver(plain, plain.backend(), bs=4)
    driver.capture()
    driver.replay([plain.add_request(c) for c in (40, 9)], [30, 5])
    missing = {key for key in recorder.launched if key not in recorder.compiled}
    assert recorder.launched and not missing, f"launched but not compiled at start-up: {sorted(missing)[:3]}"


@pytest.mark.skipif(not is_interpreter(), reason="the recorder stands in for compiles under the interpreter; on "
                    "the GPU the serving benchmark counts real ones")
@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_draft_startup_compiles_what_its_steps_launch(lane, recorder, topk):
    """A draft model runner's backend compiles at start-up every kernel its prefill, draft
    extend and draft decode steps (eager, and planned for graphs) launch."""
    world = draft_world(1, lane, topk=topk, max_reqs=8)
    _, multi, extend = draft_backends(world, topk)
    cached = [30, 5, 20]
    reqs = [world.add_request(c + topk * DRAFT_STEPS + 1) for c in cached]
    for fb in (world.extend_batch(reqs, [10, 0, 4], [6, 9, 12]),
               world.extend_batch(reqs, cached, [DRAFT_STEPS + 1] * 3, mode=ForwardMode.DRAFT_EXTEND_V2)):
        extend.init_forward_metadata(fb)
        extend.forward(*world.qkv(fb.out_cache_loc.shape[0]), world.layers[0], fb)
    multi.init_cuda_graph_state(len(reqs), len(reqs) * topk)
    for graphs in (False, True):
        fb = draft_batch(world, reqs, cached, 0, topk)
        if graphs:
            multi.init_forward_metadata_out_graph(fb)
            multi.init_forward_metadata_in_graph(fb)
        else:
            multi.init_forward_metadata(fb)
        for step, step_backend in enumerate(multi.attn_backends):
            step_backend.forward(*world.qkv(len(reqs) * topk), world.layers[0],
                                 draft_batch(world, reqs, cached, step, topk))
    missing = {key for key in recorder.launched if key not in recorder.compiled}
    assert recorder.launched and not missing, f"launched but not compiled at start-up: {sorted(missing)[:3]}"


def test_verify_backend_beside_torch_native_prefill(lane):
    """--decode-attention-backend evenkv with --speculative-attention-mode decode: SGLang's
    HybridAttnBackend sends TARGET_VERIFY to evenkv."""
    with get_context().override_server_args(prefill_attention_backend="torch_native",
                                            decode_attention_backend=plugin.NAME, speculative_attention_mode="decode"):
        world = speculative_world(1, lane, "EAGLE", 2)
        decode = world.backend()
        hybrid = HybridAttnBackend(world.runner, prefill_backend=TorchNativeAttnBackend(world.runner),
                                   decode_backend=decode)
    r = world.add_request(12)
    fb = world.verify_batch([r], [9], 2)
    hybrid.init_forward_metadata(fb)
    assert decode.forward_metadata is not None and decode.forward_metadata.num_tokens == 2


# -- tensor parallelism: per-rank head shapes ---------------------------------------------------


def attention_tp_rank(tp: int, rank: int):
    """What a scheduler process of rank ``rank`` in a TP ``tp`` server has published (no
    distributed group is started: SGLang's own override, topology kept consistent)."""
    return get_parallel().override(tp_size=tp, tp_rank=rank, attn_tp_size=tp, attn_tp_rank=rank, moe_tp_size=tp,
                                   moe_tp_rank=rank)


@pytest.mark.parametrize("total_q,total_kv,tp", [(32, 8, 2), (32, 8, 4), (32, 8, 8), (64, 8, 8)],
                         ids=["qwen3-8b-tp2", "qwen3-8b-tp4", "qwen3-8b-tp8", "llama-70b-tp8"])
def test_tensor_parallel_rank_shapes(lane, total_q, total_kv, tp):
    """The adapter on one attention-TP rank: Hq / TP query heads from the model's total and
    SGLang's attn_tp_size, Hkv / TP KV heads from the pool SGLang sized for the rank; one
    decode batch planned and run on them against the reference."""
    hq, hkv = total_q // tp, max(1, total_kv // tp)
    with attention_tp_rank(tp, tp - 1):
        world = World(1, *lane, hq=hq, hkv=hkv, d=128, layers=1, total_q_heads=total_q, ctx=48)
        backend = world.backend()
    assert (backend.num_q_heads, backend.num_kv_heads, backend.head_dim) == (hq, hkv, 128)
    attention = attention_of(backend)
    assert (attention.num_q_heads, attention.num_kv_heads, attention.group_size) == (hq, hkv, hq // hkv)
    cached = [30, 4]
    reqs = [world.add_request(c + 1) for c in cached]
    fb = world.decode_batch(reqs, cached)
    backend.init_forward_metadata(fb)
    plan = backend.forward_metadata.plans[LayerKind()]
    assert plan.page_table.shape == (2, 31) and plan.num_decodes == 2
    q = world.randn(2, hq * 128)
    # k = v = None: the pool already holds the new token (on the GPU, SGLang's KV-write kernel is
    # pre-built for one row width only).
    out = backend.forward(q, None, None, world.layers[0], fb)
    check_decode(world, out, q, fb)


def test_tensor_parallel_refuses_heads_that_do_not_split(lane):
    with attention_tp_rank(3, 0):
        world = World(1, *lane, total_q_heads=32)
        with pytest.raises(ValueError, match="do not split over attn_tp_size=3"):
            world.backend()


# -- evenkv for decode beside another prefill backend ----------------------------------------


def test_decode_backend_beside_torch_native_prefill(lane):
    """--prefill-attention-backend torch_native --decode-attention-backend evenkv: SGLang's
    HybridAttnBackend sends decode and the decode-graph calls to evenkv, extend elsewhere."""
    with get_context().override_server_args(prefill_attention_backend="torch_native",
                                            decode_attention_backend=plugin.NAME):
        world = World(1, *lane)
        decode = world.backend()
        hybrid = HybridAttnBackend(world.runner, prefill_backend=TorchNativeAttnBackend(world.runner),
                                   decode_backend=decode)
    assert hybrid.get_cuda_graph_seq_len_fill_value() == 1
    hybrid.init_cuda_graph_state(2, 2)
    assert decode.cuda_graph_seq_lens is not None

    prefix, new = [0, 6], [9, 4]
    reqs = [world.add_request(p + n + 1) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new)
    hybrid.init_forward_metadata(fb)
    assert decode.forward_metadata is None, "extend must not reach the decode backend"
    layer = world.layers[0]
    t = sum(new)
    hybrid.forward(*world.qkv(t), layer, fb)

    fb = world.decode_batch(reqs, [p + n for p, n in zip(prefix, new)])
    hybrid.init_forward_metadata(fb)
    meta = decode.forward_metadata
    plan = meta.plans[LayerKind()]
    assert meta is not None and meta.decode_rows and plan.batch_size == plan.num_decodes == 2
    q = world.randn(2, world.hq * world.d)
    out = hybrid.forward(q, world.randn(2, world.hkv, world.d), world.randn(2, world.hkv, world.d), layer, fb)
    check_decode(world, out, q, fb)


def test_imports_report_sglang_version():
    # Recorded in the test log: which SGLang this lane ran against.
    print(f"sglang {sglang.__version__}")
    assert sglang.__version__


# -- GPU lane: realistic sizes ---------------------------------------------------------------

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU lane: no CUDA device")
QWEN3_30B = dict(hq=32, hkv=4, d=128)  # the benchmark's attention shape


def skewed(total, batch, share):
    """batch lengths summing to total; request 0 holds `share` of it."""
    long = int(total * share)
    rest = total - long
    return [long] + [rest // (batch - 1) + (i < rest % (batch - 1)) for i in range(batch - 1)]


def check_rows(world, out, q, fb, rows, layer_id=0):
    sub = torch.tensor(rows, device=q.device)
    k_cache, v_cache = world.kv_pool.get_kv_buffer(layer_id)
    reqs = fb.req_pool_indices[sub].tolist()
    hq, d = world.hq, world.d
    assert_close_to_reference(out[sub].view(len(rows), hq, d), q[sub].view(len(rows), hq, d), k_cache, v_cache,
                              fb.seq_lens[sub], world.page_table(reqs), world.page_size, d ** -0.5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lens", [skewed(262144, 64, 0.8), [4096] * 64, skewed(1048576, 256, 0.4)],
                         ids=["skew80-b64-256K", "uniform-b64-256K", "skew40-b256-1M"])
def test_gpu_decode_realistic(monkeypatch, page_size, lens):
    """Eager decode on SGLang pools (random page placement), every policy on the same batch."""
    world = World(page_size, torch.device("cuda"), torch.bfloat16, layers=1, max_reqs=len(lens),
                  ctx=max(lens) + page_size, num_pages=sum(math.ceil(n / page_size) for n in lens) + 16, **QWEN3_30B)
    reqs = [world.add_request(n) for n in lens]
    fb = world.decode_batch(reqs, [n - 1 for n in lens])
    for policy in ("balanced", "fa3", "none"):
        monkeypatch.setenv(plugin.POLICY_ENV, policy)
        backend = world.backend()
        backend.init_forward_metadata(fb)
        q = world.randn(len(lens), world.hq * world.d)
        out = backend.forward(q, world.randn(len(lens), world.hkv, world.d), world.randn(len(lens), world.hkv, world.d),
                              world.layers[0], fb)
        check_rows(world, out, q, fb, [0, 1, len(lens) // 2, len(lens) - 1])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_cuda_graph_replay_realistic(page_size):
    """A real decode graph (bs 64) replayed on skewed batches of 64, 37 and 5 requests with
    one 64K-token request, req_to_token overwritten between out_graph and replay."""
    lens = skewed(262144, 64, 0.25) + [3000] * 8
    world = World(page_size, torch.device("cuda"), torch.bfloat16, layers=2, max_reqs=len(lens), ctx=max(lens) + 64,
                  num_pages=sum(math.ceil((n + 1) / page_size) for n in lens) + 16, **QWEN3_30B)
    backend = world.backend()
    driver = GraphDriver(world, backend, bs=64)
    driver.capture()
    reqs = [world.add_request(n + 1) for n in lens]
    saved = world.req_pool.req_to_token.clone()
    for pick in [list(range(64)), list(range(64, 72)) + list(range(0, 58, 2)), [0, 70, 3, 71, 5]]:
        world.req_pool.req_to_token.copy_(saved)
        batch = [reqs[i] for i in pick]
        outs, q, real = driver.replay(batch, [lens[i] for i in pick], after_out_graph=overwrite_shared_state(world))
        torch.cuda.synchronize()
        raw = len(batch)
        for layer, out in zip(world.layers, outs):
            assert torch.count_nonzero(out[raw:]) == 0
            check_rows(world, out[:raw], q[:raw], real, [0, 1, raw // 2, raw - 1], layer.layer_id)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_extend_realistic(page_size):
    """Chunked prefill on long prefixes beside fresh prompts (SGLang token pool layout)."""
    prefix, new = [16384, 0, 4000, 0], [2048, 3000, 1, 512]
    world = World(page_size, torch.device("cuda"), torch.bfloat16, layers=1, max_reqs=4,
                  ctx=max(p + n for p, n in zip(prefix, new)) + 64,
                  num_pages=sum(math.ceil((p + n) / page_size) for p, n in zip(prefix, new)) + 16, **QWEN3_30B)
    backend = world.backend()
    reqs = [world.add_request(p + n) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new)
    backend.init_forward_metadata(fb)
    t = sum(new)
    q = world.randn(t, world.hq * world.d)
    out = backend.forward(q, world.randn(t, world.hkv, world.d), world.randn(t, world.hkv, world.d),
                          world.layers[0], fb)
    check_extend(world, out, q, fb)


# -- prefill on SGLang's own FA3 ---------------------------------------------------------------


def test_flash_attention_prefill_choice(monkeypatch):
    """SGLang's FA3 on SM90 when its build loads, else none (evenkv's Triton extend), and none
    with EVENKV_PREFILL=triton; the call passes the extend rows as SGLang's fa3 backend does."""
    from sglang.kernels.ops.attention import flash_attention_v3 as fa3

    from evenkv.integrations import prefill

    calls = []
    monkeypatch.setattr(fa3, "flash_attn_with_kvcache", lambda **kw: calls.append(kw))
    monkeypatch.setattr(fa3, "_load_fa3_kernels", lambda: {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("EVENKV_PREFILL", raising=False)
    gpu = torch.device("cuda", 0)
    kernel = prefill.sglang_flash_attention(gpu)
    q, cu, lens, pt = torch.zeros(5, 4, 64), torch.tensor([0, 5]), torch.tensor([9]), torch.zeros(1, 9)
    kernel(q, q, q, q, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, max_q_len=5, max_seq_len=9, sm_scale=0.1)
    assert calls[0]["cache_seqlens"] is lens and calls[0]["page_table"] is pt and calls[0]["out"] is q
    assert calls[0]["causal"] and calls[0]["max_seqlen_q"] == 5
    assert calls[0]["k_descale"] is None and calls[0]["q"] is q and calls[0]["sinks"] is None
    assert kernel.fp8_cache_dtypes == kernel.invariant().fp8_cache_dtypes == (torch.bfloat16,)  # as fa3 does
    sinks = torch.tensor([0.1, -1.0, 2.5, 3.3])
    kernel(q, q, q, q, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, max_q_len=5, max_seq_len=9, sm_scale=0.1,
           sinks=sinks)
    assert torch.equal(calls[-1]["sinks"], sinks.bfloat16()) and kernel.takes_sinks(128)
    k8 = torch.zeros(9, 1, 2, 64, dtype=torch.float8_e4m3fn)
    kernel(q, k8, k8, q, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, max_q_len=5, max_seq_len=9, sm_scale=0.1,
           k_scale=0.5, v_scale=2.0)
    call = calls[-1]
    assert call["q"].dtype == torch.float8_e4m3fn and call["k_descale"].shape == (1, 2)
    assert call["k_descale"].eq(0.5).all() and call["v_descale"].eq(2.0).all()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert prefill.sglang_flash_attention(gpu) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def no_build():
        raise ImportError("no sgl_kernel flash_ops")

    monkeypatch.setattr(fa3, "_load_fa3_kernels", no_build)
    assert prefill.sglang_flash_attention(gpu) is None
    monkeypatch.setattr(fa3, "_load_fa3_kernels", lambda: {})
    monkeypatch.setenv("EVENKV_PREFILL", "triton")
    assert prefill.sglang_flash_attention(gpu) is None
    assert prefill.sglang_flash_attention(torch.device("cpu")) is None


def test_prefill_backend_beside_torch_native_decode(lane):
    """--prefill-attention-backend evenkv --decode-attention-backend torch_native: the reverse
    of the hybrid above also serves, evenkv taking every extend batch."""
    with get_context().override_server_args(prefill_attention_backend=plugin.NAME,
                                            decode_attention_backend="torch_native"):
        world = World(1, *lane)
        prefill = world.backend()
        hybrid = HybridAttnBackend(world.runner, prefill_backend=prefill,
                                   decode_backend=TorchNativeAttnBackend(world.runner))
    prefix, new = [0, 6], [9, 4]
    reqs = [world.add_request(p + n + 1) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new)
    hybrid.init_forward_metadata(fb)
    meta = prefill.forward_metadata
    assert meta is not None and not meta.decode_rows and meta.num_tokens == sum(new)
    layer = world.layers[0]
    t = sum(new)
    out = hybrid.forward(*world.qkv(t), layer, fb)
    assert out.shape == (t, world.hq * world.d) and torch.isfinite(out).all()


class _WithFlags:
    """Server args with some fields set, the rest read through from the real ones."""

    def __init__(self, args, **flags):
        self.__dict__.update(_args=args, **flags)

    def __getattr__(self, name):
        return getattr(self._args, name)


def test_deterministic_inference(lane, caplog):
    """--enable-deterministic-inference accepts evenkv and selects its deterministic decode, which
    the start-up line says; extend batches then read the new tokens back from the cache
    (chunking-invariant)."""
    from sglang.srt import server_args as sa

    plugin.register()
    assert plugin.NAME in sa.DETERMINISTIC_ATTENTION_BACKEND_CHOICES
    assert plugin.NAME in sa.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND
    world = World(1, *lane)
    # What the model runner holds when the server ran with --enable-deterministic-inference.
    # A view, not a test override: SGLang 0.5.23's override_server_args drops this field.
    world.runner.server_args = _WithFlags(world.runner.server_args, enable_deterministic_inference=True)
    with caplog.at_level(logging.INFO, logger="evenkv"):
        backend = world.backend()
    assert backend.deterministic and attention_of(backend).deterministic and attention_of(backend).decode.deterministic
    assert "decode on evenkv's kernels (balanced: the balanced plan; deterministic:" in caplog.text
    prefix, new = [0, 6], [9, 4]
    reqs = [world.add_request(p + n + 1) for p, n in zip(prefix, new)]
    fb = world.extend_batch(reqs, prefix, new)
    backend.init_forward_metadata(fb)
    t = sum(new)
    out = backend.forward(*world.qkv(t), world.layers[0], fb)
    assert torch.isfinite(out).all()


def test_deterministic_from_environment(lane, monkeypatch):
    """EVENKV_DETERMINISTIC=1 without the server flag: the Attention objects and the backend's
    extend path (new tokens read back from the cache) agree on it."""
    monkeypatch.setenv("EVENKV_DETERMINISTIC", "1")
    backend = World(1, *lane).backend()
    assert backend.deterministic and attention_of(backend).decode.deterministic
