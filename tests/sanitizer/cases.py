"""Tiny runs of every evenkv kernel for compute-sanitizer on the GPU (tests/sanitizer/run.sh).

    python3 tests/sanitizer_cases.py [all|persistent|hostile|terms]

all (default): decode for each policy (balanced, fa3, none, balanced + deterministic) on
page sizes 16 and 1, with the merge kernels (small and default CTA counts so requests
are cut), write_kv (int32 and int64 slot mappings with skipped -1 slots), extend (both
KV layouts), a mixed batch (evenkv.Attention), the layer terms (terms: a window, a soft-cap,
sinks and an FP8 cache on every policy, and in a mixed batch); the balanced policy with each sm90 table row
that tiny batches do not pick (the many-segments rows of head_dim 64 and 128, head_dim
256 at page 16) passed explicitly. persistent: only the persistent decode kernels
(balanced stream, fa3 and deterministic unit queues), for racecheck.

Every batch has seq_len-0 rows, partly filled last pages, page-table tails holding an
out-of-range page id (a read there is an out-of-bounds access memcheck reports) and NaN
in every cache slot no request owns (a read there shows in the result). Results are
also checked against the fp32 oracles (run on the host, so few torch kernels are
sanitized) with the tolerance rule, so a clean sanitizer run is also a correct one. Prints one "CASE ok" line per case and "CASES OK n" at the end.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
# EVENKV_SANITIZER_DEVICE=cpu dry-runs the cases under the Triton interpreter (no
# sanitizer).
DEV = os.environ.get("EVENKV_SANITIZER_DEVICE", "cuda")
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import evenkv  # noqa: E402
import evenkv.errors  # noqa: E402
from evenkv.configs import ExtendConfig  # noqa: E402
from evenkv.kernels.reference import extend_reference, kv_write_reference  # noqa: E402
from helpers import TOLERANCE_FLOOR, assert_close_to_reference, make_paged_batch  # noqa: E402

DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
HQ, HKV = 8, 2
# seq_len 0 rows, one token, partly filled last pages, and one request past 2048 tokens
# (cut into two chunks by deterministic mode, so its merge runs too).
LENS = [0, 1, 17, 100, 0, 33, 2100, 5]
VARIANTS = [("balanced", False), ("fa3", False), ("none", False), ("balanced", True)]
PERSISTENT = [("balanced", False), ("fa3", False), ("balanced", True)]
SMALL = ExtendConfig("san-m16-n16", block_m=16, block_n=16, num_warps=4, num_stages=2)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def poison_unused(k, v, seq_lens, pt, page_size):
    """Copies of k, v with NaN in every slot no request reads."""
    used = torch.zeros(k.shape[0], dtype=torch.bool, device=k.device)
    for b, n in enumerate(seq_lens.tolist()):
        tok = torch.arange(n, device=k.device)
        used[pt[b, tok // page_size].long() * page_size + tok % page_size] = True
    k2, v2 = k.clone(), v.clone()
    k2[~used], v2[~used] = float("nan"), float("nan")
    return k2, v2


def check_decode(attn, q, k, v, seq_lens, pt, host, page_size, label):
    """Plan and run ``attn`` on the batch; finite, zero for empty rows, close to the host oracle."""
    out = attn.run(attn.plan(seq_lens, pt), q, k, v)
    sync()
    assert torch.isfinite(out).all(), label
    assert torch.all(out[seq_lens == 0] == 0), label
    assert_close_to_reference(out.cpu(), *host, page_size)


def decode_cases(variants, head_dims=(128, 64), page_sizes=(16, 1)):
    count = 0
    for d in head_dims:
        for ps in page_sizes:
            q, k, v, seq_lens, pt = make_paged_batch(LENS, HQ, HKV, d, ps, DTYPE, DEV, seed=d + ps)
            kp, vp = poison_unused(k, v, seq_lens, pt, ps)
            host = [t.cpu() for t in (q, k, v, seq_lens, pt)]  # oracles on the host: fewer sanitized launches
            for policy, det in variants:
                for num_ctas in (3, None):  # few CTAs: long cuts; default (SMs x resident): many
                    attn = evenkv.DecodeAttention(HQ, HKV, d, ps, DTYPE, DEV, len(LENS), pt.shape[1], policy,
                                                  deterministic=det, num_ctas=num_ctas)
                    check_decode(attn, q, kp, vp, seq_lens, pt, host, ps, (policy, det, d, ps, num_ctas))
                    print(f"CASE ok decode policy={policy} det={det} d={d} page={ps} ctas={num_ctas}", flush=True)
                    count += 1
    return count


def sm90_row_cases():
    """The balanced policy with the sm90 rows that batches this small do not pick
    (config passed explicitly; decode_cases runs the main rows), on the default grid and on 3 CTAs."""
    from evenkv.configs import decode_config, many_segments_config
    rows = [(64, 1, many_segments_config("sm90", 64, 1)), (128, 16, many_segments_config("sm90", 128, 16)),
            (256, 16, decode_config("sm90", 256, 16))]
    count = 0
    for d, ps, config in rows:
        q, k, v, seq_lens, pt = make_paged_batch(LENS, HQ, HKV, d, ps, DTYPE, DEV, seed=d + ps + 1)
        kp, vp = poison_unused(k, v, seq_lens, pt, ps)
        host = [t.cpu() for t in (q, k, v, seq_lens, pt)]
        for num_ctas in (3, None):
            attn = evenkv.DecodeAttention(HQ, HKV, d, ps, DTYPE, DEV, len(LENS), pt.shape[1], "balanced",
                                          config=config, num_ctas=num_ctas, arch="sm90")
            check_decode(attn, q, kp, vp, seq_lens, pt, host, ps, (config.name, num_ctas))
            print(f"CASE ok decode row={config.name} d={d} page={ps} ctas={num_ctas}", flush=True)
            count += 1
    return count


def write_kv_cases():
    count = 0
    for idx_dtype in (torch.int32, torch.int64):
        num_slots, n = 4 * 16 + 5, 40
        k_cache = torch.zeros(num_slots, HKV, 128, dtype=DTYPE, device=DEV)
        v_cache = torch.zeros_like(k_cache)
        gen = torch.Generator().manual_seed(3)
        slots = torch.randperm(num_slots, generator=gen)[:n]
        slots[::7] = -1  # padded tokens: skipped
        slots[1] = num_slots - 1  # the last slot
        slot_mapping = slots.to(idx_dtype).to(DEV)
        k_new = torch.randn(n, HKV, 128, generator=gen).to(DEV)  # fp32 -> cast on write
        v_new = torch.randn(n, HKV, 128, generator=gen).to(DTYPE).to(DEV)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        evenkv.write_kv(k_cache, v_cache, k_new, v_new, slot_mapping)
        kv_write_reference(k_ref, v_ref, k_new, v_new, slot_mapping)
        sync()
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        print(f"CASE ok write_kv slots={idx_dtype}", flush=True)
        count += 1
    return count


def check_extend_rule(out, ref, lowp):
    """Tolerance rule (helpers.py) for extend outputs; every row of these batches is written."""
    sync()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    out = out.cpu()
    err = (out.float() - ref).abs().max().item()
    bound = 2 * (lowp.float() - ref).abs().max().item() + TOLERANCE_FLOOR[DTYPE]
    assert err <= bound, f"max abs error {err:.3e} > bound {bound:.3e}"


def extend_cases():
    count = 0
    q_lens = [5, 0, 37, 1, 19, 0]
    prefixes = [0, 3, 21, 40, 16, 0]  # the last request has seq_len 0
    for new_layout in (False, True):
        for config in (SMALL, None):
            ps = 16
            seq = [p + n for p, n in zip(prefixes, q_lens)]
            _, k, v, seq_lens, pt = make_paged_batch(seq, HQ, HKV, 128, ps, DTYPE, DEV, seed=7)
            gen = torch.Generator().manual_seed(8)
            total = sum(q_lens)
            q = torch.randn(total, HQ, 128, generator=gen).to(DTYPE).to(DEV)
            cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
            k_new = v_new = None
            cache_lens = seq_lens
            if new_layout:  # SGLang: the cache holds the prefix; new K/V come row-aligned with q
                k_new = torch.randn(total, HKV, 128, generator=gen).to(DTYPE).to(DEV)
                v_new = torch.randn(total, HKV, 128, generator=gen).to(DTYPE).to(DEV)
                cache_lens = torch.tensor(prefixes, dtype=torch.int32, device=DEV)
            kp, vp = poison_unused(k, v, cache_lens, pt, ps)
            out = evenkv.extend(q, kp, vp, cu_seqlens_q=cu, seq_lens=seq_lens, page_table=pt, page_size=ps,
                                max_q_len=max(q_lens), k_new=k_new, v_new=v_new, config=config)
            args = [t.cpu() for t in (q, k, v, cu, seq_lens, pt)] + [ps]
            new = dict(k_new=k_new if k_new is None else k_new.cpu(), v_new=v_new if v_new is None else v_new.cpu())
            check_extend_rule(out, extend_reference(*args, **new), extend_reference(*args, **new, compute_dtype=DTYPE))
            print(f"CASE ok extend new_layout={new_layout} config={config.name if config else 'table'}", flush=True)
            count += 1
    return count


def layer_term_cases():
    """What a layer adds: a sliding window, a soft-cap, sinks and an FP8 cache (written by the
    FP8 KV write), on every decode policy (3 CTAs and the default grid), and a mixed batch of
    the same layer through evenkv.Attention (decode rows on the decode kernels, extend rows
    on the extend kernel)."""
    count = 0
    fp8, ks, vs = torch.float8_e4m3fn, 0.05, 0.04
    q, k, v, seq_lens, pt = make_paged_batch(LENS, HQ, HKV, 64, 16, DTYPE, DEV, seed=13)
    k8, v8 = torch.empty_like(k, dtype=fp8), torch.empty_like(v, dtype=fp8)
    evenkv.write_kv(k8, v8, k, v, torch.arange(k.shape[0], device=DEV), k_scale=ks, v_scale=vs)
    sinks = torch.linspace(-2.0, 2.0, HQ, device=DEV)
    host = [t.cpu() for t in (q, k8, v8, seq_lens, pt)]
    for window, cap in ((24, None), (None, 3.0), (2048, 3.0)):
        layer = dict(sliding_window=window, logit_cap=cap)
        for policy, det in VARIANTS:
            for num_ctas in (3, None):
                attn = evenkv.DecodeAttention(HQ, HKV, 64, 16, DTYPE, DEV, len(LENS), pt.shape[1], policy,
                                              deterministic=det, num_ctas=num_ctas, kv_dtype=fp8, **layer)
                out = attn.run(attn.plan(seq_lens, pt), q, k8, v8, sinks=sinks, k_scale=ks, v_scale=vs)
                sync()
                assert torch.isfinite(out).all() and torch.all(out[seq_lens == 0] == 0), (policy, det, layer)
                assert_close_to_reference(out.cpu(), *host, 16, sinks=sinks.cpu(), k_scale=ks, v_scale=vs, **layer)
                print(f"CASE ok decode terms policy={policy} det={det} window={window} cap={cap} ctas={num_ctas}",
                      flush=True)
                count += 1
    q_lens, prefixes = [1, 1, 1, 9, 30], [20, 0, 99, 7, 16]
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    _, k, v, seq_lens, pt = make_paged_batch(seq, HQ, HKV, 64, 16, DTYPE, DEV, seed=14)
    k8, v8 = torch.empty_like(k, dtype=fp8), torch.empty_like(v, dtype=fp8)
    evenkv.write_kv(k8, v8, k, v, torch.arange(k.shape[0], device=DEV), k_scale=ks, v_scale=vs)
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(sum(q_lens), HQ, 64, generator=gen).to(DTYPE).to(DEV)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    attn = evenkv.Attention(HQ, HKV, 64, 16, DTYPE, DEV, max_batch_size=8, max_pages_per_request=pt.shape[1],
                            sliding_window=12, logit_cap=3.0, kv_dtype=fp8)
    out = attn.run(attn.plan(cu, seq_lens, pt, num_decodes=3, max_q_len=30), q, k8, v8, sinks=sinks, k_scale=ks,
                   v_scale=vs)
    args = [t.cpu() for t in (q, k8, v8, cu, seq_lens, pt)] + [16]
    terms = dict(sliding_window=12, logit_cap=3.0, sinks=sinks.cpu(), k_scale=ks, v_scale=vs)
    check_extend_rule(out, extend_reference(*args, **terms), extend_reference(*args, **terms, compute_dtype=DTYPE))
    print("CASE ok mixed terms", flush=True)
    return count + 1


def mixed_case():
    """vLLM-ordered mixed batch: 4 decode rows then 2 extend rows (the decode part through
    the balanced decode plan and merge, the rest through extend)."""
    q_lens, prefixes = [1, 1, 1, 1, 9, 30], [20, 0, 3, 99, 7, 16]
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    _, k, v, seq_lens, pt = make_paged_batch(seq, HQ, HKV, 128, 16, DTYPE, DEV, seed=9)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(sum(q_lens), HQ, 128, generator=gen).to(DTYPE).to(DEV)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    attn = evenkv.Attention(HQ, HKV, 128, 16, DTYPE, DEV, max_batch_size=8, max_pages_per_request=pt.shape[1])
    plan = attn.plan(cu, seq_lens, pt, num_decodes=4, max_q_len=max(q_lens))
    kp, vp = poison_unused(k, v, seq_lens, pt, 16)
    out = attn.run(plan, q, kp, vp)
    args = [t.cpu() for t in (q, k, v, cu, seq_lens, pt)] + [16]
    check_extend_rule(out, extend_reference(*args), extend_reference(*args, compute_dtype=DTYPE))
    print("CASE ok mixed", flush=True)
    return 1


def hostile_cases():
    """Batch data that points outside the caches, no debug mode: page ids past the cache and
    negative, lengths past the page table and negative, slots past the cache, query ranges past
    q. Each runs every policy / layout; the good requests must stay right, nothing may touch
    memory outside the tensors (memcheck), and the error flag must name each case."""
    count = 0
    hostile_pages = (10**6, -3, 2**31 - 1)
    for ps in (16, 1):
        q, k, v, seq_lens, pt = make_paged_batch(LENS, HQ, HKV, 128, ps, DTYPE, DEV, seed=11 + ps)
        for (policy, det), page_id in zip(VARIANTS, hostile_pages + hostile_pages[:1]):
            bad = pt.clone()
            bad[3, 1] = page_id  # request 3 (100 tokens) uses this entry
            attn = evenkv.DecodeAttention(HQ, HKV, 128, ps, DTYPE, DEV, len(LENS), pt.shape[1], policy,
                                          deterministic=det)
            out = attn.run(attn.plan(seq_lens, bad), q, k, v)
            sync()
            good = [i for i in range(len(LENS)) if i != 3]
            assert_close_to_reference(out[good], q[good], k, v, seq_lens[good], pt[good], ps)
            expect_flag(evenkv.errors.PAGE_OUT_OF_RANGE)
            lens = seq_lens.clone().long()
            lens[2], lens[5] = -7, 10**9
            out = attn.run(attn.plan(lens, pt), q, k, v)
            sync()
            assert torch.isfinite(out).all() and torch.all(out[2] == 0)
            # Clamped to the page table, request 5 now reads its garbage tail entries too.
            expect_flag(evenkv.errors.LENGTH_OUT_OF_RANGE, evenkv.errors.PAGE_OUT_OF_RANGE)
            print(f"CASE ok hostile decode {policy}{'-det' if det else ''} p{ps} page={page_id}", flush=True)
            count += 1
    k = torch.zeros(64, HKV, 128, dtype=DTYPE, device=DEV)
    new = torch.ones(4, HKV, 128, dtype=DTYPE, device=DEV)
    evenkv.write_kv(k, k.clone(), new, new, torch.tensor([3, 10**6, 64, -1], device=DEV))
    sync()
    expect_flag(evenkv.errors.SLOT_OUT_OF_RANGE)
    print("CASE ok hostile write_kv", flush=True)
    q_lens, prefixes = [5, 9, 3], [40, 0, 17]
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    _, k, v, seq_lens, pt = make_paged_batch(seq, HQ, HKV, 128, 16, DTYPE, DEV, seed=12)
    q = torch.randn(17, HQ, 128, device=DEV).to(DTYPE)
    for new_layout in (False, True):
        kn = torch.randn(17, HKV, 128, device=DEV).to(DTYPE) if new_layout else None
        bad_pt, bad_lens = pt.clone(), seq_lens.clone()
        bad_pt[0, 1], bad_lens[2] = 10**7, 1
        cu = torch.tensor([0, 5, 14, 10**6], dtype=torch.int32, device=DEV)
        evenkv.extend(q, k, v, cu_seqlens_q=cu, seq_lens=bad_lens, page_table=bad_pt, page_size=16, max_q_len=9,
                      k_new=kn, v_new=kn)
        sync()
        expect_flag(evenkv.errors.PAGE_OUT_OF_RANGE, evenkv.errors.SEQ_LEN_BELOW_Q_LEN,
                    evenkv.errors.QUERY_OUT_OF_RANGE)
        print(f"CASE ok hostile extend new_layout={new_layout}", flush=True)
    return count + 3 + engine_prefill_hostile_case(q, k, v, seq_lens, pt, q_lens)


def engine_prefill_hostile_case(q, k, v, seq_lens, pt, q_lens):
    """The same hostile extend rows through ``Attention`` with vLLM's FA3 as its prefill kernel:
    the rows' guard and the zeroing page audit bound them before FA3, which trusts its
    arguments, dereferences them. Counts 0, with a line that says so, where FA3 is not
    importable (memcheck then covers evenkv's kernels only)."""
    from evenkv.integrations.prefill import vllm_flash_attention

    fa = vllm_flash_attention(DEV)
    if fa is None:
        print("CASE none hostile engine-prefill: vllm.vllm_flash_attn is not importable (source the peers kit)",
              flush=True)
        return 0
    attn = evenkv.Attention(HQ, HKV, 128, 16, DTYPE, DEV, max_batch_size=8, max_pages_per_request=pt.shape[1],
                            prefill_kernel=fa)
    for bad in ("page", "length", "rows"):
        bad_pt, bad_lens = pt.clone(), seq_lens.clone()
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        if bad == "page":
            bad_pt[0, 1] = 10**7
        elif bad == "length":
            bad_lens[2] = 10**6
        else:
            cu[3] = 10**6
        out = attn.run(attn.plan(cu, bad_lens, bad_pt, num_decodes=0, max_q_len=9), q, k, v)
        sync()
        assert torch.isfinite(out).all(), bad
        # A length past the page table is clamped to it, so its garbage tail entries are read too.
        expect_flag(*{"page": [evenkv.errors.PAGE_OUT_OF_RANGE],
                      "length": [evenkv.errors.LENGTH_OUT_OF_RANGE, evenkv.errors.PAGE_OUT_OF_RANGE],
                      "rows": [evenkv.errors.QUERY_OUT_OF_RANGE]}[bad])
        print(f"CASE ok hostile engine-prefill {bad}", flush=True)
    return 3


def expect_flag(*bits):
    """The error flag holds exactly ``bits``; clears it."""
    got = int(evenkv.errors.error_flag(DEV).item())
    evenkv.errors.error_flag(DEV).zero_()
    want = 0
    for bit in bits:
        want |= bit
    if got != want:
        raise AssertionError(f"error flag {got:#x}, expected {want:#x}")


def main(which: str) -> None:
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("sanitizer_cases.py needs a CUDA device (EVENKV_SANITIZER_DEVICE=cpu: interpreter dry run)")
    where = torch.cuda.get_device_name() if DEV == "cuda" else "CPU, Triton interpreter"
    print(f"evenkv {evenkv.__version__} from {evenkv.__file__}; torch {torch.__version__}; {where}", flush=True)
    if which == "persistent":
        n = decode_cases(PERSISTENT, head_dims=(128,), page_sizes=(16,))
    elif which == "hostile":
        n = hostile_cases()
    elif which == "terms":
        n = layer_term_cases()
    elif which == "all":
        n = (decode_cases(VARIANTS) + sm90_row_cases() + write_kv_cases() + extend_cases() + mixed_case()
             + layer_term_cases() + hostile_cases())
    else:
        sys.exit(f"usage: cases.py [all|persistent|hostile|terms], got {which!r}")
    print(f"CASES OK {n}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
