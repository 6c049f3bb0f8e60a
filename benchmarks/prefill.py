#!/usr/bin/env python3
"""Prefill benchmark: evenkv extend vs FA3 varlen and FlashInfer batch prefill,
one run, same data, on one GPU.

Points (default): Qwen3-30B-A3B attention (Hq 32, Hkv 4, D 128, bf16), page size 16,
random page placement; every request of a batch has the same prompt (new tokens) on the
same cached prefix: prompts 512 / 2048 / 8192, prefixes 0 / 8192 / 32768, batches
1 / 2 / 4 / 8 / 16 / 32. ``--skewed`` adds chunked-prefill batches (one 8K chunk on a
32K prefix placed LAST, the other requests 512-token prompts with no prefix), where the
order of work matters (evenkv ``lpt`` vs ``ordered``).

Implementations (``--impls``; a missing peer is skipped with the reason printed):
  evenkv-engine                evenkv.Attention as vLLM runs it: extend rows on vLLM's FA3
                               where it is found (``config`` says which), else on evenkv's
                               Triton kernel
  evenkv-engine-sglang         the same as SGLang runs it: on SGLang's FA3 (flash_attn_with_kvcache;
                               with the SGLang device kit), else on evenkv's Triton kernel
  evenkv-lpt, evenkv-ordered   evenkv.extend's Triton kernel through a reused ExtendPlan (``ordered``
                               runs on skewed points only: on uniform ones it is the same launch)
  fa3                          vllm.vllm_flash_attn.flash_attn_varlen_func(..., block_table,
                               fa_version=3) with get_scheduler_metadata precomputed
  flashinfer-fa2, flashinfer-auto
                               flashinfer.BatchPrefillWithPagedKVCacheWrapper (backend "fa2",
                               and "auto" = FA3-based on Hopper), NHD pages, plan() untimed
FlashInfer's JIT builds start in the background at launch; FlashInfer runs after the
others so the builds overlap them.

Timing: CUDA events around the attention call only, a 256 MiB L2 flush and a short GPU
sleep before each call (so host-side launch work never shows as GPU time), median /
p20 / p80 of 3-20 calls. TFLOP/s counts causal work only: 4 * Hq * D * sum over queries
of the keys each sees (prompt * prefix + prompt * (prompt + 1) / 2 per request).
Correctness: every implementation's output at every point is checked against an fp32
reference on 48 sampled query rows (first, last, random); ``status`` is ``wrong`` when the
max abs error exceeds --tol.

Output: one long-format CSV at --out (impl, variant, config, shape, point, µs, TFLOP/s,
status, error, versions, GPU), flushed as it goes; at the end every evenkv row is
rewritten with ratio_fa3 / ratio_flashinfer (evenkv TFLOP/s over the peer's, best
FlashInfer variant), and a Markdown summary goes next to it (<out>.md) with the points
below the 0.6x bar.

    python -m benchmarks.prefill --out benchmarks/results/prefill-h200.csv
    python -m benchmarks.prefill --out /tmp/p.csv --quick
    python -m benchmarks.prefill --out /tmp/sweep.csv --sweep-configs    # tune the config table
    python -m benchmarks.prefill --out /tmp/cpu.csv --cpu-smoke          # logic test, no GPU
"""

import argparse
import csv
import datetime
import importlib
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from evenkv.configs import EXTEND_CONFIG_CANDIDATES, ExtendConfig, extend_config, resolve_arch  # noqa: E402
from evenkv.extend_attention import run_extend  # noqa: E402
from evenkv.planning import plan_extend  # noqa: E402

FIELDS = ["impl", "variant", "config", "scenario", "batch", "prompt", "prefix", "page_size", "num_q_heads",
          "num_kv_heads", "head_dim", "dtype", "us_median", "us_p20", "us_p80", "reps", "tflops", "status",
          "max_err", "ratio_fa3", "ratio_flashinfer", "versions", "gpu", "time"]
FLASHINFER_WORKSPACE = 512 << 20


# ----------------------------------------------------------------------------- data


