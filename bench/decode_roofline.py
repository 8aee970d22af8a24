"""Batch-1 (and small-batch) decode speed against the memory roofline, dummy weights of a real model shape.

Roofline: a decode step must read every weight it uses (all linear layers + lm_head; one embedding row) and
the KV cache of the context, so step time >= (weight bytes + KV bytes) / bandwidth, with the bandwidth
measured here as a large device-to-device copy (bytes read + written / time). Reported: tok/s of kestrel's
decode (Triton paged attention, model linears as bf16 nn.Linear/cuBLAS or kestrel QuantLinear) eager, with a
CUDA graph, and with a CUDA graph + torch.compile'd small ops (rope, silu*mul), and the fraction of roofline.

    python bench/decode_roofline.py --model-shape llama-3-8b --quantization none,int4-g128 --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time
import types

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from gpu_timing import copy_bandwidth  # noqa: E402
from kestrel.engine.cuda_graphs import DecodeCudaGraphs, _GraphDecodeCtx
from kestrel.kernels.attention.backend import PagedAttention, PagedAttentionMetadata
from kestrel.model.dummy import build_dummy_model, dummy_config
from kestrel.model.quantize import quant_spec, quantize_model


def step_weight_bytes(model) -> int:
    """Bytes one decode step reads from the weights: everything but the embedding table (a gather of B rows);
    a tied lm_head reads the embedding matrix once as the output projection."""
    emb = model.embed_tokens.weight
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "rope" in name or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if t is emb and model.lm_head.weight is not emb:
            continue
        total += t.numel() * t.element_size()
    return total


def compile_small_ops(model):
    """torch.compile the elementwise chains between the GEMMs (rope, silu*mul), once each, shape-generic."""
    @torch.compile(dynamic=True)
    def rope(cos, sin, positions, q, k):
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        h = q.shape[-1] // 2

        def rot(x):
            return x * c + torch.cat([-x[..., h:], x[..., :h]], -1) * s
        return rot(q), rot(k)

    @torch.compile(dynamic=True)
    def silu_mul(gu, inter: int):
        return F.silu(gu[..., :inter]) * gu[..., inter:]

    model.rope.forward = types.MethodType(lambda self, p, q, k: rope(self.cos, self.sin, p, q, k), model.rope)
    for layer in model.layers:
        mlp = layer.mlp
        mlp.forward = types.MethodType(lambda self, x: self.down_proj(silu_mul(self.gate_up_proj(x), self.inter)), mlp)


@torch.inference_mode()
def run_case(model, cfg, batch: int, prompt_len: int, new_tokens: int, mode: str, block_size: int = 16,
             dev: str = "cuda", max_model_len: int = 8192) -> dict:
    dtype = next(model.parameters()).dtype
    max_len = prompt_len + new_tokens + 1
    blocks_per_seq = -(-max_len // block_size)
    attn = PagedAttention(cfg.num_hidden_layers, batch * blocks_per_seq + 1, block_size, cfg.num_key_value_heads,
                          cfg.head_dim, dtype, dev, cfg.head_dim ** -0.5)
    tables = (torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=dev) + 1).view(batch, blocks_per_seq)
    gen = torch.Generator(device=dev).manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=dev, generator=gen)
    # prefill (eager, varlen Triton prefill) fills the cache
    pos = torch.arange(prompt_len, device=dev).repeat(batch)
    slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device=dev)).view(batch, -1)[:, :prompt_len]
    attn.set_metadata(PagedAttentionMetadata(
        slot_mapping=slots.reshape(-1), block_tables=tables, seq_lens=torch.full((batch,), prompt_len, dtype=torch.int32, device=dev),
        is_decode=False, cu_seqlens_q=torch.arange(0, (batch + 1) * prompt_len, prompt_len, dtype=torch.int32, device=dev),
        max_q_len=prompt_len))
    hidden = model(prompt.reshape(-1), pos, attn)
    ids = model.compute_logits(hidden.view(batch, prompt_len, -1)[:, -1]).argmax(-1)

    pos = torch.full((batch,), prompt_len, dtype=torch.long, device=dev)
    seq_lens = (pos + 1).to(torch.int32)
    rows = torch.arange(batch, device=dev)

    def slots_of(p):
        return tables.long()[rows, p // block_size] * block_size + p % block_size

    if mode in ("eager", "profile"):
        splits = attn.decode_splits(batch, max(blocks_per_seq * block_size, max_model_len))

        def step(ids, pos, slots, seq_lens):
            ctx = _GraphDecodeCtx(attn.k_caches, attn.v_caches, attn.windows, attn.scale, slots, tables, seq_lens, splits)
            return model.compute_logits(model(ids, pos, ctx))
    else:
        # block tables as wide as the server's (max_model_len): the split-KV factor is chosen for that capacity
        graphs = DecodeCudaGraphs(model, attn.k_caches, attn.v_caches, max_num_seqs=batch,
                                  max_blocks_per_seq=max(blocks_per_seq, max_model_len // block_size),
                                  batch_sizes=[batch])
        t0 = time.perf_counter()
        graphs.capture(progress=False)
        capture_s = time.perf_counter() - t0

        def step(ids, pos, slots, seq_lens):
            return graphs.run(ids, pos, slots, tables, seq_lens)

    # warm-up steps (also JIT for eager), then the timed run continues the same sequences
    for _ in range(3):
        ids = step(ids, pos, slots_of(pos), seq_lens).argmax(-1)
        pos += 1
        seq_lens += 1
    if mode == "profile":
        return profile_step(lambda: step(ids, pos, slots_of(pos), seq_lens))
    if dev == "cuda":
        torch.cuda.synchronize()
    ctx_start = int(pos[0])
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        ids = step(ids, pos, slots_of(pos), seq_lens).argmax(-1)
        pos += 1
        seq_lens += 1
    int(ids[0])  # wait for the device: the whole loop was queued without a sync
    t = time.perf_counter() - t0
    mean_ctx = ctx_start + (new_tokens + 1) / 2
    kv_bytes = batch * 2 * cfg.num_hidden_layers * mean_ctx * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    out = dict(batch=batch, mode=mode, prompt_len=prompt_len, new_tokens=new_tokens, seconds=t,
               step_ms=t / new_tokens * 1e3, tok_s=batch * new_tokens / t, kv_bytes_per_step=kv_bytes)
    if mode != "eager":
        out["capture_s"] = capture_s
    del attn
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


KERNEL_GROUPS = (("attention", ("_decode_kernel", "_reduce_splits", "_store_kvcache")),
                 ("gemm", ("gemm", "gemv", "_dot_kernel", "cutlass", "nvjet", "sm90", "xmma", "splitk")),
                 ("norm", ("norm",)))


def profile_step(fn) -> dict:
    """Device time per kernel group of one eager decode step (kernel sums, no launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    groups, top, n = {}, {}, 0
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        us = ev.time_range.elapsed_us()
        name = ev.name
        n += 1
        g = next((g for g, keys in KERNEL_GROUPS if any(k in name.lower() or k in name for k in keys)), "other")
        groups[g] = groups.get(g, 0.0) + us
        top[name] = top.get(name, 0.0) + us
    tops = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    return dict(kernels=n, group_us=groups, top_us=[(k[:90], v) for k, v in tops],
                kernel_ms=sum(groups.values()) / 1e3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", default="llama-3-8b", help="shape name from kestrel/model/shapes.py")
    ap.add_argument("--quantization", default="none,int4-g128", help="comma-separated schemes (kestrel/model/quantize.py)")
    ap.add_argument("--batch-sizes", default="1", help="comma-separated decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=512, help="context tokens before decoding")
    ap.add_argument("--new-tokens", type=int, default=128, help="timed decode steps")
    ap.add_argument("--max-model-len", type=int, default=8192, help="context capacity the decode graph is built for")
    ap.add_argument("--modes", default="eager,graph,graph+compile", help="comma-separated: eager, graph, graph+compile, profile (kernel time per group of one eager step)")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_roofline needs a CUDA GPU")
    for q in args.quantization.split(","):
        quant_spec(q)  # fail fast on a bad name
    import triton
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), args=vars(args))
    bw = copy_bandwidth()["rw_TBps"] * 1e12  # bytes/s, read + write
    info["copy_bw_Bps"] = bw
    print(f"{info['gpu']}: device-to-device copy {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    cfg, moe = dummy_config(args.model_shape)
    rows = []
    for q in args.quantization.split(","):
        t0 = time.perf_counter()
        model = build_dummy_model(cfg, torch.bfloat16, "cuda", moe=moe)
        torch.cuda.synchronize()
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        quantize_model(model, q)
        torch.cuda.synchronize()
        quant_s = time.perf_counter() - t0
        wbytes = step_weight_bytes(model)
        print(f"[{q}] built in {build_s:.1f}s, quantized in {quant_s:.1f}s, weights read per step {wbytes / 1e9:.2f} GB",
              flush=True)
        compiled = False
        for mode in args.modes.split(","):
            if mode == "graph+compile" and not compiled:
                compile_small_ops(model)
                compiled = True
            for b in (int(x) for x in args.batch_sizes.split(",")):
                if mode == "profile":
                    try:
                        p = run_case(model, cfg, b, args.prompt_len, args.new_tokens, "profile",
                                     max_model_len=args.max_model_len)
                    except Exception as ex:
                        print(f"[{q}] profile FAILED {type(ex).__name__}: {ex}", flush=True)
                        continue
                    rows.append(dict(quantization=q, mode="profile", batch=b, **p))
                    print(f"[{q}] profile batch {b}: {p['kernels']} kernels, {p['kernel_ms']:.3f} ms of kernel time; "
                          + ", ".join(f"{g} {v / 1e3:.3f} ms" for g, v in sorted(p["group_us"].items())), flush=True)
                    for name, us in p["top_us"]:
                        print(f"    {us:9.1f} us  {name}", flush=True)
                    continue
                try:
                    r = run_case(model, cfg, b, args.prompt_len, args.new_tokens, "eager" if mode == "eager" else "graph",
                                 max_model_len=args.max_model_len)
                except Exception as ex:  # report and go on: one failing variant must not hide the others
                    print(f"[{q}] {mode} batch {b}: FAILED {type(ex).__name__}: {ex}", flush=True)
                    rows.append(dict(quantization=q, mode=mode, batch=b, error=f"{type(ex).__name__}: {ex}"))
                    continue
                r.update(quantization=q, mode=mode, weight_bytes_per_step=wbytes, build_s=build_s, quant_s=quant_s)
                roof_step = (wbytes + r["kv_bytes_per_step"]) / bw
                r["roofline_tok_s"] = b / roof_step
                r["frac_of_roofline"] = r["tok_s"] / r["roofline_tok_s"]
                rows.append(r)
                print(f"[{q}] {mode:14s} batch {b:3d}: {r['tok_s']:8.1f} tok/s  step {r['step_ms']:.3f} ms  "
                      f"roofline {r['roofline_tok_s']:8.1f} tok/s  -> {100 * r['frac_of_roofline']:.1f}%", flush=True)
        del model
        torch.cuda.empty_cache()
    print("\n| quantization | mode | batch | tok/s | step ms | roofline tok/s | % of roofline |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["mode"] == "profile":
            continue
        if "error" in r:
            print(f"| {r['quantization']} | {r['mode']} | {r['batch']} | failed: {r['error'][:60]} | | | |")
        else:
            print(f"| {r['quantization']} | {r['mode']} | {r['batch']} | {r['tok_s']:.1f} | {r['step_ms']:.3f} | "
                  f"{r['roofline_tok_s']:.1f} | {100 * r['frac_of_roofline']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
