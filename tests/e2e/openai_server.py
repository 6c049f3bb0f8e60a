#!/usr/bin/env python3
"""The operator's path end to end (GPU machine; tests/e2e/vllm.sh and sglang.sh run it): an
engine's OpenAI-compatible HTTP server with evenkv, a real tokenizer, a bounded concurrent
localhost load on ``/v1/completions`` and ``/v1/chat/completions``, streaming and not, and a
clean stop by PID.

    python tests/e2e/openai_server.py MODEL_DIR --engine vllm|sglang [--backend evenkv|NAME]
                                      [--requests 256] [--concurrency 32] [--max-tokens 16]
    python tests/e2e/openai_server.py MODEL_DIR --tokenizer-only

1. Tokenizer: nothing can be downloaded, so a byte-level BPE is trained with the ``tokenizers``
   package on this repository's Markdown files and written into MODEL_DIR as tokenizer.json
   and tokenizer_config.json (with a chat template, so chat completions work). Its special
   tokens take ids 0-4 (pad, bos = 1, eos = 2 as in the tiny models' configs, im_start,
   im_end); added tokens fill the vocabulary up to the model's ``vocab_size``, so every id
   the model can emit decodes.
2. Server, as an operator starts it: ``vllm serve MODEL --attention-backend CUSTOM`` (``python
   -m vllm.entrypoints.cli.main serve`` where the ``vllm`` command is not installed) or
   ``python -m sglang.launch_server --model-path MODEL --attention-backend evenkv``, on
   127.0.0.1 and a free port, its output in --log. ``--backend`` picks another backend for
   comparison; ``--server-arg`` adds a flag (repeatable). ``--native-ops`` (default on) gives
   vLLM the options the device kit's vLLM needs (no compiled ``_C``).
3. Load: --requests requests, at most --concurrency at a time, in turn of four kinds:
   completion, streamed completion, chat completion, streamed chat completion; greedy,
   ``ignore_eos``, --max-tokens tokens each. Every answer is checked: HTTP 200, the object
   types, a ``length`` finish, ``usage.completion_tokens == --max-tokens`` (streams ask for
   usage), every stream event a JSON chunk of the right object, ending with ``data: [DONE]``.
4. The start-up log must hold evenkv's line naming the kernels its layers run and why
   (``evenkv: ... decode on evenkv's kernels (...); ... run on ...``); with another
   backend this check is skipped.
5. Stop: SIGTERM to the server's PID, then SIGKILL, by PID, to each of its child processes
   still alive after --stop-grace seconds (and to the server itself if it is).

Prints ``RESULT openai ... answered=N/N bad=0 kernels_logged=1 clean_stop=1 ok=1``: ok needs every
answer right, the kernel line and the server stopped; clean_stop says whether SIGTERM alone did it.
Exit status: 0 ok, 1 a check failed, 3 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.serving import wait_healthy  # noqa: E402  (the serving benchmark's readiness poll)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BPE_VOCAB = 2048  # trained tokens (bytes, merges, specials); added tokens fill up to the model's vocab
KINDS = ("completion", "completion-stream", "chat", "chat-stream")
EVENKV_LOG_LINE = re.compile(r"evenkv: .*decode on evenkv's .*kernels.*run on .*")
NO_GPU_EXIT = 3


# -- tokenizer -------------------------------------------------------------------------------


def corpus_lines(root: Path = ROOT) -> list[str]:
    """Non-empty lines of the repository's Markdown files: the tokenizer's training text and the prompts."""
    lines = []
    for path in sorted(root.glob("*.md")) + sorted((root / "docs").glob("*.md")):
        lines += [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise FileNotFoundError(f"no Markdown text under {root} to train the tokenizer on")
    return lines


def build_tokenizer(model_dir: Path, lines: list[str]) -> int:
    """Train a byte-level BPE on ``lines`` and write tokenizer.json and tokenizer_config.json into
    ``model_dir``, its vocabulary filled up to config.json's ``vocab_size``. Returns that size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if vocab < BPE_VOCAB:
        raise ValueError(f"vocab_size: expected >= {BPE_VOCAB} in {model_dir / 'config.json'}, got {vocab}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    filler = [AddedToken(f"<|x{i}|>", special=False, normalized=False) for i in range(tok.get_vocab_size(), vocab)]
    tok.add_tokens(filler)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, the model {vocab}")
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
              "pad_token": "<|pad|>", "model_max_length": json.loads((model_dir / "config.json").read_text()).get(
                  "max_position_embeddings", 4096), "add_bos_token": False, "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return vocab


# -- server ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(engine: str, model: Path, backend: str, port: int, native_ops: bool, extra: list[str],
               max_len: int, mem: float) -> list[str]:
    """The command line an operator types, for ``engine`` with ``backend`` ("evenkv": the plugin)."""
    if engine == "vllm":
        vllm = shutil.which("vllm")
        cmd = [vllm] if vllm else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
        cmd += ["serve", str(model), "--attention-backend", "CUSTOM" if backend == "evenkv" else backend,
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--dtype", "bfloat16",
                "--max-model-len", str(max_len), "--max-num-seqs", "64", "--gpu-memory-utilization", str(mem)]
        if native_ops:  # the device kit's vLLM has no compiled _C: norms and activations as PyTorch ops
            compilation = {"mode": 0, "custom_ops": ["none"], "cudagraph_mode": "FULL_DECODE_ONLY"}
            cmd += ["--compilation-config", json.dumps(compilation), "--kernel-config",
                    json.dumps({"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}})]
    elif engine == "sglang":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--attention-backend",
               backend, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--dtype",
               "bfloat16", "--context-length", str(max_len), "--max-running-requests", "64",
               "--mem-fraction-static", str(mem), "--sampling-backend", "pytorch", "--log-level", "info"]
    else:
        raise ValueError(f"engine: expected 'vllm' or 'sglang', got {engine!r}")
    return cmd + extra


def descendants(pid: int) -> list[int]:
    """PIDs of ``pid``'s child processes, recursively (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_by_pid(proc: subprocess.Popen, grace_s: float) -> dict:
    """SIGTERM to the server, then SIGKILL by PID to whatever of it and its children outlives
    ``grace_s``. Returns {"terminated": server exited on SIGTERM, "killed": PIDs killed}."""
    family = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and (proc.poll() is None or any(alive(p) for p in family)):
        time.sleep(0.2)
    terminated = proc.poll() is not None
    killed = []
    for pid in family + ([] if terminated else [proc.pid]):
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    proc.wait(30)
    return {"terminated": terminated, "killed": killed}


def kernel_log_lines(log_text: str) -> list[str]:
    """evenkv's start-up lines that name the kernels its attention layers run, and why."""
    return [m.group(0).strip() for m in EVENKV_LOG_LINE.finditer(log_text)]


# -- client ----------------------------------------------------------------------------------


@dataclass
class Answer:
    """One request's outcome: ``problem`` is None when the answer passed every check."""

    kind: str
    problem: str | None = None
    text: str = ""
    events: int = 0


@dataclass
class LoadReport:
    answers: list[Answer] = field(default_factory=list)

    @property
    def bad(self) -> list[Answer]:
        return [x for x in self.answers if x.problem is not None]

    def summary(self) -> str:
        per_kind = {k: sum(1 for x in self.answers if x.kind == k and x.problem is None) for k in KINDS}
        return " ".join(f"{k}={n}" for k, n in per_kind.items())


def request_body(kind: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """(path, JSON body) of one request of ``kind``."""
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if kind.endswith("-stream"):
        body.update(stream=True, stream_options={"include_usage": True})
    if kind.startswith("chat"):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def check_full(kind: str, doc: dict, max_tokens: int) -> tuple[str | None, str]:
    """(problem or None, text) of a non-streamed answer."""
    chat = kind.startswith("chat")
    if doc.get("object") != ("chat.completion" if chat else "text_completion"):
        return f"object {doc.get('object')!r}", ""
    choices = doc.get("choices") or []
    if len(choices) != 1:
        return f"{len(choices)} choices", ""
    c = choices[0]
    text = (c.get("message") or {}).get("content") if chat else c.get("text")
    if chat and (c.get("message") or {}).get("role") != "assistant":
        return f"message role {(c.get('message') or {}).get('role')!r}", ""
    if not isinstance(text, str):
        return f"text {text!r}", ""
    if c.get("finish_reason") != "length":
        return f"finish_reason {c.get('finish_reason')!r}", text
    used = (doc.get("usage") or {}).get("completion_tokens")
    if used != max_tokens:
        return f"usage.completion_tokens {used} (asked {max_tokens})", text
    return None, text


def check_stream(kind: str, lines: list[str], max_tokens: int) -> tuple[str | None, str, int]:
    """(problem or None, text, events) of a streamed answer's server-sent-event lines."""
    chat = kind.startswith("chat")
    want = "chat.completion.chunk" if chat else "text_completion"
    data = [ln[5:].strip() for ln in (x.strip() for x in lines) if ln.startswith("data:")]
    if not data or data[-1] != "[DONE]":
        return "the stream does not end with data: [DONE]", "", len(data)
    text, finishes, used = "", 0, None
    for payload in data[:-1]:
        try:
            chunk = json.loads(payload)
        except ValueError:
            return f"an event is not JSON: {payload[:80]!r}", text, len(data)
        if chunk.get("object") != want:
            return f"chunk object {chunk.get('object')!r}", text, len(data)
        for c in chunk.get("choices") or []:
            if chat:
                delta = c.get("delta") or {}
                if delta.get("role") not in (None, "assistant"):
                    return f"delta role {delta.get('role')!r}", text, len(data)
                piece = delta.get("content")
            else:
                piece = c.get("text")
            if piece is not None and not isinstance(piece, str):
                return f"content {piece!r}", text, len(data)
            text += piece or ""
            if c.get("finish_reason") is not None:
                finishes += 1
                if c["finish_reason"] != "length":
                    return f"finish_reason {c['finish_reason']!r}", text, len(data)
        if chunk.get("usage"):
            used = chunk["usage"].get("completion_tokens")
    if finishes != 1:
        return f"{finishes} finish_reason events", text, len(data)
    if used != max_tokens:
        return f"usage.completion_tokens {used} (asked {max_tokens})", text, len(data)
    return None, text, len(data)


async def send_load(url: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int,
                    timeout_s: float = 300) -> LoadReport:
    """``requests`` requests, the kinds in turn, at most ``concurrency`` in flight."""
    import aiohttp

    report = LoadReport()
    gate = asyncio.Semaphore(concurrency)

    async def one(session, i: int):
        kind = KINDS[i % len(KINDS)]
        path, body = request_body(kind, prompts[i % len(prompts)], max_tokens)
        answer = Answer(kind)
        async with gate:
            try:
                async with session.post(url + path, json=body) as r:
                    if r.status != 200:
                        answer.problem = f"HTTP {r.status}: {(await r.text())[:200]}"
                    elif body.get("stream"):
                        lines = [raw.decode() async for raw in r.content]
                        answer.problem, answer.text, answer.events = check_stream(kind, lines, max_tokens)
                    else:
                        answer.problem, answer.text = check_full(kind, await r.json(), max_tokens)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
                answer.problem = f"{type(err).__name__}: {err}"
        report.answers.append(answer)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, i) for i in range(requests)))
    return report


