"""GPU smoke check of the engine (no timing): async vs sync scheduling give identical greedy tokens and identical
seeded samples (temperature/top-k/top-p) on dummy weights of a real shape.

    python bench/engine_gpu_smoke.py --shape llama-3-8b [--tokenizer DIR]

--tokenizer: a saved HF tokenizer dir, for machines without the embedded GGUF (e.g. copy
~/.cache/kestrel/tokenizers/<SmolLM2 key> along); prompts are token ids, so any tokenizer with ids < vocab works."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kestrel.model.loader as loader  # noqa: E402
from kestrel.engine.llm_engine import LLMEngine  # noqa: E402
from kestrel.engine.sampling_params import SamplingParams  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b", help="model shape name, or 'tiny'")
    ap.add_argument("--tokenizer", help="HF tokenizer dir to use instead of the embedded model's")
    args = ap.parse_args()
    if args.tokenizer:
        loader.resolve = lambda model: ("hf", args.tokenizer, "dummy")  # only the tokenizer is read for dummy weights
    shape = TINY if args.shape == "tiny" else args.shape
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[(7 * i + j) % 200 + 1 for j in range(40 + 9 * i)] for i in range(6)]
    sampled = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=11 + i, ignore_eos=True)
               for i in range(3)]
    outs = {}
    for async_on in (False, True):
        t = time.time()
        e = LLMEngine(load_format="dummy", model_shape=shape, device=dev, progress=False, seed=0, max_model_len=1024,
                      dtype="bfloat16" if dev == "cuda" else "float32", async_scheduling=async_on)
        greedy = e.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        samples = e.generate(prompts[:3], sampled)
        outs[async_on] = ([o.output_token_ids for o in greedy], [o.output_token_ids for o in samples])
        print(f"{'async' if async_on else 'sync'}: {time.time() - t:.1f}s", flush=True)
        del e
    print("greedy async == sync:", outs[True][0] == outs[False][0])
    print("seeded sampling async == sync:", outs[True][1] == outs[False][1])
    sys.exit(0 if outs[True] == outs[False] else 1)


if __name__ == "__main__":
    main()
