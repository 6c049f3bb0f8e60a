"""The serving benchmark's logic on CPU: workloads, metrics, the streaming HTTP client (against
a local fake of SGLang's /generate), the engines' arguments per mode, the children's start
order, the Triton compile attribution, the summary and plots. The engines themselves run on
the GPU machine only."""

import asyncio
import csv
import json
import re
import sys

import pytest
import torch

from benchmarks import serving
from benchmarks.serving import RequestTiming, Workload
from helpers import local_http_server


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
    ctx = serving.make_workload("long-context", size)
    assert sorted(ctx.prompt_lens) == [2048] * 28 + [65536] * 4 and set(ctx.output_lens) == {128}
    longs_at = [i for i, n in enumerate(ctx.prompt_lens) if n == 65536]
    assert longs_at[0] > 0 and longs_at[-1] < 31 and len(set(longs_at)) == 4  # among the short ones
    assert ctx.max_len == 65536 + 128


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
             b'data: {"output_ids": [5, 6, 7], "meta_info": {"completion_tokens": 3, "spec_verify_ct": 1}}\n',
             b"data: [DONE]\n", b'data: {"meta_info": {"completion_tokens": 9}}\n']
    assert list(serving.stream_meta(lines)) == [{"completion_tokens": 1}, {"completion_tokens": 3, "spec_verify_ct": 1}]


def test_tokens_per_step_counts_accepted_drafts():
    w = Workload("x", [10, 10], [5, 3])
    t = [RequestTiming(0.0), RequestTiming(0.0)]
    for now, n in ((0.1, 1), (0.2, 2), (0.3, 2)):  # first token, then two steps of 2 (one draft accepted each)
        t[0].record(now, n)
    for now in (0.1, 0.2, 0.3):
        t[1].record(now, 1)
    assert serving.summarize(w, t, [], 2)["tokens_per_step"] == 1.5  # (2.0 + 1.0) / 2
    one = [RequestTiming(0.0)]
    one[0].record(0.1, 1)
    assert serving.summarize(Workload("y", [3], [1]), one, [], 1)["tokens_per_step"] is None


def test_http_client_against_a_local_fake_server():
    aiohttp_web = pytest.importorskip("aiohttp.web", reason="aiohttp comes with the [bench] extra")

    seen = []

    async def generate(request):
        body = await request.json()
        seen.append(body)
        resp = aiohttp_web.StreamResponse()
        await resp.prepare(request)
        n = body["sampling_params"]["max_new_tokens"]
        counts = [1] + list(range(3, n + 1, 2)) + ([n] if n > 1 and n % 2 == 0 else [])
        for k, count in enumerate(counts):  # the first token, then two per verify step (the last may be one)
            await asyncio.sleep(0.01)
            event = {"output_ids": [3] * count, "meta_info": {"completion_tokens": count}}
            if k:
                event["meta_info"]["spec_verify_ct"] = k
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        w = Workload("t", [4, 6, 5], [3, 5, 1], [0.0, 0.0, 0.01])  # the third joins while the others stream
        async with local_http_server({"/generate": generate}) as url:
            return await serving.http_serve(url, w, [[7] * 4, [8] * 6, [9] * 5])

    row = asyncio.run(main())
    assert row["status"] == "ok" and row["output_tokens"] == 9 and row["requests"] == 3
    assert row["max_in_flight"] == 3
    assert 5 <= row["ttft_p50_ms"] < 500 and 5 <= row["tpot_p50_ms"] < 500
    assert sorted(len(b["input_ids"]) for b in seen) == [4, 5, 6]
    # Per request (tokens - 1) / verify steps: 2/1 (3 tokens), 4/2 (5 tokens); the 1-token one has none.
    assert row["tokens_per_step"] == 2.0
    assert all(b["stream"] and b["sampling_params"]["ignore_eos"] for b in seen)


def test_http_client_sends_simultaneous_requests_in_index_order():
    """Requests due at the same time reach the server's queue in index order even when the
    server takes some slower than others (here the first ones wait longest before queueing):
    the client sends each after the one before it has its response headers."""
    aiohttp_web = pytest.importorskip("aiohttp.web", reason="aiohttp comes with the [bench] extra")
    queued = []

    async def generate(request):
        body = await request.json()
        await asyncio.sleep(0.02 * (5 - body["input_ids"][0]))  # request 0 is the slowest to queue
        queued.append(body["input_ids"][0])
        resp = aiohttp_web.StreamResponse()
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps({'meta_info': {'completion_tokens': 1}})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        w = Workload("t", [2] * 5, [1] * 5)
        async with local_http_server({"/generate": generate}) as url:
            return await serving.http_serve(url, w, [[i, 0] for i in range(5)])

    row = asyncio.run(main())
    assert row["status"] == "ok" and row["requests"] == 5
    assert queued == [0, 1, 2, 3, 4]


def _rows():
    base = {"engine": "vllm", "engine_version": "0", "mode": "default", "tp": 1, "shape": "qwen3-8b", "graphs": 1,
            "repeat": 1, "status": "ok"}
    bi = {**base, "mode": "batch-invariant"}
    return [{**base, "backend": "FLASH_ATTN", "workload": "chat", "output_tok_s": "100", "tpot_p50_ms": "20",
             "ttft_p50_ms": "500", "decode_step_p50_ms": "19", "startup_s": "50", "engine_init_s": "30"},
            {**base, "backend": "evenkv", "workload": "chat", "output_tok_s": "110", "tpot_p50_ms": "16",
             "ttft_p50_ms": "", "decode_step_p50_ms": "15", "startup_s": "53.5", "engine_init_s": "31"},
            {**base, "backend": "evenkv", "workload": "many-short", "output_tok_s": "50", "tpot_p50_ms": "1"},
            # batch-invariant rows compare with each other only, never with the default mode's
            {**bi, "backend": "FLASH_ATTN", "workload": "chat", "output_tok_s": "50", "tpot_p50_ms": "40",
             "ttft_p50_ms": "800", "decode_step_p50_ms": "30"},
            {**bi, "backend": "evenkv", "workload": "chat", "output_tok_s": "75", "tpot_p50_ms": "20",
             "ttft_p50_ms": "1000", "decode_step_p50_ms": "20"}]


