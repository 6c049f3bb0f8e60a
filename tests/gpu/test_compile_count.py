"""GPU lane: after ``warmup``, a random stream of batches compiles no kernel.

Counts Triton's post-compile hook (called for every new specialization of a kernel in this
process, whether its binary came from the disk cache or not) while random batches run for
real: decode-only, mixed and extend-only, batch sizes across the plan kernel's chunk
buckets and the many-segments threshold, page tables of any width, int32 and int64
lengths, pages 16 (vLLM-like tensors) and 1 (SGLang-like, new tokens in k_new/v_new).
"""

import os

import pytest
import torch

import evenkv
from evenkv.integrations.prefill import vllm_flash_attention
from evenkv.kernels import decode_launch
from evenkv.kv_cache import warmup_write_kv
from evenkv.kernels.reference import decode_reference
from evenkv.testing import random_paged_batch
from helpers import TOLERANCE_FLOOR, lowp_decode
from test_specialization import _tensors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU lane: no CUDA device")]

HQ, HKV, D = 8, 2, 128


def test_the_hook_counts(compiles):
    """Not vacuous: a specialization nothing built before (3 KV heads of 80) is counted."""
    k = torch.zeros(64, 3, 80, dtype=torch.float16, device="cuda")
    evenkv.write_kv(k, k.clone(), k[:3], k[:3], torch.arange(3, device="cuda"))
    assert any("kv_write_kernel" in name for name in compiles)


@pytest.mark.parametrize("page_size,new_tokens,gpt_oss,engine_prefill",
                         [(16, False, False, False), (1, True, False, False), (16, False, True, False),
                          (16, False, False, True)],
                         ids=["vllm-like", "sglang-like", "gpt-oss-like", "vllm-like-fa3-prefill"])
def test_no_compilation_after_warmup(compiles, page_size, new_tokens, gpt_oss, engine_prefill):
    """gpt-oss-like: a 128-token sliding window, bf16 sinks and an FP8 cache with scales.
    vllm-like-fa3-prefill: extend rows on vLLM's FA3, behind the rows' guard and the zeroing
    page audit (FA3's own kernels are ahead-of-time builds, not Triton's)."""
    layer, run, scales = {}, {}, {}
    if engine_prefill:
        layer["prefill_kernel"] = vllm_flash_attention("cuda")
        if layer["prefill_kernel"] is None:
            pytest.skip("vllm.vllm_flash_attn is not importable here (source the peers or vLLM kit)")
    max_batch, width = 2048, 256
    q, k_new, v_new, k_cache, v_cache = _tensors("cuda", page_size, num_pages=4096 // page_size * 64,
                                                 tokens=4096, packed=not new_tokens)
    if gpt_oss:
        kv = torch.zeros(k_cache.shape[0], HKV, 2 * D, dtype=torch.float8_e4m3fn, device="cuda")  # vLLM's K|V halves
        k_cache, v_cache = kv[..., :D], kv[..., D:]
        layer = dict(sliding_window=128, kv_dtype=torch.float8_e4m3fn)
        scales = dict(k_scale=0.5, v_scale=0.25)
        run = dict(sinks=torch.zeros(HQ, dtype=torch.bfloat16, device="cuda"), **scales)
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    attn = evenkv.Attention(HQ, HKV, D, page_size, torch.bfloat16, "cuda", max_batch, width, **layer)
    kn, vn = (k_new, v_new) if new_tokens else (None, None)
    attn.warmup(q, k_cache, v_cache, k_new=kn, v_new=vn, out=out, sinks=run.get("sinks"))
    warmup_write_kv(k_cache, v_cache, k_new, v_new)
    compiles.clear()
    gen = torch.Generator().manual_seed(1)
    tables = torch.randint(0, k_cache.shape[0] // page_size, (max_batch, width + 3), generator=gen,
                           dtype=torch.int32).cuda()
    for step in range(60):
        batch = int(torch.randint(1, max_batch + 1, (1,), generator=gen))
        cols = int(torch.randint(1, width + 1, (1,), generator=gen))
        decodes = batch if step % 3 == 0 else int(torch.randint(0, batch + 1, (1,), generator=gen))
        q_lens = [1] * decodes + torch.randint(1, min(65, cols * page_size + 1), (batch - decodes,),
                                               generator=gen).tolist()
        total = sum(q_lens)
        if total > q.shape[0]:
            continue
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        dtype = torch.int64 if step % 2 else torch.int32
        prefix = torch.randint(0, cols * page_size + 1, (batch,), generator=gen)
        seq_lens = (torch.tensor(q_lens) + prefix).clamp(max=cols * page_size).to(dtype).cuda()
        plan = attn.plan(cu, seq_lens, tables[:batch, :cols], num_decodes=decodes, max_q_len=max(q_lens))
        attn.run(plan, q[:total], k_cache, v_cache, out=out[:total], k_new=kn[:total] if new_tokens else None,
                 v_new=vn[:total] if new_tokens else None, **run)
        slots = torch.randint(-1, k_cache.shape[0], (total,), generator=gen).cuda()
        evenkv.write_kv(k_cache, v_cache, k_new[:total], v_new[:total], slots, **scales)
    torch.cuda.synchronize()
    assert compiles == [], f"kernels compiled after warm-up: {compiles}"
    evenkv.check_errors()


