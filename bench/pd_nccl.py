"""Prefill/decode disaggregation across two GPUs vs one GPU: TTFT and ITL for the same request stream.

single: one engine on cuda:0 does prefills and decodes (chunked prefill mixes them into the same steps).
pd:     rank 0 (cuda:0) only prefills: each prompt's KV blocks go GPU->GPU over NCCL (kestrel/engine/
        kv_transfer_nccl.py) to rank 1 (cuda:1), which puts them in its prefix cache, admits the request and
        decodes; so decode steps never wait behind a long prefill. TTFT is measured at the decode engine's first
        token (it recomputes only the prompt's last partial block), i.e. it includes the prefill, the transfer and
        the queueing on both sides.

Requests arrive as a Poisson stream (--rate req/s; 0 = all at once), prompts of --prompt-len random tokens,
--output-len tokens each (ignore_eos). Reported per mode: TTFT mean/p50/p99, ITL mean/p50/p99, output tok/s.

    python bench/pd_nccl.py --model-shape llama-3-8b --num-requests 64 --prompt-len 2048 --output-len 128 \
        --rate 4 --out bench/results/pd_nccl_h200x2.md
    python bench/pd_nccl.py --device cpu --dtype float32 --model-shape '{"num_hidden_layers": 2, "hidden_size": 128, \
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, \
        "vocab_size": 1000}' --num-requests 6 --prompt-len 40 --output-len 8 --kv-cache-gb 0.05   # CPU smoke (gloo)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from kestrel.model.parallel import apply_nccl_env  # noqa: E402


def _engine(args, device: str):
    from kestrel.engine import EngineConfig, LLMEngine

    shape = json.loads(args.model_shape) if args.model_shape.lstrip().startswith("{") else args.model_shape
    return LLMEngine(EngineConfig(load_format="dummy", model_shape=shape, dtype=args.dtype, device=device,
                                  kv_cache_gb=args.kv_cache_gb, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens, progress=False))


def _workload(args, vocab: int):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_requests)]
    # seeded exponential gaps (both P/D ranks must derive the same arrival times)
    gaps = (-torch.rand(args.num_requests, generator=g).log() / args.rate).tolist() if args.rate > 0 \
        else [0.0] * args.num_requests
    offsets, t = [], 0.0
    for d in gaps:
        offsets.append(t)
        t += d
    return prompts, offsets


def _record(outs, t_tok: dict, now: float):
    for o in outs:
        t_tok.setdefault(o.request_id, []).append(now)


def run_single(args) -> dict:
    from kestrel.engine import SamplingParams

    eng = _engine(args, "cuda:0" if args.device == "cuda" else "cpu")
    prompts, offsets = _workload(args, eng.model_config.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    t0, nxt, arrival, t_tok = time.time(), 0, {}, {}
    while nxt < len(prompts) or eng.has_unfinished():
        now = time.time()
        while nxt < len(prompts) and now - t0 >= offsets[nxt]:
            eng.add_request(str(nxt), prompts[nxt], params)
            arrival[str(nxt)] = t0 + offsets[nxt]
            nxt += 1
        if eng.has_unfinished():
            outs = eng.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            _record(outs, t_tok, time.time())
        else:
            time.sleep(0.0005)
    return _summary("single", arrival, t_tok, time.time() - t0)


def _pd_rank(rank: int, init_method: str, queue, args, notify) -> None:
    import torch.distributed as dist

    from kestrel.engine import SamplingParams
    from kestrel.engine.kv_transfer_nccl import recv_prefix_blocks, send_prefix_blocks
    from kestrel.model.parallel import destroy_distributed, init_distributed

    try:
        _, dev = init_distributed(rank, 2, init_method, args.device)
        eng = _engine(args, str(dev))
        prompts, offsets = _workload(args, eng.model_config.vocab_size)
        dist.barrier()
        t0 = time.time()  # both ranks share the host clock
        if rank == 0:  # prefill only: one token, then ship the prompt's blocks
            one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            nxt = 0
            while nxt < len(prompts) or eng.has_unfinished():
                now = time.time()
                while nxt < len(prompts) and now - t0 >= offsets[nxt]:
                    eng.add_request(str(nxt), prompts[nxt], one)
                    nxt += 1
                if not eng.has_unfinished():
                    time.sleep(0.0005)
                    continue
                for o in eng.step():
                    if o.finished:  # tell the decode rank which request comes, then send its blocks
                        i = int(o.request_id)
                        notify.put(i)
                        send_prefix_blocks(eng, prompts[i], dst=1)
            notify.put(-1)
        else:  # decode: admit requests as their blocks land, step continuously
            import queue as queue_mod

            params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            arrival, t_tok, done = {}, {}, False
            while not done or eng.has_unfinished():
                while not done:  # the notice arrives on a host queue: a pending recv cannot be polled on gloo
                    try:
                        i = notify.get_nowait() if eng.has_unfinished() else notify.get(timeout=0.05)
                    except queue_mod.Empty:
                        break
                    if i < 0:
                        done = True
                        break
                    recv_prefix_blocks(eng, 0)
                    eng.add_request(str(i), prompts[i], params)
                    arrival[str(i)] = t0 + offsets[i]
                if eng.has_unfinished():
                    outs = eng.step()
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    _record(outs, t_tok, time.time())
            summary = _summary("pd", arrival, t_tok, time.time() - t0)
            summary["prefix_hit_tokens"] = eng.stats()["prefix_cache_hits"]  # prompt tokens served by sent blocks
            queue.put(("ok", summary))
        destroy_distributed()
    except BaseException as e:
        import traceback
        queue.put(("error", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
        raise


def run_pd(args) -> dict:
    import torch.multiprocessing as mp

    from kestrel.model.parallel.distributed import spawn_ranks

    notify = mp.get_context("spawn").Queue()  # prefill rank -> decode rank: request i's blocks have been sent
    return spawn_ranks(_pd_rank, 2, (args, notify), timeout=args.timeout)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _summary(mode, arrival, t_tok, wall) -> dict:
    ttft = [t_tok[r][0] - arrival[r] for r in arrival if r in t_tok]
    itl = [b - a for r in t_tok for a, b in zip(t_tok[r], t_tok[r][1:])]
    ntok = sum(len(v) for v in t_tok.values())
    ms = lambda xs: [1e3 * x for x in xs]  # noqa: E731
    return dict(mode=mode, requests=len(ttft), ttft_ms_mean=statistics.fmean(ms(ttft)),
                ttft_ms_p50=_pct(ms(ttft), 0.5), ttft_ms_p99=_pct(ms(ttft), 0.99),
                itl_ms_mean=statistics.fmean(ms(itl)) if itl else float("nan"), itl_ms_p50=_pct(ms(itl), 0.5),
                itl_ms_p99=_pct(ms(itl), 0.99), output_tok_s=ntok / wall)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", default="llama-3-8b", help="known shape name or JSON of ModelConfig fields")
    ap.add_argument("--mode", default="single,pd", help="comma-separated: single, pd (default: %(default)s)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second; 0 = all at once")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="chunked-prefill budget per step")
    ap.add_argument("--kv-cache-gb", type=float, default=40.0, help="KV cache per engine")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL between cuda:0 and cuda:1")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=None, help="write a markdown report here (bench/results/...)")
    args = ap.parse_args(argv)
    modes = args.mode.split(",")
    if args.device == "cuda":
        apply_nccl_env()
        if "pd" in modes and torch.cuda.device_count() < 2:
            ap.error(f"--mode pd needs 2 GPUs, {torch.cuda.device_count()} visible")
    rows = [run_single(args) if m == "single" else run_pd(args) for m in modes]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    for r in rows:
        r.setdefault("prefix_hit_tokens", "")
    table = "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] +
                      ["| " + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
                       for r in rows])
    print(table)
    if args.out:
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        with open(args.out, "w") as f:
            f.write(f"# Prefill/decode disaggregation over NCCL, {args.model_shape}\n\n"
                    f"- date: {datetime.date.today()}\n"
                    f"- device: {torch.cuda.device_count() if args.device == 'cuda' else 0} x {gpu}\n"
                    f"- command: `python {' '.join(sys.argv)}`\n\n{table}\n\nRaw:\n\n```json\n"
                    f"{json.dumps(rows, indent=1)}\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
