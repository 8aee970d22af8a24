"""Greedy self-distillation data for the draft head on a CPU, time-boxed: the target's continuations of train-draft's
chat + varied prompts (none of bench/spec_decode.py's workloads: those are the held-out set of
bench/draft_acceptance.py), with the hidden states static_generate returns, saved in `train-draft --hidden-cache`
format (train-draft then skips generation). Session 11: 384 x 128 tokens in 449 s on one core.

  python bench/spec_cpu_data.py --model smol.gguf --out data.pt --n 768 --batch 64 --seconds 420
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from kestrel.engine.config import EngineConfig  # noqa: E402
from kestrel.engine.llm_engine import LLMEngine  # noqa: E402
from kestrel.spec.chat_prompts import chat_prompts  # noqa: E402
from kestrel.spec.prompt_set import varied_prompts  # noqa: E402
from kestrel.spec.static_generate import generate  # noqa: E402
from spec_decode import WORKLOADS  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=768, help="prompts (shuffled chat + varied)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=420, help="no new batch starts after this")
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args(argv)
    eng = LLMEngine(EngineConfig(model=a.model, device="cpu", dtype="float32", max_num_seqs=64, kv_cache_gb=0.5,
                                 enable_prefix_caching=False, progress=False))
    bench = {t for v in WORKLOADS.values() for t in v}
    texts = [t for t in chat_prompts(seed=a.seed) + varied_prompts(seed=a.seed) if t not in bench]
    random.Random(a.seed).shuffle(texts)
    texts = texts[:a.n]
    prompts = []
    for t in texts:
        ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    t0 = time.time()
    outs, hid = generate(eng.model, prompts, a.tokens, a.batch, [0.0] * len(prompts), eos_ids=(),
                         deadline=time.monotonic() + a.seconds, log=True)
    keep = [i for i, o in enumerate(outs) if o is not None]
    plens = [len(prompts[i]) for i in keep]
    torch.save({"seqs": [prompts[i] + outs[i] for i in keep], "plens": plens, "heldout": 0,
                "offs": [p - 1 for p in plens], "hidden": [hid[i].to(torch.bfloat16) for i in keep]}, a.out)
    n = sum(len(outs[i]) for i in keep)
    print(f"{len(keep)} sequences, {n} generated tokens in {time.time() - t0:.1f}s -> {a.out}")


if __name__ == "__main__":
    main()
