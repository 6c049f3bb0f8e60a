#!/usr/bin/env python3
"""Serving benchmark: evenkv against the engines' own attention backends, end to end, on
full-size model shapes and serving workloads. One child process per (engine, mode, shape,
backend), so two engines never share a process; one CSV row per workload.

    python -m benchmarks.serving vllm   --out DIR [--backends evenkv,FLASH_ATTN] [--mode default,batch-invariant]
    python -m benchmarks.serving sglang --out DIR [--backends evenkv,fa3,triton] [--mode spec-ngram] [--tp 1]
    python -m benchmarks.serving report DIR       # summary.md and plots from DIR/serving.csv

Models: dense configs with random weights (``load_format="dummy"``; only config.json is
written, nothing is downloaded), at three shapes:
  qwen3-8b             Qwen3-8B: 32 q / 8 kv heads, head dim 128, hidden 4096, 36 layers
  qwen3-30b-a3b-attn   Qwen3-30B-A3B's attention (32 q / 4 kv heads, head dim 128, 48 layers,
                       hidden 2048) with a dense MLP of its active size (intermediate 6144)
  mellum-swa           a Mellum (32 q / 4 kv heads, head dim 128, hidden 2048, dense MLPs of
                       6144, 28 layers) whose layers are three of 1024-token sliding windows to
                       one full: an architecture SGLang serves on its hybrid SWA pool (a token
                       pool for the window layers beside the full one), vLLM in KV-cache groups

Workloads (fixed seeds; ``--size full`` is the target size, ``quick`` the one a budgeted
device run affords; prompts are random token ids, decoding is greedy with ignore_eos):
  chat           prompts log-normal around 1K tokens (100-8K), outputs 128-1024 (quick 32-256),
                 512 requests (quick 256), all submitted at once
  chat-rate      the chat mix arriving as a Poisson process (latency under load)
  long-mix       2 (quick) or 4 requests of 64K-128K tokens among 1200 (quick 1100) short chats,
                 so more than 992 requests decode together
  long-context   4 prompts of 64K tokens among 28 of 2K, 128 output tokens each (32 requests;
                 the same at both sizes): few long contexts, where one split per KV head hurts
  prefill-heavy  8K-32K-token prompts, 64-token outputs, 64 requests (quick 16)
  many-short     2048 requests of ~200-token prompts, 512-token outputs (quick 96)

Modes (``--mode``, repeatable or a comma list; every backend runs in each):
  default          the engine as configured below
  batch-invariant  vLLM with ``VLLM_BATCH_INVARIANT=1``, SGLang with ``--enable-deterministic-inference``
  spec-ngram       n-gram speculative decoding (no draft model): vLLM
                   ``speculative_config={"method": "ngram", "num_speculative_tokens": K,
                   "prompt_lookup_min"/"max": ...}``, SGLang ``--speculative-algorithm NGRAM`` with
                   K + 1 draft tokens (the verify row's length) and a BFS breadth of
                   ``--ngram-breadth`` (1: a chain as in vLLM; SGLang's own default is a tree of 10)

Engines:
  vllm    in-process ``LLMEngine`` stepped by hand (each step timed; a step in which every
          running request already had its first token is a decode step). Backends are
          vLLM's names; ``evenkv`` means ``CUSTOM`` (the evenkv plugin); the default is
          ``FLASH_ATTN`` (FA3). CUDA graphs of decode steps (FULL_DECODE_ONLY, vLLM's capture
          sizes up to the batch limit), torch.compile (mode 3 with custom_ops ["none"]: the
          device kit's PyTorch norms and activations are fused around the attention op, as
          vLLM's compiled ops would be; ``--no-vllm-compile`` gives mode 0, every op eager),
          chunked prefill with 16384-token steps, no prefix caching. On the device kit's vLLM,
          whose KV write is a PyTorch stand-in (several kernels per layer, model-dtype caches
          only), the child first registers ``benchmarks.kit_stand_ins``' write: vLLM's own
          fused Triton write, which vLLM's backends then write through as they would through
          the compiled op of a full install (evenkv writes with its own kernel; one process,
          so tensor parallelism 1).
  sglang  the HTTP server (``python -m sglang.launch_server``), started per backend and
          driven by a streaming client on localhost (aiohttp), as an operator runs it; the
          client sends requests in arrival order, each after the one before it has its
          response headers, so both servers queue them in the same order. The
          default is ``fa3`` (SGLang's Hopper default), ``triton`` a second baseline.

Start-up, apart from the workloads: ``startup_s`` is the wall time to a ready engine (vLLM:
from the child's start, imports included; SGLang: from the server's launch to a healthy
``/health``), ``engine_init_s`` the engine's own part (vLLM: the ``LLM()`` call; SGLang: the
server's first log line to a healthy ``/health``), ``import_s`` the engine imports (vLLM);
``startup_phases`` the phases the engine itself logs (``engine_startup_phases``: vLLM's Dynamo
transform, torch.compile, graph capture and init engine; SGLang's startup timings, graph capture
per forward mode included), evenkv's kernel builds, and stretches between timestamped log lines
where the engines log no duration (vLLM's profile run, warm-up and capture, and what follows
capture; SGLang's scheduler spawn). A workload a child did not finish (its
time ran out: ``stopped``; the engine failed: ``error: ...``) still gets a row
with the start-up figures measured. ``--startup-only`` starts and stops each engine, sized for
``--workloads`` as a full run would be, and serves nothing: one row per child, workload
``startup:<workloads>``, with the start-up figures alone (cheap start-up pairs, e.g. both start
orders with a cold and a warm cache).
Children start in an order that rotates per (mode, shape) group and per repeat
(``child_order``; ``--first`` picks who starts the first group); ``start_order`` is a child's
position in the whole run. The first engine started on a freshly started machine can take tens
of seconds longer than the same start later; ``--untimed-start`` starts the first child's
engine once, untimed, before the timed children. ``--triton-cache fresh`` gives each child an empty
``TRITON_CACHE_DIR``; ``shared`` keeps one per (engine, mode, tp, shape, backend) across
children and runs (``--triton-cache-dir``), so with ``--repeats 2`` the second repeat starts warm;
vLLM's torch.compile cache (``VLLM_CACHE_ROOT``) and Inductor's (``TORCHINDUCTOR_CACHE_DIR``)
follow the same rule, in folders beside the Triton one;
``triton_cache`` says whether a child found its cache empty (cold), filled by an earlier start
that reached ready (warm), or only by starts that were stopped before it (partial). Triton
compiles are counted in the cache directory: at start-up, during the untimed warm-up
requests after ready (``compiled_during_warmup``, kernel names) and during each workload
(``triton_compiles_run`` and ``compiled_during_run``, kernel names, ``;``-joined); the
start-up compiles' names are in ``DIR/compiled-startup-<child>.txt``.

Metrics per (engine, mode, tp, shape, backend, workload): output tokens/s, requests/s, TTFT
and TPOT p50/p99 (TPOT = (last token time - first token time) / (tokens - 1) per request),
decode step p50 (vLLM), peak requests in flight, ``tokens_per_step`` (new tokens per request
per engine step after its first: 1 without speculation, more when drafts were accepted;
SGLang reports it only under speculation, from its verify-step count). KV room, sampled from
vLLM's scheduler after every engine step and from the batches SGLang's scheduler logs (each
prefill batch and every 40th decode batch): ``kv_usage_peak``, the fullest any KV pool got,
and ``kv_full_queued``, "n/m" of the m samples that found a pool full (>= 0.98) with requests
waiting. Where n > 0 the workload's pace
was partly admission (when a pool frees room: on SGLang's hybrid pool, when tokens leave the
window), which moves with small timing differences, so its ratios vary more from run to run
than the steps' speed does.
``run`` is the parent invocation's start (UTC), so the rows of several invocations merged into
one CSV stay apart: ``summary.md`` gives each backend's ratios to the engine's default backend
in the same run, mode, tp, shape, workload and repeat, and its start-up difference.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PROCESS_START = time.time()  # a child's start-up is counted from here
VOCAB_LOW = 3  # random prompt ids skip the special ids 0..2
CHUNK_TOKENS = 16384  # tokens per engine step (chunked prefill), both engines

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "rope_theta": 1000000.0,
         "use_sliding_window": False}
MELLUM_LAYERS = 28
# Mellum's config (transformers' MellumConfig fields): layer_types route each layer to a window
# or full attention, mlp_layer_types to a dense or MoE MLP (dense here, so no expert fields).
MELLUM = {"architectures": ["MellumForCausalLM"], "model_type": "mellum", "vocab_size": 98304, "sliding_window": 1024,
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
          "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(MELLUM_LAYERS)],
          "mlp_layer_types": ["dense"] * MELLUM_LAYERS}
SHAPES = {
    "qwen3-8b": dict(QWEN3, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36),
    "qwen3-30b-a3b-attn": dict(QWEN3, num_attention_heads=32, num_key_value_heads=4, hidden_size=2048,
                               intermediate_size=6144, num_hidden_layers=48),
    "mellum-swa": dict(MELLUM, num_attention_heads=32, num_key_value_heads=4, hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=MELLUM_LAYERS),
}
ENGINE_BACKENDS = {"vllm": {"evenkv": "CUSTOM"}, "sglang": {}}
DEFAULT_BACKEND = {"vllm": "FLASH_ATTN", "sglang": "fa3"}
BASELINES = {"vllm": ["FLASH_ATTN"], "sglang": ["fa3", "triton"]}  # run beside evenkv by default
WORKLOADS = ("chat", "chat-rate", "long-mix", "long-context", "prefill-heavy", "many-short")
MODES = ("default", "batch-invariant", "spec-ngram")
COLUMNS = ["engine", "engine_version", "mode", "tp", "kv_cache_dtype", "shape", "backend", "workload", "graphs",
           "torch_compile", "spec", "repeat", "run", "start_order", "requests", "prompt_tokens", "output_tokens", "makespan_s", "output_tok_s",
           "requests_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "decode_step_p50_ms",
           "decode_steps", "tokens_per_step", "max_in_flight", "kv_usage_peak", "kv_full_queued", "mem_fraction",
           "startup_s", "engine_init_s", "import_s",
           "startup_phases", "triton_cache", "triton_compiles_startup", "compiled_during_warmup", "triton_compiles_run",
           "compiled_during_run", "status"]


# -- models ------------------------------------------------------------------------------------


def write_model(shape: str, directory: Path, max_positions: int) -> Path:
    """The config.json of ``shape`` in ``directory`` (the engines load dummy weights)."""
    cfg = {"head_dim": 128, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
           "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
           "use_cache": True, **SHAPES[shape]}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


# -- workloads -------------------------------------------------------------------------------


@dataclass
class Workload:
    """Requests of one workload: prompt and output lengths (tokens) and arrival times (s from start)."""

    name: str
    prompt_lens: list[int]
    output_lens: list[int]
    arrivals: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.arrivals:
            self.arrivals = [0.0] * len(self.prompt_lens)

    @property
    def max_len(self) -> int:
        return max(p + o for p, o in zip(self.prompt_lens, self.output_lens))


def _chat_lens(rng: random.Random, n: int, out_lo: int, out_hi: int, median: int = 1000, lo: int = 100,
               hi: int = 8192):
    prompts = [min(hi, max(lo, round(rng.lognormvariate(math.log(median), 0.8)))) for _ in range(n)]
    return prompts, [rng.randint(out_lo, out_hi) for _ in range(n)]


def _insert_long(prompts: list[int], outs: list[int], long_lens: list[int], long_out: int):
    """Put the long requests evenly among the short ones, as they would sit in live traffic."""
    for i, n in enumerate(long_lens):
        prompts.insert((i + 1) * len(prompts) // (len(long_lens) + 1), n)
        outs.insert((i + 1) * len(outs) // (len(long_lens) + 1), long_out)


def make_workload(name: str, size: str = "quick", seed: int = 0, rate: float = 16.0) -> Workload:
    """The named workload at ``size`` ("full" or "quick"), deterministic in ``seed``."""
    if size not in ("full", "quick"):
        raise ValueError(f"size: expected 'full' or 'quick', got {size!r}")
    full = size == "full"
    rng = random.Random(f"{name}-{size}-{seed}")
    if name in ("chat", "chat-rate"):
        n = 512 if full else (256 if name == "chat" else 128)
        prompts, outs = _chat_lens(rng, n, *((128, 1024) if full else (32, 256)))
        arrivals = []
        if name == "chat-rate":
            t = 0.0
            for _ in range(n):
                arrivals.append(t)
                t += rng.expovariate(rate)
        return Workload(name, prompts, outs, arrivals)
    if name == "long-mix":
        n_long, n_short = (4, 1200) if full else (2, 1100)
        prompts, outs = _chat_lens(rng, n_short, 256, 256) if full else _chat_lens(rng, n_short, 64, 64, 256, 16, 1024)
        long_lens = [rng.randint(65536, 131072) for _ in range(n_long)]
        _insert_long(prompts, outs, long_lens, outs[0])
        return Workload(name, prompts, outs)
    if name == "long-context":
        prompts, outs = [2048] * 28, [128] * 28
        _insert_long(prompts, outs, [65536] * 4, 128)
        return Workload(name, prompts, outs)
    if name == "prefill-heavy":
        n = 64 if full else 16
        return Workload(name, [rng.randint(8192, 32768) for _ in range(n)], [64] * n)
    if name == "many-short":
        n = 2048
        return Workload(name, [rng.randint(150, 250) for _ in range(n)], [512 if full else 96] * n)
    raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {name!r}")


def prompt_ids(w: Workload, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB_LOW, vocab, (n,), generator=g).tolist() for n in w.prompt_lens]


# -- metrics ---------------------------------------------------------------------------------


@dataclass
class RequestTiming:
    """One request's life, in seconds from the workload's start."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    steps: int = 0  # engine steps that brought new tokens (vLLM), SGLang's verify steps + 1 (0 without speculation)

    def record(self, now: float, new_tokens: int):
        if new_tokens <= 0:
            return
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens += new_tokens
        self.steps += 1


