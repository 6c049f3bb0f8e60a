#!/usr/bin/env python3
"""End-to-end comparison harness: evenkv inside vLLM or SGLang against another backend of the
engine (its Triton backend by default) and HF transformers (GPU machine; tests/e2e/vllm.sh and
sglang.sh run it).

    python tests/e2e/compare.py MODEL_DIR [--engine vllm|sglang] [--backend evenkv|triton|NAME]
                                [--baseline triton|default|NAME] [--graphs 0|1] [--compare]
                                [--skewed] [--spec-ngram K] [...]

MODEL_DIR is any HF checkpoint the engine can load (a real one works the same as the tiny
random Qwen3 of the device kits). Prompts are random token ids (no tokenizer needed), of
very different lengths; decoding is greedy with ``ignore_eos``.

Modes:
  (default)    one engine, one backend, in this process: generates, prints the outputs,
               tokens/s and the per-step decode latency.
  --compare    evenkv and the --baseline backend (one child process each, so two engines
               never share a process), then HF transformers teacher-forced on the same
               weights; prints one ``RESULT compare ...`` line: per backend, tokens that are
               HF's argmax / near-ties (within --tol nats of it) / bad, the largest
               |engine logprob - HF logprob|, and evenkv vs the baseline (same tokens up to
               the first divergence, whether each divergence is a near-tie under HF).
               ok=1: no bad token, logprobs within --lp-tol, divergences near-ties, and each
               backend's rerun of the same prompts repeats its tokens (under speculation a
               rerun may differ, where each prompt's first difference is an HF near-tie); over an
               FP8 cache (--kv-cache-dtype), which HF does not round, evenkv at least as
               close to HF as the baseline on the same cache (bad tokens, largest logprob
               difference up to the larger of --lp-tol and the baseline's).
  --skewed     one prompt of --long-len tokens (>= 16K) beside --num-short short ones,
               --steps decode steps, for both backends; prints one ``RESULT skewed ...``
               line with the decode step time of each (median, p20-p80) and their ratio.
  --compare and --skewed combine (each backend's child runs both workloads).
  --spec-ngram K  both backends decode with n-gram speculation of K draft tokens (no draft
               model): vLLM ``speculative_config={"method": "ngram", ...}``, SGLang
               ``speculative_algorithm="NGRAM"`` with K + 1 draft tokens in a chain (in trees of
               up to --spec-breadth branches a level, when that is more than 1). Each
               prompt is a random block of --spec-block tokens repeated, so the n-gram
               lookup finds matches from the first step; with random weights most drafts are
               rejected, which still verifies them. RESULT adds per backend how many
               request-steps brought more than one token (vLLM) or the verify steps (SGLang).
  --spec-draft K  speculative decoding with the model as its own draft model (vLLM
               ``method="draft_model"``, SGLang ``STANDALONE`` with K steps in a chain): the
               drafts, greedy from the same weights, are mostly accepted, so every verify row
               counts; SGLang's draft attention backend is left for evenkv's plugin to name,
               unless --draft-attention names it for evenkv's run. With --spec-breadth B > 1
               (SGLang) the drafts form trees: B branches a step (EAGLE's topk), K + 2 draft
               tokens verified a step.

Decode step time: vLLM, each ``LLMEngine.step()`` in which every running request was
already decoding (wall clock, synchronous scheduling, no prefix caching). SGLang (whose
engine runs in another process): (time to generate 1 + S tokens - time to generate 1) / S.

Backend names: ``evenkv`` is vLLM's ``CUSTOM`` (the evenkv plugin) and SGLang's ``evenkv``;
``triton`` is vLLM's ``TRITON_ATTN`` and SGLang's ``triton``; ``default`` the engine's
Hopper default, vLLM's ``FLASH_ATTN`` (FA3; needs the peers kit's FA3 beside the vLLM kit)
and SGLang's ``fa3``; other names pass through.
``--graphs 1`` captures CUDA graphs: vLLM full graphs of decode steps (``FULL_DECODE_ONLY``,
no torch.compile), SGLang its default decode (full) and prefill (breakable) graphs.
``--native-ops`` (default on) makes vLLM use torch-native norms/activations: the device
kit's vLLM has no compiled ``_C``; with a full vLLM install pass ``--no-native-ops``.

Exit status: 0 ok (and ``ok=1`` on RESULT lines), 1 a check failed, 3 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

NO_GPU_EXIT = 3
BACKENDS = {"vllm": {"evenkv": "CUSTOM", "triton": "TRITON_ATTN", "default": "FLASH_ATTN"},
            "sglang": {"evenkv": "evenkv", "triton": "triton", "default": "fa3"}}
VOCAB_LOW = 3  # skip special ids 0..2 in random prompts


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="HF checkpoint directory")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--backend", default="evenkv", help="evenkv | triton | an engine backend name (default evenkv)")
    ap.add_argument("--graphs", type=int, choices=(0, 1), default=0, help="1: CUDA graphs (default 0: eager)")
    ap.add_argument("--baseline", default="triton",
                    help="--compare/--skewed: the backend evenkv is compared with (triton | default | NAME)")
    ap.add_argument("--compare", action="store_true", help="evenkv vs the baseline backend vs HF")
    ap.add_argument("--spec-ngram", type=int, default=0, metavar="K",
                    help="n-gram speculative decoding with K draft tokens (0: off)")
    ap.add_argument("--spec-block", type=int, default=16, help="--spec-ngram: the repeated block of each prompt")
    ap.add_argument("--spec-draft", type=int, default=0, metavar="K",
                    help="speculative decoding with the model as its own draft model, K draft tokens (0: off)")
    ap.add_argument("--draft-attention", default=None, metavar="NAME",
                    help="--spec-draft, SGLang: the draft model's attention backend in evenkv's run "
                         "(--speculative-draft-attention-backend; default: unnamed)")
    ap.add_argument("--spec-breadth", type=int, default=1,
                    help="SGLang: the draft tree's breadth (1: a chain; more: branching trees); --spec-ngram: "
                         "the n-gram tree's widest level, --spec-draft: branches a draft step (topk)")
    ap.add_argument("--skewed", action="store_true", help="decode step time, one long prompt beside short ones")
    ap.add_argument("--prompt-lens", default="7,100,1000,3000,13,333",
                    help="comma-separated prompt lengths of the generation workload")
    ap.add_argument("--new", type=int, default=32, help="new tokens per prompt (generation workload)")
    ap.add_argument("--long-len", type=int, default=16384, help="--skewed: the long prompt")
    ap.add_argument("--num-short", type=int, default=63, help="--skewed: how many short prompts")
    ap.add_argument("--short-lens", default="16,256", help="--skewed: short prompt lengths, uniform in [lo,hi]")
    ap.add_argument("--steps", type=int, default=64, help="--skewed: decode steps")
    ap.add_argument("--seed", type=int, default=1, help="of the random prompts")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the engine's KV cache dtype: auto, or fp8 (vLLM) / fp8_e4m3 (SGLang), for both backends")
    ap.add_argument("--page-size", type=int, default=0,
                    help="the KV page size of both backends (vLLM block_size, SGLang page_size; 0: the engine's)")
    ap.add_argument("--mem", type=float, default=0.3, help="vLLM gpu_memory_utilization / SGLang mem_fraction_static")
    ap.add_argument("--runner", choices=("auto", "v1", "v2"), default="auto",
                    help="vLLM model runner (auto = vLLM's default; sets VLLM_USE_V2_MODEL_RUNNER)")
    ap.add_argument("--native-ops", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM: torch-native norms/activations (needed with the device kit's vLLM)")
    ap.add_argument("--tol", type=float, default=0.1, help="near-tie: chosen token within TOL nats of HF's top-1")
    ap.add_argument("--lp-tol", type=float, default=0.3, help="max |engine logprob - HF logprob| for ok=1")
    ap.add_argument("--child-timeout", type=float, default=1500, help="seconds per backend child (--compare/--skewed)")
    ap.add_argument("--workloads", default=None, help=argparse.SUPPRESS)  # child: gen,skewed
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)  # child: where to write results
    return ap.parse_args(argv)


def log(*parts):
    print("[compare]", *parts, flush=True)


# -- workloads ------------------------------------------------------------------------------


def read_model_config(model: str) -> dict:
    path = os.path.join(model, "config.json")
    if not os.path.exists(path):
        sys.exit(f"compare.py: {path} not found; MODEL must be an HF checkpoint directory")
    with open(path) as f:
        return json.load(f)


def make_prompts(lens, vocab: int, seed: int, block: int = 0) -> list[list[int]]:
    """Random token prompts of the given lengths; with ``block`` > 0 each one is a random
    block of that many tokens repeated (n-gram lookups then match)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if block <= 0:
        return [torch.randint(VOCAB_LOW, vocab, (int(n),), generator=g).tolist() for n in lens]
    return [(torch.randint(VOCAB_LOW, vocab, (block,), generator=g).tolist() * (int(n) // block + 1))[:int(n)]
            for n in lens]


def spec_tokens(a) -> int:
    """Draft tokens per request and step under --spec-ngram or --spec-draft (0: no speculation)."""
    if a.spec_ngram and a.spec_draft:
        sys.exit("compare.py: --spec-ngram and --spec-draft are two kinds of speculation; pass one")
    return a.spec_ngram or a.spec_draft


def workloads(a, vocab: int) -> dict:
    """{"gen": (prompts, new_tokens), "skewed": (prompts, 1 + steps)} for the requested modes."""
    import torch

    out = {}
    if not a.skewed or a.compare:
        block = a.spec_block if a.spec_ngram else 0
        out["gen"] = (make_prompts(a.prompt_lens.split(","), vocab, a.seed, block), a.new)
    if a.skewed:
        lo, hi = (int(x) for x in a.short_lens.split(","))
        g = torch.Generator().manual_seed(a.seed + 1)
        short = torch.randint(lo, hi + 1, (a.num_short,), generator=g).tolist()
        # The long prompt sits in the middle of the batch, as it would among live traffic.
        lens = short[: a.num_short // 2] + [a.long_len] + short[a.num_short // 2:]
        out["skewed"] = (make_prompts(lens, vocab, a.seed + 2), 1 + a.steps)
    return out


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {"n": len(s), "p50": q(0.5), "p20": q(0.2), "p80": q(0.8), "mean": sum(s) / len(s)}


# -- vLLM -------------------------------------------------------------------------------------


def vllm_engine(a, backend: str, max_model_len: int, max_num_seqs: int, max_batched: int):
    """``vllm.LLM`` for ``a``'s options."""
    if a.runner != "auto":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.runner == "v2" else "0"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    if backend == "CUSTOM":
        # The entry point registers it in every vLLM process; this covers a checkout on
        # PYTHONPATH without an installed distribution (in-process engine only).
        from evenkv.integrations.vllm import register

        register()
    compilation = {}
    if a.native_ops:
        compilation["custom_ops"] = ["none"]
    kw = dict(model=a.model, skip_tokenizer_init=True, dtype="bfloat16", attention_backend=backend,
              gpu_memory_utilization=a.mem, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_batched, seed=0, enable_prefix_caching=False, async_scheduling=False,
              enforce_eager=not a.graphs, kv_cache_dtype=a.kv_cache_dtype)
    if a.page_size:
        kw["block_size"] = a.page_size
    if a.graphs:
        # Graph sizes count tokens: a speculative decode step holds 1 + K per request.
        per_request = 1 + spec_tokens(a)
        sizes = [s * per_request for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s < max_num_seqs]
        sizes.append(max_num_seqs * per_request)
        # Full graphs of decode steps without torch.compile: what the backend's
        # UNIFORM_SINGLE_TOKEN_DECODE support (evenkv) or ALWAYS (TRITON_ATTN) allows.
        compilation.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=sizes)
    if compilation:
        kw["compilation_config"] = compilation
    if a.native_ops:
        kw["kernel_config"] = {"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}}
    if a.spec_ngram:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": a.spec_ngram,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    elif a.spec_draft:
        kw["speculative_config"] = {"method": "draft_model", "model": a.model, "num_speculative_tokens": a.spec_draft}
    return LLM(**kw)


def vllm_run(llm, prompts, max_tokens: int, logprobs: bool) -> dict:
    """Step the engine by hand so each step is timed. Returns tokens, logprobs, step times
    and which steps were pure decode (every unfinished request already had a token)."""
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                        logprobs=1 if logprobs else None, output_kind=RequestOutputKind.DELTA)
    # Requests go straight to the engine: LLM.generate/enqueue force FINAL_ONLY outputs, and
    # the per-step (DELTA) outputs are what tell a decode step from a prefill step. The
    # prompt is rendered as LLM.generate renders it where that (private) helper exists
    # (vLLM 0.26 and 0.33), else handed over raw (a token prompt needs no rendering).
    render = getattr(llm, "_preprocess_cmpl_one", None)
    ids = {}
    tag = time.time_ns()
    for i, p in enumerate(prompts):
        rid = f"p{i}-{tag}"
        prompt = {"prompt_token_ids": p}
        internal = engine.add_request(rid, render(prompt) if render else prompt, sp)
        ids[rid] = ids[internal] = i  # outputs carry rid; add_request returns "<rid>-<random>"
    toks = [[] for _ in prompts]
    lps = [[] for _ in prompts]
    multi_token_steps = 0  # request-steps that brought more than one token: accepted drafts
    unfinished = set(range(len(prompts)))
    steps = []  # (seconds, pure_decode)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        decoding = all(toks[i] for i in unfinished)
        ts = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - ts, decoding))
        for o in outs:
            i = ids[o.request_id]
            c = o.outputs[0]
            toks[i] += list(c.token_ids)
            multi_token_steps += len(c.token_ids) > 1
            if logprobs:
                lps[i] += [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
            if o.finished:
                unfinished.discard(i)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    decode = [dt for dt, dec in steps if dec]
    return {"tokens": toks, "logprobs": lps if logprobs else None, "seconds": total, "steps": len(steps),
            "decode_step_s": decode, "spec": {"multi_token_steps": multi_token_steps}}


# -- SGLang ----------------------------------------------------------------------------------


def sglang_engine(a, backend: str, max_model_len: int, max_num_seqs: int, max_batched: int,
                  extra: dict | None = None):
    """``sglang.Engine`` for ``a``'s options; ``extra`` adds or overrides ``Engine`` arguments."""
    import sglang

    kw = dict(model_path=a.model, skip_tokenizer_init=True, attention_backend=backend, sampling_backend="pytorch",
              dtype="bfloat16", mem_fraction_static=a.mem, context_length=max_model_len,
              max_running_requests=max_num_seqs, chunked_prefill_size=max_batched, disable_radix_cache=True,
              log_level="error", random_seed=0, kv_cache_dtype=a.kv_cache_dtype)
    if a.page_size:
        kw["page_size"] = a.page_size
    if a.graphs:
        kw.update(cuda_graph_max_bs_decode=max_num_seqs, cuda_graph_max_bs_prefill=512)
    else:
        kw["disable_cuda_graph"] = True
    if a.spec_ngram:
        # K drafts, a chain at breadth 1: SGLang counts the verified row (last token + K drafts) as
        # draft tokens.
        kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=a.spec_ngram + 1,
                  speculative_ngram_min_bfs_breadth=1, speculative_ngram_max_bfs_breadth=a.spec_breadth)
    elif a.spec_draft:
        # K drafts from the model itself, a chain or (breadth > 1) a tree whose best K + 1 nodes are
        # verified; the draft's attention backend is left unnamed, as an operator switching to
        # evenkv with one flag leaves it.
        kw.update(speculative_algorithm="STANDALONE", speculative_draft_model_path=a.model,
                  speculative_num_steps=a.spec_draft, speculative_eagle_topk=a.spec_breadth,
                  speculative_num_draft_tokens=a.spec_draft + (1 if a.spec_breadth == 1 else 2))
        if a.draft_attention and backend == BACKENDS["sglang"]["evenkv"]:
            kw["speculative_draft_attention_backend"] = a.draft_attention
    kw.update(extra or {})
    return sglang.Engine(**kw)


