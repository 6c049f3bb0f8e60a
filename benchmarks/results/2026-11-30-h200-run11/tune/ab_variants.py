"""Scratch A/B: whole balanced run (GpuTimer, cold L2, median of 40) per point; evenkv from PYTHONPATH."""
import statistics, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode_imbalance import dist_lengths, GpuTimer
from evenkv import DecodeAttention
dev = torch.device("cuda")
Hq, Hkv, D = 32, 4, 128
tag = sys.argv[1]
points = [p.split(":") for p in sys.argv[2].split(",")]  # T:page:B:dist
timer = GpuTimer(dev, 256)
cache = {}
res = []
for T, page, B, dist in points:
    T, page, B = int(T), int(page), int(B)
    if T not in cache:
        cache.clear()
        slots = T + 64 * 2048 * 16
        kk = torch.randn(slots, Hkv, D, dtype=torch.bfloat16, device=dev)
        cache[T] = (slots, kk, torch.randn_like(kk))
    slots, k, v = cache[T]
    torch.manual_seed(B * 7 + T)
    lens = dist_lengths(dist, T, B)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    maxp = triton.cdiv(max(lens), page)
    pt = torch.randint(0, slots // page, (B, maxp), dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
    ref = DecodeAttention(Hq, Hkv, D, page, torch.bfloat16, dev, B, maxp, "fa3")
    ref.plan(seq, pt)
    want = ref.run(q, k, v).clone()
    attn = DecodeAttention(Hq, Hkv, D, page, torch.bfloat16, dev, B, maxp, "balanced")
    attn.plan(seq, pt)
    out = attn.run(q, k, v)
    err = (out.float() - want.float()).abs().max().item()
    t = statistics.median(timer.events(lambda: attn.run(q, k, v, out=out), 40, 60.0))
    res.append(f"{T//1024}K/p{page}/B{B}/{dist}={t:.1f}" + ("" if err < 2e-2 else f"(ERR {err:.1e})"))
print(tag, " ".join(res), flush=True)
