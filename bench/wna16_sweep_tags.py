"""wna16_mvs8_sweep.py json -> one markdown row per (format, layer, M): the default's µs, Humming's (same process,
where timed) and every variant as µs (x default), columns by variant kind (the tile spelled out in the tag is
spelled as what differs from the point's default: "mv16 bn64 w1 sk3-imad2" -> "sk3-imad2", "mv16 bn128 w2 sk4" ->
"bn128 w2", "m1cfg mv16 ..." -> "m1cfg", "mv-fold" -> "dflt-fold").
Wrong results (rel err >= 1e-2) are marked "WRONG".

  python bench/wna16_sweep_tags.py wna16_mvs8_sweep.json
"""
from __future__ import annotations

import json
import re
import sys


def kind(r, d) -> str:
    """Column of a variant row r: what differs from its point's default row d (tile, split, stages) + its mode
    suffix ("-grow2", "-probe1", ...), e.g. "bn128 w2", "sk8-grow2", "s1", "dflt-fold"."""
    tag = r["tag"]
    if tag.startswith("m") and "cfg" in tag.split()[0]:
        return tag.split()[0]
    suffix = re.search(r"(-[a-z]\S*)$", tag)
    suffix = suffix.group(1) if suffix else ""
    c, dc = r.get("config") or {}, (d or {}).get("config") or {}
    parts = []
    if dc and (c.get("block_n"), c.get("num_warps")) != (dc.get("block_n"), dc.get("num_warps")):
        parts.append(f"bn{c.get('block_n')} w{c.get('num_warps')}")
    if dc and c.get("split_k") != dc.get("split_k"):
        parts.append(f"sk{c.get('split_k')}")
    if dc and c.get("num_stages") != dc.get("num_stages"):
        parts.append(f"s{c.get('num_stages')}")
    if dc and c.get("kernel") != dc.get("kernel"):
        parts.insert(0, f"{c.get('kernel')}{c.get('block_m')}")
    return (" ".join(parts) or "dflt") + suffix


def main():
    res = json.load(open(sys.argv[1]))
    pts, kinds = {}, []
    for r in res["rows"]:
        pts.setdefault((r["fmt"], r["layer"], r["M"]), []).append(r)
    for rs in pts.values():
        d = next((r for r in rs if r["tag"] == "dflt"), None)
        for r in rs:
            k = kind(r, d)
            if r["tag"] not in ("dflt", "humming") and k not in kinds:
                kinds.append(k)
    print(f"GPU {res['gpu']}, {res['date']}, D2D copy {res['copy_TBps']:.3f} TB/s, wall {res.get('wall_s', 0):.0f} s. "
          f"`{res['command']}`\n")
    print("| fmt | layer | M | default µs | default config | Humming µs | x Humming | " + " | ".join(kinds) + " |")
    print("|---" * (7 + len(kinds)) + "|")
    for (fmt, layer, m), rs in pts.items():
        d = next((r for r in rs if r["tag"] == "dflt"), None)
        h = next((r for r in rs if r["tag"] == "humming"), None)
        cells = {}
        for r in rs:
            if r["tag"] in ("dflt", "humming"):
                continue
            bad = "" if r["err"] < 1e-2 else " WRONG"
            ratio = f" ({d['us'] / r['us']:.3f}x)" if d else ""
            cells[kind(r, d)] = f"{r['us']:.2f}{ratio}{bad}"
        c = d["config"] if d else {}
        cfg = f"{c.get('kernel')} bn{c.get('block_n')} w{c.get('num_warps')} sk{c.get('split_k')}" if c else ""
        best = min([r["us"] for r in rs if r["tag"] != "humming" and r["err"] < 1e-2] or [0])
        xh = f"{h['us'] / best:.2f}" if h and best else ""
        print(f"| {fmt} | {layer} | {m} | {d['us']:.2f} | {cfg} | {h['us']:.2f} | {xh} | " if d and h else
              f"| {fmt} | {layer} | {m} | {d['us']:.2f} | {cfg} |  |  | " if d else f"| {fmt} | {layer} | {m} | - | | | | ",
              end="")
        print(" | ".join(cells.get(k, "") for k in kinds) + " |")


if __name__ == "__main__":
    main()
