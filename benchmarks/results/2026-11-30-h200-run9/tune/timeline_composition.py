"""Per-CTA walk time vs what the CTA walks (tiles, tokens, segments), timeline variant on PYTHONPATH."""
import sys, numpy as np, torch, triton
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
for pt_ in sys.argv[2].split(","):
    B, dist = int(pt_.split(":")[0]), pt_.split(":")[1]
    lens = dist_lengths(dist, T, B)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    maxp = triton.cdiv(max(lens), 16)
    pt = torch.randint(0, slots // 16, (B, maxp), dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
    attn = DecodeAttention(Hq, Hkv, D, 16, torch.bfloat16, dev, B, maxp, "balanced")
    attn.plan(seq, pt); attn.run(q, k, v); torch.cuda.synchronize()
    piece, total = [int(x) for x in attn._schedule.plan_scalars[:2].cpu()]
    C = attn.num_ctas
    # tile line: tokens per tile, segment-start flags
    toks, segst = [], []
    for n in lens:
        nt = -(-n // BN)
        per = [min(BN, n - t * BN) for t in range(nt)]
        for h in range(Hkv):
            toks += per; segst += [1] + [0] * (nt - 1)
    toks, segst = np.array(toks), np.array(segst)
    assert len(toks) == total
    walks, ends = [], []
    for rep in range(6):
        timer.flush(); attn.run(q, k, v); torch.cuda.synchronize()
        t = L.TIMELINE[C].cpu().numpy()
        if rep: walks.append((t[:, 1] - t[:, 0]) / 1e3); ends.append((t[:, 2] - t[:, 0].min()) / 1e3)
    w = np.mean(walks, 0); end = np.mean(ends, 0)
    X = []
    for c in range(C):
        lo, hi = min(c * piece, total), min((c + 1) * piece, total)
        tk = toks[lo:hi]
        X.append([hi - lo, tk.sum() / BN, (tk < BN).sum(), segst[lo:hi].sum()])
    X = np.array(X, float)
    sel = X[:, 0] == piece
    A = np.c_[X[sel][:, 0], X[sel][:, 1], np.ones(sel.sum())]
    coef, *_ = np.linalg.lstsq(A, w[sel], rcond=None)
    pred = A @ coef
    r2 = 1 - ((w[sel] - pred) ** 2).sum() / ((w[sel] - w[sel].mean()) ** 2).sum()
    print(f"B{B} {dist}: C {C} piece {piece} total {total}; walk med {np.median(w):.1f} max {w.max():.1f}; end max {end.max():.1f}")
    print(f"   fit walk = {coef[0]:.3f}*tiles + {coef[1]:.3f}*fulltile_equiv + {coef[2]:.1f}  (R2 {r2:.2f}, full-range CTAs {sel.sum()})")
    fe = X[sel][:, 1]
    qs = np.quantile(fe, [0, .25, .5, .75, 1])
    for a, b in zip(qs[:-1], qs[1:]):
        m = sel.copy(); m[sel] = (fe >= a) & (fe <= b)
        print(f"   full-tile-equiv in [{a:.1f},{b:.1f}]: n {m.sum()} walk mean {w[m].mean():.1f} max {w[m].max():.1f} segs {X[m][:,3].mean():.1f}")
    for s in range(4):
        m = (np.arange(C) // 132 == s)
        print(f"   slot {s}: walk mean {w[m].mean():.1f} max {w[m].max():.1f}  fte {X[m][:,1].mean():.1f}")