def sglang_run(eng, prompts, max_tokens: int, logprobs: bool) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=logprobs)
    total = time.perf_counter() - t0
    toks = [list(o["output_ids"]) for o in outs]
    lps = [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs] if logprobs else None
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return {"tokens": toks, "logprobs": lps, "seconds": total, "steps": None, "decode_step_s": [],
            "spec": {"verify_steps": verify}}


def sglang_decode_steps(eng, prompts, steps: int) -> list[float]:
    """Per-step decode time from two runs: 1 token (prefill) and 1 + steps tokens."""
    one = sglang_run(eng, prompts, 1, False)["seconds"]
    full = sglang_run(eng, prompts, 1 + steps, False)["seconds"]
    return [(full - one) / steps]


# -- one engine, one backend -----------------------------------------------------------------


def run_backend(a) -> dict:
    """Build the engine once and run every requested workload; returns JSON-able results."""
    cfg = read_model_config(a.model)
    wl = workloads(a, cfg["vocab_size"])
    if a.workloads:
        wl = {k: v for k, v in wl.items() if k in a.workloads.split(",")}
    need = max(max(len(p) for p in ps) + n for ps, n in wl.values())
    limit = cfg.get("max_position_embeddings")
    if limit is not None and need > limit:
        sys.exit(f"compare.py: the workload needs {need} positions but the model's "
                 f"max_position_embeddings is {limit} (make the model with a larger --max-pos)")
    max_num_seqs = max(len(ps) for ps, _ in wl.values())
    max_num_seqs = 1 << (max_num_seqs - 1).bit_length()  # a capture size when --graphs 1
    # Whole prompts in one step, so the skewed run's decode steps start right after prefill.
    max_batched = min(max(8192, max(sum(len(p) for p in ps) for ps, _ in wl.values())), 1 << 17)
    backend = BACKENDS[a.engine].get(a.backend, a.backend)
    res = {"engine": a.engine, "backend": backend, "graphs": a.graphs, "runner": a.runner, "spec_ngram": a.spec_ngram,
           "spec_draft": a.spec_draft}
    t = time.time()
    if a.engine == "vllm":
        import vllm

        res["engine_version"] = vllm.__version__
        engine = vllm_engine(a, backend, need, max_num_seqs, max_batched)
        run = vllm_run
    else:
        import sglang

        res["engine_version"] = sglang.__version__
        engine = sglang_engine(a, backend, need, max_num_seqs, max_batched)
        run = sglang_run
    res["init_s"] = round(time.time() - t, 1)
    log(f"{a.engine} {res['engine_version']} backend={backend} graphs={a.graphs} ready in {res['init_s']}s")
    try:
        if "gen" in wl:
            prompts, new = wl["gen"]
            first = run(engine, prompts, new, True)  # compiles the kernels on first use
            again = run(engine, prompts, new, False)  # timed
            gen = {"prompts": prompts, "prompt_lens": [len(p) for p in prompts], "tokens": first["tokens"],
                   "logprobs": first["logprobs"], "rerun_same": again["tokens"] == first["tokens"],
                   "rerun_tokens": again["tokens"],
                   "seconds": again["seconds"], "tokens_per_s": sum(map(len, again["tokens"])) / again["seconds"],
                   "decode_step_s": again["decode_step_s"], "spec": first["spec"]}
            if a.engine == "sglang":
                gen["decode_step_s"] = sglang_decode_steps(engine, prompts, new - 1)
            res["gen"] = gen
            for p, tk in zip(prompts, first["tokens"]):
                log(f"prompt_len={len(p)} -> {tk[:16]}{' ...' if len(tk) > 16 else ''}")
            st = percentiles(gen["decode_step_s"])
            log(f"gen: {len(prompts)} prompts x {new} tokens: {gen['tokens_per_s']:.1f} tokens/s, "
                f"decode step {_ms(st)}, rerun_same={int(gen['rerun_same'])}")
        if "skewed" in wl:
            prompts, new = wl["skewed"]
            run(engine, prompts, new, False)  # warm-up: every kernel specialisation compiled
            timed = run(engine, prompts, new, False)
            sk = {"long_len": max(map(len, prompts)), "num_prompts": len(prompts), "steps": new - 1,
                  "tokens": timed["tokens"], "seconds": timed["seconds"],
                  "decode_step_s": timed["decode_step_s"]}
            if a.engine == "sglang":
                sk["decode_step_s"] = sglang_decode_steps(engine, prompts, new - 1)
            res["skewed"] = sk
            log(f"skewed: 1 x {sk['long_len']} + {len(prompts) - 1} short prompts, {new - 1} decode steps: "
                f"decode step {_ms(percentiles(sk['decode_step_s']))}")
    finally:
        if a.engine == "sglang":
            engine.shutdown()
    return res


