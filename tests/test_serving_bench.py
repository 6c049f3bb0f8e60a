"""The serving benchmark's logic on CPU: workloads, metrics, the streaming HTTP client (against
a local fake of SGLang's /generate), the summary and plots. The engines themselves run on the
GPU machine only."""

import asyncio
import json

import pytest

from benchmarks import serving
from benchmarks.serving import RequestTiming, Workload


@pytest.mark.parametrize("size", ["quick", "full"])
def test_workloads_are_deterministic_and_shaped_as_documented(size):
    for name in serving.WORKLOADS:
        a, b = serving.make_workload(name, size, seed=3), serving.make_workload(name, size, seed=3)
        assert (a.prompt_lens, a.output_lens, a.arrivals) == (b.prompt_lens, b.output_lens, b.arrivals)
        assert len(a.prompt_lens) == len(a.output_lens) == len(a.arrivals) > 0
        assert min(a.prompt_lens) > 0 and min(a.output_lens) > 0
    assert serving.make_workload("chat", size, 3).prompt_lens != serving.make_workload("chat", size, 4).prompt_lens
    chat = serving.make_workload("chat", size)
    assert 100 <= min(chat.prompt_lens) and max(chat.prompt_lens) <= 8192
    assert set(chat.arrivals) == {0.0}
    rate = serving.make_workload("chat-rate", size, rate=10.0)
    assert rate.arrivals == sorted(rate.arrivals) and rate.arrivals[-1] > 0
    mix = serving.make_workload("long-mix", size)
    longs = [n for n in mix.prompt_lens if n >= 65536]
    assert len(longs) == (4 if size == "full" else 2) and max(mix.prompt_lens) <= 131072
    assert len(mix.prompt_lens) > 992  # more requests than FA3's split limit decode together
    assert mix.prompt_lens[0] < 65536 and mix.prompt_lens[-1] < 65536  # the long ones sit inside
    heavy = serving.make_workload("prefill-heavy", size)
    assert min(heavy.prompt_lens) >= 8192 and max(heavy.prompt_lens) <= 32768 and set(heavy.output_lens) == {64}
    assert len(serving.make_workload("many-short", size).prompt_lens) == 2048


def test_bad_workload_and_size_name_the_argument():
    with pytest.raises(ValueError, match="workload: expected one of .* got 'chatt'"):
        serving.make_workload("chatt")
    with pytest.raises(ValueError, match="size: expected 'full' or 'quick', got 'big'"):
        serving.make_workload("chat", "big")


def test_summarize_computes_ttft_tpot_and_throughput():
    w = Workload("x", [10, 10, 10], [3, 5, 4], [0.0, 0.0, 1.0])
    t = [RequestTiming(0.0), RequestTiming(0.0), RequestTiming(1.0)]
    for now, n in ((0.5, 1), (0.7, 1), (0.9, 1)):
        t[0].record(now, n)
    t[1].record(1.0, 1)
    t[1].record(2.0, 4)  # a step that delivered four tokens at once
    t[2].record(1.2, 1)
    t[2].record(1.2, 0)  # no new token: ignored
    t[2].record(1.5, 3)
    row = serving.summarize(w, t, [0.1, 0.3, 0.2], max_in_flight=3)
    assert row["output_tokens"] == 12 and row["makespan_s"] == 2.0 and row["output_tok_s"] == 6.0
    assert row["requests_s"] == 1.5
    # TTFT 0.5, 1.0, 0.2 (from arrival); TPOT 0.2, 0.25, 0.1
    assert row["ttft_p50_ms"] == 500.0 and row["ttft_p99_ms"] == 1000.0
    assert row["tpot_p50_ms"] == 200.0 and row["tpot_p99_ms"] == 250.0
    assert row["decode_step_p50_ms"] == 200.0 and row["decode_steps"] == 3
    assert row["status"] == "ok"
    t[2].tokens = 3  # one token short of its output length
    assert serving.summarize(w, t, [], 3)["status"] == "incomplete:1"


def test_quantile_is_nearest_rank():
    xs = list(range(1, 101))
    assert serving.quantile(xs, 0.5) == 50 and serving.quantile(xs, 0.99) == 99 and serving.quantile(xs, 1.0) == 100
    assert serving.quantile([], 0.5) is None and serving.quantile([7], 0.99) == 7


