#!/usr/bin/env bash
# The main job: the validation report (micro, policy overhead, end-to-end decode, quality
# gate) into report/. Extra args go to benchmark/topology_kv_report.py (e.g. --quick).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
# PYTHONPATH: the scripts live in benchmark/, but import rtp_llm.* and benchmark.* from the root.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
exec .venv/bin/python benchmark/topology_kv_report.py "$@"
