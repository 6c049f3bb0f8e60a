"""Sweep DecodeConfig candidates on the GPU: the evidence behind evenkv.configs' decode tables.

For each candidate config and policy, times decode (plan excluded) on the seed
experiment's batches (one of the benchmark's shapes, default Qwen3-30B-A3B attention,
bf16) with a cold L2, and prints one CSV row per point with the fraction of the
device-to-device copy bandwidth measured in the same process, and the largest
difference from the first candidate's output at that point. Usage:

    python -m benchmarks.tune_decode --out tune.csv [--shape gemma3-12b] [--tokens 262144] [--page 16]
                                     [--kv-dtype fp8] [--q-len 8] [--deterministic]

``--kv-dtype fp8`` stores the same random cache in e4m3 (per-tensor scales) and counts one
byte per element. ``--cache-layout`` picks how K and V lie in memory (both flags take comma
lists, each pair a sweep of its own in one process): ``token-major`` (the
default; NHD: K and V each ``[pages, page, Hkv, D]``, as SGLang's pools), ``head-major`` (HND:
each ``[pages, Hkv, page, D]``, so a page of one head is contiguous), ``vllm-nhd`` and
``vllm-hnd`` (vLLM's caches: one ``[pages, page, Hkv, 2 * D]`` buffer, or ``[pages, Hkv, page,
2 * D]`` with ``VLLM_KV_CACHE_LAYOUT=HND``, whose last dim holds K then V).
``--q-len N`` times speculative-verify rows of N query tokens per request (the candidates are
then verify rows); ``--deterministic`` the batch-invariant mode. ``--grids`` times each config at
each listed persistent grid size (``DecodeAttention(num_ctas=...)``; ``default`` is the grid
``DecodeAttention`` sizes itself): where the stream-K cuts of a batch fall depends on it.
Where ``evenkv.configs.kv_head_pack`` packs (head dim 64 over an FP8 cache), two KV heads walk
as one of twice the head dim, as ``DecodeAttention`` does by default, and ``tables`` names that
head dim's rows; ``--one-kv-head`` walks each head alone (``pack_kv_heads=False``) on its own
head dim's rows.
"""

import argparse
import csv
import itertools
import re
import statistics
import sys

import torch

import evenkv
from benchmarks.decode_imbalance import SHAPES, GpuTimer, copy_bandwidth, parse_choice_list
from evenkv.configs import DecodeConfig, kv_head_pack, many_segments_config, resolve_arch
from evenkv.kernels.decode_launch import tile_rows


