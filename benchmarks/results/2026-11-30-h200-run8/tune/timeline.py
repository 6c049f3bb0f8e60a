"""Scratch: per-CTA globaltimer timeline of decode_stream_kernel (variant copy on PYTHONPATH)."""
import statistics, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode_imbalance import dist_lengths, GpuTimer
from evenkv import DecodeAttention
import evenkv.kernels.decode_launch as L
dev = torch.device("cuda")
Hq, Hkv, D, T = 32, 4, 128, int(sys.argv[1]) if len(sys.argv) > 1 else 262144
timer = GpuTimer(dev, 256)
slots = T + 64 * 2048 * 16
k = torch.randn(slots, Hkv, D, dtype=torch.bfloat16, device=dev)
v = torch.randn_like(k)
per_sm_all = {}
POINTS = [(int(p.split(":")[0]), p.split(":")[1]) for p in sys.argv[2].split(",")] if len(sys.argv) > 2 else [(128, "Uniform"), (96, "Uniform"), (2048, "Skewed40"), (2048, "Uniform"), (16, "Skewed80"), (1, "Uniform")]
for B, dist in POINTS:
    lens = dist_lengths(dist, T, B)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    maxp = triton.cdiv(max(lens), 16)
    pt = torch.randint(0, slots // 16, (B, maxp), dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
    attn = DecodeAttention(Hq, Hkv, D, 16, torch.bfloat16, dev, B, maxp, "balanced")
    attn.plan(seq, pt)
    attn.run(q, k, v)
    torch.cuda.synchronize()
    sm_walk = {}
    for rep in range(6):
        timer.flush()
        attn.run(q, k, v)
        torch.cuda.synchronize()
        tl_ = L.TIMELINE[max(L.TIMELINE)].cpu()
        t0 = tl_[:, 0].min()
        st = (tl_[:, 0] - t0).double() / 1e3
        we = (tl_[:, 1] - t0).double() / 1e3
        en = (tl_[:, 2] - t0).double() / 1e3
        walk = we - st
        print(f"B{B} {dist} rep{rep}: start max {st.max():.1f} | walk dur min/med/max {walk.min():.1f}/{walk.median():.1f}/{walk.max():.1f}"
              f" | walk end med/p90/max {we.median():.1f}/{we.quantile(0.9):.1f}/{we.max():.1f} | end max {en.max():.1f}"
              f" | tail after walk med/max {(en-we).median():.2f}/{(en-we).max():.2f}")
        if rep >= 1:
            for c in range(tl_.shape[0]):
                sm_walk.setdefault(int(tl_[c, 3]), []).append(float(walk[c]))
    sms = sorted(sm_walk)
    avg = {s: statistics.mean(sm_walk[s]) for s in sms}
    order = sorted(sms, key=lambda s: avg[s])
    print(f"  per-SM mean walk: fastest {[(s, round(avg[s],1)) for s in order[:6]]} slowest {[(s, round(avg[s],1)) for s in order[-6:]]}")
    per_sm_all[(B, dist)] = avg
keys = list(per_sm_all)
import itertools
def rank(d):
    o = sorted(d, key=lambda s: d[s]); return {s: i for i, s in enumerate(o)}
for a, b in itertools.combinations(keys, 2):
    ra, rb = rank(per_sm_all[a]), rank(per_sm_all[b])
    common = [s for s in ra if s in rb]
    n = len(common)
    if n < 3: continue
    rho = 1 - 6 * sum((ra[s] - rb[s]) ** 2 for s in common) / (n * (n * n - 1))
    print(f"spearman per-SM walk {a} vs {b}: {rho:.2f}")
# SM-id blocks: mean walk by smid // 2 (TPC) and sorted
avg = per_sm_all[keys[0]]
print("B128U per-SM mean walk by smid:", " ".join(f"{s}:{avg[s]:.0f}" for s in sorted(avg)))
# walk duration by launch slot (cta // 132) for each point's last rep is not kept; rerun one rep per point
print("--- by slot (cta // num_sms) and smid order")
for B, dist in POINTS:
    lens = dist_lengths(dist, T, B)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    maxp = triton.cdiv(max(lens), 16)
    pt = torch.randint(0, slots // 16, (B, maxp), dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
    attn = DecodeAttention(Hq, Hkv, D, 16, torch.bfloat16, dev, B, maxp, "balanced")
    attn.plan(seq, pt)
    acc = {}
    for rep in range(5):
        timer.flush()
        attn.run(q, k, v)
        torch.cuda.synchronize()
        t = L.TIMELINE[max(L.TIMELINE)].cpu()
        C = t.shape[0]
        walk = (t[:, 1] - t[:, 0]).double() / 1e3
        st = (t[:, 0] - t[:, 0].min()).double() / 1e3
        for c in range(C):
            acc.setdefault(c // 132, []).append((float(walk[c]), float(st[c])))
        if rep == 0:
            same = sum(int(t[c, 3]) == int(t[c % 132, 3]) for c in range(C))
            print(f"B{B} {dist}: CTAs on the SM of cta % 132: {same}/{C}; smid of cta 0..7: {[int(t[c,3]) for c in range(8)]}; of 132..135: {[int(t[c,3]) for c in range(132,136)]}")
    for s in sorted(acc):
        w = [x[0] for x in acc[s] if x[0] > 10]
        print(f"  slot {s}: walk mean {statistics.mean(w):.1f} median {statistics.median(w):.1f} max {max(w):.1f} start mean {statistics.mean(x[1] for x in acc[s]):.2f}")
