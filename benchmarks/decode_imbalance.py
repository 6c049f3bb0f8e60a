#!/usr/bin/env python3
"""The decode-imbalance benchmark: evenkv and every available peer, one run,
same data, on one GPU.

For each shape, total KV tokens T, page size P, batch size B and length distribution
(Uniform; Skewed40/60/80: one request holds 40/60/80 % of T, the rest share the remainder;
2x40: two requests hold 40 % each; the long request(s) at batch index 0 (and 1)):

* one KV pool per (shape, T, P), random bf16 K/V, allocated once and reused; at each point
  a fresh random page placement, the same for every implementation;
* correctness first: at a few check points per (shape, T, P) each implementation is
  compared with the fp32 reference (``evenkv.kernels.reference.decode_reference``) on a
  sample of rows; one that fails is reported ``wrong`` and not timed in that group;
  every timed point also checks that the output (pre-filled with NaN) is finite;
* timing: CUDA events around the attention call only, a 256 MiB L2 flush before each
  timed call, a GPU sleep before each chunk of calls so the host queue runs ahead;
  median, p20, p80 of 5-50 calls (fewer for slow points); plan/prepare timed apart
  (device: events; host: wall time with a sync);
* the device-to-device copy bandwidth (read + write counted) measured in the same process.

``--verify 0,3,5,7`` measures each point as plain decode (K = 0) and as speculative-decoding
verify steps of K draft tokens: every request then has q_len = 1 + K query tokens, at
positions seq_len - q_len .. seq_len - 1, causal among them (q and the output [B * q_len, Hq,
D], ``cu_seqlens_q`` in steps of q_len), over the same KV and page placement; the CSV's
``q_len`` column says which, and the summary compares each verify time with the plain decode
time of the same batch. Implementations without verify rows run the K = 0 rows only.

``--kv-dtype fp8`` quantizes the same random K/V to float8_e4m3fn (real = stored x
``KV_SCALES``, clamped into fp8's range) and runs what takes an fp8 cache with a bf16/fp16
query; ``--window W`` gives every decode row keys [len - W, len) only. Implementations
that cannot run a group (its page size, head dim, KV dtype or window) are left out of it,
with the reason (``--list`` shows them). Bandwidth fractions count the bytes the kernel
must read: each KV token once (verify rows too), min(len, W + q_len - 1) tokens per request
under a window, in the cache's element size.

Writes ``<out>/<date>-<gpu>/<tag>.csv`` (one row per measurement, flushed as it goes),
then ``summary.md`` and PNGs over every CSV in that folder (``benchmarks.report``).

    python -m benchmarks.decode_imbalance --quick
    python -m benchmarks.decode_imbalance --T 262144,1048576 --pages 16,1 --out /tmp/res
    python -m benchmarks.decode_imbalance --shape llama3-8b,qwen2.5-7b --quick
    python -m benchmarks.decode_imbalance --quick --kv-dtype fp8 --window 4096
    python -m benchmarks.decode_imbalance --quick --verify 0,3,5,7 --impls 'evenkv-balanced,fa3-*'
    python -m benchmarks.decode_imbalance --list           # implementations and why any is skipped
    python -m benchmarks.decode_imbalance --dry-run ...    # the points a run would measure
"""

import argparse
import dataclasses
import datetime
import fnmatch
import math
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from benchmarks import report
from evenkv.decode_attention import MAX_DECODE_Q_LEN
from benchmarks.peers import MODULES, Batch, Context, Runner, Shape, load, stop_background

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# ----------------------------------------------------------------------------- sweep definition

# Attention geometry per tensor-parallel rank of real models (q heads / KV heads / head_dim).
SHAPES = {s.name: s for s in (
    Shape("qwen3-30b-a3b", 32, 4, 128, "Qwen3-30B-A3B, the seed's shape (G = 8)"),
    Shape("llama3-8b", 32, 8, 128, "Llama-3-8B (G = 4)"),
    Shape("llama3-70b-tp8", 8, 1, 128, "Llama-3-70B (64 q / 8 KV heads) at tensor parallel 8 (G = 8, Hkv = 1)"),
    Shape("qwen2.5-7b", 28, 4, 128, "Qwen2.5-7B (G = 7)"),
    Shape("llama3.2-1b", 32, 8, 64, "Llama-3.2-1B, head_dim 64 (G = 4)"),
    Shape("gpt-oss-20b", 64, 8, 64, "gpt-oss-20b, head_dim 64 (G = 8; sinks, 128-token windows on half the layers)"),
    Shape("qwen3-next-80b-a3b", 16, 2, 256, "Qwen3-Next-80B-A3B full-attention layers, head_dim 256 (G = 8)"),
    Shape("gemma3-12b", 16, 8, 256, "Gemma-3-12B global layers, head_dim 256 (G = 2)"),
)}
DEFAULT_SHAPE = "qwen3-30b-a3b"
DISTS = ("Uniform", "Skewed40", "Skewed60", "Skewed80", "2x40")
T_VALUES = (32768, 262144, 1048576)
B_VALUES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
PAGE_SIZES = (16, 1)
QUICK = {"T": (262144,), "B": (1, 16, 256, 2048), "pages": (16, 1), "max_reps": 15, "plan_reps": 5}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KV_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}  # auto: the KV pool in --dtype
# fp8 pool: stored = real / scale. Powers of two, so the reference's dequantization is exact;
# unequal, so an implementation that swaps K's and V's scale fails its check; sized so that
# N(0, 1) data up to 7 sigma (K) / 14 sigma (V) stays inside fp8's +-448.
KV_SCALES = (2.0 ** -6, 2.0 ** -5)
# evenkv's decode rows take 1 + at most MAX_DECODE_Q_LEN - 1 draft tokens.
MAX_DRAFT_TOKENS = MAX_DECODE_Q_LEN - 1


