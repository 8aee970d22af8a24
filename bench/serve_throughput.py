"""Online serving throughput: an OpenAI-API load against `kestrel serve` (a subprocess), side by side with
HF transformers `generate` (static batches) on the same GPU, and kestrel with async scheduling on vs off.

Workload: ShareGPT-like request lengths drawn here (log-normal prompt and output lengths, seeded), random
token-id prompts, `ignore_eos` so every request produces its requested length. Each concurrency level keeps
C requests in flight (closed loop) until all of its requests are done. Reported per level: output tok/s,
TTFT p50/p99, ITL p50/p99 (time between streamed tokens; `logprobs=0` makes the server send one chunk per
token even when a random token id decodes to no text).

    python bench/serve_throughput.py --model-shape llama-3-8b --concurrency 1,16,64,256 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def sharegpt_like(n: int, seed: int, vocab: int, max_in: int, max_out: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs; log-normal lengths roughly matching ShareGPT (median ~150/~170)."""
    rng = np.random.default_rng(seed)
    ins = np.clip(rng.lognormal(5.0, 0.9, n), 8, max_in).astype(int)
    outs = np.clip(rng.lognormal(5.15, 0.75, n), 8, max_out).astype(int)
    return [(rng.integers(100, vocab, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def pct(xs, p):
    return float(np.percentile(xs, p)) if len(xs) else float("nan")


async def _one(client, url, model, ids, out_len):
    body = {"model": model, "prompt": ids, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, ntok = [], 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(str(ev["error"]))
            for ch in ev.get("choices", []):
                lp = ch.get("logprobs") or {}
                k = len(lp.get("tokens") or []) or (1 if ch.get("text") else 0)
                if k:
                    stamps.append((time.perf_counter(), k))
                    ntok += k
            if ev.get("usage"):
                ntok = ev["usage"]["completion_tokens"]
    t_end = time.perf_counter()
    ttft = stamps[0][0] - t0 if stamps else float("nan")
    itl = []
    for (a, _), (b, k) in zip(stamps, stamps[1:]):
        itl.extend([(b - a) / k] * k)
    return dict(ttft=ttft, itl=itl, tokens=ntok, latency=t_end - t0)


async def run_level(base, model, reqs, concurrency):
    import httpx

    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        queue = list(reqs)
        results = []

        async def worker():
            while queue:
                ids, n = queue.pop()
                results.append(await _one(client, url, model, ids, n))
        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    return dict(concurrency=concurrency, requests=len(results), output_tokens=toks, seconds=wall,
                output_tok_s=toks / wall, ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), itl_p50=pct(itl, 50),
                itl_p99=pct(itl, 99), requested_tokens=sum(n for _, n in reqs))


def make_dummy_dir(shape_name: str, out_dir: str) -> str:
    """An HF-style model directory for `kestrel serve DIR --load-format dummy`: config.json of the named shape plus
    the embedded SmolLM2 tokenizer (so the server needs neither real weights nor the embedded GGUF)."""
    from kestrel.model.loader import load_tokenizer, resolve
    from kestrel.model.shapes import model_shape

    s = model_shape(shape_name)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": s["architecture"], "vocab_size": s["vocab_size"],
           "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
           "num_hidden_layers": s["num_hidden_layers"], "num_attention_heads": s["num_attention_heads"],
           "num_key_value_heads": s["num_key_value_heads"], "head_dim": s["head_dim"],
           "rms_norm_eps": s["rms_norm_eps"], "rope_theta": s["rope_theta"], "rope_scaling": s.get("rope_scaling"),
           "max_position_embeddings": s["max_position_embeddings"], "tie_word_embeddings": False,
           "bos_token_id": s.get("bos_token_id"), "eos_token_id": s.get("eos_token_ids")}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    kind, path, _ = resolve(None)
    load_tokenizer(kind, path).save_pretrained(out_dir)
    return out_dir


def start_server(args, port, async_sched: bool, log_path: str):
    model = [args.server_model] if args.server_model else ["--model-shape", args.model_shape]
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", *model, "--port", str(port), "--load-format", "dummy",
           "--dtype", args.dtype, "--device", args.device,
           "--max-num-seqs", str(max(args.levels)), "--max-num-batched-tokens", str(args.max_batched_tokens),
           "--kv-cache-gb", str(args.kv_cache_gb), "--log-level", "warning", "--no-progress",
           "--async-scheduling" if async_sched else "--no-async-scheduling"]
    if args.quantization and args.quantization != "none":
        cmd += ["--quantization", args.quantization]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})
    return proc, cmd