def test_stream_parser_reads_sglang_events():
    lines = [b'data: {"output_ids": [5], "meta_info": {"completion_tokens": 1}}\n', b"\n",
             b'data: {"output_ids": [5, 6, 7], "meta_info": {"completion_tokens": 3}}\n', b"data: [DONE]\n",
             b'data: {"meta_info": {"completion_tokens": 9}}\n']
    assert list(serving.stream_token_counts(lines)) == [1, 3]


def test_http_client_against_a_local_fake_server():
    aiohttp_web = pytest.importorskip("aiohttp.web", reason="aiohttp comes with the [bench] extra")

    seen = []

    async def generate(request):
        body = await request.json()
        seen.append(body)
        resp = aiohttp_web.StreamResponse()
        await resp.prepare(request)
        for k in range(1, body["sampling_params"]["max_new_tokens"] + 1):
            await asyncio.sleep(0.01)
            event = {"output_ids": [3] * k, "meta_info": {"completion_tokens": k}}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        app = aiohttp_web.Application()
        app.router.add_post("/generate", generate)
        runner = aiohttp_web.AppRunner(app)
        await runner.setup()
        site = aiohttp_web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        w = Workload("t", [4, 6, 5], [3, 5, 1], [0.0, 0.0, 0.01])  # the third joins while the others stream
        try:
            return await serving.http_serve(f"http://127.0.0.1:{port}", w, [[7] * 4, [8] * 6, [9] * 5])
        finally:
            await runner.cleanup()

    row = asyncio.run(main())
    assert row["status"] == "ok" and row["output_tokens"] == 9 and row["requests"] == 3
    assert row["max_in_flight"] == 3
    assert 5 <= row["ttft_p50_ms"] < 500 and 5 <= row["tpot_p50_ms"] < 500
    assert sorted(len(b["input_ids"]) for b in seen) == [4, 5, 6]
    assert all(b["stream"] and b["sampling_params"]["ignore_eos"] for b in seen)


def _rows():
    base = {"engine": "vllm", "engine_version": "0", "shape": "qwen3-8b", "graphs": 1, "status": "ok"}
    return [{**base, "backend": "FLASH_ATTN", "workload": "chat", "output_tok_s": "100", "tpot_p50_ms": "20",
             "ttft_p50_ms": "500", "decode_step_p50_ms": "19"},
            {**base, "backend": "evenkv", "workload": "chat", "output_tok_s": "110", "tpot_p50_ms": "16",
             "ttft_p50_ms": "", "decode_step_p50_ms": "15"},
            {**base, "backend": "evenkv", "workload": "many-short", "output_tok_s": "50", "tpot_p50_ms": "1"}]


def test_ratios_summary_and_plots(tmp_path):
    rs = serving.ratios(_rows(), "vllm", "FLASH_ATTN")
    assert rs == [{"shape": "qwen3-8b", "workload": "chat", "backend": "evenkv", "tok_s_ratio": 1.1,
                   "tpot_p50_speedup": 1.25, "ttft_p50_speedup": None, "decode_step_speedup": 1.267}]
    md = serving.summary_markdown(_rows(), ["a note"])
    assert "- a note" in md and "| qwen3-8b | chat | evenkv | 1.1 | 1.25 | – | 1.267 |" in md
    serving.write_rows(tmp_path / "serving.csv", _rows())
    serving.report(tmp_path, ["n"])
    assert (tmp_path / "summary.md").read_text().startswith("# Serving benchmark")
    assert (tmp_path / "vllm-ratios.png").stat().st_size > 1000
    assert len(serving.read_rows(tmp_path / "serving.csv")) == 3


def test_model_config_has_the_shape(tmp_path):
    d = serving.write_model("qwen3-30b-a3b-attn", tmp_path / "m", 140000)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 4, 128)
    assert cfg["num_hidden_layers"] == 48 and cfg["max_position_embeddings"] == 140000
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_cli_rejects_a_bad_workload_before_starting_an_engine(tmp_path):
    with pytest.raises(ValueError, match="got 'nope'"):
        serving.main(["vllm", "--out", str(tmp_path), "--workloads", "chat,nope"])
    assert not (tmp_path / "serving.csv").exists()


def test_server_command_has_the_operator_flags(tmp_path):
    cmd = serving.sglang_server_cmd(tmp_path, "evenkv", 30000, 9000, 256, True, 0.8)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in (("--attention-backend", "evenkv"), ("--load-format", "dummy"),
                        ("--max-running-requests", "256"), ("--cuda-graph-max-bs-decode", "256")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--disable-cuda-graph" in serving.sglang_server_cmd(tmp_path, "triton", 1, 9000, 8, False, 0.8)
