"""``python -m evenkv`` (or the ``evenkv`` command).

    evenkv demo [--cpu]   on a GPU: one skewed and one uniform batch of 256K tokens,
                          checked against the fp32 reference and timed (cold L2), as a
                          fraction of the device-to-device copy bandwidth measured here;
                          without one (or with --cpu): a tiny decode under the Triton
                          interpreter, every policy and arch table checked, no timing.
    evenkv info           versions, the device, and the configs evenkv would run there.

The benchmarks against FA3, FlashInfer and the engines' kernels live in the repository's
``benchmarks/`` (``python -m benchmarks.decode_imbalance --help``).
"""

import argparse
import os
import subprocess
import sys

DEMO_SHAPE = (8, 2, 64)          # Hq, Hkv, D: G = 4
DEMO_LENS = (100, 7, 1, 33, 0)   # one long request among short ones, a 1-token one, a padding row
DEMO_PAGES = (16, 1)
GPU_SHAPE = (32, 4, 128)         # Qwen3-30B-A3B attention
GPU_TOKENS = 262144
GPU_BATCHES = {"Uniform, B = 256": [GPU_TOKENS // 256] * 256,
               "Skewed80, B = 256": [GPU_TOKENS * 4 // 5] + [GPU_TOKENS // 5 // 255] * 255}


def interpreter_demo() -> int:
    """Tiny paged decode on the CPU under the Triton interpreter: each policy and arch
    table against the fp32 reference. Correctness only: the interpreter's speed means nothing."""
    import torch

    import evenkv
    from evenkv.kernels.reference import decode_reference
    from evenkv.testing import random_paged_batch

    print("evenkv demo: Triton INTERPRETER on the CPU (TRITON_INTERPRET=1). It checks results only; "
          "timings here have no performance meaning. Run it on a GPU for speed.", flush=True)
    hq, hkv, d = DEMO_SHAPE
    failures = 0
    print(f"shape {hq} q / {hkv} kv heads, head_dim {d}, kv lens {list(DEMO_LENS)}", flush=True)
    print(f"{'page':>4} {'dtype':8} {'policy':9} {'arch':5} {'max|err|':>9} {'allowed':>9}  result", flush=True)
    for page in DEMO_PAGES:
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v, seq_lens, table = random_paged_batch(DEMO_LENS, hq, hkv, d, page, dtype, "cpu", seed=page)
            ref = decode_reference(q, k, v, seq_lens, table, page)
            allowed = evenkv.testing.tolerance(ref, ref.to(dtype), dtype)
            arch = "sm90" if dtype == torch.float16 else "sm80"  # both config tables
            for policy in evenkv.POLICIES:
                out = evenkv.decode(q, k, v, seq_lens, table, page, policy=policy, arch=arch)
                err = evenkv.testing.max_error(out, ref)
                ok = err <= allowed
                failures += not ok
                print(f"{page:>4} {str(dtype)[6:]:8} {policy:9} {arch:5} {err:9.2e} {allowed:9.2e}  "
                      f"{'ok' if ok else 'WRONG'}", flush=True)
    runs = len(DEMO_PAGES) * 2 * len(evenkv.POLICIES)
    print(f"DEMO {'PASS' if not failures else 'FAIL'} (interpreter, {runs} runs, {failures} wrong)", flush=True)
    return 1 if failures else 0


def gpu_demo() -> int:
    """Two 256K-token batches on this GPU: checked on sampled rows, then timed."""
    import torch
    import triton.testing

    import evenkv
    from evenkv.kernels.reference import decode_reference
    from evenkv.testing import max_error, random_paged_batch, tolerance

    dev, (hq, hkv, d), page = torch.device("cuda"), GPU_SHAPE, 16
    copy_src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), rep=200)
    copy_bw = 2 * copy_src.numel() / (copy_ms * 1e-3)
    print(f"evenkv demo on {torch.cuda.get_device_name(dev)}: {hq} q / {hkv} kv heads, head_dim {d}, bf16, "
          f"page {page}, {GPU_TOKENS} KV tokens; copy bandwidth here {copy_bw / 1e12:.2f} TB/s", flush=True)
    failures = 0
    for name, lens in GPU_BATCHES.items():
        q, k, v, seq_lens, table = random_paged_batch(lens, hq, hkv, d, page, torch.bfloat16, dev)
        attn = evenkv.DecodeAttention(hq, hkv, d, page, torch.bfloat16, dev, len(lens), table.shape[1])
        plan = attn.plan(seq_lens, table)
        out = attn.run(plan, q, k, v)
        rows = [0, 1, len(lens) - 1]
        ref = decode_reference(q[rows], k, v, seq_lens[rows], table[rows], page)
        ok = max_error(out[rows], ref) <= tolerance(ref, ref.to(torch.bfloat16), torch.bfloat16)
        failures += not ok
        ms = triton.testing.do_bench(lambda: attn.run(plan, q, k, v, out=out), rep=200)
        kv_bytes = 2 * GPU_TOKENS * hkv * d * 2
        print(f"  {name:18} {ms * 1e3:8.1f} us  {kv_bytes / (ms * 1e-3) / copy_bw:6.1%} of copy bandwidth  "
              f"{'ok' if ok else 'WRONG'}", flush=True)
    return 1 if failures else 0


def info() -> int:
    import torch
    import triton

    import evenkv
    from evenkv.configs import decode_config, extend_config, is_interpreter, many_segments_config, resolve_arch

    on_gpu = torch.cuda.is_available() and not is_interpreter()
    device = torch.device("cuda" if on_gpu else "cpu")
    arch = resolve_arch(None, device)
    print(f"evenkv {evenkv.__version__}, torch {torch.__version__}, triton {triton.__version__}")
    where = (torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter)" if is_interpreter()
             else "CPU without TRITON_INTERPRET=1 (evenkv's kernels cannot run here)")
    print(f"device: {where}; config table {arch}")
    for d in (64, 128, 256):
        for page in (1, 16):
            many = many_segments_config(arch, d, page)
            print(f"  head_dim {d:3} page {page:2}: decode {decode_config(arch, d, page).name}"
                  f"{', many segments ' + many.name if many else ''}; extend {extend_config(arch, d, 4, 1 << 20).name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evenkv", description="evenkv: balanced paged attention",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command")
    d = sub.add_parser("demo", help="check and time on a GPU; interpreter correctness demo without one")
    d.add_argument("--cpu", action="store_true", help="the interpreter demo even if a GPU is present")
    sub.add_parser("info", help="versions, device and configs")
    return ap


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no subcommand: the help, and argparse's usage-error status
        parser.print_help(sys.stderr)
        return 2
    if args.command == "info":
        return info()
    import torch

    from evenkv.configs import is_interpreter

    if not args.cpu and torch.cuda.is_available() and not is_interpreter():
        return gpu_demo()
    if not is_interpreter():
        # Triton reads TRITON_INTERPRET when kernels are defined, i.e. on import, and
        # evenkv's kernels are already imported here: re-run in a fresh process.
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call([sys.executable, "-m", "evenkv", "demo", "--cpu"], env=env)
    return interpreter_demo()


if __name__ == "__main__":
    sys.exit(main())