def wait_ready(base, proc, timeout):
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"], time.time() - t0
        except Exception:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become ready")


def stop_server(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_kestrel(args, async_sched, workloads, levels, out_dir):
    port = args.port + (1 if async_sched else 0)
    base = f"http://127.0.0.1:{port}"
    log_path = os.path.join(out_dir, f"server_async_{int(async_sched)}.log")
    proc, cmd = start_server(args, port, async_sched, log_path)
    rows = []
    try:
        model, ready_s = wait_ready(base, proc, args.startup_timeout)
        print(f"kestrel (async_scheduling={async_sched}) ready in {ready_s:.0f}s", flush=True)
        asyncio.run(run_level(base, model, workloads["warmup"], 2))  # first requests pay lazy init
        for c in levels:
            r = asyncio.run(run_level(base, model, workloads[c], c))
            r.update(system="kestrel", async_scheduling=async_sched)
            rows.append(r)
            print(fmt(r), flush=True)
    except Exception as ex:
        print(f"kestrel (async={async_sched}) FAILED: {type(ex).__name__}: {ex}", flush=True)
        rows.append(dict(system="kestrel", async_scheduling=async_sched, error=str(ex)))
    finally:
        stop_server(proc)
        with open(log_path) as f:
            tail = f.read()[-2000:]
        if rows and "error" in rows[-1]:
            print(tail)
    return rows, " ".join(cmd)


def bench_hf(args, workloads, levels):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kestrel.model.shapes import model_shape

    s = model_shape(args.model_shape)
    cfg = LlamaConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                      num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
                      num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], rope_theta=s["rope_theta"],
                      max_position_embeddings=s["max_position_embeddings"], rms_norm_eps=s["rms_norm_eps"])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    with torch.inference_mode():  # warm-up: CUDA context, cuBLAS handles and kernels load outside the timing
        model.generate(input_ids=torch.ones(2, 16, dtype=torch.long, device="cuda"), max_new_tokens=8,
                       min_new_tokens=8, do_sample=False, pad_token_id=0)
    rows = []
    for c in levels:
        reqs = workloads[c]
        t0 = time.perf_counter()
        useful = generated = 0
        for i in range(0, len(reqs), c):  # static batches of C, left-padded, each runs to its longest output
            batch = reqs[i:i + c]
            L = max(len(p) for p, _ in batch)
            n = max(o for _, o in batch)
            ids = torch.zeros(len(batch), L, dtype=torch.long)
            mask = torch.zeros(len(batch), L, dtype=torch.long)
            for j, (p, _) in enumerate(batch):
                ids[j, L - len(p):] = torch.tensor(p)
                mask[j, L - len(p):] = 1
            with torch.inference_mode():
                out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, pad_token_id=0)
            generated += (out.shape[1] - L) * len(batch)
            useful += sum(o for _, o in batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        r = dict(system="hf-transformers", concurrency=c, requests=len(reqs), output_tokens=useful, seconds=wall,
                 output_tok_s=useful / wall, generated_incl_padding=generated)
        rows.append(r)
        print(fmt(r), flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def fmt(r):
    if "ttft_p50" in r:
        return (f"{r['system']:16s} async={str(r.get('async_scheduling', '')):5s} C={r['concurrency']:3d}: "
                f"{r['output_tok_s']:8.1f} tok/s  TTFT p50 {1e3 * r['ttft_p50']:.0f} ms p99 {1e3 * r['ttft_p99']:.0f} ms  "
                f"ITL p50 {1e3 * r['itl_p50']:.1f} ms p99 {1e3 * r['itl_p99']:.1f} ms  ({r['requests']} req, {r['seconds']:.1f}s)")
    return f"{r['system']:16s} C={r['concurrency']:3d}: {r['output_tok_s']:8.1f} tok/s ({r['requests']} req, {r['seconds']:.1f}s)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", default="llama-3-8b", help="dummy-weight shape for both systems")
    ap.add_argument("--quantization", default="none", help="kestrel --quantization (HF always runs bf16)")
    ap.add_argument("--concurrency", default="1,16,64,256", help="comma-separated in-flight request counts")
    ap.add_argument("--requests", default="4,32,64,256", help="requests per concurrency level (same order)")
    ap.add_argument("--async-levels", default="64", help="levels repeated with --async-scheduling ('' = none)")
    ap.add_argument("--hf-levels", default="1,16,64,256", help="levels run with HF transformers ('' = skip HF)")
    ap.add_argument("--max-input", type=int, default=768, help="longest prompt (tokens)")
    ap.add_argument("--max-output", type=int, default=256, help="longest output (tokens)")
    ap.add_argument("--max-batched-tokens", type=int, default=2048, help="kestrel chunked-prefill budget per step")
    ap.add_argument("--kv-cache-gb", type=float, default=40.0, help="kestrel KV cache size")
    ap.add_argument("--server-model", default=None,
                    help="model directory for the server (dummy weights of its config.json); default: --model-shape")
    ap.add_argument("--make-dummy-dir", default=None, metavar="DIR",
                    help="only write an HF-style directory for --model-shape (config + embedded tokenizer) and exit")
    ap.add_argument("--device", default="cuda", help="kestrel server device")
    ap.add_argument("--dtype", default="bfloat16", help="kestrel server dtype")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."), help="server logs go here")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args(argv)
    if args.make_dummy_dir:
        print(make_dummy_dir(args.model_shape, args.make_dummy_dir))
        return
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != len(levels):
        raise SystemExit("--requests needs one count per --concurrency level")
    args.levels = levels
    from kestrel.model.shapes import model_shape
    shape = json.loads(args.model_shape) if args.model_shape.lstrip().startswith("{") else model_shape(args.model_shape)
    vocab = min(shape["vocab_size"], 32000)  # prompt ids must also be valid for the server's tokenizer
    workloads = {c: sharegpt_like(n, args.seed + c, vocab, args.max_input, args.max_output) for c, n in zip(levels, counts)}
    workloads["warmup"] = sharegpt_like(4, args.seed + 9999, vocab, 64, 16)  # distinct prompts: no prefix hits later
    import torch
    import triton
    info = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__, triton=triton.__version__,
                host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), args=vars(args))
    rows, cmds = [], []
    # the main run uses the engine's default (synchronous) loop; --async-levels repeats levels with
    # --async-scheduling for the on/off ratio
    r, cmd = bench_kestrel(args, False, workloads, levels, args.out_dir)
    rows += r
    cmds.append(cmd)
    hlevels = [int(x) for x in args.hf_levels.split(",") if x]
    if hlevels:
        try:
            rows += bench_hf(args, workloads, hlevels)
        except Exception as ex:
            print(f"HF peer FAILED: {type(ex).__name__}: {ex}", flush=True)
            rows.append(dict(system="hf-transformers", error=str(ex)))
    alevels = [int(x) for x in args.async_levels.split(",") if x]
    if alevels:
        r, cmd = bench_kestrel(args, True, workloads, alevels, args.out_dir)
        rows += r
        cmds.append(cmd)
    info["server_cmds"] = cmds
    print("\n| system | async | C | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['system']} | {r.get('async_scheduling', '')} | failed: {r['error'][:80]} | | | | | | |")
            continue
        t = (lambda k: f"{1e3 * r[k]:.1f}" if k in r else "-")
        print(f"| {r['system']} | {r.get('async_scheduling', '-')} | {r['concurrency']} | {r['requests']} | "
              f"{r['output_tok_s']:.1f} | {t('ttft_p50')} | {t('ttft_p99')} | {t('itl_p50')} | {t('itl_p99')} |")
    ok = {(r["system"], r.get("async_scheduling"), r["concurrency"]): r["output_tok_s"] for r in rows if "error" not in r}
    print("\nratios (output tok/s):")
    for c in levels:
        k = ok.get(("kestrel", False, c))
        h = ok.get(("hf-transformers", None, c))
        a = ok.get(("kestrel", True, c))
        if k and h:
            print(f"  C={c}: kestrel / HF generate = {k / h:.2f}x")
        if k and a:
            print(f"  C={c}: async on / off = {a / k:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
