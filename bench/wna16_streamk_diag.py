"""Which tiles of the stream-K swap kernel (cfg.streamk) are wrong: per output tile, its role in the schedule
(data-parallel / stream-K covered by one range / summed over n ranges) and its error vs x @ dequantize(W)^T.
For the 128x128 NaN of session 9 R1 (128x256 was right on every point).

  python bench/wna16_streamk_diag.py --format int4 --shape 10240,8192 --m 256 --configs 128,128,8,4,1 128,256,8,3,1
config: block_m,block_n,num_warps,num_stages,streamk (1 = ticketed sum, 2 = fp32 atomics; session 9 R2 ran
an extra 'fresh mbarriers per tile' form as 2 and the atomics as 3)
"""
from __future__ import annotations

import argparse
import collections

import torch

from kestrel.kernels.configs import ComputeConfig, LayerConfig
from kestrel.kernels.gemm_wna16_tcg import _num_sms, gemm_wna16_tcg
from kestrel.kernels.gemm_wna16_tcg_streamk import plan
from kestrel.kernels.tuning import FORMATS, make_weights
from kestrel.quant import dequantize


def roles(tiles: int, steps: int, sms: int) -> list[str]:
    progs, n_dp, per, _ = plan(tiles, steps, sms)
    out = ["dp"] * n_dp
    for u in range(tiles - n_dp):
        first, last = u * steps // per, ((u + 1) * steps - 1) // per
        out.append(f"sk{last - first + 1}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="int4")
    ap.add_argument("--shape", default="10240,8192")
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--configs", nargs="+", default=["128,128,8,4,1"])
    ap.add_argument("--unchecked", action="store_true", help="also run configs valid_for rejects (the wrong ones)")
    a = ap.parse_args()
    n, k = (int(v) for v in a.shape.split(","))
    layer = LayerConfig(FORMATS[a.format], n, k)
    w = make_weights(layer, "cuda", min_bytes=0, max_copies=1)[0]
    x = torch.randn(a.m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ dequantize(w).float().t()
    for c in a.configs:
        bm, bn, nw, st, sk = (int(v) for v in c.split(","))
        cfg = ComputeConfig("tcg", bm, bn, 0, 1, nw, st, swap=True, streamk=sk)
        if not cfg.valid_for(layer) and not a.unchecked:
            print(f"DIAG {a.format} {n}x{k} M={a.m} {c}: not valid")
            continue
        nm = -(-a.m // bm)
        role = roles(nm * (n // bn), k // 128, _num_sms(x.device))
        for rep in range(2):
            y = gemm_wna16_tcg(x, w, cfg).float()  # not gemm_wna16: it refuses what valid_for rejects
            bad = collections.Counter()
            tot = collections.Counter(role)
            first = []
            for t, r in enumerate(role):
                om, on = (t % nm) * bm, (t // nm) * bn
                yt, rt = y[om:om + bm, on:on + bn], ref[om:om + bm, on:on + bn]
                e = ((yt - rt).norm() / rt.norm()).item()
                if not e < 0.01:
                    bad[r] += 1
                    if len(first) < 6:
                        first.append((t, r, round(e, 4) if e == e else "nan"))
            err = ((y - ref).norm() / ref.norm()).item()
            print(f"DIAG {a.format} {n}x{k} M={a.m} {bm}x{bn} w{nw} s{st} streamk={sk} call {rep}: err {err:.5f}; bad "
                  f"tiles by role {dict(bad)} of {dict(tot)}; first {first}", flush=True)


if __name__ == "__main__":
    main()
