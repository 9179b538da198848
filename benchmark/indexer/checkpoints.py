"""Which trained indexer a model gets: the shape presets and the shipped checkpoints.

Shape presets (``--shape``), for a model with ``H`` query heads of ``D`` dims:

* ``dsa-ratio`` (default): DeepSeek-V3.2's indexer-to-attention cost per key. Its indexer
  does 64 x 128 = 8,192 multiply-adds per key against the attention's 128 heads x 576 =
  73,728 for q.k: 1/9. Here head dim ``min(128, D)`` and ``max(1, round(H * D / 9 / dim))``
  heads: SmolLM2 (9 x 64) gets 1 x 64, Gemma 3 270M (4 x 256) 1 x 128.
* ``proxy-cost``: ``H`` heads of ``D`` dims, the cost of the harness's own-q.k proxy (for
  the comparison at equal cost).
* ``HxD``: any explicit shape, e.g. ``4x64``.

RoPE covers the first half of the head dims (DeepSeek-V3.2: 64 of 128) unless ``--rope-dim``
says otherwise.

Shipped checkpoints live in ``benchmark/trained_indexers/`` (the command that made each is
recorded in its metadata and in that folder's README); :func:`find_shipped_checkpoint`
picks the one trained for a model's GGUF sha256 and shape preset.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Optional, Tuple

from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import IndexerCheckpointInfo, read_checkpoint_info
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjectionShape

SHAPE_PRESETS = ("dsa-ratio", "proxy-cost")
DSA_COST_RATIO = 9  # DeepSeek-V3.2: attention q.k (128 x 576) / indexer (64 x 128) multiply-adds per key
# abspath, not resolve(): under Bazel this file is a runfiles symlink, and the shipped
# checkpoints are runfiles beside it.
SHIPPED_DIR = Path(os.path.abspath(__file__)).parent.parent / "trained_indexers"


def parse_shape(text: str) -> str:
    """``dsa-ratio``, ``proxy-cost`` or ``HxD`` (normalised); ValueError naming the valid forms."""
    key = text.strip().lower()
    if key in SHAPE_PRESETS or re.fullmatch(r"[1-9][0-9]{0,3}x[1-9][0-9]{0,4}", key):
        return key
    raise ValueError(f"--shape: expected one of {list(SHAPE_PRESETS)} or HxD (e.g. 1x64), got {text!r}")


def resolve_shape(preset: str, *, heads: int, head_dim: int, hidden_size: int,
                  rope_theta: float, rope_dim: Optional[int] = None) -> IndexerProjectionShape:
    """The projection shape of ``preset`` for a model with ``heads`` x ``head_dim`` attention.

    rope_dim : the leading dims that carry RoPE; None: half the indexer's head dims
    (DeepSeek-V3.2's 64 of 128). ValueError if it is odd or exceeds the head dims.
    """
    if preset == "dsa-ratio":
        dim = min(128, head_dim)
        h = max(1, round(heads * head_dim / DSA_COST_RATIO / dim))
    elif preset == "proxy-cost":
        h, dim = heads, head_dim
    else:
        h, dim = (int(x) for x in parse_shape(preset).split("x"))
    rope = (dim // 2) & ~1 if rope_dim is None else rope_dim  # default: even
    return IndexerProjectionShape(heads=h, head_dim=dim, rope_dim=rope, hidden_size=hidden_size,
                                  q_input_size=hidden_size, rope_theta=float(rope_theta))


def model_rope_theta(config) -> float:
    """The model's RoPE base (``rope_theta``, or ``rope_parameters['rope_theta']``; 10000 if absent)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        if isinstance(params, dict):
            # Gemma 3 keys its parameters by layer type; the global layers' base is the one that counts.
            nested = params.get("full_attention", params)
            theta = nested.get("rope_theta") if isinstance(nested, dict) else None
    return float(theta or 10000.0)


def shipped_checkpoints(folder: Path = SHIPPED_DIR) -> List[Tuple[Path, IndexerCheckpointInfo]]:
    """Every readable checkpoint in ``folder`` with its metadata (unreadable files are skipped)."""
    out = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            out.append((path, read_checkpoint_info(path)))
        except ValueError:
            continue
    return out


def find_shipped_checkpoint(model_sha256: str, preset: str = "dsa-ratio",
                            folder: Path = SHIPPED_DIR) -> Optional[Path]:
    """The shipped checkpoint trained for ``model_sha256`` with shape ``preset``, or None."""
    for path, info in shipped_checkpoints(folder):
        if info.model_sha256 == model_sha256 and info.extra.get("shape_preset") == preset:
            return path
    return None


def resolve_checkpoint(explicit: Optional[Path], model_sha256: str, preset: str = "dsa-ratio") -> Optional[Path]:
    """The checkpoint a run uses: ``explicit`` when given, else the shipped one for the model (or None)."""
    if explicit is not None:
        return Path(explicit)
    return find_shipped_checkpoint(model_sha256, preset)


def load_trained_indexer(path: Path, model_sha256: Optional[str]):
    """``(layer -> IndexerProjections, info)`` of every layer in ``path``, checked against the model."""
    from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import load_indexer_checkpoint

    return load_indexer_checkpoint(path, model_sha256=model_sha256)
