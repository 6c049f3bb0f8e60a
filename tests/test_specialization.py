"""No kernel compiles after start-up: every launch a stream of random batches makes has the
specialization key of a launch ``warmup`` made.

Triton compiles a kernel once per key: the constexpr values, the launch options, the
dtypes of the tensors and whether their addresses are 16-byte aligned, and for each integer
argument not marked ``do_not_specialize`` whether it is 1 and whether it is a multiple of
16. The launchers are recorded instead of run (the ``recorder`` fixture; nothing executes),
so the test is fast on any machine; ``tests/gpu/test_compile_count.py`` counts real
compilations on a GPU.
"""

import pytest
import torch

import evenkv
from evenkv.kernels import plan_launch
from evenkv.kv_cache import warmup_write_kv


def _assert_covered(rec):
    missing = {key for key in rec.launched if key not in rec.compiled}
    assert rec.launched and not missing, f"{len(missing)} launch keys not compiled at warm-up: {sorted(missing)[:3]}"


HQ, HKV, D = 8, 2, 128


def _tensors(device, page_size, num_pages=400, tokens=600, packed=True):
    """q [T, Hq, D] as a view of a packed qkv row (engine-like strides), caches as vLLM's K|V
    halves ([slots, Hkv, 2D] views) or plain [slots, Hkv, D], k_new/v_new views of the qkv row."""
    qkv = torch.zeros(tokens, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device=device)
    q = qkv[:, :HQ * D].view(tokens, HQ, D)
    k_new = qkv[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D)
    v_new = qkv[:, (HQ + HKV) * D:].view(tokens, HKV, D)
    if packed:
        kv = torch.zeros(num_pages * page_size, HKV, 2 * D, dtype=torch.bfloat16, device=device)
        k_cache, v_cache = kv[..., :D], kv[..., D:]
    else:
        k_cache = torch.zeros(num_pages * page_size, HKV, D, dtype=torch.bfloat16, device=device)
        v_cache = torch.zeros_like(k_cache)
    return q, k_new, v_new, k_cache, v_cache


