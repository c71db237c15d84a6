#!/usr/bin/env python3
"""Markdown rows from `lanes bench colocate` and `benches/colocate_torch.py`
JSON outputs (the same keys): one row per (file, L), the repetitions'
spread of the inference p99 ratio beside / alone, the worst max ratio,
training kept, and the median latencies of the first job.

    python3 benches/colocate_table.py LABEL=out.json [LABEL=out2.json ...]
"""

import json
import statistics
import sys


def fmt(xs, pct=False):
    xs = sorted(xs)
    f = (lambda x: f"{100 * x:.0f} %") if pct else (lambda x: f"{x:.2f}")
    if len(xs) == 1:
        return f(xs[0])
    return f"{f(statistics.median(xs))} ({f(xs[0])}–{f(xs[-1])})"


def rows(label, path):
    d = json.load(open(path))
    by_load = {}
    for r in d["runs"]:
        by_load.setdefault(r["load"], []).append(r)
    for load, runs in sorted(by_load.items()):
        p99 = [r["p99_beside_over_alone"] for r in runs]
        mx = [r["max_beside_over_alone"] for r in runs]
        kept = [r["training"]["kept"] for r in runs]
        job = [r["inference"][0] for r in runs]
        a50 = statistics.median(j["alone"]["p50_ms"] for j in job)
        a99 = statistics.median(j["alone"]["p99_ms"] for j in job)
        b50 = statistics.median(j["beside_training"]["p50_ms"] for j in job)
        b99 = statistics.median(j["beside_training"]["p99_ms"] for j in job)
        met = sum(1 for r in runs if r["goals"]["all"])
        print(
            f"| {label} | {load} | {a50:.2f} / {a99:.2f} | {b50:.2f} / {b99:.2f} | {fmt(p99)} | "
            f"{max(mx):.2f} | {fmt(kept, pct=True)} | {met}/{len(runs)} |"
        )


def main():
    print("| system | L | alone p50 / p99 (ms) | beside p50 / p99 (ms) | p99 × (median, range) | max × (worst) | training kept | goals met |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for arg in sys.argv[1:]:
        label, _, path = arg.partition("=")
        try:
            rows(label, path)
        except (OSError, ValueError, KeyError) as e:
            print(f"| {label} | — | {path}: {e} | | | | | |")


if __name__ == "__main__":
    main()
