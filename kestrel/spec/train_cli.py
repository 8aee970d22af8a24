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
    p.add_argument("--prompts", default=None, help="text file, one prompt per line, or 'varied' = the generated "
                   "topic x task set of kestrel/spec/prompt_set.py (~7k prompts; default: 32 built-in prompts)")
    p.add_argument("--num-prompts", type=int, default=64, help="generations to train on (prompts are cycled; "
                   "default: %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens the target generates per prompt (default: %(default)s)")
    p.add_argument("--gen-temperature", type=float, default=0.7,
                   help="sampling temperature of the target's generations (default: %(default)s)")
    p.add_argument("--greedy-fraction", type=float, default=0.0,
                   help="share of generations made greedily (greedy verification accepts the argmax chain; the "
                        "rest use --gen-temperature for variety; default: %(default)s)")
    p.add_argument("--gen-batch", type=int, default=64, help="concurrent generations (default: %(default)s)")
    p.add_argument("--pack-tokens", type=int, default=4096,
                   help="tokens per target forward when collecting hidden states (default: %(default)s)")
    p.add_argument("--recurrent", action=argparse.BooleanOptionalAction, default=True,
                   help="sequential refiner reads the previous slot's state (the whole drafted chain; default on)")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved weights (default: %(default)s)")
    p.add_argument("--data", default=None, help="JSON file of generated token sequences: reused when it exists, "
                   "written after generating otherwise (skip regeneration when retraining)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not wrap prompts in the chat template")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps (default: %(default)s)")
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
    for name in ("k", "layers", "num_prompts", "gen_tokens", "steps", "batch_positions"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        raise ValueError("--lr must be > 0")
    if not 0.0 <= args.greedy_fraction <= 1.0:
        raise ValueError("--greedy-fraction must be in [0, 1]")
    if args.prompts and args.prompts != "varied" and not os.path.isfile(args.prompts):
        raise ValueError(f"--prompts file {args.prompts!r} not found")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise ValueError(f"output directory {out_dir!r} does not exist")


def _generate(engine, args) -> list[list[int]]:
    """The target's own continuations of the prompts (prompt + output token ids)."""
    from kestrel.engine.sampling_params import SamplingParams

    texts = DEFAULT_PROMPTS
    if args.prompts == "varied":
        from kestrel.spec.prompt_set import varied_prompts
        texts = varied_prompts(seed=args.seed)
    elif args.prompts:
        with open(args.prompts) as f:
            texts = [line.strip() for line in f if line.strip()]
        if not texts:
            raise ValueError(f"--prompts file {args.prompts!r} holds no prompts")
    prompts = []
    for i in range(args.num_prompts):
        t = texts[i % len(texts)]
        if args.chat and getattr(engine.tokenizer, "chat_template", None):
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                       tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = engine.tokenizer.encode(t)
        prompts.append(ids)
    n_greedy = round(args.greedy_fraction * len(prompts))  # every 1/fraction-th generation greedy, spread out
    greedy = {int(i * len(prompts) / n_greedy) for i in range(n_greedy)} if n_greedy else set()
    params = [SamplingParams(max_tokens=args.gen_tokens, temperature=0.0 if i in greedy else args.gen_temperature,
                             seed=args.seed + i) for i in range(len(prompts))]
    outs = engine.generate(prompts, params, use_tqdm=args.progress)
    seqs = [p + o.output_token_ids for p, o in zip(prompts, outs)]
    return seqs


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
                                    progress=args.progress, max_num_seqs=args.gen_batch))
    if args.data and os.path.isfile(args.data):
        with open(args.data) as f:
            seqs = json.load(f)
        V = engine.model_config.vocab_size
        if not (isinstance(seqs, list) and all(isinstance(q, list) and all(isinstance(t, int) and 0 <= t < V for t in q)
                                               for q in seqs)):
            raise ValueError(f"--data {args.data!r} is not a JSON list of token-id lists within the vocabulary")
        n_gen = sum(len(q) for q in seqs)
        print(f"loaded {len(seqs)} sequences ({n_gen} tokens) from {args.data}")
    else:
        seqs = _generate(engine, args)
        n_gen = sum(len(q) for q in seqs)
        print(f"generated {len(seqs)} sequences ({n_gen} tokens incl. prompts) in {time.time() - t0:.1f}s")
        if args.data:
            with open(args.data, "w") as f:
                json.dump(seqs, f)

    model = engine.model
    t1 = time.time()
    hidden = collect_hidden(model, seqs, args.device, progress=args.progress, max_tokens=args.pack_tokens,
                            dtype=torch.bfloat16 if str(args.device).startswith("cuda") else torch.float32)
    print(f"hidden states of {n_gen} tokens in {time.time() - t1:.1f}s", flush=True)
    head = DraftHead(model.config.hidden_size, k=args.k, layers=args.layers, recurrent=args.recurrent)
    head = train_head(model.embed_tokens.weight, model.lm_head.weight, hidden, seqs, k=args.k, steps=args.steps,
                      batch_positions=args.batch_positions, lr=args.lr, seed=args.seed, head=head,
                      progress=args.progress, max_seconds=args.max_seconds, log_every=0 if args.progress else 500,
                      vocab_subset=args.vocab_subset == "on" or (args.vocab_subset == "auto" and args.device == "cpu"))
    head.save(args.out, {"target": engine.model_name, "train_stats": json.dumps(head.train_stats),
                         "generated_tokens": n_gen}, dtype=getattr(torch, args.save_dtype))
    print(f"saved draft head to {args.out} ({sum(p.numel() for p in head.parameters()) / 1e6:.2f}M params, "
          f"{head.train_stats}) in {time.time() - t0:.1f}s")
    return 0