def dist_lengths(dist: str, total: int, batch: int):
    """KV lengths of one batch: ``batch`` ints >= 1 summing to exactly ``total``, long request(s) first.

    Uniform: total / batch each (the remainder spread one token at a time over the first
    requests). SkewedN: request 0 holds floor(N % of total), the others share the rest
    evenly. 2x40: requests 0 and 1 hold floor(40 %) each. Returns None where the point does
    not exist: fewer tokens than requests, B = 1 for the skewed ones (it is Uniform),
    B <= 2 for 2x40, or a request that would get no token.
    Example: dist_lengths("Skewed80", 100, 4) -> [80, 7, 7, 6].
    """
    if batch < 1 or total < batch:
        return None
    if dist == "Uniform":
        n_long, pct = 0, 0
    elif dist in ("Skewed40", "Skewed60", "Skewed80"):
        n_long, pct = 1, int(dist[len("Skewed"):])
    elif dist == "2x40":
        n_long, pct = 2, 40
    else:
        raise ValueError(f"dist: expected one of {DISTS}, got {dist!r}")
    if batch <= n_long:
        return None
    long = total * pct // 100
    rest, short = total - n_long * long, batch - n_long
    if rest < short or (n_long and long < 1):
        return None
    base, extra = divmod(rest, short)
    return [long] * n_long + [base + 1] * extra + [base] * (short - extra)


def sweep_points(t_values, b_values, dists) -> list:
    """[(T, B, dist, lengths)] in sweep order, skipping points that do not exist."""
    pts = []
    for t in t_values:
        for b in sorted(set(b_values)):
            for d in dists:
                lens = dist_lengths(d, t, b)
                if lens is not None:
                    pts.append((t, b, d, lens))
    return pts


def point_q_lens(lens, q_lens) -> list:
    """The query lengths of ``q_lens`` a batch of requests of ``lens`` tokens can have: each
    request holds its query tokens, so q_len <= the shortest request."""
    return [q for q in q_lens if q <= min(lens)]


def check_points(points) -> list:
    """The few (B, dist) of one T where every implementation is checked against the
    reference: the smallest B, the B nearest 64 with the most skewed distribution there,
    and the largest B with 2x40 (else the most skewed)."""
    if not points:
        return []
    by_b = {}
    for _, b, d, _ in points:
        by_b.setdefault(b, []).append(d)
    pref = ("2x40", "Skewed80", "Skewed60", "Skewed40", "Uniform")

    def pick(b, order):
        return next((d for d in order if d in by_b[b]), by_b[b][0])

    bs = sorted(by_b)
    mid = min(bs, key=lambda b: (abs(math.log2(b / 64)), b))
    chosen = [(bs[0], pick(bs[0], ("Uniform",) + pref)), (mid, pick(mid, pref[1:] + pref[:1])),
              (bs[-1], pick(bs[-1], pref))]
    return list(dict.fromkeys(chosen))


