"""Train the lightning indexer of a GGUF model: ``bazel run //benchmark:topology_kv_indexer_train``.

The command's front end is ``benchmark/indexer/train_cli.py``; this file only makes it runnable
as ``python benchmark/topology_kv_indexer_train.py [flags]`` from a checkout.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a script: make the repository root importable (abspath, not resolve(): under
    # Bazel this file is a runfiles symlink and the runfiles tree is the import root).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark.indexer.train_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
