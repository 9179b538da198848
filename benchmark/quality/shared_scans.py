"""Shared indexer scans in the harness: ``learned-shared:<scan>`` and ``learned-shared:<scan>+<mode>``.

What serving does with ``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=every:K``
(``rtp_llm/models_py/modules/hybrid/indexer_share.py``): within one forward, the first
sparse layer and every ``K``-th sparse layer after it rank with the trained indexer; every
other sparse layer takes the rows (and their index scores) of the nearest scanning layer
below it, for the same query tokens. ``learned-shared:K`` attends over those rows as they
are; ``learned-shared:K+<merge mode>`` runs the policy of each layer on them, with that
layer's own witness scores (its own keys' drift), as a sharing layer's own policy hook
does. ``learned-shared:1`` is ``learned``.

``<scan>`` is ``K`` or ``profile``: the scanning set the calibration wrote into the
``--profile`` file (``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=profile``). ``<mode>`` is a merge
mode or ``profile``: each layer's own profile entry (the ``profile`` selector) on the
shared rows, as serving runs a sharing layer with a profile.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Optional, Sequence, Tuple

import torch

from benchmark.quality.errors import UsageError
from benchmark.quality.layer import LayerInputs
from benchmark.quality.selector_base import Selector, SelectorSettings, learned_rows_and_scores

SHARED_PREFIX = "learned-shared:"
MERGE_MODES = ("topology_sparse_merge", "topology_compress_sparse")
PROFILE_SCAN = "profile"  # the scanning set of the --profile file (its indexer_share.scanning)
PROFILE_MODE = "profile"  # each layer's own profile entry as the policy (``+profile``)
_LAYER_LIST = re.compile(r"[0-9]{1,6}(,[0-9]{1,6})*")


@dataclasses.dataclass(frozen=True)
class SharedName:
    """A parsed shared-scan name ``learned-shared:<scan>[+<mode>]``.

    scan : ``every:K`` (written ``K``), ``profile`` (the profile's scanning set) or a comma
        list of scanning layers (the e2e's variants only: the harness's ``--selectors`` is
        itself a comma list)
    mode : the merge mode run on the shared rows, ``profile`` (the profile's per-layer
        entries), or None (the rows as they are)
    """

    scan: str
    mode: Optional[str]

    @property
    def every(self) -> Optional[int]:
        """``K`` of ``every:K``; None for the other scan forms."""
        return int(self.scan[len("every:"):]) if self.scan.startswith("every:") else None

    @property
    def needs_profile(self) -> bool:
        return self.scan == PROFILE_SCAN or self.mode == PROFILE_MODE


def parse_shared_name(
    name: str, *, modes: Sequence[str] = MERGE_MODES + (PROFILE_MODE,), lists: bool = False,
    where: str = "--selectors",
) -> Optional[SharedName]:
    """``"learned-shared:4+topology_sparse_merge"`` -> ``SharedName("every:4", "topology_sparse_merge")``;
    None for a name without the prefix; ``ValueError`` naming ``where`` for a malformed one.

    ``modes``: the modes allowed after ``+``; ``lists``: whether ``<scan>`` may be a comma
    list of layers (ascending, validated against the model by ``IndexerSharePlan``).
    """
    key = name.strip().lower()
    if not key.startswith(SHARED_PREFIX):
        return None
    body, _, mode = key[len(SHARED_PREFIX):].partition("+")
    forms = "K (K >= 1), profile" + (" or a comma list of scanning layers" if lists else "")
    ok_body = (body.isdigit() and int(body) >= 1) or body == PROFILE_SCAN or (
        lists and bool(_LAYER_LIST.fullmatch(body)) and "," in body)
    if not ok_body or (mode and mode not in modes):
        raise ValueError(f"{where}: expected {SHARED_PREFIX}<scan> or {SHARED_PREFIX}<scan>+<mode> with <scan> "
                         f"{forms} and <mode> one of {list(modes)}, got {name.strip()[:200]!r}")
    scan = f"every:{int(body)}" if body.isdigit() else body
    return SharedName(scan, mode or None)


def split_shared_name(name: str) -> Optional[SharedName]:
    """:func:`parse_shared_name` for ``--selectors`` (``UsageError`` for a malformed name)."""
    try:
        return parse_shared_name(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def scanning_test(scan: str, profile=None):
    """``scans(layer_idx, n) -> bool`` for a harness scan form (``n``: the layer's position
    among the forward's sparse layers, from 0); ``profile`` is needed for ``profile``."""
    if scan == PROFILE_SCAN:
        if profile is None or profile.scanning_layers is None:
            raise UsageError(f"--selectors: {SHARED_PREFIX}profile needs --profile FILE with an indexer_share.scanning "
                             f"set (benchmark/topology_kv_calibrate.py --scan K writes one)")
        chosen = frozenset(profile.scanning_layers)
        return lambda layer_idx, n: layer_idx in chosen
    every = SharedName(scan, None).every
    if every is None:
        raise UsageError(f"--selectors: scan {scan!r}: the harness takes {SHARED_PREFIX}K or {SHARED_PREFIX}profile")
    return lambda layer_idx, n: n % every == 0


def scan_share(
    name: str, full_attention_layers: Optional[Sequence[int]] = None, profile_scanning: Optional[Sequence[int]] = None,
) -> float:
    """The share of the sparse layers that run the indexer under selector ``name``: 1 for a
    selector that does not share; for ``learned-shared:K`` the model's exact share, or
    ``1/K`` without ``full_attention_layers``; for ``learned-shared:profile`` the profile's
    (NaN without it)."""
    shared = parse_shared_name(name)
    if shared is None:
        return 1.0
    layers = None if full_attention_layers is None else list(full_attention_layers)
    if shared.scan == PROFILE_SCAN:
        return float("nan") if profile_scanning is None or not layers else len(profile_scanning) / len(layers)
    if not layers:
        return 1.0 / shared.every
    return len(layers[::shared.every]) / len(layers)


class SharedScan:
    """The scanning layers' rows within one forward, per budget (one per selector).

    The harness calls a selector once per sparse layer, in ascending layer order, in each
    forward; a layer index not above the previous one starts a new forward. ``every``: the
    ``n``-th sparse layer of a forward (from 0) scans when ``n % every == 0``; or
    ``scans(layer_idx, n) -> bool`` (:func:`scanning_test`), the first sparse layer always
    scanning.
    """

    def __init__(self, every: Optional[int] = None, *, scans=None, label: Optional[str] = None) -> None:
        if scans is None:
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"every: expected an int >= 1, got {every!r}")
            scans = lambda layer_idx, n: n % every == 0  # noqa: E731
        elif every is not None:
            raise ValueError("SharedScan: give every or scans, not both")
        self._scans = scans
        self.label = label or f"{SHARED_PREFIX}{every}"
        self._state: Dict[int, Tuple[int, int, Tuple[torch.Tensor, torch.Tensor]]] = {}  # width -> (layer, n, rows)
        self._scanned: Dict[int, bool] = {}  # width -> whether the last layer asked scanned

    def rows(self, layer: LayerInputs, width: int, settings: SelectorSettings) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(rows, scores)`` for ``layer``: its own trained-indexer rows when it scans, else
        those of the forward's last scanning layer."""
        last = self._state.get(width)
        n = 0 if last is None or layer.layer_idx <= last[0] else last[1] + 1
        self._scanned[width] = n == 0 or self._scans(layer.layer_idx, n)
        if self._scanned[width]:
            found = learned_rows_and_scores(layer, width, settings)
        else:
            found = last[2]
            if found[0].shape[0] != layer.lengths.shape[0]:
                raise ValueError(f"{self.label}: layer {layer.layer_idx} has {layer.lengths.shape[0]} "
                                 f"query rows, its scanning layer {found[0].shape[0]}")
        self._state[width] = (layer.layer_idx, n, found)
        return found

    def scanned(self, width: int) -> bool:
        """Whether the layer of the last :meth:`rows` call at ``width`` ranked with its own indexer."""
        return self._scanned[width]


def make_shared_learned(scan: str, settings: SelectorSettings, profile=None) -> Selector:
    """Selector ``learned-shared:<scan>``: the rows of the nearest scanning layer, unchanged."""
    base_rows = shared_base_rows(scan, settings, profile)

    def select_shared(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        return base_rows(layer, width)[0]

    select_shared.__name__ = f"select_learned_shared_{scan.replace(':', '_')}"
    return select_shared


def shared_base_rows(scan: str, settings: SelectorSettings, profile=None):
    """``base_rows(layer, width) -> (rows, scores)`` of ``learned-shared:<scan>`` (for the policy selectors)."""
    memory = shared_scan(scan, profile)
    return lambda layer, width: memory.rows(layer, width, settings)


def shared_scan(scan: str, profile=None) -> SharedScan:
    """The :class:`SharedScan` of ``learned-shared:<scan>``."""
    return SharedScan(scans=scanning_test(scan, profile), label=f"{SHARED_PREFIX}{scan}")
