"""The `kestrel` CLI: every flag documented, bad flags give a one-line error (no traceback), and `generate` / `chat`
on the embedded SmolLM2 print exactly the engine's greedy output, chat keeping its history.
(`kestrel serve` runs as a real subprocess in test_server_openai.py.)"""
from __future__ import annotations

import io
from dataclasses import fields

import pytest

from kestrel.cli import build_parser, main
from kestrel.commands.engine_args import engine_config_from_args
from kestrel.engine.config import EngineConfig
from kestrel.engine.sampling_params import SamplingParams

PROMPT = "The capital of France is"
CHAT = ["Name a color.", "Now name another one."]


def subparsers():
    parser = build_parser()
    return parser, parser._subparsers._group_actions[0].choices


def test_every_flag_has_help():
    parser, subs = subparsers()
    assert {"serve", "generate", "chat"} <= set(subs)
    for name, p in [("kestrel", parser), *subs.items()]:
        for action in p._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help text"


def test_every_engine_config_field_is_a_serve_flag():
    _, subs = subparsers()
    for cmd in ("serve", "generate", "chat"):
        dests = {a.dest for a in subs[cmd]._actions}
        missing = [f.name for f in fields(EngineConfig) if f.name not in dests]
        assert not missing, f"kestrel {cmd} lacks flags for {missing}"
    args = subs["serve"].parse_args(["some/model", "--max-num-seqs", "3", "--kv-cache-gb", "0.5",
                                     "--no-enable-prefix-caching", "--model-shape", '{"num_layers": 2}'])
    assert (args.model, args.max_num_seqs, args.kv_cache_gb, args.enable_prefix_caching, args.model_shape) == \
        ("some/model", 3, 0.5, False, {"num_layers": 2})


@pytest.mark.parametrize("args", [
    ["serve", "--max-num-seqs", "0"],
    ["serve", "--port", "70000"],
    ["serve", "--dtype", "float8"],
    ["serve", "--max-num-seqs", "many"],
    ["serve", "--model-shape", "{oops"],
    ["generate", "--prompt", "hi", "--temperature", "-1"],
    ["generate", "--prompt", ""],
    ["generate", "--prompt", "hi", "--device", "tpu9"],
    ["generate", "--prompt", "hi", "--device", "cuda:99"],
    ["generate"],
    ["nonsense"],
])
def test_bad_flags_give_clear_error(args, capsys):
    # All of these fail before any model loads.
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "error" in err.lower() and "Traceback" not in err


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


def run_cli(monkeypatch, capsys, engine, args: list[str], stdin: str = "") -> str:
    """Run the real CLI code in-process on the already loaded engine (one model load for the whole module)."""
    seen = {}

    def build_engine(parsed):
        seen["config"] = engine_config_from_args(parsed)
        return engine

    monkeypatch.setattr(f"kestrel.commands.{args[0]}.build_engine", build_engine)
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    capsys.readouterr()
    assert main(args + ["--max-model-len", "512", "--no-progress"]) == 0
    assert seen["config"].max_model_len == 512 and seen["config"].progress is False
    return capsys.readouterr().out


def greedy(engine, prompt, max_tokens=6) -> str:
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def test_generate_prints_greedy_completion(monkeypatch, capsys, engine):
    out = run_cli(monkeypatch, capsys, engine, ["generate", "--prompt", PROMPT, "--max-tokens", "6",
                                                 "--temperature", "0"])
    assert out == greedy(engine, PROMPT) + "\n"


def test_chat_streams_replies_and_keeps_history(monkeypatch, capsys, engine):
    stdin = "\n".join(CHAT + ["/exit", "never sent"]) + "\n"
    out = run_cli(monkeypatch, capsys, engine, ["chat", "--max-tokens", "6", "--temperature", "0"], stdin)
    tok = engine.tokenizer
    history, expected = [], ""
    for msg in CHAT:
        history.append({"role": "user", "content": msg})
        ids = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        reply = greedy(engine, ids)
        history.append({"role": "assistant", "content": reply})
        expected += reply + "\n"
    assert out == expected  # the second reply only matches if the first turn was kept in the history