def test_ratios_summary_and_plots(tmp_path):
    rs = serving.ratios(_rows(), "vllm", "FLASH_ATTN")
    common = {"run": "–", "tp": "1", "kv_cache_dtype": "auto", "torch_compile": "0", "shape": "qwen3-8b",
              "workload": "chat", "repeat": "1", "backend": "evenkv"}
    assert rs == [{"mode": "default", **common, "tok_s_ratio": 1.1, "tpot_p50_speedup": 1.25, "ttft_p50_speedup": None,
                   "decode_step_speedup": 1.267, "startup_delta_s": 3.5, "engine_init_delta_s": 1.0},
                  {"mode": "batch-invariant", **common, "tok_s_ratio": 1.5, "tpot_p50_speedup": 2.0,
                   "ttft_p50_speedup": 0.8, "decode_step_speedup": 1.5, "startup_delta_s": None,
                   "engine_init_delta_s": None}]
    md = serving.summary_markdown(_rows(), ["a note"])
    assert "- a note" in md
    assert "| – | default | 1 | auto | 0 | qwen3-8b | chat | 1 | evenkv | 1.1 | 1.25 | – | 1.267 | 3.5 | 1.0 |" in md
    assert "| – | batch-invariant | 1 | auto | 0 | qwen3-8b | chat | 1 | evenkv | 1.5 | 2.0 | 0.8 | 1.5 | – | – |" in md
    # start-up: one line per engine start, the chat and many-short rows of one evenkv start folded
    assert "| vllm | default | 1 | – | qwen3-8b | FLASH_ATTN | 1 | – | – | 50 | 30 | – | – |" in md
    assert "| vllm | default | 1 | – | qwen3-8b | evenkv | 1 | – | – | 53.5 | 31 | – | – |" in md
    starts = serving.startup_rows(_rows() + [{**_rows()[1], "workload": "long-mix"}])
    assert [(r["backend"], r["startup_s"]) for r in starts] == [("FLASH_ATTN", "50"), ("evenkv", "53.5")]
    serving.write_rows(tmp_path / "serving.csv", _rows())
    serving.report(tmp_path, ["n"])
    assert (tmp_path / "summary.md").read_text().startswith("# Serving benchmark")
    assert (tmp_path / "vllm-ratios.png").stat().st_size > 1000
    assert len(serving.read_rows(tmp_path / "serving.csv")) == 5


def test_ratios_pair_repeats_and_compile_modes_and_read_old_rows_as_default_mode():
    old = {"engine": "sglang", "shape": "s", "workload": "chat", "output_tok_s": "100", "tpot_p50_ms": "10",
           "ttft_p50_ms": "100"}  # a row of a CSV written before the mode, tp and repeat columns
    rows = [{**old, "backend": "fa3"}, {**old, "backend": "evenkv", "output_tok_s": "120"},
            {**old, "backend": "fa3", "mode": "default", "tp": "1", "repeat": "2", "output_tok_s": "200"},
            {**old, "backend": "evenkv", "mode": "default", "tp": "1", "repeat": "2", "output_tok_s": "220"},
            {**old, "backend": "triton", "tp": "2", "output_tok_s": "90"}]  # no fa3 row at tp 2: no ratio
    rows.append({**old, "backend": "evenkv", "torch_compile": "3", "output_tok_s": "130"})  # no fa3 row compiled
    rows.append({**old, "backend": "evenkv", "kv_cache_dtype": "fp8", "output_tok_s": "140"})  # no fa3 row over FP8
    rs = serving.ratios(rows, "sglang", "fa3")
    assert [(r["backend"], r["repeat"], r["tok_s_ratio"]) for r in rs] == [("evenkv", "1", 1.2), ("evenkv", "2", 1.1)]
    rows.append({**old, "backend": "fa3", "kv_cache_dtype": "fp8", "output_tok_s": "100"})
    fp8 = [r for r in serving.ratios(rows, "sglang", "fa3") if r["kv_cache_dtype"] == "fp8"]
    assert [(r["backend"], r["tok_s_ratio"]) for r in fp8] == [("evenkv", 1.4)]


def test_rows_of_two_runs_merged_into_one_csv_pair_within_their_run():
    """Two invocations, each repeat 1 of the same workload: each backend row is compared with the
    default backend's row of its own run, and each run's engine starts are listed apart."""
    base = {"engine": "sglang", "mode": "spec-ngram", "tp": "1", "shape": "s", "workload": "long-mix", "repeat": "1",
            "tpot_p50_ms": "10", "ttft_p50_ms": "100", "startup_s": "90", "start_order": "1"}
    rows = [{**base, "run": "A", "backend": "fa3", "output_tok_s": "100"},
            {**base, "run": "A", "backend": "evenkv", "output_tok_s": "90", "start_order": "2"},
            {**base, "run": "B", "backend": "evenkv", "output_tok_s": "120"},
            {**base, "run": "B", "backend": "fa3", "output_tok_s": "100", "start_order": "2"}]
    rs = serving.ratios(rows, "sglang", "fa3")
    assert [(r["run"], r["tok_s_ratio"]) for r in rs] == [("A", 0.9), ("B", 1.2)]
    assert [(r["backend"], r["start_order"]) for r in serving.startup_rows(rows)] == [
        ("fa3", "1"), ("evenkv", "2"), ("evenkv", "1"), ("fa3", "2")]
    rows[3]["start_order"] = "1"  # the same start position in both runs: still two starts
    assert len(serving.startup_rows(rows)) == 4


def test_csv_written_by_an_older_version_is_rewritten_with_the_new_columns(tmp_path):
    path = tmp_path / "serving.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, ["engine", "backend", "workload", "output_tok_s"])
        w.writeheader()
        w.writerow({"engine": "vllm", "backend": "evenkv", "workload": "chat", "output_tok_s": "7"})
    serving.write_rows(path, _rows()[:1])
    serving.write_rows(path, _rows()[1:2])  # same columns now: appended
    with path.open() as f:
        assert next(csv.reader(f)) == serving.COLUMNS
    rows = serving.read_rows(path)
    assert [(r["backend"], r["output_tok_s"], r["mode"]) for r in rows] == [
        ("evenkv", "7", ""), ("FLASH_ATTN", "100", "default"), ("evenkv", "110", "default")]


def test_the_csv_header_has_every_row_column():
    for col in ("mode", "tp", "start_order", "repeat", "run", "triton_cache", "engine_init_s", "import_s",
                "compiled_during_run", "compiled_during_warmup", "tokens_per_step", "torch_compile", "spec",
                "kv_cache_dtype"):
        assert col in serving.COLUMNS
    assert len(set(serving.COLUMNS)) == len(serving.COLUMNS)


