"""Per-request and per-step state of the policy, owned by the caller (host side).

* :class:`TopologyRequestContext`: one request's stable scaffold (e.g. a shared system
  prompt, for ``topology_compress_sparse``) and its fingerprint history.
* :class:`TopologyStepPlan`: what one forward step shares across its layers, built once per
  step from the contexts: the scaffold span of every row as a device tensor and the
  fingerprints. Passing it to every layer's call (``plan=``) keeps the host list, the
  host-to-device copy and the fingerprint bookkeeping off the per-layer path (and out of
  a captured CUDA graph, where a host list would be frozen as a constant).

Nothing here is module state: the caller creates, owns and passes these objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Sequence, Tuple, Union

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import select_request_rows
from rtp_llm.models_py.modules.hybrid.topology_kv.config import TopologyKVPolicyConfig, TopologyKVPolicyMode


@dataclasses.dataclass
class TopologyRequestContext:
    """Per-request state the caller owns and passes in; the policy keeps none of its own.

    Attributes
    ----------
    scaffold_token_ids : tuple of int
        The request's stable scaffold (e.g. a shared system prompt), a prefix of the
        request. ``TOPOLOGY_COMPRESS_SPARSE`` represents structural blocks that lie
        wholly inside it by one token each.
    last_fingerprint : str or None
        Fingerprint of the previous call with this context.
    compression_hits : int
        Calls whose fingerprint equalled the previous one (the scaffold and output
        contract were unchanged, so a cached scaffold layout could be reused).
    """

    scaffold_token_ids: Tuple[int, ...] = ()
    last_fingerprint: Optional[str] = None
    compression_hits: int = 0

    def __post_init__(self) -> None:
        ids = tuple(self.scaffold_token_ids)
        for i, tok in enumerate(ids):
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise TypeError(f"scaffold_token_ids[{i}]: expected int, got {type(tok).__name__}")
        self.scaffold_token_ids = ids

    @property
    def scaffold_length(self) -> int:
        return len(self.scaffold_token_ids)


def policy_fingerprint(config: TopologyKVPolicyConfig, width: int, scaffold_token_ids: Sequence[int]) -> str:
    """Stable hex digest of the scaffold tokens and the output contract.

    Covers the mode, width ``W``, block size, block counts, structural fraction and
    the scaffold token ids: equal fingerprints mean equal structural layouts for the
    scaffold span. Stable across processes (sha256 of a canonical string).
    """
    contract = (
        f"mode={config.policy.value};W={width};bs={config.block_size};sink={config.sink_blocks};"
        f"local={config.local_blocks};witness={config.witness_blocks};"
        f"frac={config.max_structural_fraction!r};sink_tokens={config.sink_tokens};"
        f"budget={config.structural_budget.value};scaffold="
    )
    digest = hashlib.sha256(contract.encode())
    digest.update(",".join(str(int(t)) for t in scaffold_token_ids).encode())
    return digest.hexdigest()[:16]


ContextArg = Union[None, TopologyRequestContext, Sequence[TopologyRequestContext]]


def as_context_list(context: ContextArg):
    if context is None:
        return []
    if isinstance(context, TopologyRequestContext):
        return [context]
    contexts = list(context)
    for i, c in enumerate(contexts):
        if not isinstance(c, TopologyRequestContext):
            raise TypeError(f"context[{i}]: expected TopologyRequestContext, got {type(c).__name__}")
    return contexts


@dataclasses.dataclass(frozen=True)
class TopologyStepPlan:
    """One forward step's shared policy inputs; build with :meth:`build`, pass to each layer.

    Attributes
    ----------
    scaffold_lengths : int64 ``[R]`` on the rows' device, or None (no compression)
        Each row's scaffold span (compress mode), from its request's context.
    fingerprints : one per context, as :func:`policy_fingerprint`
    compression_hits : contexts whose fingerprint equalled their previous one
    """

    scaffold_lengths: Optional[torch.Tensor]
    fingerprints: Tuple[str, ...] = ()
    compression_hits: int = 0

    @classmethod
    def build(
        cls,
        config: TopologyKVPolicyConfig,
        width: int,
        context: ContextArg,
        *,
        num_rows: int,
        row_to_request: Optional[torch.Tensor] = None,
        device: Union[str, torch.device] = "cpu",
    ) -> "TopologyStepPlan":
        """Fingerprint the contexts (updating their history once) and place the scaffold spans.

        ``context``: one context for every row, one per request (with ``row_to_request``,
        int ``[R]``), or one per row. Raises ``ValueError`` naming ``context`` otherwise.
        """
        contexts = as_context_list(context)
        fingerprints = tuple(policy_fingerprint(config, width, c.scaffold_token_ids) for c in contexts)
        hits = 0
        for ctx, fp in zip(contexts, fingerprints):
            if ctx.last_fingerprint == fp:
                ctx.compression_hits += 1
                hits += 1
            ctx.last_fingerprint = fp
        scaffold = None
        if config.policy is TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE and contexts:
            per_request = torch.tensor([c.scaffold_length for c in contexts], dtype=torch.int64, device=device)
            if len(contexts) == 1:
                scaffold = per_request.expand(num_rows)
            elif row_to_request is not None:
                scaffold = select_request_rows(per_request, row_to_request, "the contexts")
            else:
                if len(contexts) != num_rows:
                    raise ValueError(
                        f"context: expected 1 context, one per row ({num_rows}), or "
                        f"row_to_request, got {len(contexts)} contexts"
                    )
                scaffold = per_request
        return cls(scaffold_lengths=scaffold, fingerprints=fingerprints, compression_hits=hits)