def quantile(xs, q: float) -> float | None:
    """Nearest-rank quantile of ``xs`` (None when empty)."""
    s = sorted(xs)
    if not s:
        return None
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(w: Workload, timings: list[RequestTiming], decode_steps: list[float], max_in_flight: int) -> dict:
    """The CSV metrics of one finished workload. A request that produced no token counts in
    neither TTFT nor TPOT and makes the status ``incomplete``."""
    done = [t for t in timings if t.first_token is not None]
    end = max((t.last_token for t in done), default=0.0)
    out_tokens = sum(t.tokens for t in timings)
    ttft = [t.first_token - t.arrival for t in done]
    tpot = [(t.last_token - t.first_token) / (t.tokens - 1) for t in done if t.tokens > 1]
    # The first step brings the first token alone; each later step 1 + the accepted drafts.
    per_step = [(t.tokens - 1) / (t.steps - 1) for t in done if t.steps > 1]

    def ms(v):
        return None if v is None else round(v * 1e3, 3)

    short = [t for t, n in zip(timings, w.output_lens) if t.tokens < n]
    return {"workload": w.name, "requests": len(w.prompt_lens), "prompt_tokens": sum(w.prompt_lens),
            "output_tokens": out_tokens, "makespan_s": round(end, 3),
            "output_tok_s": round(out_tokens / end, 1) if end else None,
            "requests_s": round(len(done) / end, 3) if end else None,
            "ttft_p50_ms": ms(quantile(ttft, 0.5)), "ttft_p99_ms": ms(quantile(ttft, 0.99)),
            "tpot_p50_ms": ms(quantile(tpot, 0.5)), "tpot_p99_ms": ms(quantile(tpot, 0.99)),
            "decode_step_p50_ms": ms(quantile(decode_steps, 0.5)), "decode_steps": len(decode_steps),
            "tokens_per_step": round(sum(per_step) / len(per_step), 3) if per_step else None,
            "max_in_flight": max_in_flight, "status": "ok" if not short else f"incomplete:{len(short)}"}


