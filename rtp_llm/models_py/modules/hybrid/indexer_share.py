"""Indexer scans shared across layers: which sparse layers scan, which reuse another's rows.

A *scanning* layer runs the indexer's top-k op over its own keys; a *sharing* layer runs no
op and writes or reads no indexer key: it takes the top-k rows of the nearest scanning
layer below it (the op's rows, before that layer's policy), and its own policy hook, when
enabled, merges its own structure into them (its profile entry, its own drift tracker).
Rows are request-local token positions, the same coordinates in every layer of a request,
so a row of one layer is a valid row of another.

The pattern is per model, over the model's sparse (indexer) layers in ascending order:

* ``none`` (default): every sparse layer scans (no change, bit for bit);
* ``every:K`` (``K >= 1``): the first sparse layer and every ``K``-th after it scan
  (``every:1`` is ``none``);
* ``L0,L1,...``: exactly these layers scan; the list starts with the first sparse layer
  (a layer below every scanning layer would have nothing to reuse), each entry a sparse
  layer, ascending, no repeats;
* ``profile``: the scanning set the calibration wrote into the profile
  (``RTP_LLM_TOPOLOGY_KV_PROFILE``'s ``indexer_share.scanning``; the calibration, ``--scan K``,
  picks the set whose sharing layers lose least by reusing the nearest scanning layer below).

Serving reads ``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE`` once, when the model builds its layers
(:meth:`IndexerSharePlan.from_env`), and hands the plan to each ``Indexer``. Within a
step, the scanning layers leave their op rows in a caller-owned :class:`SharedTopkRows`
and the sharing layers read them there (``Indexer._compute_topk(..., shared_rows=...)``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import check_scanning_layers, shown

ENV_INDEXER_SHARE = "RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE"
SHARE_NONE = "none"
SHARE_PROFILE = "profile"
_EVERY = re.compile(r"every:([0-9]{1,6})")
_LIST = re.compile(r"[0-9]{1,6}(,[0-9]{1,6})*")


@dataclasses.dataclass(frozen=True)
class IndexerSharePlan:
    """Which of a model's sparse layers scan; immutable, validated once.

    sparse_layers : the model's sparse (indexer) layers, ascending
    scanning : the layers that scan, ascending; the first is ``sparse_layers[0]``
    spec : the pattern as written (``none``, ``every:K`` or the list), for logs and reports
    """

    sparse_layers: Tuple[int, ...]
    scanning: Tuple[int, ...]
    spec: str = SHARE_NONE

    def __post_init__(self) -> None:
        sparse = tuple(self.sparse_layers)
        if not sparse or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in sparse):
            raise ValueError(f"sparse_layers: expected a non-empty sequence of layer indices >= 0, got {shown(sparse)}")
        if list(sparse) != sorted(set(sparse)):
            raise ValueError(f"sparse_layers: expected ascending, without repeats, got {shown(sparse)}")
        scanning = tuple(self.scanning)
        check_scanning_layers(scanning, sparse, "scanning")
        object.__setattr__(self, "sparse_layers", sparse)
        object.__setattr__(self, "scanning", scanning)
        # layer -> the scanning layer whose rows it uses (itself when it scans), fixed here.
        source, current = {}, sparse[0]
        for layer in sparse:
            if layer in scanning:
                current = layer
            source[layer] = current
        object.__setattr__(self, "_source", source)

    @classmethod
    def none(cls, sparse_layers: Sequence[int]) -> "IndexerSharePlan":
        """Every sparse layer scans."""
        return cls(tuple(sparse_layers), tuple(sparse_layers), SHARE_NONE)

    @classmethod
    def parse(
        cls, text: str, sparse_layers: Sequence[int], *, where: str = ENV_INDEXER_SHARE,
        profile_scanning: Optional[Sequence[int]] = None, profile_path: Optional[str] = None,
    ) -> "IndexerSharePlan":
        """The plan written as ``text`` (module docstring); ``ValueError`` naming ``where``,
        the value and what was expected.

        profile_scanning : the loaded profile's scanning layers (``TopologyKVProfile.scanning_layers``),
            read for ``profile`` only; ``profile_path`` names that profile in errors
            (None: no profile is loaded).
        """
        sparse = tuple(sparse_layers)
        if not isinstance(text, str):
            raise ValueError(f"{where}: expected 'none', 'every:K', 'profile' or a comma list of layers, "
                             f"got {shown(text)}")
        key = text.strip().lower().replace(" ", "")
        if key in ("", SHARE_NONE):
            return cls.none(sparse)
        if key == SHARE_PROFILE:
            if profile_path is None:
                raise ValueError(f"{where}=profile: expected a loaded profile (RTP_LLM_TOPOLOGY_KV_PROFILE), "
                                 f"got none")
            if profile_scanning is None:
                raise ValueError(f"{where}=profile: the profile {shown(profile_path)} has no indexer_share.scanning "
                                 f"(calibrate with --scan K to write one)")
            layers = tuple(profile_scanning)
            check_scanning_layers(layers, sparse, f"{where}=profile ({shown(profile_path)})")
            return cls(sparse, layers, SHARE_PROFILE)
        every = _EVERY.fullmatch(key)
        if every:
            k = int(every.group(1))
            if k < 1:
                raise ValueError(f"{where}={shown(text)}: expected every:K with K >= 1, got K = {k}")
            return cls(sparse, sparse[::k], f"every:{k}")
        if not _LIST.fullmatch(key):
            raise ValueError(f"{where}={shown(text)}: expected 'none', 'every:K' (K >= 1), 'profile' or a comma list of "
                             f"scanning layers (e.g. {','.join(str(x) for x in sparse[:2])})")
        layers = tuple(int(x) for x in key.split(","))
        check_scanning_layers(layers, sparse, f"{where}={shown(text)}")
        return cls(sparse, layers, ",".join(str(x) for x in layers))

    @classmethod
    def from_env(cls, environ: Mapping[str, str], sparse_layers: Sequence[int], profile=None) -> "IndexerSharePlan":
        """:data:`ENV_INDEXER_SHARE` read once (unset or blank: ``none``); ``profile``: the
        model's loaded ``TopologyKVProfile`` or None, read for ``profile`` only."""
        return cls.parse(environ.get(ENV_INDEXER_SHARE) or SHARE_NONE, sparse_layers,
                         profile_scanning=None if profile is None else profile.scanning_layers,
                         profile_path=None if profile is None else profile.path)

    @property
    def shares(self) -> bool:
        """Whether any sparse layer reuses another's rows."""
        return len(self.scanning) < len(self.sparse_layers)

    def source(self, layer: int) -> int:
        """The scanning layer whose rows ``layer`` uses (``layer`` itself when it scans)."""
        try:
            return self._source[layer]
        except KeyError:
            raise ValueError(f"layer_idx: expected one of the sparse layers {shown(list(self.sparse_layers))}, "
                             f"got {shown(layer)}") from None

    def scans(self, layer: int) -> bool:
        return self.source(layer) == layer

    def scan_fraction(self) -> float:
        """Scanning layers / sparse layers."""
        return len(self.scanning) / len(self.sparse_layers)


@dataclasses.dataclass
class SharedTopkRows:
    """Caller-owned, one per step (or per thread): the op rows each scanning layer left.

    ``by_layer[layer]`` is the int32 ``[R, W]`` output of that layer's top-k op in this
    step (before its policy), or None for a CP rank with no local row. The ``Indexer``
    writes it on a scanning layer and reads it on a sharing one; a new step needs a new
    object (or :meth:`clear`), so no row of an earlier step is ever reused.
    """

    by_layer: Dict[int, Optional[torch.Tensor]] = dataclasses.field(default_factory=dict)

    def clear(self) -> None:
        self.by_layer.clear()