class SilentPrefill:
    """An engine prefill kernel that does nothing (only evenkv's launches are recorded)."""

    name, fp8_cache_dtypes = "silent prefill", ()

    def takes_sinks(self, num_q_heads):
        return True

    def invariant(self):
        return self

    def __call__(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("page_size,new_tokens", [(16, False), (1, True)], ids=["vllm-like", "sglang-like"])
@pytest.mark.parametrize("policy,prefill", [(policy, False) for policy in evenkv.POLICIES] + [("balanced", True)],
                         ids=list(evenkv.POLICIES) + ["balanced-engine-prefill"])
def test_random_batches_compile_nothing_after_warmup(device, recorder, page_size, new_tokens, policy, prefill):
    """Attention (both engines' entry): batch sizes across the plan kernel's chunk buckets and
    the many-segments threshold, page tables of any width and row stride, any query lengths,
    any number of decode rows, int32 and int64 lengths; extend rows on evenkv's kernel or an
    engine's (``prefill``: then evenkv bounds their rows, from any first row, and the new
    tokens are read from the cache, as SGLang's adapter then passes them)."""
    max_batch, width = 300, 64
    q, k_new, v_new, k_cache, v_cache = _tensors(device, page_size, packed=not new_tokens)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    attn = evenkv.Attention(HQ, HKV, D, page_size, torch.bfloat16, device, max_batch, width, policy,
                            prefill_kernel=SilentPrefill() if prefill else None)
    assert (attn.prefill_kernel is not None) == prefill
    kn, vn = (k_new, v_new) if new_tokens and not prefill else (None, None)
    attn.warmup(q, k_cache, v_cache, k_new=kn, v_new=vn, out=out)
    gen = torch.Generator().manual_seed(0)
    page_tables = torch.zeros(max_batch, width + 7, dtype=torch.int32, device=device)
    for step in range(40):
        batch = int(torch.randint(1, max_batch + 1, (1,), generator=gen))
        cols = int(torch.randint(1, width + 1, (1,), generator=gen))
        decodes = int(torch.randint(0, batch + 1, (1,), generator=gen)) if step % 3 else batch
        q_lens = [1] * decodes + torch.randint(1, 9, (batch - decodes,), generator=gen).tolist()
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        dtype = torch.int64 if step % 2 else torch.int32
        seq_lens = torch.randint(1, cols * page_size + 1, (batch,), generator=gen).to(dtype).to(device)
        table = page_tables[:batch, :cols] if step % 4 else torch.zeros(batch, cols, dtype=torch.int32,
                                                                           device=device)
        plan = attn.plan(cu, seq_lens, table, num_decodes=decodes, max_q_len=max(q_lens))
        total = int(cu[-1])
        attn.run(plan, q[:total], k_cache, v_cache, out=out[:total],
                 k_new=None if kn is None else kn[:total], v_new=None if vn is None else vn[:total],
                 sm_scale=0.1 + step / 100)
    _assert_covered(recorder)


@pytest.mark.parametrize("halves", [True, False], ids=["vllm-halves", "token-major"])
def test_packed_kv_heads_compile_nothing_after_warmup(device, recorder, halves):
    """Head dim 64 over an FP8 cache walks two KV heads as one: warm-up builds the packed
    kernels for the cache it is given (the two heads a stride apart in vLLM's K|V halves, side
    by side in a token-major cache), so decode batches on either side of the many-segments
    threshold launch nothing it did not build."""
    hq, hkv, d, page, max_batch, width = 8, 2, 64, 16, 300, 8
    fp8 = torch.float8_e4m3fn
    if halves:
        kv = torch.zeros(64 * page, hkv, 2 * d, dtype=fp8, device=device)
        k_cache, v_cache = kv[..., :d], kv[..., d:]
    else:
        k_cache = torch.zeros(64 * page, hkv, d, dtype=fp8, device=device)
        v_cache = torch.zeros_like(k_cache)
    attn = evenkv.Attention(hq, hkv, d, page, torch.bfloat16, device, max_batch, width, kv_dtype=fp8)
    assert attn.decode.head_pack == 2
    q = torch.zeros(max_batch, hq, d, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    attn.warmup(q, k_cache, v_cache, out=out)
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 7, max_batch):
        seq_lens = torch.randint(1, width * page + 1, (batch,), generator=gen).to(torch.int32).to(device)
        table = torch.randint(0, 64, (batch, width), generator=gen).to(torch.int32).to(device)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        plan = attn.plan(cu, seq_lens, table, num_decodes=batch, max_q_len=1)
        attn.run(plan, q[:batch], k_cache, v_cache, out=out[:batch], k_scale=0.5, v_scale=0.25)
    _assert_covered(recorder)


def test_write_kv_compiles_nothing_after_warmup(device, recorder):
    q, k_new, v_new, k_cache, v_cache = _tensors(device, 16)
    warmup_write_kv(k_cache, v_cache, k_new, v_new)
    for n, dtype in ((1, torch.int64), (37, torch.int32), (600, torch.int64)):
        evenkv.write_kv(k_cache, v_cache, k_new[:n], v_new[:n], torch.zeros(n, dtype=dtype, device=device))
    _assert_covered(recorder)


def test_the_check_sees_a_new_specialization(device, recorder):
    """The check is not vacuous: warmed up for int32 lengths only, a plan on int64 lengths is
    a launch warm-up did not compile."""
    q, k_new, v_new, k_cache, v_cache = _tensors(device, 16)
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, torch.bfloat16, device, 8, 8)
    attn.warmup(q, k_cache, v_cache, index_dtypes=(torch.int32,))
    table = torch.zeros(2, 8, dtype=torch.int32, device=device)
    attn.run(attn.plan(torch.ones(2, dtype=torch.int32, device=device), table), q[:2], k_cache, v_cache)
    _assert_covered(recorder)
    attn.run(attn.plan(torch.ones(2, dtype=torch.int64, device=device), table), q[:2], k_cache, v_cache)
    with pytest.raises(AssertionError, match="not compiled at warm-up"):
        _assert_covered(recorder)