def _ms(st: dict) -> str:
    if not st.get("n"):
        return "n/a (no pure decode step)"
    return f"{st['p50'] * 1e3:.3f} ms (p20 {st['p20'] * 1e3:.3f}, p80 {st['p80'] * 1e3:.3f}, n={st['n']})"


# -- orchestration: both backends, HF reference -----------------------------------------------


def run_json_child(cmd: list[str], label: str, json_path: str, timeout: float) -> dict:
    """Run a child process that writes its results to ``json_path``; return them (and remove the
    file), or raise naming ``label`` if it failed or ran past ``timeout`` seconds."""
    t = time.time()
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0:
        raise RuntimeError(f"the {label} child failed ({rc}) after {time.time() - t:.0f}s; its log is above")
    with open(json_path) as f:
        res = json.load(f)
    os.unlink(json_path)
    return res


def run_child(a, backend: str, workloads_csv: str) -> dict:
    fd, path = tempfile.mkstemp(prefix=f"offline_generate_{backend}_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), a.model, "--engine", a.engine, "--backend", backend,
           "--graphs", str(a.graphs), "--prompt-lens", a.prompt_lens, "--new", str(a.new), "--long-len",
           str(a.long_len), "--num-short", str(a.num_short), "--short-lens", a.short_lens, "--steps", str(a.steps),
           "--seed", str(a.seed), "--mem", str(a.mem), "--runner", a.runner, "--kv-cache-dtype", a.kv_cache_dtype,
           "--page-size", str(a.page_size),
           "--native-ops" if a.native_ops else "--no-native-ops", "--workloads", workloads_csv, "--json-out", path,
           "--spec-ngram", str(a.spec_ngram), "--spec-block", str(a.spec_block), "--spec-breadth", str(a.spec_breadth),
           "--spec-draft", str(a.spec_draft)]
    if a.draft_attention:
        cmd += ["--draft-attention", a.draft_attention]
    if a.compare:
        cmd.append("--compare")
    if a.skewed:
        cmd.append("--skewed")
    log(f"child: {backend}, {workloads_csv}")
    return run_json_child(cmd, backend, path, a.child_timeout)