def test_model_config_has_the_shape(tmp_path):
    d = serving.write_model("qwen3-30b-a3b-attn", tmp_path / "m", 140000)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 4, 128)
    assert cfg["num_hidden_layers"] == 48 and cfg["max_position_embeddings"] == 140000
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_mellum_shape_is_a_hybrid_window_model(tmp_path):
    """mellum-swa: Mellum's architecture (SGLang's hybrid SWA pool), three window layers to one full
    layer, dense MLPs, in transformers' MellumConfig fields."""
    cfg = json.loads((serving.write_model("mellum-swa", tmp_path / "m", 140000) / "config.json").read_text())
    assert cfg["architectures"] == ["MellumForCausalLM"] and cfg["model_type"] == "mellum"
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 4, 128)
    layers = cfg["num_hidden_layers"]
    assert len(cfg["layer_types"]) == len(cfg["mlp_layer_types"]) == layers == 28
    assert cfg["layer_types"].count("full_attention") == 7 and cfg["layer_types"][:4] == ["sliding_attention"] * 3 + [
        "full_attention"]
    assert set(cfg["mlp_layer_types"]) == {"dense"} and cfg["sliding_window"] == 1024
    assert set(cfg["rope_parameters"]) == {"full_attention", "sliding_attention"}
    assert "use_sliding_window" not in cfg and "rope_theta" not in cfg  # Qwen3's keys only


def test_cli_rejects_a_bad_workload_before_starting_an_engine(tmp_path):
    with pytest.raises(ValueError, match="got 'nope'"):
        serving.main(["vllm", "--out", str(tmp_path), "--workloads", "chat,nope"])
    assert not (tmp_path / "serving.csv").exists()


def test_cli_modes_tp_and_default_backends(tmp_path):
    a = serving.parse_args(["sglang", "--out", str(tmp_path), "--mode", "default", "--mode",
                            "batch-invariant,spec-ngram,default", "--tp", "2"])
    assert a.modes == ["default", "batch-invariant", "spec-ngram"] and a.tp == 2
    assert a.backends == "evenkv,fa3,triton" and serving.DEFAULT_BACKEND["sglang"] == "fa3"
    v = serving.parse_args(["vllm", "--out", str(tmp_path)])
    assert v.modes == ["default"] and v.tp == 1 and v.backends == "evenkv,FLASH_ATTN" and v.vllm_compile
    assert v.triton_cache == "fresh" and v.repeats == 1
    with pytest.raises(ValueError, match="mode: expected one of default, batch-invariant, spec-ngram, got 'fast'"):
        serving.parse_args(["vllm", "--out", str(tmp_path), "--mode", "default,fast"])
    with pytest.raises(ValueError, match="tp: expected >= 1, got 0"):
        serving.parse_args(["vllm", "--out", str(tmp_path), "--tp", "0"])
    with pytest.raises(ValueError, match="ngram-min <= ngram-max"):
        serving.parse_args(["vllm", "--out", str(tmp_path), "--ngram-min", "5", "--ngram-max", "3"])
    c = serving.parse_args(["child", "--engine", "vllm", "--shape", "qwen3-8b", "--backend", "evenkv", "--mode",
                            "spec-ngram", "--spec-tokens", "5", "--vllm-compile"])
    setup = serving.child_setup(c)
    assert (setup.mode, setup.spec_tokens, setup.torch_compile, setup.tp) == ("spec-ngram", 5, 3, 1)
    eager = serving.parse_args(["child", "--engine", "vllm", "--shape", "qwen3-8b", "--backend", "evenkv",
                                "--no-vllm-compile"])
    assert serving.child_setup(eager).torch_compile == 0


def test_children_rotate_which_backend_starts_first():
    kids = serving.child_order(["evenkv", "fa3", "triton"], ["default", "batch-invariant"], ["s"], 2)
    groups = [[c.backend for c in kids[i:i + 3]] for i in range(0, len(kids), 3)]
    assert groups == [["evenkv", "fa3", "triton"], ["fa3", "triton", "evenkv"], ["fa3", "triton", "evenkv"],
                      ["triton", "evenkv", "fa3"]]
    assert [c.start_order for c in kids] == list(range(1, 13))
    assert [(c.repeat, c.mode) for c in kids[::3]] == [(1, "default"), (1, "batch-invariant"), (2, "default"),
                                                       (2, "batch-invariant")]
    # Two backends, two modes, two repeats: each mode's first backend alternates across repeats.
    pairs = serving.child_order(["evenkv", "fa3"], ["default", "spec-ngram"], ["s"], 2)
    starts = {(c.repeat, c.mode): c.backend for c in pairs[::2]}
    assert starts == {(1, "default"): "evenkv", (1, "spec-ngram"): "fa3", (2, "default"): "fa3",
                      (2, "spec-ngram"): "evenkv"}
    first = serving.child_order(["evenkv", "FLASH_ATTN"], ["default"], ["a", "b"], 1, first="FLASH_ATTN")
    assert [(c.shape, c.backend) for c in first] == [("a", "FLASH_ATTN"), ("a", "evenkv"), ("b", "evenkv"),
                                                     ("b", "FLASH_ATTN")]
    with pytest.raises(ValueError, match="first: expected one of the backends .* got 'triton'"):
        serving.child_order(["evenkv", "FLASH_ATTN"], ["default"], ["a"], 1, first="triton")


def _fake_compile(cache, entry, name, binary=".cubin"):
    d = cache / entry
    d.mkdir(parents=True)
    (d / f"{name}.json").write_text(json.dumps({"name": name, "num_warps": 4}))
    (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {}}))
    (d / f"{name}.ttir").write_text("")
    (d / f"{name}{binary}").write_bytes(b"\0")


def test_compiles_are_attributed_by_kernel_name(tmp_path):
    cache = tmp_path / "triton"
    assert serving.compiled_kernels(cache) == {}
    _fake_compile(cache, "AAA", "decode_split_kernel")
    _fake_compile(cache, "BBB", "extend_kernel")
    (cache / "CCC").mkdir()  # an entry still being written: no binary yet, not counted
    (cache / "CCC" / "extend_kernel.json").write_text("{}")
    before = serving.compiled_kernels(cache)
    assert before == {"AAA": "decode_split_kernel", "BBB": "extend_kernel"}
    _fake_compile(cache, "DDD", "extend_kernel")  # a second specialization of the same kernel
    _fake_compile(cache, "EEE", "merge_kernel", ".hsaco")
    assert serving.compiled_since(before, cache) == ["extend_kernel", "merge_kernel"]
    assert serving.compiled_since({}, cache) == ["decode_split_kernel", "extend_kernel", "extend_kernel",
                                                 "merge_kernel"]


