"""`kestrel train-draft`: train the semi-autoregressive draft head on text the target model generates itself."""
from __future__ import annotations

import argparse
import json
import os
import time

DEFAULT_PROMPTS = [
    "Explain how a hash table works.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Write a Python function that reverses a linked list.",
    "Summarize the plot of Romeo and Juliet.", "Give me five tips for better sleep.",
    "How does photosynthesis work?", "Write a haiku about autumn rain.", "What is the difference between TCP and UDP?",
    "Describe the water cycle for a ten-year-old.", "Write an email asking my manager for a day off.",
    "List the planets of the solar system with one fact each.", "How do I make a simple tomato sauce?",
    "Explain recursion with an example.", "What is machine learning?", "Write a limerick about a cat.",
    "Why is the sky blue?", "Compare Python and JavaScript.", "Give a recipe for pancakes.",
    "What happened during the French Revolution?", "Write a SQL query that counts orders per customer.",
    "Explain the rules of chess briefly.", "How do vaccines work?", "Write a motivational speech for a team.",
    "What is the Pythagorean theorem?", "Describe a day in the life of a medieval farmer.",
    "How can I improve my public speaking?", "Explain what an API is.", "Write a poem about the ocean.",
    "What are the benefits of regular exercise?", "Explain Git branching to a beginner.",
    "Write a dialogue between a robot and a child.",
]