def test_cold_warmup_builds_in_children(compiles, tmp_path, monkeypatch):
    """On an empty disk cache, the constructor builds nothing and every build of the warm-up
    happens in a forked child: this process only loads the children's binaries (Triton's compile listener sees a
    cache hit for each), and the object then decodes a batch correctly without a build. A
    shape nothing else in this process built (5 q / 1 KV heads of 96) keeps the in-memory
    kernel caches out of it. The persistent grids come from the built decode kernels. The children
    build the kernels' launchers too: this process compiles none (Triton's ``_build`` of a
    ``__triton_launcher`` module), neither in the warm-up nor at the first launches."""
    import triton
    import triton.runtime.build as triton_build
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    launchers_built_here = []
    parent, real_build = os.getpid(), triton_build._build

    def recording_build(name, *args, **kwargs):
        if name == "__triton_launcher" and os.getpid() == parent:
            launchers_built_here.append(name)
        return real_build(name, *args, **kwargs)

    monkeypatch.setattr(triton_build, "_build", recording_build)
    monkeypatch.setenv("EVENKV_BUILD_PROCESSES", "4")
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda *, cache_hit, **_: hits.append(cache_hit))
    hq, hkv, d, page = 5, 1, 96, 16
    q, k_cache, v_cache, seq_lens, table = random_paged_batch([1, 300, 0, 1000], hq, hkv, d, page, torch.bfloat16,
                                                              "cuda", seed=3)
    attn = evenkv.Attention(hq, hkv, d, page, torch.bfloat16, "cuda", 8, table.shape[1])
    assert compiles == [], "the constructor builds nothing: the warm-up builds everything in one batch"
    attn.warmup(q, k_cache, v_cache, index_dtypes=(torch.int32,))
    assert len(compiles) >= 5 and len(hits) == len(compiles), (compiles, hits)
    decode = attn.decode
    for (config, query), grid in zip(decode._probes, decode._grids):
        kernel = decode._compile(config, decode._dummy_inputs(), query)
        resident = decode_launch.resident_ctas_per_sm(kernel, decode.device)
        assert grid == decode.num_sms * min(resident, config.max_ctas_per_sm), (config.name, grid, resident)
    assert all(hits), f"built in this process, not loaded from a child's build: {hits}"
    compiles.clear()
    cu = torch.arange(5, dtype=torch.int32, device="cuda")
    out = attn.run(attn.plan(cu, seq_lens, table, num_decodes=4, max_q_len=1), q, k_cache, v_cache)
    assert compiles == []
    assert launchers_built_here == [], f"{len(launchers_built_here)} launchers compiled here, not in a child"
    ref = decode_reference(q, k_cache, v_cache, seq_lens, table, page)
    base = (lowp_decode(q, k_cache, v_cache, seq_lens, table, page).float() - ref).abs().max().item()
    assert (out.float() - ref).abs().max().item() <= 2 * base + TOLERANCE_FLOOR[q.dtype]


def test_warm_disk_cache_loads_without_forking(compiles, tmp_path, monkeypatch):
    """A warm-up whose every build is in the disk cache (a kept TRITON_CACHE_DIR) forks no child:
    the async-compile keys evenkv probes (``launching.in_disk_cache``) are where
    ``triton.compile`` stores its builds. The in-memory kernel caches are emptied between the
    two warm-ups, as in a fresh process."""
    import triton
    from triton.runtime.jit import JITFunction

    from evenkv.kernels import decode, extend, kv_write, launching, plan

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setenv("EVENKV_BUILD_PROCESSES", "4")
    forks = []
    build_in_children = launching.build_in_children
    monkeypatch.setattr(launching, "build_in_children", lambda builds, n: (forks.append(len(builds)),
                                                                             build_in_children(builds, n)))
    hq, hkv, d, page = 7, 1, 80, 16
    q, k_cache, v_cache, _, table = random_paged_batch([1, 300], hq, hkv, d, page, torch.bfloat16, "cuda", seed=4)

    def warm_up():
        for module in (decode, extend, kv_write, plan):
            for fn in vars(module).values():
                if isinstance(fn, JITFunction):
                    fn.device_caches.clear()
        attn = evenkv.Attention(hq, hkv, d, page, torch.bfloat16, "cuda", 8, table.shape[1])
        attn.warmup(q, k_cache, v_cache, index_dtypes=(torch.int32,))

    warm_up()
    assert forks and len(compiles) >= 5, (forks, compiles)
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda *, cache_hit, **_: hits.append(cache_hit))
    forks.clear()
    warm_up()
    assert forks == [] and hits and all(hits), (forks, hits)
