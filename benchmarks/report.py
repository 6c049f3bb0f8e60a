#!/usr/bin/env python3
"""Summary and plots of decode-imbalance results (long-format CSV, one row per measurement).

    python -m benchmarks.report RESULTS_DIR_OR_CSV [...] [--out DIR] [--ours evenkv-balanced]

Reads every CSV given (a folder means its ``*.csv``), keeps the last row of each
(series, T, page, B, dist, implementation), and writes into ``--out`` (default: the
first folder given, or the first CSV's folder). A series is a shape with its KV cache and
its query rows: the shape's name, plus ``kv=fp8`` when the KV dtype is not the model dtype,
``window=W`` for a sliding window and ``q_len=N`` for speculative-verify rows of N query
tokens per request (CSVs without those columns hold plain decode of the shape alone), so
rows of different KV dtypes, windows or query lengths are grouped, compared and plotted apart:

* ``summary.md``: the headline numbers of ``--ours`` (worst fraction of the copy
  bandwidth over all points, worst flatness, worst and median ratio to FA3 auto and
  to the best peer at each point), each implementation's worst point; where the run has
  verify rows, each verify time of ``--ours`` over its plain decode time on the same batch
  and over FA3's at the same q_len, and the flatness per (B, q_len); where it has
  evenkv-balanced-det, its time over evenkv-balanced's and fa3-ns1's; then per
  (series, T, page) the flatness table (max/min time over the distributions at each B),
  the per-point ratios and the full time table;
* PNGs per (series, T, page): ``time_*`` (µs vs B, one panel per implementation, one
  line per distribution), ``frac_*`` (fraction of the copy bandwidth) and ``ratio_*``
  (ours / each peer). Skipped, with a note, when matplotlib is missing.

Definitions. Ratio = time of ours / time of the other at the same point (< 1: ours is
faster). Best peer = the fastest non-evenkv implementation with status ok at that point.
Flatness = max / min of the median time over the distributions measured at one
(series, T, page, B); at B = 1 every distribution is the same single request, measured
once, so flatness is 1 there. Only rows with status ok count.
"""

import argparse
import csv
import glob
import math
import os
import statistics
import sys
from collections import defaultdict

COLUMNS = [
    "run", "timestamp", "gpu", "num_sms", "cc", "torch", "triton", "cuda", "evenkv", "evenkv_git",
    "flashinfer", "vllm", "sglang",
    "shape", "hq", "hkv", "head_dim", "dtype", "kv_dtype", "window", "T", "B", "dist", "q_len", "page", "max_len",
    "min_len",
    "name", "impl", "variant", "impl_version", "config", "config_detail", "status", "detail",
    "us_med", "us_p20", "us_p80", "us_min", "n_rep", "plan_dev_us", "plan_host_us", "launch_host_us",
    "kv_bytes", "gbps", "frac_copy", "copy_rw_tbps", "check_err", "check_tol",
]
INT_COLUMNS = ("hq", "hkv", "head_dim", "window", "T", "B", "q_len", "page", "max_len", "min_len", "n_rep", "kv_bytes",
               "num_sms")
FLOAT_COLUMNS = ("us_med", "us_p20", "us_p80", "us_min", "plan_dev_us", "plan_host_us", "launch_host_us", "gbps",
                 "frac_copy", "copy_rw_tbps", "check_err", "check_tol")
DIST_ORDER = ("Uniform", "Skewed40", "Skewed60", "Skewed80", "2x40")
OURS = "evenkv-balanced"
FA3_AUTO = "fa3-auto"
FA3_NS1 = "fa3-ns1"
DETERMINISTIC = "evenkv-balanced-det"
# The targets the summary counts misses against. Verify rows: at most 1.15x the plain decode
# of the same batch, no slower than the fastest FA3 variant at the same q_len, flat across
# distributions within 1.10. Deterministic decode: at most 1.10x the balanced policy, no
# slower than FA3 with one split.
VERIFY_OVER_PLAIN_GOAL = 1.15
VERIFY_OVER_FA3_GOAL = 1.00
VERIFY_FLAT_GOAL = 1.10
DET_OVER_BALANCED_GOAL = 1.10
DET_OVER_FA3_NS1_GOAL = 1.00


# ----------------------------------------------------------------------------- loading


def _style_panel(ax, title: str, log_y: bool):
    """One panel: log2 batch-size axis with plain tick labels, optional log y, grid."""
    from matplotlib.ticker import FuncFormatter
    ax.set_title(title, fontsize=9)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def _panels(plt, count: int):
    """A grid of up to 4 columns of panels sharing both axes, one per implementation."""
    ncol = min(4, count)
    nrow = math.ceil(count / ncol)
    return plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.2 * nrow), squeeze=False, sharex=True, sharey=True)