# -- vLLM (in-process engine, stepped by hand) ----------------------------------------------------


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes to capture: fine steps up to 256, then at most 12.5 % padding."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    sizes += list(range(320, 1025, 64)) + list(range(1152, 2049, 128))
    return [s for s in sizes if s < max_batch] + [max_batch]


@dataclass(frozen=True)
class EngineSetup:
    """What a child's engine runs with besides the backend: the mode, tensor parallelism,
    the KV cache's dtype, CUDA graphs, vLLM's torch.compile mode and the n-gram speculation knobs."""

    mode: str = "default"
    tp: int = 1
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8" (e4m3, per-tensor scales)
    graphs: bool = True
    torch_compile: int = 0  # vLLM compilation mode: 0 (off) or 3 (VLLM_COMPILE)
    spec_tokens: int = 3  # spec-ngram: draft tokens per step (vLLM K; SGLang verifies K + 1 tokens)
    ngram_min: int = 2  # spec-ngram, vLLM: shortest n-gram matched
    ngram_max: int = 4  # spec-ngram, vLLM: longest n-gram matched
    ngram_breadth: int = 1  # spec-ngram, SGLang: BFS breadth (1 = a chain of drafts)

    def spec_label(self, engine: str) -> str:
        if self.mode != "spec-ngram":
            return ""
        if engine == "vllm":
            return f"ngram:k={self.spec_tokens},n={self.ngram_min}-{self.ngram_max}"
        return f"NGRAM:draft={self.spec_tokens + 1},breadth={self.ngram_breadth}"


def mode_env(engine: str, mode: str) -> dict:
    """Environment variables a mode needs in the engine's process (set before the engine imports)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    return {"VLLM_BATCH_INVARIANT": "1"} if engine == "vllm" and mode == "batch-invariant" else {}


def vllm_llm_kwargs(model: Path, backend: str, max_model_len: int, max_num_seqs: int, mem: float,
                    setup: EngineSetup) -> dict:
    """The ``vllm.LLM`` arguments of one child (batch-invariant mode is an environment variable)."""
    compilation = {"mode": setup.torch_compile, "custom_ops": ["none"]}
    # A decode step of a speculative batch holds 1 + K tokens per request: graph sizes are in tokens.
    per_request = 1 + setup.spec_tokens if setup.mode == "spec-ngram" else 1
    if setup.graphs:
        compilation.update(cudagraph_mode="FULL_DECODE_ONLY",
                           cudagraph_capture_sizes=[s * per_request for s in capture_sizes(max_num_seqs)])
    else:
        compilation["cudagraph_mode"] = "NONE"
    kw = dict(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              attention_backend=backend, gpu_memory_utilization=mem, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=CHUNK_TOKENS, enable_chunked_prefill=True,
              enable_prefix_caching=False, async_scheduling=False, seed=0, enforce_eager=not setup.graphs,
              tensor_parallel_size=setup.tp, compilation_config=compilation,
              # The device kit's vLLM has no compiled _C: norms run as PyTorch ops for every backend alike.
              kernel_config={"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}})
    if setup.kv_cache_dtype == "fp8":
        kw["kv_cache_dtype"] = "fp8"
    if setup.mode == "spec-ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": setup.spec_tokens,
                                    "prompt_lookup_min": setup.ngram_min, "prompt_lookup_max": setup.ngram_max}
    return kw


def vllm_llm(model: Path, backend: str, max_model_len: int, max_num_seqs: int, mem: float, setup: EngineSetup):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    if backend == "CUSTOM":  # the entry point covers installs; this covers a checkout on PYTHONPATH
        from evenkv.integrations.vllm import register

        register()
    from benchmarks import kit_stand_ins

    if kit_stand_ins.runs_on_stand_ins():
        kit_stand_ins.install_kv_write()  # vLLM's fused write for its own backends, as in a full install
    return LLM(**vllm_llm_kwargs(model, backend, max_model_len, max_num_seqs, mem, setup))


def vllm_serve(llm, w: Workload, prompts: list[list[int]]) -> dict:
    """Run ``w`` through ``llm``'s engine: requests join when their arrival time has passed."""
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    render = getattr(llm, "_preprocess_cmpl_one", None)  # how LLM.generate renders a prompt, where it exists
    timings = [RequestTiming(a) for a in w.arrivals]
    order = sorted(range(len(prompts)), key=lambda i: w.arrivals[i])
    index, next_arrival, unfinished, started = {}, 0, set(), set()
    decode_steps, max_in_flight, pool_states = [], 0, []
    tag = time.time_ns()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while next_arrival < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while next_arrival < len(order) and w.arrivals[order[next_arrival]] <= now:
            i = order[next_arrival]
            sp = SamplingParams(temperature=0.0, max_tokens=w.output_lens[i], ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
            prompt = {"prompt_token_ids": prompts[i]}
            rid = f"{w.name}-{i}-{tag}"
            index[rid] = index[engine.add_request(rid, render(prompt) if render else prompt, sp)] = i
            unfinished.add(i)
            next_arrival += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, w.arrivals[order[next_arrival]] - now))
            continue
        max_in_flight = max(max_in_flight, len(unfinished))
        decoding = unfinished <= started
        ts = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter() - t0
        if decoding:
            decode_steps.append(now - (ts - t0))
        state = vllm_pool_state(engine)
        if state is not None:
            pool_states.append(state)
        for o in outs:
            i = index[o.request_id]
            timings[i].record(now, len(o.outputs[0].token_ids))
            started.add(i)
            if o.finished:
                unfinished.discard(i)
    return {**summarize(w, timings, decode_steps, max_in_flight), **pool_pressure(pool_states)}


def vllm_pool_state(engine) -> tuple[float, int] | None:
    """(KV cache usage in [0, 1], requests waiting) of an in-process vLLM engine's scheduler
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ``LLMEngine.engine_core`` is an ``InprocClient``
    holding the ``EngineCore``), or None where a vLLM keeps them elsewhere. Requests its
    scheduler set aside this step (``skipped_waiting``, where it has one) wait too."""
    scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
    manager = getattr(scheduler, "kv_cache_manager", None)
    if manager is None or not hasattr(scheduler, "waiting"):
        return None
    return float(manager.usage), len(scheduler.waiting) + len(getattr(scheduler, "skipped_waiting", ()))


# -- SGLang (HTTP server, streaming client) ----------------------------------------------------


def sglang_server_cmd(model: Path, backend: str, port: int, max_model_len: int, max_running: int, mem: float,
                      setup: EngineSetup) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--load-format", "dummy",
           "--attention-backend", backend, "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--sampling-backend", "pytorch", "--dtype", "bfloat16", "--mem-fraction-static", str(mem),
           "--context-length", str(max_model_len), "--max-running-requests", str(max_running),
           "--chunked-prefill-size", str(CHUNK_TOKENS), "--disable-radix-cache", "--random-seed", "0",
           "--tp-size", str(setup.tp), "--log-level", "info"]
    cmd += ["--cuda-graph-max-bs-decode", str(max_running)] if setup.graphs else ["--disable-cuda-graph"]
    if setup.kv_cache_dtype == "fp8":
        cmd += ["--kv-cache-dtype", "fp8_e4m3"]
    if setup.mode == "batch-invariant":
        cmd += ["--enable-deterministic-inference"]
    elif setup.mode == "spec-ngram":
        # SGLang counts the verified row's tokens (the last accepted token + K drafts) as draft tokens.
        cmd += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(setup.spec_tokens + 1),
                "--speculative-ngram-min-bfs-breadth", "1",
                "--speculative-ngram-max-bfs-breadth", str(setup.ngram_breadth)]
    return cmd


def stream_meta(body_lines):
    """The ``meta_info`` of each of SGLang's ``/generate`` server-sent events (``completion_tokens``
    so far; ``spec_verify_ct``, the verify steps, under speculative decoding); the stream ends
    with ``data: [DONE]``."""
    for raw in body_lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)["meta_info"]


