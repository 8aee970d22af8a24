"""Decode speed of tensor parallelism: TP=1 vs TP=2 (or any list) on dummy weights of a real model shape, one
process per GPU, through kestrel's TP step path (rank 0 broadcasts each step, every rank runs its shard, NCCL
all-reduce after o_proj and down_proj, all-gather of the vocab-parallel logits).

Per TP size and batch size: prefill `--prompt-len` tokens for each of `--batch` sequences, then `--steps` timed
greedy decode steps (after `--warmup`). Reported: decode tok/s, ms per step, and the time per step spent in the
model's collectives (CUDA events around every all-reduce / all-gather on rank 0, so it includes waiting for the
slower rank), plus the TP=N / TP=1 speed ratio. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc.).

    python bench/tp_decode.py --model-shape llama-3-8b --tp 1,2 --batch 1,8,32 --out bench/results/tp_decode_h200x2.md
    python bench/tp_decode.py --device cpu --dtype float32 --model-shape '{"num_hidden_layers": 2, \
        "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, \
        "head_dim": 32, "vocab_size": 4096}' --batch 2 --prompt-len 32 --steps 8   # CPU smoke run (gloo)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from kestrel.model.parallel import apply_nccl_env, destroy_distributed, init_distributed, shard_llama  # noqa: E402


def _shape_config(shape: str):
    from kestrel.model.config import ModelConfig
    from kestrel.model.dummy import dummy_config

    if shape.lstrip().startswith("{"):
        return ModelConfig(**json.loads(shape))
    cfg, moe = dummy_config(shape)
    if moe:
        raise ValueError("tp_decode measures dense models; MoE shapes go through expert parallelism")
    return cfg


class _CommTimer:
    """CUDA events around each collective; read after a synchronize (events do not stall the stream)."""

    def __init__(self):
        self.pairs: list = []
        self.active = False

    def __call__(self):
        timer = self

        class _Ctx:
            def __enter__(self):
                if timer.active:
                    self.s, self.e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    self.s.record()

            def __exit__(self, *exc):
                if timer.active:
                    self.e.record()
                    timer.pairs.append((self.s, self.e))
        return _Ctx()

    def total_ms(self) -> float:
        return sum(s.elapsed_time(e) for s, e in self.pairs)


def _rank_main(rank: int, init_method: str, queue, tp: int, args) -> None:
    from kestrel.engine.scheduler import ScheduledBatch
    from kestrel.engine.tp_worker import TPModelRunner, _SeqView, _TokenWindow
    from kestrel.model.dummy import build_dummy_model

    try:
        group, dev = init_distributed(rank, tp, init_method, args.device)
        cuda = dev.type == "cuda"
        dtype = getattr(torch, args.dtype)
        cfg = _shape_config(args.model_shape)
        model = build_dummy_model(cfg, dtype, dev, seed=0)
        if args.quantization != "none":
            from kestrel.model.quantize import quantize_model
            quantize_model(model, args.quantization)
        rank_cfg = shard_llama(model, group)  # every rank built the same full weights; keep this rank's slices
        if cuda:
            torch.cuda.empty_cache()
        timer = _CommTimer() if cuda else None
        group.comm_timer = timer
        bs, results = 16, []
        for B in args.batch:
            total = args.prompt_len + args.warmup + args.steps + 1
            nb = -(-total // bs)
            runner = TPModelRunner(model, rank_cfg, B * nb, bs, dtype, str(dev), 0, group=group)
            if rank != 0:
                runner.worker_loop()  # runs rank 0's steps until it moves to the next batch size
                runner = None
                continue
            g = torch.Generator().manual_seed(B)
            toks = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(B)]
            tables = [list(range(i * nb, (i + 1) * nb)) for i in range(B)]
            seqs = [_SeqView(_TokenWindow(0, t), 0, tables[i]) for i, t in enumerate(toks)]
            _, logits = runner.forward_step(ScheduledBatch(seqs, [args.prompt_len] * B))  # prefill
            last = logits.argmax(-1).tolist()
            L = args.prompt_len + 1

            def step():
                nonlocal last, L
                views = [_SeqView(_TokenWindow(L - 1, [last[i]]), L - 1, tables[i]) for i in range(B)]
                _, lg = runner.forward_step(ScheduledBatch(views, [1] * B))
                last = lg.argmax(-1).tolist()  # the engine's sampler also syncs once per step
                L += 1
            for _ in range(args.warmup):
                step()
            if cuda:
                torch.cuda.synchronize()
                timer.pairs.clear()
                timer.active = True
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            if cuda:
                torch.cuda.synchronize()
                timer.active = False
            dt = time.perf_counter() - t0
            comm = timer.total_ms() / args.steps if cuda else float("nan")
            results.append(dict(tp=tp, batch=B, tok_s=B * args.steps / dt, step_ms=1e3 * dt / args.steps,
                                comm_ms=comm, collectives_per_step=len(timer.pairs) / args.steps if cuda else None))
            runner.stop_workers()
            runner = None  # frees the KV cache before the next batch size
        if rank == 0:
            queue.put(("ok", results))
        destroy_distributed()
    except BaseException as e:  # report instead of leaving the parent waiting
        import traceback
        queue.put(("error", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
        raise


def run_tp(tp: int, args) -> list[dict]:
    from kestrel.model.parallel.distributed import spawn_ranks

    return spawn_ranks(_rank_main, tp, (tp, args), timeout=args.timeout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", default="llama-3-8b", help="known shape name or JSON of ModelConfig fields")
    ap.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes (default: %(default)s)")
    ap.add_argument("--batch", default="1,8,32", help="comma-separated decode batch sizes (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sequence (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode steps first (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL, one GPU per rank")
    ap.add_argument("--quantization", default="none", help="quantize-on-load scheme before sharding")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for one TP size's run")
    ap.add_argument("--out", default=None, help="write a markdown report here (bench/results/...)")
    args = ap.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    tps = [int(t) for t in args.tp.split(",")]
    if args.device == "cuda":
        apply_nccl_env()
        have = torch.cuda.device_count()
        if max(tps) > have:
            ap.error(f"--tp {max(tps)} needs {max(tps)} GPUs, {have} visible")
    rows = []
    for tp in tps:
        print(f"TP={tp} ...", flush=True)
        rows += run_tp(tp, args)
    base = {r["batch"]: r["tok_s"] for r in rows if r["tp"] == tps[0]}
    lines = [f"| TP | batch | decode tok/s | ms/step | collectives ms/step | collectives/step | vs TP={tps[0]} |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['batch']} | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {r['comm_ms']:.3f} | "
                     f"{r['collectives_per_step']} | {r['tok_s'] / base[r['batch']]:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
        n = torch.cuda.device_count() if args.device == "cuda" else 0
        with open(args.out, "w") as f:
            f.write(f"# Tensor-parallel decode, {args.model_shape}\n\n- date: {datetime.date.today()}\n"
                    f"- device: {n} x {gpu}; torch {torch.__version__}\n- command: `python {' '.join(sys.argv)}`\n"
                    f"- dtype {args.dtype}, quantization {args.quantization}, prompt {args.prompt_len} tokens, "
                    f"{args.steps} timed steps after {args.warmup} warm-up\n\n{table}\n\n"
                    f"Raw:\n\n```json\n{json.dumps(rows, indent=1)}\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
