"""Run-6 scratch timing of DecodeAttention variants (how tune/ab-*.log were measured).

Each variant is a copy of evenkv on PYTHONPATH, one process per variant, all in one device
call (so they share a machine), run from the repository root:

    PYTHONPATH=/tmp/variant python3 benchmarks/results/2026-11-30-h200-run6/tune/compare_variants.py <tag> \
        16:1:Uniform,16:2048:Skewed40,...      (page:B:distribution points)

Per point (Qwen3 32/4/128 bf16, T = 262144): the balanced policy's run() is timed with the
benchmark's GpuTimer (256 MiB L2 flush before each call, median of 30), eagerly and as a
CUDA-graph replay; its output is compared with the fa3 policy's (max abs error), with
itself over 3 repeats and with 3 graph replays (torch.equal).
"""
import statistics, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode_imbalance import dist_lengths, GpuTimer, copy_bandwidth
from evenkv import DecodeAttention
tag = sys.argv[1]
points = [tuple(p.split(":")) for p in sys.argv[2].split(",")]
dev = torch.device("cuda")
Hq, Hkv, D, T = 32, 4, 128, 262144
timer = GpuTimer(dev, 256)
slots = T + 64 * 2048 * 16
k = torch.randn(slots, Hkv, D, dtype=torch.bfloat16, device=dev)
v = torch.randn_like(k)
print(tag, "copy TB/s %.3f" % copy_bandwidth(dev), flush=True)
for P, B, dist in points:
    P, B = int(P), int(B)
    lens = dist_lengths(dist, T, B)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    maxp = triton.cdiv(max(lens), P)
    g = torch.Generator(device=dev); g.manual_seed(B * 7 + P)
    pt = torch.randint(0, slots // P, (B, maxp), dtype=torch.int32, device=dev, generator=g)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev, generator=g)
    attn = DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, B, maxp, "balanced")
    attn.plan(seq, pt)
    out = attn.run(q, k, v).clone()
    ref = DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, B, maxp, "fa3")
    ref.plan(seq, pt)
    err = (ref.run(q, k, v).float() - out.float()).abs().max().item()
    same = all(torch.equal(attn.run(q, k, v), out) for _ in range(3))
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        og = attn.run(q, k, v)
    gsame = True
    for _ in range(3):
        og.zero_(); gr.replay(); torch.cuda.synchronize()
        gsame &= torch.equal(og, out)
    ts = sorted(timer.events(lambda: attn.run(q, k, v), 30, 50.0))
    tg = sorted(timer.events(gr.replay, 30, 10.0))
    print(f"{tag} P{P} B{B} {dist}: {statistics.median(ts):.1f} us (p20 {ts[6]:.1f}) graph {statistics.median(tg):.1f} "
          f"err {err:.1e} rep_eq {same} graph_eq {gsame}", flush=True)