def csv_paths(inputs) -> list:
    paths = []
    for p in inputs:
        if os.path.isdir(p):
            paths += sorted(glob.glob(os.path.join(p, "*.csv")))
        else:
            paths.append(p)
    return paths


def _convert(row: dict) -> dict:
    for k in INT_COLUMNS:
        v = row.get(k, "")
        row[k] = int(float(v)) if v not in ("", None) else None
    for k in FLOAT_COLUMNS:
        v = row.get(k, "")
        row[k] = float(v) if v not in ("", None) else None
    row["kv_dtype"] = row.get("kv_dtype") or row["dtype"]
    row["window"] = row["window"] or 0
    row["q_len"] = row["q_len"] or 1
    row["cache"] = cache_series(row)
    row["series"] = series(row)
    return row


def cache_series(r) -> str:
    """The shape's name, with the KV dtype where it is not the model dtype and the window."""
    label = r["shape"]
    if r["kv_dtype"] != r["dtype"]:
        label += f" kv={r['kv_dtype']}"
    if r["window"]:
        label += f" window={r['window']}"
    return label


def series(r) -> str:
    """``cache_series``, with the query tokens per request of verify rows (q_len > 1)."""
    return r["cache"] + (f" q_len={r['q_len']}" if r["q_len"] > 1 else "")


def read_rows(inputs) -> list:
    """Rows of every CSV in ``inputs``; of repeated measurements the last one wins."""
    latest = {}
    for path in csv_paths(inputs):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                row = _convert(dict(row))
                latest[point_key(row) + (row["name"],)] = row
    return list(latest.values())


def point_key(r) -> tuple:
    return (r["series"], r["T"], r["page"], r["B"], r["dist"])


def group_key(r) -> tuple:
    return (r["series"], r["T"], r["page"])


def is_ok(r) -> bool:
    return r["status"] == "ok" and r["us_med"] is not None


def is_peer(r) -> bool:
    return r["impl"] != "evenkv"


def dist_rank(d) -> int:
    return DIST_ORDER.index(d) if d in DIST_ORDER else len(DIST_ORDER)


def fmt_point(p) -> str:
    label, t, page, b, dist = p
    return f"{label} T={t} p{page} B={b} {dist}"


# ----------------------------------------------------------------------------- metrics

def flatness(rows) -> dict:
    """{(series, T, page, B, name): (max/min us over distributions, number of distributions)}."""
    times = defaultdict(list)
    for r in rows:
        if is_ok(r):
            times[(r["series"], r["T"], r["page"], r["B"], r["name"])].append(r["us_med"])
    return {k: (max(v) / min(v), len(v)) for k, v in times.items()}


def point_ratios(rows, ours=OURS) -> list:
    """One dict per point where ``ours`` is ok: its time, the best peer there and both ratios."""
    by_point = defaultdict(dict)
    for r in rows:
        if is_ok(r):
            by_point[point_key(r)][r["name"]] = r
    out = []
    for p, impls in by_point.items():
        if ours not in impls:
            continue
        mine = impls[ours]["us_med"]
        peers = {n: r["us_med"] for n, r in impls.items() if is_peer(r)}
        best = min(peers, key=peers.get) if peers else None
        fa3 = peers.get(FA3_AUTO)
        out.append({
            "point": p, "ours_us": mine, "best_peer": best, "best_us": peers.get(best),
            "ratio_best": mine / peers[best] if best else None,
            "fa3_us": fa3, "ratio_fa3": mine / fa3 if fa3 else None,
        })
    out.sort(key=lambda d: (d["point"][0], d["point"][1], d["point"][2], d["point"][3], dist_rank(d["point"][4])))
    return out


