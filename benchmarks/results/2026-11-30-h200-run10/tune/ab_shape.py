"""Scratch A/B of decode configs for one shape, in one process: whole balanced run (GpuTimer, cold L2, median of 30).
argv: shape name, variants ("base", "many", or "x-n64-s2-r80-c6": keys off the main row), points "T:page:B:dist,...".
"""
import dataclasses, statistics, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode_imbalance import dist_lengths, GpuTimer, SHAPES
import evenkv
from evenkv import DecodeAttention
from evenkv.arch import many_segments_config
dev = torch.device("cuda")
shape = SHAPES[sys.argv[1]]
Hq, Hkv, D = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
base = evenkv.decode_config("sm90", D, 1)  # the page-1 row: what the table held for every page size before run 10
VARIANTS = {}
for spec in sys.argv[2].split(","):
    if spec == "many":
        VARIANTS[spec] = many_segments_config("sm90", D, 16)
        continue
    kw = {}
    for part in spec.split("-")[1:]:
        key = {"r": "max_registers", "c": "max_ctas_per_sm", "s": "num_stages", "n": "block_n", "w": "num_warps"}[part[0]]
        kw[key] = int(part[1:])
    VARIANTS[spec] = dataclasses.replace(base, name=spec, **kw)
points = [p.split(":") for p in sys.argv[3].split(",")]  # T:page:B:dist
timer = GpuTimer(dev, 256)
cache = {}
print(f"{shape.name} {Hq}/{Hkv}/{D} base {base}", flush=True)
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
    runs = {}
    for name, cfg in VARIANTS.items():
        attn = DecodeAttention(Hq, Hkv, D, page, torch.bfloat16, dev, B, maxp, "balanced", config=cfg)
        attn.plan(seq, pt)
        out = attn.run(q, k, v)
        err = (out.float() - want.float()).abs().max().item()
        runs[name] = (attn, out, err)
    times = {n: [] for n in VARIANTS}
    for rnd in range(2):
        for name, (attn, out, err) in runs.items():
            times[name].append(statistics.median(timer.events(lambda: attn.run(q, k, v, out=out), 30, 60.0)))
    row = " ".join(f"{n}={'/'.join(f'{t:.1f}' for t in times[n])}(C{runs[n][0].num_ctas})" + ("" if runs[n][2] < 2e-2 else f"(ERR {runs[n][2]:.1e})") for n in VARIANTS)
    print(f"{T//1024}K p{page} B{B} {dist}: {row}", flush=True)
