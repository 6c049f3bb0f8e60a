"""CPU tests of the benchmark harnesses (no GPU): the length generator, the sweep and
check-point selection, fp8 pools, windows and the bytes they read, verify rows (their
batches, reference and check), the summary math on a synthetic CSV (verify and
deterministic ratios included), argument parsing, the evenkv/peer adapters' naming and what
each says it supports, each peer adapter's calls against a stand-in of its peer's API
(written from the peer's documented semantics), the whole measurement loop with CUDA timing
mocked (evenkv kernels under the interpreter), and ``python -m evenkv demo`` in interpreter
mode.
"""

import csv
import dataclasses
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import benchmarks.decode_imbalance as di
from benchmarks import report
from benchmarks.peers import (Runner, evenkv_impl, fa3, fi_jit, flashinfer_holistic, flashinfer_xqa, load,
                               sglang_lean, sglang_triton)

import evenkv

REPO = Path(__file__).resolve().parent.parent

PCT = {"Skewed40": 40, "Skewed60": 60, "Skewed80": 80}


# ----------------------------------------------------------------------------- distributions

@pytest.mark.parametrize("total", [32768, 262144, 1048576, 1000])
@pytest.mark.parametrize("dist", di.DISTS)
def test_dist_lengths_exact_total_and_long_first(total, dist):
    for b in di.B_VALUES:
        lens = di.dist_lengths(dist, total, b)
        if lens is None:
            continue
        assert len(lens) == b and sum(lens) == total and min(lens) >= 1
        if dist == "Uniform":
            assert max(lens) - min(lens) <= 1
        elif dist == "2x40":
            assert lens[0] == lens[1] == total * 40 // 100
            assert all(n <= lens[0] for n in lens[2:])
            assert max(lens[2:]) - min(lens[2:]) <= 1
        else:
            assert lens[0] == total * PCT[dist] // 100
            assert max(lens[1:]) - min(lens[1:]) <= 1


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 1 << 21), b=st.integers(1, 4096), dist=st.sampled_from(di.DISTS))
def test_dist_lengths_property(total, b, dist):
    lens = di.dist_lengths(dist, total, b)
    n_long = {"Uniform": 0, "2x40": 2}.get(dist, 1)
    long = total * (40 if dist == "2x40" else PCT.get(dist, 0)) // 100
    rest = total - n_long * long
    exists = total >= b and b > n_long and rest >= b - n_long and (n_long == 0 or long >= 1)
    assert (lens is not None) == exists
    if lens is not None:
        assert len(lens) == b and sum(lens) == total and min(lens) >= 1


def test_dist_lengths_examples_and_missing_points():
    assert di.dist_lengths("Skewed80", 100, 4) == [80, 7, 7, 6]
    assert di.dist_lengths("2x40", 100, 4) == [40, 40, 10, 10]
    assert di.dist_lengths("Uniform", 10, 4) == [3, 3, 2, 2]
    assert di.dist_lengths("Uniform", 7, 1) == [7]
    assert di.dist_lengths("Skewed40", 7, 1) is None      # B = 1 is Uniform
    assert di.dist_lengths("2x40", 100, 2) is None        # two 40 % requests leave 20 % for nobody
    assert di.dist_lengths("Uniform", 3, 4) is None       # fewer tokens than requests
    assert di.dist_lengths("Skewed80", 32768, 2048) is not None
    with pytest.raises(ValueError):
        di.dist_lengths("Skewed50", 100, 4)


def test_sweep_points_and_check_points():
    pts = di.sweep_points((32768,), di.B_VALUES, di.DISTS)
    # B = 1: Uniform only; B = 2: no 2x40; every other B: all five
    assert len(pts) == 1 + 4 + 5 * (len(di.B_VALUES) - 2)
    assert all(sum(lens) == t for t, _, _, lens in pts)
    assert di.sweep_points((100,), (64, 128), ("Uniform",)) == \
        [(100, 64, "Uniform", di.dist_lengths("Uniform", 100, 64))]
    checks = di.check_points(pts)
    assert checks == [(1, "Uniform"), (64, "Skewed80"), (2048, "2x40")]
    assert di.check_points(di.sweep_points((262144,), (1, 16, 256, 2048), di.DISTS)) == \
        [(1, "Uniform"), (16, "Skewed80"), (2048, "2x40")]


def test_sample_rows_and_seeds():
    rows = di.sample_rows(2048, 8, 3)
    assert len(rows) == 8 and {0, 1, 2047} <= set(rows) and rows == sorted(rows)
    assert di.sample_rows(1, 8, 0) == [0]
    assert di.sample_rows(5, 8, 0) == [0, 1, 2, 3, 4]
    assert di.stable_seed(0, "qwen3-30b-a3b", 262144, 16) == di.stable_seed(0, "qwen3-30b-a3b", 262144, 16)


def test_compare_rows_tolerance():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 64, generator=g)
    ok, err, tol = di.compare_rows({0: ref.to(torch.bfloat16)}, {0: ref}, torch.bfloat16)
    assert ok and err < tol
    ok, err, _ = di.compare_rows({0: (ref * 1.02).to(torch.bfloat16)}, {0: ref}, torch.bfloat16)
    assert not ok and err > 0.015
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert di.compare_rows({0: nan}, {0: ref}, torch.bfloat16)[0] is False


