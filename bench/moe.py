"""Fused MoE layer (routed experts) on one GPU, peers side by side in one process:
  kestrel FusedMoE (sort/align + 2 grouped GEMM launches for all experts) in bf16, FP8 W8A8 and int4-g128 W4A16
  vs a per-expert cuBLAS bf16 loop (gather -> up -> SiLU·mul -> down -> weighted scatter-add; the index lists are
     precomputed and the whole loop captured in a CUDA graph, so it pays no host sync or launch gaps)
  vs Humming's MoE GEMM ("indexed" grouped GEMM, fp8 W8A8 and int4 W4A16) composed the same way (its sort/align
     runs outside the timed region: a Python loop in humming.testing; SiLU·mul and the weighted sum in torch).
Timed region: given x [M, H] and the router's top-k (weights, ids) -> output [M, H]. CUDA graph of 20 calls rotating
over --routings token batches with their own routings (other experts each call: the L2 stays cold, as across layers).
kestrel_<fmt>_us includes kestrel's sort/align; kestrel_<fmt>_noalign_us takes it precomputed (FusedMoE.plan), as
the peers' timed regions exclude theirs (Humming: metadata built before; loop: index lists built before);
kestrel_align_us is the sort/align alone.
Shapes: Qwen3-30B-A3B (128 experts, top-8), DeepSeek-V2-Lite (64, top-6), Mixtral-8x7B (8, top-2),
DeepSeek-V3 (256, top-8, H=7168). Output: raw JSON + markdown + PNG in --out.

  python bench/moe.py
  python bench/moe.py --models qwen3-30b-a3b --ms 1,64,4096 --formats bf16,fp8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gemm_w8a8 import LogRow, add_run_args, humming_build, log, past_deadline, rel, safe_us, start_run, write_report  # noqa: E402

from kestrel.kernels.moe_align import route_topk  # noqa: E402
from kestrel.kernels import moe_gemm  # noqa: E402
from kestrel.kernels.moe_gemm import quantize_experts  # noqa: E402
from kestrel.kernels.moe_layer import FusedMoE, ref_moe  # noqa: E402

MODELS = {  # experts, top_k, hidden, moe intermediate
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "deepseek-v3": (256, 8, 7168, 2048),
}
# name -> (weight fmt, activation fmt, kernel layout, planar); int4 = W4A16 in the WNA16 planar layout (moe_mv
# kernel), int4h = the byte-packed "halves" layout (lowbit_gemm kernel), int4p = the interchange "pairs" packing
FMT = {"bf16": ("bf16", "bf16", True, False), "fp8": ("fp8", "fp8", True, False), "int4": ("int4", "bf16", True, True),
       "int4h": ("int4", "bf16", True, False), "int4p": ("int4", "bf16", False, False)}
# int4tN = int4 with the layer's Gluon loop forced to KESTREL_MOE_TCG=N while it is called, int4t3b128 also with
# KESTREL_MOE_TCG_BM=128 (moe_gemm's globals, set around each format's calls: the loops are timed side by side in
# one process on the same quantized weights)
TCG_MODES = {"int4t2": {"USE_TCG": "2"}, "int4t3": {"USE_TCG": "3"}, "int4t3b128": {"USE_TCG": "3", "TCG_BM": "128"},
             "int4t3b64": {"USE_TCG": "3", "TCG_BM": ""}, "int4t4": {"USE_TCG": "4"}, "int4t5": {"USE_TCG": "5"}, "int4t4b64": {"USE_TCG": "4", "TCG_BM": ""},
             # session 10: the WS loop with 80 / 96-row blocks (64 + 16 / 32 rows); int4t5s9 = session 9's default
             # (WS with the fenced release for <= 64-row blocks, 128-row tcgp above 192 slots per expert)
             "int4t5b80": {"USE_TCG": "5", "TCG_BM": "80"}, "int4t5b96": {"USE_TCG": "5", "TCG_BM": "96"},
             "int4t5b64": {"USE_TCG": "5", "TCG_BM": ""},
             "int4t5s9": {"USE_TCG": "5", "TCG_BM": "128", "TCG_WS": 1},
             # session 11: the WS loop without the register-A race (TcgConfig.LOOP 2, row halves), default blocks
             # / 64 / 80 / 96 rows
             "int4t5l2": {"USE_TCG": "5", "TCG_LOOP": 2}, "int4t5b64l2": {"USE_TCG": "5", "TCG_BM": "", "TCG_LOOP": 2},
             "int4t5b80l2": {"USE_TCG": "5", "TCG_BM": "80", "TCG_LOOP": 2},
             "int4t5b96l2": {"USE_TCG": "5", "TCG_BM": "96", "TCG_LOOP": 2},
             "int4t3b128l2": {"USE_TCG": "3", "TCG_BM": "128", "TCG_LOOP": 2},
             "int4t3b64l2": {"USE_TCG": "3", "TCG_BM": "", "TCG_LOOP": 2},
             "int4t4b64l2": {"USE_TCG": "4", "TCG_BM": "", "TCG_LOOP": 2}}
FMT.update({f: FMT["int4"] for f in TCG_MODES})
HUMMING = {"fp8": ({"dtype": "float8e4m3"}, {"dtype": "float8e4m3"}),
           "int4": ({"dtype": "int4", "group_size": 128}, None)}
# the Humming layer each is held to
HUMMING_OF = {"fp8": "fp8", "int4": "int4", "int4h": "int4", "int4p": "int4", **{f: "int4" for f in TCG_MODES}}


# both peers are timed without their sort / index-list building, so the fair kestrel column is *_noalign; the
# align-included ratio is listed too (kestrel's align is one or three launches inside the layer)
RATIOS = [(f"kestrel {f} vs {peer}{tag}", col, f"kestrel_{f}{suffix}_us")
          for f in ("bf16", "fp8", "int4", "int4h", "int4p", *TCG_MODES)
          for peer, col in (("per-expert cuBLAS bf16 loop", "cublas_loop_us"),
                            (f"Humming {HUMMING_OF.get(f, f)}", f"humming_{HUMMING_OF.get(f, f)}_us"))
          for tag, suffix in ((" (both excl. sort/align)", "_noalign"), (" (kestrel incl. align)", ""))]


class PerExpertDequant:
    """fp32 expert e of quantized weights on demand (what ref_moe indexes): DeepSeek-V3's dequantized experts
    would take 45 GB at once, one expert at a time stays small."""

    def __init__(self, ew):
        self.ew, self.shape = ew, ew.shape

    def __getitem__(self, e):
        from kestrel.kernels.moe_mv import PlanarW4
        p = self.ew.planar
        if p is None:
            return self.ew.dequantize()[e]
        return PlanarW4(p.qweight[e:e + 1], p.scales[e:e + 1], p.group).dequantize()[0]


def cublas_loop(x, topk_w, topk_ids, w13, w2):
    """per-expert bf16 loop with index lists computed up front (outside the timed region)."""
    E, I = w13.shape[0], w2.shape[-1]
    plan = []
    for e in range(E):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel():
            plan.append((e, tok, topk_w[tok, slot].to(torch.bfloat16)[:, None]))
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)

    def run():
        out.zero_()
        for e, tok, wt in plan:
            h = x[tok] @ w13[e].t()
            y = (F.silu(h[:, :I]) * h[:, I:]) @ w2[e].t()
            out.index_add_(0, tok, (y * wt).float())
        return out
    return run


def humming_moe(fmt, w13, w2, E, top_k):
    from humming.layer import HummingLayer
    wcfg, icfg = HUMMING[fmt]
    layers = []
    for W in (w13, w2):
        L = HummingLayer(shape_n=W.shape[1], shape_k=W.shape[2], weight_config=dict(wcfg),
                         input_config=dict(icfg) if icfg else None, num_experts=E, torch_dtype=torch.bfloat16).cuda()
        L.load_from_unquantized(W)
        L.transform()
        layers.append(L)
    return layers


def humming_forward(layers, x, topk_w, topk_ids, E, top_k):
    """build Humming's indexed-GEMM metadata for this batch, return a closure that runs the layer."""
    from humming.testing.data import generate_moe_tensors
    from humming.tune import get_heuristics_config
    M, H = x.shape
    I = layers[1].shape_k
    cc = {"gemm_type": "indexed"}
    meta = []
    for L in layers:
        cfg = get_heuristics_config(L.humming_config, shape_m=M * top_k, gemm_type="indexed")
        _, _, sid, eid, npad = generate_moe_tensors(topk_ids, E, "indexed", cfg["block_shape"][0])
        meta.append((cfg, sid, eid, npad))

    def run():
        (c1, s1, e1, n1), (c2, s2, e2, n2) = meta
        h = layers[0](x, sorted_ids=s1, expert_ids=e1, num_tokens_padded=n1, top_k=top_k, compute_config=cc,
                      tuning_config=c1)
        a = F.silu(h[:, :I]) * h[:, I:]
        y = layers[1](a, sorted_ids=s2, expert_ids=e2, num_tokens_padded=n2, top_k=1, compute_config=cc,
                      tuning_config=c2)
        return (y.view(M, top_k, H).float() * topk_w[..., None]).sum(1)
    run.cfgs = [{k: v if isinstance(v, (int, float, str, bool, list, tuple, type(None))) else str(v)
                 for k, v in c.items()} for c, *_ in meta]
    return run


