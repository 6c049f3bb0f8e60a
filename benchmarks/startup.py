"""Start-up of evenkv's kernel builds: constructor plus ``warmup``, cold and warm.

Each point runs in a fresh process with its own empty ``TRITON_CACHE_DIR``, after CUDA is
initialised, and times ``evenkv.Attention(...)`` and ``Attention.warmup`` apart, counting the
kernels Triton hands over (``builds``: its post-compile hook, which fires for a build and for
a load from the disk cache alike; ``constructor_builds``: those of the constructor), once
building in this process only (``EVENKV_BUILD_PROCESSES=1``) and once in forked processes (the
default); the order of the two alternates over repeats. Then a second fresh process on the same, now filled, cache times
the warm start (``warm_*`` columns: every kernel loaded from the cache). Engine-like layer kinds:

- ``vllm-like``: Qwen3-8B (32 / 8 heads, D 128, bf16), page 16, K|V halves of one cache tensor,
  up to 1024 requests, int32 lengths; the extend kernels built too (vLLM's default keeps FA3
  for prefill and builds none of them, so an engine start has fewer builds than this);
- ``vllm-like-spec``: the same with verify rows of up to 4 tokens (3 draft tokens);
- ``sglang-like``: Qwen3-30B-A3B (32 / 4 heads), page 1, new tokens in k_new / v_new, int32 and
  int64 lengths;
- ``sglang-like-spec``: the same with tree-masked verify rows of 4 tokens (SGLang's NGRAM).

After the builds, the same process times one engine step as an engine captures it into a CUDA
graph (``layer_forward``: a plan of 256 decode or verify rows of 5 tokens, then one run per
layer, 36 layers for the vLLM-like kinds and 48 for the SGLang-like): its host time, eager time
and capture time (``step_*_ms``: capture and instantiation, what an engine pays per captured
batch size), and the same for FA3 varlen (``fa3_step_*_ms``) where vLLM's FA3 build is installed;
a step that fails leaves its error in ``step_error`` beside the builds' figures.

    python -m benchmarks.startup [--kinds vllm-like,sglang-like] [--repeats 2] [--processes 1,forked] [--out startup.csv]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.tune_decode import write_csv

KINDS = {
    "vllm-like": dict(heads=(32, 8), page=16, batch=1024, q_len=1, new_tokens=False, int64=False, tree=False,
                      layers=36),
    "vllm-like-spec": dict(heads=(32, 8), page=16, batch=1024, q_len=4, new_tokens=False, int64=False, tree=False,
                           layers=36),
    "sglang-like": dict(heads=(32, 4), page=1, batch=1024, q_len=1, new_tokens=True, int64=True, tree=False,
                        layers=48),
    "sglang-like-spec": dict(heads=(32, 4), page=1, batch=1024, q_len=4, new_tokens=True, int64=True, tree=True,
                             layers=48),
}
# The captured forward: a decode (or verify) step of CAPTURE_BATCH requests of CAPTURE_SEQ_LEN
# tokens, the engines' capture-time fill (a graph's cost to capture does not depend on lengths).
CAPTURE_BATCH = 256
CAPTURE_SEQ_LEN = 5


def step_batch(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, q_len: int, device):
    """The captured step's batch (``benchmarks.peers.Batch``, bf16): CAPTURE_BATCH requests of
    CAPTURE_SEQ_LEN tokens, q_len query tokens each, over a random KV pool."""
    import torch

    from benchmarks.decode_imbalance import Pool
    from benchmarks.peers import Shape

    shape = Shape("startup", num_q_heads, num_kv_heads, head_dim)
    pool = Pool(shape, CAPTURE_BATCH * CAPTURE_SEQ_LEN, page_size, CAPTURE_BATCH, torch.bfloat16, device, seed=0)
    return pool.batch([CAPTURE_SEQ_LEN] * CAPTURE_BATCH, seed=0, q_len=q_len)


def layer_forward(attn, batch, *, layers: int, tree: bool, index_dtype):
    """What one captured engine step asks of evenkv: one plan of ``batch``'s decode (q_len 1) or
    verify rows (with ``tree``, as chains of tree masks: ``attn`` built with tree_masks=True),
    then ``layers`` runs into ``batch.out``. index_dtype: the lengths' dtype the engine passes
    (int32 or int64)."""
    from benchmarks.peers.evenkv_impl import chain_mask

    seq_lens, q_len = batch.seq_lens.to(index_dtype), batch.q_len
    rows = {}
    if q_len > 1:
        rows = dict(decode_q_len=q_len, num_decode_tokens=batch.batch_size * q_len,
                    tree_mask=chain_mask(batch.cu_seqlens_q) if tree else None)

    def forward():
        plan = attn.plan(batch.cu_seqlens_q, seq_lens, batch.page_table, num_decodes=batch.batch_size,
                         max_q_len=q_len, **rows)
        for _ in range(layers):
            attn.run(plan, batch.q, batch.k_slots, batch.v_slots, out=batch.out)
    return forward


def fa3_forward(batch, *, layers: int):
    """The same step on FA3 varlen as vLLM runs it (``benchmarks.peers.fa3``, FA3's own split):
    its scheduler metadata, then ``layers`` calls; None where vLLM's FA3 build is not installed."""
    import math

    import torch

    from benchmarks.peers import Context, Shape, fa3

    if not fa3.available()[0]:
        return None
    q, k = batch.q, batch.k_pages
    shape = Shape("startup", q.shape[1], k.shape[2], k.shape[3])
    ctx = Context(shape, q.dtype, q.device, batch.page_size, batch.batch_size, batch.page_table.shape[1],
                  1 / math.sqrt(shape.head_dim), torch.cuda.get_device_properties(q.device).multi_processor_count,
                  max_q_len=batch.q_len)
    runner = fa3.make("auto", ctx)
    runner.prepare(batch)

    def forward():
        runner.plan()
        for _ in range(layers):
            runner.run()
    return forward


def capture_costs(forward, repeats: int = 3) -> dict:
    """Milliseconds (the best of ``repeats``) of one forward: its host time (launches issued, no
    wait), eager (to the GPU's end) and captured into a CUDA graph (capture and instantiation,
    what an engine pays per captured size and run)."""
    import torch

    forward()
    host = eager = capture = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host, eager = min(host, t1 - t0), min(eager, time.perf_counter() - t0)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph):
            forward()
        torch.cuda.synchronize()
        capture = min(capture, time.perf_counter() - t0)
        del graph
    return dict(host_ms=round(host * 1e3, 2), eager_ms=round(eager * 1e3, 2), capture_ms=round(capture * 1e3, 2))