def _worst_and_median(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return max(values), statistics.median(values)


def headline(rows, ours=OURS, scope=None) -> dict:
    """The numbers the project is judged by, for ``ours`` over ``rows`` (all points).

    worst_frac: lowest fraction of the copy bandwidth; worst_flat: highest max/min over
    distributions; ratio_fa3 / ratio_best: (worst = highest, median) of ours / FA3 auto
    and ours / the best peer at each point.
    """
    mine = [r for r in rows if r["name"] == ours]
    ok = [r for r in mine if is_ok(r)]
    h = {"scope": scope or "all points", "points": len(mine), "ok": len(ok),
         "not_ok": len(mine) - len(ok)}
    fr = [r for r in ok if r["frac_copy"] is not None]
    if fr:
        w = min(fr, key=lambda r: r["frac_copy"])
        h["worst_frac"], h["worst_frac_at"], h["worst_frac_us"] = w["frac_copy"], point_key(w), w["us_med"]
        h["median_frac"] = statistics.median(r["frac_copy"] for r in fr)
    flats = {k: v for k, v in flatness(rows).items() if k[4] == ours}
    if flats:
        k = max(flats, key=lambda k: flats[k][0])
        h["worst_flat"], h["worst_flat_at"], h["worst_flat_n"] = flats[k][0], k[:4], flats[k][1]
    pr = point_ratios(rows, ours)
    h["ratio_fa3_worst"], h["ratio_fa3_median"] = _worst_and_median(d["ratio_fa3"] for d in pr)
    h["ratio_best_worst"], h["ratio_best_median"] = _worst_and_median(d["ratio_best"] for d in pr)
    with_fa3 = [d for d in pr if d["ratio_fa3"] is not None]
    with_best = [d for d in pr if d["ratio_best"] is not None]
    if with_fa3:
        h["ratio_fa3_worst_at"] = max(with_fa3, key=lambda d: d["ratio_fa3"])["point"]
        h["ratio_fa3_n"] = len(with_fa3)
    if with_best:
        w = max(with_best, key=lambda d: d["ratio_best"])
        h["ratio_best_worst_at"], h["ratio_best_worst_peer"] = w["point"], w["best_peer"]
        h["ratio_best_n"] = len(with_best)
    return h


def impl_worst(rows) -> list:
    """Per implementation: status counts, median/worst fraction of copy BW and worst flatness."""
    by_name = defaultdict(list)
    for r in rows:
        by_name[r["name"]].append(r)
    flats = flatness(rows)
    out = []
    for name, rs in by_name.items():
        ok = [r for r in rs if is_ok(r) and r["frac_copy"] is not None]
        d = {"name": name, "impl": rs[0]["impl"], "points": len(rs), "ok": len(ok),
             "wrong": sum(r["status"] == "wrong" for r in rs), "error": sum(r["status"] == "error" for r in rs)}
        if ok:
            w = min(ok, key=lambda r: r["frac_copy"])
            d.update(median_frac=statistics.median(r["frac_copy"] for r in ok), worst_frac=w["frac_copy"],
                     worst_at=point_key(w), worst_us=w["us_med"])
        f = {k: v for k, v in flats.items() if k[4] == name}
        if f:
            k = max(f, key=lambda k: f[k][0])
            d.update(worst_flat=f[k][0], worst_flat_at=k[:4])
        out.append(d)
    out.sort(key=lambda d: (d["impl"] != "evenkv", -(d.get("median_frac") or 0)))
    return out


def _worst(items, key):
    """(worst = highest value of ``key``, the item holding it, count of items with a value)."""
    items = [d for d in items if d[key] is not None]
    if not items:
        return None, None, 0
    w = max(items, key=lambda d: d[key])
    return w[key], w, len(items)


# Bytes per element of the model dtype (q and the output): the benchmark's dtypes
# (decode_imbalance.DTYPES), kept here so that the report reads CSVs without torch.
ELEMENT_BYTES = {"bf16": 2, "fp16": 2}


def query_bytes(r) -> int:
    """What a decode row's queries add to its KV reads: q read and the output written, q_len
    rows of Hq x head_dim elements per request ([B * q_len, Hq, D] each way)."""
    return 2 * r["B"] * r["q_len"] * r["hq"] * r["head_dim"] * ELEMENT_BYTES[r["dtype"]]


def bytes_floor(verify, plain) -> float:
    """The verify row's time over its plain decode's if both moved their bytes (KV read once,
    q read and the output written; merge partials left out) at the same bandwidth: the least
    verify / plain a decode kernel can reach at that point. At B = 2048 of T = 256K (128-token
    requests) a q_len of 8 brings as many q and output bytes as half the KV."""
    return (verify["kv_bytes"] + query_bytes(verify)) / (plain["kv_bytes"] + query_bytes(plain))


def verify_ratios(rows, ours=OURS) -> list:
    """One dict per verify point (q_len > 1) where ``ours`` is ok: "point" (cache series, T,
    page, B, dist), "q_len", its time, "ratio_plain" = its time / its plain decode time on the
    same batch (the q_len 1 row of that point), "floor" = ``bytes_floor`` of the two,
    "ratio_fa3_auto" = its time / fa3-auto's and "ratio_fa3_best" = its time / the fastest FA3
    variant's ("fa3_best") at that q_len; None where the other row is missing or not ok."""
    by_point = defaultdict(dict)
    for r in rows:
        if is_ok(r):
            by_point[(r["cache"], r["T"], r["page"], r["B"], r["dist"], r["q_len"])][r["name"]] = r
    out = []
    for key, impls in by_point.items():
        if key[5] == 1 or ours not in impls:
            continue
        mine = impls[ours]["us_med"]
        plain = by_point.get(key[:5] + (1,), {}).get(ours)
        fa3 = {n: r["us_med"] for n, r in impls.items() if r["impl"] == "fa3"}
        best = min(fa3, key=fa3.get) if fa3 else None
        out.append({"point": key[:5], "q_len": key[5], "ours_us": mine,
                    "plain_us": plain["us_med"] if plain else None,
                    "ratio_plain": mine / plain["us_med"] if plain else None,
                    "floor": bytes_floor(impls[ours], plain) if plain else None,
                    "ratio_fa3_auto": mine / fa3[FA3_AUTO] if FA3_AUTO in fa3 else None,
                    "fa3_best": best, "ratio_fa3_best": mine / fa3[best] if best else None})
    out.sort(key=lambda d: (d["point"][:4], dist_rank(d["point"][4]), d["q_len"]))
    return out


def verify_flatness(rows, ours=OURS) -> dict:
    """{(cache series, T, page, B, q_len): (max/min of ``ours``' time over the distributions,
    number of distributions)} for the verify rows (q_len > 1)."""
    flats = flatness(rows)
    return {(r["cache"], r["T"], r["page"], r["B"], r["q_len"]): flats[(r["series"], r["T"], r["page"], r["B"], ours)]
            for r in rows if r["name"] == ours and r["q_len"] > 1 and is_ok(r)}


def verify_summary(rows, ours=OURS) -> list:
    """Per (cache series, T, page, q_len) of verify rows: the worst of each ratio of
    ``verify_ratios`` and of ``verify_flatness``, where it is, and how many miss their goal."""
    groups = defaultdict(list)
    for d in verify_ratios(rows, ours):
        groups[d["point"][:3] + (d["q_len"],)].append(d)
    flats = verify_flatness(rows, ours)
    out = []
    for g in sorted(groups):
        ds = groups[g]
        f = [{"B": k[3], "flat": v[0]} for k, v in flats.items() if k[:3] + (k[4],) == g and v[1] > 1]
        s = {"group": g, "points": len(ds)}
        s["plain_worst"], w, s["plain_n"] = _worst(ds, "ratio_plain")
        s["plain_worst_at"] = w and w["point"]
        s["plain_over"] = sum(d["ratio_plain"] > VERIFY_OVER_PLAIN_GOAL for d in ds if d["ratio_plain"] is not None)
        s["plain_worst_floor"] = w and w["floor"]
        s["goal_below_floor"] = sum(d["floor"] > VERIFY_OVER_PLAIN_GOAL for d in ds if d["floor"] is not None)
        s["over_floor_worst"], _, _ = _worst([dict(d, over_floor=d["ratio_plain"] / d["floor"]) for d in ds
                                              if d["ratio_plain"] is not None], "over_floor")
        s["fa3_auto_worst"], _, _ = _worst(ds, "ratio_fa3_auto")
        s["fa3_best_worst"], w, s["fa3_n"] = _worst(ds, "ratio_fa3_best")
        s["fa3_best_worst_at"], s["fa3_best_worst_impl"] = (w["point"], w["fa3_best"]) if w else (None, None)
        s["fa3_over"] = sum(d["ratio_fa3_best"] > VERIFY_OVER_FA3_GOAL for d in ds if d["ratio_fa3_best"] is not None)
        s["flat_worst"], w, s["flat_n"] = _worst(f, "flat")
        s["flat_worst_b"] = w and w["B"]
        s["flat_over"] = sum(x["flat"] > VERIFY_FLAT_GOAL for x in f)
        out.append(s)
    return out


def deterministic_ratios(rows, det=DETERMINISTIC, balanced=OURS, fa3_ns1=FA3_NS1) -> list:
    """One dict per point where ``det`` is ok: "ratio_balanced" = its time / ``balanced``'s,
    "ratio_fa3_ns1" = its time / ``fa3_ns1``'s at that point (None where that row is not ok)."""
    by_point = defaultdict(dict)
    for r in rows:
        if is_ok(r):
            by_point[point_key(r)][r["name"]] = r["us_med"]
    out = []
    for p, t in by_point.items():
        if det in t:
            out.append({"point": p, "det_us": t[det],
                        "ratio_balanced": t[det] / t[balanced] if balanced in t else None,
                        "ratio_fa3_ns1": t[det] / t[fa3_ns1] if fa3_ns1 in t else None})
    out.sort(key=lambda d: (d["point"][:4], dist_rank(d["point"][4])))
    return out


def deterministic_summary(rows) -> list:
    """Per (series, T, page): worst and median of each ``deterministic_ratios`` ratio, where the
    worst is, and how many points miss their goal."""
    groups = defaultdict(list)
    for d in deterministic_ratios(rows):
        groups[group_key_from_point(d["point"])].append(d)
    out = []
    for g in sorted(groups):
        ds = groups[g]
        s = {"group": g, "points": len(ds)}
        for key, goal in (("ratio_balanced", DET_OVER_BALANCED_GOAL), ("ratio_fa3_ns1", DET_OVER_FA3_NS1_GOAL)):
            s[key + "_worst"], w, s[key + "_n"] = _worst(ds, key)
            s[key + "_worst_at"] = w and w["point"]
            s[key + "_median"] = _worst_and_median(d[key] for d in ds)[1]
            s[key + "_over"] = sum(d[key] > goal for d in ds if d[key] is not None)
        out.append(s)
    return out


# ----------------------------------------------------------------------------- markdown

def _f(v, spec=".2f", none="–"):
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _pct(v):
    if v is None:
        return "–"
    return f"{100 * v:.0f}%" if v >= 0.095 else f"{100 * v:.1f}%"


def _table(header, body) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return lines + [""]


def _names_in_order(rows) -> list:
    names = {r["name"]: r["impl"] for r in rows}
    return sorted(names, key=lambda n: (names[n] != "evenkv", n != OURS, names[n], n))


def _headline_row(h) -> list:
    flat_at = h.get("worst_flat_at")
    return [
        h["scope"], f"{h['ok']}/{h['points']}",
        f"{_pct(h.get('worst_frac'))} ({fmt_point(h['worst_frac_at'])}, {_f(h.get('worst_frac_us'), '.0f')} µs)"
        if "worst_frac" in h else "–",
        _pct(h.get("median_frac")),
        f"{_f(h.get('worst_flat'))} ({flat_at[0]} T={flat_at[1]} p{flat_at[2]} B={flat_at[3]})" if flat_at else "–",
        f"{_f(h.get('ratio_fa3_worst'))} / {_f(h.get('ratio_fa3_median'))}"
        + (f" ({fmt_point(h['ratio_fa3_worst_at'])})" if h.get("ratio_fa3_worst_at") else ""),
        f"{_f(h.get('ratio_best_worst'))} / {_f(h.get('ratio_best_median'))}"
        + (f" ({fmt_point(h['ratio_best_worst_at'])} vs {h['ratio_best_worst_peer']})"
           if h.get("ratio_best_worst_at") else ""),
    ]


def summary_markdown(rows, ours=OURS, sources=(), notes=()) -> str:
    if not rows:
        return "# decode-imbalance benchmark\n\nNo rows.\n"
    r0 = rows[-1]
    statuses = defaultdict(int)
    for r in rows:
        statuses[r["status"]] += 1
    copy_bw = sorted({r["copy_rw_tbps"] for r in rows if r["copy_rw_tbps"]})
    out = [f"# Decode attention under load imbalance — {r0['gpu']}, {r0['timestamp'][:10]}", ""]
    out += [f"- Rows: {len(rows)} ({', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))}); sources: "
            + ", ".join(os.path.basename(s) for s in sources)]
    out += [f"- Versions: torch {r0['torch']}, triton {r0['triton']}, CUDA {r0['cuda']}, evenkv {r0['evenkv']}"
            f" ({r0['evenkv_git']}), {r0['flashinfer']}, {r0['vllm']}, {r0['sglang']}"]
    out += ["- Copy bandwidth (device-to-device, read + write counted), measured in each run: "
            + ", ".join(f"{v:.3f} TB/s" for v in copy_bw)]
    out += ["- Protocol: same KV pool, same random page placement and same q for every implementation; the long "
            "request(s) at batch index 0 (and 1); CUDA events around the attention call only; 256 MiB L2 flush "
            "before each timed call; median (p20/p80 in the CSV) of 5-50 calls; plan/prepare timed apart. "
            "Fraction = KV bytes read (each token once, verify rows too; min(len, window + q_len - 1) tokens per "
            "request under a window; in the cache's element size) / time / "
            "copy bandwidth (a read-only kernel can exceed 100 %). "
            "Ratio = ours / other (< 1: ours faster)."]
    out += [f"- {n}" for n in notes]
    out.append("")

    out += [f"## Headline: {ours}", ""]
    header = ["scope", "ok/points", "worst fraction of copy BW", "median fraction", "worst flatness (max/min)",
              "ratio to fa3-auto: worst / median", "ratio to best peer: worst / median"]
    body = [_headline_row(headline(rows, ours))]
    groups = sorted({group_key(r) for r in rows})
    for g in groups:
        sub = [r for r in rows if group_key(r) == g]
        body.append(_headline_row(headline(sub, ours, scope=f"{g[0]} T={g[1]} page {g[2]}")))
    out += _table(header, body)

    out += ["## Every implementation: worst point", ""]
    header = ["implementation", "ok/points", "wrong", "error", "median fraction", "worst fraction (point, µs)",
              "worst flatness (at)"]
    body = []
    for d in impl_worst(rows):
        wf = d.get("worst_flat_at")
        body.append([d["name"], f"{d['ok']}/{d['points']}", d["wrong"], d["error"], _pct(d.get("median_frac")),
                     f"{_pct(d.get('worst_frac'))} ({fmt_point(d['worst_at'])}, {_f(d.get('worst_us'), '.0f')} µs)"
                     if "worst_frac" in d else "–",
                     f"{_f(d.get('worst_flat'))} ({wf[0]} T={wf[1]} p{wf[2]} B={wf[3]})" if wf else "–"])
    out += _table(header, body)

    bad = [r for r in rows if r["status"] not in ("ok",)]
    if bad:
        out += ["## Not timed (wrong / error)", ""]
        seen = {}
        for r in bad:
            seen.setdefault((r["name"], r["status"], r["detail"][:160]), []).append(r)
        body = [[n, s, d, len(rs), fmt_point(point_key(rs[0]))] for (n, s, d), rs in seen.items()]
        out += _table(["implementation", "status", "detail", "points", "first point"], body)

    out += verify_markdown(rows, ours)
    out += deterministic_markdown(rows)

    flats = flatness(rows)
    ratios = point_ratios(rows, ours)
    for g in groups:
        sub = [r for r in rows if group_key(r) == g]
        names = _names_in_order(sub)
        bs = sorted({r["B"] for r in sub})
        dists = sorted({r["dist"] for r in sub}, key=dist_rank)
        out += [f"## {g[0]}, T = {g[1]}, page size {g[2]}", ""]
        out += ["Flatness: max/min of the median time over the distributions at each B.", ""]
        body = []
        for b in bs:
            row = [b]
            for n in names:
                f = flats.get((g[0], g[1], g[2], b, n))
                row.append(_f(f[0]) + ("" if f is None or f[1] == len([d for d in dists if _exists(sub, b, d)])
                                       else "*") if f else "–")
            body.append(row)
        out += _table(["B"] + names, body)
        out.append("`*`: fewer distributions measured ok than exist at that B.")
        out.append("")
        out += [f"Ratio {ours} / best peer (best peer) and / fa3-auto, per point.", ""]
        rmap = {d["point"]: d for d in ratios if group_key_from_point(d["point"]) == g}
        body = []
        for b in bs:
            row = [b]
            for dist in dists:
                d = rmap.get((g[0], g[1], g[2], b, dist))
                if d is None:
                    row.append("–")
                else:
                    row.append(f"{_f(d['ratio_best'])} ({d['best_peer'] or '–'}) / {_f(d['ratio_fa3'])}")
            body.append(row)
        out += _table(["B"] + list(dists), body)
        out += ["Median time in µs (fraction of copy bandwidth).", ""]
        by = {(r["B"], r["dist"], r["name"]): r for r in sub}
        body = []
        for b in bs:
            for dist in dists:
                if not _exists(sub, b, dist):
                    continue
                row = [b, dist]
                for n in names:
                    r = by.get((b, dist, n))
                    if r is None:
                        row.append("–")
                    elif is_ok(r):
                        row.append(f"{r['us_med']:.0f} ({_pct(r['frac_copy'])})")
                    else:
                        row.append(r["status"])
                body.append(row)
        out += _table(["B", "dist"] + names, body)
    return "\n".join(out) + "\n"


def group_key_from_point(p) -> tuple:
    return p[:3]


def _over(count, n) -> str:
    return f"{count}/{n}" if n else "–"


def verify_markdown(rows, ours=OURS) -> list:
    """The verify section: one summary line per (cache series, T, page, q_len), then per
    (cache series, T, page) each point's verify / plain and verify / fastest FA3, and the
    flatness at each B. Nothing without verify rows of ``ours``."""
    summary = verify_summary(rows, ours)
    if not summary:
        return []
    out = [f"## Speculative verify: {ours}", "",
           f"Verify rows: q_len = 1 + K query tokens per request (K draft tokens). Ratios of {ours}'s verify time "
           f"to its plain decode time on the same batch (goal <= {VERIFY_OVER_PLAIN_GOAL:.2f}), to fa3-auto's and to "
           f"the fastest FA3 variant's at the same q_len (goal <= {VERIFY_OVER_FA3_GOAL:.2f}); flatness = max/min "
           f"over the distributions at one B (goal <= {VERIFY_FLAT_GOAL:.2f}); over = points missing the goal. "
           "Floor = the least verify / plain at that point if both kernels moved their bytes (KV read once, q read "
           "and the output written) at one bandwidth; \"goal < floor\" counts the points where the verify / plain "
           "goal lies below it.", ""]
    header = ["series", "T", "page", "q_len", "points", "verify / plain: worst (at; floor there)", "over",
              "goal < floor", "verify / plain over floor: worst", "/ fa3-auto: worst", "/ fastest FA3: worst (at)",
              "over", "flatness: worst (B)", "over"]
    body = []
    for s in summary:
        cache, t, page, q_len = s["group"]
        at = s["plain_worst_at"]
        fat = s["fa3_best_worst_at"]
        body.append([cache, t, page, q_len, s["points"],
                     f"{_f(s['plain_worst'])} ({at[3]} {at[4]}; {_f(s['plain_worst_floor'])})" if at else "–",
                     _over(s["plain_over"], s["plain_n"]), _over(s["goal_below_floor"], s["plain_n"]),
                     _f(s["over_floor_worst"]), _f(s["fa3_auto_worst"]),
                     f"{_f(s['fa3_best_worst'])} ({fat[3]} {fat[4]}, {s['fa3_best_worst_impl']})" if fat else "–",
                     _over(s["fa3_over"], s["fa3_n"]),
                     f"{_f(s['flat_worst'])} ({s['flat_worst_b']})" if s["flat_n"] else "–",
                     _over(s["flat_over"], s["flat_n"])])
    out += _table(header, body)
    ratios = verify_ratios(rows, ours)
    flats = verify_flatness(rows, ours)
    for g in sorted({d["point"][:3] for d in ratios}):
        here = [d for d in ratios if d["point"][:3] == g]
        q_lens = sorted({d["q_len"] for d in here})
        cell = {(d["point"][3], d["point"][4], d["q_len"]): d for d in here}
        out += [f"### Verify, {g[0]}, T = {g[1]}, page size {g[2]}: verify / plain (its floor) and / fastest FA3",
                ""]
        body = []
        for b in sorted({d["point"][3] for d in here}):
            dists = sorted({d["point"][4] for d in here if d["point"][3] == b}, key=dist_rank)
            for dist in dists:
                row = [b, dist]
                for q in q_lens:
                    d = cell.get((b, dist, q))
                    row.append(f"{_f(d['ratio_plain'])} ({_f(d['floor'])}) / {_f(d['ratio_fa3_best'])}" if d else "–")
                body.append(row)
            if len(dists) > 1:
                body.append([b, "flatness"] + [_f(flats[g + (b, q)][0]) if g + (b, q) in flats else "–"
                                               for q in q_lens])
        out += _table(["B", "dist"] + [f"q_len={q}" for q in q_lens], body)
    return out


def deterministic_markdown(rows) -> list:
    """The deterministic section: per (series, T, page) the worst and median of
    evenkv-balanced-det over evenkv-balanced and over fa3-ns1, then each point's two ratios.
    Nothing without ok evenkv-balanced-det rows."""
    summary = deterministic_summary(rows)
    if not summary:
        return []
    out = [f"## Deterministic: {DETERMINISTIC}", "",
           f"Its time over {OURS}'s (goal <= {DET_OVER_BALANCED_GOAL:.2f}) and over {FA3_NS1}'s (goal <= "
           f"{DET_OVER_FA3_NS1_GOAL:.2f}) at each point; over = points missing the goal.", ""]
    body = []
    for s in summary:
        row = list(s["group"]) + [s["points"]]
        for key in ("ratio_balanced", "ratio_fa3_ns1"):
            at = s[key + "_worst_at"]
            row += [f"{_f(s[key + '_worst'])} ({at[3]} {at[4]}) / {_f(s[key + '_median'])}" if at else "–",
                    _over(s[key + "_over"], s[key + "_n"])]
        body.append(row)
    out += _table(["series", "T", "page", "points", f"/ {OURS}: worst (at) / median", "over",
                   f"/ {FA3_NS1}: worst (at) / median", "over"], body)
    ratios = deterministic_ratios(rows)
    for g in sorted({group_key_from_point(d["point"]) for d in ratios}):
        cell = {d["point"][3:]: d for d in ratios if group_key_from_point(d["point"]) == g}
        dists = sorted({k[1] for k in cell}, key=dist_rank)
        out += [f"### Deterministic, {g[0]}, T = {g[1]}, page size {g[2]}: / {OURS} and / {FA3_NS1}", ""]
        body = [[b] + [f"{_f(cell[(b, dist)]['ratio_balanced'])} / {_f(cell[(b, dist)]['ratio_fa3_ns1'])}"
                       if (b, dist) in cell else "–" for dist in dists] for b in sorted({k[0] for k in cell})]
        out += _table(["B"] + dists, body)
    return out


def _exists(sub, b, dist) -> bool:
    return any(r["B"] == b and r["dist"] == dist for r in sub)


# ----------------------------------------------------------------------------- plots

def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in str(s))


