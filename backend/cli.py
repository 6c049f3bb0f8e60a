"""The ``evenkv`` command.

    evenkv bench [ARGS...]   the decode-imbalance benchmark (benchmarks/decode_imbalance.py;
                             ``evenkv bench --help`` lists its options). Needs the repo checkout.
    evenkv demo [--cpu] [--out DIR]
                             on a GPU: the ``--quick`` benchmark, then where its results went;
                             without one (or with --cpu): a tiny decode under the Triton
                             interpreter, every policy checked against the fp32 reference.

``python -m evenkv.bench ARGS...`` is ``evenkv bench ARGS...``.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

BENCH_RELPATH = Path("benchmarks") / "decode_imbalance.py"


def find_benchmark() -> Path:
    """benchmarks/decode_imbalance.py of the checkout evenkv was installed from (editable)."""
    root = Path(__file__).resolve().parent.parent  # backend/ -> the repo root
    script = root / BENCH_RELPATH
    if not script.exists():
        raise SystemExit(
            f"evenkv bench: {BENCH_RELPATH} not found next to {Path(__file__).resolve().parent}. The benchmark "
            "(and its peer adapters) ships with the repository, not with the package: clone the evenkv repo and "
            "either `pip install -e .` there or run `python benchmarks/decode_imbalance.py` from it.")
    return script


def load_benchmark():
    """Import benchmarks/decode_imbalance.py by path (its folder is not a package)."""
    script = find_benchmark()
    name = "evenkv_decode_imbalance"
    if name in sys.modules:
        return sys.modules[name]
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_bench(argv) -> int:
    return load_benchmark().main(list(argv))


# ----------------------------------------------------------------------------- demo

DEMO_SHAPE = (8, 2, 64)          # Hq, Hkv, D: G = 4
DEMO_LENS = (100, 7, 1, 33)      # one long request among short ones, a 1-token one
DEMO_PAGES = (16, 1)


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_demo() -> int:
    """Tiny paged decode on the CPU under the Triton interpreter: each policy and arch
    table vs the fp32 reference. Correctness only; the interpreter's speed means nothing."""
    import math
    import warnings

    import torch

    import evenkv
    from evenkv.kernels.reference import decode_reference

    print("evenkv demo: Triton INTERPRETER on the CPU (TRITON_INTERPRET=1). This checks results only; "
          "timings here have no performance meaning. Run `evenkv demo` on a GPU for the benchmark.", flush=True)
    # The interpreter evaluates masked lanes too (-inf - -inf): numpy warns, the result is right.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\..*")
    hq, hkv, d = DEMO_SHAPE
    dtype, dev = torch.float16, torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(DEMO_LENS), hq, d, generator=g).to(dtype)
    failures = 0
    print(f"shape {hq} q / {hkv} kv heads, head_dim {d}, fp16, kv lens {list(DEMO_LENS)}", flush=True)
    print(f"{'page':>4} {'policy':9} {'arch':5} {'max|err|':>9} {'rel err':>9}  result", flush=True)
    for page in DEMO_PAGES:
        npages = [-(-n // page) for n in DEMO_LENS]
        num_pages = sum(npages) + 3
        k = torch.randn(num_pages * page, hkv, d, generator=g).to(dtype)
        v = torch.randn(num_pages * page, hkv, d, generator=g).to(dtype)
        perm = torch.randperm(num_pages, generator=g).to(torch.int32)
        table = torch.zeros(len(DEMO_LENS), max(npages), dtype=torch.int32)
        used = 0
        for i, n in enumerate(npages):
            table[i, :n] = perm[used:used + n]
            used += n
        seq_lens = torch.tensor(DEMO_LENS, dtype=torch.int32)
        ref = decode_reference(q, k, v, seq_lens, table, page)
        arch = "sm90" if page == DEMO_PAGES[0] else "sm80"  # both config tables, one run per policy and page
        for policy in evenkv.POLICIES:
            attn = evenkv.DecodeAttention(hq, hkv, d, page, dtype, dev, len(DEMO_LENS), max(npages), policy,
                                          arch=arch)
            attn.plan(seq_lens, table)
            out = attn.run(q, k, v).float()
            err = (out - ref).abs().max().item()
            rel = ((out - ref).norm() / ref.norm()).item()
            # fp16 output rounding alone gives ~5e-4 relative; 1e-2 flags real errors only
            ok = math.isfinite(rel) and rel < 1e-2
            failures += not ok
            print(f"{page:>4} {policy:9} {arch:5} {err:9.2e} {rel:9.2e}  {'ok' if ok else 'WRONG'}", flush=True)
    print(f"DEMO {'PASS' if not failures else 'FAIL'} (interpreter, {len(DEMO_PAGES) * len(evenkv.POLICIES)} "
          f"runs, {failures} wrong)", flush=True)
    return 1 if failures else 0


def demo(args) -> int:
    import torch
    if not args.cpu and torch.cuda.is_available() and not _interpreter_on():
        bench = load_benchmark()
        out = args.out or str(Path(bench.__file__).resolve().parent / "results")
        rc = bench.main(["--quick", "--out", out])
        print(f"evenkv demo: quick benchmark finished (rc {rc}); results under {out} "
              "(<date>-<gpu>/: CSV, summary.md, PNGs)", flush=True)
        return rc
    if not _interpreter_on():
        # Triton reads TRITON_INTERPRET when kernels are defined, i.e. on import, and
        # evenkv's kernels are already imported here: re-run in a fresh interpreter process.
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call([sys.executable, "-m", "evenkv.cli", "demo", "--cpu"], env=env)
    return interpreter_demo()


# ----------------------------------------------------------------------------- entry

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evenkv", description="evenkv: balanced decode attention",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="the decode-imbalance benchmark (args go to it; see `evenkv bench --help`)",
                       add_help=False)
    b.add_argument("args", nargs=argparse.REMAINDER)
    d = sub.add_parser("demo", help="quick benchmark on a GPU, interpreter correctness demo without one")
    d.add_argument("--cpu", action="store_true", help="the interpreter demo even if a GPU is present")
    d.add_argument("--out", default=None, help="results root for the GPU demo (default benchmarks/results)")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # pass everything after "bench" through untouched (incl. --help)
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return demo(args)
    return run_bench(args.args)


if __name__ == "__main__":
    sys.exit(main())