class Point:
    """One batch: per-request prompt (new tokens) and prefix lengths, plus its scenario name."""

    def __init__(self, scenario, prompts, prefixes):
        self.scenario, self.prompts, self.prefixes = scenario, list(prompts), list(prefixes)

    @property
    def batch(self):
        return len(self.prompts)

    def key(self):
        return (self.scenario, tuple(self.prompts), tuple(self.prefixes))

    def label(self):
        if self.scenario == "uniform":
            return f"B={self.batch} prompt={self.prompts[0]} prefix={self.prefixes[0]}"
        return f"{self.scenario} B={self.batch}"

    def causal_keys(self) -> int:
        """Sum over queries of the keys each sees (causal, no window)."""
        return sum(p * c + p * (p + 1) // 2 for p, c in zip(self.prompts, self.prefixes))


class Batch:
    """The tensors every implementation reads (generated from a per-point seed, so each
    implementation sees the same data): q [T, Hq, D], pages [P, page, Hkv, D] x2,
    cu_seqlens_q [B+1] int32, seq_lens [B] int32, page_table [B, max_pages] int32 (random
    placement), FlashInfer's CSR page lists, out [T, Hq, D] (NaN-filled before each impl)."""

    def __init__(self, point, hq, hkv, d, page_size, dtype, device, seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        seq = [p + c for p, c in zip(point.prompts, point.prefixes)]
        npages = [math.ceil(s / page_size) for s in seq]
        total_pages = sum(npages) + 1
        self.k_pages = torch.randn(total_pages, page_size, hkv, d, generator=gen, device=device, dtype=dtype)
        self.v_pages = torch.randn(total_pages, page_size, hkv, d, generator=gen, device=device, dtype=dtype)
        total_q = sum(point.prompts)
        self.q = torch.randn(total_q, hq, d, generator=gen, device=device, dtype=dtype)
        self.out = torch.empty_like(self.q)
        perm = torch.randperm(total_pages, generator=gen, device=device).to(torch.int32)
        i32 = dict(dtype=torch.int32, device=device)
        self.page_table = torch.zeros(point.batch, max(npages), **i32)
        indptr = [0]
        for b, n in enumerate(npages):
            self.page_table[b, :n] = perm[indptr[-1]:indptr[-1] + n]
            indptr.append(indptr[-1] + n)
        self.kv_indptr = torch.tensor(indptr, **i32)
        self.kv_indices = perm[:indptr[-1]].contiguous()
        self.last_page_len = torch.tensor([s - (n - 1) * page_size for s, n in zip(seq, npages)], **i32)
        self.cu_seqlens_q = torch.tensor([0] + list(_cumsum(point.prompts)), **i32)
        self.seq_lens = torch.tensor(seq, **i32)
        self.max_q_len, self.max_seq_len = max(point.prompts), max(seq)
        self.page_size, self.point = page_size, point
        self.sm_scale = d ** -0.5

    def reference_rows(self, rows):
        """fp32 attention of the sampled q rows: [len(rows), Hq, D]."""
        hq, d = self.q.shape[1:]
        hkv = self.k_pages.shape[2]
        cu = self.cu_seqlens_q.tolist()
        k_all = self.k_pages.view(-1, hkv, d)
        v_all = self.v_pages.view(-1, hkv, d)
        outs = []
        for r in rows:
            b = max(i for i in range(len(cu) - 1) if cu[i] <= r)
            pos = self.point.prefixes[b] + (r - cu[b])
            tok = torch.arange(pos + 1, device=self.q.device)
            slots = self.page_table[b, tok // self.page_size].long() * self.page_size + tok % self.page_size
            k = k_all[slots].float().repeat_interleave(hq // hkv, dim=1)
            v = v_all[slots].float().repeat_interleave(hq // hkv, dim=1)
            s = torch.einsum("hd,lhd->hl", self.q[r].float(), k) * self.sm_scale
            outs.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v))
        return torch.stack(outs)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def sample_rows(point, count, seed):
    total = sum(point.prompts)
    gen = torch.Generator().manual_seed(seed)
    rows = {0, total - 1}
    ends = list(_cumsum(point.prompts))
    rows.update(e - 1 for e in ends if e > 0)
    rows.update(torch.randint(0, total, (count,), generator=gen).tolist())
    return sorted(rows)[:count] if len(rows) > count else sorted(rows)


# ----------------------------------------------------------------------------- implementations


class Impl:
    """prepare(batch) untimed (plans, index formats); run() timed; config(): what it resolved to."""

    family = ""
    variant = ""

    def prepare(self, batch):
        self.batch = batch

    def run(self):
        raise NotImplementedError

    def config(self) -> str:
        return ""


class EvenKV(Impl):
    family = "evenkv"

    def __init__(self, schedule, cfg=None, arch=None):
        self.variant, self.schedule, self.cfg, self.arch = schedule, schedule, cfg, arch
        if cfg is not None:
            self.variant = f"{schedule}-m{cfg.block_m}-n{cfg.block_n}-w{cfg.num_warps}-s{cfg.num_stages}"

    def prepare(self, batch):
        self.batch = b = batch
        hq, hkv = b.q.shape[1], b.k_pages.shape[2]
        self.resolved = self.cfg or extend_config(resolve_arch(self.arch, b.q.device), b.q.shape[2], hq // hkv,
                                                  b.max_q_len)
        self.plan = plan_extend(b.cu_seqlens_q, b.seq_lens, b.page_table, page_size=b.page_size,
                                group_size=hq // hkv, max_q_len=b.max_q_len, config=self.resolved,
                                schedule=self.schedule)

    def run(self):
        b = self.batch
        run_extend(self.plan, b.q, b.k_pages, b.v_pages, b.out, k_new=None, v_new=None, sm_scale=b.sm_scale,
                   causal=True, sliding_window=None, logit_cap=None)

    def config(self):
        c = self.resolved
        return f"{c.name} m{c.block_m} n{c.block_n} w{c.num_warps} s{c.num_stages} {self.schedule}"


class EvenKVEngine(Impl):
    """evenkv.Attention planned once per batch, with an engine's FA3 as its prefill kernel, as
    that engine's adapter builds it: ``vllm`` (vLLM's flash_attn_varlen_func) or ``sglang``
    (SGLang's flash_attn_with_kvcache); evenkv's Triton extend where the engine's FA3 is missing."""

    family = "evenkv"

    def __init__(self, engine: str = "vllm"):
        self.engine = engine
        self.variant = "engine" if engine == "vllm" else f"engine-{engine}"

    def prepare(self, batch):
        from evenkv.attention import Attention
        from evenkv.integrations import prefill

        kernel = {"vllm": prefill.vllm_flash_attention, "sglang": prefill.sglang_flash_attention}[self.engine]
        self.batch = b = batch
        hq, d = b.q.shape[1:]
        hkv = b.k_pages.shape[2]
        self.attn = Attention(hq, hkv, d, b.page_size, b.q.dtype, b.q.device, b.point.batch, b.page_table.shape[1],
                              sm_scale=b.sm_scale, prefill_kernel=kernel(b.q.device))
        self.plan = self.attn.plan(b.cu_seqlens_q, b.seq_lens, b.page_table, num_decodes=0, max_q_len=b.max_q_len,
                                   max_seq_len=b.max_seq_len)

    def run(self):
        b = self.batch
        self.attn.run(self.plan, b.q, b.k_pages, b.v_pages, out=b.out)

    def config(self):
        return self.attn.prefill_reason


class FA3(Impl):
    family, variant = "fa3", "varlen"

    def __init__(self):
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        self.fwd, self.meta_fn = flash_attn_varlen_func, get_scheduler_metadata

    def prepare(self, batch):
        self.batch = b = batch
        hq, d = b.q.shape[1:]
        hkv = b.k_pages.shape[2]
        try:
            self.metadata = self.meta_fn(
                b.point.batch, b.max_q_len, b.max_seq_len, hq, hkv, d, cache_seqlens=b.seq_lens, qkv_dtype=b.q.dtype,
                cu_seqlens_q=b.cu_seqlens_q, page_size=b.page_size, causal=True, window_size=(-1, -1))
            self.note = "scheduler_metadata"
        except Exception as err:  # noqa: BLE001  (older builds: let FA3 plan inside the call)
            self.metadata, self.note = None, f"no scheduler_metadata ({type(err).__name__})"

    def run(self):
        b = self.batch
        self.fwd(b.q, b.k_pages, b.v_pages, max_seqlen_q=b.max_q_len, cu_seqlens_q=b.cu_seqlens_q,
                 max_seqlen_k=b.max_seq_len, seqused_k=b.seq_lens, softmax_scale=b.sm_scale, causal=True,
                 block_table=b.page_table, out=b.out, scheduler_metadata=self.metadata, fa_version=3)

    def config(self):
        return f"fa_version=3 {self.note}"


class FlashInfer(Impl):
    family = "flashinfer"

    def __init__(self, backend):
        import flashinfer
        self.variant, self.backend = backend, backend
        self.workspace = None
        self.flashinfer = flashinfer

    def prepare(self, batch):
        self.batch = b = batch
        if self.workspace is None:
            self.workspace = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=b.q.device)
        hq, d = b.q.shape[1:]
        hkv = b.k_pages.shape[2]
        self.wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self.backend)
        self.wrapper.plan(b.cu_seqlens_q, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, b.page_size,
                          causal=True, sm_scale=b.sm_scale, q_data_type=b.q.dtype, kv_data_type=b.k_pages.dtype)

    def run(self):
        b = self.batch
        self.wrapper.run(b.q, (b.k_pages, b.v_pages), out=b.out)

    def config(self):
        return f"backend={self.backend} -> {getattr(self.wrapper, '_backend', '?')}"


def start_flashinfer_builds(head_dim, dtype_name, backends):
    """JIT-build FlashInfer's prefill modules in the background (compile only); returns the processes."""
    code = ("import sys, time, torch; from flashinfer.jit import gen_batch_prefill_module as g; t = time.time(); "
            "dt = {'bf16': torch.bfloat16, 'fp16': torch.float16}[sys.argv[2]]; "
            "s = g(sys.argv[1], dt, dt, dt, torch.int32, int(sys.argv[3]), int(sys.argv[3]), 0, False, False, False); "
            "s.build(verbose=False); print(f'flashinfer {sys.argv[1]} prefill module built in {time.time() - t:.0f}s')")
    procs = []
    for backend in backends:
        name = "fa3" if backend == "auto" else backend
        procs.append(subprocess.Popen([sys.executable, "-c", code, name, dtype_name, str(head_dim)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def peer_versions():
    out = []
    for mod in ("vllm", "flashinfer", "triton", "torch"):
        try:
            out.append(f"{mod} {importlib.import_module(mod).__version__}")
        except Exception:  # noqa: BLE001
            pass
    return "; ".join(out)


# ----------------------------------------------------------------------------- timing


class Timer:
    def __init__(self, device, flush_mib):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(flush_mib << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def time_us(self, fn, reps):
        times = []
        for _ in range(reps):
            if self.cuda:
                self.flush.zero_()
                torch.cuda._sleep(200_000)  # ~0.1 ms: the host enqueues the call before the GPU gets there
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
        return times


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# ----------------------------------------------------------------------------- sweep


def parse_ints(text):
    return tuple(int(x) for x in text.split(",") if x)


def build_points(args):
    points = []
    for prompt in args.prompts:
        for prefix in args.prefixes:
            for b in args.batches:
                if args.max_tokens and b * (prompt + prefix) > args.max_tokens:
                    continue
                points.append(Point("uniform", [prompt] * b, [prefix] * b))
    if args.skewed:
        for b in args.skewed_batches:
            points.append(Point("skewed", [args.skew_short] * (b - 1) + [args.skew_prompt],
                                [0] * (b - 1) + [args.skew_prefix]))
    return points


def make_impls(args, log):
    impls, skipped = [], []
    for name in args.impls:
        try:
            if name == "evenkv-engine":
                impls.append(EvenKVEngine())
            elif name == "evenkv-engine-sglang":
                impls.append(EvenKVEngine("sglang"))
            elif name == "evenkv-lpt":
                impls.append(EvenKV("lpt", arch=args.arch))
            elif name == "evenkv-ordered":
                impls.append(EvenKV("ordered", arch=args.arch))
            elif name == "fa3":
                impls.append(FA3())
            elif name.startswith("flashinfer-"):
                impls.append(FlashInfer(name.split("-", 1)[1]))
            else:
                raise ValueError(f"unknown implementation {name!r}")
        except Exception as err:  # noqa: BLE001  (a missing peer: say why, go on)
            skipped.append((name, f"{type(err).__name__}: {err}"))
            log(f"SKIP {name}: {type(err).__name__}: {err}")
    return impls, skipped


def run(args):
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    t0 = time.time()

    def log(*msg):
        print(f"[prefill +{time.time() - t0:6.1f}s]", *msg, flush=True)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    versions = peer_versions()
    log(f"{gpu} | {versions}")
    hq, hkv, d = args.shape
    points = build_points(args)
    if args.sweep_configs:
        impls = [EvenKV("lpt", ExtendConfig("sweep", *c)) for c in EXTEND_CONFIG_CANDIDATES]
        impls.insert(0, EvenKV("lpt", arch=args.arch))
        skipped = []
    else:
        impls, skipped = make_impls(args, log)
    fi_backends = [i.backend for i in impls if isinstance(i, FlashInfer)]
    builds = start_flashinfer_builds(d, args.dtype, fi_backends) if fi_backends and device.type == "cuda" else []
    if builds:
        log(f"FlashInfer JIT builds started in the background: {fi_backends}")
    impls.sort(key=lambda i: isinstance(i, FlashInfer))  # FlashInfer last: its builds overlap the others

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    timer = Timer(device, args.flush_mib)
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    with open(out_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        for impl in impls:
            if isinstance(impl, FlashInfer) and builds:
                for proc in builds:
                    text, _ = proc.communicate()
                    log("  " + (text.strip().splitlines() or ["(no output)"])[-1])
                builds = []
            for idx, point in enumerate(points):
                if isinstance(impl, EvenKV) and impl.schedule == "ordered" and point.scenario == "uniform":
                    continue  # equal seq_lens: LPT order is request order, the same launch
                row = dict(impl=impl.family, variant=impl.variant, scenario=point.scenario, batch=point.batch,
                           prompt=max(point.prompts), prefix=max(point.prefixes), page_size=args.page_size,
                           num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=args.dtype, versions=versions,
                           gpu=gpu, time=stamp, ratio_fa3="", ratio_flashinfer="")
                row["_key"] = point.key()
                try:
                    batch = Batch(point, hq, hkv, d, args.page_size, dtype, device, seed=1000 + idx)
                    impl.prepare(batch)
                    batch.out.fill_(float("nan"))
                    impl.run()  # warm-up (compiles) and the output we check
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    sampled = sample_rows(point, args.check_rows, seed=idx)
                    ref = batch.reference_rows(sampled)
                    got = batch.out[sampled].float()
                    err = (got - ref).abs().max().item() if torch.isfinite(got).all() else math.inf
                    row["max_err"] = f"{err:.3e}"
                    row["config"] = impl.config()
                    if not err <= args.tol:
                        row["status"] = "wrong"
                        log(f"WRONG {impl.family}/{impl.variant} {point.label()}: max err {err:.3e}")
                    else:
                        est = timer.time_us(impl.run, 1)[0]
                        reps = max(args.min_reps, min(args.max_reps, int(args.target_ms * 1e3 / max(est, 1.0))))
                        times = timer.time_us(impl.run, reps)
                        med = statistics.median(times)
                        row.update(status="ok", reps=reps, us_median=f"{med:.1f}", us_p20=f"{quantile(times, 0.2):.1f}",
                                   us_p80=f"{quantile(times, 0.8):.1f}",
                                   tflops=f"{4 * hq * d * point.causal_keys() / (med * 1e-6) / 1e12:.2f}")
                        log(f"{impl.family:10s} {impl.variant:14s} {point.label():34s} {med:10.1f} us "
                            f"{row['tflops']:>8s} TFLOP/s  err {err:.1e}")
                    del batch
                except Exception as err:  # noqa: BLE001  (one failing point must not stop the run)
                    row.update(status="error", config=f"{type(err).__name__}: {str(err)[:200]}")
                    log(f"ERROR {impl.family}/{impl.variant} {point.label()}: {type(err).__name__}: {err}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                writer.writerow({k: v for k, v in row.items() if not k.startswith("_")})
                fh.flush()
    add_ratios(rows)
    with open(out_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: v for k, v in row.items() if not k.startswith("_")})
    summary = summarize(rows, skipped, gpu, versions, args)
    Path(str(out_path.with_suffix("")) + ".md").write_text(summary)
    print(summary)
    log(f"wrote {out_path} and {out_path.with_suffix('')}.md")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def add_ratios(rows):
    """ratio_fa3 / ratio_flashinfer on every evenkv row: its TFLOP/s over the peer's at the
    same point (FlashInfer: its best variant there)."""
    best = {}
    for r in rows:
        if r.get("status") != "ok" or r["impl"] == "evenkv":
            continue
        k = (r["impl"], r["_key"])
        best[k] = max(best.get(k, 0.0), float(r["tflops"]))
    for r in rows:
        if r["impl"] != "evenkv" or r.get("status") != "ok":
            continue
        for peer, col in (("fa3", "ratio_fa3"), ("flashinfer", "ratio_flashinfer")):
            if best.get((peer, r["_key"])):
                r[col] = f"{float(r['tflops']) / best[(peer, r['_key'])]:.3f}"


def summarize(rows, skipped, gpu, versions, args):
    lines = ["# Prefill benchmark: evenkv extend vs peers", "",
             f"{gpu}; {versions}; Hq/Hkv/D = {'/'.join(map(str, args.shape))}, {args.dtype}, page {args.page_size}", ""]
    for name, why in skipped:
        lines.append(f"- skipped {name}: {why}")
    lines += ["", "| point | impl | variant | µs | TFLOP/s | vs FA3 | vs FlashInfer | status |",
              "|---|---|---|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["scenario"], r["prompt"], r["prefix"], r["batch"], r["impl"])):
        label = f"{r['scenario']} B={r['batch']} prompt={r['prompt']} prefix={r['prefix']}"
        lines.append(f"| {label} | {r['impl']} | {r['variant']} | {r.get('us_median', '')} | {r.get('tflops', '')} | "
                     f"{r.get('ratio_fa3', '')} | {r.get('ratio_flashinfer', '')} | {r.get('status', '')} |")
    ratios = [float(r["ratio_fa3"]) for r in rows if r["impl"] == "evenkv" and r.get("ratio_fa3")]
    if ratios:
        below = [r for r in rows if r["impl"] == "evenkv" and r.get("ratio_fa3") and float(r["ratio_fa3"]) < 0.6]
        lines += ["", f"evenkv / FA3 throughput: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, "
                      f"max {max(ratios):.2f} over {len(ratios)} evenkv rows; {len(below)} below the 0.6x bar."]
        for r in below:
            lines.append(f"- below bar: {r['variant']} {r['scenario']} B={r['batch']} prompt={r['prompt']} "
                         f"prefix={r['prefix']}: {r['ratio_fa3']}")
    bad = [r for r in rows if r.get("status") != "ok"]
    for r in bad:
        lines.append(f"- {r.get('status')}: {r['impl']}/{r['variant']} {r['scenario']} B={r['batch']} "
                     f"prompt={r['prompt']} prefix={r['prefix']}: {r.get('config', '')} {r.get('max_err', '')}")
    return "\n".join(lines) + "\n"


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="CSV path (a Markdown summary is written next to it)")
    ap.add_argument("--prompts", type=parse_ints, default=(512, 2048, 8192))
    ap.add_argument("--prefixes", type=parse_ints, default=(0, 8192, 32768))
    ap.add_argument("--batches", type=parse_ints, default=(1, 2, 4, 8, 16, 32))
    ap.add_argument("--max-tokens", type=int, default=0, help="skip points whose B * (prompt + prefix) exceeds this")
    ap.add_argument("--skewed", action="store_true", help="add chunked-prefill batches (a long chunk placed last)")
    ap.add_argument("--skewed-batches", type=parse_ints, default=(4, 16, 32))
    ap.add_argument("--skew-prompt", type=int, default=8192)
    ap.add_argument("--skew-prefix", type=int, default=32768)
    ap.add_argument("--skew-short", type=int, default=512, help="prompt of the other requests of a skewed batch")
    ap.add_argument("--shape", type=parse_ints, default=(32, 4, 128), help="Hq,Hkv,D")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--impls", type=lambda s: tuple(x for x in s.split(",") if x),
                    default=("evenkv-engine", "evenkv-lpt", "evenkv-ordered", "fa3", "flashinfer-fa2",
                             "flashinfer-auto"))
    ap.add_argument("--arch", choices=("sm80", "sm90"), default=None, help="evenkv config table (default: probe)")
    ap.add_argument("--sweep-configs", action="store_true",
                    help="time evenkv with each candidate config (evenkv.configs.EXTEND_CONFIG_CANDIDATES) instead")
    ap.add_argument("--quick", action="store_true", help="prompts 512,8192; prefixes 0,32768; batches 1,8,32")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=20)
    ap.add_argument("--target-ms", type=float, default=250.0, help="timed calls per point ~ this / one call")
    ap.add_argument("--flush-mib", type=int, default=256)
    ap.add_argument("--check-rows", type=int, default=48)
    ap.add_argument("--tol", type=float, default=2e-2, help="max abs error vs the fp32 reference on sampled rows")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the Triton interpreter, evenkv only")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.prompts, args.prefixes, args.batches = (512, 8192), (0, 32768), (1, 8, 32)
    if args.sweep_configs and not args.quick:
        args.prompts, args.prefixes, args.batches = (512, 2048, 8192), (0, 32768), (4, 32)
    if args.cpu_smoke:
        args.prompts, args.prefixes, args.batches = (5, 33), (0, 20), (1, 3)
        args.shape, args.dtype, args.skew_prompt, args.skew_prefix = (4, 2, 64), "fp16", 40, 50
        args.skew_short = 7
        args.skewed_batches = (3,)
        args.impls = tuple(i for i in args.impls if i.startswith("evenkv"))
        args.min_reps, args.max_reps = 1, 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
