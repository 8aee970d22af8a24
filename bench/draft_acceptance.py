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
from kestrel.spec.acceptance import (draft_positions, format_stats, head_prefixes, match_prefix,  # noqa: E402
                                      slot_stats, table_header)
from kestrel.spec.draft_head import DraftHead  # noqa: E402
from kestrel.spec.ngram import ngram_draft_device  # noqa: E402
from kestrel.spec.train_draft import collect_hidden  # noqa: E402
from spec_decode import WORKLOADS, chat_prompts  # noqa: E402


@torch.inference_mode()
def prefixes(seqs, plens, k, model=None, hidden=None, head=None, hybrid_min_n: int | None = None, readout=None):
    """Accepted prefix length at every generated position: n-gram drafts (head=None), head drafts
    (kestrel.spec.acceptance, as train-draft's held-out split), or hybrid (the n-gram's where it matched an n-gram
    of >= hybrid_min_n tokens, the head's elsewhere; as the loop runs it)."""
    dev = model.embed_tokens.weight.device if model is not None else "cpu"
    if head is not None:
        head = head.to(dev, model.embed_tokens.weight.dtype).eval()
        if hybrid_min_n is None:
            return head_prefixes(head, seqs, plens, hidden, model.embed_tokens.weight, model.lm_head.weight, k,
                                 readout=readout)
    out = []
    for j, (s, p) in enumerate(zip(seqs, plens)):
        L = len(s)
        t = draft_positions(L, p, dev)
        toks = torch.tensor(s, device=dev)
        d, has, n = ngram_draft_device(toks[None].expand(len(t), L), t + 2, k, return_n=True)
        if head is not None:
            dh, _ = head.draft_greedy(hidden[j][t].to(dev), toks[t + 1], model.embed_tokens.weight,
                                      model.lm_head.weight, k, readout=readout, **_context(head, hidden[j], t))
            d = torch.where((n >= hybrid_min_n)[:, None], d, dh)
        idx = t[:, None] + 2 + torch.arange(k, device=dev)[None, :]
        valid = (idx < L) & (has[:, None] | (head is not None))
        out.append(match_prefix(d, toks[idx.clamp(max=L - 1)], valid).cpu())
    return torch.cat(out)


def _context(head, hidden, t) -> dict:
    """A context head's window of the last hidden states at positions t (hidden: the whole sequence's)."""
    if not getattr(head, "context", 0):
        return {}
    ctx, valid = head.context_window(hidden.to(t.device, head.fuse.weight.dtype), t, head.context)
    return {"ctx": ctx, "ctx_valid": valid}


@torch.inference_mode()
def tree_prefixes(seqs, plens, widths, model, hidden, head, readout=None, max_rows: int = 2048) -> torch.Tensor:
    """Accepted length of the best root-to-leaf path of the head's greedy draft tree (DraftHead.draft_tree) at every
    generated position: what verifying the whole tree at once (tree attention) would accept."""
    dev = model.embed_tokens.weight.device
    head = head.to(dev, model.embed_tokens.weight.dtype).eval()
    k, out = len(widths), []
    for j, (s, p) in enumerate(zip(seqs, plens)):
        L = len(s)
        t = draft_positions(L, p, dev)
        toks = torch.tensor(s, device=dev)
        idx = t[:, None] + 2 + torch.arange(k, device=dev)[None, :]
        for c in range(0, len(t), max_rows):
            tc, ic = t[c:c + max_rows], idx[c:c + max_rows]
            d = head.draft_tree(hidden[j][tc].to(dev), toks[tc + 1], model.embed_tokens.weight, model.lm_head.weight,
                                widths, readout=readout, **_context(head, hidden[j], tc))
            truth, valid = toks[ic.clamp(max=L - 1)][:, None, :], (ic < L)[:, None, :]
            out.append(((d == truth) & valid).long().cumprod(2).sum(2).amax(1).cpu())
    return torch.cat(out)


def tree_nodes(widths) -> int:
    """Draft tokens in the tree: sum over depths of the branches alive there."""
    n, P = 0, 1
    for w in widths:
        P *= w
        n += P
    return n