def lengths(total, batch, dist):
    share = {"Uniform": 0.0, "Skewed40": 0.4, "Skewed60": 0.6, "Skewed80": 0.8, "2x40": 0.4}[dist]
    heads = 2 if dist == "2x40" else (1 if share else 0)
    heads = min(heads, batch)
    big = [int(total * share)] * heads if share else []
    rest, n = total - sum(big), batch - len(big)
    if n == 0:
        big[-1] += rest
        return big
    return big + [rest // n + (1 if i < rest % n else 0) for i in range(n)]


def make_batch(total, batch, dist, page, num_pages, shape, q_len=1):
    """q [B * q_len, Hq, D] bf16, seq_lens [B] int32 and a page table [B, max pages] int32 of
    random distinct pages out of ``num_pages``, for ``total`` tokens split by ``dist``."""
    lens = lengths(total, batch, dist)
    pages = [(n + page - 1) // page for n in lens]
    perm = torch.randperm(num_pages, device="cuda").int()
    pt = torch.zeros(batch, max(pages), dtype=torch.int32, device="cuda")
    off = 0
    for b, n in enumerate(pages):
        pt[b, :n] = perm[off:off + n]
        off += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, shape.num_q_heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    return q, seq_lens, pt


CACHE_LAYOUTS = ("token-major", "head-major", "vllm-nhd", "vllm-hnd")
KV_DTYPES = ("auto", "fp8")


def random_caches(num_pages, page, hkv, d, layout, fp8, device="cuda"):
    """Random K and V caches as [num_pages, page, Hkv, D] views in ``layout`` (CACHE_LAYOUTS,
    see the module docstring): bf16 values, or with ``fp8`` those values / 0.05 in e4m3 (the
    0.05 is their k_scale and v_scale). Returns (k, v, scales: the run's scale keywords)."""
    def stored(shape, head_major):
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        x = (x / 0.05).to(torch.float8_e4m3fn) if fp8 else x
        return x.transpose(1, 2) if head_major else x

    head_major = layout in ("head-major", "vllm-hnd")
    shape = (num_pages, hkv, page) if head_major else (num_pages, page, hkv)
    if layout.startswith("vllm"):
        kv = stored((*shape, 2 * d), head_major)
        k, v = kv[..., :d], kv[..., d:]
    else:
        k, v = stored((*shape, d), head_major), stored((*shape, d), head_major)
    return k, v, (dict(k_scale=0.05, v_scale=0.05) if fp8 else {})


def write_csv(path, rows):
    """rows (dicts with the same keys) -> a CSV file with a header."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def parse_config(name):
    """'bn64-w4-s5-c3-r128' -> DecodeConfig(block_n 64, 4 warps, 5 stages, 3 CTAs/SM, 128 registers
    (default: the compiler's)); merge launched as a programmatic dependent where the GPU has it.
    A '-loops' suffix walks each segment in a loop of its own (``DecodeConfig.segment_loops``),
    a '-nopdl' suffix launches the merge after the decode kernel ends (no programmatic launch)."""
    match = re.fullmatch(r"bn(\d+)-w(\d+)-s(\d+)-c(\d+)(?:-r(\d+))?(-loops)?(-nopdl)?", name)
    if match is None:
        raise ValueError(f"--configs: expected bn<block_n>-w<warps>-s<stages>-c<ctas/SM>[-r<max regs>][-loops]"
                         f"[-nopdl], got {name!r}")
    bn, warps, stages, ctas, regs, loops, no_pdl = match.groups()
    return DecodeConfig(name, int(bn), int(warps), int(stages), int(ctas), max_registers=int(regs) if regs else None,
                        programmatic_launch=no_pdl is None, segment_loops=loops is not None)


def parse_grids(text):
    """'default,256,260' -> (None, 256, 260): persistent grid sizes, None for DecodeAttention's own."""
    grids = []
    for item in text.split(","):
        if item == "default":
            grids.append(None)
        elif item.isdigit() and int(item) > 0:
            grids.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"expected a comma list of positive ints or 'default', got {text!r}")
    return tuple(grids)


def table_configs(head_dim, page, rows, kv_fp8, archs=("sm80", "sm90")):
    """evenkv.configs' rows for ``head_dim`` and ``page`` (verify rows of ``rows`` tile rows
    when given) of each of ``archs``, the many-segments rows included: each is passed
    explicitly, so every row runs at every point, not only where DecodeAttention would pick
    it. Over an FP8 cache (``kv_fp8``) the FP8 rows come first, then the bf16 rows they
    replace. One config per name."""
    configs = {}
    for arch, fp8 in itertools.product(archs, (True, False) if kv_fp8 else (False,)):
        for cfg in (evenkv.decode_config(arch, head_dim, page, fp8, rows=rows),
                    many_segments_config(arch, head_dim, page, fp8, rows=rows)):
            if cfg is not None:
                configs.setdefault(cfg.name, cfg)
    return list(configs.values())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tune_decode")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--batches", default="1,8,64,512,2048")
    ap.add_argument("--dists", default="Uniform,Skewed80,2x40")
    ap.add_argument("--policies", default="balanced")
    ap.add_argument("--grids", type=parse_grids, default=(None,),
                    help="persistent grid sizes to time each config at: comma list of ints or 'default' (the default)")
    ap.add_argument("--kv-dtype", type=parse_choice_list(KV_DTYPES), default=("auto",),
                    help="a comma list of auto, fp8 (or all): each a sweep of its own in this process")
    ap.add_argument("--cache-layout", type=parse_choice_list(CACHE_LAYOUTS), default=("token-major",),
                    help=f"a comma list of {', '.join(CACHE_LAYOUTS)} (or all): each a sweep of its own in this process")
    ap.add_argument("--q-len", type=int, default=1, help="query tokens per request (> 1: speculative-verify rows)")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--one-kv-head", action="store_true",
                    help="walk each KV head alone where evenkv would walk two as one (head dim 64 over an FP8 cache)")
    ap.add_argument("--configs", default="grid",
                    help="'grid', 'tables', or a comma list of bn<block_n>-w<warps>-s<stages>-c<ctas/SM>[-r<max regs>]")
    ap.add_argument("--archs", default="sm80,sm90", help="whose table rows --configs tables times")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    copy_bw = copy_bandwidth(device) * 1e12
    print(f"copy bandwidth (read+write) {copy_bw / 1e12:.3f} TB/s", file=sys.stderr)
    timer = GpuTimer(device, 256)
    rows = []
    for kv_dtype, layout in itertools.product(args.kv_dtype, args.cache_layout):
        rows += sweep(args, kv_dtype, layout, timer, copy_bw)
    write_csv(args.out, rows)


def sweep(args, kv_dtype, layout, timer, copy_bw):
    """Every (batch, distribution, config, policy, grid) point over caches of ``kv_dtype`` stored in
    ``layout``: the CSV rows (and one printed line per point)."""
    total, page, shape = args.tokens, args.page, SHAPES[args.shape]
    hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    pages_needed = total // page + 4096
    fp8 = kv_dtype == "fp8"
    k, v, scales = random_caches(pages_needed, page, hkv, d, layout, fp8)
    q_len = args.q_len
    pack = kv_head_pack(resolve_arch(None, k.device), hq, hkv, d, q_len, args.deterministic, fp8) \
        if not args.one_kv_head else 1
    if args.configs == "tables":
        configs = table_configs(d * pack, page, tile_rows(hq // hkv, q_len) if q_len > 1 else None, fp8,
                                args.archs.split(","))
    elif args.configs == "grid":
        configs = [parse_config(f"bn{bn}-w{w}-s{s}-c{c}")
                   for bn, w, s, c in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (2, 4))]
    else:
        configs = [parse_config(name) for name in args.configs.split(",")]
    print(f"-- {shape.name}, KV cache {kv_dtype}, {layout}", flush=True)
    rows = []
    kv_bytes = 2 * total * hkv * d * k.element_size()
    for batch in map(int, args.batches.split(",")):
        for dist in args.dists.split(","):
            q, seq_lens, pt = make_batch(total, batch, dist, page, pages_needed, shape, q_len)
            verify = dict(cu_seqlens_q=torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda"),
                          q_len=q_len) if q_len > 1 else {}
            first_out = None
            for cfg, policy, grid in itertools.product(configs, args.policies.split(","), args.grids):
                try:
                    attn = evenkv.DecodeAttention(hq, hkv, d, page, q.dtype, "cuda", batch, pt.shape[1], policy,
                                                  num_ctas=grid, config=cfg, kv_dtype=k.dtype, max_q_len=q_len,
                                                  deterministic=args.deterministic, pack_kv_heads=pack > 1)
                    plan = attn.plan(seq_lens, pt, **verify)
                    out = attn.run(plan, q, k, v, **scales)
                    first_out = out.clone() if first_out is None else first_out
                    diff = (out.float() - first_out.float()).abs().max().item()
                    us = statistics.median(timer.events(lambda: attn.run(plan, q, k, v, out=out, **scales), 30,
                                                        100.0))
                except Exception as exc:  # a config that fails to compile (shared memory) is reported
                    print(f"{cfg.name} {policy}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                    continue
                frac = kv_bytes / (us * 1e-6) / copy_bw
                rows.append(dict(config=cfg.name, policy=policy, deterministic=args.deterministic, shape=shape.name,
                                 kv_dtype=kv_dtype, cache_layout=layout, head_pack=attn.head_pack,
                                 ctas=attn.num_ctas, T=total, q_len=q_len, B=batch, dist=dist, page=page,
                                 us=round(us, 2), frac_copy=round(frac, 4),
                                 max_diff_vs_first=f"{diff:.2e}"))
                print(f"{cfg.name:24s} {policy:8s} C={attn.num_ctas:4d} B={batch:5d} {dist:9s} "
                      f"{us:9.1f} us {100 * frac:6.1f} % diff {diff:.1e}", flush=True)
    return rows


if __name__ == "__main__":
    main()
