"""`kestrel generate [MODEL] --prompt ...`: offline generation, printed to stdout."""
from __future__ import annotations

import argparse
import sys

from kestrel.commands.engine_args import add_engine_args, add_sampling_args, build_engine, sampling_params_from_args


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text for one or more prompts and print it",
                       description="Complete each --prompt with MODEL (default: the embedded SmolLM2). One prompt "
                                   "is streamed to stdout as it is generated; several are run as one batch.")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeatable; '-' reads the prompt from stdin)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template as a user turn")
    add_sampling_args(p, max_tokens=64)
    add_engine_args(p)
    return p


def _prompt_ids(tok, text: str, chat: bool) -> list[int]:
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(text)


def run(args: argparse.Namespace) -> int:
    prompts = [sys.stdin.read() if p == "-" else p for p in args.prompt]
    if any(not p for p in prompts):
        raise ValueError("--prompt must not be empty")
    params = sampling_params_from_args(args)
    engine = build_engine(args)
    ids = [_prompt_ids(engine.tokenizer, p, args.chat) for p in prompts]
    for i, p in enumerate(ids):
        engine.add_request(str(i), p, params)
    texts = [""] * len(ids)
    while engine.has_unfinished():
        for out in engine.step():
            if len(ids) == 1:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            texts[int(out.request_id)] += out.new_text
    if len(ids) == 1:
        sys.stdout.write("\n")
    else:
        for i, (p, t) in enumerate(zip(prompts, texts)):
            print(f"=== [{i}] {p}\n{t}")
    return 0
