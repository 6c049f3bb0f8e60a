"""The operator-path script's CPU parts (tests/e2e/openai_server.py): the answer checks, the
concurrent client against a local fake OpenAI server, the stop by PID, the start-up log match
against the adapters' own log text, the server command lines and the tokenizer it builds. The
engines' servers themselves run on the GPU machine only."""

import ast
import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
import openai_server as oa  # noqa: E402
from helpers import local_http_server  # noqa: E402


def _chunk(kind, piece=None, finish=None, usage=None, role=None):
    chat = kind.startswith("chat")
    choice = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {k: v for k, v in (("role", role), ("content", piece)) if v is not None}
    else:
        choice["text"] = piece or ""
    c = {"object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice] if piece or finish or
         role else []}
    if usage is not None:
        c["usage"] = {"completion_tokens": usage}
    return "data: " + json.dumps(c) + "\n"


def _stream(kind, n, done=True):
    lines = [_chunk(kind, role="assistant")] if kind.startswith("chat") else []
    lines += [_chunk(kind, piece=f"t{i}", finish="length" if i == n - 1 else None) for i in range(n)]
    lines += [_chunk(kind, usage=n)] + (["data: [DONE]\n"] if done else [])
    return lines


def test_full_answers_are_checked():
    good = {"object": "text_completion", "choices": [{"text": "abc", "finish_reason": "length"}],
            "usage": {"completion_tokens": 4}}
    assert oa.check_full("completion", good, 4) == (None, "abc")
    assert oa.check_full("completion", good, 5)[0] == "usage.completion_tokens 4 (asked 5)"
    assert oa.check_full("completion", {**good, "object": "chat.completion"}, 4)[0] == "object 'chat.completion'"
    chat = {"object": "chat.completion", "usage": {"completion_tokens": 4},
            "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}]}
    assert oa.check_full("chat", chat, 4) == (None, "hi")
    stopped = {**chat, "choices": [{**chat["choices"][0], "finish_reason": "stop"}]}
    assert oa.check_full("chat", stopped, 4)[0] == "finish_reason 'stop'"
    assert oa.check_full("chat", {**chat, "choices": []}, 4)[0] == "0 choices"


@pytest.mark.parametrize("kind", ["completion-stream", "chat-stream"])
def test_streams_are_checked(kind):
    assert oa.check_stream(kind, _stream(kind, 4), 4)[:2] == (None, "t0t1t2t3")
    assert oa.check_stream(kind, _stream(kind, 4, done=False), 4)[0] == "the stream does not end with data: [DONE]"
    assert oa.check_stream(kind, _stream(kind, 3), 4)[0] == "usage.completion_tokens 3 (asked 4)"
    broken = _stream(kind, 4)
    broken.insert(1, "data: {not json\n")
    assert oa.check_stream(kind, broken, 4)[0].startswith("an event is not JSON")
    twice = _stream(kind, 4)
    twice.insert(-2, _chunk(kind, piece="x", finish="length"))
    assert oa.check_stream(kind, twice, 4)[0] == "2 finish_reason events"
    other = "completion-stream" if kind == "chat-stream" else "chat-stream"
    assert oa.check_stream(kind, _stream(other, 4), 4)[0].startswith("chunk object")


def test_client_against_a_local_fake_server():
    web = pytest.importorskip("aiohttp.web", reason="aiohttp comes with the [bench] extra")
    seen = []
    in_flight = [0, 0]

    async def answer(request):
        body = await request.json()
        seen.append((request.path, body))
        kind = ("chat" if request.path.endswith("chat/completions") else "completion") + (
            "-stream" if body.get("stream") else "")
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            await asyncio.sleep(0.02)
            n = body["max_tokens"]
            if not body.get("stream"):
                chat = kind == "chat"
                choice = {"finish_reason": "length", **({"message": {"role": "assistant", "content": "ok"}} if chat
                                                        else {"text": "ok"})}
                return web.json_response({"object": "chat.completion" if chat else "text_completion",
                                          "choices": [choice], "usage": {"completion_tokens": n}})
            resp = web.StreamResponse()
            await resp.prepare(request)
            # The fake's chat streams drop their [DONE] for prompts that start with "B": those must count as bad.
            done = not (kind == "chat-stream" and body["messages"][0]["content"].startswith("B"))
            for line in _stream(kind, n, done):
                await resp.write((line + "\n").encode())
            return resp
        finally:
            in_flight[0] -= 1

    async def main():
        async with local_http_server({"/v1/completions": answer, "/v1/chat/completions": answer}) as url:
            return await oa.send_load(url, ["A prompt", "B prompt", "C prompt"], 40, 6, 3)

    report = asyncio.run(main())
    assert len(report.answers) == 40 and 2 <= in_flight[1] <= 6
    assert report.summary() == "completion=10 completion-stream=10 chat=10 chat-stream=7"
    assert {x.problem for x in report.bad} == {"the stream does not end with data: [DONE]"}
    assert all(b["temperature"] == 0.0 and b["ignore_eos"] and b["model"] == "tiny" for _, b in seen)
    assert all(b["stream_options"] == {"include_usage": True} for _, b in seen if b.get("stream"))


def test_stop_by_pid_kills_children_that_outlive_sigterm(tmp_path):
    pid_file = tmp_path / "child.pid"
    # A server stand-in: it leaves on SIGTERM, its child ignores SIGTERM (as engine workers can).
    script = ("import signal, subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    child = int(pid_file.read_text())
    assert oa.descendants(proc.pid) == [child] and oa.alive(child)
    stop = oa.stop_by_pid(proc, grace_s=1.0)
    assert stop == {"terminated": True, "killed": [child]}
    for _ in range(50):
        if not oa.alive(child):
            break
        time.sleep(0.1)
    assert not oa.alive(child)


def test_stop_by_pid_kills_a_server_that_ignores_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline() == b"up\n"  # its handler is in place
    stop = oa.stop_by_pid(proc, grace_s=0.5)
    assert stop == {"terminated": False, "killed": [proc.pid]} and proc.returncode == -signal.SIGKILL


def _adapter_kernel_messages():
    """The adapters' start-up log messages (logger.info("evenkv: ... decode on ...", ...)), rendered."""
    out = []
    for name in ("vllm_backend.py", "sglang_backend.py"):
        tree = ast.parse((ROOT / "evenkv" / "integrations" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "info" and node.args:
                text = getattr(node.args[0], "value", None)
                if isinstance(text, str) and text.startswith("evenkv:") and "decode on" in text:
                    out.append(re.sub(r"%d", "4", text).replace("%s", "LayerKind(window=None)"))
    return out


def test_the_log_match_finds_the_adapters_own_kernel_lines():
    messages = _adapter_kernel_messages()
    assert len(messages) == 2, messages  # one per engine adapter
    log = "\n".join(["INFO 12-01 loading", f"[2026-12-01 10:00:00] {messages[1]}", "noise evenkv: other",
                     f"INFO 12-01 [vllm_backend.py:301] {messages[0]}", "done"])
    found = oa.kernel_log_lines(log)
    assert len(found) == 2 and all("decode on evenkv's" in x and "run on" in x for x in found)
    assert oa.kernel_log_lines("INFO vllm started\nevenkv: registered\n") == []


def test_server_commands(tmp_path):
    v = oa.server_cmd("vllm", tmp_path, "evenkv", 8123, True, ["--enforce-eager"], 2048, 0.3)
    assert v[v.index("serve") + 1] == str(tmp_path) and v[v.index("--attention-backend") + 1] == "CUSTOM"
    assert json.loads(v[v.index("--compilation-config") + 1])["custom_ops"] == ["none"]
    assert v[-1] == "--enforce-eager" and v[v.index("--port") + 1] == "8123"
    assert "--kernel-config" not in oa.server_cmd("vllm", tmp_path, "FLASH_ATTN", 1, False, [], 2048, 0.3)
    s = oa.server_cmd("sglang", tmp_path, "evenkv", 8123, True, [], 2048, 0.3)
    assert s[1:3] == ["-m", "sglang.launch_server"] and s[s.index("--attention-backend") + 1] == "evenkv"
    assert "--skip-tokenizer-init" not in s  # the operator's path detokenizes
    with pytest.raises(ValueError, match="engine: expected 'vllm' or 'sglang', got 'trt'"):
        oa.server_cmd("trt", tmp_path, "evenkv", 1, True, [], 2048, 0.3)


def test_tokenizer_covers_the_model_vocabulary(tmp_path):
    pytest.importorskip("tokenizers", reason="tokenizers comes with the engines' installs")
    from tokenizers import Tokenizer
    import jinja2

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 3000, "max_position_embeddings": 1024}))
    assert oa.build_tokenizer(tmp_path, oa.corpus_lines()) == 3000
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 3000
    assert [tok.token_to_id(t) for t in oa.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    text = "evenkv decodes: ünïcode and bytes \x07 too"
    assert tok.decode(tok.encode(text).ids) == text  # byte level: any text round-trips
    assert tok.decode([2999]) == "<|x2999|>"  # the last id the model can emit decodes
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["model_max_length"]) == ("<|bos|>", "<|eos|>", 1024)
    chat = jinja2.Template(cfg["chat_template"]).render(messages=[{"role": "user", "content": "hi"}],
                                                        add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    with pytest.raises(ValueError, match="vocab_size: expected >= 2048 .* got 1000"):
        oa.build_tokenizer(tmp_path, ["some text"])