@pytest.mark.parametrize("engine", ["vllm-like", "sglang-like"])
def test_speculative_batches_compile_nothing_after_warmup(device, recorder, engine):
    """Steps of a speculating engine after the warm-up its adapter does (``max_decode_q_len`` =
    1 + k draft tokens). vLLM-like (k = 3): pages of 16, the cache read for every row, int32
    lengths only; decode rows of 1 to 1 + k query tokens (verify rows, short prefill chunks)
    then padding requests (q_len 0, seq_len 0) or prefill rows. SGLang-like (n-gram, k = 7): page
    1, new tokens in k_new/v_new, int64 lengths; uniform verify batches with tree masks, plain
    decode batches and extend batches, and the adapter's ``q_lens=(1, 1 + k)``: every decode
    variant built is one these batches launch (rows of 2-4 tokens would take a 16-row variant of
    their own; 8 tokens x G = 4 take 32 rows). Both engines' cu_seqlens_q are int32."""
    vllm = engine == "vllm-like"
    page_size, max_batch, width, verify = (16, 300, 64, 4) if vllm else (1, 300, 1024, 8)
    q, k_new, v_new, k_cache, v_cache = _tensors(device, page_size, packed=vllm)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    # SGLang's adapter under n-gram speculation: decode batches of 1 token, verify batches of
    # 1 + k tokens with tree masks.
    sglang = {} if vllm else dict(q_lens=(1, verify), tree_masks=True)
    attn = evenkv.Attention(HQ, HKV, D, page_size, torch.bfloat16, device, max_batch, width,
                            max_decode_q_len=verify, **sglang)
    new = {} if vllm else dict(k_new=k_new, v_new=v_new)
    index_dtypes = (torch.int32,) if vllm else (torch.int64,)
    attn.warmup(q, k_cache, v_cache, out=out, index_dtypes=index_dtypes, **new)
    gen = torch.Generator().manual_seed(2)
    for step in range(40):
        batch = int(torch.randint(1, max_batch // verify + 1, (1,), generator=gen))
        kind = step % 3  # 0: uniform verify, 1: decode rows of any length (vLLM) / plain decode, 2: with prefills
        if kind == 0:
            q_lens, decodes = [verify] * batch, batch
        elif kind == 1:
            q_lens = torch.randint(1, verify + 1, (batch,), generator=gen).tolist() if vllm else [1] * batch
            decodes = batch
        else:
            decodes = int(torch.randint(0, batch + 1, (1,), generator=gen)) if vllm else 0
            q_lens = (torch.randint(1, verify + 1, (decodes,), generator=gen).tolist() +
                      torch.randint(verify + 1, 3 * verify, (batch - decodes,), generator=gen).tolist())
        padding = int(torch.randint(0, 3, (1,), generator=gen)) if vllm and decodes == batch else 0
        q_lens += [0] * padding
        decodes += padding
        dtype = index_dtypes[step % len(index_dtypes)]
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        seq_lens = [q_len + int(torch.randint(0, width * page_size - q_len + 1, (1,), generator=gen)) if q_len else 0
                    for q_len in q_lens]
        seq_lens = torch.tensor(seq_lens, dtype=dtype, device=device)
        table = torch.zeros(len(q_lens), width, dtype=torch.int32, device=device)
        decode_q_len = max(q_lens[:decodes], default=1) or 1
        decode_tokens = {} if decode_q_len == 1 else dict(num_decode_tokens=int(cu[decodes]))
        if sglang and decode_q_len > 1:
            chain = [(1 << (t + 1)) - 1 for t in range(verify)] * decodes
            decode_tokens["tree_mask"] = torch.tensor(chain, dtype=torch.int32, device=device)
        plan = attn.plan(cu, seq_lens, table, num_decodes=decodes, max_q_len=max(q_lens),
                         decode_q_len=decode_q_len, **decode_tokens)
        total = int(cu[-1])
        attn.run(plan, q[:total], k_cache, v_cache, out=out[:total],
                 **{name: tensor[:total] for name, tensor in new.items()})
    _assert_covered(recorder)
    if sglang:  # and nothing more: only the variants such batches launch were built
        launched = set(recorder.launched)
        assert not {key for key in recorder.compiled if key[0] == "decode_stream_kernel" and key not in launched}


def _as_on_gpu(attn, monkeypatch):
    """Make an interpreter object behave as one on the GPU before its first build: each grid at
    its config's cap, unresolved, and decode builds that come back as futures whose kernel of
    the i-th build fits i CTAs per SM. Returns (the parallel-compile mode of each decode build,
    the builds whose result was asked for, each decode build's CTAs per SM by (config name,
    max_q_len), the (mode, grids) of each plan-kernel build)."""
    from triton.runtime._async_compile import active_mode

    from evenkv.kernels import decode_launch

    modes, built, plans, ctas_of = [], [], [], {}

    class InFlight:
        def __init__(self, ctas):
            self.ctas = ctas

        def result(self):
            built.append(self.ctas)
            return self

    def compile_decode(config, t, query, merge=False):
        modes.append(active_mode.get())
        ctas_of[config.name, query.max_q_len] = len(modes)
        return InFlight(len(modes))

    def compile_plans(page_table, index_dtypes):
        plans.append((active_mode.get(), list(attn._grids)))

    monkeypatch.setattr(attn, "_compile", compile_decode)
    monkeypatch.setattr(attn, "_compile_plans", compile_plans)
    monkeypatch.setattr(decode_launch, "resident_ctas_per_sm", lambda kernel, dev: kernel.ctas)
    attn._set_grids([attn.num_sms * config.max_ctas_per_sm for config, _ in attn._probes])
    attn._grids_resolved = False
    return modes, built, ctas_of, plans


def test_warmup_builds_everything_in_one_batch_then_sets_grids(device, monkeypatch):
    """On the GPU a variant's persistent grid comes from its built decode kernel (registers,
    shared memory), so the constructor builds nothing: each grid is its config's cap until
    ``warmup``, which submits every build (decode, merge, plan) to one parallel-compile batch,
    then sets each grid from its own variant's kernel, and builds the plan kernels again, in a
    second batch, only where a grid changed."""
    q, _, _, k_cache, v_cache = _tensors(device, 16)
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, torch.bfloat16, device, 8, 4, max_q_len=4)
    modes, built, ctas_of, plans = _as_on_gpu(attn, monkeypatch)
    caps = list(attn._grids)
    attn.warmup(q, k_cache, v_cache, index_dtypes=(torch.int32,))
    assert modes[0] is not None and all(mode is modes[0] for mode in modes) and plans[0][0] is modes[0]
    assert plans[0][1] == caps, "the first plan builds are for the caps' grids, in the same batch"
    assert {query.max_q_len for _, query in attn._probes} == {1, 2, 4}
    assert sorted(built) == sorted(ctas_of[config.name, query.max_q_len] for config, query in attn._probes)
    expected = [attn.num_sms * min(ctas_of[config.name, query.max_q_len], config.max_ctas_per_sm)
                for config, query in attn._probes]
    assert attn._grids == expected and expected != caps
    assert attn.num_ctas == expected[0] and attn.launch_config(1) == (attn._probes[0][0], expected[0])
    assert len(plans) == 2 and plans[1][0] is not modes[0] and plans[1][1] == expected
    assert set(attn._grid_schedules) == set(expected) and attn._schedule.num_ctas == expected[0]


def test_first_plan_before_warmup_builds_the_grids_kernels(device, monkeypatch):
    """A plan before ``warmup`` (the functional API, a user who never warms up) builds the
    decode kernels that set the grids, in one batch, and plans on the grids they give."""
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, torch.bfloat16, device, 8, 4)
    modes, built, _, plans = _as_on_gpu(attn, monkeypatch)
    monkeypatch.setattr(plan_launch, "launch_plan_stream", lambda *args, **kwargs: None)
    table = torch.zeros(2, 4, dtype=torch.int32, device=device)
    plan = attn.plan(torch.full((2,), 40, dtype=torch.int32, device=device), table)
    assert len(modes) == len(attn._probes) == 2 and modes[0] is modes[1] is not None and sorted(built) == [1, 2]
    assert plan.schedule.num_ctas == attn.num_ctas == attn.num_sms * 1
    assert not plans, "plan kernels compile when launched, not ahead"
    attn.plan(torch.full((2,), 40, dtype=torch.int32, device=device), table)
    assert len(modes) == 2, "grids are set once"


