"""Is a greedy speculative output that differs from plain decoding a bug or rounding? Runs the same engine code
(CPU, eager paths, n-gram k=4) in float32 and in bfloat16 and prints, per prompt, whether the outputs are identical
and the common prefix. float32 must be identical; in bfloat16 the verify forward (k+1 tokens per row) rounds
differently from the decode forward (1 token), so near-ties flip.

    python bench/spec_numerics.py 96 bfloat16 float32
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kestrel.spec  # noqa: E402,F401
from kestrel.engine.llm_engine import LLMEngine  # noqa: E402
from kestrel.engine.sampling_params import SamplingParams  # noqa: E402
from kestrel.spec.config import parse_speculative  # noqa: E402
from kestrel.spec.factory import build_spec_decoder  # noqa: E402
from spec_decode import WORKLOADS, _prefix, chat_prompts  # noqa: E402


def main(max_tokens: int, dtypes: list[str]) -> None:
    for dtype in dtypes:
        e = LLMEngine(progress=False, max_num_seqs=4, async_scheduling=False, num_kv_blocks=256, dtype=dtype)
        prompts = chat_prompts(e.tokenizer, 4, texts=WORKLOADS["chat"])
        p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        t = time.time()
        ref = [o.output_token_ids for o in e.generate(prompts, p)]
        e.spec = build_spec_decoder(e, parse_speculative("drafter=ngram,k=4"))
        got = [o.output_token_ids for o in e.generate(prompts, p)]
        print(dtype, "same", sum(a == b for a, b in zip(got, ref)), "/", len(ref), "common prefix",
              [_prefix(a, b) for a, b in zip(got, ref)], f"{time.time() - t:.0f}s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 96, sys.argv[2:] or ["bfloat16", "float32"])
