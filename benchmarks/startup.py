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
  int64 lengths.

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
    "vllm-like": dict(heads=(32, 8), page=16, batch=1024, q_len=1, new_tokens=False, int64=False),
    "vllm-like-spec": dict(heads=(32, 8), page=16, batch=1024, q_len=4, new_tokens=False, int64=False),
    "sglang-like": dict(heads=(32, 4), page=1, batch=1024, q_len=1, new_tokens=True, int64=True),
}


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
                            max_decode_q_len=spec["q_len"])
    t1 = time.perf_counter()
    constructor_builds = len(builds)
    attn.warmup(q, k_cache, v_cache, k_new=new, v_new=new, out=torch.empty_like(q),
                index_dtypes=(torch.int32, torch.int64) if spec["int64"] else (torch.int32,))
    t2 = time.perf_counter()
    return dict(constructor_s=round(t1 - t0, 3), warmup_s=round(t2 - t1, 3), total_s=round(t2 - t0, 3),
                builds=len(builds), constructor_builds=constructor_builds)


COLUMNS = ("constructor_s", "warmup_s", "total_s", "builds", "constructor_builds")


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
