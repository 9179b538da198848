"""Quality harness for topology-aware KV selection: ``bazel run //benchmark:topology_kv_quality``.

Also runs as ``python benchmark/topology_kv_quality.py [flags]`` from a checkout. See
``benchmark/quality/__init__.py`` for what it measures and ``--help`` for the flags.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a script: make the repository root importable (abspath, not resolve(): under
    # Bazel this file is a runfiles symlink and the runfiles tree is the import root).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark.quality.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
