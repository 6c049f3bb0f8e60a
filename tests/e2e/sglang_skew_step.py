"""GPU machine: decode step time of a skewed batch in a real SGLang engine (one backend per run).

usage:
  python3 tests/sglang_skew_step.py run --model DIR --backend evenkv|triton [--graphs 1] [--long 16384]
          [--short 63] [--short-min 16] [--short-max 256] [--steps 64] [--reps 3] [--load-format dummy]
          [--json FILE]
  python3 tests/sglang_skew_step.py compare A.json B.json

Workload: one prompt of --long tokens beside --short prompts of --short-min..--short-max tokens
(random token ids, fixed seed), greedy, every request in one decode batch. All prompts fit one
prefill batch (chunking off), so a generate of 1 token is prefill only and a generate of
steps + 1 tokens is the same prefill plus `steps` decode steps of the whole batch; the decode
step time is the difference over `steps` (median of --reps; radix cache off so every repeat
prefills again). Engine-level timings include the scheduler's per-step host work, the same
for both backends; they are not production numbers (tiny random model, kit engine).

The model directory's config.json needs max_position_embeddings >= long + steps + 1 (the
GPU script writes a copy of the kit's tiny model with a larger value).

Prints one line: RESULT skew backend=... decode_step_ms=... ; ``compare`` prints the ratio and
how many greedy tokens the two runs share (random bf16 weights have near-ties, so agreement
below 100% is expected and is judged by the kit's check.py, not here).
"""

import argparse
import json
import statistics
import sys
import time


def run(a) -> dict:
    import torch

    import sglang

    gen = torch.Generator().manual_seed(7)
    vocab = json.load(open(f"{a.model}/config.json"))["vocab_size"]
    lens = [a.long] + torch.randint(a.short_min, a.short_max + 1, (a.short,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]
    total = sum(lens)
    kw = dict(model_path=a.model, skip_tokenizer_init=True, attention_backend=a.backend, sampling_backend="pytorch",
              dtype="bfloat16", mem_fraction_static=a.mem, max_total_tokens=total + len(lens) * (a.steps + 8) + 4096,
              chunked_prefill_size=-1, max_prefill_tokens=total + 1024, max_running_requests=len(lens),
              disable_radix_cache=True, log_level=a.log_level, random_seed=0, load_format=a.load_format)
    if a.graphs:
        kw.update(cuda_graph_max_bs_decode=len(lens), disable_prefill_cuda_graph=True)
    else:
        kw["disable_cuda_graph"] = True
    t0 = time.time()
    eng = sglang.Engine(**kw)
    init_s = time.time() - t0

    def timed(new_tokens):
        sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp)
        return time.perf_counter() - t, outs

    timed(2)  # warm-up: kernel compiles, graph pools
    prefill, full = [], []
    outs = None
    for _ in range(a.reps):
        prefill.append(timed(1)[0])
        t, outs = timed(a.steps + 1)
        full.append(t)
    eng.shutdown()
    steps_ms = [(f - p) / a.steps * 1e3 for f, p in zip(full, prefill)]
    res = dict(backend=a.backend, graphs=a.graphs, sglang=sglang.__version__, long=a.long, short=a.short,
               short_tokens=total - a.long, batch=len(lens), steps=a.steps, reps=a.reps, init_s=round(init_s, 1),
               prefill_s=round(statistics.median(prefill), 4), decode_step_ms=round(statistics.median(steps_ms), 3),
               decode_step_ms_all=[round(x, 3) for x in steps_ms],
               tokens=[o["output_ids"] for o in outs], gpu=torch.cuda.get_device_name())
    print(f"RESULT skew backend={a.backend} graphs={a.graphs} batch={len(lens)} long={a.long} "
          f"short_tokens={res['short_tokens']} steps={a.steps} decode_step_ms={res['decode_step_ms']} "
          f"(reps {res['decode_step_ms_all']}) prefill_s={res['prefill_s']} init_s={res['init_s']}", flush=True)
    return res


def compare(paths) -> None:
    a, b = (json.load(open(p)) for p in paths)
    agree = sum(x == y for ta, tb in zip(a["tokens"], b["tokens"]) for x, y in zip(ta, tb))
    total = sum(len(t) for t in a["tokens"])
    long_same = a["tokens"][0] == b["tokens"][0]
    print(f"RESULT skew_compare {a['backend']}/{b['backend']} graphs={a['graphs']} "
          f"decode_step_ms={a['decode_step_ms']}/{b['decode_step_ms']} "
          f"ratio={a['decode_step_ms'] / b['decode_step_ms']:.3f} token_agree={agree}/{total} "
          f"long_request_same={int(long_same)}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--backend", required=True)
    r.add_argument("--graphs", type=int, default=1)
    r.add_argument("--long", type=int, default=16384)
    r.add_argument("--short", type=int, default=63)
    r.add_argument("--short-min", type=int, default=16)
    r.add_argument("--short-max", type=int, default=256)
    r.add_argument("--steps", type=int, default=64)
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--mem", type=float, default=0.1)
    r.add_argument("--log-level", default="error")
    r.add_argument("--load-format", default="auto", help="dummy: random weights for a config-only model directory")
    r.add_argument("--json")
    c = sub.add_parser("compare")
    c.add_argument("paths", nargs=2)
    a = ap.parse_args(argv)
    if a.cmd == "compare":
        compare(a.paths)
        return
    res = run(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    sys.exit(main())
