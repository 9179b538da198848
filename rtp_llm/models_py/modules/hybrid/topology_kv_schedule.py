"""Topology KV candidate schedule: block centroids, drift, sink/local/witness blocks.

Pure tensor functions, no module state. Shape vocabulary (shared with the policy):

    B  requests (or rows: one causal length each)
    L  KV length (tokens)
    N  blocks, ``N = ceil(L / block_size)``
    H  heads, D head dim
    S  scheduled blocks per row (``sink_blocks + local_blocks + witness_blocks``)

A *schedule* picks, for each row with causal length ``length``, three disjoint
sets of KV blocks of ``block_size`` tokens (64 = the engine's page size):

* sink blocks    blocks ``0 .. sink_blocks - 1`` (attention sinks live there);
* local blocks   the ``local_blocks`` blocks ending at the block that holds the
                 row's last token ``length - 1`` (the recent window);
* witness blocks the ``witness_blocks`` remaining blocks with the highest score
                 (key-centroid drift by default), ties to the lower block index.

Only blocks that hold at least one token ``< length`` are eligible, so a
schedule never reaches past the causal length. Expanding a schedule gives
sorted, unique token indices ``< length`` padded with ``-1``.

Public functions validate their arguments (``ValueError`` / ``TypeError`` naming
the argument, expected and actual). The ``_unchecked`` variants used by the
policy hot path do not look at values and never force a host sync.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Tuple, Union

import torch

DEFAULT_BLOCK_SIZE = 64  # the engine's KV page size (tokens per block)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


def parse_enum_member(cls, value, setting: str):
    """The one parser of option names: a member, or its value/name case-insensitively.

    Unknown names raise ``ValueError`` naming ``setting`` and listing the valid values.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in cls:
            if key in (member.value, member.name.lower()):
                return member
    valid = ", ".join(m.value for m in cls)
    raise ValueError(f"{setting}: expected one of [{valid}] (case-insensitive), got {value!r}")


class DriftMetric(enum.Enum):
    """How far a block's key centroid moved from the previous block's centroid."""

    L2 = "l2"  # ||c[b] - c[b-1]||_2 over (H, D)
    COSINE = "cosine"  # 1 - cos(c[b], c[b-1]) over the flattened (H, D) vector

    @classmethod
    def parse(cls, value: Union[str, "DriftMetric"]) -> "DriftMetric":
        """Parse a metric name case-insensitively; unknown names list the valid ones."""
        return parse_enum_member(cls, value, "drift metric")