def test_a_cache_is_warm_only_after_a_start_that_reached_ready(tmp_path):
    """A cache filled by a start stopped before ready (its time ran out) is
    partial, not warm: its next start still compiles what the stopped one did not reach."""
    cache = tmp_path / "triton"
    assert serving.cache_state(cache, serving.compiled_kernels(cache)) == "cold"
    _fake_compile(cache, "AAA", "decode_split_kernel")
    assert serving.cache_state(cache, serving.compiled_kernels(cache)) == "partial"
    (cache / serving.READY_MARK).touch()
    assert serving.compiled_kernels(cache) == {"AAA": "decode_split_kernel"}  # the mark is not a kernel
    assert serving.cache_state(cache, serving.compiled_kernels(cache)) == "warm"


def test_a_child_may_run_into_later_shares_but_not_their_minimum():
    """A cold start longer than an equal share runs on; every later child keeps --min-child."""
    assert serving.child_deadline(320, 4, 40) == 200
    assert serving.child_deadline(100, 1, 40) == 100
    assert serving.child_deadline(100, 3, 40) == 20  # below --min-child: the parent skips it


def test_a_short_budget_leaves_out_whole_groups_from_the_end():
    """Where the budget cannot keep --min-child for every start, the last (repeat, mode, shape)
    groups go, not the first child, which would leave its group's other backends unpaired."""
    kids = serving.child_order(["evenkv", "FLASH_ATTN"], ["default"], ["s"], 2, first="FLASH_ATTN")
    assert serving.children_that_fit(kids, 2, 0, 600, 150) == kids  # 4 starts fit
    assert serving.children_that_fit(kids, 2, 0, 556, 150) == kids[:2]  # 3 fit: one whole pair
    assert [c.backend for c in kids[:2]] == ["FLASH_ATTN", "evenkv"]
    assert serving.children_that_fit(kids, 2, 1, 600, 150) == kids[:2]  # an untimed start takes one share
    assert serving.children_that_fit(kids, 2, 0, 100, 150) == kids[:2]  # at least the first group
    three = serving.child_order(["evenkv", "fa3", "triton"], ["default", "batch-invariant"], ["s"], 1)
    assert serving.children_that_fit(three, 3, 0, 5 * 120, 120) == three[:3]