def test_plans_of_every_grid_share_one_plan_kernel(device, recorder):
    """The plan kernel's variant does not depend on the grid it plans for (one start-up build
    fewer per grid): an object whose many-segments row runs another grid than its main row
    (here 10 CTAs against 4, 5 CTAs per SM against 2 on the interpreter's 2 SMs) builds one
    plan variant per batch chunk and length dtype, and plans of both grids launch it."""
    import dataclasses

    q, _, _, k_cache, v_cache = _tensors(device, 16)
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, torch.bfloat16, device, 16, 8)
    config, grid, (many, _) = attn._variants[1]
    attn._variants[1] = (config, grid, (many, 10))
    attn._grid_schedules[10] = dataclasses.replace(attn._schedule, num_ctas=10)
    attn.warmup(q, k_cache, v_cache, index_dtypes=(torch.int32,))
    assert len({key for key in recorder.compiled if key[0] == "plan_stream_kernel"}) == 1
    table = torch.zeros(16, 8, dtype=torch.int32, device=device)
    seq_lens = torch.full((16,), 100, dtype=torch.int32, device=device)
    for batch, ctas in ((2, grid), (16, 10)):  # below and at the many-segments threshold
        plan = attn.plan(seq_lens[:batch], table[:batch])
        assert plan.schedule.num_ctas == ctas
        attn.run(plan, q[:batch], k_cache, v_cache)
    _assert_covered(recorder)