def add_parser(subparsers):
    p = subparsers.add_parser(
        "train-draft", help="train a speculative-decoding draft head by self-distillation",
        description="Self-distillation of the semi-autoregressive draft head: the target model generates text "
                    "from a set of prompts, then the head learns to predict the target's next k tokens from its "
                    "hidden states. Use the result with --speculative drafter=head,head=FILE.")
    p.add_argument("model", nargs="?", default=None,
                   help="target model (HF directory, .gguf file); default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--out", default="draft_head.safetensors", help="output file (default: %(default)s)")
    p.add_argument("--k", type=int, default=4, help="draft tokens the head proposes (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="MLP blocks in the parallel backbone (default: %(default)s)")
    p.add_argument("--prompts", default=None, help="text file, one prompt per line, 'varied' = the generated "
                   "topic x task set of kestrel/spec/prompt_set.py (~7k prompts), 'chat' = the human-style requests of "
                   "kestrel/spec/chat_prompts.py (code, poems, how-tos, emails; ~1.9k), 'self' = prompts the target writes "
                   "itself (as many as --num-prompts needs), or several joined by '+' (e.g. varied+self: 'self' "
                   "fills what the others leave; default: 32 built-in prompts)")
    p.add_argument("--self-prompt-tokens", type=int, default=40, help="longest self-written prompt (default: %(default)s)")
    p.add_argument("--self-prompt-sample-tokens", type=int, default=8,
                   help="first tokens of a self-written prompt sampled at temperature 1, the rest greedy "
                        "(default: %(default)s)")
    p.add_argument("--generator", choices=["static", "engine"], default="static",
                   help="'static' = lockstep batched generation that also returns the hidden states (fast); "
                        "'engine' = the serving engine, then a second pass for the hidden states (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate all --gen-tokens, past the end of the answer too: benchmarks with ignore_eos "
                        "(bench/spec_decode.py) draft there as well (session 3 R2: answers averaged 101 of 128 tokens)")
    p.add_argument("--gen-seconds", type=float, default=None,
                   help="time box for generating the training sequences (static generator): no new batch starts "
                        "after it, training uses what was made (default: no limit)")
    p.add_argument("--heldout", type=float, default=0.05,
                   help="share of distinct prompts held out (generated greedily, never trained on): train-draft "
                        "reports the head's greedy acceptance per slot there and on as many training sequences "
                        "(default: %(default)s)")
    p.add_argument("--train-positions", choices=["generated", "all"], default="generated",
                   help="positions trained on: past each prompt, where the head drafts at inference, or all "
                        "(default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    p.add_argument("--mult", type=int, default=2, help="MLP width multiple of the backbone blocks (default: %(default)s)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the head's vocab readout on CUDA (default on)")
    p.add_argument("--num-prompts", type=int, default=64, help="generations to train on (prompts are cycled; "
                   "default: %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens the target generates per prompt (default: %(default)s)")
    p.add_argument("--gen-temperature", type=float, default=0.7,
                   help="sampling temperature of the target's generations (default: %(default)s)")
    p.add_argument("--greedy-fraction", type=float, default=0.0,
                   help="share of generations made greedily (greedy verification accepts the argmax chain; the "
                        "rest use --gen-temperature for variety; default: %(default)s)")
    p.add_argument("--gen-batch", type=int, default=256, help="concurrent generations (default: %(default)s)")
    p.add_argument("--pack-tokens", type=int, default=4096,
                   help="tokens per target forward when collecting hidden states (default: %(default)s)")
    p.add_argument("--recurrent", action=argparse.BooleanOptionalAction, default=True,
                   help="sequential refiner reads the previous slot's state (the whole drafted chain; default on)")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved weights (default: %(default)s)")
    p.add_argument("--data", default=None, help="JSON file of generated token sequences: reused when it exists, "
                   "written after generating otherwise (skip regeneration when retraining)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not wrap prompts in the chat template")
    p.add_argument("--init", default=None, help="start from this trained head (same target, same --k) instead of "
                   "a fresh one: training continues on newly generated text (e.g. one time-boxed GPU job after another)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="store this many most frequent tokens of the generated text with the head: greedy "
                        "drafting reads out over them only (a full-vocabulary readout per slot is a third of a "
                        "proposal's device time); 0 = the full vocabulary (default: %(default)s)")
    p.add_argument("--save-every", type=float, default=None,
                   help="also save the head (to --out) every so many seconds of training, so a job killed by its "
                        "time limit still leaves the latest head (default: only at the end)")
    p.add_argument("--context", type=int, default=0,
                   help="context attention over the target's last N hidden states (DraftHead context=N; with --init "
                        "a context-free head grows it, starting as that head; offline-only so far: the loop cannot "
                        "draft with it yet; default: %(default)s = none)")
    p.add_argument("--freeze-base", action="store_true",
                   help="with --context: train only the context attention (ctx_*), the --init head's weights stay "
                        "as they are (little data: fine-tuning all of a head trained on millions of tokens overfits)")
    p.add_argument("--hidden-cache", default=None,
                   help="torch file of the generated sequences and their hidden states: reused when it exists, "
                        "written otherwise (retraining skips both generation and the hidden-state pass)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: 500; with --max-seconds, as many as the clock allows)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop training after this many seconds (the LR schedule follows the clock; default: no limit)")
    p.add_argument("--batch-positions", type=int, default=256, help="positions per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--vocab-subset", choices=["auto", "on", "off"], default="auto",
                   help="train the readout only over tokens seen in the generated text (~10x cheaper; auto = on for "
                        "CPU; default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="target dtype for generation (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="'dummy' = random target weights (tests; default: %(default)s)")
    p.add_argument("--model-shape", type=json.loads, default=None,
                   help="JSON model config overrides for --load-format dummy")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show progress bars")
    return p


def _check(args):
    if args.steps is None and not args.max_seconds:  # with a time box alone the clock ends training (session 16:
        args.steps = 500  # the then-default 500 steps cut a 50 s box after 12 s)
    for name in ("k", "layers", "num_prompts", "gen_tokens", "steps", "batch_positions", "gen_batch", "mult"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        raise ValueError("--lr must be > 0")
    if args.max_seconds is not None and args.max_seconds <= 0:
        raise ValueError("--max-seconds must be > 0")
    if not 0.0 <= args.greedy_fraction <= 1.0:
        raise ValueError("--greedy-fraction must be in [0, 1]")
    if not 0.0 <= args.heldout < 0.5:
        raise ValueError("--heldout must be in [0, 0.5)")
    for src in (args.prompts or "").split("+"):
        if src and src not in ("varied", "chat", "self") and not os.path.isfile(src):
            raise ValueError(f"--prompts file {src!r} not found")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise ValueError(f"output directory {out_dir!r} does not exist")


def _prompt_texts(engine, args) -> list[str]:
    """Distinct prompt texts from the --prompts sources ('self' fills up to --num-prompts)."""
    texts, want_self = [], False
    for src in (args.prompts or "builtin").split("+"):
        if src == "builtin":
            texts += DEFAULT_PROMPTS
        elif src == "varied":
            from kestrel.spec.prompt_set import varied_prompts
            texts += varied_prompts(seed=args.seed)
        elif src == "chat":
            from kestrel.spec.chat_prompts import chat_prompts
            texts += chat_prompts(seed=args.seed)
        elif src == "self":
            want_self = True
        else:
            with open(src) as f:
                got = [line.strip() for line in f if line.strip()]
            if not got:
                raise ValueError(f"--prompts file {src!r} holds no prompts")
            texts += got
    texts = list(dict.fromkeys(texts))
    if want_self and len(texts) < args.num_prompts:
        from kestrel.spec.self_prompts import self_written_prompts
        t0 = time.time()
        own = self_written_prompts(engine.model, engine.tokenizer, args.num_prompts - len(texts),
                                   engine.model_config.eos_token_ids, seed=args.seed,
                                   max_tokens=args.self_prompt_tokens, sample_tokens=args.self_prompt_sample_tokens,
                                   batch_size=max(args.gen_batch, 512))
        print(f"the target wrote {len(own)} distinct prompts in {time.time() - t0:.1f}s", flush=True)
        texts = list(dict.fromkeys(texts + own))
        import random
        random.Random(args.seed).shuffle(texts)  # the held-out split below takes from the front: mix the sources
    return texts


def _encode_all(engine, args, texts: list[str]) -> list[list[int]]:
    """Chat-templated token ids of every prompt. The template is rendered once around a marker and the texts are
    batch-encoded between its two halves (apply_chat_template took ~1 ms per prompt: 16 s for 16k); checked
    against the full template on the first prompts, which it must reproduce exactly, else the slow path."""
    tok = engine.tokenizer
    if not (args.chat and getattr(tok, "chat_template", None)):
        return [tok.encode(t) for t in texts]

    def full(t):
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    mark = "\x00KESTREL\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True, tokenize=False)
    if text.count(mark) == 1:
        pre, post = (tok.encode(x, add_special_tokens=False) for x in text.split(mark))
        body = tok(texts, add_special_tokens=False)["input_ids"]
        out = [pre + list(b) + post for b in body]
        if all(out[i] == full(texts[i]) for i in range(min(32, len(texts)))):
            return out
    return [full(t) for t in texts]


def _generate(engine, args):
    """The target's own continuations of the prompts. Returns (seqs = prompt + output ids, prompt lengths, number
    of held-out sequences at the front (greedy, distinct prompts), hidden states or None, their offsets)."""
    import torch

    from kestrel.engine.sampling_params import SamplingParams

    texts = _prompt_texts(engine, args)
    n_ho = round(args.heldout * min(args.num_prompts, len(texts))) if len(texts) > 1 else 0
    n_train = max(args.num_prompts - n_ho, 1)
    train_texts = texts[n_ho:] or texts
    chosen = texts[:n_ho] + [train_texts[i % len(train_texts)] for i in range(n_train)]
    prompts = _encode_all(engine, args, chosen)
    n_greedy = round(args.greedy_fraction * n_train)  # every 1/fraction-th generation greedy, spread out
    greedy = {n_ho + int(i * n_train / n_greedy) for i in range(n_greedy)} if n_greedy else set()
    temps = [0.0 if i < n_ho or i in greedy else args.gen_temperature for i in range(len(prompts))]
    if args.generator == "static":
        from kestrel.spec.static_generate import generate
        dev = engine.model.embed_tokens.weight.device
        g = torch.Generator(device=dev).manual_seed(args.seed)
        kw = dict(eos_ids=() if args.ignore_eos else engine.model_config.eos_token_ids, generator=g,
                  log=not args.progress)
        outs, hidden = generate(engine.model, prompts[:n_ho], args.gen_tokens, args.gen_batch, temps[:n_ho], **kw)
        deadline = time.monotonic() + args.gen_seconds if args.gen_seconds else None
        o2, h2 = generate(engine.model, prompts[n_ho:], args.gen_tokens, args.gen_batch, temps[n_ho:],
                          deadline=deadline, **kw)
        keep = [i for i, o in enumerate(o2) if o is not None]  # the time box may leave some out
        prompts = prompts[:n_ho] + [prompts[n_ho + i] for i in keep]
        outs, hidden = outs + [o2[i] for i in keep], hidden + [h2[i] for i in keep]
        offs = [len(p) - 1 for p in prompts]
    else:
        params = [SamplingParams(max_tokens=args.gen_tokens, temperature=t, seed=args.seed + i,
                                 ignore_eos=args.ignore_eos) for i, t in enumerate(temps)]
        outs = [o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=args.progress)]
        hidden, offs = None, None
    seqs = [p + o for p, o in zip(prompts, outs)]
    return seqs, [len(p) for p in prompts], n_ho, hidden, offs


def frequent_tokens(seqs, plens, n: int, vocab_size: int):
    """The n most frequent tokens past the prompts (sorted by id) and the share of those tokens they cover."""
    import torch
    gen = torch.tensor([t for s, p in zip(seqs, plens) for t in s[p:]] or [0])
    counts = torch.bincount(gen, minlength=vocab_size)
    top = counts.argsort(descending=True)[:min(n, vocab_size)]
    return top.sort().values, float(counts[top].sum()) / max(int(counts.sum()), 1)


def _load_data(path: str, vocab_size: int):
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):  # the older format: sequences only (no prompt lengths: train everywhere)
        data = {"seqs": data, "prompt_lens": None, "heldout": 0}
    seqs = data.get("seqs") if isinstance(data, dict) else None
    if not (isinstance(seqs, list) and all(isinstance(q, list) and all(isinstance(t, int) and 0 <= t < vocab_size
                                                                       for t in q) for q in seqs)):
        raise ValueError(f"--data {path!r} is not a JSON list of token-id lists within the vocabulary")
    plens = data.get("prompt_lens")
    return seqs, plens if plens is not None else [1] * len(seqs), int(data.get("heldout", 0))


def _acceptance_report(head, engine, split: dict, k: int) -> tuple[list[str], dict]:
    """Greedy acceptance per slot on held-out and on as many training sequences, with the head in the target's
    dtype as the engine runs it."""
    import copy

    from kestrel.spec.acceptance import draft_positions, format_stats, head_prefixes, slot_stats, table_header
    emb, lm = engine.model.embed_tokens.weight, engine.model.lm_head.weight
    h = copy.deepcopy(head).to(emb.device, emb.dtype).eval()
    lines, out = table_header(k, walk=True), {}
    ro = h.subset_readout(emb, lm)  # as HeadDrafter drafts; the full-vocabulary row shows what the subset costs
    for name, (seqs, plens, hid, offs) in split.items():
        if not seqs:
            continue
        cnt = [len(draft_positions(len(q), max(p, o + 1))) for q, p, o in zip(seqs, plens, offs)]
        st = slot_stats(head_prefixes(h, seqs, plens, hid, emb, lm, k, hidden_offsets=offs, readout=ro), k, cnt)
        lines.append(format_stats(f"{name} ({len(seqs)} seqs)", st))
        if ro is not None and name == "held-out":
            full = slot_stats(head_prefixes(h, seqs, plens, hid, emb, lm, k, hidden_offsets=offs), k, cnt)
            lines.append(format_stats(f"{name}, full-vocabulary readout", full))
        out[name] = {"cond": [round(x, 3) for x in st["cond"]], "tokens_per_verify": round(st["tokens_per_verify"][-1], 3),
                     "walk": round(st["walk"][-1], 3)}
    return lines, out


def run(args) -> int:
    _check(args)
    import torch

    from kestrel.engine.config import EngineConfig
    from kestrel.engine.llm_engine import LLMEngine
    from kestrel.spec.draft_head import DraftHead
    from kestrel.spec.train_draft import collect_hidden, train_head

    torch.manual_seed(args.seed)
    if str(args.device).startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 for the head's fp32 training matmuls
    t0 = time.time()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
                                    load_format=args.load_format, model_shape=args.model_shape,
                                    progress=args.progress, max_num_seqs=min(args.gen_batch, 256),
                                    cuda_graphs=args.generator == "engine"))
    model = engine.model
    hidden = offs = None
    if args.hidden_cache and os.path.isfile(args.hidden_cache):
        c = torch.load(args.hidden_cache)
        seqs, plens, n_ho, hidden, offs = c["seqs"], c["plens"], int(c.get("heldout", 0)), c["hidden"], c["offs"]
        print(f"loaded {len(seqs)} sequences and hidden states from {args.hidden_cache}")
    elif args.data and os.path.isfile(args.data):
        seqs, plens, n_ho = _load_data(args.data, engine.model_config.vocab_size)
        print(f"loaded {len(seqs)} sequences ({sum(map(len, seqs))} tokens) from {args.data}")
    else:
        seqs, plens, n_ho, hidden, offs = _generate(engine, args)
        n_out = sum(len(q) - p for q, p in zip(seqs, plens))
        print(f"generated {len(seqs)} sequences ({n_out} new tokens, {sum(map(len, seqs))} with prompts; "
              f"{args.generator}) in {time.time() - t0:.1f}s", flush=True)
        if args.data:
            with open(args.data, "w") as f:
                json.dump({"seqs": seqs, "prompt_lens": plens, "heldout": n_ho}, f)
    if args.hidden_cache and not os.path.isfile(args.hidden_cache):
        torch.save({"seqs": seqs, "plens": plens, "heldout": n_ho, "hidden": hidden, "offs": offs}, args.hidden_cache)
    n_gen = sum(len(q) for q in seqs)
    if hidden is None:
        t1 = time.time()
        hidden = collect_hidden(model, seqs, args.device, progress=args.progress, max_tokens=args.pack_tokens,
                                dtype=torch.bfloat16 if str(args.device).startswith("cuda") else torch.float32)
        offs = [0] * len(seqs)
        print(f"hidden states of {n_gen} tokens in {time.time() - t1:.1f}s", flush=True)
    tr = slice(n_ho, None)
    train_plens = plens[tr] if args.train_positions == "generated" else None
    if args.init:
        head = DraftHead.load(args.init)
        if head.cfg["hidden_size"] != model.config.hidden_size or head.k != args.k:
            raise ValueError(f"--init {args.init}: head for hidden size {head.cfg['hidden_size']}, k={head.k}; this "
                             f"run wants {model.config.hidden_size}, k={args.k}")
        print(f"continuing from {args.init} ({head.meta.get('train_stats', '?')})", flush=True)
        if args.context and not head.context:
            head = head.grown(args.context)
    else:
        head = DraftHead(model.config.hidden_size, k=args.k, layers=args.layers, mult=args.mult,
                         recurrent=args.recurrent, context=args.context)
    if args.freeze_base:
        if not head.context:
            raise ValueError("--freeze-base trains the context attention only: give --context")
        for n, w in head.named_parameters():
            w.requires_grad_(n.startswith("ctx_"))
    vocab = head.vocab  # --draft-vocab 0 keeps an --init head's own
    if args.draft_vocab:  # from the data alone: checkpoints saved during training carry it too
        vocab, cover = frequent_tokens(seqs[tr], plens[tr], args.draft_vocab, engine.model_config.vocab_size)
        print(f"draft vocabulary: {len(vocab)} tokens cover {cover:.4f} of the generated training tokens", flush=True)
    head.vocab = vocab
    meta = {"target": engine.model_name, "generated_tokens": n_gen}

    def checkpoint(h, stats):
        h.save(args.out, {**meta, "train_stats": json.dumps(stats)}, dtype=getattr(torch, args.save_dtype))
        print(f"checkpoint {args.out} {stats}", flush=True)
    head = train_head(model.embed_tokens.weight, model.lm_head.weight, hidden[tr], seqs[tr], k=args.k, steps=args.steps,
                      batch_positions=args.batch_positions, lr=args.lr, seed=args.seed, head=head,
                      progress=args.progress, max_seconds=args.max_seconds, log_every=0 if args.progress else 500,
                      vocab_subset=args.vocab_subset == "on" or (args.vocab_subset == "auto" and args.device == "cpu"),
                      prompt_lens=train_plens, weight_decay=args.weight_decay, amp=args.amp, hidden_offsets=offs[tr],
                      checkpoint=checkpoint if args.save_every else None, checkpoint_every=args.save_every or 0)
    head.vocab = vocab
    n_eval = max(n_ho, 1)
    split = {"held-out": (seqs[:n_ho], plens[:n_ho], hidden[:n_ho], offs[:n_ho]),
             "train": (seqs[n_ho:n_ho + n_eval], plens[n_ho:n_ho + n_eval], hidden[n_ho:n_ho + n_eval],
                       offs[n_ho:n_ho + n_eval])}
    lines, acc = _acceptance_report(head, engine, split, args.k)
    print("greedy acceptance of the trained head (train row: its own training sequences; a gap = overfitting):")
    print("\n".join(lines), flush=True)
    head.save(args.out, {**meta, "train_stats": json.dumps(head.train_stats), "acceptance": json.dumps(acc)},
              dtype=getattr(torch, args.save_dtype))
    print(f"saved draft head to {args.out} ({sum(p.numel() for p in head.parameters()) / 1e6:.2f}M params, "
          f"{head.train_stats}) in {time.time() - t0:.1f}s")
    return 0
