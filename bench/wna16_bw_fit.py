"""Why small layers cannot reach the copy bandwidth: fit time = fixed + bytes / marginal bandwidth over the Llama
shapes of bench/gemm_wna16.py result files, per (peer, format, M) — least squares in µs vs MB. `fixed` is what every
call costs whatever its size inside the timing graph (launch, DRAM latency ramp, the last wave, split-K finish);
`marginal` is the rate at which extra weight bytes stream. A layer reaches a fraction f of the copy bandwidth C only
if bytes >= fixed / (1 / (f C) - 1 / marginal), and never if marginal <= f C.

  python bench/wna16_bw_fit.py bench/results/gemm_wna16_smallm_h200_s4r1.json [more.json] [--copy 4.222]
"""
from __future__ import annotations

import argparse
import json


def fit(points):
    """Least squares t = a + b * x over (x MB, t µs) -> (a µs, 1 / b TB/s)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (t - mt) for x, t in points) / sxx
    return mt - b * mx, 1 / b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--copy", type=float, default=None, help="copy TB/s (default: the files' meta)")
    ap.add_argument("--frac", type=float, default=0.85)
    args = ap.parse_args()
    pts, copy = {}, args.copy
    for p in args.json:
        res = json.load(open(p))
        copy = copy or res["meta"].get("copy_TBps") or res["meta"].get("copy_bw_TBps")
        for r in res["rows"]:
            for peer in ("kestrel", "humming"):
                if r.get(f"{peer}_us"):  # later files win per shape
                    pts.setdefault((peer, r["fmt"], r["M"]), {})[(r["N"], r["K"])] = (r["w_bytes"] / 1e6,
                                                                                     r[f"{peer}_us"])
    copy = copy or 4.222
    goal = args.frac * copy
    print(f"copy {copy:.3f} TB/s, goal {args.frac:.0%} = {goal:.2f} TB/s\n")
    print("| peer | fmt | M | shapes | fixed µs | marginal TB/s | marginal % copy | MB needed for the goal | "
          "largest layer MB | its % copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (peer, fmt, m), by in sorted(pts.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if len(by) < 3:
            continue
        a, bw = fit(list(by.values()))
        need = a / (1 / goal - 1 / bw) if bw > goal else float("inf")
        big = max(by.values())
        print(f"| {peer} | {fmt} | {m} | {len(by)} | {a:.1f} | {bw:.2f} | {100 * bw / copy:.0f} | "
              f"{'never' if need == float('inf') else f'{need:.0f}'} | {big[0]:.0f} | "
              f"{100 * big[0] / big[1] / copy:.0f} |")


if __name__ == "__main__":
    main()
