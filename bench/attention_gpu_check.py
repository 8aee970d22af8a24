"""GPU self-check of the serving path (run on the device before benchmarking; prints PASS/FAIL lines):
1. Triton paged prefill/decode/SWA kernels in bf16 at Llama-3-8B head shapes vs a float64 PyTorch reference;
2. a small dummy model decoding greedily: CUDA-graph replay vs eager (same kernels) vs the engine's PyTorch
   attention backend, token for token; also with int4-g128 QuantLinear inside the graph;
3. decode-kernel time vs its KV bytes at long contexts (split-KV on and off)."""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kestrel.engine.attention import TorchAttentionBackend, build_metadata  # noqa: E402
from kestrel.engine.cuda_graphs import DecodeCudaGraphs, _GraphDecodeCtx  # noqa: E402
from kestrel.engine.model_runner import ForwardContext  # noqa: E402
from kestrel.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from kestrel.model.dummy import build_dummy_model, dummy_config  # noqa: E402
from kestrel.model.quantize import quantize_model  # noqa: E402

FAILS = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def ref_attn(q, k, v, q_pos, scale, window):
    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, 1)
    v = v.double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) * scale
    kp = torch.arange(k.shape[0], device=q.device)
    vis = kp[None, :] <= q_pos[:, None]
    if window:
        vis &= q_pos[:, None] - kp[None, :] < window
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s.masked_fill(~vis[None], -math.inf), -1), v)


