#!/usr/bin/env bash
# The main job. For now: the decode microbenchmark on CPU; extra args go to the benchmark.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
# PYTHONPATH: the script lives in benchmark/, but imports rtp_llm.* and benchmark.* from the root.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python benchmark/topology_kv_candidate_schedule.py --device cpu "$@"