async def http_serve(url: str, w: Workload, prompts: list[list[int]]) -> dict:
    """Send ``w`` to a running server's ``/generate`` (streaming) at the workload's arrival times."""
    import aiohttp

    timings = [RequestTiming(a) for a in w.arrivals]
    in_flight = [0, 0]  # now, peak
    # Requests go out in arrival order (index order among simultaneous ones), each once the one
    # before it has its response headers: SGLang sends them as its handler takes the request,
    # so every server queues the requests in the same order. Sent concurrently, they reach the
    # server's queue in an order that differs from run to run, and with it which requests
    # wait behind the long prompts' prefill.
    order = sorted(range(len(prompts)), key=lambda i: (w.arrivals[i], i))
    taken = {i: asyncio.Event() for i in order}
    before = dict(zip(order[1:], order))

    async def one(session, i: int, t0: float):
        await asyncio.sleep(max(0.0, w.arrivals[i] - (time.perf_counter() - t0)))
        if i in before:
            await taken[before[i]].wait()
        body = {"input_ids": prompts[i], "stream": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": w.output_lens[i], "ignore_eos": True}}
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        seen, verify_steps = 0, 0
        try:
            r = await session.post(url + "/generate", json=body)
        finally:
            taken[i].set()
        async with r:
            if r.status != 200:
                raise RuntimeError(f"/generate answered {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                for meta in stream_meta([line]):
                    count = meta["completion_tokens"]
                    timings[i].record(time.perf_counter() - t0, count - seen)
                    seen = max(seen, count)
                    verify_steps = meta.get("spec_verify_ct", verify_steps)
        # The server may merge steps into one event under load, so events do not count steps;
        # under speculation the server counts its verify steps (the prefill brings the first token).
        timings[i].steps = verify_steps + 1 if verify_steps else 0
        in_flight[0] -= 1

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, i, t0) for i in range(len(prompts))))
    return summarize(w, timings, [], in_flight[1])


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, paths: tuple[str, ...] = ("/health",)) -> float:
    """Seconds until every one of ``paths`` answers 200; raises if the server exits first or
    is not ready after ``timeout_s``."""
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            for path in paths:
                with urllib.request.urlopen(url + path, timeout=5) as r:
                    if r.status != 200:
                        raise OSError(r.status)
            return time.time() - t0
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen):
    """SIGTERM to the server's process group, SIGKILL to whatever is left after 20 s."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            time.sleep(1)
        except subprocess.TimeoutExpired:
            pass


BINARY_SUFFIXES = (".cubin", ".hsaco")


# Left in a Triton cache by a child whose engine reached ready: the start-up compiles are all in.
READY_MARK = ".evenkv-serving-ready"


def cache_state(cache_dir: Path, compiled: dict) -> str:
    """The state of a child's Triton cache at its start: cold (no compiled kernel), warm (an
    earlier start reached ready with it) or partial (kernels only from starts stopped before
    ready). compiled: ``compiled_kernels(cache_dir)``."""
    if not compiled:
        return "cold"
    return "warm" if (cache_dir / READY_MARK).exists() else "partial"


def compiled_kernels(cache_dir: Path) -> dict[str, str]:
    """{cache entry: kernel name} of the Triton kernels compiled into ``cache_dir``: Triton
    keeps each compiled specialization in its own folder, beside the binary a ``NAME.json``
    whose ``name`` field is the kernel's name."""
    found = {}
    if not cache_dir.exists():
        return found
    for entry in sorted(d for d in cache_dir.iterdir() if d.is_dir()):
        for binary in sorted(f for f in entry.iterdir() if f.suffix in BINARY_SUFFIXES):
            try:
                name = json.loads(binary.with_suffix(".json").read_text()).get("name", binary.stem)
            except (OSError, ValueError):
                name = binary.stem
            found[entry.name] = name
            break
    return found


def compiled_since(before: dict[str, str], cache_dir: Path) -> list[str]:
    """Names of the kernels compiled into ``cache_dir`` since ``before`` (sorted; repeats kept)."""
    return sorted(name for entry, name in compiled_kernels(cache_dir).items() if entry not in before)


# -- child: one engine, one shape, one backend --------------------------------------------------


# The last line of a Python traceback ("torch.OutOfMemoryError: CUDA out of memory. ...").
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b: ")


# SGLang's scheduler logs each prefill batch and every 40th decode batch with each KV pool's
# usage ("token usage: 0.08", or "full token usage: ..., swa token usage: ..." on a hybrid pool)
# and the requests waiting for room ("#queue-req: 23").
_BATCH_LINE = re.compile(r"\b(Prefill|Decode) batch\b")
_POOL_USAGE = re.compile(r"token usage: ([\d.]+)")
_QUEUED = re.compile(r"#queue-req: (\d+)")
KV_FULL_USAGE = 0.98  # a pool this full admits no request that needs room


def batch_pool_state(line: str) -> tuple[float, int] | None:
    """(the fullest KV pool's usage, requests queued) of one SGLang batch log line, else None."""
    if not _BATCH_LINE.search(line):
        return None
    usage = [float(u) for u in _POOL_USAGE.findall(line)]
    queued = _QUEUED.search(line)
    if not usage or queued is None:
        return None
    return max(usage), int(queued.group(1))


def pool_pressure(states: list[tuple[float, int]]) -> dict:
    """A workload's KV room from its (fullest pool's usage, requests waiting) samples:
    ``kv_usage_peak``, the fullest any pool was, and ``kv_full_queued``, "n/m": n of the m
    samples found a pool at least KV_FULL_USAGE full with requests waiting. Where n > 0 the
    workload's pace was set partly by admission (how soon the pools free room), not only by the
    steps' speed. Empty cells without samples."""
    if not states:
        return {"kv_usage_peak": "", "kv_full_queued": ""}
    full = sum(usage >= KV_FULL_USAGE and queued > 0 for usage, queued in states)
    return {"kv_usage_peak": max(usage for usage, _ in states), "kv_full_queued": f"{full}/{len(states)}"}


class ServerLog:
    """Copies a server's output to this process's stdout and remembers when its first line came
    (the server's imports are done then), so start-up splits into imports and engine init; the
    last exception it printed, so a failed workload's row names the server's error, not only what
    the client saw of it; and the KV pools' state at each batch the server logged, so a row says
    whether its workload waited for KV room (``pool_pressure``)."""

    def __init__(self, proc: subprocess.Popen):
        import threading

        self.first_line_at: float | None = None
        self.last_exception: str | None = None
        self.batches: list[tuple[float, int]] = []  # batch_pool_state of each batch line
        self._thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _pump(self, stream):
        for line in stream:
            if self.first_line_at is None:
                self.first_line_at = time.time()
            if _EXCEPTION_LINE.match(line):
                self.last_exception = line.strip()
            state = batch_pool_state(line)
            if state is not None:
                self.batches.append(state)
            sys.stdout.write(line)
        sys.stdout.flush()

    def pool_pressure(self, since: int) -> dict:
        """``pool_pressure`` over the batches logged from index ``since``. The lines arrive
        through a pipe while the client runs, so a batch logged in a workload's last
        milliseconds may count toward the next one."""
        return pool_pressure(self.batches[since:])

    def exception(self, wait_s: float = 2.0) -> str | None:
        """The last exception line the server printed, once its output has drained (up to
        ``wait_s`` seconds while it still runs)."""
        self._thread.join(wait_s)
        return self.last_exception


def child_setup(a) -> EngineSetup:
    return EngineSetup(mode=a.mode, tp=a.tp, kv_cache_dtype=a.kv_cache_dtype, graphs=a.graphs,
                       torch_compile=3 if a.vllm_compile else 0,
                       spec_tokens=a.spec_tokens, ngram_min=a.ngram_min, ngram_max=a.ngram_max,
                       ngram_breadth=a.ngram_breadth)


