#!/usr/bin/env python3
"""Summary and plots of decode-imbalance results (long-format CSV, one row per measurement).

    python -m benchmarks.report RESULTS_DIR_OR_CSV [...] [--out DIR] [--ours evenkv-balanced]

Reads every CSV given (a folder means its ``*.csv``), keeps the last row of each
(series, T, page, B, dist, implementation), and writes into ``--out`` (default: the
first folder given, or the first CSV's folder). A series is a shape with its KV cache: the
shape's name, plus ``kv=fp8`` when the KV dtype is not the model dtype and ``window=W``
for a sliding window (CSVs without those columns hold the shape alone), so rows of
different KV dtypes or windows are grouped, compared and plotted apart:

* ``summary.md``: the headline numbers of ``--ours`` (worst fraction of the copy
  bandwidth over all points, worst flatness, worst and median ratio to FA3 auto and
  to the best peer at each point), each implementation's worst point, and per
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
    "shape", "hq", "hkv", "head_dim", "dtype", "kv_dtype", "window", "T", "B", "dist", "page", "max_len", "min_len",
    "name", "impl", "variant", "impl_version", "config", "config_detail", "status", "detail",
    "us_med", "us_p20", "us_p80", "us_min", "n_rep", "plan_dev_us", "plan_host_us", "launch_host_us",
    "kv_bytes", "gbps", "frac_copy", "copy_rw_tbps", "check_err", "check_tol",
]
INT_COLUMNS = ("hq", "hkv", "head_dim", "window", "T", "B", "page", "max_len", "min_len", "n_rep", "kv_bytes",
               "num_sms")
FLOAT_COLUMNS = ("us_med", "us_p20", "us_p80", "us_min", "plan_dev_us", "plan_host_us", "launch_host_us", "gbps",
                 "frac_copy", "copy_rw_tbps", "check_err", "check_tol")
DIST_ORDER = ("Uniform", "Skewed40", "Skewed60", "Skewed80", "2x40")
OURS = "evenkv-balanced"
FA3_AUTO = "fa3-auto"


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
    row["series"] = series(row)
    return row


def series(r) -> str:
    """The shape's name, with the KV dtype where it is not the model dtype and the window."""
    label = r["shape"]
    if r["kv_dtype"] != r["dtype"]:
        label += f" kv={r['kv_dtype']}"
    if r["window"]:
        label += f" window={r['window']}"
    return label


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
            "Fraction = KV bytes read (min(len, window) tokens per request, in the cache's element size) / time / "
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