def test_batch_formats_agree():
    shape = di.Shape("t", 4, 2, 64)
    lens = [37, 1, 16, 20]
    for page in (16, 1):
        pool = di.Pool(shape, sum(lens), page, len(lens), torch.float16, torch.device("cpu"), 0)
        b = pool.batch(lens, 5)
        indptr, slots = b.token_indices()
        assert indptr.tolist() == [0, 37, 38, 54, 74]
        for r, n in enumerate(lens):
            tok = torch.arange(n)
            want = b.page_table[r, tok // page].long() * page + tok % page
            assert torch.equal(slots[indptr[r]:indptr[r + 1]].long(), want)
            pages = b.page_indices[b.page_indptr[r]:b.page_indptr[r + 1]]
            assert torch.equal(pages, b.page_table[r, :len(pages)])
            assert b.last_page_len[r].item() == n - (len(pages) - 1) * page
        assert len(set(b.page_indices.tolist())) == len(b.page_indices)  # no page used twice
        assert pool.batch(lens, 5).page_indices.tolist() == b.page_indices.tolist()  # same seed, same placement


# ----------------------------------------------------------------------------- verify rows

def test_verify_argument_lists_query_lengths():
    assert di.resolve_args([]).q_lens == (1,)
    assert di.resolve_args(["--verify", "0,3,5,7"]).q_lens == (1, 4, 6, 8)
    assert di.resolve_args(["--verify", "7,0,7"]).q_lens == (1, 8)
    assert di.resolve_args(["--verify", "15"]).q_lens == (16,)
    for bad in ("16", "-1", "x", ",", "3,16"):
        with pytest.raises(SystemExit):
            di.resolve_args(["--verify", bad])


def test_verify_batch_rows_over_the_same_placement():
    """A verify batch has q_len query rows per request ([B * q_len, Hq, D] q and out, request
    b's rows b * q_len ..) and cu_seqlens_q in steps of q_len, over the same page placement
    as the plain batch of the same seed; its q_len cannot exceed the shortest request."""
    shape, lens = di.Shape("t", 4, 2, 64), [37, 3, 16, 20]
    pool = di.Pool(shape, sum(lens), 16, len(lens), torch.float16, torch.device("cpu"), 0)
    plain, verify = pool.batch(lens, 5), pool.batch(lens, 5, 3)
    assert plain.q.shape == plain.out.shape == (4, 4, 64) and plain.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert verify.q.shape == verify.out.shape == (12, 4, 64) and verify.q_len == 3
    assert verify.cu_seqlens_q.tolist() == [0, 3, 6, 9, 12] and verify.cu_seqlens_q.dtype == torch.int32
    assert verify.query_rows(2) == slice(6, 9) and plain.query_rows(2) == slice(2, 3)
    assert torch.equal(verify.page_table, plain.page_table) and torch.equal(verify.seq_lens, plain.seq_lens)
    assert torch.equal(verify.q[:4], plain.q)  # the same random stream, longer
    verify.out.copy_(torch.arange(12.0)[:, None, None].expand(12, 4, 64))
    outs = di.request_outputs(verify, [1, 3])
    assert outs[1].shape == (3, 4, 64) and outs[1][:, 0, 0].tolist() == [3.0, 4.0, 5.0]
    assert di.request_outputs(plain, [1])[1].shape == (4, 64)
    with pytest.raises(ValueError, match="q_len: expected 1 to the shortest request's 3 tokens"):
        pool.batch(lens, 5, 4)
    assert di.point_q_lens(lens, (1, 3, 4, 8)) == [1, 3]


@pytest.mark.parametrize("window", [0, 5])
def test_verify_reference_is_causal_among_the_new_tokens(window):
    """Token t of a verify row sits at position n - q_len + t: its reference is the plain
    decode of the request cut right after it (with the same window)."""
    from evenkv.kernels.reference import decode_reference
    shape, lens, q_len = di.Shape("t", 4, 2, 64), [50, 7, 30], 3
    pool = di.Pool(shape, sum(lens), 16, len(lens), torch.float16, torch.device("cpu"), 4)
    b = pool.batch(lens, 2, q_len)
    refs = di.reference_rows(b, [0, 1, 2], shape, 0.125, 1 << 30, window=window)
    for r, n in enumerate(lens):
        assert refs[r].shape == (q_len, 4, 64)
        for t in range(q_len):
            want = decode_reference(b.q[r * q_len + t][None], b.k_slots, b.v_slots, torch.tensor([n - q_len + t + 1]),
                                    b.page_table[r:r + 1], 16, 0.125, sliding_window=window or None)[0]
            torch.testing.assert_close(refs[r][t], want, rtol=1e-5, atol=1e-6)
    # the check tells the tokens apart: the last token's result is not the first's
    assert (refs[0][0] - refs[0][-1]).abs().max() > 1e-2


# ----------------------------------------------------------------------------- fp8 pools and windows

def test_kv_read_bytes_counts_window_and_element_size():
    assert di.kv_read_bytes([10, 3], 2, 64, 2) == 13 * 2 * 64 * 2 * 2          # bf16, every token
    assert di.kv_read_bytes([10, 3], 2, 64, 1) == 13 * 2 * 64 * 2               # fp8: 1 byte
    assert di.kv_read_bytes([10, 3], 2, 64, 1, window=4) == (4 + 3) * 2 * 64 * 2  # min(len, W) tokens
    assert di.kv_read_bytes([10, 3], 2, 64, 2, window=100) == di.kv_read_bytes([10, 3], 2, 64, 2)
    # verify rows read each token once; under a window, the union of their tokens' windows
    assert di.kv_read_bytes([10, 3], 2, 64, 2, q_len=4) == di.kv_read_bytes([10, 3], 2, 64, 2)
    assert di.kv_read_bytes([10, 3], 2, 64, 1, window=4, q_len=3) == (6 + 3) * 2 * 64 * 2


def test_fp8_pool_holds_the_same_data_scaled():
    shape, lens = di.Shape("t", 4, 2, 64), [40, 9]
    args = (shape, sum(lens), 16, len(lens), torch.bfloat16, torch.device("cpu"), 3)
    plain, fp8 = di.Pool(*args), di.Pool(*args, kv_dtype=torch.float8_e4m3fn)
    assert fp8.k.dtype == fp8.v.dtype == torch.float8_e4m3fn and (fp8.k_scale, fp8.v_scale) == di.KV_SCALES
    for stored, scale, real in ((fp8.k, fp8.k_scale, plain.k), (fp8.v, fp8.v_scale, plain.v)):
        back = stored.float() * scale
        assert torch.isfinite(back).all()
        assert ((back - real.float()).norm() / real.float().norm()) < 0.05   # e4m3 keeps 3 mantissa bits
    b = fp8.batch(lens, 1)
    assert (b.k_scale, b.v_scale) == di.KV_SCALES and b.k_pages.element_size() == 1
    huge = di.to_fp8(torch.tensor([1e6, -1e6, 0.5]), 1.0).float()
    assert huge.tolist() == [448.0, -448.0, 0.5]                              # clamped, not NaN


def test_reference_rows_window_and_fp8_scales():
    """A windowed row's reference is the plain reference of a request made of its last W
    keys (page size 1: those keys are a slice of the page table); an fp8 pool's reference
    is that of its dequantized values."""
    from evenkv.kernels.reference import decode_reference
    shape, lens, w = di.Shape("t", 4, 2, 64), [50, 7, 30], 16
    pool = di.Pool(shape, sum(lens), 1, len(lens), torch.float16, torch.device("cpu"), 4)
    b = pool.batch(lens, 2)
    refs = di.reference_rows(b, [0, 1, 2], shape, 0.125, 1 << 30, window=w)
    for r, n in enumerate(lens):
        first = max(0, n - w)
        want = decode_reference(b.q[r:r + 1], b.k_slots, b.v_slots, torch.tensor([n - first]),
                                b.page_table[r:r + 1, first:].contiguous(), 1, 0.125)[0]
        torch.testing.assert_close(refs[r], want, rtol=1e-5, atol=1e-6)
    fp8 = di.Pool(shape, sum(lens), 1, len(lens), torch.float16, torch.device("cpu"), 4, torch.float8_e4m3fn)
    b8 = fp8.batch(lens, 2)
    deq_k = (b8.k_slots.float() * b8.k_scale).to(torch.float16)  # exact: fp8 values x 2^-k fit in fp16
    deq_v = (b8.v_slots.float() * b8.v_scale).to(torch.float16)
    refs = di.reference_rows(b8, [0, 2], shape, 0.125, 1 << 30)
    for r in (0, 2):
        want = decode_reference(b8.q[r:r + 1], deq_k, deq_v, b8.seq_lens[r:r + 1], b8.page_table[r:r + 1], 1, 0.125)
        torch.testing.assert_close(refs[r], want[0], rtol=1e-5, atol=1e-6)


def test_fp8_tolerance_is_scale_free():
    """fp8's check tolerance is its rounding error after scaling, whatever the output's
    magnitude (a long decode's outputs are ~1/sqrt(len), below fp8's normal range)."""
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(4, 64, generator=g) * 1e-3
    assert 0.01 < di.rounding_error(ref, torch.float8_e4m3fn) < 0.05
    assert di.rounding_error(ref, torch.float8_e4m3fn) == pytest.approx(di.rounding_error(ref * 1e3,
                                                                                         torch.float8_e4m3fn))
    off = {0: ref * 1.03}
    assert di.compare_rows(off, {0: ref}, torch.float8_e4m3fn)[0]
    assert not di.compare_rows(off, {0: ref}, torch.bfloat16)[0]
    assert not di.compare_rows({0: ref * 2}, {0: ref}, torch.float8_e4m3fn)[0]  # a missed scale still fails


# ----------------------------------------------------------------------------- summary math

def _row(name, impl, b, dist, us, t=1000, page=16, shape="s", status="ok", **extra):
    kv_bytes = 1_000_000
    return {"run": "r", "timestamp": "2026-01-01T00:00:00", "gpu": "G", "torch": "t", "triton": "t", "cuda": "c",
            "evenkv": "0", "evenkv_git": "x", "flashinfer": "flashinfer absent", "vllm": "vllm absent",
            "sglang": "sglang absent", "shape": shape, "hq": 32, "hkv": 4, "head_dim": 128, "dtype": "bf16", "T": t,
            "B": b, **extra,
            "dist": dist, "page": page, "name": name, "impl": impl, "variant": name, "status": status,
            "detail": "" if status == "ok" else "boom", "us_med": us if status == "ok" else "",
            "kv_bytes": kv_bytes, "copy_rw_tbps": 1.0,
            "frac_copy": (kv_bytes / (us * 1e-6) / 1e12) if status == "ok" else ""}


SYNTH = [
    # B = 4: ours flat-ish, fa3 flat, flashinfer skew cliff
    _row("evenkv-balanced", "evenkv", 4, "Uniform", 10.0), _row("evenkv-balanced", "evenkv", 4, "Skewed80", 12.0),
    _row("fa3-auto", "fa3", 4, "Uniform", 8.0), _row("fa3-auto", "fa3", 4, "Skewed80", 8.0),
    _row("flashinfer-tc", "flashinfer", 4, "Uniform", 5.0), _row("flashinfer-tc", "flashinfer", 4, "Skewed80", 50.0),
    # B = 8: ours fastest; a peer error
    _row("evenkv-balanced", "evenkv", 8, "Uniform", 4.0), _row("evenkv-balanced", "evenkv", 8, "Skewed80", 4.0),
    _row("fa3-auto", "fa3", 8, "Uniform", 8.0), _row("fa3-auto", "fa3", 8, "Skewed80", 16.0),
    _row("flashinfer-tc", "flashinfer", 8, "Uniform", 0, status="error"),
    _row("flashinfer-tc", "flashinfer", 8, "Skewed80", 20.0),
]


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=report.COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in report.COLUMNS})