def hf_scores(model: str, prompts, outputs) -> list[list[tuple[int, float, dict]]]:
    """Teacher-forced HF log-probs: for each prompt and generated position, (argmax, top-1 logprob,
    {token: logprob}) for the tokens any backend chose there."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    res = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            rows = []
            for toks in outputs:  # each backend's own continuation
                ids = torch.tensor([p + toks[i][:-1]], device="cuda")
                logp = torch.log_softmax(m(ids).logits[0, len(p) - 1:].float(), -1)
                rows.append((logp.argmax(-1).tolist(), logp.max(-1).values.tolist(),
                             [logp[j, t].item() for j, t in enumerate(toks[i])]))
            res.append(rows)
    del m
    torch.cuda.empty_cache()
    return res


def first_divergences(tokens_a, tokens_b, lp_a, lp_b, tol: float) -> tuple[int, int]:
    """(prompts whose continuations a and b differ, how many of those first differ at an HF
    near-tie): per prompt, the first position j where the tokens differ; the contexts are equal
    up to j, so HF's row there is shared, and the two tokens' HF log-probs (``lp_a[i][j]``,
    ``lp_b[i][j]``) within ``tol`` nats make it a near-tie."""
    divergences = ties = 0
    for i, (a_, b_) in enumerate(zip(tokens_a, tokens_b)):
        j = next((j for j, (x, y) in enumerate(zip(a_, b_)) if x != y), None)
        if j is not None:
            divergences += 1
            ties += abs(lp_a[i][j] - lp_b[i][j]) <= tol
    return divergences, ties


def compare_report(a, ev: dict, tr: dict) -> tuple[str, bool]:
    """The RESULT fields of --compare and whether they pass (``tr``: the baseline's results)."""
    prompts = ev["gen"]["prompts"]
    if tr["gen"]["prompts"] != prompts:
        raise RuntimeError("the two backends were given different prompts")
    base = a.baseline
    runs = {"evenkv": ev["gen"], base: tr["gen"]}
    # HF reads the unquantized K/V, so over an FP8 cache every backend departs from it by the
    # cache's rounding: there evenkv must be at least as close to HF as the baseline on the same
    # cache, and its divergences from the baseline need not be near-ties.
    fp8 = a.kv_cache_dtype.startswith("fp8")
    # Under speculation a rerun's drafts differ (the n-gram cache, or the draft's own state, is
    # warm by then), and a position verified in a row of another length or tree may round to the
    # other side of a near-tie: there a rerun may differ, first at an HF near-tie only (over an
    # FP8 cache, whose rounding HF does not see, an engine-side near-tie can still fail this).
    # Without speculation it must repeat the first run's tokens exactly.
    spec = bool(spec_tokens(a))
    outputs = [runs[name]["tokens"] for name in runs]
    rerun_output = {}  # backend -> its differing rerun's index in outputs
    for name in runs:
        if spec and not runs[name]["rerun_same"]:
            rerun_output[name] = len(outputs)
            outputs.append(runs[name]["rerun_tokens"])
    scores = hf_scores(a.model, prompts, outputs)
    token_lps = [[scores[i][k][2] for i in range(len(prompts))] for k in range(len(outputs))]
    fields, ok, stats = [], True, {}
    for k, name in enumerate(runs):
        agree = near = bad = total = 0
        max_dlp = 0.0
        for i in range(len(prompts)):
            top, top_lp, tok_lp = scores[i][k]
            for j, t in enumerate(runs[name]["tokens"][i]):
                total += 1
                gap = top_lp[j] - tok_lp[j]
                agree += t == top[j]
                near += t != top[j] and gap <= a.tol
                bad += gap > a.tol
                max_dlp = max(max_dlp, abs(runs[name]["logprobs"][i][j] - tok_lp[j]))
        stats[name] = (bad, max_dlp)
        rerun_ok = runs[name]["rerun_same"]
        fields += [f"{name}_hf_top1={agree}/{total}", f"{name}_hf_near_ties={near}", f"{name}_hf_bad={bad}",
                   f"{name}_hf_max_lp_diff={max_dlp:.4f}", f"{name}_rerun_same={int(rerun_ok)}"]
        if name in rerun_output:
            div, ties = first_divergences(runs[name]["tokens"], runs[name]["rerun_tokens"], token_lps[k],
                                          token_lps[rerun_output[name]], a.tol)
            rerun_ok = div == ties
            fields += [f"{name}_rerun_divergences={div}", f"{name}_rerun_divergences_near_tie={ties}"]
        ok &= rerun_ok and (fp8 or (bad == 0 and max_dlp <= a.lp_tol))
        fields += [f"{name}_{key}={v}" for key, v in sorted(runs[name].get("spec", {}).items()) if spec]
    # evenkv vs the baseline: same tokens up to the first divergence; a divergence must be a
    # near-tie under HF (the contexts are equal up to there, so HF's row is shared).
    same = total = 0
    max_dlp = 0.0
    divergences, tie_divergences = first_divergences(runs["evenkv"]["tokens"], runs[base]["tokens"], token_lps[0],
                                                     token_lps[1], a.tol)
    for i in range(len(prompts)):
        e, t = runs["evenkv"]["tokens"][i], runs[base]["tokens"][i]
        total += len(e)
        for j, (x, y) in enumerate(zip(e, t)):
            if x != y:
                break
            same += 1
            max_dlp = max(max_dlp, abs(runs["evenkv"]["logprobs"][i][j] - runs[base]["logprobs"][i][j]))
    if fp8:
        (bad_e, dlp_e), (bad_b, dlp_b) = stats["evenkv"], stats[base]
        ok &= bad_e <= bad_b and dlp_e <= max(a.lp_tol, dlp_b)
    else:
        ok &= tie_divergences == divergences and max_dlp <= a.lp_tol
    fields += [f"evenkv_vs_{base}_same_prefix={same}/{total}", f"divergences={divergences}",
               f"divergences_near_tie={tie_divergences}", f"evenkv_vs_{base}_max_lp_diff={max_dlp:.4f}"]
    for name in runs:
        st = percentiles(runs[name]["decode_step_s"])
        fields += [f"{name}_tok_s={runs[name]['tokens_per_s']:.1f}",
                   f"{name}_decode_step_ms={st['p50'] * 1e3:.3f}" if st.get("n") else f"{name}_decode_step_ms=na"]
    return " ".join(fields), ok


def skewed_report(ev: dict, tr: dict, base: str) -> str:
    fields = []
    stats = {}
    for name, res in (("evenkv", ev), (base, tr)):
        st = percentiles(res["skewed"]["decode_step_s"])
        stats[name] = st
        if st.get("n"):
            fields.append(f"{name}_step_ms={st['p50'] * 1e3:.3f}({st['p20'] * 1e3:.3f}-{st['p80'] * 1e3:.3f},"
                          f"n={st['n']})")
        else:
            fields.append(f"{name}_step_ms=na")
    if stats["evenkv"].get("n") and stats[base].get("n"):
        fields.append(f"{base}_over_evenkv={stats[base]['p50'] / stats['evenkv']['p50']:.3f}")
    e, t = ev["skewed"]["tokens"], tr["skewed"]["tokens"]
    same = sum(x == y for a_, b_ in zip(e, t) for x, y in zip(a_, b_))
    fields.append(f"tokens_same={same}/{sum(map(len, e))}")
    return " ".join(fields)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("compare.py: no CUDA GPU is visible (torch.cuda.is_available() is False). vLLM and SGLang "
              "offline generation with evenkv need an NVIDIA GPU (SM80 or newer); nothing was run.",
              file=sys.stderr, flush=True)
        return NO_GPU_EXIT
    if a.engine not in BACKENDS:
        raise SystemExit(f"--engine: expected vllm or sglang, got {a.engine}")

    if a.json_out or not (a.compare or a.skewed):  # one backend, here
        res = run_backend(a)
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(res, f)
            log(f"results written to {a.json_out}")
        else:
            print(f"RESULT run engine={a.engine}-{res['engine_version']} backend={res['backend']} graphs={a.graphs} "
                  f"tok_s={res['gen']['tokens_per_s']:.1f} "
                  f"decode_step_ms={_ms(percentiles(res['gen']['decode_step_s'])).split(' ')[0]} "
                  f"rerun_same={int(res['gen']['rerun_same'])}", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip the engines' slow teardown (vLLM in-process engine)

    csv = ",".join(k for k, on in (("gen", a.compare), ("skewed", a.skewed)) if on)
    ev = run_child(a, "evenkv", csv)
    tr = run_child(a, a.baseline, csv)
    head = (f"engine={a.engine}-{ev['engine_version']} baseline={tr['backend']} graphs={a.graphs} runner={a.runner} "
            f"kv={a.kv_cache_dtype} spec_ngram={a.spec_ngram} spec_draft={a.spec_draft} page_size={a.page_size or 'default'}")
    ok = True
    if a.compare:
        fields, ok_c = compare_report(a, ev, tr)
        ok &= ok_c
        print(f"RESULT compare {head} prompts={len(ev['gen']['prompt_lens'])} "
              f"lens={','.join(map(str, ev['gen']['prompt_lens']))} new={a.new} {fields} ok={int(ok_c)}", flush=True)
    if a.skewed:
        sk = ev["skewed"]
        print(f"RESULT skewed {head} long={sk['long_len']} short={sk['num_prompts'] - 1}x[{a.short_lens}] "
              f"steps={sk['steps']} {skewed_report(ev, tr, a.baseline)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
