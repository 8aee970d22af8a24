"""Host (Python) cost of one speculative decoding step, by phase, at decode batch sizes 1, 8, 64 (issue #6).

Same setup as bench/engine_host_overhead.py (whose model, CPU-time timer and glibc tuning this reuses): the real
engine with a random 1-layer Llama (SmolLM2's vocabulary and tokenizer), greedy, `ignore_eos`, n-gram drafter,
k=4, the confidence scheduler with a GPU's token budget (256) or fixed k. On a GPU an all-decode spec step goes
through the captured verify forward (kestrel/spec/verify_graph.py); here that path runs too, with the replay
replaced by a free stand-in for the argmax (the next token repeats the last one, with a change every 7th position,
so n-gram drafts are mostly accepted, as on repetitive text; plain steps run an embedding -> logits model with the
same argmax up to rare exceptions). Phases are self time (nested calls are
charged to the inner phase) of the engine thread:

  schedule   the engine's Scheduler.schedule
  draft      SpecDecoder._draft + the drafter's propose (room, KV blocks for the drafts)
  spec_sched the spec scheduler's allocate (how many drafts to verify per request)
  inputs     VerifyGraphs.run less the forward: packing the padded verify inputs + copies into the static buffers
  verify     greedy/sampling acceptance, logprobs, drafter feedback (_graph_forward / _verify / _record)
  rollback   BlockManager.free_tail (KV blocks of rejected drafts)
  loop       loop=on (kestrel/spec/spec_loop.py, the overlapped device loop): choosing K, KV blocks ahead,
             block-table / flag uploads, launching the step (its device step, SpecLoop._step, counts as forward)
  commit     the rest of SpecDecoder.step (or the loop's commit): token append, stop checks, detokenization, outputs
  forward / sample: device work on a GPU, excluded from host
"host" is the engine thread's CPU time per step less forward and sample.

    python bench/spec_host_overhead.py --label after --out bench/results/spec_host_overhead.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

from engine_host_overhead import TINY, PhaseTimer, cpu_name

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams
from kestrel.spec import verify_graph  # kestrel.spec registers the spec step builder

PHASES = ("schedule", "draft", "spec_sched", "inputs", "verify", "rollback", "loop", "commit")


class SelfTimer(PhaseTimer):
    """PhaseTimer charging each call its self time: a wrapped call inside another wrapped call is subtracted
    from the outer phase. Missing attributes are skipped (the same script times older trees)."""

    def __init__(self):
        super().__init__()
        self.stack: list[float] = []

    def wrap(self, obj, name, phase):
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            self.stack.append(0.0)
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt = time.thread_time() - t0
                child = self.stack.pop()
                self.t[phase] += dt - child
                if self.stack:
                    self.stack[-1] += dt
        setattr(obj, name, timed)


def stub_verify_graphs(eng, k: int, batch_sizes):
    """VerifyGraphs without capture whose step is embedding -> logits (the replay is device work on a GPU)."""
    runner = eng.runner
    b = runner.backend
    g = verify_graph.VerifyGraphs(runner.model, b.k_cache, b.v_cache, batch_sizes,
                                  verify_graph.default_k_buckets(max(k, 4)), -(-eng.max_model_len // runner.block_size),
                                  capture=False)
    V, H = runner.model.embed_tokens.weight.shape
    # one-hot logits in a buffer kept across steps: only the previous step's ones are cleared, so the step costs
    # ~nothing (a [T, V] matmul or memset, 60 MB, would evict the caches and inflate every host phase after it;
    # a GPU does that work off the host). Rows read by a sampler then agree with `top`.
    buf = torch.zeros(max(batch_sizes) * (g.k_sizes[-1] + 1), V)
    zh = torch.zeros(1, H)
    prev = [torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)]

    def step(bs, K):
        T = bs * (K + 1)
        ids, pos = g.input_ids[:T], g.positions[:T]
        top = torch.where(pos % 7 == 6, (ids + 1) % V, ids)
        buf[prev[0], prev[1]] = 0.0
        rows = torch.arange(T)
        buf[rows, top] = 1.0
        prev[:] = [rows, top]
        return buf[:T], top, zh.expand(T, H)
    g._step = step
    return g


def free_model(eng):
    """Every forward (plain decode, prefill, verify) becomes embedding -> logits: nearly free, and the same
    next-token function on every path, so greedy output settles into a cycle that n-gram drafts then predict."""
    model = eng.runner.model
    E = model.embed_tokens.weight
    V = E.shape[0]
    model.compute_logits = lambda h: h @ E.t()  # tied: argmax(logits of e_t) = t (up to rare exceptions)
    # the next token repeats the last one, except at every 7th position where it moves on: drafts of the
    # repeated token fail there, so ~1 in 7 verified drafts is rejected (KV rollback, partial acceptance)
    model.forward = lambda ids, positions, ctx: model.embed_tokens(torch.where(positions % 7 == 6, (ids + 1) % V, ids))


def make_engine(spec: str, max_bs: int, blocks: int, graphs: bool):
    eng = LLMEngine(EngineConfig(load_format="dummy", model_shape=dict(TINY), progress=False, max_num_seqs=max_bs,
                                 max_num_batched_tokens=8192, num_kv_blocks=blocks, async_scheduling=False,
                                 speculative=spec))
    sp = eng.spec
    free_model(eng)
    if graphs:
        sp.graphs = stub_verify_graphs(eng, sp.cfg.k, sorted({1, 2, 4, 8, 16, 32, 48, 64, max_bs}))
    t = SelfTimer()
    t.wrap(eng.scheduler, "schedule", "schedule")
    t.wrap(sp, "step", "commit")
    t.wrap(sp, "_draft", "draft")
    t.wrap(sp.drafter, "propose", "draft")
    t.wrap(sp.scheduler, "allocate", "spec_sched")
    t.wrap(sp, "_graph_forward", "verify")
    t.wrap(sp, "_eager_forward", "verify")
    t.wrap(sp, "_verify", "verify")
    t.wrap(sp, "_record", "verify")
    t.wrap(eng.block_manager, "free_tail", "rollback")
    t.wrap(eng.runner, "execute", "forward")
    t.wrap(eng.runner, "sampler", "sample")
    t.wrap(eng.runner.model, "forward", "forward")  # eager verify forwards
    t.wrap(eng.runner.model, "compute_logits", "forward")
    if sp.loop is not None:
        t.wrap(sp.loop, "step", "loop")
        t.wrap(sp.loop, "_step", "forward")
        t.wrap(sp.loop, "_commit", "commit")
    if sp.graphs is not None:
        t.wrap(sp.graphs, "run", "inputs")
        t.wrap(sp.graphs, "_step", "forward")
    return eng, t


def chunk(eng, t, steps):
    t.t.clear()
    t.on = True
    tok0, c0, w0 = eng.num_generated_tokens, time.thread_time(), time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    t.on = False
    ph = {k: 1e3 * v / steps for k, v in t.t.items()}
    ph["host"] = 1e3 * cpu / steps - ph.get("forward", 0.0) - ph.get("sample", 0.0)
    ph["step"] = 1e3 * wall / steps
    ph["tok"] = (eng.num_generated_tokens - tok0) / steps  # tokens emitted per step (all requests)
    return ph


def measure(eng, t, bs, prompt_tokens, steps, repeats, logprobs, seed):
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    vocab = eng.model_config.vocab_size
    for i in range(bs):
        block = torch.randint(300, vocab, (16,), generator=g).tolist()  # repetitive text: n-gram drafts exist
        eng.add_request(f"b{bs}-{i}", (block * (prompt_tokens // 16 + 1))[:prompt_tokens], params)
    while any(s.num_computed_tokens < s.prompt_len for s in eng.seqs.values()):  # prefill (untimed)
        eng.step()
    for _ in range(5):  # warm-up decodes (the drafter's index, the acceptance rate settle)
        eng.step()
    best = min((chunk(eng, t, steps) for _ in range(repeats)), key=lambda ph: ph["host"])
    for rid in list(eng.seqs):
        eng.abort_request(rid)
    eng.block_manager.reset_prefix_cache()
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--specs", nargs="+", default=["drafter=ngram,k=4,token_budget=256",
                                                   "drafter=ngram,k=4,schedule=fixed"])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--logprobs", type=int, default=-1, help="logprobs per request (-1: none, as spec_decode.py)")
    ap.add_argument("--eager", action="store_true", help="the eager verify path (CPU engine) instead of the graph one")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logprobs = None if args.logprobs < 0 else args.logprobs
    if os.environ.get("MALLOC_MMAP_MAX_") is None:  # as engine_host_overhead.py: no refaulted logits buffers
        env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    torch.set_num_threads(1)
    mb = max(args.batch_sizes)
    blocks = mb * ((args.prompt_tokens + 5 * (args.repeats + 2) * args.steps + 80) // 16 + 4)
    rows = []
    for spec in args.specs:
        eng, t = make_engine(spec, mb, blocks, not args.eager)
        for bs in args.batch_sizes:
            ph = measure(eng, t, bs, args.prompt_tokens, args.steps, args.repeats, logprobs, bs)
            rows.append((spec, bs, ph))
            print(f"{spec} batch {bs:3d}: host {ph['host']:6.3f} ms/step " +
                  " ".join(f"{p} {ph.get(p, 0):.3f}" for p in PHASES) +
                  f" | forward {ph.get('forward', 0):.2f} sample {ph.get('sample', 0):.2f} | {ph['tok']:.1f} tok/step",
                  flush=True)
    if args.out:
        lines = [f"### {args.label}", "",
                 f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
                 f"- CPU: {cpu_name()} ({os.cpu_count()} cores visible), torch threads 1, torch {torch.__version__}",
                 f"- command: `python {shlex.join(sys.argv)}`",
                 (f"- prompt {args.prompt_tokens}, best of {args.repeats} x {args.steps} steps, greedy, "
                  f"logprobs={logprobs}, verify path: {'eager' if args.eager else 'graph (stand-in replay)'}"), "",
                 "| spec | batch | host ms/step | " + " | ".join(PHASES) + " | forward | sample | tokens/step |",
                 "|---" * (len(PHASES) + 6) + "|"]
        for spec, bs, ph in rows:
            lines.append(f"| {spec} | {bs} | **{ph['host']:.3f}** | " +
                         " | ".join(f"{ph.get(p, 0):.3f}" for p in PHASES) +
                         f" | {ph.get('forward', 0):.2f} | {ph.get('sample', 0):.2f} | {ph['tok']:.1f} |")
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
