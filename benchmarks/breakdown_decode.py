"""Where the balanced decode's time goes, on the GPU: the evidence behind issue 4's notes.

For each point (one of the benchmark's shapes, default Qwen3-30B-A3B attention, bf16,
cold L2) it prints one CSV row per measurement, all in GPU time from torch.profiler
(mean over the profiled calls; host launch gaps excluded): the plan step, each kernel
of the balanced run and their sum (on sm90 the merge kernel is launched early, as a
programmatic dependent, so its time includes its wait for the decode kernel and the sum
overstates; ncu serialises the kernels and times each alone), the ``none`` policy (one
CTA per (request, KV head), no split, no merge), the balanced run at other persistent
grid sizes (``--grids``, CTAs per SM; CTAs past the resident ones run in later waves,
the stream-K partition does not need them co-resident) and with other register caps
(``--max-registers``). ``--ncu`` instead runs one point three times for a profiler:

    python benchmarks/breakdown_decode.py --out breakdown.csv --points 1:Uniform,2048:Skewed40
    ncu --clock-control none --kernel-name regex:decode_stream --launch-skip 2 --launch-count 1 \\
        python benchmarks/breakdown_decode.py --ncu 2048:Skewed40
"""

import argparse
import dataclasses
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import evenkv
from decode_imbalance import SHAPES, copy_bandwidth
from tune_decode import make_batch, write_csv


def kernel_means_us(fn, flush, reps=20) -> dict:
    """Mean device time of each evenkv kernel that ``fn`` launches (the L2 flush before
    each call excluded)."""
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    return {evt.key: evt.device_time_total / reps for evt in prof.key_averages()
            if evt.key.startswith(("decode_", "merge_", "plan_"))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--points", default="1:Uniform,128:Uniform,2048:Uniform,2048:Skewed40")
    ap.add_argument("--grids", default="2,3,4,6,8,12", help="persistent CTAs per SM to try")
    ap.add_argument("--max-registers", default="",
                    help="per-thread register caps to try (resident CTAs then follow the registers, up to 8/SM)")
    ap.add_argument("--ncu", help="B:dist: run that point 3 times and exit")
    args = ap.parse_args()
    torch.manual_seed(0)
    total, page, shape = args.tokens, args.page, SHAPES[args.shape]
    hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    k_pages = total // page + 4096
    k = torch.randn(k_pages * page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def build(batch, pt, policy="balanced", **kw):
        return evenkv.DecodeAttention(hq, hkv, d, page, torch.bfloat16, "cuda", batch, pt.shape[1], policy, **kw)

    if args.ncu:
        b, dist = args.ncu.split(":")
        q, seq_lens, pt = make_batch(total, int(b), dist, page, k_pages, shape)
        attn = build(int(b), pt)
        for _ in range(3):
            attn.plan(seq_lens, pt)
            attn.run(q, k, v)
        torch.cuda.synchronize()
        return

    copy_bw = copy_bandwidth(torch.device("cuda")) * 1e12
    kv_bytes = 2 * total * hkv * d * 2
    rows = []

    def emit(point, what, ctas, us):
        frac = kv_bytes / (us * 1e-6) / copy_bw
        rows.append(dict(point=point, what=what, ctas=ctas, us=round(us, 2), frac_copy=round(frac, 4)))
        print(f"{point:16s} {what:34s} C={ctas:5d} {us:9.2f} us {100 * frac:6.1f} %", flush=True)

    def emit_run(point, what, attn, q, out):
        attn.run(q, k, v, out=out)
        kernels = kernel_means_us(lambda: attn.run(q, k, v, out=out), flush)
        if what == "balanced":
            for name, us in sorted(kernels.items()):
                emit(point, f"kernel {name}", attn.num_ctas, us)
        emit(point, what, attn.num_ctas, sum(kernels.values()))

    print(f"copy bandwidth (read+write) {copy_bw / 1e12:.3f} TB/s, {sms} SMs", file=sys.stderr)
    for spec in args.points.split(","):
        b, dist = spec.split(":")
        batch = int(b)
        q, seq_lens, pt = make_batch(total, batch, dist, page, k_pages, shape)
        out = torch.empty_like(q)
        attn = build(batch, pt)
        for name, us in kernel_means_us(lambda: attn.plan(seq_lens, pt), flush).items():
            emit(spec, f"plan {name}", attn.num_ctas, us)
        attn.plan(seq_lens, pt)
        emit_run(spec, "balanced", attn, q, out)
        direct = build(batch, pt, "none")
        direct.plan(seq_lens, pt)
        emit_run(spec, "policy none", direct, q, out)
        for per_sm in map(int, args.grids.split(",")):
            grid = build(batch, pt, num_ctas=per_sm * sms)
            grid.plan(seq_lens, pt)
            emit_run(spec, f"balanced grid {per_sm}/SM", grid, q, out)
        for regs in [int(r) for r in args.max_registers.split(",") if r]:
            capped = build(batch, pt, config=dataclasses.replace(attn.config, max_registers=regs, max_ctas_per_sm=8))
            capped.plan(seq_lens, pt)
            emit_run(spec, f"balanced max_registers {regs}", capped, q, out)
    if args.out:
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