def stable_seed(*parts) -> int:
    """A seed from ``parts`` that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def kv_read_bytes(lens, num_kv_heads: int, head_dim: int, elem_bytes: int, window: int = 0, q_len: int = 1) -> int:
    """Bytes of K and V a decode of requests of ``lens`` tokens must read, each token once
    whatever the query tokens per request (``q_len``): every token without a window, else
    the union of the q_len query tokens' windows, min(len, window + q_len - 1) tokens; Hkv x
    D elements of ``elem_bytes`` each, for K and again for V.
    Example: kv_read_bytes([10, 3], 2, 64, 1, window=4) = 7 x 256; with q_len=2, 8 x 256."""
    tokens = sum(min(n, window + q_len - 1) for n in lens) if window else sum(lens)
    return tokens * num_kv_heads * head_dim * 2 * elem_bytes


def parse_int_list(text: str) -> tuple:
    vals = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        elif part.endswith("m"):
            part, mult = part[:-1], 1024 * 1024
        vals.append(int(part) * mult)
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
    return tuple(vals)


def parse_verify(text: str) -> tuple:
    """``--verify``: draft lengths K (0 = plain decode) -> the query tokens per request, 1 + K,
    sorted. Example: '0,3,5,7' -> (1, 4, 6, 8)."""
    drafts = parse_int_list(text)
    bad = [k for k in drafts if not 0 <= k <= MAX_DRAFT_TOKENS]
    if bad:
        raise argparse.ArgumentTypeError(f"expected draft lengths K in 0..{MAX_DRAFT_TOKENS} (0: plain decode), "
                                         f"got {text!r}")
    return tuple(sorted({1 + k for k in drafts}))


def parse_choice_list(choices):
    def parse(text: str) -> tuple:
        vals = tuple(v.strip() for v in text.split(",") if v.strip())
        if vals == ("all",):
            return tuple(choices)
        bad = [v for v in vals if v not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)} (or 'all'), got {text!r}")
        return vals
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_imbalance", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", type=parse_choice_list(SHAPES), default=(DEFAULT_SHAPE,),
                    help=f"comma list of shapes, or 'all' (default {DEFAULT_SHAPE}): " + ", ".join(
                        f"{s.name} {s.num_q_heads}/{s.num_kv_heads}/{s.head_dim}" for s in SHAPES.values()))
    ap.add_argument("--T", "--tokens", dest="T", type=parse_int_list, default=None,
                    help="total KV tokens per batch, comma list; 256k-style suffixes ok (default 32768,262144,1048576)")
    ap.add_argument("--B", "--batch", dest="B", type=parse_int_list, default=None,
                    help="batch sizes, comma list (default 1,2,4,...,2048 plus 48,96,...,1536)")
    ap.add_argument("--dists", type=parse_choice_list(DISTS), default=DISTS, help="distributions (default all)")
    ap.add_argument("--pages", type=parse_int_list, default=None, help="page sizes (default 16,1)")
    ap.add_argument("--impls", default="default",
                    help="comma list of implementation names or fnmatch patterns ('default' = the default "
                         "variants; e.g. 'evenkv-*,fa3-*'); --list shows them")
    ap.add_argument("--skip", default="", help="comma list of names/patterns to leave out")
    ap.add_argument("--quick", action="store_true",
                    help="small subset (T 262144, B 1,16,256,2048, pages 16,1, <= 15 calls): < 1 min GPU time "
                         "once compiled; explicit --T/--B/--pages still win")
    ap.add_argument("--out", default=str(HERE / "results"), help="results root (default benchmarks/results)")
    ap.add_argument("--tag", default=None, help="CSV name inside the run folder (default quick-/sweep-HHMMSS)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default="auto",
                    help="KV pool dtype: auto = --dtype; fp8 = float8_e4m3fn with per-tensor scales")
    ap.add_argument("--window", type=int, default=0,
                    help="sliding window W: each decode row reads keys [len - W, len) (default 0: none)")
    ap.add_argument("--verify", dest="q_lens", type=parse_verify, default=(1,), metavar="K[,K...]",
                    help="draft tokens per request, comma list: each point runs with q_len = 1 + K query tokens "
                         f"per request (speculative verify; K <= {MAX_DRAFT_TOKENS}); 0 = plain decode (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--max-reps", type=int, default=None, help="timed calls per point at most (default 50)")
    ap.add_argument("--budget-ms", type=float, default=150.0,
                    help="GPU time per measurement that sets the number of calls between the bounds")
    ap.add_argument("--plan-reps", type=int, default=None, help="plan calls timed per point (default 10)")
    ap.add_argument("--flush-mib", type=int, default=256, help="L2 flush buffer written before each timed call")
    ap.add_argument("--copy-mib", type=int, default=1024, help="buffer size of the copy-bandwidth measurement")
    ap.add_argument("--check-rows", type=int, default=8, help="rows compared with the reference per check point")
    ap.add_argument("--no-check", action="store_true", help="skip the reference checks (NaN checks stay)")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="stop measuring after this many seconds and still write the report (0 = none)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--list", action="store_true", help="list implementations and availability, then exit")
    ap.add_argument("--dry-run", action="store_true", help="print the sweep and exit (no GPU needed)")
    return ap


def resolve_args(argv=None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    a.T = a.T or (QUICK["T"] if a.quick else T_VALUES)
    a.B = a.B or (QUICK["B"] if a.quick else B_VALUES)
    a.pages = a.pages or (QUICK["pages"] if a.quick else PAGE_SIZES)
    a.max_reps = a.max_reps or (QUICK["max_reps"] if a.quick else 50)
    a.plan_reps = a.plan_reps or (QUICK["plan_reps"] if a.quick else 10)
    if a.min_reps < 1 or a.max_reps < a.min_reps:
        raise SystemExit(f"--min-reps/--max-reps: expected 1 <= min <= max, got {a.min_reps}/{a.max_reps}")
    if any(p < 1 for p in a.pages) or any(b < 1 for b in a.B) or any(t < 1 for t in a.T):
        raise SystemExit("--T/--B/--pages: expected positive integers")
    if a.window < 0:
        raise SystemExit(f"--window: expected a positive window or 0 (none), got {a.window}")
    a.shapes = [SHAPES[s] for s in a.shape]
    a.impl_patterns = [p.strip() for p in a.impls.split(",") if p.strip()]
    a.skip_patterns = [p.strip() for p in a.skip.split(",") if p.strip()]
    return a


def kv_dtype_name(args) -> str:
    """The KV pool's dtype as the CSV's ``kv_dtype`` column names it (bf16, fp16 or fp8)."""
    return args.dtype if args.kv_dtype == "auto" else args.kv_dtype


def make_context(args, shape, page, device, max_batch=1, max_pages=1, num_sms=1, max_q_len=1) -> Context:
    """The Context of one (shape, page size) group of the run ``args`` describes, for batches
    of up to ``max_q_len`` query tokens per request."""
    return Context(shape, DTYPES[args.dtype], device, page, max_batch, max_pages, 1.0 / math.sqrt(shape.head_dim),
                   num_sms, kv_dtype=KV_DTYPES[args.kv_dtype], window=args.window, max_q_len=max_q_len)


def impl_name(family: str, variant: str) -> str:
    return family if variant == "default" else f"{family}-{variant}"


def selected(name: str, default: bool, patterns, skip) -> bool:
    if any(fnmatch.fnmatchcase(name, p) for p in skip):
        return False
    if "default" in patterns and default:
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in patterns if p != "default")


# ----------------------------------------------------------------------------- environment

def gpu_slug(name: str) -> str:
    s = name.lower().replace("nvidia", "").strip()
    return "".join(c if c.isalnum() else "-" for c in s).strip("-") or "gpu"


def git_version() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) if rev else ""
    except Exception:  # noqa: BLE001
        return ""


def collect_env(device) -> dict:
    import triton
    from benchmarks.peers import module_version
    props = torch.cuda.get_device_properties(device)
    env = {
        "run": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": props.name, "num_sms": props.multi_processor_count, "cc": f"{props.major}.{props.minor}",
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda or "",
        "evenkv": load("evenkv_impl").version(), "evenkv_git": git_version(),
    }
    for key, mod in (("flashinfer", "flashinfer"), ("vllm", "vllm"), ("sglang", "sglang")):
        v = module_version(mod)
        env[key] = f"{key} {v}" if v else f"{key} absent"
    return env


# ----------------------------------------------------------------------------- data

def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as float8_e4m3fn, clamped into its range (a plain cast makes overflow NaN)."""
    fmax = torch.finfo(torch.float8_e4m3fn).max
    return (x / scale).clamp_(-fmax, fmax).to(torch.float8_e4m3fn)


