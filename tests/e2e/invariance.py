#!/usr/bin/env python3
"""Batch and chunking invariance end to end (GPU machine; tests/e2e/vllm.sh and sglang.sh run it):
one prompt's greedy tokens and logprobs must be bitwise the same whatever else is in the batch
and however its prefill is cut into chunks, with the engine in its batch-invariant mode
(vLLM ``VLLM_BATCH_INVARIANT=1``, SGLang ``enable_deterministic_inference``).

    python tests/e2e/invariance.py MODEL_DIR [--engine vllm|sglang] [--backend evenkv|default|NAME]
                                   [--graphs 0|1] [--target-len 1500] [--others 63] [--chunk 97]

Four runs of the same target prompt (random token ids, --new greedy tokens with logprobs):
  alone          the target alone, its prefill in one step
  batch          the target second among --others prompts of 5 to --other-max tokens (all
                 prefilled without chunking, then decoding together: a batch of others + 1)
  chunked-batch  the same batch with a prefill budget of --chunk tokens per step (vLLM
                 ``max_num_batched_tokens``, SGLang ``chunked_prefill_size``): the target's
                 prefill is cut into chunks whose sizes and boundaries depend on its neighbours
  chunked-alone  the target alone with that budget (chunks of --chunk tokens)
The first two share one engine, the last two another (one child process each, as an engine's
chunk budget is fixed when it starts). Every run's target tokens and logprobs must equal the
``alone`` run's bit for bit. Prints ``RESULT invariance ... ok=1|0`` and, per differing run,
the first position where tokens or logprobs differ.

``--backend default`` is the engine's Hopper default (vLLM ``FLASH_ATTN``, SGLang ``fa3``),
to see whether it is invariant too; ``--no-deterministic`` runs the engine in its default
mode. Engine options (CUDA graphs, native ops) are compare.py's.

Exit status: 0 ok=1, 1 a run differs, 3 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402  (the engine builders and runners shared with the comparison harness)

RUNS = ("alone", "batch", "chunked-batch", "chunked-alone")
TARGET_INDEX = 1  # the target sits after one short prompt, so a chunk budget cuts it off-grid


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="HF checkpoint directory")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--backend", default="evenkv", help="evenkv | default | triton | an engine backend name")
    ap.add_argument("--graphs", type=int, choices=(0, 1), default=1, help="1: CUDA graphs (default)")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's batch-invariant mode (default on)")
    ap.add_argument("--target-len", type=int, default=1500, help="tokens of the target prompt")
    ap.add_argument("--others", type=int, default=63, help="other prompts in the batch runs")
    ap.add_argument("--other-max", type=int, default=1200, help="longest other prompt (shortest: 5)")
    ap.add_argument("--chunk", type=int, default=97, help="prefill tokens per step in the chunked runs")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens per request")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--mem", type=float, default=0.3, help="vLLM gpu_memory_utilization / SGLang mem_fraction_static")
    ap.add_argument("--native-ops", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM: torch-native norms/activations (needed with the device kit's vLLM)")
    ap.add_argument("--child-timeout", type=float, default=400, help="seconds per engine child")
    ap.add_argument("--child", choices=("whole", "chunked"), help=argparse.SUPPRESS)  # child: which engine
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name in ("target_len", "others", "other_max", "chunk", "new"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(a, name)}")
    return a


def prompts(a, vocab: int) -> tuple[list[int], list[list[int]]]:
    """(target, the batch runs' prompts with the target at TARGET_INDEX)."""
    import torch

    g = torch.Generator().manual_seed(a.seed)
    lens = torch.randint(5, a.other_max + 1, (a.others,), generator=g).tolist()
    lens[0] = min(lens[0], 31)  # the prompt before the target is short: both prefill in the first step
    others = compare.make_prompts(lens, vocab, a.seed + 1)
    target = compare.make_prompts([a.target_len], vocab, a.seed + 2)[0]
    return target, others[:TARGET_INDEX] + [target] + others[TARGET_INDEX:]


def engine_args(a) -> argparse.Namespace:
    """The option set compare.py's engine builders read."""
    return argparse.Namespace(model=a.model, graphs=a.graphs, mem=a.mem, kv_cache_dtype="auto", runner="auto",
                              native_ops=a.native_ops, spec_ngram=0)


def run_child(a) -> dict:
    """One engine (whole or chunked prefill), its two runs: {run: {"tokens", "logprobs"}}."""
    cfg = compare.read_model_config(a.model)
    target, batch = prompts(a, cfg["vocab_size"])
    need = max(map(len, batch)) + a.new
    if need > cfg.get("max_position_embeddings", need):
        sys.exit(f"invariance.py: the prompts need {need} positions, more than the model's max_position_embeddings")
    seqs = 1 << (len(batch) - 1).bit_length()
    backend = compare.BACKENDS[a.engine].get(a.backend, a.backend)
    whole = sum(map(len, batch)) + 1024  # every prompt of the batch prefilled in one step
    budget = whole if a.child == "whole" else a.chunk
    t = time.time()
    if a.engine == "vllm":
        if a.deterministic:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read when vLLM initialises
        import vllm

        version = vllm.__version__
        # The step's token budget: the whole batch (no chunk), or --chunk tokens (prefills cut into chunks).
        engine = compare.vllm_engine(engine_args(a), backend, need, seqs, budget)
        run = compare.vllm_run
    else:
        import sglang

        version = sglang.__version__
        extra = {"enable_deterministic_inference": a.deterministic,
                 "chunked_prefill_size": -1 if a.child == "whole" else budget,
                 "max_prefill_tokens": whole}
        engine = compare.sglang_engine(engine_args(a), backend, need, seqs, budget, extra)
        run = compare.sglang_run
    compare.log(f"{a.engine} {version} {backend} ({a.child} prefill, budget {budget}) ready in {time.time() - t:.0f}s")
    order = (("alone", [target]), ("batch", batch)) if a.child == "whole" else \
        (("chunked-batch", batch), ("chunked-alone", [target]))
    res = {"engine": f"{a.engine}-{version}", "backend": backend, "runs": {}}
    try:
        for name, ps in order:
            out = run(engine, ps, a.new, True)
            i = 0 if len(ps) == 1 else TARGET_INDEX
            res["runs"][name] = {"tokens": out["tokens"][i], "logprobs": out["logprobs"][i]}
            compare.log(f"{name}: {out['tokens'][i][:12]} ...")
    finally:
        if a.engine == "sglang":
            engine.shutdown()
    return res


def first_difference(ref: dict, run: dict) -> str | None:
    """Where ``run`` first differs from ``ref`` (tokens, then logprobs, bitwise), or None."""
    for j, (x, y) in enumerate(zip(ref["tokens"], run["tokens"])):
        if x != y:
            return f"token {j}: {y} vs {x}"
    if len(ref["tokens"]) != len(run["tokens"]):
        return f"{len(run['tokens'])} tokens vs {len(ref['tokens'])}"
    for j, (x, y) in enumerate(zip(ref["logprobs"], run["logprobs"])):
        if x != y:
            return f"logprob {j}: {y!r} vs {x!r} (diff {y - x:.3g})"
    return None


def spawn(a, argv: list[str], which: str) -> dict:
    fd, path = tempfile.mkstemp(prefix=f"invariance_{which}_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", which, "--json-out", path]
    compare.log(f"child: {which} prefill")
    return compare.run_json_child(cmd, f"{which}-prefill", path, a.child_timeout)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("invariance.py: no CUDA GPU is visible; the engines need one. Nothing was run.", file=sys.stderr)
        return compare.NO_GPU_EXIT
    if a.child:
        res = run_child(a)
        with open(a.json_out, "w") as f:
            json.dump(res, f)
        sys.stdout.flush()
        os._exit(0)  # skip the engines' slow teardown
    whole, chunked = spawn(a, argv, "whole"), spawn(a, argv, "chunked")
    runs = {**whole["runs"], **chunked["runs"]}
    diffs = {name: first_difference(runs["alone"], runs[name]) for name in RUNS[1:]}
    for name, d in diffs.items():
        if d:
            print(f"[invariance] {name} differs from alone at {d}", flush=True)
    ok = not any(diffs.values())
    same = " ".join(f"{name}_identical={int(not d)}" for name, d in diffs.items())
    print(f"RESULT invariance engine={whole['engine']} backend={whole['backend']} graphs={a.graphs} "
          f"deterministic={int(a.deterministic)} target={a.target_len} others={a.others} chunk={a.chunk} "
          f"new={a.new} {same} ok={int(ok)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