def kernels_vs_reference():
    dev, bs, H, Hkv, D = "cuda", 16, 32, 8, 128
    for window in (0, 100):
        ctx_lens, q_lens = [1, 300, 1000, 77], [1, 45, 130, 77]
        nb = sum(-(-c // bs) for c in ctx_lens) + 4
        kc = torch.randn(nb, bs, Hkv, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        perm = torch.randperm(nb, device=dev).to(torch.int32)
        maxb = max(-(-c // bs) for c in ctx_lens)
        tables = torch.zeros(len(ctx_lens), maxb, dtype=torch.int32, device=dev)
        i = 0
        for s, c in enumerate(ctx_lens):
            n = -(-c // bs)
            tables[s, :n] = perm[i:i + n]
            i += n
        seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
        scale = D ** -0.5

        def gather(c, s, n):
            p = torch.arange(n, device=dev)
            return c[tables[s, p // bs].long(), p % bs]
        for splits in (1, 8):
            q = torch.randn(len(ctx_lens), H, D, device=dev, dtype=torch.bfloat16)
            out = paged_decode_attention(q, kc, vc, tables, seq_lens, scale, window=window, num_splits=splits)
            err = max(((out[s:s + 1].double() - r).norm() / r.norm()).item() for s, n in enumerate(ctx_lens)
                      for r in [ref_attn(q[s:s + 1], gather(kc, s, n), gather(vc, s, n),
                                         torch.tensor([n - 1], device=dev), scale, window)])
            check(f"decode bf16 window={window} splits={splits}", err < 2e-2, f"rel err {err:.2e}")
        cu = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
        q = torch.randn(int(cu[-1]), H, D, device=dev, dtype=torch.bfloat16)
        out = paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, scale, max_q_len=max(q_lens), window=window)
        err = 0.0
        for s, (c, n) in enumerate(zip(ctx_lens, q_lens)):
            r = ref_attn(q[cu[s]:cu[s + 1]], gather(kc, s, c), gather(vc, s, c), torch.arange(c - n, c, device=dev),
                         scale, window)
            err = max(err, ((out[cu[s]:cu[s + 1]].double() - r).norm() / r.norm()).item())
        check(f"prefill bf16 window={window} (prefix-cached)", err < 2e-2, f"rel err {err:.2e}")


@torch.inference_mode()
def graph_decode_matches(quant):
    cfg, _ = dummy_config(dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=512))
    model = build_dummy_model(cfg, torch.bfloat16, "cuda", seed=3, std=0.08)
    quantize_model(model, quant)
    bs, B, P, N = 16, 3, 37, 12
    nblk = -(-(P + N + 1) // bs)
    args = (cfg.num_hidden_layers, B * nblk + 1, bs, 8, 2, 32, torch.bfloat16, "cuda", None)
    ref = TorchAttentionBackend(*args)
    tables = [[1 + b * nblk + j for j in range(nblk)] for b in range(B)]
    prompt = torch.randint(0, 512, (B, P), device="cuda")
    meta, positions = build_metadata([], [(0, P, t) for t in tables], bs, None, "cuda")
    h = model(prompt.reshape(-1), torch.tensor(positions, device="cuda"), ForwardContext(ref, meta))
    first = model.compute_logits(h.view(B, P, -1)[:, -1]).argmax(-1)
    # reference continuation (teacher-forced on its own greedy tokens): engine's PyTorch backend, eager
    k0 = [k.clone() for k in ref.k_cache]
    v0 = [v.clone() for v in ref.v_cache]
    inputs, ref_logits, ids = [], [], first.clone()
    for t in range(N):
        meta, positions = build_metadata([(P + t + 1, tb) for tb in tables], [], bs, None, "cuda")
        inputs.append(ids)
        lg = model.compute_logits(model(ids, torch.tensor(positions, device="cuda"), ForwardContext(ref, meta))).float()
        ref_logits.append(lg)
        ids = lg.argmax(-1)
    # the same steps through the captured graphs (bucket 4 for 3 sequences: one padding row) and eagerly
    graphs = DecodeCudaGraphs(model, k0, v0, max_num_seqs=4, max_blocks_per_seq=nblk + 2, batch_sizes=[1, 4])
    graphs.capture(progress=False)
    tb = torch.tensor(tables, dtype=torch.int32, device="cuda")
    worst_g = worst_e = 0.0
    agree = 0
    for t in range(N):
        p = torch.full((B,), P + t, device="cuda")
        slots = tb.long()[torch.arange(B, device="cuda"), p // bs] * bs + p % bs
        lens = (p + 1).to(torch.int32)
        ctx = _GraphDecodeCtx(k0, v0, [0] * cfg.num_hidden_layers, 32 ** -0.5, slots, tb, lens, 2)
        eager = model.compute_logits(model(inputs[t], p, ctx)).float()  # writes the same K/V the graph will
        lg = graphs.run(inputs[t], p, slots, tb, lens).float()
        worst_g = max(worst_g, ((lg - ref_logits[t]).norm() / ref_logits[t].norm()).item())
        worst_e = max(worst_e, ((lg - eager).norm() / eager.norm()).item())
        agree += int(torch.equal(lg.argmax(-1), ref_logits[t].argmax(-1)))
    check(f"[{quant}] graph decode vs PyTorch attention backend", worst_g < 3e-2 and agree >= N - 1,
          f"max rel err {worst_g:.2e}, argmax agree {agree}/{N}")
    check(f"[{quant}] graph replay vs eager (same kernels)", worst_e < 1e-2, f"max rel err {worst_e:.2e}")


def decode_kernel_speed():
    from triton.testing import do_bench
    dev, bs, Hkv, D = "cuda", 16, 8, 128
    for B, ctx in ((1, 4096), (1, 32768), (32, 4096)):
        nb = B * ctx // bs
        kc = torch.randn(nb, bs, Hkv, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = torch.randperm(nb, device=dev, dtype=torch.int32).view(B, -1)
        q = torch.randn(B, 32, D, device=dev, dtype=torch.bfloat16)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        kv_bytes = 2 * kc.numel() * 2
        for splits in (1, max(1, min(64, 264 // (B * Hkv)))):
            t = do_bench(lambda: paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, num_splits=splits),
                         warmup=10, rep=50, return_mode="median") / 1e3
            print(f"decode kernel B={B} ctx={ctx} splits={splits}: {t * 1e6:.1f} us, {kv_bytes / t / 1e12:.2f} TB/s of KV",
                  flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    kernels_vs_reference()
    for qz in ("none", "int4-g128"):
        try:
            graph_decode_matches(qz)
        except Exception as ex:
            check(f"[{qz}] graph decode ran", False, f"{type(ex).__name__}: {ex}")
    decode_kernel_speed()
    print("SELF-CHECK", "FAILED: " + ", ".join(FAILS) if FAILS else "ALL PASS", flush=True)