def test_vllm_arguments_per_mode(tmp_path):
    default = serving.EngineSetup()
    kw = serving.vllm_llm_kwargs(tmp_path, "CUSTOM", 9000, 48, 0.8, default)
    assert kw["tensor_parallel_size"] == 1 and "speculative_config" not in kw and "kv_cache_dtype" not in kw
    fp8 = serving.vllm_llm_kwargs(tmp_path, "FLASH_ATTN", 9000, 48, 0.8, serving.EngineSetup(kv_cache_dtype="fp8"))
    assert fp8["kv_cache_dtype"] == "fp8"
    assert kw["compilation_config"]["mode"] == 0 and kw["compilation_config"]["custom_ops"] == ["none"]
    assert kw["compilation_config"]["cudagraph_capture_sizes"][-1] == 48
    spec = serving.EngineSetup(mode="spec-ngram", tp=2, torch_compile=3, spec_tokens=3, ngram_min=2, ngram_max=4)
    kw = serving.vllm_llm_kwargs(tmp_path, "FLASH_ATTN", 9000, 48, 0.8, spec)
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                        "prompt_lookup_max": 4}
    assert kw["tensor_parallel_size"] == 2 and kw["compilation_config"]["mode"] == 3
    # graph sizes count tokens: 1 + K per request of a verify step
    sizes = kw["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes[0] == 4 and sizes[-1] == 48 * 4 and all(s % 4 == 0 for s in sizes)
    eager = serving.vllm_llm_kwargs(tmp_path, "CUSTOM", 9000, 48, 0.8, serving.EngineSetup(graphs=False))
    assert eager["enforce_eager"] and eager["compilation_config"]["cudagraph_mode"] == "NONE"
    assert serving.mode_env("vllm", "batch-invariant") == {"VLLM_BATCH_INVARIANT": "1"}
    assert serving.mode_env("vllm", "default") == {} and serving.mode_env("sglang", "batch-invariant") == {}
    assert spec.spec_label("vllm") == "ngram:k=3,n=2-4" and spec.spec_label("sglang") == "NGRAM:draft=4,breadth=1"
    assert default.spec_label("vllm") == ""


def _kv_write_case(cache_dtype, layout="NHD"):
    torch.manual_seed(0)
    blocks, block_size, hkv, d, padded = 4, 16, 2, 8, 7
    key, value = (torch.randn(padded, hkv, d, dtype=torch.bfloat16) * 4 for _ in range(2))
    key[1, 0, 0] = 1e4  # beyond e4m3's range once divided by the scale
    shape = (blocks, hkv, block_size, d) if layout == "HND" else (blocks, block_size, hkv, d)
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
    if layout == "HND":
        caches = [c.transpose(1, 2) for c in caches]
    slots = torch.tensor([17, 3, -1, 63, 40])  # 5 tokens; vLLM pads key and value past them
    return key, value, caches, slots


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_kit_kv_write_stores_e4m3_as_vllm_does(cache_dtype, layout):
    """The serving benchmark's FP8 KV write for vLLM's own backends on the kit's stand-ins, on
    CPU tensors: value / scale, saturated to +-448, rounded to e4m3; a slot of -1 goes to slot 0
    (the GPU lane checks vLLM's fused write on CUDA tensors against this one)."""
    from benchmarks.kit_stand_ins import write_kv_cache

    key, value, (k_cache, v_cache), slots = _kv_write_case(cache_dtype, layout)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([2.0])
    write_kv_cache(key, value, k_cache, v_cache, slots, "fp8", k_scale, v_scale)
    k8, v8 = (c.view(torch.float8_e4m3fn).float() for c in (k_cache, v_cache))
    for i, slot in enumerate([17, 3, 0, 63, 40]):
        want_k = (key[i].float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        want_v = (value[i].float() / 2.0).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        assert torch.equal(k8[slot // 16, slot % 16], want_k) and torch.equal(v8[slot // 16, slot % 16], want_v)
    assert k8[0, 3, 0, 0] == 448.0 and not k8.isnan().any()
    written = {17, 3, 0, 63, 40}
    untouched = [s for s in range(64) if s not in written]
    assert all(k8[s // 16, s % 16].abs().sum() == 0 for s in untouched)


def test_kit_kv_write_auto_and_bad_arguments():
    from benchmarks.kit_stand_ins import write_kv_cache

    key, value, (k_cache, v_cache), slots = _kv_write_case(torch.bfloat16)
    one = torch.tensor([1.0])
    write_kv_cache(key, value, k_cache, v_cache, slots, "auto", one, one)
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[3, 15], value[3])
    with pytest.raises(ValueError, match="kv_cache_dtype.*'fp8_e5m2'"):
        write_kv_cache(key, value, k_cache, v_cache, slots, "fp8_e5m2", one, one)
    with pytest.raises(ValueError, match="key_cache/value_cache: expected uint8 or float8_e4m3fn.*bfloat16"):
        write_kv_cache(key, value, k_cache, v_cache, slots, "fp8", one, one)


@pytest.fixture
def kits_kv_write_op():
    """``_C_cache_ops::reshape_and_cache_flash`` defined as the kit's stand-ins define it, with a
    write that refuses FP8 caches (unless this process already has the op)."""
    if hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
        yield
        return
    kit = torch.library.Library("_C_cache_ops", "FRAGMENT")
    kit.define("reshape_and_cache_flash(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
               "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")

    def refuses_fp8(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
        raise NotImplementedError("stub supports kv_cache_dtype='auto' only")

    kit.impl("reshape_and_cache_flash", refuses_fp8, "CPU")
    yield kit


def test_kit_kv_write_replaces_the_kits_op(kits_kv_write_op, monkeypatch):
    """install_kv_write takes over the op the kit's stand-ins define, for CPU and CUDA tensors,
    also where ``Library.impl`` refuses by default to override a Python registration (torch
    2.11, the device's)."""
    from benchmarks import kit_stand_ins

    original_impl = torch.library.Library.impl

    def impl_refusing_overrides_by_default(self, op_name, fn, dispatch_key="", *, with_keyset=False,
                                           allow_override=False):
        return original_impl(self, op_name, fn, dispatch_key, with_keyset=with_keyset, allow_override=allow_override)

    monkeypatch.setattr(torch.library.Library, "impl", impl_refusing_overrides_by_default)
    monkeypatch.setattr(kit_stand_ins, "_registrations", None)
    key, value, (k_cache, v_cache), slots = _kv_write_case(torch.uint8)
    kit_stand_ins.install_kv_write()
    kit_stand_ins.install_kv_write()  # idempotent
    torch.ops._C_cache_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, "fp8", torch.tensor([1.0]),
                                                   torch.tensor([1.0]))
    assert torch.equal(k_cache.view(torch.float8_e4m3fn)[1, 1].float(),
                       key[0].float().clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert not kit_stand_ins.runs_on_stand_ins()  # no vLLM here, so never the kit's


@pytest.mark.parametrize("kv_cache_dtype, stand_ins, installs", [("fp8", True, True), ("fp8", False, False),
                                                                  ("auto", True, True), ("auto", False, False)])
def test_vllm_child_installs_the_fused_write_only_over_the_kits_stand_ins(tmp_path, monkeypatch, kv_cache_dtype,
                                                                         stand_ins, installs):
    import types

    from benchmarks import kit_stand_ins

    installed = []
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vllm_llm sets it; the test restores it
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: kw))
    monkeypatch.setattr(kit_stand_ins, "runs_on_stand_ins", lambda: stand_ins)
    monkeypatch.setattr(kit_stand_ins, "install_kv_write", lambda: installed.append(True))
    kw = serving.vllm_llm(tmp_path, "FLASH_ATTN", 9000, 48, 0.8, serving.EngineSetup(kv_cache_dtype=kv_cache_dtype))
    assert installed == ([True] if installs else [])
    assert kw["attention_backend"] == "FLASH_ATTN" and kw.get("kv_cache_dtype", "auto") == kv_cache_dtype


def test_server_command_has_the_operator_flags(tmp_path):
    cmd = serving.sglang_server_cmd(tmp_path, "evenkv", 30000, 9000, 256, 0.8, serving.EngineSetup())
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in (("--attention-backend", "evenkv"), ("--load-format", "dummy"),
                        ("--max-running-requests", "256"), ("--cuda-graph-max-bs-decode", "256"), ("--tp-size", "1")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-deterministic-inference" not in cmd and "--speculative-algorithm" not in cmd
    assert "--kv-cache-dtype" not in cmd
    fp8 = serving.sglang_server_cmd(tmp_path, "fa3", 1, 9000, 8, 0.8, serving.EngineSetup(kv_cache_dtype="fp8"))
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    eager = serving.sglang_server_cmd(tmp_path, "triton", 1, 9000, 8, 0.8, serving.EngineSetup(graphs=False))
    assert "--disable-cuda-graph" in eager
    det = serving.sglang_server_cmd(tmp_path, "fa3", 1, 9000, 8, 0.8, serving.EngineSetup(mode="batch-invariant"))
    assert "--enable-deterministic-inference" in det
    spec = serving.sglang_server_cmd(tmp_path, "evenkv", 1, 9000, 8, 0.8,
                                     serving.EngineSetup(mode="spec-ngram", tp=2, spec_tokens=5, ngram_breadth=3))
    for flag, value in (("--speculative-algorithm", "NGRAM"), ("--speculative-num-draft-tokens", "6"),
                        ("--speculative-ngram-max-bfs-breadth", "3"), ("--tp-size", "2")):
        assert spec[spec.index(flag) + 1] == value


def test_parent_runs_children_in_turn_with_their_triton_caches(tmp_path, monkeypatch):
    """run_parent with a stand-in child that writes one row holding its cache folder and flags."""
    child = (
        "import json, os, sys\n"
        "a = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
        "cache = os.environ['TRITON_CACHE_DIR']\n"
        "warm = bool(os.listdir(cache))\n"
        "os.makedirs(os.path.join(cache, a['--backend'] + a['--repeat']), exist_ok=True)\n"
        "row = {'engine': 'sglang', 'mode': a['--mode'], 'tp': 1, 'shape': 's', 'backend': a['--backend'],\n"
        "       'workload': 'chat', 'repeat': a['--repeat'], 'start_order': a['--start-order'],\n"
        "       'triton_cache': 'warm' if warm else 'cold', 'output_tok_s': 1,\n"
        "       'status': '|'.join(os.environ[k] for k in ('TRITON_CACHE_DIR', 'VLLM_CACHE_ROOT',\n"
        "                                                   'TORCHINDUCTOR_CACHE_DIR'))}\n"
        "open(a['--json'], 'w').write(json.dumps([row]))\n"
        "print('Engine startup timings (s): scheduler_e2e=1.5, cuda_graph={decode=0.25, prefill=0.00}')\n")

    def fake_cmd(a, c, rows_json, startup_file):
        return [sys.executable, "-c", child, "--backend", c.backend, "--mode", c.mode, "--repeat", str(c.repeat),
                "--start-order", str(c.start_order), "--json", str(rows_json)]

    monkeypatch.setattr(serving, "child_cmd", fake_cmd)
    monkeypatch.setattr(serving.subprocess, "run", lambda *args, **kw: None)  # the untimed engine import
    out = tmp_path / "run"
    rc = serving.main(["sglang", "--out", str(out), "--backends", "evenkv,fa3", "--mode", "default,batch-invariant",
                       "--repeats", "2", "--triton-cache", "shared", "--triton-cache-dir", str(tmp_path / "tc"),
                       "--min-child", "0", "--budget", "600"])
    assert rc == 0
    rows = serving.read_rows(out / "serving.csv")
    assert [(r["repeat"], r["mode"], r["backend"], r["start_order"]) for r in rows] == [
        ("1", "default", "evenkv", "1"), ("1", "default", "fa3", "2"),
        ("1", "batch-invariant", "fa3", "3"), ("1", "batch-invariant", "evenkv", "4"),
        ("2", "default", "fa3", "5"), ("2", "default", "evenkv", "6"),
        ("2", "batch-invariant", "evenkv", "7"), ("2", "batch-invariant", "fa3", "8")]
    # one shared cache folder per (mode, backend), the torch.compile caches beside it: cold at its
    # first start, warm in the second repeat
    for r in rows:
        triton = str(tmp_path / "tc" / f"sglang-{r['mode']}-tp1-qwen3-30b-a3b-attn-{r['backend']}")
        assert r["status"] == f"{triton}|{triton}-vllm|{triton}-inductor"
        assert r["triton_cache"] == ("cold" if r["repeat"] == "1" else "warm")
        assert r["startup_phases"] == "scheduler_e2e=1.5;cuda_graph.decode=0.25"  # from the child's log
    assert len({r["run"] for r in rows}) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rows[0]["run"])
    assert (out / "summary.md").exists()


@pytest.fixture
def row_writing_children(monkeypatch):
    """Children that write one ok row for their backend and exit at once; no engine import."""
    child = ("import json, sys\n"
             "a = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
             "open(a['--json'], 'w').write(json.dumps([{'engine': 'sglang', 'backend': a['--backend'], "
             "'workload': 'chat', 'status': 'ok'}]))\n")
    monkeypatch.setattr(serving, "child_cmd", lambda a, c, rows_json, startup_file: [
        sys.executable, "-c", child, "--backend", c.backend, "--json", str(rows_json)])
    monkeypatch.setattr(serving.subprocess, "run", lambda *args, **kw: None)  # the untimed engine import


def test_a_budget_short_of_every_child_warns_and_skips_from_the_first(tmp_path, row_writing_children, capsys):
    """Two children at --min-child 60 in 100 s: the parent says so before starting, skips the
    first (40 s would be left for it) and runs the second."""
    out = tmp_path / "run"
    assert serving.main(["sglang", "--out", str(out), "--backends", "evenkv,fa3", "--first", "evenkv",
                         "--min-child", "60", "--budget", "100"]) == 1
    printed = capsys.readouterr().out
    assert re.search(r"WARNING: (99|100) s of --budget left for 2 engine starts x --min-child 60 s", printed)
    assert "SKIPPED sglang default qwen3-30b-a3b-attn evenkv" in printed
    assert [r["backend"] for r in serving.read_rows(out / "serving.csv")] == ["fa3"]


def test_a_budget_short_of_two_repeats_runs_the_first_pair_whole(tmp_path, row_writing_children, capsys):
    """Two repeats of a pair at --min-child 60 in 200 s: the second repeat's group is left out,
    and both backends of the first run (not the first child skipped and three run unpaired)."""
    out = tmp_path / "run"
    assert serving.main(["sglang", "--out", str(out), "--backends", "evenkv,fa3", "--first", "fa3", "--repeats", "2",
                         "--min-child", "60", "--budget", "200"]) == 1
    printed = capsys.readouterr().out
    assert printed.count("SKIPPED") == 2 and "(repeat 2, start 3)" in printed and "(repeat 2, start 4)" in printed
    assert [r["backend"] for r in serving.read_rows(out / "serving.csv")] == ["fa3", "evenkv"]


def test_untimed_start_runs_first_and_writes_no_row(tmp_path, monkeypatch):
    """--untimed-start: one start-up-only start of the first child's engine, with its own Triton
    cache, before the timed children; only the timed children have rows."""
    starts = tmp_path / "starts.txt"
    child = (
        "import json, os, sys\n"
        "a = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
        f"open({str(starts)!r}, 'a').write(a['--backend'] + a['--repeat'] + ' ' + str(a.get('--startup-only'))"
        " + ' ' + os.environ['TRITON_CACHE_DIR'] + '\\n')\n"
        "row = {'engine': 'sglang', 'mode': 'default', 'tp': 1, 'shape': 's', 'backend': a['--backend'],\n"
        "       'workload': 'chat', 'repeat': a['--repeat'], 'start_order': a['--start-order'], 'status': 'ok'}\n"
        "open(a['--json'], 'w').write(json.dumps([row]))\n")

    def fake_cmd(a, c, rows_json, startup_file):
        flag = ["--startup-only", "1"] if a.startup_only else []
        return [sys.executable, "-c", child, "--backend", c.backend, "--repeat", str(c.repeat),
                "--start-order", str(c.start_order), "--json", str(rows_json)] + flag

    monkeypatch.setattr(serving, "child_cmd", fake_cmd)
    monkeypatch.setattr(serving.subprocess, "run", lambda *args, **kw: None)
    out = tmp_path / "run"
    assert serving.main(["sglang", "--out", str(out), "--backends", "evenkv,fa3", "--first", "fa3", "--untimed-start",
                         "--min-child", "0", "--budget", "600"]) == 0
    lines = [line.split() for line in starts.read_text().splitlines()]
    assert [(b, flag) for b, flag, _ in lines] == [("fa30", "1"), ("fa31", "None"), ("evenkv1", "None")]
    assert len({cache for _, _, cache in lines}) == 3  # the untimed start warms no child's cache
    rows = serving.read_rows(out / "serving.csv")
    assert [(r["backend"], r["start_order"]) for r in rows] == [("fa3", "1"), ("evenkv", "2")]
    assert (out / "untimed-start.log").exists()


def test_server_log_is_copied_and_its_first_line_timed(capfd):
    import subprocess
    import time

    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3); print('server_args=...');"
                             "print('ready \\xff')"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    log = serving.ServerLog(proc)
    proc.wait(10)
    log._thread.join(10)
    assert log.first_line_at is not None and log.first_line_at - t0 >= 0.3
    assert "server_args=...\nready" in capfd.readouterr().out


def test_server_log_tracks_kv_pool_pressure_per_workload():
    """The fullest KV pool and the batches that found one full with requests queued, from
    SGLang's batch lines (hybrid and plain pools), counted from a workload's first batch."""
    import subprocess

    hybrid = ("[2026-12-05 18:53:26] Decode batch, #running-req: 233, #full token: 327551, full token usage: 0.08, "
              "#swa token: 327551, swa token usage: 1.00, cuda graph: True, gen throughput (token/s): 818.20, "
              "#queue-req: 23")
    lines = ["server_args=...",
             "[t] Prefill batch, #new-seq: 1, #new-token: 3, #cached-token: 0, token usage: 0.99, #running-req: 0, "
             "#queue-req: 0, #pending-token: 0, cuda graph: True",  # full, but nobody waits
             "[t] Decode batch, #running-req: 3, #token: 70, token usage: 0.50, cuda graph: True, #queue-req: 4",
             hybrid,
             "a line that mentions token usage: 1.00 but is no batch line, #queue-req: 9"]
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print(*sys.argv[1:], sep='\\n')", *lines],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = serving.ServerLog(proc)  # its thread alone reads the output
    proc.wait(10)
    log._thread.join(10)
    assert log.batches == [(0.99, 0), (0.5, 4), (1.0, 23)]
    assert log.pool_pressure(0) == {"kv_usage_peak": 1.0, "kv_full_queued": "1/3"}
    assert log.pool_pressure(1) == {"kv_usage_peak": 1.0, "kv_full_queued": "1/2"}
    assert log.pool_pressure(2) == {"kv_usage_peak": 1.0, "kv_full_queued": "1/1"}
    assert log.pool_pressure(3) == {"kv_usage_peak": "", "kv_full_queued": ""}  # no batch logged since
    assert serving.batch_pool_state(lines[1]) == (0.99, 0)
    assert serving.batch_pool_state(lines[4]) is None


def test_vllm_pool_state_from_an_in_process_scheduler():
    """KV usage and the requests waiting (queued and set aside) from vLLM's scheduler, as
    vLLM 0.26-0.33 nest it; None where the engine has no in-process scheduler."""
    from types import SimpleNamespace as NS

    def engine(scheduler):
        return NS(engine_core=NS(engine_core=NS(scheduler=scheduler)))

    full = NS(kv_cache_manager=NS(usage=0.99), waiting=[1, 2], skipped_waiting=[3])
    assert serving.vllm_pool_state(engine(full)) == (0.99, 3)
    assert serving.vllm_pool_state(engine(NS(kv_cache_manager=NS(usage=0.25), waiting=[]))) == (0.25, 0)
    assert serving.vllm_pool_state(NS(engine_core=NS())) is None  # a multiprocess client
    assert serving.vllm_pool_state(engine(NS(waiting=[]))) is None
    assert serving.pool_pressure([(0.99, 3), (0.25, 0), (0.99, 0)]) == {"kv_usage_peak": 0.99,
                                                                       "kv_full_queued": "1/3"}
    assert serving.pool_pressure([]) == {"kv_usage_peak": "", "kv_full_queued": ""}


def test_engine_startup_phases_from_the_engines_logs():
    vllm_log = ("INFO 12-03 14:55:54.881 [backends.py:1155] Dynamo bytecode transform time: 3.50 s\n"
                "INFO 12-03 14:55:56.953 [monitor.py:53] torch.compile took 5.57 s in total\n"
                "INFO [vllm_backend.py:626] evenkv: kernels of 1 attention object(s) built or loaded in 0.06 s\n"
                "INFO [vllm_backend.py:626] evenkv: kernels of 2 attention object(s) built or loaded in 0.40 s\n"
                "INFO [model_runner.py:747] Graph capturing finished in 1 secs, took 0.13 GiB\n"
                "INFO [core.py:340] init engine (profile, create kv cache, warmup model) took 9.90 s (compilation: 5.57 s)\n")
    assert serving.engine_startup_phases(vllm_log, "vllm") == \
        "dynamo=3.5;torch_compile=5.57;capture=1;init_engine=9.9;evenkv_builds=0.4"
    sglang_log = ("[2026-12-03 15:13:38] evenkv: kernels of 1 attention object(s) built or loaded in 0.05 s\n"
                  "[2026-12-03 15:14:28] Engine startup timings (s): load_weight=0.13, kv_cache_allocation=0.41, "
                  "scheduler_e2e=53.39, cuda_graph={prefill=33.62, decode=0.00, target_verify=15.98}, "
                  "tokenizer_e2e=74.29\n")
    assert serving.engine_startup_phases(sglang_log, "sglang") == (
        "evenkv_builds=0.05;load_weight=0.13;kv_cache_allocation=0.41;scheduler_e2e=53.39;tokenizer_e2e=74.29;"
        "cuda_graph.prefill=33.62;cuda_graph.target_verify=15.98")
    # vLLM's phases are not read from an SGLang log, and a log without any gives ""
    assert serving.engine_startup_phases(vllm_log, "sglang") == "evenkv_builds=0.4"
    assert serving.engine_startup_phases("nothing here\n", "vllm") == ""


def test_startup_stretches_between_timestamped_log_lines():
    vllm_log = ("(EngineCore pid=7) INFO 12-06 23:59:50.120 [model_runner.py:305] Model loading took 15.3 GiB\n"
                "INFO 12-06 23:59:54 [gpu_worker.py:560] Available KV cache memory: 53.7 GiB\n"
                "INFO 12-06 23:59:55 [gpu_worker.py:560] Available KV cache memory: 53.7 GiB\n"
                "INFO 12-07 00:00:03 [model_runner.py:747] Graph capturing finished in 5 secs, took 0.51 GiB\n"
                "INFO 12-07 00:00:20 [core.py:347] init engine (profile, create kv cache, warmup model) took 30.1 s\n")
    # stretches from the first matching line to the first later one, across midnight
    assert serving.engine_startup_phases(vllm_log, "vllm") == (
        "capture=5;init_engine=30.1;load_to_kv_sizing=4;kv_sizing_to_captured=9;captured_to_ready=17")
    sglang_log = ("[2026-12-06 06:59:45] server_args=ServerArgs(model_path='m')\n"
                  "[2026-12-06 07:00:08 TP0] Init torch distributed begin.\n")
    assert serving.engine_startup_phases(sglang_log, "sglang") == "scheduler_spawn=23"
    # an end line before its start line, or a missing one, gives no stretch; nor does another engine's format
    assert serving.engine_startup_phases("\n".join(reversed(sglang_log.splitlines())), "sglang") == ""
    assert serving.engine_startup_phases(vllm_log.split("INFO 12-07")[0], "vllm") == "load_to_kv_sizing=4"
    assert serving.engine_startup_phases(sglang_log, "vllm") == ""


def test_memory_fraction_per_engine_and_mode(tmp_path):
    assert serving.memory_fraction("sglang", "spec-ngram", None) == 0.8
    assert serving.memory_fraction("sglang", "default", None) == 0.9
    assert serving.memory_fraction("vllm", "spec-ngram", None) == 0.9
    assert serving.memory_fraction("sglang", "spec-ngram", 0.7) == 0.7
    a = serving.parse_args(["sglang", "--out", str(tmp_path)])
    child = serving.Child(1, "spec-ngram", "qwen3-30b-a3b-attn", "evenkv", 1)
    assert "--mem" not in serving.child_cmd(a, child, tmp_path / "r.json", tmp_path / "s.txt")
    fp8 = serving.parse_args(["vllm", "--out", str(tmp_path), "--kv-cache-dtype", "fp8"])
    cmd = serving.child_cmd(fp8, child, tmp_path / "r.json", tmp_path / "s.txt")
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    assert serving.child_setup(serving.parse_args(cmd[3:])).kv_cache_dtype == "fp8"
    a = serving.parse_args(["sglang", "--out", str(tmp_path), "--mem", "0.75"])
    cmd = serving.child_cmd(a, child, tmp_path / "r.json", tmp_path / "s.txt")
    assert cmd[cmd.index("--mem") + 1] == "0.75"


def test_a_child_whose_engine_fails_keeps_a_row_per_workload(tmp_path, monkeypatch):
    """run_child with an SGLang server that exits before it is ready: each workload gets a row
    with the error and what was measured before it; the error still propagates."""
    import types

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0-test"))
    monkeypatch.setattr(serving, "sglang_server_cmd",
                        lambda *args: [sys.executable, "-c", "print('server_args=...'); raise SystemExit(3)"])
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    a = serving.parse_args(["child", "--engine", "sglang", "--shape", "qwen3-30b-a3b-attn", "--backend", "fa3",
                            "--mode", "spec-ngram", "--workloads", "chat,long-mix", "--model-dir", str(tmp_path),
                            "--startup-timeout", "60"])
    rows = []
    with pytest.raises(RuntimeError, match="exited with 3"):
        serving.run_child(a, rows)
    assert [r["workload"] for r in rows] == ["chat", "long-mix"]
    for r in rows:
        assert r["status"] == "error: RuntimeError: the server exited with 3 before it was ready"
        assert r["backend"] == "fa3" and r["mode"] == "spec-ngram" and r["mem_fraction"] == 0.8
        assert r["engine_version"] == "0-test" and r["triton_cache"] == "cold" and "startup_s" not in r
        assert r["kv_cache_dtype"] == "auto"
        assert set(r) <= set(serving.COLUMNS), set(r) - set(serving.COLUMNS)  # the CSV keeps every field
    assert serving.unfinished_status(SystemExit(143)) == "stopped"
    assert serving.unfinished_status(ValueError("x" * 300)).startswith("error: ValueError: xxx")
    assert len(serving.unfinished_status(ValueError("x" * 300))) < 200


def test_a_server_that_dies_mid_run_is_named_in_the_row(tmp_path, monkeypatch):
    """A server whose scheduler dies while a workload runs shows the client only a cut-off
    response: the row's status leads with the server's own last exception line."""
    import types

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0-test"))
    crash = ("import sys; print('Traceback (most recent call last):'); "
             "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB.'); sys.exit(1)")
    monkeypatch.setattr(serving, "sglang_server_cmd", lambda *args: [sys.executable, "-c", crash])
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    a = serving.parse_args(["child", "--engine", "sglang", "--shape", "qwen3-30b-a3b-attn", "--backend", "evenkv",
                            "--workloads", "chat", "--model-dir", str(tmp_path), "--startup-timeout", "60"])
    rows = []
    with pytest.raises(RuntimeError, match="exited with 1"):
        serving.run_child(a, rows)
    assert rows[0]["status"] == ("error: server: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                 "1.02 GiB.; client: RuntimeError: the server exited with 1 before it was ready")


_HEALTHY_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("server_args=...", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_startup_only_child_records_its_start_and_stops_its_server(tmp_path, monkeypatch):
    """--startup-only: the server starts, becomes healthy, is stopped, and the child leaves one
    row (workload startup:<workloads>) with the start-up figures and no workload numbers; the
    parent passes the flag on."""
    import socket
    import types

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = []

    def fake_server_cmd(*args):
        started.append(args)
        return [sys.executable, "-c", _HEALTHY_SERVER, str(port)]

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0-test"))
    monkeypatch.setattr(serving, "sglang_server_cmd", fake_server_cmd)
    stopped = []
    real_stop = serving.stop_server
    monkeypatch.setattr(serving, "stop_server", lambda proc: (real_stop(proc), stopped.append(proc.poll())))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    a = serving.parse_args(["child", "--engine", "sglang", "--shape", "qwen3-30b-a3b-attn", "--backend", "evenkv",
                            "--mode", "spec-ngram", "--workloads", "chat,long-mix", "--model-dir", str(tmp_path),
                            "--port", str(port), "--startup-timeout", "60", "--startup-only"])
    rows = []
    serving.run_child(a, rows)
    # Sized as a full run of both workloads would be: long-mix's requests.
    assert len(started) == 1 and started[0][4] == len(serving.make_workload("long-mix", "quick").prompt_lens)
    assert stopped and stopped[0] is not None  # the server's process has exited
    assert len(rows) == 1
    r = rows[0]
    assert r["workload"] == "startup:chat,long-mix" and r["status"] == "ok"
    assert r["startup_s"] >= 0 and r["triton_compiles_startup"] == 0 and "output_tok_s" not in r
    parent = serving.parse_args(["sglang", "--out", str(tmp_path), "--startup-only"])
    child = serving.Child(1, "spec-ngram", "qwen3-30b-a3b-attn", "evenkv", 1)
    assert "--startup-only" in serving.child_cmd(parent, child, tmp_path / "r.json", tmp_path / "s.txt")
    parent = serving.parse_args(["sglang", "--out", str(tmp_path)])
    assert "--startup-only" not in serving.child_cmd(parent, child, tmp_path / "r.json", tmp_path / "s.txt")
