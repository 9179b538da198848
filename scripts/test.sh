#!/usr/bin/env bash
# Runs every test two ways: through Bazel (`bazel test //...`, the sandboxed path with
# declared runfiles) and with plain pytest from the venv, then the GPU check's CPU smoke
# mode (scripts/gpu_check.sh --smoke). Non-zero exit on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh

status=0

echo "[test] bazel test //...  (manual/GPU targets are skipped)"
set +e
bazel test //... "$@"
rc=$?
set -e
if [ "$rc" -eq 4 ]; then
  # Bazel's "build OK, but no test targets" exit code.
  echo "[test] !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
  echo "[test] WARNING: bazel found NO test targets under //... (exit 4); nothing ran there" >&2
  echo "[test] !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
elif [ "$rc" -ne 0 ]; then
  echo "[test] FAILED: bazel test exited $rc" >&2
  status=1
fi

echo "[test] pytest benchmark/ rtp_llm/  (plain venv, no Bazel)"
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider benchmark/ rtp_llm/
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] FAILED: pytest collected no tests in benchmark/ rtp_llm/ (exit 5); there must be tests" >&2
  status=1
elif [ "$rc" -ne 0 ]; then
  echo "[test] FAILED: pytest exited $rc" >&2
  status=1
fi

echo "[test] bash scripts/gpu_check.sh --smoke  (the GPU check's machinery, on the CPU)"
smoke_dir="$(mktemp -d)"
set +e
bash scripts/gpu_check.sh --smoke "$smoke_dir"
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  echo "[test] FAILED: gpu_check.sh --smoke exited $rc (its report: $smoke_dir/gpu_check.md)" >&2
  status=1
fi

if [ "$status" -eq 0 ]; then
  echo "[test] all tests passed"
fi
exit "$status"