class WitnessSignal(enum.Enum):
    """What ranks the witness blocks (the caller computes it; the policy takes the scores).

    KEY_DRIFT      ``||c_k[b] - c_k[b-1]||`` of key centroids: where the content changes
                   (the seed's signal; query-independent, one vector per request).
    VALUE_DRIFT    the same on value centroids: information the key-only indexer never sees.
    QUERY_CENTROID ``sum_h relu(q_h . c_k[b, g(h)])``: the row's own query against each
                   block's key centroid, DSA's indexer form at block granularity (N dot
                   products per head instead of L; a coarse, cheap second opinion).
    QUERY_MASS     the row's query against each block's key centroid, softmax-normalized
                   over the row's blocks per head (scale ``D ** -0.5``) and summed over heads:
                   the estimated attention mass of each block, i.e. the recall a witness
                   adds. Same side table as QUERY_CENTROID; the softmax makes every head
                   count equally, as the recall metric does.
    QUERY_BOUND    as QUERY_MASS, with ``sum_d max(q_d kmin_d, q_d kmax_d)`` (an upper bound
                   on ``q . k`` over the block, as in Quest) in place of the centroid dot
                   product. Two ``[N, Hkv, D]`` side tables (per-channel key min and max).
    """

    KEY_DRIFT = "key_drift"
    VALUE_DRIFT = "value_drift"
    QUERY_CENTROID = "query_centroid"
    QUERY_MASS = "query_mass"
    QUERY_BOUND = "query_bound"

    @classmethod
    def parse(cls, value: Union[str, "WitnessSignal"]) -> "WitnessSignal":
        return parse_enum_member(cls, value, "witness signal")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class TopologyScheduleConfig:
    """Which blocks a topology schedule keeps per row.

    Attributes
    ----------
    sink_blocks : int >= 0
        Leading blocks kept (attention sinks sit in the first tokens).
    local_blocks : int >= 0
        Blocks kept ending at the block of the row's last token (recency).
    witness_blocks : int >= 0
        Highest-scoring remaining blocks (key-centroid drift by default).
    block_size : int > 0
        Tokens per block; 64 matches the engine's KV page.

    At least one of the three counts must be positive (an empty schedule
    selects nothing and is always a configuration mistake).
    """

    sink_blocks: int = 1
    local_blocks: int = 2
    witness_blocks: int = 2
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        _check_int("sink_blocks", self.sink_blocks, 0)
        _check_int("local_blocks", self.local_blocks, 0)
        _check_int("witness_blocks", self.witness_blocks, 0)
        _check_int("block_size", self.block_size, 1)
        if self.total_blocks == 0:
            raise ValueError(
                "sink_blocks + local_blocks + witness_blocks: expected > 0, got 0 "
                "(an empty schedule selects no token)"
            )

    @property
    def total_blocks(self) -> int:
        return self.sink_blocks + self.local_blocks + self.witness_blocks

    @property
    def max_tokens(self) -> int:
        """Upper bound on the tokens one row's schedule expands to."""
        return self.total_blocks * self.block_size

    @classmethod
    def from_token_budget(
        cls, token_budget: int, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> "TopologyScheduleConfig":
        """Split ``token_budget // block_size`` blocks among sink, local and witness.

        One sink block (sinks are few tokens; one page holds them), then half of the
        rest, rounded up, to the recent window (the strongest prior for decode),
        then the remainder to witnesses: 2 blocks -> 1/1/0, 4 -> 1/2/1,
        8 -> 1/4/3, 16 -> 1/8/7. The expansion never exceeds ``token_budget``.
        """
        _check_int("block_size", block_size, 1)
        _check_int("token_budget", token_budget, 1)
        n_blocks = token_budget // block_size
        if n_blocks == 0:
            raise ValueError(
                f"token_budget: expected >= block_size ({block_size}) so that one block "
                f"fits, got {token_budget}"
            )
        sink = 1
        local = (n_blocks - sink + 1) // 2
        witness = n_blocks - sink - local
        return cls(sink_blocks=sink, local_blocks=local, witness_blocks=witness, block_size=block_size)


# ----------------------------------------------------------------------------------------
# Validation helpers (public entry points only: they may look at values and sync).
# ----------------------------------------------------------------------------------------


def _check_tensor(name: str, value, *, ndims, dtypes) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected torch.Tensor, got {type(value).__name__}")
    if value.dim() not in ndims:
        raise ValueError(f"{name}: expected rank in {tuple(ndims)}, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in [{names}], got {value.dtype}")


def _check_lengths(lengths, *, rows: Optional[int] = None, max_length: Optional[int] = None) -> None:
    _check_tensor("lengths", lengths, ndims=(1,), dtypes=_INT_DTYPES)
    if rows is not None and lengths.shape[0] != rows:
        raise ValueError(f"lengths: expected shape ({rows},), got {tuple(lengths.shape)}")
    if lengths.numel():
        low = int(lengths.min())
        if low <= 0:
            raise ValueError(f"lengths: expected every length > 0, got min {low}")
        if max_length is not None and int(lengths.max()) > max_length:
            raise ValueError(
                f"lengths: expected every length <= {max_length} (the key length), "
                f"got max {int(lengths.max())}"
            )


# ----------------------------------------------------------------------------------------
# Centroids and drift.
# ----------------------------------------------------------------------------------------


def _check_block_keys(keys, block_size, lengths) -> None:
    """Validation shared by the per-block key tables (centroids, min/max bounds)."""
    _check_int("block_size", block_size, 1)
    _check_tensor("keys", keys, ndims=(3, 4), dtypes=_FLOAT_DTYPES)
    if keys.shape[-3] == 0:
        raise ValueError(f"keys: expected L > 0 tokens, got shape {tuple(keys.shape)}")
    if lengths is not None:
        if keys.dim() != 4:
            raise ValueError("lengths: only valid with batched keys [B, L, H, D]")
        _check_lengths(lengths, rows=keys.shape[0], max_length=keys.shape[1])


def block_key_centroids(
    keys: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mean key of every block of ``block_size`` tokens.

    Parameters
    ----------
    keys : Tensor ``[L, H, D]`` or ``[B, L, H, D]``, float16/bfloat16/float32/float64
        Token-major keys (like a paged cache).
    block_size : int > 0
    lengths : optional int Tensor ``[B]`` (batched input only)
        Valid tokens per request; tokens at or past a length are ignored. Default: all L.

    Returns
    -------
    Tensor ``[N, H, D]`` or ``[B, N, H, D]``, float32 (float64 for float64 input),
    ``N = ceil(L / block_size)``. Accumulation is in fp32 for 16-bit input. The
    partial last block is the mean of its valid tokens; a block with no valid
    token is all zeros.
    """
    _check_block_keys(keys, block_size, lengths)
    return block_key_centroids_unchecked(keys, block_size, lengths)


def block_key_centroids_unchecked(
    keys: torch.Tensor, block_size: int, lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`block_key_centroids` without validation (no host sync)."""
    acc_dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
    squeeze = keys.dim() == 3
    k = keys.unsqueeze(0) if squeeze else keys  # [B, L, H, D]
    B, L, H, D = k.shape
    N = (L + block_size - 1) // block_size
    pad = N * block_size - L
    kf = k.to(acc_dtype)
    if lengths is not None:
        token = torch.arange(L, device=k.device)
        valid = token.unsqueeze(0) < lengths.to(k.device).unsqueeze(1)  # [B, L]
        kf = kf * valid.unsqueeze(-1).unsqueeze(-1).to(acc_dtype)
        counts = valid.to(acc_dtype)
    else:
        counts = torch.ones(B, L, dtype=acc_dtype, device=k.device)
    if pad:
        kf = torch.nn.functional.pad(kf, (0, 0, 0, 0, 0, pad))  # [B, N*bs, H, D]
        counts = torch.nn.functional.pad(counts, (0, pad))
    sums = kf.view(B, N, block_size, H, D).sum(dim=2)  # [B, N, H, D]
    n = counts.view(B, N, block_size).sum(dim=2)  # [B, N]
    centroids = sums / n.clamp(min=1).unsqueeze(-1).unsqueeze(-1)
    return centroids.squeeze(0) if squeeze else centroids


def block_drift_scores(centroids: torch.Tensor, metric: Union[DriftMetric, str] = DriftMetric.L2) -> torch.Tensor:
    """Drift of every block's centroid from the previous block's centroid.

    Parameters
    ----------
    centroids : float Tensor ``[N, H, D]`` or ``[B, N, H, D]`` (from :func:`block_key_centroids`)
    metric : DriftMetric or its name

    Returns
    -------
    float32 (float64 for float64 input) Tensor ``[N]`` or ``[B, N]``; block 0 scores 0.
    L2: ``||c[b] - c[b-1]||``; COSINE: ``1 - cos(c[b], c[b-1])`` (0 if either is zero).
    """
    metric = DriftMetric.parse(metric)
    _check_tensor("centroids", centroids, ndims=(3, 4), dtypes=_FLOAT_DTYPES)
    return block_drift_scores_unchecked(centroids, metric)


def block_drift_scores_unchecked(centroids: torch.Tensor, metric: DriftMetric = DriftMetric.L2) -> torch.Tensor:
    """:func:`block_drift_scores` without validation (no host sync)."""
    acc_dtype = torch.float64 if centroids.dtype == torch.float64 else torch.float32
    c = centroids.to(acc_dtype).flatten(-2)  # [..., N, H*D]
    scores = torch.zeros(c.shape[:-1], dtype=acc_dtype, device=c.device)  # [..., N]
    if c.shape[-2] > 1:
        cur, prev = c[..., 1:, :], c[..., :-1, :]
        if metric is DriftMetric.L2:
            scores[..., 1:] = torch.linalg.vector_norm(cur - prev, dim=-1)
        else:
            cos = torch.nn.functional.cosine_similarity(cur, prev, dim=-1, eps=1e-12)
            scores[..., 1:] = 1.0 - cos
    return scores


# ----------------------------------------------------------------------------------------
# Schedules.
# ----------------------------------------------------------------------------------------


def _sort_ascending_pad_last(ids: torch.Tensor) -> torch.Tensor:
    """Sort each row ascending with negative entries (padding) moved to the end as -1."""
    big = torch.iinfo(ids.dtype).max
    keyed = torch.where(ids < 0, torch.full_like(ids, big), ids)
    keyed, _ = torch.sort(keyed, dim=-1)
    return torch.where(keyed == big, torch.full_like(keyed, -1), keyed)


def score_sort_keys(scores: torch.Tensor, tiebreak: torch.Tensor) -> torch.Tensor:
    """Unique int64 sort keys: the fp32 score's order-preserving bits, then ``tiebreak``.

    ``tiebreak`` must be in ``[0, 2**32)`` and unique per row; a larger one wins ties.
    NaN counts as ``-inf`` and ``-0.0`` as ``+0.0``.
    """
    s = scores.to(torch.float32)
    s = torch.where(torch.isnan(s), float("-inf"), s) + 0.0
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float
    return ordered * (1 << 32) + tiebreak


def witness_fallback_scores(num_blocks: int, device: torch.device) -> torch.Tensor:
    """Scores used when no drift is given: the block index itself (``[N]`` float32).

    Deterministic and documented: without a drift signal the witnesses are the most
    recent eligible blocks, i.e. the recent window extends backwards past the local
    blocks. Recency is the strongest prior we have without data.
    """
    return torch.arange(num_blocks, dtype=torch.float32, device=device)


def prioritized_block_schedule_unchecked(
    lengths: torch.Tensor,
    sink_blocks: int,
    local_blocks: int,
    witness_blocks: int,
    block_size: int,
    drift_scores: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Scheduled block ids per row in *priority order*, no validation, no host sync.

    Parameters
    ----------
    lengths : int Tensor ``[R]``, every value > 0 (not checked)
    drift_scores : float Tensor ``[R, N]`` or None (then :func:`witness_fallback_scores`)
        Only blocks ``< ceil(length / block_size)`` of a row are considered.

    Returns
    -------
    int64 Tensor ``[R, sink_blocks + local_blocks + witness_blocks]``. Columns are
    laid out ``[sink..., local..., witness...]``: sinks ascending, locals from the
    query's own block backwards, witnesses by descending score (ties: lower block
    first). Missing blocks (row too short) are ``-1`` in their column. Blocks are
    unique per row.
    """
    device = lengths.device
    lengths = lengths.to(torch.int64)
    R = lengths.shape[0]
    num_blocks = (lengths + block_size - 1) // block_size  # [R]
    sink_cols = torch.arange(sink_blocks, device=device)  # [s]
    sinks = torch.where(sink_cols.unsqueeze(0) < num_blocks.unsqueeze(1), sink_cols.unsqueeze(0), -1)
    sink_end = torch.clamp(num_blocks, max=sink_blocks)  # [R] first block after the sinks
    local_cols = torch.arange(local_blocks, device=device)
    locals_ = num_blocks.unsqueeze(1) - 1 - local_cols.unsqueeze(0)  # [R, l]
    locals_ = torch.where(locals_ >= sink_end.unsqueeze(1), locals_, -1)
    local_start = torch.clamp(num_blocks - local_blocks, min=0)
    local_start = torch.maximum(local_start, sink_end)  # [R] first local block (or nb)
    parts = [sinks.expand(R, sink_blocks), locals_]
    if witness_blocks > 0:
        if drift_scores is None:
            n_max = None
            scores = None
        else:
            scores = drift_scores.to(torch.float32)
            n_max = scores.shape[-1]
        if scores is None:
            # Without drift the score is the block index (see witness_fallback_scores);
            # the top candidates are then simply the blocks right below local_start.
            cols = torch.arange(witness_blocks, device=device)
            wit = local_start.unsqueeze(1) - 1 - cols.unsqueeze(0)  # [R, w]
            wit = torch.where(wit >= sink_end.unsqueeze(1), wit, -1)
        else:
            block = torch.arange(n_max, device=device).unsqueeze(0)  # [1, N]
            eligible = (block >= sink_end.unsqueeze(1)) & (block < local_start.unsqueeze(1))  # [R, N]
            k = min(witness_blocks, n_max)
            # Unique int64 keys (order-preserving int view of the score, then the block
            # index reversed) make topk deterministic: ties go to the lower block. O(N)
            # per row, unlike a full sort.
            key = score_sort_keys(scores, n_max - 1 - block)
            key = torch.where(eligible, key, torch.iinfo(torch.int64).min)
            top = torch.topk(key, k, dim=1, largest=True, sorted=True).indices  # [R, k]
            top_ok = torch.gather(eligible, 1, top)
            wit = torch.where(top_ok, top, -1)
            if k < witness_blocks:
                wit = torch.nn.functional.pad(wit, (0, witness_blocks - k), value=-1)
        parts.append(wit)
    return torch.cat(parts, dim=1)


def build_block_schedule(
    lengths: torch.Tensor, config: TopologyScheduleConfig, drift_scores: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Sink, local and witness block ids for every row, sorted ascending.

    Parameters
    ----------
    lengths : int32/int64 Tensor ``[B]``, every value > 0
        Causal length of each row (tokens ``0 .. length - 1`` are visible).
    config : TopologyScheduleConfig
    drift_scores : float Tensor ``[B, N]`` or ``[N]`` (shared by all rows), optional
        Witness scores per block (e.g. :func:`block_drift_scores`). ``N`` must cover
        every row's blocks: ``N >= ceil(max(lengths) / block_size)``. Without it,
        witnesses fall back to the most recent eligible blocks.

    Returns
    -------
    int64 Tensor ``[B, S]``, ``S = config.total_blocks``, on ``lengths.device``: unique
    block ids per row in ascending order, ``-1`` padding at the end when a row has
    fewer eligible blocks than ``S``. Ties between equal scores go to the lower block.
    """
    if not isinstance(config, TopologyScheduleConfig):
        raise TypeError(f"config: expected TopologyScheduleConfig, got {type(config).__name__}")
    _check_lengths(lengths)
    scores = _check_drift(drift_scores, lengths, config.block_size)
    blocks = prioritized_block_schedule_unchecked(
        lengths, config.sink_blocks, config.local_blocks, config.witness_blocks, config.block_size, scores
    )
    return _sort_ascending_pad_last(blocks)


def _check_drift(drift_scores, lengths, block_size) -> Optional[torch.Tensor]:
    if drift_scores is None:
        return None
    _check_tensor("drift_scores", drift_scores, ndims=(1, 2), dtypes=_FLOAT_DTYPES)
    B = lengths.shape[0]
    if drift_scores.dim() == 1:
        drift_scores = drift_scores.unsqueeze(0).expand(B, -1)
    if drift_scores.shape[0] != B:
        raise ValueError(f"drift_scores: expected {B} rows (one per length), got shape {tuple(drift_scores.shape)}")
    if B:
        need = (int(lengths.max()) + block_size - 1) // block_size
        if drift_scores.shape[1] < need:
            raise ValueError(
                f"drift_scores: expected >= {need} blocks to cover max length {int(lengths.max())}, "
                f"got shape {tuple(drift_scores.shape)}"
            )
    if drift_scores.device != lengths.device:
        raise ValueError(f"drift_scores: expected device {lengths.device}, got {drift_scores.device}")
    return drift_scores


def expand_blocks_unchecked(block_ids: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token ids of each block, block by block in the given column order, no compaction.

    Returns int64 ``[R, S * block_size]``: column ``j * block_size + t`` holds token
    ``block_ids[r, j] * block_size + t`` or ``-1`` when the block is ``-1`` or the
    token is at or past ``lengths[r]``. No validation, no host sync.
    """
    offs = torch.arange(block_size, device=block_ids.device)
    tok = block_ids.to(torch.int64).unsqueeze(-1) * block_size + offs  # [R, S, bs]
    ok = (block_ids.unsqueeze(-1) >= 0) & (tok < lengths.to(torch.int64).view(-1, 1, 1))
    return torch.where(ok, tok, -1).flatten(1)  # [R, S*bs]


def compact_valid_first(ids: torch.Tensor) -> torch.Tensor:
    """Move the non-negative entries of each row to the front, keeping their order.

    ``ids`` int ``[R, K]``; returns the same shape and dtype with ``-1`` after the
    valid entries. Uses a stable sort on the padding flag, so the order of the valid
    entries is preserved. No host sync.
    """
    pad = (ids < 0).to(torch.int8)
    order = torch.sort(pad, dim=-1, stable=True).indices
    out = torch.gather(ids, 1, order)
    return torch.where(out < 0, torch.full_like(out, -1), out)


def expand_block_schedule(block_ids: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Expand ascending block ids to sorted, unique token indices ``< length``.

    Parameters
    ----------
    block_ids : int Tensor ``[B, S]``, ascending unique block ids per row, ``-1`` tail
        (the output of :func:`build_block_schedule`).
    lengths : int Tensor ``[B]``, every value > 0
    block_size : int > 0

    Returns
    -------
    int64 Tensor ``[B, S * block_size]``: ascending, unique token indices of the row's
    blocks that are ``< lengths[b]``, then ``-1``.
    """
    _check_int("block_size", block_size, 1)
    _check_tensor("block_ids", block_ids, ndims=(2,), dtypes=_INT_DTYPES)
    _check_lengths(lengths, rows=block_ids.shape[0])
    return compact_valid_first(expand_blocks_unchecked(block_ids, lengths, block_size))


def build_topology_token_indices(
    lengths: torch.Tensor, config: TopologyScheduleConfig, drift_scores: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`build_block_schedule` then :func:`expand_block_schedule` in one call.

    Returns int64 ``[B, config.max_tokens]`` ascending unique token ids, ``-1`` tail.
    """
    blocks = build_block_schedule(lengths, config, drift_scores)
    return compact_valid_first(expand_blocks_unchecked(blocks, lengths, config.block_size))


def query_centroid_scores(query: torch.Tensor, key_centroids: torch.Tensor) -> torch.Tensor:
    """Witness scores ``sum_h relu(q[r, h] . c[r, b, g(h)])`` (:attr:`WitnessSignal.QUERY_CENTROID`).

    Parameters
    ----------
    query : float ``[R, H, D]`` each row's query heads (post-RoPE)
    key_centroids : float ``[R, N, Hkv, D]`` (per row) or ``[N, Hkv, D]`` (shared), from
        :func:`block_key_centroids`; ``H`` must be a multiple of ``Hkv`` (GQA: query head
        ``h`` reads KV head ``h // (H / Hkv)``)

    Returns
    -------
    float32 ``[R, N]``. Blocks past a row's causal length are not masked here (the
    schedule ignores them). Cost ``R * N * H * D`` multiply-adds: the indexer's form at
    block granularity, ``block_size`` times cheaper than scanning every key.
    """
    _check_query_tables(query, {"key_centroids": key_centroids}, None, 1, None)
    return query_centroid_scores_unchecked(query, key_centroids)


def query_centroid_scores_unchecked(query: torch.Tensor, key_centroids: torch.Tensor) -> torch.Tensor:
    """:func:`query_centroid_scores` without validation (no host sync)."""
    R, H, D = query.shape
    Hkv = key_centroids.shape[-2]
    q = query.to(torch.float32).view(R, Hkv, H // Hkv, D)  # [R, Hkv, G, D]
    dots = _query_block_dot(q, key_centroids.to(torch.float32))  # [R, Hkv, G, N]
    return torch.relu(dots).sum(dim=(1, 2))  # [R, N]


def block_key_bounds(
    keys: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, lengths: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel minimum and maximum key of every block of ``block_size`` tokens.

    Parameters
    ----------
    keys : Tensor ``[L, H, D]`` or ``[B, L, H, D]``, float16/bfloat16/float32/float64
    block_size : int > 0
    lengths : optional int Tensor ``[B]`` (batched input only): tokens at or past a
        length are ignored

    Returns
    -------
    ``(key_min, key_max)``, each ``[N, H, D]`` or ``[B, N, H, D]``, float32 (float64 for
    float64 input), ``N = ceil(L / block_size)``. A block with no valid token is all zeros
    in both (its bound is then 0, like an empty centroid's dot product).
    """
    _check_block_keys(keys, block_size, lengths)
    return block_key_bounds_unchecked(keys, block_size, lengths)


def block_key_bounds_unchecked(
    keys: torch.Tensor, block_size: int, lengths: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_key_bounds` without validation (no host sync)."""
    acc_dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
    squeeze = keys.dim() == 3
    k = (keys.unsqueeze(0) if squeeze else keys).to(acc_dtype)  # [B, L, H, D]
    B, L, H, D = k.shape
    N = (L + block_size - 1) // block_size
    valid = torch.arange(N * block_size, device=k.device).unsqueeze(0) < (
        torch.full((B, 1), L, device=k.device) if lengths is None else lengths.to(k.device).unsqueeze(1)
    )  # [B, N*bs]; the padding past L is invalid too
    pad = N * block_size - L
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))
    mask = valid.view(B, N, block_size, 1, 1)
    blocks = k.view(B, N, block_size, H, D)
    kmin = torch.where(mask, blocks, float("inf")).amin(dim=2)  # [B, N, H, D]
    kmax = torch.where(mask, blocks, float("-inf")).amax(dim=2)
    empty = ~valid.view(B, N, block_size).any(dim=2)  # [B, N]
    kmin = torch.where(empty[..., None, None], 0.0, kmin)
    kmax = torch.where(empty[..., None, None], 0.0, kmax)
    return (kmin.squeeze(0), kmax.squeeze(0)) if squeeze else (kmin, kmax)


def _check_query_tables(query: torch.Tensor, tables, lengths, block_size, scale) -> None:
    """Validation shared by the query-aware witness signals (``tables``: name -> tensor)."""
    _check_tensor("query", query, ndims=(3,), dtypes=_FLOAT_DTYPES)
    _check_int("block_size", block_size, 1)
    R, H, D = query.shape
    first_name, first = next(iter(tables.items()))
    for name, table in tables.items():
        _check_tensor(name, table, ndims=(3, 4), dtypes=_FLOAT_DTYPES)
        if table.shape != first.shape:
            raise ValueError(
                f"{name}: expected the shape of {first_name} {tuple(first.shape)}, got {tuple(table.shape)}"
            )
    Hkv = first.shape[-2]
    if first.shape[-1] != D or H % Hkv:
        raise ValueError(
            f"{first_name}: expected [..., Hkv, {D}] with Hkv dividing {H} query heads, got shape {tuple(first.shape)}"
        )
    if first.dim() == 4 and first.shape[0] != R:
        raise ValueError(f"{first_name}: expected {R} rows, got shape {tuple(first.shape)}")
    if lengths is not None:
        _check_lengths(lengths, rows=R)
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
        raise ValueError(f"scale: expected a positive number or None, got {scale!r}")


def _query_block_dot(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``q [R, Hkv, G, D]`` against ``table`` ``[N, Hkv, D]`` or ``[R, N, Hkv, D]`` -> ``[R, Hkv, G, N]``."""
    if table.dim() == 3:
        return torch.einsum("rkgd,nkd->rkgn", q, table)
    return torch.einsum("rkgd,rnkd->rkgn", q, table)


def _softmax_block_mass(logits: torch.Tensor, lengths, block_size: int, scale: float) -> torch.Tensor:
    """``sum_h softmax_b(scale * logits)`` over each row's eligible blocks -> float32 ``[R, N]``."""
    u = logits * scale  # [R, Hkv, G, N]
    if lengths is not None:
        N = u.shape[-1]
        n_blocks = (lengths.to(torch.int64) + block_size - 1) // block_size  # [R]
        eligible = torch.arange(N, device=u.device).unsqueeze(0) < n_blocks.to(u.device).unsqueeze(1)  # [R, N]
        u = u.masked_fill(~eligible[:, None, None, :], float("-inf"))
    return torch.softmax(u, dim=-1).sum(dim=(1, 2))


def query_mass_scores(
    query: torch.Tensor,
    key_centroids: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Witness scores of :attr:`WitnessSignal.QUERY_MASS`: estimated attention mass per block.

    ``score[r, b] = sum_h softmax_b(scale * q[r, h] . c[b, g(h)])`` over the row's eligible
    blocks (those holding a token ``< lengths[r]``; every block when ``lengths`` is None);
    ineligible blocks score 0 and each row sums to ``H`` (every head contributes mass 1).

    Parameters
    ----------
    query : float ``[R, H, D]`` each row's query heads (post-RoPE)
    key_centroids : float ``[N, Hkv, D]`` (shared) or ``[R, N, Hkv, D]`` (per row), from
        :func:`block_key_centroids`; ``H`` a multiple of ``Hkv`` (head ``h`` reads KV head
        ``h // (H / Hkv)``)
    lengths : optional int ``[R]`` causal lengths (> 0)
    block_size : tokens per block (only used with ``lengths``)
    scale : softmax scale; default ``D ** -0.5``

    Returns
    -------
    float32 ``[R, N]``. Cost ``R N H D`` multiply-adds plus a softmax over ``[R, H, N]``.
    """
    _check_query_tables(query, {"key_centroids": key_centroids}, lengths, block_size, scale)
    return query_mass_scores_unchecked(query, key_centroids, lengths, block_size, scale)


def query_mass_scores_unchecked(
    query: torch.Tensor,
    key_centroids: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`query_mass_scores` without validation (no host sync)."""
    R, H, D = query.shape
    Hkv = key_centroids.shape[-2]
    q = query.to(torch.float32).view(R, Hkv, H // Hkv, D)  # [R, Hkv, G, D]
    logits = _query_block_dot(q, key_centroids.to(torch.float32))
    return _softmax_block_mass(logits, lengths, block_size, D ** -0.5 if scale is None else scale)


def query_bound_scores(
    query: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Witness scores of :attr:`WitnessSignal.QUERY_BOUND`: :func:`query_mass_scores` with a bound.

    For row ``r``, head ``h`` (KV head ``g(h)``) and block ``b``:
    ``u = sum_d max(q_d kmin[b, g, d], q_d kmax[b, g, d])`` bounds ``q . k`` for every key
    of the block from above; ``score[r, b] = sum_h softmax_b(scale * u)`` over the row's
    eligible blocks, ineligible blocks 0, rows summing to ``H``.

    Parameters
    ----------
    query : float ``[R, H, D]``
    key_min, key_max : float ``[N, Hkv, D]`` (shared) or ``[R, N, Hkv, D]`` (per row), from
        :func:`block_key_bounds`
    lengths, block_size, scale : as in :func:`query_mass_scores`

    Returns
    -------
    float32 ``[R, N]``. Cost ``2 R N H D`` multiply-adds plus a softmax over ``[R, H, N]``.
    """
    _check_query_tables(query, {"key_min": key_min, "key_max": key_max}, lengths, block_size, scale)
    return query_bound_scores_unchecked(query, key_min, key_max, lengths, block_size, scale)


def query_bound_scores_unchecked(
    query: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`query_bound_scores` without validation (no host sync)."""
    R, H, D = query.shape
    Hkv = key_min.shape[-2]
    q = query.to(torch.float32).view(R, Hkv, H // Hkv, D)  # [R, Hkv, G, D]
    # max(q kmin, q kmax) = q+ kmax - q- kmin, summed over d.
    logits = _query_block_dot(torch.relu(q), key_max.to(torch.float32)) - _query_block_dot(
        torch.relu(-q), key_min.to(torch.float32)
    )
    return _softmax_block_mass(logits, lengths, block_size, D ** -0.5 if scale is None else scale)