def test_summary_math_on_synthetic_csv(tmp_path):
    _write_csv(tmp_path / "a.csv", SYNTH)
    rows = report.read_rows([str(tmp_path)])
    assert len(rows) == len(SYNTH)
    flat = report.flatness(rows)
    assert flat[("s", 1000, 16, 4, "evenkv-balanced")] == (pytest.approx(1.2), 2)
    assert flat[("s", 1000, 16, 4, "flashinfer-tc")] == (pytest.approx(10.0), 2)
    assert flat[("s", 1000, 16, 8, "flashinfer-tc")] == (pytest.approx(1.0), 1)  # the error row does not count
    ratios = {d["point"][3:]: d for d in report.point_ratios(rows)}
    assert ratios[(4, "Uniform")]["best_peer"] == "flashinfer-tc"
    assert ratios[(4, "Uniform")]["ratio_best"] == pytest.approx(2.0)
    assert ratios[(4, "Skewed80")]["ratio_best"] == pytest.approx(1.5)
    assert ratios[(4, "Skewed80")]["ratio_fa3"] == pytest.approx(1.5)
    assert ratios[(8, "Uniform")]["best_peer"] == "fa3-auto" and ratios[(8, "Uniform")]["ratio_best"] == 0.5
    assert ratios[(8, "Skewed80")]["ratio_fa3"] == pytest.approx(0.25)
    h = report.headline(rows)
    assert h["ok"] == h["points"] == 4
    assert h["worst_frac"] == pytest.approx(1e6 / 12e-6 / 1e12)  # 1 MB in 12 µs against 1 TB/s
    assert h["worst_frac_at"] == ("s", 1000, 16, 4, "Skewed80")
    assert h["worst_flat"] == pytest.approx(1.2) and h["worst_flat_at"] == ("s", 1000, 16, 4)
    assert h["ratio_fa3_worst"] == pytest.approx(1.5)
    assert h["ratio_fa3_median"] == pytest.approx((0.5 + 1.25) / 2)     # ratios 1.25, 1.5, 0.5, 0.25
    assert h["ratio_best_worst"] == pytest.approx(2.0)
    assert h["ratio_best_median"] == pytest.approx((0.5 + 1.5) / 2)     # ratios 2.0, 1.5, 0.5, 0.25
    worst = {d["name"]: d for d in report.impl_worst(rows)}
    assert worst["flashinfer-tc"]["error"] == 1 and worst["flashinfer-tc"]["worst_at"][3:] == (4, "Skewed80")
    assert worst["flashinfer-tc"]["worst_flat"] == pytest.approx(10.0)

    res = report.generate([str(tmp_path)], str(tmp_path / "out"), plots=False)
    text = Path(res["summary"]).read_text()
    assert "## Headline: evenkv-balanced" in text and "| 4 | 1.20 | 1.00 | 10.00 |" in text
    assert "2.00 / 1.00" in text  # best-peer ratio worst / median in the headline row


