"""Run-5 scratch timing of DecodeAttention variants (how tune/merge-variants.log and
tune/page-prefetch-variant.log were measured). Each variant is a copy of evenkv on
PYTHONPATH; one process per variant, all in one device call so they share a machine:

    PYTHONPATH=/tmp/variant python3 benchmarks/results/2026-11-30-h200-run5/tune/compare_decode_variants.py <tag>

(from the repository root: it imports benchmarks/decode_imbalance.py).

Per point (Qwen3 32/4/128 bf16, T = 262144): the balanced policy's run() is timed with the
benchmark's GpuTimer (256 MiB L2 flush before each call, GPU sleep ahead, median of 30),
eagerly and as a CUDA-graph replay; its output is compared with the fa3 policy's
(max abs error), with itself over 3 repeats and with 3 graph replays (torch.equal).
The batch sizes / pages of a given log are in its lines.
"""
import statistics, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode_imbalance import dist_lengths, GpuTimer, copy_bandwidth
from evenkv import DecodeAttention
tag = sys.argv[1]
dev = torch.device("cuda")
Hq, Hkv, D, T = 32, 4, 128, 262144
timer = GpuTimer(dev, 256)
slots = T + 64 * 2048 * 16
k = torch.randn(slots, Hkv, D, dtype=torch.bfloat16, device=dev)
v = torch.randn_like(k)
print(tag, "copy TB/s %.3f" % copy_bandwidth(dev), flush=True)
for P in (16, 1):
    for B in (1, 16, 128, 512, 1024, 2048):
        for dist in ("Uniform", "Skewed40"):
            lens = dist_lengths(dist, T, B)
            if lens is None:
                continue
            seq = torch.tensor(lens, dtype=torch.int32, device=dev)
            maxp = triton.cdiv(max(lens), P)
            pt = torch.randint(0, slots // P, (B, maxp), dtype=torch.int32, device=dev)
            q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
            attn = DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, B, maxp, "balanced")
            attn.plan(seq, pt)
            out = attn.run(q, k, v).clone()
            ref = DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, B, maxp, "fa3")
            ref.plan(seq, pt)
            err = (ref.run(q, k, v).float() - out.float()).abs().max().item()
            same = all(torch.equal(attn.run(q, k, v), out) for _ in range(3))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                og = attn.run(q, k, v)
            gsame = True
            for _ in range(3):
                og.zero_(); g.replay(); torch.cuda.synchronize()
                gsame &= torch.equal(og, out)
            ts = sorted(timer.events(lambda: attn.run(q, k, v), 30, 50.0))
            tg = sorted(timer.events(g.replay, 30, 10.0))
            print(f"{tag} P{P} B{B} {dist}: {statistics.median(ts):.1f} us (p20 {ts[6]:.1f}) graph {statistics.median(tg):.1f} err_vs_fa3 {err:.2e} repeat_equal {same} graph_equal {gsame}", flush=True)
