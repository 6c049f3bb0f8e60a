"""The read-only floor of the decode benchmark's protocol: how fast can any kernel read S MiB?

``decode_imbalance.py`` times each call after writing 256 MiB (``GpuTimer.flush``), so every
implementation starts with a cold L2 full of dirty lines and cold code. This script times a
plain streaming read of one contiguous buffer (a persistent Triton sum, the best of a few
grid / tile configs) under the same protocol, and again with the L2 flushed by a read
(clean lines, nothing to write back), and prints each as a fraction of the copy bandwidth
measured in the same process. No attention kernel reads paged KV faster than this kernel
reads a contiguous buffer of the same size, so a goal stated as a fraction of the copy
bandwidth is only reachable where this floor is above it. KV bytes of the benchmark's
points: Qwen3 (Hkv 4, D 128, bf16) 64 MiB at T = 32K, 512 MiB at 256K, 2 GiB at 1M;
Llama-3-70B TP8 (Hkv 1) 128 MiB at 256K; an FP8 cache holds half its bf16 bytes (Qwen3 and
gpt-oss-20b 256 MiB at 256K, Llama-3-8B 512 MiB). Usage (GPU):

    python -m benchmarks.read_floor [--mib 32,64,128,256,512,1024,2048] [--out floor.csv]
"""

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

from benchmarks.decode_imbalance import GpuTimer, copy_bandwidth
from benchmarks.tune_decode import write_csv


@triton.jit
def read_sum_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out[p] = sum of x[p * n_per_prog : (p + 1) * n_per_prog] in fp32 (x bf16, n_per_prog a
    multiple of BLOCK): a program streams one contiguous chunk, BLOCK elements per step."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, n_per_prog, BLOCK, num_stages=NUM_STAGES):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_sum(x: torch.Tensor, grid: int, block: int, num_warps: int, num_stages: int = 4) -> torch.Tensor:
    """x [N] bf16 contiguous, N divisible by grid * block -> per-program sums [grid] fp32."""
    if x.dim() != 1 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous 1-D bfloat16 tensor, got shape {tuple(x.shape)} {x.dtype}")
    if x.numel() % (grid * block):
        raise ValueError(f"x: expected a length divisible by grid * block = {grid * block}, got {x.numel()}")
    out = torch.empty(grid, dtype=torch.float32, device=x.device)
    read_sum_kernel[(grid,)](x, out, x.numel() // grid, BLOCK=block, NUM_STAGES=num_stages, num_warps=num_warps)
    return out


# (programs, elements per step, warps): 1-16 programs per SM of the H200's 132, 2-8 KiB steps.
CONFIGS = ((512, 2048, 4), (1024, 2048, 4), (2048, 1024, 4), (256, 4096, 8), (512, 4096, 8))


def main():
    ap = argparse.ArgumentParser(prog="python -m benchmarks.read_floor")
    ap.add_argument("--mib", default="32,64,128,256,512,1024,2048")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda")
    timer = GpuTimer(device, 256)
    copy_tbps = copy_bandwidth(device)
    clean = torch.ones(256 << 19, dtype=torch.bfloat16, device=device)
    print(f"copy bandwidth (read+write) {copy_tbps:.3f} TB/s", file=sys.stderr)
    rows = []
    for mib in map(int, args.mib.split(",")):
        x = torch.ones((mib << 20) // 2, dtype=torch.bfloat16, device=device)
        best = None
        for grid, block, warps in CONFIGS:
            if x.numel() % (grid * block):
                continue
            sums = read_sum(x, grid, block, warps)
            if sums.sum().item() != x.numel():
                raise RuntimeError(f"read_sum_kernel: wrong sum at {mib} MiB, grid {grid}, block {block}")
            fn = lambda: read_sum(x, grid, block, warps)  # noqa: E731
            dirty = statistics.median(timer.events(fn, args.reps, 40.0))
            write_flush = timer.flush
            timer.flush = clean.sum  # evicts L2 by reading: clean lines, no write-back
            try:
                clean_us = statistics.median(timer.events(fn, args.reps, 40.0))
            finally:
                timer.flush = write_flush
            if best is None or dirty < best["us_write_flush"]:
                best = dict(mib=mib, grid=grid, block=block, warps=warps, us_write_flush=round(dirty, 2),
                            us_read_flush=round(clean_us, 2))
        for key in ("write_flush", "read_flush"):
            best[f"frac_copy_{key}"] = round((mib << 20) / (best[f"us_{key}"] * 1e-6) / (copy_tbps * 1e12), 4)
        best["copy_rw_tbps"] = round(copy_tbps, 3)
        rows.append(best)
        print(f"{mib:5d} MiB  write-flush {best['us_write_flush']:7.1f} us ({100 * best['frac_copy_write_flush']:5.1f} %"
              f" of copy)  read-flush {best['us_read_flush']:7.1f} us ({100 * best['frac_copy_read_flush']:5.1f} %)"
              f"  [grid {best['grid']}, block {best['block']}, {best['warps']} warps]", flush=True)
    if args.out:
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