def test_last_row_wins_and_report_cli(tmp_path):
    _write_csv(tmp_path / "a.csv", SYNTH)
    _write_csv(tmp_path / "b.csv", [_row("evenkv-balanced", "evenkv", 4, "Skewed80", 10.0)])  # a re-run
    rows = report.read_rows([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert report.flatness(rows)[("s", 1000, 16, 4, "evenkv-balanced")][0] == pytest.approx(1.0)
    assert report.main([str(tmp_path), "--no-plots", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "summary.md").exists()


def test_kv_dtype_and_window_rows_form_their_own_series(tmp_path):
    """Rows of one point with another KV dtype or a window neither replace nor join the
    default rows: they are their own series, labelled in the summary; old CSVs (no such
    columns) read as the default."""
    fp8 = dict(dtype="bf16", kv_dtype="fp8")
    win = dict(dtype="bf16", kv_dtype="bf16", window=24)
    extra = [_row("evenkv-balanced", "evenkv", 4, "Uniform", 5.0, **fp8),
             _row("fa3-auto", "fa3", 4, "Uniform", 4.0, **fp8),
             _row("evenkv-balanced", "evenkv", 4, "Uniform", 2.0, **win),
             _row("fa3-auto", "fa3", 4, "Uniform", 1.0, **win)]
    _write_csv(tmp_path / "a.csv", SYNTH)
    _write_csv(tmp_path / "b.csv", extra)
    rows = report.read_rows([str(tmp_path)])
    assert len(rows) == len(SYNTH) + len(extra)
    assert {r["series"] for r in rows} == {"s", "s kv=fp8", "s window=24"}
    ratios = {d["point"]: d["ratio_fa3"] for d in report.point_ratios(rows)}
    assert ratios[("s", 1000, 16, 4, "Uniform")] == pytest.approx(1.25)       # the default rows, untouched
    assert ratios[("s kv=fp8", 1000, 16, 4, "Uniform")] == pytest.approx(1.25)
    assert ratios[("s window=24", 1000, 16, 4, "Uniform")] == pytest.approx(2.0)
    text = Path(report.generate([str(tmp_path)], str(tmp_path / "out"), plots=False)["summary"]).read_text()
    assert "## s kv=fp8, T = 1000, page size 16" in text and "## s window=24, T = 1000, page size 16" in text


def _verify_rows():
    """evenkv-balanced plain (q_len 1) and verify (q_len 4) rows, FA3's two variants at q_len 4,
    one verify point with no plain row, and an fp8-cache verify row whose plain row is bf16's."""
    ev, fa = ("evenkv-balanced", "evenkv"), "fa3"
    return [
        _row(*ev, 4, "Uniform", 10.0), _row(*ev, 4, "Uniform", 11.0, q_len=4),
        _row("fa3-auto", fa, 4, "Uniform", 10.0, q_len=4), _row("fa3-ns1", fa, 4, "Uniform", 20.0, q_len=4),
        _row(*ev, 4, "Skewed80", 10.0), _row(*ev, 4, "Skewed80", 12.0, q_len=4),
        _row("fa3-auto", fa, 4, "Skewed80", 30.0, q_len=4), _row("fa3-ns1", fa, 4, "Skewed80", 15.0, q_len=4),
        _row(*ev, 8, "Uniform", 5.0, q_len=4),
        _row(*ev, 4, "Uniform", 6.0, q_len=4, dtype="bf16", kv_dtype="fp8"),
    ]


def test_verify_ratios_pair_each_verify_row_with_the_same_batch_plain_row(tmp_path):
    _write_csv(tmp_path / "v.csv", _verify_rows())
    rows = report.read_rows([str(tmp_path)])
    assert {r["series"] for r in rows} == {"s", "s q_len=4", "s kv=fp8 q_len=4"}
    got = {(d["point"], d["q_len"]): d for d in report.verify_ratios(rows)}
    assert len(got) == 4  # the q_len 1 rows are no verify points
    u, k = got[(("s", 1000, 16, 4, "Uniform"), 4)], got[(("s", 1000, 16, 4, "Skewed80"), 4)]
    assert u["ratio_plain"] == pytest.approx(1.1) and k["ratio_plain"] == pytest.approx(1.2)
    # 1 MB of KV; q and out of 4 requests x 32 heads x 128 bf16 elements, 1 or 4 rows each
    assert u["floor"] == pytest.approx((1e6 + 4 * 4 * 32 * 128 * 2 * 2) / (1e6 + 4 * 32 * 128 * 2 * 2))
    assert u["ratio_fa3_auto"] == pytest.approx(1.1) and u["fa3_best"] == "fa3-auto"
    assert k["ratio_fa3_auto"] == pytest.approx(0.4)
    assert k["fa3_best"] == "fa3-ns1" and k["ratio_fa3_best"] == pytest.approx(0.8)
    alone = got[(("s", 1000, 16, 8, "Uniform"), 4)]
    assert alone["ratio_plain"] is None and alone["ratio_fa3_best"] is None
    assert got[(("s kv=fp8", 1000, 16, 4, "Uniform"), 4)]["ratio_plain"] is None  # never against bf16's plain row
    assert report.verify_flatness(rows)[("s", 1000, 16, 4, 4)] == (pytest.approx(12 / 11), 2)
    s = {x["group"]: x for x in report.verify_summary(rows)}[("s", 1000, 16, 4)]
    assert s["points"] == 3 and s["plain_worst"] == pytest.approx(1.2)
    assert s["plain_worst_at"] == ("s", 1000, 16, 4, "Skewed80") and (s["plain_over"], s["plain_n"]) == (1, 2)
    assert s["plain_worst_floor"] == pytest.approx(u["floor"]) and s["goal_below_floor"] == 2  # floor 1.18 > 1.15
    assert s["over_floor_worst"] == pytest.approx(1.2 / u["floor"])
    assert s["fa3_best_worst"] == pytest.approx(1.1) and s["fa3_best_worst_impl"] == "fa3-auto"
    assert (s["fa3_over"], s["fa3_n"]) == (1, 2)
    assert s["flat_worst"] == pytest.approx(12 / 11) and s["flat_worst_b"] == 4
    assert (s["flat_over"], s["flat_n"]) == (0, 1)
    text = report.summary_markdown(rows)
    assert "## Speculative verify: evenkv-balanced" in text
    assert ("| s | 1000 | 16 | 4 | 3 | 1.20 (4 Skewed80; 1.18) | 1/2 | 2/2 | 1.01 | 1.10 | 1.10 (4 Uniform, fa3-auto) "
            "| 1/2 | 1.09 (4) | 0/1 |") in text
    assert "| 4 | Skewed80 | 1.20 (1.18) / 0.80 |" in text and "| 4 | flatness | 1.09 |" in text
    assert "## Deterministic" not in text  # no evenkv-balanced-det rows


def test_deterministic_ratios_over_balanced_and_fa3_one_split(tmp_path):
    det, bal, ns1 = ("evenkv-balanced-det", "evenkv"), ("evenkv-balanced", "evenkv"), ("fa3-ns1", "fa3")
    rows = [_row(*bal, 4, "Uniform", 10.0), _row(*det, 4, "Uniform", 10.5), _row(*ns1, 4, "Uniform", 12.0),
            _row(*bal, 4, "Skewed80", 10.0), _row(*det, 4, "Skewed80", 12.0), _row(*ns1, 4, "Skewed80", 10.0),
            _row(*det, 8, "Uniform", 3.0), _row(*bal, 8, "Uniform", 1.0, status="error")]
    _write_csv(tmp_path / "d.csv", rows)
    rows = report.read_rows([str(tmp_path)])
    got = {d["point"][3:]: d for d in report.deterministic_ratios(rows)}
    assert got[(4, "Uniform")]["ratio_balanced"] == pytest.approx(1.05)
    assert got[(4, "Uniform")]["ratio_fa3_ns1"] == pytest.approx(10.5 / 12)
    assert got[(4, "Skewed80")]["ratio_balanced"] == pytest.approx(1.2)
    assert got[(8, "Uniform")]["ratio_balanced"] is None and got[(8, "Uniform")]["ratio_fa3_ns1"] is None
    (s,) = report.deterministic_summary(rows)
    assert s["group"] == ("s", 1000, 16) and s["points"] == 3
    assert s["ratio_balanced_worst"] == pytest.approx(1.2) and s["ratio_balanced_worst_at"][3:] == (4, "Skewed80")
    assert s["ratio_balanced_median"] == pytest.approx(1.125)
    assert (s["ratio_balanced_over"], s["ratio_balanced_n"]) == (1, 2)
    assert s["ratio_fa3_ns1_worst"] == pytest.approx(1.2) and (s["ratio_fa3_ns1_over"], s["ratio_fa3_ns1_n"]) == (1, 2)
    text = report.summary_markdown(rows)
    assert "## Deterministic: evenkv-balanced-det" in text
    assert "| s | 1000 | 16 | 3 | 1.20 (4 Skewed80) / 1.12 | 1/2 |" in text
    assert "| 4 | 1.05 / 0.88 | 1.20 / 1.20 |" in text and "| 8 | – / – | – |" in text
    assert "## Speculative verify" not in text


# ----------------------------------------------------------------------------- arguments

def test_args_defaults_quick_and_overrides():
    a = di.resolve_args([])
    assert a.T == di.T_VALUES and a.B == di.B_VALUES and a.pages == (16, 1) and a.dists == di.DISTS
    assert [s.name for s in a.shapes] == ["qwen3-30b-a3b"] and a.max_reps == 50
    q = di.resolve_args(["--quick"])
    assert q.T == (262144,) and q.B == (1, 16, 256, 2048) and q.max_reps == 15
    o = di.resolve_args(["--quick", "--T", "256k,1m", "--B", "1,3", "--pages", "1", "--dists", "Uniform,2x40",
                         "--shape", "llama3-8b,gemma3-12b", "--impls", "evenkv-*,fa3-auto", "--skip", "*@sm80"])
    assert o.T == (262144, 1048576) and o.B == (1, 3) and o.pages == (1,) and o.dists == ("Uniform", "2x40")
    assert [(s.num_q_heads, s.num_kv_heads, s.head_dim) for s in o.shapes] == [(32, 8, 128), (16, 8, 256)]
    assert o.impl_patterns == ["evenkv-*", "fa3-auto"] and o.skip_patterns == ["*@sm80"]
    assert len(di.resolve_args(["--shape", "all"]).shapes) == len(di.SHAPES)
    assert a.kv_dtype == "auto" and a.window == 0 and di.kv_dtype_name(a) == "bf16"
    f = di.resolve_args(["--kv-dtype", "fp8", "--window", "4096", "--dtype", "fp16"])
    assert di.kv_dtype_name(f) == "fp8" and f.window == 4096
    ctx = di.make_context(f, di.SHAPES["llama3-8b"], 16, torch.device("cpu"))
    assert ctx.kv_fp8 and ctx.cache_dtype == torch.float8_e4m3fn and ctx.window == 4096 and ctx.dtype == torch.float16
    assert not di.make_context(a, a.shapes[0], 16, torch.device("cpu")).kv_fp8
    for bad in (["--dists", "Skewed50"], ["--shape", "gpt5"], ["--T", "x"], ["--min-reps", "9", "--max-reps", "3"],
                ["--window", "-1"], ["--kv-dtype", "int8"]):
        with pytest.raises(SystemExit):
            di.resolve_args(bad)


def test_shapes_cover_the_issue():
    dims = {(s.num_q_heads, s.num_kv_heads, s.head_dim) for s in di.SHAPES.values()}
    assert {(32, 4, 128), (32, 8, 128), (8, 1, 128), (28, 4, 128)} <= dims
    assert any(d == 64 for _, _, d in dims) and any(d == 256 for _, _, d in dims)
    assert all(s.num_q_heads % s.num_kv_heads == 0 for s in di.SHAPES.values())


def test_impl_selection_and_names():
    assert di.impl_name("vllm_triton", "default") == "vllm_triton"
    assert di.impl_name("fa3", "auto") == "fa3-auto"
    assert di.selected("fa3-auto", True, ["default"], [])
    assert not di.selected("fa3-max32", False, ["default"], [])
    assert di.selected("fa3-max32", False, ["fa3-*"], [])
    assert not di.selected("evenkv-none@sm80", True, ["default"], ["*@sm80"])
    assert evenkv_impl.parse_variant("fa3@sm80") == ("fa3", "sm80", False, False, False)
    assert evenkv_impl.parse_variant("balanced-det") == ("balanced", None, True, False, False)
    assert evenkv_impl.parse_variant("balanced-tree@sm80") == ("balanced", "sm80", False, True, False)
    assert evenkv_impl.parse_variant("balanced-onehead") == ("balanced", None, False, False, True)
    for bad in ("balanced@sm70", "tree-balanced", "balanced-trees", "balanced-one"):
        with pytest.raises(ValueError):
            evenkv_impl.parse_variant(bad)
    assert evenkv_impl.chain_mask(torch.tensor([0, 3, 4, 6], dtype=torch.int32)).tolist() == [1, 3, 7, 1, 1, 3]
    ctx = types.SimpleNamespace(device=torch.device("cpu"))
    names = [v for v, _ in evenkv_impl.variants(ctx)]
    assert names[:2] == ["balanced", "balanced@sm80"]  # CPU resolves to sm90: only the other table is forced
    assert sglang_triton.schedule_seq(5) == 256 and sglang_triton.schedule_seq(300) == 512
    assert sglang_triton.schedule_seq(256) == 256


def test_what_each_adapter_says_it_supports():
    cpu = torch.device("cpu")
    qwen = di.SHAPES["qwen3-30b-a3b"]

    def ctx(*argv, page=16, shape=qwen):
        return di.make_context(di.resolve_args(list(argv)), shape, page, cpu)

    assert evenkv_impl.feature_kwargs(ctx()) == {}  # a default run needs nothing new of the library
    assert evenkv_impl.feature_kwargs(ctx("--kv-dtype", "fp8", "--window", "512")) == {
        "kv_dtype": torch.float8_e4m3fn, "sliding_window": 512}
    assert flashinfer_xqa.supports(ctx()) == "" and flashinfer_xqa.supports(ctx("--kv-dtype", "fp8")) == ""
    assert "16, 32, 64, 128" in flashinfer_xqa.supports(ctx(page=1))
    assert fa3.supports(ctx("--kv-dtype", "fp8")) == "" and fa3.supports(ctx("--window", "64")) == ""
    assert "bf16" in fa3.supports(ctx("--kv-dtype", "fp8", "--dtype", "fp16"))
    assert flashinfer_holistic.supports(ctx()) == ""
    assert flashinfer_holistic.supports(ctx("--kv-dtype", "fp8", "--window", "64")) == \
        "no fp8 KV cache; no sliding window"
    assert sglang_triton.supports(ctx("--window", "64")) == "no sliding window"
    verify = di.make_context(di.resolve_args(["--verify", "3"]), qwen, 16, cpu, max_q_len=4)
    for peer in (fa3, load("vllm_triton"), flashinfer_holistic):  # verify rows as their engines run them
        assert peer.supports(verify) == ""
    for peer in (load("flashinfer"), flashinfer_xqa, sglang_triton):
        assert peer.supports(verify) == "no verify rows"
    assert sglang_triton.supports(dataclasses.replace(verify, window=64)) == "no sliding window; no verify rows"
    assert fi_jit.decode_spec(ctx("--kv-dtype", "fp8"), tensor_cores=True) == ("prefill", "bf16", "fp8", "128", "0")
    assert fi_jit.xqa_spec(ctx("--window", "64")) == ("xqa", "bf16", "bf16", "128", "16", "8", "1")
    assert fi_jit.holistic_spec(ctx())[0] == "holistic"
    # a module run, never the file: this folder's flashinfer.py would shadow FlashInfer
    assert fi_jit.command(("decode",))[1:] == ["-m", "benchmarks.peers.fi_jit", "decode"]


def test_evenkv_verify_objects_build_in_the_background(monkeypatch):
    """A verify object (max_q_len > 1) is built ahead in a background process that rebuilds it
    from its spec; plain decode objects and CPU runs start nothing."""
    started = []
    monkeypatch.setattr(evenkv_impl, "start_background", lambda key, argv: started.append((key, argv)) or True)
    args = di.resolve_args(["--verify", "0,3", "--kv-dtype", "fp8", "--window", "64"])
    qwen = di.SHAPES["qwen3-30b-a3b"]
    ctx = di.make_context(args, qwen, 16, torch.device("cuda"), max_batch=2048, max_q_len=4)
    assert evenkv_impl.prebuild("balanced-det", ctx) == [
        "evenkv balanced-det 32 4 128 16 bf16 fp8 64 4 2048"]
    (key, argv), = started
    assert argv[1:3] == ["-m", "benchmarks.peers.evenkv_impl"] and key == ("evenkv",) + tuple(argv[3:])
    assert evenkv_impl.prebuild("balanced", dataclasses.replace(ctx, max_q_len=1)) == []
    assert evenkv_impl.prebuild("balanced", dataclasses.replace(ctx, device=torch.device("cpu"))) == []
    assert len(started) == 1
    spec = evenkv_impl.build_spec("balanced-det", dataclasses.replace(ctx, shape=di.Shape("t", 4, 2, 64)))
    attn = evenkv_impl.build(spec, device="cpu")
    assert (attn.max_q_len, attn.deterministic, attn.page_size, attn.sliding_window) == (4, True, 16, 64)
    assert attn.kv_dtype == torch.float8_e4m3fn and attn.max_batch_size == 2048 and attn.head_dim == 64


def test_lean_kernel_comes_from_the_kit_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("EVENKV_LEAN_DIR", raising=False)
    assert sglang_lean.lean_dir() == REPO / ".kits" / "lean"
    monkeypatch.setenv("EVENKV_LEAN_DIR", str(tmp_path))
    assert sglang_lean.lean_dir() == tmp_path
    ok, why = sglang_lean.available()
    assert not ok and str(tmp_path / "decode_attention.py") in why and "benchmarks/peers/sglang_lean.py" in why


def test_list_names_every_adapter_and_why_it_does_not_run(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert di.main(["--list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines["evenkv-balanced"].split()[1:3] == ["default", "selected"]
    for family in ("flashinfer_holistic", "flashinfer_xqa", "sglang_lean"):  # GPU only
        assert "unavailable:" in lines[family], out
    assert "no CUDA device" in lines["sglang_lean"] or "decode_attention.py missing" in lines["sglang_lean"]


def test_dry_run_lists_the_points(capsys):
    assert di.main(["--dry-run", "--T", "32768", "--B", "1,2", "--pages", "16"]) == 0
    out = capsys.readouterr().out
    assert "T=32768 page 16: 5 points" in out


# ----------------------------------------------------------------------------- the loop, CUDA mocked

class _FakeEvent:
    def __init__(self, enable_timing=True):
        self.t = 0.0

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


@pytest.fixture
def mocked_cuda(monkeypatch):
    """The benchmark's CUDA calls (events, sync, sleep, device properties) mocked for a CPU
    run under the interpreter, plus a tiny shape preset."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(name="CPU mock", multi_processor_count=2, major=0, minor=0))
    monkeypatch.setitem(di.SHAPES, "tiny", di.Shape("tiny", 4, 2, 64))


@pytest.mark.interpreter
def test_measurement_loop_with_mocked_cuda(tmp_path, mocked_cuda):
    """The whole run (checks, timing, CSV, summary) on the CPU: CUDA events/sync mocked,
    evenkv under the interpreter. Numbers are meaningless; the bookkeeping is not."""
    args = di.resolve_args(["--shape", "tiny", "--T", "80", "--B", "4", "--dists", "Uniform,Skewed80",
                            "--pages", "16", "--impls", "evenkv-balanced", "--skip", "*@*", "--dtype", "fp16",
                            "--min-reps", "1", "--max-reps", "1", "--plan-reps", "1", "--flush-mib", "1",
                            "--copy-mib", "1", "--check-rows", "2", "--out", str(tmp_path), "--tag", "t"])
    impls, _ = di.discover(args, torch.device("cpu"), quiet=True)
    assert [i.name for i in impls] == ["evenkv-balanced"]
    run_dir = Path(di.Bench(args, torch.device("cpu")).run(impls))
    rows = list(csv.DictReader(open(run_dir / "t.csv")))
    assert [(r["B"], r["dist"], r["name"]) for r in rows] == [
        ("4", "Uniform", "evenkv-balanced"), ("4", "Skewed80", "evenkv-balanced")]
    assert all(r["status"] == "ok" for r in rows), [(r["name"], r["status"], r["detail"]) for r in rows]
    assert all(float(r["us_med"]) > 0 and int(r["n_rep"]) >= 1 for r in rows)
    assert rows[-1]["max_len"] == "64" and rows[-1]["min_len"] == "5"
    assert rows[-1]["kv_bytes"] == str(80 * 2 * 64 * 2 * 2)  # T x Hkv x D x (K, V) x 2 bytes
    checked = [r for r in rows if r["check_err"]]
    assert {(r["B"], r["dist"]) for r in checked} == {("4", "Uniform"), ("4", "Skewed80")}
    assert all(float(r["check_err"]) <= float(r["check_tol"]) for r in checked)
    assert rows[0]["config"].startswith("sm90:") and rows[0]["plan_host_us"]
    assert (run_dir / "summary.md").exists() and list(run_dir.glob("time_tiny_T80_p16.png"))


@pytest.mark.interpreter
def test_wrong_implementation_is_not_timed(tmp_path, monkeypatch, mocked_cuda):
    """An adapter whose output is wrong at a check point is reported 'wrong' everywhere in the group."""

    class Broken(Runner):
        config = "broken"

        def __init__(self, variant, ctx):
            pass

        def run(self):
            self.batch.out.copy_(self.batch.q * 3)

    fake = types.SimpleNamespace(FAMILY="broken", available=lambda: (True, ""), version=lambda: "0",
                                 variants=lambda ctx: [("x", True)], make=lambda v, ctx: Broken(v, ctx))
    monkeypatch.setattr(di, "MODULES", ("broken",))
    monkeypatch.setattr(di, "load", lambda m: fake)
    args = di.resolve_args(["--shape", "tiny", "--T", "40", "--B", "2,4", "--dists", "Uniform", "--pages", "1",
                            "--dtype", "fp16", "--min-reps", "1", "--max-reps", "1", "--plan-reps", "1",
                            "--flush-mib", "1", "--copy-mib", "1", "--out", str(tmp_path), "--tag", "w", "--no-plots"])
    monkeypatch.setattr(report, "generate", lambda *a, **k: {"summary": "", "pngs": [], "headline": {}})
    impls, _ = di.discover(args, torch.device("cpu"), quiet=True)
    run_dir = Path(di.Bench(args, torch.device("cpu")).run(impls))
    rows = list(csv.DictReader(open(run_dir / "w.csv")))
    assert [r["status"] for r in rows] == ["wrong", "wrong"] and not any(r["us_med"] for r in rows)
    assert "reference check failed" in rows[0]["detail"]


@pytest.mark.interpreter
def test_verify_rows_in_the_measurement_loop(tmp_path, mocked_cuda, fake_peers):
    """A --verify 0,2 run through the benchmark's own path: evenkv's balanced, deterministic and
    tree-masked runners (interpreter) and FA3 (stand-in) run the plain and the verify rows of each point,
    each checked against the reference at q_len 1 and 3; FlashInfer's decode wrapper, which
    has no verify rows, runs the plain rows only and the summary says why."""
    args = di.resolve_args(["--shape", "tiny", "--T", "80", "--B", "4", "--dists", "Uniform,Skewed80", "--pages", "16",
                            "--verify", "0,2", "--dtype", "bf16",
                            "--impls", "evenkv-balanced,evenkv-balanced-det,evenkv-balanced-tree,fa3-auto,"
                            "flashinfer-notc",
                            "--min-reps", "1", "--max-reps", "1", "--plan-reps", "1", "--flush-mib", "1",
                            "--copy-mib", "1", "--check-rows", "4", "--out", str(tmp_path),
                            "--tag", "v", "--no-plots"])
    impls, _ = di.discover(args, torch.device("cpu"), quiet=True)
    every = ["evenkv-balanced", "evenkv-balanced-det", "evenkv-balanced-tree", "fa3-auto"]
    assert [i.name for i in impls] == every + ["flashinfer-notc"]
    assert impls[4].unsupported == {("tiny", 16, 3): "no verify rows"}
    run_dir = Path(di.Bench(args, torch.device("cpu")).run(impls))
    rows = list(csv.DictReader(open(run_dir / "v.csv")))
    assert [(r["dist"], r["q_len"], r["name"]) for r in rows] == [
        (d, q, n) for d in ("Uniform", "Skewed80") for q in ("1", "3")
        for n in every + (["flashinfer-notc"] if q == "1" else [])]
    assert all(r["status"] == "ok" for r in rows), [(r["name"], r["q_len"], r["status"], r["detail"]) for r in rows]
    assert all(r["check_err"] and float(r["check_err"]) <= float(r["check_tol"]) for r in rows)
    kv = {(r["dist"], r["q_len"]): r["kv_bytes"] for r in rows}
    assert kv[("Skewed80", "1")] == kv[("Skewed80", "3")] == str(80 * 2 * 64 * 2 * 2)  # each KV byte once
    summary = (run_dir / "summary.md").read_text()
    assert "flashinfer-notc not run for tiny page 16 q_len 3: no verify rows" in summary
    assert "## Speculative verify: evenkv-balanced" in summary and "## Deterministic: evenkv-balanced-det" in summary
    assert "| tiny | 80 | 16 | 3 | 2 |" in summary


def _non_causal_verify(ctx):
    """A runner whose verify rows let every new token see all of its request's new tokens."""
    from evenkv.kernels.reference import extend_reference

    class NonCausal(Runner):
        config = "non-causal"

        def run(self):
            b = self.batch
            b.out.copy_(extend_reference(b.q, b.k_slots, b.v_slots, b.cu_seqlens_q, b.seq_lens, b.page_table,
                                         b.page_size, sm_scale=ctx.sm_scale, causal=False))
    return NonCausal()


@pytest.mark.interpreter
def test_verify_rows_that_ignore_causality_are_wrong(tmp_path, monkeypatch, mocked_cuda):
    """Without causality among the new tokens, a verify row's earlier tokens see later ones: the
    check reports that implementation wrong at q_len 3 (and does not time it there) while its
    plain rows, where causal and non-causal agree, pass."""
    fake = types.SimpleNamespace(FAMILY="noncausal", available=lambda: (True, ""), version=lambda: "0",
                                 variants=lambda ctx: [("x", True)], make=lambda v, ctx: _non_causal_verify(ctx))
    monkeypatch.setattr(di, "MODULES", ("noncausal",))
    monkeypatch.setattr(di, "load", lambda m: fake)
    args = di.resolve_args(["--shape", "tiny", "--T", "80", "--B", "4", "--dists", "Uniform,Skewed80", "--pages", "1",
                            "--verify", "0,2", "--dtype", "fp16", "--min-reps", "1", "--max-reps", "1",
                            "--plan-reps", "1", "--flush-mib", "1", "--copy-mib", "1", "--out", str(tmp_path),
                            "--tag", "n", "--no-plots"])
    monkeypatch.setattr(report, "generate", lambda *a, **k: {"summary": "", "pngs": [], "headline": {}})
    impls, _ = di.discover(args, torch.device("cpu"), quiet=True)
    run_dir = Path(di.Bench(args, torch.device("cpu")).run(impls))
    rows = list(csv.DictReader(open(run_dir / "n.csv")))
    assert [(r["q_len"], r["status"]) for r in rows] == [("1", "ok"), ("3", "wrong")] * 2
    assert "reference check failed at B=4 Uniform q_len=3" in rows[1]["detail"] and not rows[1]["us_med"]


# ----------------------------------------------------------------------------- peers' APIs, stood in

def _paged_decode(q, k_pages, v_pages, tables, lens, scale, v_scale=1.0, window=0, cu_seqlens_q=None):
    """What every stand-in computes, from its peer's documented semantics: fp32 attention over
    an NHD paged cache [pages, P, Hkv, D] read as stored; request b's pages ``tables[b]`` and
    query rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (default: row b), its q_len tokens at the
    end of its keys, each seeing the keys up to its own position (causal, bottom-right
    aligned); scores x ``scale``, output x ``v_scale``; each token its last ``window`` keys
    (all when 0)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    page, g = k_pages.shape[1], q.shape[1] // k_pages.shape[2]
    cu = list(range(len(lens) + 1)) if cu_seqlens_q is None else cu_seqlens_q.tolist()
    for b, n in enumerate(lens):
        for row in range(cu[b], cu[b + 1]):
            pos = n - (cu[b + 1] - row)  # the last query row sits at n - 1
            tok = torch.arange(max(0, pos + 1 - window) if window else 0, pos + 1)
            pages = torch.as_tensor(tables[b])[tok // page].long()
            k, v = (c[pages, tok % page].float().repeat_interleave(g, 1) for c in (k_pages, v_pages))
            p = (torch.einsum("hd,nhd->hn", q[row].float(), k) * scale).softmax(-1)
            out[row] = torch.einsum("hn,nhd->hd", p, v) * v_scale
    return out


def _csr_tables(indptr, indices):
    ind = indptr.tolist()
    return [indices[ind[i]:ind[i + 1]].tolist() for i in range(len(ind) - 1)]


class _DecodeWrapper:
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper (0.6.13): window_left is the left
    inclusive width (W - 1 reads W keys); k_scale scales the scores, v_scale the output."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_tensor_cores=False):
        assert kv_layout == "NHD"

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, sm_scale=None):
        self.tables = _csr_tables(indptr, indices)
        self.lens = [(len(t) - 1) * page_size + n for t, n in zip(self.tables, last_page_len.tolist())]
        self.dtypes, self.window, self.sm_scale = (q_data_type, kv_data_type), window_left + 1, sm_scale

    def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None):
        k, v = paged_kv_cache
        assert (q.dtype, k.dtype) == self.dtypes
        out.copy_(_paged_decode(q, k, v, self.tables, self.lens, self.sm_scale * (k_scale or 1.0), v_scale or 1.0,
                                self.window))
        return out


class _BatchAttention:
    """flashinfer.BatchAttention (0.6.13): page CSR plus token lengths, its own workspaces."""

    def __init__(self, kv_layout="NHD", device="cuda"):
        assert kv_layout == "NHD"

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_qo_heads, num_kv_heads, head_dim_qk,
             head_dim_vo, page_size, causal=False, sm_scale=None, logits_soft_cap=None, q_data_type=torch.bfloat16,
             kv_data_type=torch.bfloat16, use_profiler=False):
        assert causal and qo_indptr.dtype == kv_len_arr.dtype == torch.int32
        self.tables, self.lens, self.sm_scale = _csr_tables(kv_indptr, kv_indices), kv_len_arr.tolist(), sm_scale
        self.qo_indptr = qo_indptr.clone()

    def run(self, q, kv_cache, out=None, lse=None, k_scale=None, v_scale=None):
        assert lse is not None and lse.shape == q.shape[:2] and lse.dtype == torch.float32
        out.copy_(_paged_decode(q, *kv_cache, self.tables, self.lens, self.sm_scale, cu_seqlens_q=self.qo_indptr))
        return out, lse


def _trtllm_decode(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, bmm1_scale=1.0,
                   bmm2_scale=1.0, window_left=-1, out=None, kv_layout="HND", backend="auto"):
    """flashinfer.decode.trtllm_batch_decode_with_kv_cache (0.6.13), XQA: scores x bmm1_scale
    (the softmax scale with k_scale in it), output x bmm2_scale (v_scale)."""
    assert kv_layout == "NHD" and backend == "xqa" and workspace_buffer.dtype == torch.uint8
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and out.dtype == query.dtype
    assert max_seq_len == max(seq_lens.tolist())
    out.copy_(_paged_decode(query, *kv_cache, block_tables.tolist(), seq_lens.tolist(), bmm1_scale, bmm2_scale,
                            window_left + 1))
    return out


def _fa3_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
                  qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                  cache_leftpad=None, page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1),
                  has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0):
    return ("metadata", qkv_dtype, tuple(window_size), num_splits, max_seqlen_q)


def _fa3(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None, softmax_scale=None,
         causal=False, window_size=None, block_table=None, out=None, scheduler_metadata=None, q_descale=None,
         k_descale=None, v_descale=None, num_splits=0, fa_version=2):
    """vllm.vllm_flash_attn.flash_attn_varlen_func (vLLM 0.26), FA3: q, k, v of one dtype,
    an fp8 one with [B, Hkv] descales and bf16 output; varlen query rows (cu_seqlens_q, at
    most max_seqlen_q per request) at the end of each request's keys, causal; a query at
    position p reads keys [p - left, p]."""
    assert fa_version == 3 and causal and q.dtype == k.dtype == v.dtype
    assert out.dtype == (torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
    assert scheduler_metadata == ("metadata", q.dtype, tuple(window_size), num_splits, max_seqlen_q)
    assert max_seqlen_q >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    b, hkv = len(seqused_k), k.shape[2]
    scale = [1.0, 1.0, 1.0]
    for i, d in enumerate((q_descale, k_descale, v_descale)):
        if d is not None:
            assert d.shape == (b, hkv) and bool((d == d[0, 0]).all())
            scale[i] = float(d[0, 0])
    out.copy_(_paged_decode(q.float() * scale[0], k, v, block_table.tolist(), seqused_k.tolist(),
                            softmax_scale * scale[1], scale[2], window_size[0] + 1, cu_seqlens_q))
    return out


def _unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                       window_size, block_table, softcap, q_descale, k_descale, v_descale, seq_threshold_3D=None,
                       num_par_softmax_segments=None, softmax_segm_output=None, softmax_segm_max=None,
                       softmax_segm_expsum=None):
    """vllm.v1.attention.ops.triton_unified_attention.unified_attention (vLLM 0.26): varlen
    query rows at the end of each request's keys, causal; k/v descales [B, Hkv]; the 3D
    (split) kernel only for max_seqlen_q 1 and at most seq_threshold_3D requests, into
    segment buffers [threshold, Hq, segments, D padded]."""
    assert causal and window_size == (-1, -1) and softcap == 0 and q_descale is None
    b = len(seqused_k)
    assert k_descale.shape == v_descale.shape == (b, k.shape[2]) and bool((k_descale == 1).all())
    assert max_seqlen_q >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert max_seqlen_k == max(seqused_k.tolist())
    if max_seqlen_q == 1 and b <= seq_threshold_3D:
        assert softmax_segm_output.shape[:3] == (seq_threshold_3D, q.shape[1], num_par_softmax_segments)
    out.copy_(_paged_decode(q, k, v, block_table.tolist(), seqused_k.tolist(), softmax_scale,
                            cu_seqlens_q=cu_seqlens_q))


@pytest.fixture
def fake_peers(monkeypatch):
    """FlashInfer and vLLM's FA3 as importable stand-ins; CUDA syncs and workspaces made CPU-cheap."""
    fi = types.ModuleType("flashinfer")
    fi.__version__ = "stand-in"
    fi.BatchDecodeWithPagedKVCacheWrapper, fi.BatchAttention = _DecodeWrapper, _BatchAttention
    fi.decode = types.ModuleType("flashinfer.decode")
    fi.decode.trtllm_batch_decode_with_kv_cache = _trtllm_decode
    vllm, vfa = types.ModuleType("vllm"), types.ModuleType("vllm.vllm_flash_attn")
    vfa.flash_attn_varlen_func, vfa.get_scheduler_metadata = _fa3, _fa3_metadata
    unified = types.ModuleType(load("vllm_triton").MODULE)
    unified.unified_attention = _unified_attention
    for name, mod in (("flashinfer", fi), ("flashinfer.decode", fi.decode), ("vllm", vllm),
                      ("vllm.vllm_flash_attn", vfa), (unified.__name__, unified)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(load("flashinfer"), "WORKSPACE_BYTES", 1 << 10)
    monkeypatch.setattr(flashinfer_xqa, "WORKSPACE_BYTES", 1 << 10)


PEER_CASES = [("flashinfer", "notc", "auto", 0, 1), ("flashinfer", "tc", "fp8", 0, 1),
              ("flashinfer", "notc", "auto", 24, 1), ("flashinfer_holistic", "default", "auto", 0, 1),
              ("flashinfer_holistic", "default", "auto", 0, 4), ("flashinfer_xqa", "default", "auto", 0, 1),
              ("flashinfer_xqa", "default", "fp8", 0, 1), ("flashinfer_xqa", "default", "auto", 24, 1),
              ("fa3", "auto", "auto", 0, 1), ("fa3", "auto", "fp8", 0, 1), ("fa3", "ns1", "auto", 24, 1),
              ("fa3", "auto", "auto", 0, 4), ("fa3", "ns1", "fp8", 0, 3), ("fa3", "auto", "auto", 24, 5),
              ("vllm_triton", "default", "auto", 0, 1), ("vllm_triton", "default", "auto", 0, 4)]


@pytest.mark.parametrize("module,variant,kv,window,q_len", PEER_CASES)
def test_peer_adapters_call_the_peer_api_as_documented(module, variant, kv, window, q_len, fake_peers):
    """Each adapter, driven as the benchmark drives it, through a stand-in of its peer's API:
    the output equals the fp32 reference, so index formats, scales (fp8: K and V scaled
    differently), the window and verify rows (q_len query tokens per request, causal among
    them) reach the peer as its API defines them."""
    cpu, shape, lens = torch.device("cpu"), di.Shape("t", 8, 2, 64), [70, 5, 33]
    args = di.resolve_args(["--kv-dtype", kv, "--window", str(window), "--verify", str(q_len - 1)])
    ctx = di.make_context(args, shape, 16, cpu, max_batch=len(lens), max_pages=8, max_q_len=q_len)
    assert getattr(load(module), "supports", lambda c: "")(ctx) == ""
    batch = di.Pool(shape, sum(lens), 16, len(lens), torch.bfloat16, cpu, 0, ctx.kv_dtype).batch(lens, 1, q_len)
    runner = load(module).make(variant, ctx)
    di.run_once(runner, batch)
    refs = di.reference_rows(batch, range(len(lens)), shape, ctx.sm_scale, 1 << 30, window=window)
    ok, err, tol = di.compare_rows(di.request_outputs(batch, refs), refs,
                                   torch.float8_e4m3fn if ctx.kv_fp8 else torch.bfloat16)
    assert ok, f"rel err {err:.3g} > tol {tol:.3g}"
    assert runner.describe()


@pytest.mark.interpreter
def test_fp8_window_run_writes_its_columns_and_bytes(tmp_path, monkeypatch, mocked_cuda, fake_peers):
    """A whole --kv-dtype fp8 --window run over stand-in peers: every row carries the KV
    dtype, the window and the bytes of the window's tokens in 1-byte elements; XQA, which
    takes pages of 16+ only, is left out of page 1 with a note; its JIT build is started
    for page 16 only."""
    monkeypatch.setattr(flashinfer_xqa, "available", lambda: (True, ""))
    builds = []
    monkeypatch.setattr(fi_jit, "start_background", lambda key, argv: builds.append(key) or True)
    args = di.resolve_args(["--shape", "tiny", "--T", "80", "--B", "2,4", "--dists", "Uniform,Skewed80",
                            "--pages", "16,1", "--impls", "fa3-auto,flashinfer_xqa", "--kv-dtype", "fp8",
                            "--window", "24", "--min-reps", "1", "--max-reps", "1", "--plan-reps", "1",
                            "--flush-mib", "1", "--copy-mib", "1", "--out", str(tmp_path), "--tag", "f", "--no-plots"])
    impls, _ = di.discover(args, torch.device("cpu"), quiet=True)
    assert [i.name for i in impls] == ["fa3-auto", "flashinfer_xqa"]
    run_dir = Path(di.Bench(args, torch.device("cpu")).run(impls))
    assert builds == [("xqa", "bf16", "fp8", "64", "16", "2", "1")]
    rows = list(csv.DictReader(open(run_dir / "f.csv")))
    assert sorted((r["name"], r["page"]) for r in rows) == sorted(
        [("fa3-auto", p) for p in ("16", "1") for _ in range(4)] + [("flashinfer_xqa", "16")] * 4)
    assert all(r["status"] == "ok" for r in rows), [(r["name"], r["status"], r["detail"]) for r in rows]
    for r in rows:
        lens = di.dist_lengths(r["dist"], 80, int(r["B"]))
        assert (r["kv_dtype"], r["window"], r["dtype"]) == ("fp8", "24", "bf16")
        assert int(r["kv_bytes"]) == di.kv_read_bytes(lens, 2, 64, 1, window=24)
    checked = [r for r in rows if r["check_err"]]
    assert checked and all(float(r["check_err"]) <= float(r["check_tol"]) for r in checked)
    summary = (run_dir / "summary.md").read_text()
    assert "flashinfer_xqa not run for tiny page 1: pages of 16, 32, 64, 128 tokens only" in summary
    assert "## tiny kv=fp8 window=24, T = 80, page size 16" in summary


# ----------------------------------------------------------------------------- the demo

def test_demo_interpreter_mode_runs():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "evenkv", "demo", "--cpu"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "INTERPRETER" in p.stdout and "no performance meaning" in p.stdout and "DEMO PASS" in p.stdout


def test_demo_reexecs_with_interpreter_env(monkeypatch):
    from evenkv import cli
    seen = {}

    def fake_call(cmd, env):
        seen.update(cmd=cmd, env=env)
        return 0

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cli.subprocess, "call", fake_call)
    assert cli.main(["demo", "--cpu"]) == 0
    assert seen["cmd"][1:] == ["-m", "evenkv", "demo", "--cpu"] and seen["env"]["TRITON_INTERPRET"] == "1"


def test_python_m_benchmarks_dry_run():
    p = subprocess.run([sys.executable, "-m", "benchmarks.decode_imbalance", "--dry-run", "--quick"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "qwen3-30b-a3b 32/4/128 T=262144 page 16: 16 points" in p.stdout


def test_python_m_evenkv_info():
    p = subprocess.run([sys.executable, "-m", "evenkv", "info"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "config table sm" in p.stdout and "head_dim 128 page 16: decode sm" in p.stdout



def test_python_m_evenkv_without_a_command_prints_usage(capsys):
    from evenkv import cli
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: evenkv") and "demo" in err and "info" in err


@pytest.mark.parametrize("name", ["decode_imbalance", "prefill", "read_floor", "report", "serving", "startup", "tune_decode"])
def test_benchmark_usage_lines_name_the_real_command(name, monkeypatch, capsys):
    """Each benchmark's --help shows the command that runs it from the checkout."""
    import importlib
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"/somewhere/benchmarks/{name}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks.{name} ")


# ----------------------------------------------------------------------------- the other benchmark tools

def test_prefill_cpu_smoke_checks_every_point(tmp_path):
    """benchmarks/prefill.py end to end under the interpreter: every evenkv point is checked
    against the fp32 reference (status ok) and both schedules run on the skewed point."""
    out = tmp_path / "p.csv"
    p = subprocess.run([sys.executable, "-m", "benchmarks.prefill", "--out", str(out), "--cpu-smoke", "--skewed"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader(open(out)))
    assert rows and all(r["status"] == "ok" for r in rows), [(r["variant"], r["status"], r["max_err"]) for r in rows]
    assert {r["variant"] for r in rows if r["scenario"] == "skewed"} == {"engine", "lpt", "ordered"}
    assert (tmp_path / "p.md").exists()


def test_prefill_engine_paths_fall_back_to_the_triton_extend_without_an_engine_fa3(tmp_path):
    """Both engines' prefill paths on a machine without their FA3 (the CPU): extend rows on
    evenkv's Triton kernel, checked against the fp32 reference, and the config says so."""
    out = tmp_path / "p.csv"
    p = subprocess.run([sys.executable, "-m", "benchmarks.prefill", "--out", str(out), "--cpu-smoke",
                        "--impls", "evenkv-engine,evenkv-engine-sglang"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader(open(out)))
    assert {r["variant"] for r in rows} == {"engine", "engine-sglang"}
    assert all(r["status"] == "ok" and "Triton" in r["config"] for r in rows), \
        [(r["variant"], r["status"], r["config"]) for r in rows]


def test_startup_benchmark_alternates_the_build_modes_and_keeps_a_failed_point(tmp_path):
    """benchmarks/startup.py's parent loop on a machine without CUDA: every point runs in its own
    process, in-process and forked builds alternate by repeat (``--processes`` picks them), and
    a point that fails is a CSV row whose status says why and when (cold or warm start),
    written as it finishes."""
    out = tmp_path / "s.csv"
    p = subprocess.run([sys.executable, "-m", "benchmarks.startup", "--kinds", "vllm-like", "--repeats", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader(open(out)))
    from evenkv.kernels.launching import build_processes
    forked = str(build_processes())
    assert [(r["repeat"], r["build_processes"]) for r in rows] == [("1", "1"), ("1", forked), ("2", forked), ("2", "1")]
    assert all(r["status"].startswith("error (cold): ") and r["total_s"] == r["warm_total_s"] == "" for r in rows), \
        [r["status"] for r in rows]
    p = subprocess.run([sys.executable, "-m", "benchmarks.startup", "--kinds", "sglang-like", "--repeats", "1",
                        "--processes", "forked", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert p.returncode == 0, p.stdout + p.stderr
    assert [(r["kind"], r["build_processes"]) for r in csv.DictReader(open(out))] == [("sglang-like", forked)]


def test_tune_decode_sweeps_every_cache_dtype_and_layout_listed(capsys):
    """--kv-dtype and --cache-layout take comma lists (one process sweeps each pair); an unknown
    item is refused by name."""
    from benchmarks import tune_decode
    args = tune_decode.parse_args(["--out", "x.csv", "--kv-dtype", "fp8,auto", "--cache-layout", "vllm-hnd,token-major"])
    assert args.kv_dtype == ("fp8", "auto") and args.cache_layout == ("vllm-hnd", "token-major")
    default = tune_decode.parse_args(["--out", "x.csv"])
    assert default.kv_dtype == ("auto",) and default.cache_layout == ("token-major",)
    with pytest.raises(SystemExit):
        tune_decode.parse_args(["--out", "x.csv", "--cache-layout", "token-major,nhd"])
    assert "got 'token-major,nhd'" in capsys.readouterr().err
    assert tune_decode.parse_args(["--out", "x.csv", "--cache-layout", "all"]).cache_layout == tune_decode.CACHE_LAYOUTS


def test_tune_decode_parses_config_names():
    from benchmarks import tune_decode
    cfg = tune_decode.parse_config("bn64-w4-s5-c3-r128")
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.max_ctas_per_sm, cfg.max_registers) == (64, 4, 5, 3, 128)
    assert cfg.programmatic_launch and not cfg.segment_loops
    assert tune_decode.parse_config("bn32-w8-s2-c4").max_registers is None
    assert tune_decode.parse_config("bn32-w4-s3-c2-r224-loops").segment_loops
    no_pdl = tune_decode.parse_config("bn64-w4-s3-c2-r224-loops-nopdl")
    assert no_pdl.segment_loops and not no_pdl.programmatic_launch and no_pdl.max_registers == 224
    with pytest.raises(ValueError, match="bn64-w4-sX-c3"):
        tune_decode.parse_config("bn64-w4-sX-c3")
    with pytest.raises(ValueError, match="bn64-w4-s3-c2-nopdl-loops"):
        tune_decode.parse_config("bn64-w4-s3-c2-nopdl-loops")


def test_tune_decode_parses_grid_sizes(capsys):
    """--grids: each config is timed at every listed persistent grid ('default': DecodeAttention's
    own); anything but positive ints and 'default' is refused with the whole value named."""
    from benchmarks import tune_decode
    assert tune_decode.parse_args(["--out", "x.csv"]).grids == (None,)
    assert tune_decode.parse_args(["--out", "x.csv", "--grids", "default,256,260"]).grids == (None, 256, 260)
    for bad in ("256,0", "264,-8", "256,auto", ""):
        with pytest.raises(SystemExit):
            tune_decode.parse_args(["--out", "x.csv", "--grids", bad])
        assert f"got {bad!r}" in capsys.readouterr().err


def test_read_floor_kernel_sums_each_chunk():
    """The read-floor benchmark's streaming kernel (interpreter): program p sums its own chunk."""
    from benchmarks import read_floor
    x = torch.randn(4 * 3 * 32, dtype=torch.bfloat16)
    got = read_floor.read_sum(x, grid=4, block=32, num_warps=4, num_stages=2)
    want = x.float().view(4, -1).sum(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="divisible by grid \\* block = 256, got 384"):
        read_floor.read_sum(x, grid=4, block=64, num_warps=4)
    with pytest.raises(ValueError, match="bfloat16 tensor, got shape \\(384,\\) torch.float32"):
        read_floor.read_sum(x.float(), grid=4, block=32, num_warps=4)


@pytest.mark.parametrize("q_len,tree", [(1, False), (4, False), (4, True)])
def test_startup_step_is_the_planned_batch_on_every_layer(q_len, tree):
    """benchmarks/startup.py's captured step (interpreter): one plan of decode or verify rows of
    CAPTURE_SEQ_LEN tokens, then a run per layer, each layer's output the reference's."""
    from benchmarks import startup
    from evenkv.kernels.reference import extend_reference

    hq, hkv, d, page = 4, 2, 64, 1
    batch = startup.step_batch(hq, hkv, d, page, q_len, "cpu")
    assert batch.batch_size == startup.CAPTURE_BATCH and batch.max_len == startup.CAPTURE_SEQ_LEN
    batch.out.zero_()
    attn = evenkv.Attention(hq, hkv, d, page, torch.bfloat16, "cpu", startup.CAPTURE_BATCH,
                            batch.page_table.shape[1], max_decode_q_len=q_len, tree_masks=tree)
    runs = []
    real_run = attn.run
    attn.run = lambda *args, **kw: runs.append(1) or real_run(*args, **kw)
    startup.layer_forward(attn, batch, layers=3, tree=tree, index_dtype=torch.int64)()
    assert len(runs) == 3
    ref = extend_reference(batch.q, batch.k_slots, batch.v_slots, batch.cu_seqlens_q, batch.seq_lens,
                           batch.page_table, page)
    assert (batch.out.float() - ref).abs().max() < 2e-2


def test_tune_decode_tables_time_fp8_rows_beside_the_bf16_rows():
    from benchmarks import tune_decode
    import evenkv
    from evenkv.configs import many_segments_config
    bf16 = [c.name for c in tune_decode.table_configs(256, 16, None, False)]
    fp8 = [c.name for c in tune_decode.table_configs(256, 16, None, True)]
    assert evenkv.decode_config("sm90", 256, 16, True).name in fp8
    assert evenkv.decode_config("sm90", 256, 16).name in fp8 and set(bf16) < set(fp8)
    assert len(fp8) == len(set(fp8))
    verify = [c.name for c in tune_decode.table_configs(256, 16, 64, True, archs=("sm90",))]
    assert {evenkv.decode_config("sm90", 256, 16, True, rows=64).name, many_segments_config("sm90", 256, 16, rows=64).name,
            many_segments_config("sm90", 256, 16, True, rows=64).name} <= set(verify)
    assert not any(name.startswith("sm80") for name in verify)


@pytest.mark.parametrize("layout", ["head-major", "vllm-nhd", "vllm-hnd"])
def test_tune_decode_cache_layouts_decode_like_the_token_major_one(layout):
    """--cache-layout: pages stored HND ([pages, Hkv, page, D] viewed as [pages, page, Hkv, D]) or
    as vLLM's one K|V buffer (NHD or HND, K and V the halves of its last dim); decode over each,
    FP8 included (read as int16 pairs), gives the same bits as over the same values stored
    token-major."""
    from benchmarks import tune_decode
    hq, hkv, d, page, pages = 8, 2, 64, 16, 8
    expected_strides = {"head-major": (hkv * page * d, d, page * d, 1),
                        "vllm-nhd": (page * hkv * 2 * d, hkv * 2 * d, 2 * d, 1),
                        "vllm-hnd": (hkv * page * 2 * d, 2 * d, page * 2 * d, 1)}[layout]
    q = torch.randn(2, hq, d, dtype=torch.bfloat16)
    seq_lens = torch.tensor([70, 33], dtype=torch.int32)
    pt = torch.tensor([[5, 0, 7, 2, 6], [3, 1, 4, 0, 0]], dtype=torch.int32)
    for fp8 in (False, True):
        torch.manual_seed(0)
        k, v, scales = tune_decode.random_caches(pages, page, hkv, d, layout, fp8, "cpu")
        assert k.shape == v.shape == (pages, page, hkv, d)
        assert k.stride() == v.stride() == expected_strides
        assert k.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
        if layout.startswith("vllm"):
            assert v.data_ptr() == k.data_ptr() + d * k.element_size()
        attn = evenkv.DecodeAttention(hq, hkv, d, page, torch.bfloat16, "cpu", 2, pt.shape[1], kv_dtype=k.dtype)
        plan = attn.plan(seq_lens, pt)
        out = attn.run(plan, q, k, v, **scales).clone()
        assert torch.equal(out, attn.run(plan, q, k.contiguous(), v.contiguous(), **scales))
