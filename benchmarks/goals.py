#!/usr/bin/env python3
"""Score issue 4's eight decode goals from decode-imbalance CSVs (one run's folder).

    python benchmarks/goals.py benchmarks/results/<run>   # prints a markdown table

Each goal is counted over the points it names, ``evenkv-balanced`` against the peers
measured in the same CSVs (``report.read_rows``: of repeated measurements the last
wins). The main shape is Qwen3-30B-A3B (32/4/128, bf16); a goal whose points are
missing from the CSVs says so instead of passing.

1. T = 262144, page 16: time <= 143 us at every point;
2. T = 1048576, page 16: >= 100 % of the copy bandwidth at every point;
3. ratio to FA3 auto <= 1.00 at every point (T = 262144, page 16), <= 0.85 at B >= 384,
   and its range at B > 992 (where FA3 stops splitting);
4. flatness (max / min over the distributions at one T, B) <= 1.10, at every T measured;
5. page 1 within 10 % of page 16 (T = 262144, same B and distribution);
6. the plan step <= 10 us of GPU time at B = 2048 (the CSV's ``plan_dev_us``);
7. T = 32768: within 1.1x of the best peer at every point;
8. every other shape at T = 262144: >= 85 % of the copy bandwidth at every point.
"""

import argparse
import sys

import report

MAIN_SHAPE = "qwen3-30b-a3b"
OURS = report.OURS


def _ours(rows, shape=MAIN_SHAPE, total=None, page=None):
    return [r for r in rows if r["name"] == OURS and report.is_ok(r) and r["shape"] == shape
            and (total is None or r["T"] == total) and (page is None or r["page"] == page)]


def _count(values, ok) -> str:
    """'met n/n' or 'n/N (range lo-hi)' for a list of numbers and a predicate."""
    if not values:
        return "no points measured"
    good = sum(ok(v) for v in values)
    verdict = "met" if good == len(values) else "not met"
    return f"{verdict}: {good}/{len(values)} (range {min(values):.3g}-{max(values):.3g})"


def score(rows) -> list:
    """[(goal, verdict text)] for the eight goals over ``rows`` (report.read_rows)."""
    out = []
    t256 = _ours(rows, total=262144, page=16)
    out.append(("1. T=256K p16 time <= 143 us", _count([r["us_med"] for r in t256], lambda v: v <= 143.0)))
    t1m = _ours(rows, total=1048576, page=16)
    out.append(("2. T=1M p16 >= 100 % of copy", _count([r["frac_copy"] for r in t1m], lambda v: v >= 1.0)))

    ratios = [d for d in report.point_ratios(rows) if d["point"][0] == MAIN_SHAPE and d["point"][1:3] == (262144, 16)
              and d["ratio_fa3"] is not None]
    out.append(("3a. ratio to FA3 <= 1.00 (256K p16)", _count([d["ratio_fa3"] for d in ratios], lambda v: v <= 1.0)))
    out.append(("3b. ratio to FA3 <= 0.85 at B >= 384",
                _count([d["ratio_fa3"] for d in ratios if d["point"][3] >= 384], lambda v: v <= 0.85)))
    far = [d["ratio_fa3"] for d in ratios if d["point"][3] > 992]
    out.append(("3c. ratio to FA3 at B > 992", f"range {min(far):.3g}-{max(far):.3g}" if far else "no points measured"))

    flats = {}
    for (shape, total, page, _, name), (v, n) in report.flatness(rows).items():
        if name == OURS and shape == MAIN_SHAPE and n > 1:
            flats.setdefault((total, page), []).append(v)
    for (total, page), values in sorted(flats.items()):
        out.append((f"4. flatness <= 1.10 (T={total} p{page})", _count(values, lambda v: v <= 1.10)))

    p16 = {(r["B"], r["dist"]): r["us_med"] for r in t256}
    p1 = [r["us_med"] / p16[(r["B"], r["dist"])] for r in _ours(rows, total=262144, page=1)
          if (r["B"], r["dist"]) in p16]
    out.append(("5. page 1 / page 16 within 10 %", _count(p1, lambda v: 0.9 <= v <= 1.1)))

    plan = [r["plan_dev_us"] for r in _ours(rows) if r["B"] == 2048 and r["plan_dev_us"] is not None]
    out.append(("6. plan <= 10 us at B = 2048", _count(plan, lambda v: v <= 10.0)))

    t32 = [d["ratio_best"] for d in report.point_ratios(rows) if d["point"][0] == MAIN_SHAPE
           and d["point"][1] == 32768 and d["ratio_best"] is not None]
    out.append(("7. T=32K within 1.1x of the best peer", _count(t32, lambda v: v <= 1.10)))

    others = sorted({r["shape"] for r in rows if r["name"] == OURS and r["shape"] != MAIN_SHAPE})
    for shape in others:
        fr = [r["frac_copy"] for r in _ours(rows, shape=shape, total=262144)]
        out.append((f"8. {shape} >= 85 % of copy (256K)", _count(fr, lambda v: v >= 0.85)))
    if not others:
        out.append(("8. other shapes >= 85 % of copy", "no points measured"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="result folders or CSVs")
    args = ap.parse_args(argv)
    rows = report.read_rows(args.inputs)
    print("| goal | result |\n|---|---|")
    for goal, verdict in score(rows):
        print(f"| {goal} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