def measure(kind: str) -> dict:
    """Constructor and warm-up seconds and build count of one kind, in this (fresh) process."""
    import torch
    import triton

    import evenkv
    spec = KINDS[kind]
    builds = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **_: builds.append(1)
    (hq, hkv), d, page, dev = spec["heads"], 128, spec["page"], "cuda"
    slots = 4096 * page
    kv = torch.zeros(slots, hkv, 2 * d, dtype=torch.bfloat16, device=dev)
    k_cache, v_cache = kv[..., :d], kv[..., d:]
    q = torch.zeros(8192, hq, d, dtype=torch.bfloat16, device=dev)
    new = torch.zeros(8192, hkv, d, dtype=torch.bfloat16, device=dev) if spec["new_tokens"] else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    attn = evenkv.Attention(hq, hkv, d, page, torch.bfloat16, dev, spec["batch"], 65536 // page,
                            max_decode_q_len=spec["q_len"], tree_masks=spec["tree"])
    t1 = time.perf_counter()
    constructor_builds = len(builds)
    attn.warmup(q, k_cache, v_cache, k_new=new, v_new=new, out=torch.empty_like(q),
                index_dtypes=(torch.int32, torch.int64) if spec["int64"] else (torch.int32,))
    t2 = time.perf_counter()
    row = dict(constructor_s=round(t1 - t0, 3), warmup_s=round(t2 - t1, 3), total_s=round(t2 - t0, 3),
               builds=len(builds), constructor_builds=constructor_builds)
    try:
        batch = step_batch(hq, hkv, d, page, spec["q_len"], dev)
        costs = capture_costs(layer_forward(attn, batch, layers=spec["layers"], tree=spec["tree"],
                                            index_dtype=torch.int64 if spec["int64"] else torch.int32))
        row.update({f"step_{k}": v for k, v in costs.items()})
        fa3 = fa3_forward(batch, layers=spec["layers"])
        if fa3 is not None:
            row.update({f"fa3_step_{k}": v for k, v in capture_costs(fa3).items()})
    except Exception as error:  # noqa: BLE001  (the builds' figures stand; the row says what failed)
        row["step_error"] = f"{type(error).__name__}: {error}"[:200]
    return row


COLUMNS = ("constructor_s", "warmup_s", "total_s", "builds", "constructor_builds", "step_host_ms", "step_eager_ms",
           "step_capture_ms", "fa3_step_host_ms", "fa3_step_eager_ms", "fa3_step_capture_ms", "step_error")


def run_child(kind: str, processes: str) -> dict:
    """One point: a fresh process on an empty Triton cache, then one on the cache it filled.
    ``measure``'s dict, its ``warm_`` copy, and a status."""
    row = {}
    with tempfile.TemporaryDirectory(prefix="evenkv-startup-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        if processes == "1":
            env["EVENKV_BUILD_PROCESSES"] = "1"
        else:
            env.pop("EVENKV_BUILD_PROCESSES", None)
        for prefix in ("", "warm_"):
            proc = subprocess.run([sys.executable, "-m", "benchmarks.startup", "--child", kind], capture_output=True,
                                  text=True, env=env)
            if proc.returncode != 0:
                return dict(row, status=f"error ({prefix or 'cold'}): " + proc.stderr.strip().splitlines()[-1][:200])
            row.update({prefix + k: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()})
    return dict(row, status="ok")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--processes", default="1,forked",
                    help="build processes per point, comma list: 1 (in-process) and/or forked (the default count)")
    ap.add_argument("--out", default="startup.csv")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    from evenkv.kernels.launching import build_processes
    modes = [str(build_processes()) if p == "forked" else p for p in args.processes.split(",")]
    rows = []
    for kind in args.kinds.split(","):
        for repeat in range(args.repeats):
            for processes in modes if repeat % 2 == 0 else modes[::-1]:
                row = dict(kind=kind, repeat=repeat + 1, build_processes=processes, **run_child(kind, processes))
                print(json.dumps(row), flush=True)
                rows.append(dict(row, **{p + k: row.get(p + k, "") for p in ("", "warm_") for k in COLUMNS}))
                write_csv(args.out, rows)  # after every point: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
