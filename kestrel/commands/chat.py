"""`kestrel chat [MODEL]`: interactive chat in the terminal; replies stream token by token, history is kept."""
from __future__ import annotations

import argparse
import sys
import uuid

from kestrel.commands.engine_args import add_engine_args, add_sampling_args, build_engine, sampling_params_from_args

HELP = "commands: /exit (or Ctrl-D) quits, /reset clears the history"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("chat", help="interactive chat with streaming replies",
                       description=f"Chat with MODEL (default: the embedded SmolLM2). {HELP}.")
    p.add_argument("--system", default=None, help="system prompt for the conversation")
    add_sampling_args(p, max_tokens=256)
    add_engine_args(p)
    return p


def _prompt_ids(engine, history: list[dict]) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _reply(engine, ids: list[int], args) -> str:
    """Stream one reply to stdout; Ctrl-C stops it (and frees its KV blocks) but keeps the chat going."""
    room = engine.max_model_len - len(ids)
    params = sampling_params_from_args(args, max_tokens=min(args.max_tokens, room))
    rid = uuid.uuid4().hex
    engine.add_request(rid, ids, params)
    text = ""
    try:
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                text += out.new_text
    except KeyboardInterrupt:
        engine.abort_request(rid)
        sys.stdout.write(" [interrupted]")
    sys.stdout.write("\n")
    return text


def run(args: argparse.Namespace) -> int:
    sampling_params_from_args(args)  # bad sampling flags fail before the model loads
    engine = build_engine(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    print(f"kestrel chat with {engine.model_name} ({HELP})", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            history = []
            continue
        if not cmd:
            continue
        history.append({"role": "user", "content": line})
        ids = _prompt_ids(engine, system + history)
        while len(ids) >= engine.max_model_len and len(history) > 1:  # forget the oldest turns first
            history = history[2:] if len(history) > 2 else history[-1:]
            ids = _prompt_ids(engine, system + history)
        if len(ids) >= engine.max_model_len:
            print(f"error: this message is {len(ids)} tokens, longer than the context "
                  f"({engine.max_model_len}); not sent", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": _reply(engine, ids, args)})
    return 0
