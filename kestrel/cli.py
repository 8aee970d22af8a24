"""`kestrel` console script: argparse subcommands, one module per subcommand.

To add a subcommand, write a module with `add_parser(subparsers)` (register the parser, cheaply: import heavy
things inside run) and `run(args) -> int | None`, and list it in COMMANDS below.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "kestrel.commands.serve",
    "kestrel.commands.generate",
    "kestrel.commands.chat",
    "kestrel.router.cli",
    "kestrel.kernels.tune_cli",
    "kestrel.spec.train_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kestrel", description="kestrel: LLM inference stack "
                                     "(OpenAI-compatible server, offline generation, interactive chat).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="run `kestrel COMMAND --help` for its flags")
    for name in COMMANDS:
        try:
            module = importlib.import_module(name)
        except ImportError as e:  # one broken optional subcommand must not take the others down
            print(f"kestrel: subcommand module {name} is unavailable ({e})", file=sys.stderr)
            continue
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        # Bad input: a clear message, not a traceback.
        print(f"kestrel {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
