"""The grouped Gluon int4 MoE kernels (moe_tcg.py) on a Hopper GPU vs a per-slot fp64 loop on the dequantized
experts: the WS loop (the serving default) with 64 / 80 / 96-row expert blocks, the tcgp loop (64 x 256, 128 x 128)
and the persistent tcgp loop (64 x 256), each with its one-A K loop (LOOP 0) and the race-free two-wgmma loop
(LOOP 2), bf16 slot stores (up projection) and the routed fp32-atomic token sums (down projection). Gluon has no CPU
interpreter: skipped elsewhere."""
import pytest
import torch

from kestrel.kernels.moe_align import moe_align
from kestrel.kernels.moe_mv import planar_from_codes

moe_tcg = pytest.importorskip("kestrel.kernels.moe_tcg")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="Gluon wgmma kernels: Hopper GPU only")


def _case(M, k, E, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (E, N, K), generator=g)
    sc = torch.rand(E, N, K // 128, generator=g) * 0.02 + 0.005
    w = planar_from_codes(q, sc, 128)
    # the kernel's weights: (c - 8) * bf16(scale), rounded to bf16 once
    wd = (q.double() * sc.to(torch.bfloat16).double().repeat_interleave(128, -1)).to(torch.bfloat16).double()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, k, generator=g)
    tw = tw / tw.sum(-1, keepdim=True)
    return w, wd, ids, tw


def _rows_ok(got, ref):
    """every row finite and within bf16 rounding of the reference (a wrong tile shows as a bad row)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    assert torch.isfinite(got).all()
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
    assert rel.max().item() < 1e-2, (rel.max().item(), rel.argmax().item())
    assert ((got - ref).norm() / ref.norm()).item() < 4e-3


# the WS loop (WS 2, BN 256) and the plain tcgp loop (WS 0: 64 x 256 row halves, 128 x 128 K halves with LOOP 2)
# and the persistent tcgp loop (PERSIST 1 flat, 2 nested tile / K-step loop; 64 x 256)
PERSISTENT = [dict(BM=64, BN=256, WS=0, PERSIST=p, LOOP=loop) for p in (1, 2) for loop in (0, 2)]
CFGS = ([dict(BM=bm, BN=256, WS=2, LOOP=loop) for bm in (64, 80, 96) for loop in (0, 2)]
        + [dict(BM=bm, BN=bn, WS=0, LOOP=loop) for bm, bn in ((64, 256), (128, 128)) for loop in (0, 2)]
        + PERSISTENT)


def _cfg(c):
    return moe_tcg.TcgConfig(BM=c["BM"], BN=c["BN"], num_warps=8, num_stages=4, GROUP_M=8, SWAP=2, WS=c["WS"],
                             PERSIST=c.get("PERSIST", 0), LOOP=c["LOOP"])


def _up_slots(c, x, w, ids, E, N):
    """the up projection through the Gluon kernel: x @ W_e^T into each slot's row (NaN-filled first, so a row the
    kernel misses fails _rows_ok)."""
    cfg = _cfg(c)
    xc, wc = x.cuda(), w.to("cuda")
    assert moe_tcg.supports(xc, wc, cfg)
    M, k = ids.shape
    al = moe_align(ids.cuda(), E, cfg.BM)
    out = torch.full((M * k, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe_tcg.grouped_gemm_planar_tcg(xc, wc, al, M * k, k, out, cfg)
    return out


def _id(c):
    kind = "ws" if c["WS"] else {0: "tcgp", 1: "tcgq", 2: "tcgqn"}[c.get("PERSIST", 0)]
    return f"{kind}-bm{c['BM']}-bn{c['BN']}-loop{c['LOOP']}"


@pytest.mark.parametrize("c", CFGS, ids=_id)
@pytest.mark.parametrize("N", [512, 384])  # 384: a partial last N tile (masked scales, TMA zero fill)
def test_up_slot_store_vs_reference(c, N):
    M, k, E, K = 320, 2, 8, 1024  # 80 slots per expert (two 64-row blocks each); 8 K steps (the ring wraps)
    w, wd, ids, _ = _case(M, k, E, N, K, seed=N + c["BM"])
    x = torch.randn(M, K).to(torch.bfloat16)
    out = _up_slots(c, x, w, ids, E, N)
    ref = torch.stack([x[t // k].double() @ wd[ids.flatten()[t]].t() for t in range(M * k)])
    _rows_ok(out, ref)


@pytest.mark.parametrize("c", CFGS, ids=_id)
def test_down_routed_reduce_vs_reference(c):
    M, k, E, N, K = 320, 2, 8, 512, 768  # 6 K steps (Qwen3's down projection)
    w, wd, ids, tw = _case(M, k, E, N, K, seed=7 + c["BM"])
    cfg = _cfg(c)
    T = M * k
    h = torch.randn(T, K).to(torch.bfloat16)  # the slots' activations (silu(gate) * up)
    wc = w.to("cuda")
    al = moe_align(ids.cuda(), E, cfg.BM)
    out = torch.empty((M, N), device="cuda", dtype=torch.float32)
    moe_tcg.grouped_gemm_planar_tcg(h.cuda(), wc, al, T, 1, out, cfg, topk_weights=tw.flatten().cuda(), reduce_k=k)
    ids_f, tw_f = ids.flatten(), tw.flatten().double()
    ref = torch.stack([sum(tw_f[m * k + j] * (h[m * k + j].double() @ wd[ids_f[m * k + j]].t()) for j in range(k))
                       for m in range(M)])
    _rows_ok(out, ref)


@pytest.mark.parametrize("c", PERSISTENT, ids=_id)
def test_persistent_many_tiles_per_program(c):
    """the persistent loops with more tiles than SMs (the cases above give each program one tile at most): each
    program rolls its ring over tile ends (next tile's expert, columns, gathered rows, scales prefetched across
    the boundary) and runs the tile epilogue between steps. 24 blocks x 16 N tiles = 384 tiles on 132 SMs."""
    M, k, E, N, K = 640, 2, 8, 4096, 512  # 160 slots per expert (3 blocks of 64), 4 K steps a tile
    w, wd, ids, _ = _case(M, k, E, N, K, seed=11 + c["PERSIST"] + c["LOOP"])
    x = torch.randn(M, K).to(torch.bfloat16)
    out = _up_slots(c, x, w, ids, E, N)
    ref = torch.empty(M * k, N, dtype=torch.float64)
    slot_e = ids.flatten().long()
    for e in range(E):  # per expert: its slots' x rows @ its dequantized weights (fp64)
        sl = (slot_e == e).nonzero().flatten()
        ref[sl] = x[sl // k].double() @ wd[e].t()
    _rows_ok(out, ref)