def table(name, pref: torch.Tensor, k: int, counts=None) -> list[str]:
    return [format_stats(name, slot_stats(pref, k, counts))]


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
    ap.add_argument("--eval-cache", default=None,
                    help="torch file of each workload's generated texts and hidden states: reused when it exists "
                         "(same model, --max-tokens and prompts), written otherwise; comparing heads one run at a "
                         "time then scores them on identical positions without regenerating")
    ap.add_argument("--trees", nargs="*", default=[],
                    help="draft trees to score as well, each as comma-separated widths per slot, e.g. 4,2,1,1 (top-4 "
                         "first tokens, top-2 under each, then greedy); depth = the number of widths (<= --k)")
    args = ap.parse_args(argv)
    if args.tokenizer:
        import kestrel.model.loader as loader
        from transformers import AutoTokenizer
        loader.load_tokenizer = lambda kind, path: AutoTokenizer.from_pretrained(args.tokenizer)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=64,
                                    kv_cache_gb=1.0, enable_prefix_caching=False, progress=False))
    k = args.k
    lines = [f"device {args.device} {args.dtype}, greedy, {args.max_tokens} tokens per prompt, engine "
             f"{engine.model_name}; walk = tokens/verify walking each text as the speculative loop does "
             f"(acceptance.walk_tokens_per_verify)", "", *table_header(k, walk=True)]
    for wl in args.workloads:
        texts = WORKLOADS[wl][:args.num_prompts] if args.num_prompts else WORKLOADS[wl]
        prompts = chat_prompts(engine.tokenizer, len(texts), texts=texts)
        cache = f"{args.eval_cache}.{wl}" if args.eval_cache else None
        if cache and os.path.isfile(cache):
            c = torch.load(cache)
            seqs, hidden = c["seqs"], [h.to(args.device) for h in c["hidden"]]
            if [q[:len(p)] for q, p in zip(seqs, prompts)] != prompts or c["max_tokens"] != args.max_tokens:
                raise ValueError(f"--eval-cache {cache}: other prompts or --max-tokens")
        else:
            outs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                           ignore_eos=True))
            seqs = [p + o.output_token_ids for p, o in zip(prompts, outs)]
            hidden = collect_hidden(engine.model, seqs, args.device, progress=False, max_tokens=4096,
                                    dtype=engine.model.embed_tokens.weight.dtype)
            if cache:
                torch.save({"seqs": seqs, "hidden": [h.cpu() for h in hidden], "max_tokens": args.max_tokens}, cache)
        plens = [len(p) for p in prompts]
        cnt = [len(draft_positions(len(q), p)) for q, p in zip(seqs, plens)]
        lines += table(f"{wl}: ngram", prefixes(seqs, plens, k), k, cnt)
        for h in args.head:
            head = DraftHead.load(h).to(engine.model.embed_tokens.weight.device, engine.model.embed_tokens.weight.dtype)
            name = os.path.basename(h)
            # the engine drafts over the head's draft vocabulary where it has one (subset_readout)
            ro = head.subset_readout(engine.model.embed_tokens.weight, engine.model.lm_head.weight)
            lines += table(f"{wl}: head {name}", prefixes(seqs, plens, k, engine.model, hidden, head, readout=ro), k, cnt)
            if ro is not None:
                lines += table(f"{wl}: head {name}, full-vocabulary readout",
                               prefixes(seqs, plens, k, engine.model, hidden, head), k, cnt)
            for tr in args.trees:
                w = [int(x) for x in tr.split(",")]
                lines += table(f"{wl}: head {name}, tree {tr} ({tree_nodes(w)} draft tokens)",
                               tree_prefixes(seqs, plens, w, engine.model, hidden, head, readout=ro), k, cnt)
            for mn in (1, 2, 3):
                lines += table(f"{wl}: hybrid (n-gram if n>={mn}, else head) {name}",
                               prefixes(seqs, plens, k, engine.model, hidden, head, mn, readout=ro), k, cnt)
        print("\n".join(lines[-1 - (5 + len(args.trees)) * len(args.head):]), flush=True)
    text = "\n".join(lines) + f"\n\n({time.perf_counter() - t0:.0f} s)\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
