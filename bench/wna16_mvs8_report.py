"""wna16_mvs8_sweep.py json -> markdown table per (format, layer, M): the default config, the best variant (module
defaults, FOLD_E8M0 on), their ratio, % of copy bandwidth, and x Humming: same process where the sweep timed Humming,
else from --humming-json (bench/gemm_wna16.py result files of another process: marked "other process").

  python bench/wna16_mvs8_report.py sweep.json --humming-json bench/results/gemm_wna16_smallm_h200_s4r1.json ...
"""
from __future__ import annotations

import argparse
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep")
    ap.add_argument("--humming-json", nargs="*", default=[])
    args = ap.parse_args()
    res = json.load(open(args.sweep))
    other = {}
    for p in args.humming_json:
        for r in json.load(open(p))["rows"]:
            if "humming_us" in r:
                other[(r["fmt"], r["layer"], r["M"])] = r["humming_us"]
    pts = {}
    for r in res["rows"]:
        pts.setdefault((r["fmt"], r["layer"], r["M"]), []).append(r)
    print(f"GPU {res['gpu']}, {res['date']}, D2D copy {res['copy_TBps']:.3f} TB/s. `{res['command']}`\n")
    print("| fmt | layer | M | default µs | best, defaults | µs | best, FOLD | µs | x default | % copy | "
          "Humming µs | x Humming | wrong |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, rs in pts.items():
        ok = [r for r in rs if r["tag"] != "humming" and r["err"] < 1e-2]
        wrong = [r["tag"] for r in rs if r["tag"] != "humming" and not r["err"] < 1e-2]
        d = next((r for r in ok if r["tag"] == "dflt"), None)
        b0 = min((r for r in ok if r["fold"] is None), key=lambda r: r["us"], default=None)
        b2 = min((r for r in ok if r["fold"] == "fold"), key=lambda r: r["us"], default=None)
        best = min((b for b in (b0, b2) if b), key=lambda r: r["us"], default=None)
        h = next((r["us"] for r in rs if r["tag"] == "humming"), None)
        hs = f"{h:.2f}" if h else (f"{other[key]:.2f} (other process)" if key in other else "")
        hv = h or other.get(key)
        f = lambda r: (r["tag"], f"{r['us']:.2f}") if r else ("", "")
        if not (d and best):
            print(f"| {key[0]} | {key[1]} | {key[2]} | - | | | | | | | | | {', '.join(wrong)} |")
            continue
        xh = f"{hv / best['us']:.2f}" if hv else ""
        print(f"| {key[0]} | {key[1]} | {key[2]} | {d['us']:.2f} | {' | '.join(f(b0))} | {' | '.join(f(b2))} | "
              f"{d['us'] / best['us']:.3f} | {best['pct_copy']:.0f} | {hs} | {xh} | {', '.join(wrong)} |")

if __name__ == "__main__":
    main()
