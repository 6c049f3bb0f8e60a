"""Scratch: GPU time of DecodeAttention.plan (as decode_imbalance's plan_dev_us) for plan-grid variants."""
import statistics, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode_imbalance import dist_lengths, GpuTimer
import evenkv
import evenkv.kernels.decode_launch as L
from evenkv.kernels.plan import plan_stream_kernel
dev = torch.device("cuda")
timer = GpuTimer(dev, 256)
orig = L.launch_plan_stream
def variant(tile, warps):
    def launch(seq_lens, plan_seq_lens, active_req, cta_start, plan_scalars, capacity, num_ctas, num_sms, num_kv_heads, block_n, segment_overhead):
        block_b = min(max(triton.next_power_of_2(seq_lens.shape[0]), 128), L.PLAN_MAX_BLOCK_B)
        block_c = min(triton.next_power_of_2(triton.cdiv(num_ctas, num_sms)), tile // block_b)
        plan_stream_kernel[(triton.cdiv(num_ctas, block_c),)](
            seq_lens, plan_seq_lens, active_req, cta_start, plan_scalars, seq_lens.shape[0], capacity, num_ctas,
            NUM_KV_HEADS=num_kv_heads, BLOCK_N=block_n, SEGMENT_OVERHEAD=segment_overhead,
            BLOCK_B=block_b, BLOCK_C=block_c, num_warps=warps if block_b >= 1024 else 4)
    return launch
for B, dist in [(2048, "Uniform"), (2048, "Skewed40"), (1536, "Uniform")]:
    lens = dist_lengths(dist, 262144, B)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    pt = torch.zeros(B, 262144 // 16 + 1, dtype=torch.int32, device=dev)
    attn = evenkv.DecodeAttention(32, 4, 128, 16, torch.bfloat16, dev, 2048, pt.shape[1])
    attn.plan(seq, pt); torch.cuda.synchronize()
    base = attn._schedule.cta_start.clone()
    res = []
    for name, (tile, warps) in [("t8192-w8", (8192, 8)), ("t8192-w4", (8192, 4)), ("t16384-w8", (16384, 8)), ("t8192-w8b", (8192, 8))]:
        L.launch_plan_stream = variant(tile, warps)
        attn.plan(seq, pt); torch.cuda.synchronize()
        assert torch.equal(attn._schedule.cta_start, base), name
        t = []
        for _ in range(3):
            t.append(statistics.median(timer.events(lambda: attn.plan(seq, pt), 30, 200.0, flush=False)))
        res.append(f"{name}={min(t):.2f}")
    L.launch_plan_stream = orig
    print(f"B{B} {dist} grid {attn.launch_config(B)[1]}: " + " ".join(res), flush=True)