def run_model(name, ms, fmts, rows, budget, routings=8, check_max_m=256, check_max_weights=1.5e9, loop=True):
    E, k, H, I = MODELS[name]
    log(f"== {name}: E={E} top{k} H={H} I={I}")
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    router = torch.randn(E, H, device="cuda", dtype=torch.bfloat16)
    ours, quant = {}, {}
    for f in fmts:
        wf, af, kl, pl = FMT[f]
        if FMT[f] not in quant:  # int4 / int4t2 / int4t3 share one quantized copy
            quant[FMT[f]] = (quantize_experts(w13, wf, kernel_layout=kl, planar=pl),
                             quantize_experts(w2, wf, kernel_layout=kl, planar=pl))
        ours[f] = FusedMoE(router, *quant[FMT[f]], k, af)
    hum = {}
    for h in dict.fromkeys(HUMMING_OF[f] for f in fmts if f in HUMMING_OF):
        layers = humming_build(f"{h} MoE layers", lambda: humming_moe(h, w13, w2, E, k), budget)
        if layers is not None:
            hum[h] = layers
    check = E * 2 * I * H < check_max_weights  # the fp32 reference loop is slow on big layers
    for M in ms:
        if past_deadline():
            break
        # R token batches with their own routings, timed in rotation: each call touches other experts, as the MoE
        # layers of consecutive transformer blocks do, so the L2 (50 MB) does not keep a decode step's experts warm
        xs = [torch.randn(M, H, device="cuda", dtype=torch.bfloat16) for _ in range(routings)]
        rts = [route_topk(xi @ router.t(), k) for xi in xs]
        x, (tw, ti) = xs[0], rts[0]
        r = LogRow(section=name, M=M, N=2 * I, K=H, E=E, top_k=k, routings=routings)
        if loop:
            r["cublas_loop_us"] = safe_us([cublas_loop(xi, a, b, w13, w2) for xi, (a, b) in zip(xs, rts)])
        for f in fmts:
            moe = ours[f]
            saved = {g: getattr(moe_gemm, g) for g in TCG_MODES.get(f, {})}
            for g, v in TCG_MODES.get(f, {}).items():  # read by moe_configs at each call (and graph capture)
                setattr(moe_gemm, g, v)
            try:
                from kestrel.kernels.moe_gemm import moe_configs
                r[f"kestrel_{f}_cfgs"] = [f"{type(c).__name__}{c.as_dict()}" for c in
                                          moe_configs(M, k, E, moe.act, moe.w13, moe.w2)]
                y = moe(x, (tw, ti))
                if M <= check_max_m and check:  # the reference loop is slow at large M; correctness shown at small M
                    ref = ref_moe(x, tw, ti, PerExpertDequant(moe.w13), PerExpertDequant(moe.w2), moe.act)
                    r[f"{f}_err_vs_dequant"] = rel(y, ref)
                r[f"kestrel_{f}_us"] = safe_us([lambda moe=moe, xi=xi, rt=rt: moe(xi, rt) for xi, rt in zip(xs, rts)])
                # sort/align outside the timed region, as Humming's and the loop's are
                plans = [moe.plan(rt[1]) for rt in rts]
                r[f"kestrel_{f}_noalign_us"] = safe_us([lambda moe=moe, xi=xi, rt=rt, pl=pl: moe(xi, rt, align=pl)
                                                        for xi, rt, pl in zip(xs, rts, plans)])
                if f == fmts[0]:
                    r["kestrel_align_us"] = safe_us([lambda moe=moe, rt=rt: moe.plan(rt[1]) for rt in rts])
            except Exception as ex:
                traceback.print_exc()
                r[f"kestrel_{f}_error"] = repr(ex)[:200]
            finally:
                for g, v in saved.items():
                    setattr(moe_gemm, g, v)
            h = HUMMING_OF.get(f)
            if h in hum and f"humming_{h}_us" not in r:
                try:
                    runs = [humming_forward(hum[h], xi, a, b, E, k) for xi, (a, b) in zip(xs, rts)]
                    if M <= check_max_m and check:
                        r[f"humming_{h}_err_vs_bf16"] = rel(runs[0](), ref_moe(x, tw, ti, w13, w2))
                    r[f"humming_{h}_cfgs"] = runs[0].cfgs  # its heuristic's tiles (up, down)
                    r[f"humming_{h}_us"] = safe_us(runs)
                except Exception as ex:
                    traceback.print_exc()
                    r[f"humming_{h}_error"] = repr(ex)[:200]
        rows.append(r)
        log("ROW", json.dumps(r))
    del ours, hum, w13, w2
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {','.join(MODELS)}")
    p.add_argument("--ms", default="1,16,64,256,1024,4096", help="comma list of token counts M")
    p.add_argument("--formats", default="bf16,fp8,int4",
                   help="comma list of bf16,fp8,int4,int4h,int4p,int4t2,int4t3 (int4* = W4A16 g128: planar / halves / "
                        "pairs; int4tN(b128): planar with KESTREL_MOE_TCG=N (KESTREL_MOE_TCG_BM=128))")
    p.add_argument("--humming-models", default="qwen3-30b-a3b,mixtral-8x7b",
                   help="models on which Humming runs too (its JIT costs ~10 s per layer and format)")
    p.add_argument("--routings", type=int, default=8, help="distinct token batches / routings timed in rotation")
    p.add_argument("--check-max-m", type=int, default=256, help="check vs the fp32 per-expert loop up to this M")
    p.add_argument("--check-max-weights", type=float, default=1.5e9,
                   help="check only layers of fewer up-projection weights (E x 2I x H) than this")
    p.add_argument("--no-loop", action="store_true", help="skip the per-expert cuBLAS loop (A/B runs of our formats)")
    add_run_args(p, budget_s=240)
    args = p.parse_args()
    meta = start_run(args, "bench/moe.py")
    log(meta)
    ms = [int(v) for v in args.ms.split(",")]
    fmts = args.formats.split(",")
    hm = set(args.humming_models.split(","))
    rows = []
    for name in args.models.split(","):
        if past_deadline():
            break
        try:
            run_model(name, ms, fmts, rows, args.budget_s if name in hm else -1, args.routings, args.check_max_m,
                      args.check_max_weights, loop=not args.no_loop)
        except Exception:
            traceback.print_exc()
        write_report(rows, args.out, meta, stem="moe", ratios=RATIOS)


if __name__ == "__main__":
    main()
