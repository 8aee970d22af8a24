"""bench/wna16_decode_sweep.py json -> markdown table (µs, x Humming, x cuBLAS, % of copy) and, with --cache, the
per-shape winners written into a tune-cache file for the M <= 16 buckets (M = 1 -> bucket 1, 4 -> 2 and 4,
16 -> 8 and 16: mv pads M to 16, so bucket 8 takes the M = 16 winner).

  python bench/wna16_decode_report.py sweep.json --pdl 1 [--cache kestrel/kernels/tune_cache_h200.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys

BUCKETS = {1: (1,), 4: (2, 4), 16: (8, 16)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--pdl", type=int, default=1, help="pick winners among runs with PDL on (1) or off (0)")
    ap.add_argument("--cache", default=None, help="tune-cache json to update with the winners")
    ap.add_argument("--source", default="bench/wna16_decode_sweep.py H200")
    args = ap.parse_args()
    d = json.load(open(args.json))
    bw = d["copy_TBps"]
    groups = collections.defaultdict(list)
    for r in d["rows"]:
        groups[(r["fmt"], r.get("layer", ""), r["N"], r["K"], r["M"])].append(r)
    print(f"GPU {d['gpu']}, {d['date']}, copy {bw:.3f} TB/s, command `{d['command']}`\n")
    print("| fmt | layer | M | Humming µs | cuBLAS µs | kestrel before µs (default, no PDL) | kestrel µs | "
          "config | x Humming | x cuBLAS | % copy | x before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = collections.defaultdict(lambda: collections.defaultdict(list))
    entries = {}
    for (fmt, layer, n, k, m), rs in groups.items():
        hum = next((r["us"] for r in rs if r["kind"] == "humming"), None)
        cub = next((r["us"] for r in rs if r["kind"] == "cublas"), None)
        ok = [r for r in rs if r["kind"] == "kestrel" and r["err"] < 1e-2]
        before = next((r for r in ok if r["default"] and not r["pdl"]), None)
        dflt_pdl = next((r for r in ok if r["default"] and r["pdl"]), None)
        pool = [r for r in ok if bool(r["pdl"]) == bool(args.pdl)]
        if not pool:
            continue
        best = min(pool, key=lambda r: r["us"])
        c = best["config"]
        desc = f"{c['kernel']} bn{c['block_n']} w{c['num_warps']} sk{c['split_k']} pf{c.get('prefetch', 0)}" + (
            " pdl" if best["pdl"] else "")
        tb = lambda us: 100 * r["w_bytes"] / (us * 1e-6) / 1e12 / bw
        r = best
        f = lambda v, p=1: "" if v is None else f"{v:.{p}f}"
        print(f"| {fmt} | {layer} | {m} | {f(hum)} | {f(cub)} | {f(before and before['us'])} | {best['us']:.1f} | "
              f"{desc} | {f(hum and hum / best['us'], 2)} | {f(cub and cub / best['us'], 2)} | {tb(best['us']):.0f} | "
              f"{f(before and before['us'] / best['us'], 2)} |")
        if hum:
            ratios[(fmt, m)]["best"].append(hum / best["us"])
            if before:
                ratios[(fmt, m)]["before"].append(hum / before["us"])
            if dflt_pdl:
                ratios[(fmt, m)]["default+pdl"].append(hum / dflt_pdl["us"])
        ratios[(fmt, m)]["copy"].append(tb(best["us"]))
        for b in BUCKETS.get(m, ()):
            entries[f"{d['gpu']}|{best['spec_name'] if 'spec_name' in best else spec_name(fmt)}|n{n}|k{k}|m{b}"] = {
                "config": c, "us": round(best["us"], 3), "source": f"{args.source} {d['date']} (M={m} winner"
                + (", PDL on" if best["pdl"] else "") + ")"}
    print("\n| fmt | M | x Humming before (min / median / max) | default + PDL | best (tuned) | % copy (min / max) |")
    print("|---|---|---|---|---|---|")
    for (fmt, m), v in sorted(ratios.items()):
        s = lambda xs: f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"
        print(f"| {fmt} | {m} | {s(v['before'])} | {s(v['default+pdl'])} | {s(v['best'])} | "
              f"{min(v['copy']):.0f} / {max(v['copy']):.0f} |")
    if args.cache:
        cache = json.load(open(args.cache))
        cache.update(entries)
        with open(args.cache, "w") as fh:
            json.dump(cache, fh, indent=1, sort_keys=True)  # the format configs.store_cache writes
        print(f"\nwrote {len(entries)} entries to {args.cache}", file=sys.stderr)


def spec_name(fmt: str) -> str:
    sys.path.insert(0, ".")
    from kestrel.kernels.tuning import FORMATS
    return FORMATS[fmt].name


if __name__ == "__main__":
    main()
