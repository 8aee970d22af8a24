"""Give a draft head that has none a draft vocabulary (the most frequent tokens of a short greedy generation by the
target on train-draft's chat + varied prompts, as `kestrel train-draft --draft-vocab` stores), weights unchanged.
For timing an older head through the draft-vocabulary / fused drafting path without retraining it.

  python bench/spec_add_vocab.py --model smol.gguf --tokenizer tok --head in.safetensors --out out.safetensors
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


@torch.inference_mode()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--head", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--size", type=int, default=8192)
    args = ap.parse_args(argv)
    if args.tokenizer:
        import kestrel.model.loader as loader
        from transformers import AutoTokenizer
        loader.load_tokenizer = lambda kind, path: AutoTokenizer.from_pretrained(args.tokenizer)
    from kestrel.model import load_model
    from kestrel.spec.chat_prompts import chat_prompts
    from kestrel.spec.draft_head import DraftHead
    from kestrel.spec.prompt_set import varied_prompts
    from kestrel.spec.static_generate import generate
    from kestrel.spec.train_cli import frequent_tokens
    t0 = time.time()
    lm = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device, progress=False)
    tok = lm.tokenizer
    n = args.num_prompts
    texts = chat_prompts(n // 2) + varied_prompts(n - n // 2)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in texts]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    outs, _ = generate(lm.model, prompts, args.gen_tokens, 1024, want_hidden=False)
    head = DraftHead.load(args.head)
    seqs = [p + o for p, o in zip(prompts, outs)]
    head.vocab, cover = frequent_tokens(seqs, [len(p) for p in prompts], args.size, lm.model.lm_head.weight.shape[0])
    head.save(args.out, {k: v for k, v in head.meta.items() if k != "kestrel_draft_head"}, dtype=torch.bfloat16)
    print(f"draft vocabulary {len(head.vocab)} tokens cover {cover:.4f} of {sum(map(len, outs))} generated tokens; "
          f"saved {args.out} in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
