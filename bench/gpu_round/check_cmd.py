"""Dry-run check of one GPU-round stage command (called by lib.sh when DRY=1), so that a typo in a flag or a test
selection is found on the CPU machine and not after minutes of lent device time.

  python3 bench/gpu_round/check_cmd.py python3 bench/moe.py --models ... --lean
Checks: the script / test files exist; every --flag of a bench script or of `kestrel SUBCOMMAND` is defined in its
source; every word of a pytest -k expression names something in the selected test files. DRY_COLLECT=1 also runs
`pytest --collect-only` on the selection (slower: imports torch and the test modules) and needs ≥ 1 test selected.
Exit status 1 with one line per problem.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where each `kestrel SUBCOMMAND` defines its flags
SUBCOMMANDS = {"train-draft": "kestrel/spec/train_cli.py", "tune": "kestrel/kernels/tune_cli.py", "generate": "kestrel/cli.py",
               "serve": "kestrel/cli.py", "chat": "kestrel/cli.py"}
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def strip_wrappers(argv: list[str]) -> list[str]:
    """Drop `env`, VAR=VAL assignments and `timeout N` in front of the real command."""
    while argv:
        if argv[0] == "env" or ENV_ASSIGN.match(argv[0]):
            argv = argv[1:]
        elif argv[0] == "timeout":
            argv = argv[2:]
        else:
            break
    return argv


def flags_of(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def source_with_siblings(script: Path) -> str:
    """The script's text plus that of the sibling modules it imports (bench scripts share add_run_args etc.)."""
    src = script.read_text()
    for mod in re.findall(r"^from (\w+) import", src, re.M):
        sib = script.with_name(mod + ".py")
        if sib.exists() and sib != script:
            src += sib.read_text()
    return src


def defined(flag: str, src: str) -> bool:
    names = [flag]
    if flag.startswith("--no-"):  # argparse.BooleanOptionalAction defines --no-X beside --X
        names.append("--" + flag[5:])
    return any(f"'{n}'" in src or f'"{n}"' in src for n in names)


def check_flags(script: Path, flags: list[str]) -> list[str]:
    src = source_with_siblings(script)
    return [f"{script.relative_to(ROOT)}: no flag {f}" for f in flags if not defined(f, src)]


def check_pytest(args: list[str]) -> list[str]:
    problems, files, kexpr, i = [], [], None, 0
    while i < len(args):
        a = args[i]
        if a in ("-k", "-p", "-m"):
            if a == "-k":
                kexpr = args[i + 1]
            i += 2
            continue
        if not a.startswith("-"):
            files.append(a)
        i += 1
    missing = [f for f in files if not (ROOT / f.split("::")[0]).exists()]
    problems += [f"no test file {f}" for f in missing]
    if kexpr and not missing:
        text = "".join((ROOT / f.split("::")[0]).read_text() for f in files).lower()
        for word in re.findall(r"[A-Za-z0-9_]+", kexpr):
            if word not in ("and", "or", "not") and word.lower() not in text:
                problems.append(f"-k word {word!r} matches nothing in {' '.join(files)}")
    if os.environ.get("DRY_COLLECT") == "1" and not problems:
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
        if kexpr:
            cmd += ["-k", kexpr]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0 or "::" not in out.stdout:
            problems.append(f"pytest selects nothing: {' '.join(cmd[3:])}\n{out.stdout[-400:]}")
    return problems


def check(argv: list[str]) -> list[str]:
    argv = strip_wrappers(argv)
    if not argv:
        return ["empty command"]
    if argv[0].startswith("python") and argv[1:3] == ["-m", "pytest"]:
        return check_pytest(argv[3:])
    if argv[0].startswith("python") and argv[1:3] == ["-m", "kestrel.cli"]:
        argv = ["kestrel", *argv[3:]]
    elif argv[0] == "kestrel":  # session 15 lost a stage to this: the repo is on PYTHONPATH there, not pip-installed
        return ["the device has no `kestrel` console script: use python3 -m kestrel.cli"]
    if argv[0].startswith("python"):
        script = ROOT / argv[1]
        if not script.exists():
            return [f"no script {argv[1]}"]
        return check_flags(script, flags_of(argv[2:]))
    if argv[0] == "kestrel":  # (as python3 -m kestrel.cli)
        src = SUBCOMMANDS.get(argv[1])
        if src is None:
            return [f"unknown kestrel subcommand {argv[1]}"]
        return check_flags(ROOT / src, flags_of(argv[2:]))
    return [f"don't know how to check {argv[0]}"]


def main() -> int:
    problems = check(sys.argv[1:])
    for p in problems:
        print("DRY problem:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