# -- main --------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="HF checkpoint directory (a tokenizer is written into it)")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--backend", default="evenkv", help="evenkv (default) or an engine backend name")
    ap.add_argument("--tokenizer-only", action="store_true", help="write the tokenizer and stop")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048, help="the server's context length")
    ap.add_argument("--mem", type=float, default=0.3, help="vLLM gpu-memory-utilization / SGLang mem-fraction-static")
    ap.add_argument("--native-ops", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM: torch-native norms/activations (needed with the device kit's vLLM)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more server flag (repeatable)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--stop-grace", type=float, default=30, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--log", type=Path, default=Path("/tmp/evenkv-openai-server.log"), help="the server's output")
    a = ap.parse_args(argv)
    for name in ("requests", "concurrency", "max_tokens"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(a, name)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    lines = corpus_lines()
    vocab = build_tokenizer(a.model, lines)
    print(f"[openai] tokenizer: byte-level BPE of {BPE_VOCAB} tokens filled to {vocab}, in {a.model}", flush=True)
    if a.tokenizer_only:
        return 0
    import torch

    if not torch.cuda.is_available():
        print("openai_server.py: no CUDA GPU is visible; the engines need one. Nothing was served.", file=sys.stderr)
        return NO_GPU_EXIT
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_cmd(a.engine, a.model, a.backend, port, a.native_ops, a.server_arg, a.max_len, a.mem)
    print("[openai] " + " ".join(cmd), flush=True)
    a.log.parent.mkdir(parents=True, exist_ok=True)
    with a.log.open("w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        report, ready_s, error = LoadReport(), None, None
        try:
            ready_s = wait_healthy(url, proc, a.startup_timeout, paths=("/health", "/v1/models"))
            print(f"[openai] ready in {ready_s:.1f}s (PID {proc.pid})", flush=True)
            t = time.time()
            report = asyncio.run(send_load(url, lines, a.requests, a.concurrency, a.max_tokens))
            print(f"[openai] {a.requests} requests in {time.time() - t:.1f}s: {report.summary()}", flush=True)
        except RuntimeError as err:
            error = str(err)
            print(f"[openai] {err}", flush=True)
        finally:
            stop = stop_by_pid(proc, a.stop_grace)
    for x in report.bad[:8]:
        print(f"[openai] bad {x.kind}: {x.problem}", flush=True)
    sample = next((x for x in report.answers if x.problem is None and x.kind == "chat-stream"), None)
    if sample:
        print(f"[openai] a streamed chat answer ({sample.events} events): {sample.text[:120]!r}", flush=True)
    kernels = kernel_log_lines(a.log.read_text(errors="replace"))
    for line in kernels:
        print(f"[openai] server log: {line}", flush=True)
    answered = len(report.answers) - len(report.bad)
    need_log = a.backend == "evenkv"
    clean = stop["terminated"] and not stop["killed"]
    ok = error is None and answered == a.requests and (bool(kernels) or not need_log) and stop["terminated"]
    print(f"RESULT openai engine={a.engine} backend={a.backend} ready_s={ready_s and round(ready_s, 1)} "
          f"answered={answered}/{a.requests} bad={len(report.bad)} concurrency={a.concurrency} "
          f"max_tokens={a.max_tokens} {report.summary()} "
          f"kernels_logged={int(bool(kernels)) if need_log else 'na'} clean_stop={int(clean)} "
          f"killed_by_pid={len(stop['killed'])} wall_s={time.time() - t0:.0f} ok={int(ok)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
