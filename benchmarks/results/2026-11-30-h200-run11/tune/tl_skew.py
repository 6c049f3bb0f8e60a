"""Scratch: per-CTA timeline at Uniform vs skewed points (timeline variant on PYTHONPATH)."""
import statistics, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode_imbalance import dist_lengths, GpuTimer
from evenkv import DecodeAttention
import evenkv.kernels.decode_launch as L
dev = torch.device("cuda")
Hq, Hkv, D, BN = 32, 4, 128, 64
T = int(sys.argv[1])
timer = GpuTimer(dev, 256)
slots = T + 64 * 2048 * 16
k = torch.randn(slots, Hkv, D, dtype=torch.bfloat16, device=dev); v = torch.randn_like(k)
for spec in sys.argv[2].split(","):
    B, dist = int(spec.split(":")[0]), spec.split(":")[1]
    lens = dist_lengths(dist, T, B)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    maxp = triton.cdiv(max(lens), 16)
    pt = torch.randint(0, slots // 16, (B, maxp), dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
    attn = DecodeAttention(Hq, Hkv, D, 16, torch.bfloat16, dev, B, maxp, "balanced")
    attn.plan(seq, pt); attn.run(q, k, v); torch.cuda.synchronize()
    piece = int(attn._schedule.plan_scalars[0].cpu())
    long_cost = Hkv * (-(-lens[0] // BN)) if dist != "Uniform" else 0
    rows = []
    for rep in range(8):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timer.flush(); s.record(); attn.run(q, k, v); e.record(); torch.cuda.synchronize()
        t = L.TIMELINE[max(L.TIMELINE)].cpu()
        C = t.shape[0]
        t0 = t[:, 0].min()
        st = (t[:, 0] - t0).double() / 1e3; we = (t[:, 1] - t0).double() / 1e3; en = (t[:, 2] - t0).double() / 1e3
        walk = we - st
        on_long = torch.tensor([(c + 1) * piece <= long_cost for c in range(C)])
        rest = ~on_long & (walk > 5)
        rows.append((s.elapsed_time(e) * 1e3, we.max().item(), en.max().item(), (en - we).max().item(),
                     walk[on_long].mean().item() if on_long.any() else float("nan"), walk[rest].mean().item(),
                     walk[on_long].max().item() if on_long.any() else float("nan"), walk[rest].max().item(),
                     int(on_long.sum())))
    med = [statistics.median(r[i] for r in rows[1:]) for i in range(8)]
    print(f"B{B:5d} {dist:9s} piece {piece:3d} C {C}: run {med[0]:6.1f} | walk end max {med[1]:6.1f} | kernel end {med[2]:6.1f}"
          f" | fused-merge tail max {med[3]:5.2f} | walk mean long/other {med[4]:6.1f}/{med[5]:6.1f} max {med[6]:6.1f}/{med[7]:6.1f}"
          f" | CTAs on long {rows[0][8]}", flush=True)