class Pool:
    """The KV pool of one (shape, T, page size): [num_pages, P, Hkv, D] random K and V,
    with room for every batch of the sweep (partial last pages included). With
    ``kv_dtype`` float8_e4m3fn the same random data is stored as ``to_fp8(x, scale)``,
    scales ``KV_SCALES``."""

    def __init__(self, shape, total, page, max_batch, dtype, device, seed, kv_dtype=None):
        self.shape, self.page_size, self.device, self.dtype = shape, page, device, dtype
        self.num_pages = -(-total // page) + (max_batch if page > 1 else 0) + 64
        g = torch.Generator(device=device).manual_seed(seed)
        dims = (self.num_pages, page, shape.num_kv_heads, shape.head_dim)
        self.k = torch.randn(dims, generator=g, device=device, dtype=dtype)
        self.v = torch.randn(dims, generator=g, device=device, dtype=dtype)
        self.k_scale = self.v_scale = 1.0
        if kv_dtype == torch.float8_e4m3fn:
            self.k_scale, self.v_scale = KV_SCALES
            self.k, self.v = to_fp8(self.k, self.k_scale), to_fp8(self.v, self.v_scale)

    def batch(self, lens, seed, q_len=1) -> Batch:
        """A batch over this pool with a fresh random page placement (seeded: the same for
        every q_len) and ``q_len`` query tokens per request (q and out [B * q_len, Hq, D])."""
        if not 1 <= q_len <= min(lens):
            raise ValueError(f"q_len: expected 1 to the shortest request's {min(lens)} tokens (a request holds its "
                             f"query tokens), got {q_len}")
        dev, p, s = self.device, self.page_size, self.shape
        g = torch.Generator(device=dev).manual_seed(seed)
        b = len(lens)
        npages = [-(-n // p) for n in lens]
        total_pages = sum(npages)
        perm = torch.randperm(self.num_pages, generator=g, device=dev)[:total_pages].to(torch.int32)
        indptr = [0]
        for n in npages:
            indptr.append(indptr[-1] + n)
        i32 = dict(dtype=torch.int32, device=dev)
        page_indptr = torch.tensor(indptr, **i32)
        npages_t = torch.tensor(npages, dtype=torch.long, device=dev)
        row = torch.repeat_interleave(torch.arange(b, device=dev), npages_t)
        col = torch.arange(total_pages, device=dev) - page_indptr.long()[row]
        table = torch.zeros(b, max(npages), **i32)
        table[row, col] = perm
        last = torch.tensor([n - (k - 1) * p for n, k in zip(lens, npages)], **i32)
        q = torch.randn(b * q_len, s.num_q_heads, s.head_dim, generator=g, device=dev, dtype=self.dtype)
        out = torch.empty_like(q)
        return Batch(list(lens), torch.tensor(lens, **i32), p, table, page_indptr, perm, last, self.k, self.v, q, out,
                     k_scale=self.k_scale, v_scale=self.v_scale, q_len=q_len)


# ----------------------------------------------------------------------------- correctness

def reference_rows(batch, rows, shape, sm_scale, mem_cap_bytes, window=0) -> dict:
    """{request: fp32 reference} for the sampled requests ``rows``: [Hq, D] for plain decode
    rows, [q_len, Hq, D] for verify rows (``batch.q_len`` > 1: token t at position
    seq_len - q_len + t sees the keys up to it, ``extend_reference``'s causal rule). One KV
    head at a time, over that head's keys gathered out of the pages (the reference expands
    K/V to fp32 per query head, so a whole long request would not fit); requests whose
    per-head working set exceeds ``mem_cap_bytes`` are left out. A token sees its last
    ``window`` keys (all when 0); an fp8 pool is read as stored x scale, which is exact
    (power-of-two scales)."""
    from evenkv.kernels.reference import extend_reference
    g, q_len, dev = shape.group, batch.q_len, batch.q.device
    i32 = dict(dtype=torch.int32, device=dev)
    refs = {}
    for b in rows:
        n = batch.seq_lens_host[b]
        first = max(0, n - q_len + 1 - window) if window else 0  # the first key any of its tokens sees
        keys = n - first
        if 3 * keys * g * shape.head_dim * 4 > mem_cap_bytes:
            continue
        q = batch.q[batch.query_rows(b)]
        # The gathered keys as a cache of one KV head and page size 1: key j in slot j.
        one_request = dict(cu_seqlens_q=torch.tensor([0, q_len], **i32), seq_lens=torch.tensor([keys], **i32),
                           page_table=torch.arange(keys, **i32)[None], page_size=1)
        parts = []
        for h in range(shape.num_kv_heads):
            k, v = (_request_kv(cache[:, h:h + 1], batch.page_table[b], n, batch.page_size, scale)[first:]
                    for cache, scale in ((batch.k_slots, batch.k_scale), (batch.v_slots, batch.v_scale)))
            parts.append(extend_reference(q[:, h * g:(h + 1) * g], k, v, sm_scale=sm_scale,
                                          sliding_window=window or None, **one_request))
        ref = torch.cat(parts, 1)
        refs[b] = ref[0] if q_len == 1 else ref
    return refs


def request_outputs(batch, requests) -> dict:
    """{request: its rows of ``batch.out``}, shaped as ``reference_rows`` gives them."""
    return {b: batch.out[b] if batch.q_len == 1 else batch.out[batch.query_rows(b)] for b in requests}


def _request_kv(cache, page_table_row, seq_len, page_size, scale) -> torch.Tensor:
    """[seq_len, Hkv, D] fp32 of one request from a [num_slots, Hkv, D] cache, x ``scale``.
    An fp8 cache is gathered as bytes: indexing float8 tensors is not implemented everywhere."""
    from evenkv.kernels.reference import gather_request_kv
    if cache.element_size() == 1:
        rows = gather_request_kv(cache.view(torch.uint8), page_table_row, seq_len, page_size).view(cache.dtype)
    else:
        rows = gather_request_kv(cache, page_table_row, seq_len, page_size)
    return rows.float() * scale


def rounding_error(ref, dtype) -> float:
    """Relative L2 error of storing ``ref`` in ``dtype``. For fp8, after scaling ref's
    largest magnitude to fp8's largest, as a per-tensor scale would: fp8's exponent range
    is too narrow for small outputs unscaled (a long decode's are ~1/sqrt(len))."""
    norm = ref.norm().clamp_min(1e-30)
    if dtype == torch.float8_e4m3fn:
        s = torch.finfo(dtype).max / ref.abs().max().clamp_min(1e-30)
        return float(((ref * s).to(dtype).float() / s - ref).norm() / norm)
    return float((ref.to(dtype).float() - ref).norm() / norm)


def compare_rows(out, refs, dtype) -> tuple:
    """(ok, worst relative L2 error, its tolerance) of each request's output ``out[request]``
    against ``refs[request]`` (``request_outputs``, ``reference_rows``). A request passes when
    its error is at most 4x the error of merely rounding the reference to ``dtype`` (measured
    0.0017 for bf16, a bf16-P kernel 0.0023, one 64-token tile missing from 800k tokens
    0.0084). An fp8 run passes fp8 here: its kernels may compute in fp8 (FA3 and XQA quantize
    q and P)."""
    worst, worst_tol, ok = 0.0, 0.0, True
    for b, ref in refs.items():
        o = out[b].float()
        norm = ref.norm().clamp_min(1e-30)
        if not bool(torch.isfinite(o).all()):
            return False, float("inf"), 0.0
        err = float((o - ref).norm() / norm)
        tol = 4.0 * rounding_error(ref, dtype) + 1e-4
        if err / tol > (worst / worst_tol if worst_tol else 0.0):
            worst, worst_tol = err, tol
        ok &= err <= tol
    return ok, worst, worst_tol


def sample_rows(batch_size, k, seed) -> list:
    """Rows 0, 1 (the long ones) and the last, plus random others: at most k."""
    import random
    rows = list(dict.fromkeys(r for r in (0, 1, batch_size - 1) if 0 <= r < batch_size))
    rest = [r for r in range(batch_size) if r not in rows]
    random.Random(seed).shuffle(rest)
    return sorted(rows + rest[: max(0, k - len(rows))])[: max(k, 1)]


# ----------------------------------------------------------------------------- timing

class GpuTimer:
    """CUDA-event timing with an L2 flush before each call and a GPU sleep before each chunk."""

    CHUNK = 20

    def __init__(self, device, flush_mib):
        self.device = device
        self.flush_buf = torch.empty(flush_mib << 20, dtype=torch.uint8, device=device)
        self.cycles_per_us = self._calibrate_sleep()
        self.flush_us = self._time_flush()

    def flush(self):
        self.flush_buf.zero_()  # writes flush_mib MiB: evicts the 50-60 MB L2

    def _calibrate_sleep(self) -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        s.record()
        torch.cuda._sleep(1_000_000)
        e.record()
        torch.cuda.synchronize()
        return 1_000_000 / max(s.elapsed_time(e) * 1000, 1e-3)

    def _time_flush(self) -> float:
        return statistics.median(self.events(self.flush, 10, 0.0, flush=False))

    def sleep_us(self, us):
        torch.cuda._sleep(int(self.cycles_per_us * us))

    def events(self, fn, reps, host_us, flush=True) -> list:
        """GPU µs of ``reps`` calls of ``fn``, each after an L2 flush (if ``flush``)."""
        times = []
        for start in range(0, reps, self.CHUNK):
            n = min(self.CHUNK, reps - start)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            torch.cuda.synchronize()
            # Let the host enqueue the whole chunk before the GPU reaches it, so the
            # launch overhead of Python-heavy wrappers never shows up between the events.
            self.sleep_us(min(20_000.0, n * (host_us + 30.0)))
            for s, e in ev:
                if flush:
                    self.flush()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            times += [s.elapsed_time(e) * 1000.0 for s, e in ev]
        return times

    def host_plan(self, fn, reps) -> float:
        """Median host µs of fn() + synchronize."""
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)


def copy_bandwidth(device, mib=1024, reps=20) -> float:
    """Device-to-device copy bandwidth in TB/s, read + write counted (as the anchors)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for s, e in ev:
        s.record()
        dst.copy_(src)
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in ev)
    del src, dst
    return 2 * (mib << 20) / (ms * 1e-3) / 1e12


def quantile(sorted_vals, q) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


# ----------------------------------------------------------------------------- the run

class Impl:
    def __init__(self, module, family, variant, default):
        self.module, self.family, self.variant, self.default = module, family, variant, default
        self.name = impl_name(family, variant)
        self.version = ""
        self.unsupported = {}  # (shape name, page size, q_len) -> why it does not run those rows

    def runs(self, shape_name: str, page: int, q_len: int) -> bool:
        return (shape_name, page, q_len) not in self.unsupported

    def runs_any(self, shape_name: str, page: int, q_lens) -> bool:
        return any(self.runs(shape_name, page, q) for q in q_lens)


def unsupported_groups(mod, args, device) -> dict:
    """{(shape name, page size, q_len): reason} for the rows of the run that ``mod`` cannot run."""
    supports = getattr(mod, "supports", None)
    if supports is None:
        return {}
    out = {}
    for shape in args.shapes:
        for page in args.pages:
            for q_len in args.q_lens:
                reason = supports(make_context(args, shape, page, device, max_q_len=q_len))
                if reason:
                    out[(shape.name, page, q_len)] = reason
    return out


def unsupported_notes(it, q_lens) -> list:
    """One line per (shape, page size, reason) that ``it`` does not run, naming the query
    lengths where the run has verify rows."""
    by_reason = {}
    for (shape, page, q_len), why in it.unsupported.items():
        by_reason.setdefault((shape, page, why), []).append(q_len)
    notes = []
    for (shape, page, why), qs in by_reason.items():
        where = f"{shape} page {page}" + (f" q_len {', '.join(map(str, sorted(qs)))}" if max(q_lens) > 1 else "")
        notes.append(f"{it.name} not run for {where}: {why}")
    return notes


def discover(args, device, quiet=False) -> tuple:
    """(selected Impls, [(family, reason)] skipped): a family is skipped where it cannot run
    here at all, or none of the run's (shape, page size, q_len) rows."""
    probe = make_context(args, args.shapes[0], 16, device)
    impls, skipped = [], []
    for modname in MODULES:
        mod = load(modname)
        ok, why = mod.available()
        if not ok:
            skipped.append((mod.FAMILY, why))
            continue
        try:
            unsupported = unsupported_groups(mod, args, device)
            variants = mod.variants(probe)
        except Exception as e:  # noqa: BLE001
            skipped.append((mod.FAMILY, f"{type(e).__name__}: {e}"))
            continue
        if len(unsupported) == len(args.shapes) * len(args.pages) * len(args.q_lens):
            skipped.append((mod.FAMILY, "; ".join(dict.fromkeys(unsupported.values()))))
            continue
        version = mod.version()
        for variant, default in variants:
            it = Impl(modname, mod.FAMILY, variant, default)
            it.version = version
            it.unsupported = unsupported
            if selected(it.name, default, args.impl_patterns, args.skip_patterns):
                impls.append(it)
    if not quiet:
        for fam, why in skipped:
            print(f"[bench] skip {fam}: {why}", flush=True)
    return impls, skipped


def run_once(runner, batch) -> None:
    """Prepare, plan and run once into a NaN-filled output (a row left unwritten shows)."""
    runner.prepare(batch)
    runner.plan()
    batch.out.fill_(float("nan"))
    runner.run()
    torch.cuda.synchronize()


class Stop(Exception):
    pass


class Bench:
    def __init__(self, args, device=None):
        self.args = args
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.dtype = DTYPES[args.dtype]
        self.kv_elem_bytes = (KV_DTYPES[args.kv_dtype] or self.dtype).itemsize
        self.env = collect_env(self.device)
        self.t_start = time.time()
        self.stop_reason = ""
        self.notes = []
        self.fatal = False

    # -- helpers ----------------------------------------------------------------
    def check_time(self):
        if self.stop_reason:
            raise Stop(self.stop_reason)
        if self.args.time_limit and time.time() - self.t_start > self.args.time_limit:
            self.stop_reason = f"--time-limit {self.args.time_limit:.0f}s reached"
            raise Stop(self.stop_reason)

    def write(self, row):
        full = {c: "" for c in report.COLUMNS}
        full.update(self.env)
        full.update({k: v for k, v in row.items() if k in full})
        self.writer.writerow([full[c] for c in report.COLUMNS])
        self.csv_file.flush()

    def base_row(self, shape, total, page, b, dist, lens, it, q_len=1):
        kv_bytes = kv_read_bytes(lens, shape.num_kv_heads, shape.head_dim, self.kv_elem_bytes, self.args.window,
                                 q_len)
        return {"shape": shape.name, "hq": shape.num_q_heads, "hkv": shape.num_kv_heads,
                "head_dim": shape.head_dim, "dtype": self.args.dtype, "kv_dtype": kv_dtype_name(self.args),
                "window": self.args.window, "T": total, "B": b, "dist": dist, "q_len": q_len,
                "page": page, "max_len": max(lens), "min_len": min(lens), "name": it.name, "impl": it.family,
                "variant": it.variant, "impl_version": it.version, "kv_bytes": kv_bytes,
                "copy_rw_tbps": f"{self.copy_tbps:.4f}"}

    def handle_error(self, e) -> str:
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        elif "CUDA error" in str(e) or "illegal memory access" in str(e) or "device-side assert" in str(e):
            self.fatal = True  # the context is gone: every later CUDA call would fail
            self.stop_reason = f"CUDA context lost ({msg})"
        return msg

    # -- one (shape, T, page) ----------------------------------------------------
    def run_group(self, shape, total, page, points, impls, bar):
        a = self.args
        max_batch = max(b for _, b, _, _ in points)
        max_pages = max(-(-max(lens) // page) for _, _, _, lens in points)
        ctx = make_context(a, shape, page, self.device, max_batch, max_pages, self.env["num_sms"])
        sm_scale = ctx.sm_scale
        seed = stable_seed(a.seed, shape.name, total, page)
        pool = Pool(shape, total, page, max_batch, self.dtype, self.device, seed, ctx.kv_dtype)
        # fp8 kernels may compute in fp8: their check tolerance follows the cache's dtype
        tol_dtype = ctx.cache_dtype if ctx.kv_fp8 else self.dtype
        runners = {}  # name -> Runner
        bad = {}  # (name, q_len) -> (status, detail); (name, None): the whole group
        for it in impls:
            max_q_len = max(q for q in a.q_lens if it.runs(shape.name, page, q))
            try:
                runners[it.name] = load(it.module).make(it.variant, dataclasses.replace(ctx, max_q_len=max_q_len))
            except Exception as e:  # noqa: BLE001
                bad[(it.name, None)] = ("error", "setup: " + self.handle_error(e))
                if self.fatal:
                    raise Stop(self.stop_reason)

        def failed(name, q_len):
            return bad.get((name, q_len)) or bad.get((name, None))

        point_seed = {(b, d): stable_seed(seed, b, d) for _, b, d, _ in points}
        lens_of = {(b, d): lens for _, b, d, lens in points}
        check_err = {}  # (name, B, dist, q_len) -> (error, tolerance, failure)

        # correctness first: an implementation wrong at one q_len is not timed at it in this group
        if not a.no_check:
            for b, d in check_points(points):
                for q_len in point_q_lens(lens_of[(b, d)], a.q_lens):
                    self.check_time()
                    here = [it for it in impls if it.runs(shape.name, page, q_len) and not failed(it.name, q_len)]
                    if not here:
                        continue
                    batch = pool.batch(lens_of[(b, d)], point_seed[(b, d)], q_len)
                    rows = sample_rows(b, a.check_rows, point_seed[(b, d)])
                    refs = reference_rows(batch, rows, shape, sm_scale, mem_cap_bytes=12 << 30, window=a.window)
                    at = f"B={b} {d}" + (f" q_len={q_len}" if q_len > 1 else "")
                    for it in here:
                        try:
                            run_once(runners[it.name], batch)
                            ok, err, tol = compare_rows(request_outputs(batch, refs), refs, tol_dtype)
                        except Exception as e:  # noqa: BLE001
                            msg = self.handle_error(e)
                            if self.fatal:
                                raise Stop(self.stop_reason)
                            check_err[(it.name, b, d, q_len)] = ("", "", f"check run failed: {msg}")
                            continue
                        check_err[(it.name, b, d, q_len)] = (f"{err:.3g}", f"{tol:.3g}", "")
                        if not ok:
                            bad[(it.name, q_len)] = ("wrong", f"reference check failed at {at}: rel err {err:.3g} > "
                                                              f"tol {tol:.3g} (rows {sorted(refs)})")
                            print(f"\n[bench] WRONG {it.name} {shape.name} T={total} page {page}: "
                                  f"{bad[(it.name, q_len)][1]}", flush=True)
                    del batch, refs
            torch.cuda.empty_cache()

        for _, b, d, lens in points:
            for q_len in point_q_lens(lens, a.q_lens):
                here = [it for it in impls if it.runs(shape.name, page, q_len)]
                if not here:
                    continue
                self.check_time()
                batch = pool.batch(lens, point_seed[(b, d)], q_len)
                for it in here:
                    bar.set_description(f"{shape.name} T={total} p{page} B={b} {d} q{q_len} {it.name}"[:70])
                    row = self.base_row(shape, total, page, b, d, lens, it, q_len)
                    ce = check_err.get((it.name, b, d, q_len))
                    if ce:
                        row["check_err"], row["check_tol"] = ce[0], ce[1]
                    if failed(it.name, q_len):
                        row["status"], row["detail"] = failed(it.name, q_len)
                    else:
                        row.update(self.measure(runners[it.name], batch))
                        if ce and ce[2]:
                            row["detail"] = (row.get("detail", "") + "; " + ce[2]).strip("; ")
                    self.write(row)
                    bar.update(1)
                    if self.fatal:
                        raise Stop(self.stop_reason)
                del batch
            if b * max(lens) // page > (64 << 20):  # a big padded page table: give it back
                torch.cuda.empty_cache()
        del pool, runners
        torch.cuda.empty_cache()

    def measure(self, runner, batch) -> dict:
        a, timer = self.args, self.timer

        def row(**fields):  # read after prepare: a runner's config may depend on the batch
            return {"config": runner.config, "config_detail": getattr(runner, "config_repr", ""), **fields}
        try:
            run_once(runner, batch)
            if not bool(torch.isfinite(batch.out).all()):
                return row(status="wrong", detail="non-finite output (NaN-filled output not written?)")
            t0 = time.perf_counter()
            runner.run()
            host_us = (time.perf_counter() - t0) * 1e6
            torch.cuda.synchronize()
            est = timer.events(runner.run, 1, host_us)[0]
            reps = int(a.budget_ms * 1000 / (est + timer.flush_us + 5))
            reps = max(a.min_reps, min(a.max_reps, reps))
            times = sorted(timer.events(runner.run, reps, host_us))
            plan_dev = plan_host = ""
            if type(runner).plan is not Runner.plan:  # it has a plan step
                # The host time first: the GPU sleep ahead of the timed plans must cover their
                # enqueue, or the host's launch latency lands between the events.
                host_plan_us = timer.host_plan(runner.plan, a.plan_reps)
                plan_dev = f"{statistics.median(timer.events(runner.plan, a.plan_reps, host_plan_us, flush=False)):.2f}"
                plan_host = f"{host_plan_us:.2f}"
            detail = runner.describe()
        except Exception as e:  # noqa: BLE001
            return row(status="error", detail=self.handle_error(e))
        med = statistics.median(times)
        kvp = batch.k_pages
        kv_bytes = kv_read_bytes(batch.seq_lens_host, kvp.shape[2], kvp.shape[3], kvp.element_size(), a.window,
                                 batch.q_len)
        gbps = kv_bytes / (med * 1e-6) / 1e9
        return row(status="ok", detail=detail if detail != runner.config else "", us_med=f"{med:.2f}",
                   us_p20=f"{quantile(times, 0.2):.2f}", us_p80=f"{quantile(times, 0.8):.2f}",
                   us_min=f"{times[0]:.2f}", n_rep=len(times), plan_dev_us=plan_dev, plan_host_us=plan_host,
                   launch_host_us=f"{host_us:.1f}", gbps=f"{gbps:.1f}",
                   frac_copy=f"{gbps / (self.copy_tbps * 1000):.4f}")

    # -- whole run ---------------------------------------------------------------
    def start_prebuilds(self, impls) -> list:
        """Start the background JIT builds of every (implementation, group, q_len) the run will
        measure, where the adapter offers them; what was started."""
        a, started = self.args, []
        for it in impls:
            prebuild = getattr(load(it.module), "prebuild", None)
            if prebuild is None:
                continue
            for shape in a.shapes:
                for page in a.pages:
                    for q_len in a.q_lens:
                        if it.runs(shape.name, page, q_len):
                            ctx = make_context(a, shape, page, self.device, max_batch=max(a.B), max_q_len=q_len)
                            started += prebuild(it.variant, ctx)
        return started

    def run(self, impls) -> str:
        import csv
        a = self.args
        run_dir = Path(a.out) / f"{datetime.date.today().isoformat()}-{gpu_slug(self.env['gpu'])}"
        run_dir.mkdir(parents=True, exist_ok=True)
        tag = a.tag or f"{'quick' if a.quick else 'sweep'}-{datetime.datetime.now().strftime('%H%M%S')}"
        csv_path = run_dir / f"{tag}.csv"
        print(f"[bench] {self.env['gpu']} ({self.env['num_sms']} SMs), torch {self.env['torch']}, triton "
              f"{self.env['triton']}; evenkv {self.env['evenkv']} {self.env['evenkv_git']}; "
              f"{self.env['flashinfer']}, {self.env['vllm']}, {self.env['sglang']}", flush=True)
        print(f"[bench] implementations: {', '.join(i.name for i in impls)}", flush=True)
        started = self.start_prebuilds(impls)
        if started:
            print(f"[bench] JIT builds in the background: {', '.join(started)}", flush=True)
        self.timer = GpuTimer(self.device, a.flush_mib)
        self.copy_tbps = copy_bandwidth(self.device, a.copy_mib)
        print(f"[bench] copy bandwidth {self.copy_tbps:.3f} TB/s (read + write); L2 flush {self.timer.flush_us:.0f} "
              f"µs; CSV {csv_path}", flush=True)
        groups = []
        for shape in a.shapes:
            for total in a.T:
                pts = sweep_points((total,), a.B, a.dists)
                for page in a.pages:
                    here = [i for i in impls if i.runs_any(shape.name, page, a.q_lens)]
                    if pts and here:
                        groups.append((shape, total, page, pts, here))
        for i in impls:
            self.notes += unsupported_notes(i, a.q_lens)
        n_meas = sum(count_measurements(shape, page, pts, here, a.q_lens) for shape, _, page, pts, here in groups)
        with open(csv_path, "w", newline="") as f:
            self.csv_file, self.writer = f, csv.writer(f)
            self.writer.writerow(report.COLUMNS)
            f.flush()
            bar = progress(n_meas)
            try:
                for shape, total, page, pts, here in groups:
                    self.run_group(shape, total, page, pts, here, bar)
            except Stop as e:
                print(f"\n[bench] stopped early: {e}", flush=True)
                self.notes.append(f"Run stopped early: {e}")
            finally:
                bar.close()
                stop_background()
        if not self.fatal:
            end_bw = copy_bandwidth(self.device, a.copy_mib)
            self.notes.append(f"Copy bandwidth at the start / end of {tag}: {self.copy_tbps:.3f} / {end_bw:.3f} TB/s")
        res = report.generate([str(run_dir)], str(run_dir), notes=self.notes, plots=not a.no_plots)
        print(f"[bench] wrote {csv_path}, {res['summary']} and {len(res['pngs'])} PNG "
              f"({time.time() - self.t_start:.0f} s)", flush=True)
        print(f"[bench] evenkv-balanced: {report.format_headline(res['headline'])}", flush=True)
        return str(run_dir)


def progress(total):
    """tqdm over the measurements; updates every 30 s when stderr is not a terminal (a
    captured log stays short), a plain printer when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total)
    tty = sys.stderr.isatty()
    return tqdm(total=total, unit="meas", dynamic_ncols=tty, ncols=None if tty else 100,
                mininterval=2.0 if tty else 30.0, file=sys.stderr)


class _PlainProgress:
    """tqdm stand-in (the GPU image may lack tqdm): a line every 30 s."""

    def __init__(self, total):
        self.total, self.n, self.t0, self.last, self.desc = total, 0, time.time(), 0.0, ""

    def set_description(self, d):
        self.desc = d

    def update(self, k):
        self.n += k
        if time.time() - self.last > 30:
            self.last = time.time()
            print(f"[bench] {self.n}/{self.total} measurements, {time.time() - self.t0:.0f}s: {self.desc}",
                  file=sys.stderr, flush=True)

    def close(self):
        print(f"[bench] {self.n}/{self.total} measurements in {time.time() - self.t0:.0f}s", file=sys.stderr,
              flush=True)


def count_measurements(shape, page, points, impls, q_lens) -> int:
    """Rows one (shape, T, page) group of ``points`` writes: one per (point, q_len it can
    have, implementation that runs that q_len)."""
    return sum(it.runs(shape.name, page, q) for _, _, _, lens in points for q in point_q_lens(lens, q_lens)
               for it in impls)


def dry_run(args) -> int:
    impls, skipped = discover(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"), quiet=True)
    total = n_meas = 0
    for shape in args.shapes:
        for t in args.T:
            pts = sweep_points((t,), args.B, args.dists)
            for page in args.pages:
                total += len(pts)
                n_meas += count_measurements(shape, page, pts, impls, args.q_lens)
                verify = ""
                if max(args.q_lens) > 1:
                    batches = sum(len(point_q_lens(lens, args.q_lens)) for _, _, _, lens in pts)
                    verify = f" x q_len {', '.join(map(str, args.q_lens))}: {batches} batches;"
                print(f"{shape.name} {shape.num_q_heads}/{shape.num_kv_heads}/{shape.head_dim} T={t} page {page}: "
                      f"{len(pts)} points,{verify} checks at {check_points(pts)}")
    print(f"{total} points, {len(impls)} implementations: {n_meas} measurements")
    print("implementations: " + (", ".join(i.name for i in impls) or "none available here"))
    for fam, why in skipped:
        print(f"skipped {fam}: {why}")
    return 0


def list_impls(args) -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impls, skipped = discover(args, dev, quiet=True)
    chosen = {i.name for i in impls}
    args2 = argparse.Namespace(**{**vars(args), "impl_patterns": ["*"], "skip_patterns": []})
    every, _ = discover(args2, dev, quiet=True)
    for i in every:
        kind, chosen_mark = "default" if i.default else "extra  ", "selected" if i.name in chosen else " " * 8
        print(f"{i.name:28s} {kind} {chosen_mark}  {i.version}")
        for note in unsupported_notes(i, args.q_lens):
            print(f"{'':28s}   {note[len(i.name) + 1:]}")
    for fam, why in skipped:
        print(f"{fam:28s} unavailable: {why}")
    return 0


def main(argv=None) -> int:
    args = resolve_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.list:
        return list_impls(args)
    if not torch.cuda.is_available():
        print("[bench] no CUDA device: the benchmark times GPU kernels. Use --dry-run to see the sweep, or "
              "`python -m evenkv demo` for a CPU (Triton interpreter) correctness demo.", file=sys.stderr)
        return 2
    impls, _ = discover(args, torch.device("cuda"))
    if not impls:
        print("[bench] no implementation selected/available", file=sys.stderr)
        return 2
    bench = Bench(args)

    def on_term(signum, frame):  # a time-limited caller: stop measuring, still write the report
        bench.stop_reason = f"signal {signum}"
    signal.signal(signal.SIGTERM, on_term)
    run_dir = bench.run(impls)
    print(f"[bench] results in {run_dir}", flush=True)
    return 3 if bench.fatal else 0


if __name__ == "__main__":
    sys.exit(main())
