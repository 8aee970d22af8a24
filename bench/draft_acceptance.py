"""Held-out acceptance of drafters, per slot, without timing: what greedy verification would accept.

The target generates greedy continuations of prompts the head never saw (bench/spec_decode.py's `chat` and `edit`
workloads); at every generated position t the drafter proposes k tokens from what a speculative step would hand
it (draft head: the target's hidden state h_t and token x_{t+1}; n-gram: the tokens up to x_{t+1}), and the
proposal is compared with the target's own next tokens x_{t+2..t+k+1}. Under greedy verification draft token i
is accepted iff it and every earlier one match, so this is the acceptance of a speculative run (up to numerics:
the hidden states here come from one full forward, not the paged decode path).

Prints per slot i: P(accept i | accepted < i) and P(prefix >= i), and the expected tokens per verification
(accepted prefix + the target's own token) for fixed k = 1..K.

  python bench/draft_acceptance.py --head H.safetensors [--head H2 ...] --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from kestrel.engine.config import EngineConfig  # noqa: E402
from kestrel.engine.llm_engine import LLMEngine  # noqa: E402
from kestrel.engine.sampling_params import SamplingParams  # noqa: E402
from kestrel.spec.draft_head import DraftHead  # noqa: E402
from kestrel.spec.ngram import ngram_draft_device  # noqa: E402
from kestrel.spec.train_draft import collect_hidden  # noqa: E402
from spec_decode import WORKLOADS, chat_prompts  # noqa: E402


def match_prefix(draft: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, k] drafts vs true next tokens (valid: the true token exists) -> accepted prefix length [N]."""
    return ((draft == truth) & valid).long().cumprod(1).sum(1)


@torch.inference_mode()
def prefixes(seqs, plens, k, model=None, hidden=None, head=None, hybrid_min_n: int | None = None):
    """Accepted prefix length at every generated position: n-gram drafts (head=None), head drafts, or hybrid
    (the n-gram's where it matched an n-gram of >= hybrid_min_n tokens, the head's elsewhere; as the loop runs it).
    Every position is one row of the device n-gram lookup over the whole sequence cut at its length."""
    dev = model.embed_tokens.weight.device if model is not None else "cpu"
    if head is not None:
        head = head.to(dev, model.embed_tokens.weight.dtype).eval()
    out = []
    for j, (s, p) in enumerate(zip(seqs, plens)):
        L = len(s)
        t = torch.arange(p - 1, L - 2, device=dev)  # h_t produced x_{t+1}, a generated token; x_{t+2} exists
        toks = torch.tensor(s, device=dev)
        d, has, n = ngram_draft_device(toks[None].expand(len(t), L), t + 2, k, return_n=True)
        if head is not None:
            dh, _ = head.draft_greedy(hidden[j][t].to(dev), toks[t + 1], model.embed_tokens.weight,
                                      model.lm_head.weight, k)
            d = dh if hybrid_min_n is None else torch.where((n >= hybrid_min_n)[:, None], d, dh)
        idx = t[:, None] + 2 + torch.arange(k, device=dev)[None, :]
        valid = (idx < L) & (has[:, None] | (head is not None))
        out.append(match_prefix(d, toks[idx.clamp(max=L - 1)], valid).cpu())
    return torch.cat(out)


def table(name, pref: torch.Tensor, k: int) -> list[str]:
    n = pref.numel()
    reach = [(pref >= i).float().mean().item() for i in range(k + 1)]  # reach[0] = 1
    cond = [reach[i] / reach[i - 1] if reach[i - 1] > 0 else 0.0 for i in range(1, k + 1)]
    exp = [1 + sum(reach[1:j + 1]) for j in range(1, k + 1)]
    return [f"| {name} | {n} | " + " | ".join(f"{c:.3f}" for c in cond) + " | "
            + " | ".join(f"{r:.3f}" for r in reach[1:]) + " | " + " | ".join(f"{e:.2f}" for e in exp) + " |"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--head", action="append", default=[], help="draft head file (repeatable)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["chat", "edit"], choices=list(WORKLOADS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=None, help="cut each workload to this many prompts")
    ap.add_argument("--out", default=None, help="append the markdown table to this file")
    args = ap.parse_args(argv)
    if args.tokenizer:
        import kestrel.model.loader as loader
        from transformers import AutoTokenizer
        loader.load_tokenizer = lambda kind, path: AutoTokenizer.from_pretrained(args.tokenizer)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=64,
                                    kv_cache_gb=1.0, enable_prefix_caching=False, progress=False))
    k = args.k
    hdr = ("| drafter | positions | " + " | ".join(f"P(acc {i} \\| <{i})" for i in range(1, k + 1)) + " | "
           + " | ".join(f"P(prefix>={i})" for i in range(1, k + 1)) + " | "
           + " | ".join(f"tokens/verify k={j}" for j in range(1, k + 1)) + " |")
    lines = [f"device {args.device} {args.dtype}, greedy, {args.max_tokens} tokens per prompt, engine "
             f"{engine.model_name}", "", hdr, "|---" * (2 + 3 * k) + "|"]
    for wl in args.workloads:
        texts = WORKLOADS[wl][:args.num_prompts] if args.num_prompts else WORKLOADS[wl]
        prompts = chat_prompts(engine.tokenizer, len(texts), texts=texts)
        outs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
        seqs = [p + o.output_token_ids for p, o in zip(prompts, outs)]
        plens = [len(p) for p in prompts]
        hidden = collect_hidden(engine.model, seqs, args.device, progress=False, max_tokens=4096,
                                dtype=engine.model.embed_tokens.weight.dtype)
        lines += table(f"{wl}: ngram", prefixes(seqs, plens, k), k)
        for h in args.head:
            head = DraftHead.load(h)
            name = os.path.basename(h)
            lines += table(f"{wl}: head {name}", prefixes(seqs, plens, k, engine.model, hidden, head), k)
            for mn in (1, 2, 3):
                lines += table(f"{wl}: hybrid (n-gram if n>={mn}, else head) {name}",
                               prefixes(seqs, plens, k, engine.model, hidden, head, mn), k)
        print("\n".join(lines[-1 - 4 * len(args.head):]), flush=True)
    text = "\n".join(lines) + f"\n\n({time.perf_counter() - t0:.0f} s)\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
