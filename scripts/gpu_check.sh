#!/usr/bin/env bash
# Every GPU claim in one command: bash scripts/gpu_check.sh [--smoke] [OUTDIR] [flags]
# On a CUDA machine with only this checkout and a Python that has torch, Triton, pytest and
# hypothesis (no Bazel, no venv, no network). --smoke: the same machinery on the CPU (CI).
# Flags and parts: benchmark/validation/gpu_check.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# The interpreter: $PYTHON, else this checkout's .venv when there is one, else python3.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
exec "$PY" -m benchmark.validation.gpu_check "$@"
