"""Bounded SWA KV + replay (kestrel/engine/swa_kv.py): KV blocks held and tokens replayed, on the CPU.

A random model with gpt-oss-20b's attention layout (24 layers alternating sliding/full, window 128, 8 KV heads
of 64) but tiny hidden/MLP sizes, so it runs on a CPU; block counts do not depend on those sizes. Request 1
prefills a long prefix; request 2 shares it, adds its own tokens and decodes. Three engines, same weights:
full-length KV for every layer (--no-swa-bounded-kv), bounded SWA KV with the exact replay (default), and
bounded with DeepInfer's plain `window`-token replay (--swa-replay-tokens 128 --no-swa-replay-exact).
Prints, for request 2: tokens run through the model for its prompt, tokens replayed, KV blocks it holds at
the end (per pool, and as bytes for the real gpt-oss-20b shape in bf16) and its max |logit| difference
from the full-length-KV engine. No timing.

    python bench/swa_replay.py [--prefix 4000] [--new 64]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

LAYERS, WINDOW, BS = 24, 128, 16
SHAPE = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
             num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
             sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))
LAYER_BLOCK_BYTES = 2 * BS * 8 * 64 * 2  # K+V of one block of one layer, gpt-oss-20b (8 KV heads x 64, bf16)


def run(label, prefix, new, **kw):
    eng = LLMEngine(EngineConfig(load_format="dummy", model_shape=SHAPE, block_size=BS, kv_cache_gb=1.0,
                                 max_num_batched_tokens=1024, async_scheduling=False, progress=False, **kw))
    g = torch.Generator().manual_seed(0)
    common = torch.randint(3, 512, (prefix,), generator=g).tolist()
    p1 = common + torch.randint(3, 512, (16,), generator=g).tolist()
    p2 = common + torch.randint(3, 512, (16,), generator=g).tolist()
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    eng.generate([p1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    rows, fwd = [], eng.runner.forward_step

    def capture(batch):
        order, logits = fwd(batch)
        if logits is not None:
            rows.extend(logits.clone())
        return order, logits
    eng.runner.forward_step = capture
    before = eng.num_prompt_tokens
    eng.add_request("r2", p2, params)
    seq, held = eng.seqs["r2"], None
    while eng.has_unfinished():
        if not seq.is_finished:  # blocks it holds going into its last step
            held = (len(seq.block_table), getattr(eng.block_manager, "swa_blocks_held", lambda s: 0)(seq))
        eng.step()
    plan = eng.swa_plan
    n_swa = LAYERS // 2
    full_layers = LAYERS if plan is None else LAYERS - n_swa
    layer_blocks = held[0] * full_layers + held[1] * n_swa
    st = eng.stats()
    return dict(label=label, prompt_run=eng.num_prompt_tokens - before, replayed=st.get("swa_replayed_tokens", 0),
                replay_len=plan.replay_tokens if plan else "-", full_blocks=held[0], swa_blocks=held[1],
                layer_blocks=layer_blocks, mib=layer_blocks * LAYER_BLOCK_BYTES / 2**20,
                logits=torch.stack(rows), tokens=seq.output_token_ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=4000, help="shared prefix length (tokens)")
    ap.add_argument("--new", type=int, default=64, help="tokens request 2 generates")
    a = ap.parse_args()
    runs = [run("full-length KV (--no-swa-bounded-kv)", a.prefix, a.new, swa_bounded_kv=False),
            run("bounded, exact replay (default)", a.prefix, a.new),
            run("bounded, 128-token replay (--no-swa-replay-exact)", a.prefix, a.new, swa_replay_exact=False)]
    ref = runs[0]
    L = a.prefix + 16 + a.new
    print(f"gpt-oss-20b attention layout ({LAYERS} layers, {LAYERS // 2} sliding, window {WINDOW}), block {BS}; "
          f"request 2: {a.prefix}-token cached prefix + 16 own tokens, {a.new} generated (length {L})")
    print("| engine | replay R | prompt tokens run | replayed | full-attn blocks | SWA blocks | layer-blocks | "
          "KV MiB (gpt-oss-20b bf16) | max abs logit diff vs full-length | same greedy tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        diff = (r["logits"] - ref["logits"]).abs().max().item()
        print(f"| {r['label']} | {r['replay_len']} | {r['prompt_run']} | {r['replayed']} | {r['full_blocks']} | "
              f"{r['swa_blocks']} | {r['layer_blocks']} | {r['mib']:.1f} | {diff:.2e} | {r['tokens'] == ref['tokens']} |")
    saved = 1 - runs[1]["layer_blocks"] / ref["layer_blocks"]
    print(f"bounded SWA KV holds {runs[1]['layer_blocks']} of {ref['layer_blocks']} layer-blocks for request 2 "
          f"({saved:.1%} less KV memory)")


if __name__ == "__main__":
    main()