# SGLang's fa3 baseline with n-gram speculation captures verify graphs for up to 1102
# requests; where FA3 starts splitting KV (992 requests and fewer) each graph holds a split
# workspace of about 1.7 GiB: its capture ran out of memory at 0.9 of the GPU for weights and KV
# on the H200 and at 0.85 on an 80 GB H100. Both backends of a mode get the same fraction.
DEFAULT_MEMORY_FRACTION = 0.9
SGLANG_SPEC_MEMORY_FRACTION = 0.8


def memory_fraction(engine: str, mode: str, mem: float | None) -> float:
    """The fraction of GPU memory for weights and KV cache: ``--mem`` when given, else 0.9, or
    0.8 for SGLang in spec-ngram mode (its fa3 baseline's graph capture needs the room)."""
    if mem is not None:
        return mem
    return SGLANG_SPEC_MEMORY_FRACTION if (engine, mode) == ("sglang", "spec-ngram") else DEFAULT_MEMORY_FRACTION


def run_child(a, rows: list[dict]):
    """Start the engine once and run every workload, appending one result row per workload to ``rows``."""
    works = [make_workload(n, a.size, a.seed, a.rate) for n in a.workloads.split(",")]
    # The rows this child owes: one per workload, or one for the start-up alone.
    row_names = ["startup:" + a.workloads] if a.startup_only else [w.name for w in works]
    # A margin over the longest request: SGLang stops a request one token short of its context length.
    max_len = max(w.max_len for w in works) + 16
    max_seqs = max(len(w.prompt_lens) for w in works)
    model = write_model(a.shape, Path(a.model_dir) / a.shape, max_len)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    backend = ENGINE_BACKENDS[a.engine].get(a.backend, a.backend)
    setup = child_setup(a)
    os.environ.update(mode_env(a.engine, a.mode))
    base = {"engine": a.engine, "mode": a.mode, "tp": a.tp, "kv_cache_dtype": a.kv_cache_dtype, "shape": a.shape,
            "backend": a.backend, "graphs": int(a.graphs), "torch_compile": setup.torch_compile if a.engine == "vllm" else "",
            "spec": setup.spec_label(a.engine), "repeat": a.repeat, "start_order": a.start_order}
    # The parent gives each child its TRITON_CACHE_DIR (fresh, or shared across children).
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or tempfile.mkdtemp(prefix="evenkv-triton-cache-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    at_start = compiled_kernels(cache)
    base["triton_cache"] = cache_state(cache, at_start)
    mem = memory_fraction(a.engine, a.mode, a.mem)
    base["mem_fraction"] = mem
    warmup = Workload("warmup", [64, 3000, 17], [8, 8, 8])  # untimed: whatever loads lazily on first use
    finished, proc, server_log = set(), None, None
    try:
        if a.engine == "vllm":
            t = time.time()
            import vllm
            from vllm import LLM  # noqa: F401  (the import cost belongs to import_s)

            t_llm = time.time()
            base.update(engine_version=vllm.__version__, import_s=round(t_llm - t, 1))
            llm = vllm_llm(model, backend, max_len, max_seqs, mem, setup)
            base.update(engine_init_s=round(time.time() - t_llm, 1), startup_s=round(time.time() - PROCESS_START, 1))
            serve = lambda w: vllm_serve(llm, w, prompt_ids(w, vocab, a.seed))  # noqa: E731
        else:
            import sglang

            base["engine_version"] = sglang.__version__
            url = f"http://127.0.0.1:{a.port}"
            cmd = sglang_server_cmd(model, backend, a.port, max_len, max_seqs, mem, setup)
            print("[serving] " + " ".join(cmd), flush=True)
            t = time.time()
            proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", bufsize=1)
            server_log = ServerLog(proc)
            serve = lambda w: asyncio.run(http_serve(url, w, prompt_ids(w, vocab, a.seed)))  # noqa: E731
            wait_healthy(url, proc, a.startup_timeout)
            ready = time.time()
            base["startup_s"] = round(ready - t, 1)
            base["engine_init_s"] = round(ready - (server_log.first_line_at or t), 1)
        cache.mkdir(parents=True, exist_ok=True)
        (cache / READY_MARK).touch()
        startup = compiled_since(at_start, cache)
        base["triton_compiles_startup"] = len(startup)
        if a.compiled_startup_file:
            Path(a.compiled_startup_file).write_text("".join(n + "\n" for n in startup))
        if a.startup_only:
            rows.append({**base, "workload": row_names[0], "status": "ok"})
            finished.add(row_names[0])
            return
        before = compiled_kernels(cache)
        serve(warmup)
        base["compiled_during_warmup"] = ";".join(compiled_since(before, cache))
        for w in works:
            print(f"[serving] {a.engine} {a.mode} {a.shape} {a.backend}: {w.name} ({len(w.prompt_lens)} requests)",
                  flush=True)
            before = compiled_kernels(cache)
            logged = len(server_log.batches) if server_log is not None else 0
            row = serve(w)
            if server_log is not None:
                row.update(server_log.pool_pressure(logged))
            during = compiled_since(before, cache)
            rows.append({**base, **row, "triton_compiles_run": len(during), "compiled_during_run": ";".join(during)})
            finished.add(w.name)
            print(f"[serving]   {rows[-1]}", flush=True)
    except BaseException as error:
        # A row for each workload that did not finish, with the start-up figures measured so far.
        status = unfinished_status(error, server_log.exception() if server_log is not None else None)
        rows.extend({**base, "workload": name, "status": status} for name in row_names if name not in finished)
        raise
    finally:
        if proc is not None:
            stop_server(proc)


def unfinished_status(error: BaseException, server_error: str | None = None) -> str:
    """The status of a workload the child did not finish: ``stopped`` when the parent's budget ran
    out (its SIGTERM exits with 143), else ``error: <exception>``, led by the server's own last
    exception line where it printed one (a server that dies mid-run shows the client only a
    cut-off response)."""
    if isinstance(error, SystemExit) and error.code == 143:
        return "stopped"
    text = _clip(f"{type(error).__name__}: {error}".replace("\n", " "))
    return f"error: server: {_clip(server_error)}; client: {text}" if server_error else f"error: {text}"


def _clip(text: str, limit: int = 160) -> str:
    return text[:limit] + "..." if len(text) > limit else text


# -- parent: children, CSV, summary, plots ---------------------------------------------------------


_VLLM_PHASES = (("dynamo", r"Dynamo bytecode transform time: ([\d.]+) s"),
                ("torch_compile", r"torch\.compile took ([\d.]+) s in total"),
                ("capture", r"Graph capturing finished in ([\d.]+) secs"),
                ("init_engine", r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"))
_EVENKV_BUILDS = r"evenkv: kernels of \d+ attention object\(s\) built or loaded in ([\d.]+) s"
# Stretches between two logged lines (whole seconds: both engines log wall time to the second),
# where the engines log no duration: (name, first line, last line). vLLM: from the model load to
# the KV-cache sizing (the profile run), from there to the end of graph capture (kernel warm-up,
# evenkv's builds, capture), and from there to the end of init engine (sampler warm-up, vLLM's
# own Triton compiles). SGLang: from the server's arguments to the scheduler's first step (the
# scheduler process's spawn and imports).
_LOG_STRETCHES = {
    "vllm": (("load_to_kv_sizing", r"Model loading took", r"Available KV cache memory"),
             ("kv_sizing_to_captured", r"Available KV cache memory", r"Graph capturing finished"),
             ("captured_to_ready", r"Graph capturing finished", r"init engine \(profile")),
    "sglang": (("scheduler_spawn", r"server_args=ServerArgs\(", r"Init torch distributed begin"),),
}
# A line's wall time: vLLM's "INFO 12-06 06:52:27" (after "(EngineCore pid=N) " where the engine
# core is a process of its own), SGLang's "[2026-12-06 06:59:45]" (" TP0]" with several ranks).
_LOG_TIME = {"vllm": r"^(?:\(.*?\) )?[A-Z]+ \d\d-\d\d (\d\d):(\d\d):(\d\d)",
             "sglang": r"^\[\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d)"}


def _log_stretches(log: str, engine: str) -> dict[str, float]:
    """The ``_LOG_STRETCHES`` of ``engine`` found in ``log``, in seconds: from the first line that
    matches the first pattern to the first later line that matches the second (a day boundary
    between them is one day less). A stretch whose lines are missing is left out."""
    times = []
    for line in log.splitlines():
        stamp = re.match(_LOG_TIME.get(engine, "$^"), line)
        if stamp:
            h, m, sec = (int(x) for x in stamp.groups())
            times.append((h * 3600 + m * 60 + sec, line))
    stretches = {}
    for name, first, last in _LOG_STRETCHES.get(engine, ()):
        start = next((i for i, (_, line) in enumerate(times) if re.search(first, line)), None)
        if start is None:
            continue
        end = next((t for t, line in times[start:] if re.search(last, line)), None)
        if end is not None:
            stretches[name] = float((end - times[start][0]) % 86400)
    return stretches


def engine_startup_phases(log: str, engine: str) -> str:
    """The start-up phases an engine logged (seconds, ``name=value`` joined by ``;``): vLLM's
    Dynamo transform, torch.compile total, graph capture (whole seconds, as vLLM logs it) and
    init engine; SGLang's "Engine startup timings" line, graph captures per forward mode as
    ``cuda_graph.<mode>`` (zeros left out); ``evenkv_builds``, evenkv's kernel builds or
    loads; and the ``_LOG_STRETCHES`` between timestamped lines. A phase logged more than once (one line per tensor-parallel worker) counts its
    longest. Empty when the log has none of them."""
    phases: dict[str, float] = {}

    def put(name: str, value: str):
        phases[name] = max(phases.get(name, 0.0), float(value))

    patterns = list(_VLLM_PHASES) if engine == "vllm" else []
    for name, pattern in patterns + [("evenkv_builds", _EVENKV_BUILDS)]:
        for value in re.findall(pattern, log):
            put(name, value)
    if engine == "sglang":
        for line in re.findall(r"Engine startup timings \(s\): (.*)", log):
            nested = dict(re.findall(r"(\w+)=\{([^}]*)\}", line))
            for key, value in re.findall(r"(\w+)=([\d.]+)", re.sub(r"\w+=\{[^}]*\}", "", line)):
                put(key, value)
            for group, items in nested.items():
                for key, value in re.findall(r"(\w+)=([\d.]+)", items):
                    if float(value):
                        put(f"{group}.{key}", value)
    for name, seconds in _log_stretches(log, engine).items():
        put(name, str(seconds))
    return ";".join(f"{name}={value:g}" for name, value in phases.items())


def write_rows(path: Path, rows: list[dict]):
    """Append ``rows`` to the CSV at ``path``; a file written with other columns (an older
    version of this benchmark) is rewritten with the current ones, missing cells left empty."""
    header = None
    if path.exists():
        with path.open(newline="") as f:
            header = next(csv.reader(f), None)
    if header == COLUMNS:
        with path.open("a", newline="") as f:
            csv.DictWriter(f, COLUMNS, extrasaction="ignore").writerows(rows)
        return
    old = read_rows(path) if header else []
    with path.open("w", newline="") as f:
        wr = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(old + rows)


def read_rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def row_group(r: dict) -> tuple:
    """What a backend's row is compared on: the same engine, mode, tp, shape, workload, repeat,
    vLLM torch.compile mode, run and KV cache dtype (rows of older CSVs, without these columns,
    count as default mode, tp 1, repeat 1, compile mode 0, one run and an "auto" cache)."""
    return (r["engine"], r.get("mode") or "default", str(r.get("tp") or 1), r["shape"], r["workload"],
            str(r.get("repeat") or 1), str(r.get("torch_compile") or 0), r.get("run") or "",
            r.get("kv_cache_dtype") or "auto")


def ratios(rows: list[dict], engine: str, default: str) -> list[dict]:
    """Per (run, mode, tp, shape, workload, repeat) and backend != default: output tok/s ratio and
    TPOT p50 / TTFT p50 / decode step speed-ups (default's time over the backend's; higher is
    better, the default backend run in the same mode), and the start-up and engine-init
    differences in seconds (backend's minus default's; lower is better)."""
    ref = {row_group(r): r for r in rows if r["engine"] == engine and r["backend"] == default}
    out = []
    for r in rows:
        key = row_group(r)
        if r["engine"] != engine or r["backend"] == default or key not in ref:
            continue
        d = ref[key]

        def over(a, b):
            a, b = _num(a), _num(b)
            return round(a / b, 3) if a and b else None

        def minus(a, b):
            a, b = _num(a), _num(b)
            return round(a - b, 1) if a is not None and b is not None else None

        out.append({"run": key[7] or "–", "mode": key[1], "tp": key[2], "kv_cache_dtype": key[8],
                    "torch_compile": key[6], "shape": r["shape"], "workload": r["workload"], "repeat": key[5], "backend": r["backend"],
                    "tok_s_ratio": over(r["output_tok_s"], d["output_tok_s"]),
                    "tpot_p50_speedup": over(d["tpot_p50_ms"], r["tpot_p50_ms"]),
                    "ttft_p50_speedup": over(d["ttft_p50_ms"], r["ttft_p50_ms"]),
                    "decode_step_speedup": over(d.get("decode_step_p50_ms"), r.get("decode_step_p50_ms")),
                    "startup_delta_s": minus(r.get("startup_s"), d.get("startup_s")),
                    "engine_init_delta_s": minus(r.get("engine_init_s"), d.get("engine_init_s"))})
    return out


STARTUP_COLUMNS = ("engine", "mode", "tp", "torch_compile", "shape", "backend", "repeat", "start_order",
                   "triton_cache", "startup_s", "engine_init_s", "triton_compiles_startup", "startup_phases")


def startup_rows(rows: list[dict]) -> list[dict]:
    """One row per engine start (a child's workloads share its start-up), in the CSV's order,
    with the STARTUP_COLUMNS; starts that measured nothing of it are left out."""
    starts = {}
    for r in rows:
        key = (r.get("run") or "", *(str(r.get(c) or "") for c in STARTUP_COLUMNS[:8]))
        if key not in starts and (r.get("startup_s") or r.get("engine_init_s") or r.get("startup_phases")):
            starts[key] = {c: r.get(c) or "" for c in STARTUP_COLUMNS}
    return list(starts.values())


def summary_markdown(rows: list[dict], notes=()) -> str:
    lines = ["# Serving benchmark", ""] + [f"- {n}" for n in notes] + [""]
    cols = ["engine", "mode", "tp", "kv_cache_dtype", "torch_compile", "shape", "backend", "workload", "start_order",
            "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "decode_step_p50_ms", "tokens_per_step",
            "max_in_flight", "kv_full_queued", "startup_s", "engine_init_s", "triton_cache", "triton_compiles_startup",
            "triton_compiles_run", "status"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c) or "–") for c in cols) + " |" for r in rows]
    for engine in sorted({r["engine"] for r in rows}):
        rs = ratios(rows, engine, DEFAULT_BACKEND[engine])
        if not rs:
            continue
        lines += ["", f"## {engine}: against {DEFAULT_BACKEND[engine]} in the same mode (higher is better; "
                  "start-up: seconds more than it)", "",
                  "| run | mode | tp | KV cache | torch.compile | shape | workload | repeat | backend | "
                  "output tok/s ratio | TPOT p50 speed-up | TTFT p50 speed-up | decode step speed-up | start-up +s | "
                  "engine init +s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        keys = ("run", "mode", "tp", "kv_cache_dtype", "torch_compile", "shape", "workload", "repeat", "backend",
                "tok_s_ratio", "tpot_p50_speedup", "ttft_p50_speedup", "decode_step_speedup", "startup_delta_s",
                "engine_init_delta_s")
        lines += ["| " + " | ".join("–" if r[k] is None else str(r[k]) for k in keys) + " |" for r in rs]
    starts = startup_rows(rows)
    if starts:
        lines += ["", "## Start-up, one line per engine start (phases: as the engine logged them, seconds)", "",
                  "| " + " | ".join(STARTUP_COLUMNS) + " |", "|" + "---|" * len(STARTUP_COLUMNS)]
        lines += ["| " + " | ".join(str(r[c]) or "–" for c in STARTUP_COLUMNS) + " |" for r in starts]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for engine in sorted({r["engine"] for r in rows}):
        rs = ratios(rows, engine, DEFAULT_BACKEND[engine])
        if not rs:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(max(11, 0.7 * len(rs)), 3.8))
        # The fields that tell the bars apart: shape, tp, repeat and run only where there are several.
        varying = [k for k in ("shape", "tp", "torch_compile", "repeat", "run") if len({r[k] for r in rs}) > 1]
        labels = ["\n".join([r["workload"], r["mode"], r["backend"], *(f"{k} {r[k]}" for k in varying)]) for r in rs]
        for ax, key, title in ((axes[0], "tok_s_ratio", "output tokens/s"), (axes[1], "tpot_p50_speedup", "TPOT p50")):
            vals = [r[key] or 0 for r in rs]
            ax.bar(range(len(vals)), vals, color="#3b7dd8")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks(range(len(vals)), labels, fontsize=6)
            ax.set_title(f"{engine}: vs {DEFAULT_BACKEND[engine]} in the same mode, {title} (>1 better)", fontsize=9)
        fig.tight_layout()
        p = out_dir / f"{engine}-ratios.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def report(out_dir: Path, notes=()):
    rows = read_rows(out_dir / "serving.csv")
    (out_dir / "summary.md").write_text(summary_markdown(rows, notes))
    plot(rows, out_dir)
    print((out_dir / "summary.md").read_text(), flush=True)