def test_named_q_lens_cover_every_plannable_row(device, recorder):
    """An object naming only 4-token rows (q_lens=(4,)) with tree masks: plain rows (q_len 1,
    no mask) run on the 4-token bucket too, and its warm-up builds that causal variant beside
    the tree-masked one."""
    page_size, width = 16, 8
    q, _, _, k_cache, v_cache = _tensors(device, page_size)
    attn = evenkv.DecodeAttention(HQ, HKV, D, page_size, torch.bfloat16, device, 16, width, max_q_len=4,
                                  q_lens=(4,), tree_masks=True)
    attn.warmup(q, k_cache, v_cache, index_dtypes=(torch.int32,))
    table = torch.zeros(4, width, dtype=torch.int32, device=device)
    seq_lens = torch.full((4,), 50, dtype=torch.int32, device=device)
    attn.run(attn.plan(seq_lens, table), q[:4], k_cache, v_cache)
    cu = torch.arange(0, 17, 4, dtype=torch.int32, device=device)
    tree = torch.tensor([1, 3, 7, 15] * 4, dtype=torch.int32, device=device)
    attn.run(attn.plan(seq_lens, table, cu_seqlens_q=cu, q_len=4, tree_mask=tree), q[:16], k_cache, v_cache)
    _assert_covered(recorder)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_grid_probes_before_warmup_build_the_kernels_runs_launch(device, recorder, monkeypatch, kv_dtype):
    """On the GPU the first plan of an object that was not warmed up builds each variant's decode
    kernel on one-page stand-in tensors, through the real launchers, to size its grid. Those
    builds must go through the launchers' host code (a cache of one page as [1, page_size, Hkv,
    D]) and be the very kernels a token-major cache's runs launch: nothing compiles twice."""
    from evenkv.kernels import decode_launch

    monkeypatch.setattr(decode_launch, "resident_ctas_per_sm", lambda kernel, dev: 2)
    attn = evenkv.DecodeAttention(HQ, HKV, D, 16, torch.bfloat16, device, 8, 8, kv_dtype=kv_dtype)
    attn._grids_resolved = False
    table = torch.zeros(2, 8, dtype=torch.int32, device=device)
    plan = attn.plan(torch.ones(2, dtype=torch.int32, device=device), table)
    probes = set(recorder.compiled)
    assert {key[0] for key in probes} == {"decode_stream_kernel"}, sorted(probes)
    assert attn._grids == [attn.num_sms * 2] * len(attn._probes)
    recorder.compiled.clear()
    k_cache = torch.zeros(64 * 16, HKV, D, dtype=torch.bfloat16, device=device).to(kv_dtype)
    q = torch.zeros(2, HQ, D, dtype=torch.bfloat16, device=device)
    attn.warmup(q, k_cache, k_cache.clone())
    attn.run(plan, q, k_cache, k_cache.clone())
    assert probes <= recorder.compiled, "the grid probes built kernels warm-up does not"
    _assert_covered(recorder)
