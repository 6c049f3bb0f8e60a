"""Scratch: whole balanced run (GpuTimer, cold L2, median of 40) at several persistent grid sizes."""
import statistics, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode_imbalance import dist_lengths, GpuTimer
from evenkv import DecodeAttention
dev = torch.device("cuda")
Hq, Hkv, D = 32, 4, 128
T = int(sys.argv[1])
grids = [int(x) for x in sys.argv[2].split(",")]
points = [(int(p.split(":")[0]), p.split(":")[1]) for p in sys.argv[3].split(",")]
page = int(sys.argv[4]) if len(sys.argv) > 4 else 16
timer = GpuTimer(dev, 256)
slots = T + 64 * 2048 * 16
k = torch.randn(slots, Hkv, D, dtype=torch.bfloat16, device=dev)
v = torch.randn_like(k)
for B, dist in points:
    lens = dist_lengths(dist, T, B)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    maxp = triton.cdiv(max(lens), page)
    pt = torch.randint(0, slots // page, (B, maxp), dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
    ref = DecodeAttention(Hq, Hkv, D, page, torch.bfloat16, dev, B, maxp, "fa3")
    ref.plan(seq, pt)
    want = ref.run(q, k, v).clone()
    line = []
    for g in grids:
        attn = DecodeAttention(Hq, Hkv, D, page, torch.bfloat16, dev, B, maxp, "balanced", num_ctas=g * 132)
        attn.plan(seq, pt)
        out = attn.run(q, k, v)
        err = (out.float() - want.float()).abs().max().item()
        t = statistics.median(timer.events(lambda: attn.run(q, k, v, out=out), 40, 60.0))
        line.append(f"c{g}={t:.1f}" + ("" if err < 2e-2 else f"(ERR {err:.2e})"))
    print(f"T{T} P{page} B{B} {dist}: " + " ".join(line), flush=True)
