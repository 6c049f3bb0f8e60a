#!/usr/bin/env python3
"""Serving benchmark: evenkv against the engines' own attention backends, end to end, on
full-size model shapes and serving workloads. One child process per (engine, shape,
backend), so two engines never share a process; one CSV row per workload.

    python -m benchmarks.serving vllm   --out DIR [--backends evenkv,FLASH_ATTN] [--shapes qwen3-8b]
    python -m benchmarks.serving sglang --out DIR [--backends evenkv,triton] [--shapes qwen3-30b-a3b-attn]
    python -m benchmarks.serving report DIR       # summary.md and plots from DIR/serving.csv

Models: dense Qwen3 configs with random weights (``load_format="dummy"``; only config.json
is written, nothing is downloaded), at two shapes:
  qwen3-8b             Qwen3-8B: 32 q / 8 kv heads, head dim 128, hidden 4096, 36 layers
  qwen3-30b-a3b-attn   Qwen3-30B-A3B's attention (32 q / 4 kv heads, head dim 128, 48 layers,
                       hidden 2048) with a dense MLP of its active size (intermediate 6144)

Workloads (fixed seeds; ``--size full`` is the target size, ``quick`` the one a budgeted
device run affords; prompts are random token ids, decoding is greedy with ignore_eos):
  chat           prompts log-normal around 1K tokens (100-8K), outputs 128-1024 (quick 32-256),
                 512 requests (quick 256), all submitted at once
  chat-rate      the chat mix arriving as a Poisson process (latency under load)
  long-mix       2 (quick) or 4 requests of 64K-128K tokens among 1200 (quick 1100) short chats,
                 so more than 992 requests decode together
  prefill-heavy  8K-32K-token prompts, 64-token outputs, 64 requests (quick 16)
  many-short     2048 requests of ~200-token prompts, 512-token outputs (quick 96)

Engines:
  vllm    in-process ``LLMEngine`` stepped by hand (each step timed; a step in which every
          running request already had its first token is a decode step). Backends are
          vLLM's names; ``evenkv`` means ``CUSTOM`` (the evenkv plugin). CUDA graphs of decode
          steps (FULL_DECODE_ONLY, vLLM's capture sizes up to the batch limit), torch.compile
          off (mode 0), chunked prefill with 16384-token steps, no prefix caching.
  sglang  the HTTP server (``python -m sglang.launch_server``), started per backend and
          driven by a streaming client on localhost (aiohttp), as an operator runs it:
          startup time, Triton kernels compiled during startup and during the workloads
          (``TRITON_CACHE_DIR`` is fresh per server), TTFT and TPOT from the stream.

Metrics per (engine, shape, backend, workload): output tokens/s, requests/s, TTFT and TPOT
p50/p99 (TPOT = (last token time - first token time) / (tokens - 1) per request), decode
step p50 (vLLM), peak requests in flight. ``summary.md`` gives each backend's ratio to the
engine's default backend (``--default``).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

VOCAB_LOW = 3  # random prompt ids skip the special ids 0..2
CHUNK_TOKENS = 16384  # tokens per engine step (chunked prefill), both engines

SHAPES = {
    "qwen3-8b": dict(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36),
    "qwen3-30b-a3b-attn": dict(num_attention_heads=32, num_key_value_heads=4, hidden_size=2048,
                               intermediate_size=6144, num_hidden_layers=48),
}
ENGINE_BACKENDS = {"vllm": {"evenkv": "CUSTOM"}, "sglang": {}}
DEFAULT_BACKEND = {"vllm": "FLASH_ATTN", "sglang": "triton"}
WORKLOADS = ("chat", "chat-rate", "long-mix", "prefill-heavy", "many-short")
COLUMNS = ["engine", "engine_version", "shape", "backend", "workload", "graphs", "requests", "prompt_tokens",
           "output_tokens", "makespan_s", "output_tok_s", "requests_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
           "tpot_p99_ms", "decode_step_p50_ms", "decode_steps", "max_in_flight", "startup_s",
           "triton_compiles_startup", "triton_compiles_run", "status"]


# -- models ------------------------------------------------------------------------------------


def write_model(shape: str, directory: Path, max_positions: int) -> Path:
    """A Qwen3 config.json for ``shape`` in ``directory`` (the engines load dummy weights)."""
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "vocab_size": 151936,
           "max_position_embeddings": max_positions, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
           "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
           "use_cache": True, "use_sliding_window": False, **SHAPES[shape]}
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
        # The long requests sit among the short ones, as they would in live traffic.
        for i, n in enumerate(long_lens):
            prompts.insert((i + 1) * len(prompts) // (n_long + 1), n)
            outs.insert((i + 1) * len(outs) // (n_long + 1), outs[0])
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

    def record(self, now: float, new_tokens: int):
        if new_tokens <= 0:
            return
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens += new_tokens


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
            "max_in_flight": max_in_flight, "status": "ok" if not short else f"incomplete:{len(short)}"}


# -- vLLM (in-process engine, stepped by hand) ----------------------------------------------------


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes to capture: fine steps up to 256, then at most 12.5 % padding."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    sizes += list(range(320, 1025, 64)) + list(range(1152, 2049, 128))
    return [s for s in sizes if s < max_batch] + [max_batch]


def vllm_llm(model: Path, backend: str, max_model_len: int, max_num_seqs: int, graphs: bool, mem: float):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    if backend == "CUSTOM":  # the entry point covers installs; this covers a checkout on PYTHONPATH
        from evenkv.integrations.vllm import register

        register()
    compilation = {"mode": 0, "custom_ops": ["none"]}
    if graphs:
        compilation.update(cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=capture_sizes(max_num_seqs))
    else:
        compilation["cudagraph_mode"] = "NONE"
    # The device kit's vLLM has no compiled _C: norms run as PyTorch ops for every backend alike.
    return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
               attention_backend=backend, gpu_memory_utilization=mem, max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=CHUNK_TOKENS, enable_chunked_prefill=True,
               enable_prefix_caching=False, async_scheduling=False, seed=0, enforce_eager=not graphs,
               compilation_config=compilation,
               kernel_config={"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}})


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
    decode_steps, max_in_flight = [], 0
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
        for o in outs:
            i = index[o.request_id]
            timings[i].record(now, len(o.outputs[0].token_ids))
            started.add(i)
            if o.finished:
                unfinished.discard(i)
    return summarize(w, timings, decode_steps, max_in_flight)


# -- SGLang (HTTP server, streaming client) ----------------------------------------------------


def sglang_server_cmd(model: Path, backend: str, port: int, max_model_len: int, max_running: int,
                      graphs: bool, mem: float) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--load-format", "dummy",
           "--attention-backend", backend, "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--sampling-backend", "pytorch", "--dtype", "bfloat16", "--mem-fraction-static", str(mem),
           "--context-length", str(max_model_len), "--max-running-requests", str(max_running),
           "--chunked-prefill-size", str(CHUNK_TOKENS), "--disable-radix-cache", "--random-seed", "0",
           "--log-level", "warning"]
    cmd += ["--cuda-graph-max-bs-decode", str(max_running)] if graphs else ["--disable-cuda-graph"]
    return cmd


def stream_token_counts(body_lines):
    """Completion-token counts from SGLang's ``/generate`` server-sent events, one per event
    that carries ``meta_info.completion_tokens`` (the stream ends with ``data: [DONE]``)."""
    for raw in body_lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)["meta_info"]["completion_tokens"]


async def http_serve(url: str, w: Workload, prompts: list[list[int]]) -> dict:
    """Send ``w`` to a running server's ``/generate`` (streaming) at the workload's arrival times."""
    import aiohttp

    timings = [RequestTiming(a) for a in w.arrivals]
    in_flight = [0, 0]  # now, peak

    async def one(session, i: int, t0: float):
        await asyncio.sleep(max(0.0, w.arrivals[i] - (time.perf_counter() - t0)))
        body = {"input_ids": prompts[i], "stream": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": w.output_lens[i], "ignore_eos": True}}
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        seen = 0
        async with session.post(url + "/generate", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"/generate answered {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                for count in stream_token_counts([line]):
                    timings[i].record(time.perf_counter() - t0, count - seen)
                    seen = max(seen, count)
        in_flight[0] -= 1

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, i, t0) for i in range(len(prompts))))
    return summarize(w, timings, [], in_flight[1])


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            pass
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


def count_compiled(cache_dir: Path) -> int:
    """Triton kernels compiled into a cache directory (one folder per compiled specialization)."""
    return sum(1 for d in cache_dir.iterdir() if any(f.suffix == ".cubin" for f in d.iterdir())) \
        if cache_dir.exists() else 0


# -- child: one engine, one shape, one backend --------------------------------------------------


def run_child(a, rows: list[dict]):
    """Start the engine once and run every workload, appending one result row per workload to ``rows``."""
    works = [make_workload(n, a.size, a.seed, a.rate) for n in a.workloads.split(",")]
    # A margin over the longest request: SGLang stops a request one token short of its context length.
    max_len = max(w.max_len for w in works) + 16
    max_seqs = max(len(w.prompt_lens) for w in works)
    model = write_model(a.shape, Path(a.model_dir) / a.shape, max_len)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    backend = ENGINE_BACKENDS[a.engine].get(a.backend, a.backend)
    base = {"engine": a.engine, "shape": a.shape, "backend": a.backend, "graphs": int(a.graphs)}
    # The parent gives each child a fresh TRITON_CACHE_DIR: startup compiles count as startup.
    cache = Path(os.environ.get("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="evenkv-triton-cache-")))
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    warmup = Workload("warmup", [64, 3000, 17], [8, 8, 8])  # untimed: whatever loads lazily on first use
    t = time.time()
    if a.engine == "vllm":
        import vllm

        base["engine_version"] = vllm.__version__
        llm = vllm_llm(model, backend, max_len, max_seqs, a.graphs, a.mem)
        base["startup_s"] = round(time.time() - t, 1)
        base["triton_compiles_startup"] = count_compiled(cache)
        serve, stop = (lambda w: vllm_serve(llm, w, prompt_ids(w, vocab, a.seed))), None
    else:
        import sglang

        base["engine_version"] = sglang.__version__
        url = f"http://127.0.0.1:{a.port}"
        cmd = sglang_server_cmd(model, backend, a.port, max_len, max_seqs, a.graphs, a.mem)
        print("[serving] " + " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd, start_new_session=True)
        serve, stop = (lambda w: asyncio.run(http_serve(url, w, prompt_ids(w, vocab, a.seed)))), proc
    try:
        if stop is not None:
            base["startup_s"] = round(wait_healthy(url, stop, a.startup_timeout), 1)
            base["triton_compiles_startup"] = count_compiled(cache)
        serve(warmup)
        for w in works:
            print(f"[serving] {a.engine} {a.shape} {a.backend}: {w.name} ({len(w.prompt_lens)} requests)", flush=True)
            before = count_compiled(cache)
            rows.append({**base, **serve(w), "triton_compiles_run": count_compiled(cache) - before})
            print(f"[serving]   {rows[-1]}", flush=True)
    finally:
        if stop is not None:
            stop_server(stop)


# -- parent: children, CSV, summary, plots ---------------------------------------------------------


def write_rows(path: Path, rows: list[dict]):
    new = not path.exists()
    with path.open("a", newline="") as f:
        wr = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        if new:
            wr.writeheader()
        wr.writerows(rows)


def read_rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def ratios(rows: list[dict], engine: str, default: str) -> list[dict]:
    """Per (shape, workload, backend != default): output tok/s ratio (higher is better) and
    TPOT p50 / TTFT p50 speed-ups (default's time over the backend's; higher is better)."""
    ref = {(r["shape"], r["workload"]): r for r in rows if r["engine"] == engine and r["backend"] == default}
    out = []
    for r in rows:
        key = (r["shape"], r["workload"])
        if r["engine"] != engine or r["backend"] == default or key not in ref:
            continue
        d = ref[key]

        def over(a, b):
            a, b = _num(a), _num(b)
            return round(a / b, 3) if a and b else None

        out.append({"shape": r["shape"], "workload": r["workload"], "backend": r["backend"],
                    "tok_s_ratio": over(r["output_tok_s"], d["output_tok_s"]),
                    "tpot_p50_speedup": over(d["tpot_p50_ms"], r["tpot_p50_ms"]),
                    "ttft_p50_speedup": over(d["ttft_p50_ms"], r["ttft_p50_ms"]),
                    "decode_step_speedup": over(d["decode_step_p50_ms"], r["decode_step_p50_ms"])})
    return out


def summary_markdown(rows: list[dict], notes=()) -> str:
    lines = ["# Serving benchmark", ""] + [f"- {n}" for n in notes] + [""]
    cols = ["engine", "shape", "backend", "workload", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
            "tpot_p99_ms", "decode_step_p50_ms", "max_in_flight", "startup_s", "status"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c) or "–") for c in cols) + " |" for r in rows]
    for engine in sorted({r["engine"] for r in rows}):
        rs = ratios(rows, engine, DEFAULT_BACKEND[engine])
        if not rs:
            continue
        lines += ["", f"## {engine}: against {DEFAULT_BACKEND[engine]} (higher is better)", "",
                  "| shape | workload | backend | output tok/s ratio | TPOT p50 speed-up | TTFT p50 speed-up | "
                  "decode step speed-up |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['workload']} | {r['backend']} | {r['tok_s_ratio'] or '–'} | "
                  f"{r['tpot_p50_speedup'] or '–'} | {r['ttft_p50_speedup'] or '–'} | {r['decode_step_speedup'] or '–'} |"
                  for r in rs]
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
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        labels = [f"{r['workload']}\n{r['shape']}" for r in rs]
        for ax, key, title in ((axes[0], "tok_s_ratio", "output tokens/s"), (axes[1], "tpot_p50_speedup", "TPOT p50")):
            vals = [r[key] or 0 for r in rs]
            ax.bar(range(len(vals)), vals, color="#3b7dd8")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks(range(len(vals)), labels, fontsize=7)
            ax.set_title(f"{engine}: evenkv vs {DEFAULT_BACKEND[engine]}, {title} (>1 better)", fontsize=9)
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


def run_parent(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.time() + a.budget
    failed = 0
    # One untimed import first: a fresh machine's first import of an engine writes its bytecode
    # cache, a cost that would otherwise land on the first child's startup time only.
    subprocess.run([sys.executable, "-c", f"import {a.engine}"], capture_output=True, timeout=600)
    children = [(shape, backend) for shape in a.shapes.split(",") for backend in a.backends.split(",")]
    for k, (shape, backend) in enumerate(children):
        share = (t_end - time.time()) / (len(children) - k)  # an equal share for each child left
        if share < a.min_child:
            print(f"[serving] SKIPPED {a.engine} {shape} {backend}: a {share:.0f} s share of the budget", flush=True)
            failed += 1
            continue
        rows_json = out / f".{a.engine}-{shape}-{backend}.json"
        cmd = [sys.executable, "-m", "benchmarks.serving", "child", "--engine", a.engine, "--shape", shape,
               "--backend", backend, "--workloads", a.workloads, "--size", a.size, "--seed", str(a.seed),
               "--rate", str(a.rate), "--mem", str(a.mem), "--model-dir", a.model_dir, "--port", str(a.port),
               "--json", str(rows_json), "--startup-timeout", str(a.startup_timeout)]
        cmd += ["--graphs"] if a.graphs else ["--no-graphs"]
        print(f"[serving] child {a.engine} {shape} {backend} ({share:.0f} s)", flush=True)
        env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="evenkv-triton-cache-")}
        with (out / f"{a.engine}-{shape}-{backend}.log").open("w") as log:
            rc = run_with_deadline(cmd, log, env, share)
        if rows_json.exists():
            write_rows(out / "serving.csv", json.loads(rows_json.read_text()))
            rows_json.unlink()
        if rc != 0:
            failed += 1
            print(f"[serving] child {a.engine} {shape} {backend} failed ({rc}); see its log", flush=True)
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
        p.add_argument("--mem", type=float, default=0.9, help="fraction of GPU memory for weights and KV cache")
        p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True, help="CUDA graphs")
        p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "evenkv-serving-models"))
        p.add_argument("--port", type=int, default=30123)
        p.add_argument("--startup-timeout", type=float, default=400)
        if name == "child":
            p.add_argument("--engine", choices=("vllm", "sglang"), required=True)
            p.add_argument("--shape", choices=sorted(SHAPES), required=True)
            p.add_argument("--backend", required=True)
            p.add_argument("--json")
        else:
            p.add_argument("--out", required=True, help="run folder: serving.csv, summary.md, plots, child logs")
            p.add_argument("--backends", default=f"evenkv,{DEFAULT_BACKEND[name]}")
            p.add_argument("--shapes", default="qwen3-8b" if name == "vllm" else "qwen3-30b-a3b-attn")
            p.add_argument("--budget", type=float, default=3600, help="seconds for all children together, shared equally")
            p.add_argument("--min-child", type=float, default=120, help="skip a child with less budget left")
            p.add_argument("--note", action="append", default=[], help="a line for summary.md (repeatable)")
            p.set_defaults(engine=name)
    p = sub.add_parser("report")
    p.add_argument("dir")
    p.add_argument("--note", action="append", default=[])
    return ap.parse_args(argv)


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