def run_with_deadline(cmd: list[str], log, env: dict, seconds: float):
    """Run a child; past ``seconds`` it gets SIGTERM (it stops its server) and, 40 s later, SIGKILL."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return "timeout"


def split_list(values: list[str]) -> list[str]:
    """``--mode a --mode b,c`` -> [a, b, c] (order kept, repeats dropped)."""
    out = []
    for v in values:
        out += [x for x in v.split(",") if x and x not in out]
    return out


@dataclass(frozen=True)
class Child:
    repeat: int
    mode: str
    shape: str
    backend: str
    start_order: int  # 1-based position in the whole run

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.shape}-{self.backend}-r{self.repeat}"


def child_order(backends: list[str], modes: list[str], shapes: list[str], repeats: int,
                first: str | None = None) -> list[Child]:
    """Every (repeat, mode, shape, backend) child in start order. The backends' order rotates
    by one from each (mode, shape) group to the next within a repeat, and by one more each
    repeat, so each backend starts first in turn, within every (mode, shape) across repeats too
    (a first child pays the machine's cold caches); ``first`` starts the first group."""
    if first is not None and first not in backends:
        raise ValueError(f"first: expected one of the backends {backends}, got {first!r}")
    offset = backends.index(first) if first is not None else 0
    children = []
    for repeat in range(repeats):
        for g, (mode, shape) in enumerate((m, s) for m in modes for s in shapes):
            r = (offset + repeat + g) % len(backends)
            for backend in backends[r:] + backends[:r]:
                children.append(Child(repeat + 1, mode, shape, backend, len(children) + 1))
    return children


def untimed_start(a, first: Child, out: Path, seconds: float) -> None:
    """``--untimed-start``: start and stop ``first``'s engine once, with a Triton cache of its
    own, before the timed children, so that what a freshly started machine makes its first
    engine start pay lands on no child. Its log is
    ``untimed-start.log``; it writes no row."""
    scratch = Path(tempfile.mkdtemp(prefix="evenkv-untimed-start-"))
    c = Child(0, first.mode, first.shape, first.backend, 0)
    cmd = child_cmd(argparse.Namespace(**{**vars(a), "startup_only": True}), c, scratch / "rows.json",
                    scratch / "compiled.txt")
    print(f"[serving] untimed start: {a.engine} {c.mode} {c.shape} {c.backend} ({seconds:.0f} s)", flush=True)
    with (out / "untimed-start.log").open("w") as log:
        rc = run_with_deadline(cmd, log, {**os.environ, **compile_cache_env(str(scratch / "triton"))}, seconds)
    print(f"[serving] untimed start done ({rc})", flush=True)


def child_cmd(a, c: Child, rows_json: Path, startup_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.serving", "child", "--engine", a.engine, "--shape", c.shape,
           "--backend", c.backend, "--mode", c.mode, "--tp", str(a.tp), "--repeat", str(c.repeat),
           "--start-order", str(c.start_order), "--workloads", a.workloads, "--size", a.size, "--seed", str(a.seed),
           "--kv-cache-dtype", a.kv_cache_dtype,
           "--rate", str(a.rate), "--model-dir", a.model_dir, "--port", str(a.port),
           "--json", str(rows_json), "--compiled-startup-file", str(startup_file),
           "--startup-timeout", str(a.startup_timeout), "--spec-tokens", str(a.spec_tokens),
           "--ngram-min", str(a.ngram_min), "--ngram-max", str(a.ngram_max), "--ngram-breadth", str(a.ngram_breadth)]
    cmd += [] if a.mem is None else ["--mem", str(a.mem)]
    cmd += ["--graphs"] if a.graphs else ["--no-graphs"]
    cmd += ["--vllm-compile"] if a.vllm_compile else ["--no-vllm-compile"]
    cmd += ["--startup-only"] if a.startup_only else []
    return cmd


def compile_cache_env(triton_cache: str) -> dict:
    """A child's caches of compiled code: Triton's at ``triton_cache``, and vLLM's torch.compile
    and Inductor's caches beside it, so that they are as cold or warm as it (in their default
    folders under the home directory, the first compiled child would warm them for every later
    one)."""
    return {"TRITON_CACHE_DIR": triton_cache, "VLLM_CACHE_ROOT": f"{triton_cache}-vllm",
            "TORCHINDUCTOR_CACHE_DIR": f"{triton_cache}-inductor"}


def triton_cache_for(a, c: Child, shared_root: Path | None) -> str:
    """A fresh directory per child, or one per (engine, mode, tp, shape, backend) under
    ``shared_root`` (a mode compiles kernel variants of its own)."""
    if shared_root is None:
        return tempfile.mkdtemp(prefix="evenkv-triton-cache-")
    d = shared_root / f"{a.engine}-{c.mode}-tp{a.tp}-{c.shape}-{c.backend}"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def child_deadline(left_s: float, children_left: int, min_child_s: float) -> float:
    """Seconds the next child may run: the budget left less ``min_child_s`` for each of the
    ``children_left - 1`` children after it."""
    return left_s - min_child_s * (children_left - 1)


def children_that_fit(children: list[Child], group_size: int, starts_before: int, left_s: float,
                      min_child_s: float) -> list[Child]:
    """The children to start: all where ``left_s`` gives each of them (after ``starts_before``
    untimed starts) ``min_child_s``; else whole comparison groups from the front (``group_size``
    children, one per backend: ``child_order``'s (repeat, mode, shape) groups), as many as fit,
    at least the first. So a short budget drops the last repeats and modes, not one backend of a
    pair."""
    if min_child_s <= 0:
        return children
    fit = int(left_s // min_child_s) - starts_before
    if fit >= len(children):
        return children
    return children[:max(group_size, fit // group_size * group_size)]


def run_parent(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.time() + a.budget
    run = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    failed = 0
    # One untimed import first: a fresh machine's first import of an engine writes its bytecode
    # cache, a cost that would otherwise land on the first child's startup time only.
    subprocess.run([sys.executable, "-c", f"import {a.engine}"], capture_output=True, timeout=600)
    shared_root = None
    if a.triton_cache == "shared":
        shared_root = Path(a.triton_cache_dir or tempfile.mkdtemp(prefix="evenkv-triton-shared-"))
    backends = split_list([a.backends])
    planned = child_order(backends, a.modes, split_list([a.shapes]), a.repeats, a.first)
    untimed = int(a.untimed_start and bool(planned))
    left = t_end - time.time()
    if (len(planned) + untimed) * a.min_child > left:
        print(f"[serving] WARNING: {left:.0f} s of --budget left for {len(planned) + untimed} engine starts x "
              f"--min-child {a.min_child:.0f} s: whole groups of backends are left out from the end, then "
              f"children skipped from the first on until the rest fit", flush=True)
    children = children_that_fit(planned, len(backends), untimed, left, a.min_child)
    for c in planned[len(children):]:
        print(f"[serving] SKIPPED {a.engine} {c.mode} {c.shape} {c.backend} (repeat {c.repeat}, start "
              f"{c.start_order}): its group left out for the budget", flush=True)
        failed += 1
    if a.untimed_start and children:
        untimed_start(a, children[0], out, child_deadline(t_end - time.time(), len(children) + 1, a.min_child))
    for k, c in enumerate(children):
        # What is left, less --min-child for each child after this one: a child is stopped only
        # where it would take the minimum of one after it (a cold start may need several shares).
        share = child_deadline(t_end - time.time(), len(children) - k, a.min_child)
        label = f"{a.engine} {c.mode} {c.shape} {c.backend} (repeat {c.repeat}, start {c.start_order})"
        if share < a.min_child:
            print(f"[serving] SKIPPED {label}: {share:.0f} s of the budget left for it", flush=True)
            failed += 1
            continue
        rows_json = out / f".{a.engine}-{c.name}.json"
        cmd = child_cmd(a, c, rows_json, out / f"compiled-startup-{a.engine}-{c.name}.txt")
        print(f"[serving] child {label} ({share:.0f} s)", flush=True)
        env = {**os.environ, **compile_cache_env(triton_cache_for(a, c, shared_root))}
        log_path = out / f"{a.engine}-{c.name}.log"
        with log_path.open("w") as log:
            rc = run_with_deadline(cmd, log, env, share)
        if rows_json.exists():
            phases = engine_startup_phases(log_path.read_text(errors="replace"), a.engine)
            write_rows(out / "serving.csv",
                       [{**r, "startup_phases": phases, "run": run} for r in json.loads(rows_json.read_text())])
            rows_json.unlink()
        if rc != 0:
            failed += 1
            print(f"[serving] child {label} failed ({rc}); see its log", flush=True)
    if (out / "serving.csv").exists():
        report(out, a.note)
    return 1 if failed else 0


def child_main(a) -> int:
    rows = []
    # The parent's SIGTERM (its budget ran out) unwinds through run_child, which stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run_child(a, rows)
    finally:
        if a.json:  # whatever finished, even when a later workload failed
            Path(a.json).write_text(json.dumps(rows))
    sys.stdout.flush()
    os._exit(0)  # skip the engines' slow teardown


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("vllm", "sglang", "child"):
        p = sub.add_parser(name)
        p.add_argument("--workloads", default=",".join(WORKLOADS))
        p.add_argument("--size", choices=("full", "quick"), default="quick")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--rate", type=float, default=16.0, help="chat-rate: requests per second")
        p.add_argument("--mem", type=float, help="fraction of GPU memory for weights and KV cache (default 0.9; "
                       "0.8 for SGLang spec-ngram, whose fa3 baseline needs the room to capture its graphs)")
        p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True, help="CUDA graphs")
        p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                       help="the KV cache: auto (the model dtype) or fp8 (e4m3; vLLM --kv-cache-dtype fp8, "
                            "SGLang --kv-cache-dtype fp8_e4m3)")
        p.add_argument("--tp", type=int, default=1,
                       help="tensor parallel size (vLLM tensor_parallel_size, SGLang --tp-size)")
        p.add_argument("--vllm-compile", action=argparse.BooleanOptionalAction, default=True,
                       help="vLLM: torch.compile (compilation mode 3, custom_ops ['none']); --no-vllm-compile: mode 0")
        p.add_argument("--spec-tokens", type=int, default=3, help="spec-ngram: draft tokens per step (K)")
        p.add_argument("--ngram-min", type=int, default=2, help="spec-ngram, vLLM: prompt_lookup_min")
        p.add_argument("--ngram-max", type=int, default=4, help="spec-ngram, vLLM: prompt_lookup_max")
        p.add_argument("--ngram-breadth", type=int, default=1,
                       help="spec-ngram, SGLang: --speculative-ngram-max-bfs-breadth (1: a chain of drafts)")
        p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "evenkv-serving-models"))
        p.add_argument("--port", type=int, default=30123)
        p.add_argument("--startup-timeout", type=float, default=400)
        p.add_argument("--startup-only", action="store_true",
                       help="start each engine (sized for --workloads), record its start-up, stop it; serve nothing")
        if name == "child":
            p.add_argument("--engine", choices=("vllm", "sglang"), required=True)
            p.add_argument("--shape", choices=sorted(SHAPES), required=True)
            p.add_argument("--backend", required=True)
            p.add_argument("--mode", choices=MODES, default="default")
            p.add_argument("--repeat", type=int, default=1)
            p.add_argument("--start-order", type=int, default=1)
            p.add_argument("--json")
            p.add_argument("--compiled-startup-file", help="where to write the names of the start-up compiles")
        else:
            p.add_argument("--out", required=True, help="run folder: serving.csv, summary.md, plots, child logs")
            p.add_argument("--backends", default=",".join(["evenkv"] + BASELINES[name]))
            p.add_argument("--shapes", default="qwen3-8b" if name == "vllm" else "qwen3-30b-a3b-attn")
            p.add_argument("--mode", action="append", default=[],
                           help=f"repeatable or a comma list of {', '.join(MODES)} (default: default)")
            p.add_argument("--repeats", type=int, default=1, help="run every (mode, shape, backend) this many times")
            p.add_argument("--first", help="the backend that starts first (the order then rotates; default: "
                                           "the first of --backends)")
            p.add_argument("--triton-cache", choices=("fresh", "shared"), default="fresh",
                           help="fresh: an empty TRITON_CACHE_DIR per child (cold start); shared: one per (engine, "
                                "shape, backend) reused across children (warm from its second start)")
            p.add_argument("--triton-cache-dir", help="shared: the folder that keeps them (default: a new temp folder)")
            p.add_argument("--budget", type=float, default=3600,
                           help="seconds for all children together; a child is stopped only where it would "
                                "leave less than --min-child to each child after it")
            p.add_argument("--untimed-start", action="store_true",
                           help="start and stop the first child's engine once, untimed, before the timed children "
                                "(a freshly started machine's first engine start can be tens of seconds slower)")
            p.add_argument("--min-child", type=float, default=120,
                           help="seconds kept for each child still to start; where --budget cannot keep them "
                                "for all, the last whole groups of backends are left out, and a child with less "
                                "left is skipped")
            p.add_argument("--note", action="append", default=[], help="a line for summary.md (repeatable)")
            p.set_defaults(engine=name)
    p = sub.add_parser("report")
    p.add_argument("dir")
    p.add_argument("--note", action="append", default=[])
    a = ap.parse_args(argv)
    if a.cmd in ("vllm", "sglang"):
        a.modes = split_list(a.mode) or ["default"]
        unknown = [m for m in a.modes if m not in MODES]
        if unknown:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {', '.join(map(repr, unknown))}")
        if a.repeats < 1:
            raise ValueError(f"repeats: expected >= 1, got {a.repeats}")
    if a.cmd != "report":
        if a.tp < 1:
            raise ValueError(f"tp: expected >= 1, got {a.tp}")
        if a.spec_tokens < 1 or not 1 <= a.ngram_min <= a.ngram_max or a.ngram_breadth < 1:
            raise ValueError(f"spec-tokens, ngram-min/max, ngram-breadth: expected spec-tokens >= 1, "
                             f"1 <= ngram-min <= ngram-max and ngram-breadth >= 1, got {a.spec_tokens}, "
                             f"{a.ngram_min}/{a.ngram_max}, {a.ngram_breadth}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.cmd == "report":
        report(Path(a.dir), a.note)
        return 0
    for n in a.workloads.split(","):
        make_workload(n, a.size)  # a bad name fails here, before any engine starts
    if a.cmd == "child":
        return child_main(a)
    return run_parent(a)


if __name__ == "__main__":
    sys.exit(main())
