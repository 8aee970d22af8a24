"""Greedy speculative decoding through the padded verify step (kestrel/spec/verify_graph.py, the shapes the CUDA
graphs replay) vs plain decoding, on the real SmolLM2 in float32 on the CPU (no capture; Triton interpreted, slow:
~17 min for 32 tokens on 2 cores). Prints whether every output is token-identical.

    TRITON_INTERPRET=1 python bench/spec_padded_check.py 32
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
from kestrel.spec.verify_graph import VerifyGraphs  # noqa: E402
from spec_decode import WORKLOADS, chat_prompts  # noqa: E402


def main(max_tokens: int) -> int:
    e = LLMEngine(progress=False, max_num_seqs=4, async_scheduling=False, num_kv_blocks=256)
    prompts = chat_prompts(e.tokenizer, 2, texts=WORKLOADS["edit"]) + chat_prompts(e.tokenizer, 1, texts=WORKLOADS["chat"])
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ref = [o.output_token_ids for o in e.generate(prompts, p)]
    e.spec = build_spec_decoder(e, parse_speculative("drafter=ngram,k=4"))
    b = e.runner.backend
    vg = VerifyGraphs(e.model, b.k_cache, b.v_cache, [1, 2, 4], [1, 2, 4], -(-e.max_model_len // e.runner.block_size),
                      capture=False)
    calls, run = [], vg.run
    vg.run = lambda rows, K=None: calls.append(len(rows)) or run(rows, K)
    e.spec.graphs = vg
    t = time.time()
    got = [o.output_token_ids for o in e.generate(prompts, p)]
    same = [a == b for a, b in zip(got, ref)]
    print("padded-path steps", len(calls), "identical", all(same), same, e.stats()["spec_mean_accepted_length"],
          f"{time.time() - t:.0f}s")
    print(e.tokenizer.decode(got[0]))
    return 0 if all(same) and calls else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 32))