def plot_all(rows, out_dir, ours=OURS) -> list:
    """PNG plots per (series, T, page). Returns the files written ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"[report] plots skipped: matplotlib unavailable ({type(e).__name__}: {e})", flush=True)
        return []
    files = []
    colors = {d: f"C{i}" for i, d in enumerate(DIST_ORDER)}
    for g in sorted({group_key(r) for r in rows}):
        sub = [r for r in rows if group_key(r) == g and is_ok(r)]
        if not sub:
            continue
        names = _names_in_order(sub)
        tag = f"{_slug(g[0])}_T{g[1]}_p{g[2]}"
        title = f"{g[0]}, T={g[1]}, page {g[2]} ({sub[0]['gpu']})"
        copy_bw = sub[0]["copy_rw_tbps"]
        # The KV bytes are the same at every point of a group unless a window trims them.
        kv_bytes = {r["kv_bytes"] for r in sub}
        for kind in ("time", "frac"):
            fig, axes = _panels(plt, len(names))
            for ax, n in zip(axes.flat, names):
                for dist in DIST_ORDER:
                    pts = sorted((r["B"], r["us_med"] if kind == "time" else r["frac_copy"])
                                 for r in sub if r["name"] == n and r["dist"] == dist)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, lw=1.2, color=colors[dist],
                                label=dist)
                if kind == "time" and copy_bw and len(kv_bytes) == 1:
                    ideal = sub[0]["kv_bytes"] / (copy_bw * 1e12) * 1e6
                    ax.axhline(ideal, color="k", ls=":", lw=0.8)
                if kind == "frac":
                    ax.axhline(1.0, color="k", ls=":", lw=0.8)
                _style_panel(ax, n, log_y=kind == "time")
            for ax in list(axes.flat)[len(names):]:
                ax.axis("off")
            axes.flat[0].legend(fontsize=7)
            fig.supxlabel("batch size B")
            fig.supylabel("µs (median)" if kind == "time" else "fraction of copy bandwidth")
            fig.suptitle(title + ("; dotted: KV bytes at the copy bandwidth" if kind == "time" else ""))
            fig.tight_layout()
            path = os.path.join(out_dir, f"{kind}_{tag}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            files.append(path)
        peers = [n for n in names if not n.startswith("evenkv")]
        mine = {(r["B"], r["dist"]): r["us_med"] for r in sub if r["name"] == ours}
        if peers and mine:
            fig, axes = _panels(plt, len(peers))
            for ax, n in zip(axes.flat, peers):
                for dist in DIST_ORDER:
                    pts = sorted((r["B"], mine[(r["B"], dist)] / r["us_med"]) for r in sub
                                 if r["name"] == n and r["dist"] == dist and (r["B"], dist) in mine)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, lw=1.2, color=colors[dist],
                                label=dist)
                ax.axhline(1.0, color="k", ls=":", lw=0.8)
                _style_panel(ax, f"{ours} / {n}", log_y=True)
            for ax in list(axes.flat)[len(peers):]:
                ax.axis("off")
            axes.flat[0].legend(fontsize=7)
            fig.supxlabel("batch size B")
            fig.supylabel("time ratio (< 1: evenkv faster)")
            fig.suptitle(title)
            fig.tight_layout()
            path = os.path.join(out_dir, f"ratio_{tag}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            files.append(path)
    return files


# ----------------------------------------------------------------------------- entry

def generate(inputs, out_dir=None, ours=OURS, notes=(), plots=True) -> dict:
    """Read ``inputs`` (CSVs or folders), write summary.md and PNGs into ``out_dir``."""
    sources = csv_paths(inputs)
    if out_dir is None:
        first = inputs[0]
        out_dir = first if os.path.isdir(first) else os.path.dirname(os.path.abspath(first))
    os.makedirs(out_dir, exist_ok=True)
    rows = read_rows(inputs)
    summary = os.path.join(out_dir, "summary.md")
    with open(summary, "w") as f:
        f.write(summary_markdown(rows, ours, sources, notes))
    pngs = plot_all(rows, out_dir, ours) if plots and rows else []
    return {"summary": summary, "pngs": pngs, "rows": len(rows), "headline": headline(rows, ours) if rows else {}}


def format_headline(h) -> str:
    if not h or not h.get("ok"):
        return "no ok rows for the headline implementation"
    return (f"{h['ok']}/{h['points']} points ok; worst fraction of copy BW {_pct(h.get('worst_frac'))}"
            f" at {fmt_point(h['worst_frac_at'])}; worst flatness {_f(h.get('worst_flat'))}; "
            f"ratio to fa3-auto worst {_f(h.get('ratio_fa3_worst'))} median {_f(h.get('ratio_fa3_median'))}; "
            f"to best peer worst {_f(h.get('ratio_best_worst'))} median {_f(h.get('ratio_best_median'))}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="result CSVs or folders holding them")
    ap.add_argument("--out", default=None, help="where summary.md and the PNGs go")
    ap.add_argument("--ours", default=OURS, help="implementation the headline is about")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    res = generate(a.inputs, a.out, a.ours, plots=not a.no_plots)
    print(f"[report] {res['rows']} rows -> {res['summary']} (+{len(res['pngs'])} PNG)")
    print(f"[report] {a.ours}: {format_headline(res['headline'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
