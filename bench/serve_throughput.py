"""Online serving throughput: an OpenAI-API load against `kestrel serve` (subprocesses), side by side with
HF transformers `generate` (static batches) on the same GPU, and kestrel with async scheduling on vs off.

Workload: ShareGPT-like request lengths drawn here (log-normal prompt and output lengths, seeded), random
token-id prompts, `ignore_eos` so every request produces its requested length. Each concurrency level keeps
C requests in flight (closed loop) until all of its requests are done. Reported per level: output tok/s,
TTFT p50/p99, ITL p50/p99 (time between streamed tokens; `logprobs=0` makes the server send one chunk per
token even when a random token id decodes to no text).

Both kestrel servers (async scheduling off and on) start together (their load + CUDA-graph capture overlap), get
a warm-up load, then run the levels interleaved (off C, on C, ...), one server busy at a time; both stop before
the HF peer loads. --deadline-s skips HF levels that would not finish in time; the JSON is rewritten after
every row, so a run cut short keeps what it measured.

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
    cmd += args.server_args.split()
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


def engine_stats(base):
    import httpx

    try:
        return httpx.get(base + "/stats", timeout=10).json()
    except Exception:
        return {}


def start_kestrel(args, async_sched, out_dir):
    port = args.port + (1 if async_sched else 0)
    log_path = os.path.join(out_dir, f"server_async_{int(async_sched)}.log")
    proc, cmd = start_server(args, port, async_sched, log_path)
    return dict(async_sched=async_sched, base=f"http://127.0.0.1:{port}", proc=proc, cmd=" ".join(cmd),
                log=log_path, model=None, error=None)


def ready_and_warm(srv, args, workloads, t_start):
    """Wait for the server, then warm it up (Triton kernels specialize on shapes the first requests bring)."""
    try:
        srv["model"], ready_s = wait_ready(srv["base"], srv["proc"], args.startup_timeout - (time.time() - t_start))
        srv["ready_s"] = time.time() - t_start
        t = time.time()
        asyncio.run(run_level(srv["base"], srv["model"], workloads["warmup"], min(32, len(workloads["warmup"]))))
        srv["warmup_s"] = time.time() - t
        print(f"kestrel (async_scheduling={srv['async_sched']}) ready {srv['ready_s']:.0f}s after launch, "
              f"warm-up {srv['warmup_s']:.1f}s", flush=True)
    except Exception as ex:
        srv["error"] = f"{type(ex).__name__}: {ex}"
        print(f"kestrel (async={srv['async_sched']}) FAILED to start: {srv['error']}", flush=True)


def kestrel_level(srv, workload, c):
    if srv["error"]:
        return dict(system="kestrel", async_scheduling=srv["async_sched"], concurrency=c, error=srv["error"])
    try:
        s0 = engine_stats(srv["base"])
        r = asyncio.run(run_level(srv["base"], srv["model"], workload, c))
        s1 = engine_stats(srv["base"])
        steps = s1.get("num_steps", 0) - s0.get("num_steps", 0)
        r.update(system="kestrel", async_scheduling=srv["async_sched"], engine_steps=steps,
                 ms_per_step=1e3 * r["seconds"] / steps if steps else None)
        if "async_wait_s" in s1:  # engine thread blocked on the device's tokens: the rest of its time overlapped
            r["engine_wait_frac"] = (s1["async_wait_s"] - s0.get("async_wait_s", 0.0)) / r["seconds"]
        print(fmt(r), flush=True)
        return r
    except Exception as ex:
        srv["error"] = f"{type(ex).__name__}: {ex}"
        print(f"kestrel (async={srv['async_sched']}) C={c} FAILED: {srv['error']}", flush=True)
        with open(srv["log"]) as f:
            print(f.read()[-3000:])
        return dict(system="kestrel", async_scheduling=srv["async_sched"], concurrency=c, error=srv["error"])


def same_outputs(servers, prompts, n=32):
    """Greedy texts of a few prompts, one request at a time (same batch shapes on both servers), async on vs off."""
    import httpx

    texts = []
    for srv in servers:
        if srv["error"]:
            return None
        t = []
        for ids in prompts:
            body = {"model": srv["model"], "prompt": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
            t.append(httpx.post(srv["base"] + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"])
        texts.append(t)
    return all(t == texts[0] for t in texts)


def bench_kestrel(args, workloads, levels, async_levels, out_dir, emit):
    """Both servers start at once; levels interleave (off C, on C) so drift hits both modes alike."""
    t0 = time.time()
    servers = [start_kestrel(args, False, out_dir)]
    if async_levels:
        servers.append(start_kestrel(args, True, out_dir))
    try:
        for srv in servers:
            ready_and_warm(srv, args, workloads, t0)
        if len(servers) == 2:
            same = same_outputs(servers, [ids for ids, _ in workloads["warmup"][:args.check_prompts]])
            print(f"async on == off (greedy, {args.check_prompts} prompts x 32 tokens): {same}", flush=True)
            servers[1]["same_as_sync"] = same
        for c in levels:
            for srv in servers:
                if srv["async_sched"] and c not in async_levels:
                    continue
                emit(kestrel_level(srv, workloads[c], c))
    finally:
        for srv in servers:
            stop_server(srv["proc"])
            if srv["error"]:
                with open(srv["log"]) as f:
                    print(f.read()[-3000:])
    return [dict(async_scheduling=s["async_sched"], cmd=s["cmd"], ready_s=s.get("ready_s"),
                 warmup_s=s.get("warmup_s"), same_as_sync=s.get("same_as_sync"), error=s["error"]) for s in servers]


# seconds per static batch of C in HF run 1 (H200, default workload): what a level costs, for --deadline-s
HF_EST_S = {1: 14, 16: 22, 64: 31, 256: 66}


def bench_hf(args, workloads, levels, emit, deadline=None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kestrel.model.shapes import model_shape

    s = json.loads(args.model_shape) if args.model_shape.lstrip().startswith("{") else model_shape(args.model_shape)
    cfg = LlamaConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                      num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
                      num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], rope_theta=s["rope_theta"],
                      max_position_embeddings=s["max_position_embeddings"], rms_norm_eps=s["rms_norm_eps"])
    dev = args.device
    torch.set_default_dtype(getattr(torch, args.dtype))
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    with torch.inference_mode():  # warm-up: CUDA context, cuBLAS handles and kernels load outside the timing
        for b in (1, 8):
            model.generate(input_ids=torch.ones(b, 16, dtype=torch.long, device=dev), max_new_tokens=8,
                           min_new_tokens=8, do_sample=False, pad_token_id=0)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    for c, n_req in levels:
        reqs = workloads[c][:n_req]  # the first requests of the same workload (HF is slow: fewer of them)
        est = HF_EST_S.get(c, 0) * -(-n_req // c) if dev.startswith("cuda") else 0
        if deadline and time.time() + est > deadline:
            print(f"HF C={c}: skipped, ~{est:.0f}s would pass the deadline", flush=True)
            emit(dict(system="hf-transformers", concurrency=c, error="skipped: deadline"))
            continue
        sync()
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
                out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, pad_token_id=0)
            generated += (out.shape[1] - L) * len(batch)
            useful += sum(o for _, o in batch)
        sync()
        wall = time.perf_counter() - t0
        r = dict(system="hf-transformers", concurrency=c, requests=len(reqs), output_tokens=useful, seconds=wall,
                 output_tok_s=useful / wall, generated_incl_padding=generated)
        emit(r)
        print(fmt(r), flush=True)
    del model
    if not dev.startswith("cuda"):
        return
    torch.cuda.empty_cache()


def fmt(r):
    if "ttft_p50" in r:
        return (f"{r['system']:16s} async={str(r.get('async_scheduling', '')):5s} C={r['concurrency']:3d}: "
                f"{r['output_tok_s']:8.1f} tok/s  TTFT p50 {1e3 * r['ttft_p50']:.0f} ms p99 {1e3 * r['ttft_p99']:.0f} ms  "
                f"ITL p50 {1e3 * r['itl_p50']:.1f} ms p99 {1e3 * r['itl_p99']:.1f} ms  ({r['requests']} req, {r['seconds']:.1f}s"
                + (f", {r['ms_per_step']:.2f} ms/step" if r.get("ms_per_step") else "")
                + (f", engine waits {100 * r['engine_wait_frac']:.0f}%" if "engine_wait_frac" in r else "") + ")")
    return f"{r['system']:16s} C={r['concurrency']:3d}: {r['output_tok_s']:8.1f} tok/s ({r['requests']} req, {r['seconds']:.1f}s)"


def report(rows, levels):
    lines = ["| system | async | C | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
             "| ms/step | engine wait |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r.get('async_scheduling', '-')} | {r.get('concurrency', '')} | "
                         f"failed: {r['error'][:80]} | | | | | | | |")
            continue
        t = (lambda k: f"{1e3 * r[k]:.1f}" if k in r else "-")
        step = f"{r['ms_per_step']:.2f}" if r.get("ms_per_step") else "-"
        wait = f"{100 * r['engine_wait_frac']:.0f}%" if "engine_wait_frac" in r else "-"
        lines.append(f"| {r['system']} | {r.get('async_scheduling', '-')} | {r['concurrency']} | {r['requests']} | "
                     f"{r['output_tok_s']:.1f} | {t('ttft_p50')} | {t('ttft_p99')} | {t('itl_p50')} | "
                     f"{t('itl_p99')} | {step} | {wait} |")
    ok = {(r["system"], r.get("async_scheduling"), r["concurrency"]): r for r in rows if "error" not in r}
    lines.append("\nratios:")
    for c in levels:
        k, h, a = (ok.get(key) for key in (("kestrel", False, c), ("hf-transformers", None, c), ("kestrel", True, c)))
        if k and h:
            lines.append(f"  C={c}: kestrel (async off) / HF generate, output tok/s = "
                         f"{k['output_tok_s'] / h['output_tok_s']:.2f}x")
        if a and h:
            lines.append(f"  C={c}: kestrel (async on) / HF generate, output tok/s = "
                         f"{a['output_tok_s'] / h['output_tok_s']:.2f}x")
        if k and a:
            lines.append(f"  C={c}: async on / off: output tok/s {a['output_tok_s'] / k['output_tok_s']:.3f}x, "
                         f"ITL p50 {a['itl_p50'] / k['itl_p50']:.3f}x, TTFT p50 {a['ttft_p50'] / k['ttft_p50']:.3f}x")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", default="llama-3-8b", help="dummy-weight shape for both systems (name or JSON)")
    ap.add_argument("--quantization", default="none", help="kestrel --quantization (HF always runs bf16)")
    ap.add_argument("--concurrency", default="1,16,64,256", help="comma-separated in-flight request counts")
    ap.add_argument("--requests", default="4,64,128,512", help="kestrel requests per concurrency level (same order)")
    ap.add_argument("--async-levels", default="1,16,64,256",
                    help="levels also run on a second server with async scheduling on ('' = none)")
    ap.add_argument("--hf-levels", default="1,16,64,256", help="levels run with HF transformers ('' = skip HF)")
    ap.add_argument("--hf-requests", default="1,16,64,256",
                    help="HF requests per --hf-levels level: the first ones of kestrel's workload")
    ap.add_argument("--max-input", type=int, default=768, help="longest prompt (tokens)")
    ap.add_argument("--max-output", type=int, default=256, help="longest output (tokens)")
    ap.add_argument("--max-batched-tokens", type=int, default=2048, help="kestrel chunked-prefill budget per step")
    ap.add_argument("--kv-cache-gb", type=float, default=24.0, help="KV cache size of each kestrel server")
    ap.add_argument("--server-model", default=None,
                    help="model directory for the server (dummy weights of its config.json); default: --model-shape")
    ap.add_argument("--make-dummy-dir", default=None, metavar="DIR",
                    help="only write an HF-style directory for --model-shape (config + embedded tokenizer) and exit")
    ap.add_argument("--device", default="cuda", help="device of both systems")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of both systems")
    ap.add_argument("--server-args", default="", help="extra `kestrel serve` flags (space-separated)")
    ap.add_argument("--warmup-requests", type=int, default=64, help="warm-up requests per server (not timed)")
    ap.add_argument("--check-prompts", type=int, default=4, help="prompts compared between async on and off")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--startup-timeout", type=float, default=300, help="seconds for both servers to become ready")
    ap.add_argument("--deadline-s", type=float, default=None, help="skip HF levels that would end later than this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."), help="server logs go here")
    ap.add_argument("--json", default=None, help="write all numbers here (rewritten after every row)")
    args = ap.parse_args(argv)
    t_start = time.time()
    if args.make_dummy_dir:
        print(make_dummy_dir(args.model_shape, args.make_dummy_dir))
        return
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != len(levels):
        raise SystemExit("--requests needs one count per --concurrency level")
    args.levels = levels
    alevels = [int(x) for x in args.async_levels.split(",") if x]
    hlevels = [int(x) for x in args.hf_levels.split(",") if x]
    hcounts = [int(x) for x in args.hf_requests.split(",") if x]
    if len(hcounts) != len(hlevels) or not set(hlevels) <= set(levels) or not set(alevels) <= set(levels):
        raise SystemExit("--hf-requests needs one count per --hf-levels level; HF/async levels must be in --concurrency")
    from kestrel.model.shapes import model_shape
    shape = json.loads(args.model_shape) if args.model_shape.lstrip().startswith("{") else model_shape(args.model_shape)
    vocab = min(shape["vocab_size"], 32000)  # prompt ids must also be valid for the server's tokenizer
    workloads = {c: sharegpt_like(n, args.seed + c, vocab, args.max_input, args.max_output) for c, n in zip(levels, counts)}
    # distinct prompts (no prefix hits later), varied lengths: the Triton kernels compile their shape variants here
    workloads["warmup"] = sharegpt_like(args.warmup_requests, args.seed + 9999, vocab, args.max_input, 32)
    import torch
    import triton
    info = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                triton=triton.__version__, host=platform.node(),
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), args=vars(args))
    rows = []

    def emit(r):
        rows.append(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(info=info, rows=rows), f, indent=1)

    info["servers"] = bench_kestrel(args, workloads, levels, alevels, args.out_dir, emit)
    info["kestrel_done_s"] = time.time() - t_start
    if hlevels:
        try:
            bench_hf(args, workloads, list(zip(hlevels, hcounts)), emit,
                     deadline=t_start + args.deadline_s if args.deadline_s else None)
        except Exception as ex:
            print(f"HF peer FAILED: {type(ex).__name__}: {ex}", flush=True)
            emit(dict(system="hf-transformers", error=f"{type(ex).__name__}: {ex}"))
    info["total_s"] = time.time() - t_start
    print()
    print(report(rows, levels))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
