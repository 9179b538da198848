"""Context-parallel indexer across two real processes (torch.distributed, gloo).

Each rank owns a zigzag share of every request's query tokens, as the engine's CP
prefill splits them. Like the engine, a rank computes the keys of its own tokens, the
ranks all-gather them and restore the global token order, and every rank writes the
whole batch's keys into its paged cache (feeding its drift tracker). Each rank then runs
``Indexer._compute_topk`` on the CP path, policy enabled, for its rows only; the rows are
all-gathered and must equal, bit for bit, the single-process ragged result.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.indexer_params import IndexerKeyCache
from rtp_llm.models_py.modules.hybrid.test import indexer_ref as ref
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    CoordinateMismatchAction,
    IndexerTopologySettings,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import BlockDriftTracker
from tools.device_under_test import DEVICE

CP_SIZE = 2
PAGE, HEADS, DIM, WIDTH = 64, 4, 32, 2048
# (prefix, new tokens) per request: rows on both sides of the 2048 width and far past it.
PREFIX = (0, 2030, 4900)
NEW = (24, 36, 40)
PLANTED_BLOCKS = (10, 20)
SEED = 21
MODES = ("disabled", "topology_sparse_merge")


def _settings(mode: str) -> IndexerTopologySettings:
    return IndexerTopologySettings(
        policy=TopologyKVPolicyConfig(
            policy=TopologyKVPolicyMode.parse(mode),
            block_size=PAGE,
            coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED,
        )
    )


def _to(obj):
    """Move every tensor field of a parameter dataclass to DEVICE."""
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(DEVICE))
    return obj


def _case():
    # Integer-valued data: exact logits, so bit-equality tests the CP plumbing, not whether
    # a GEMM accumulates a row the same way for a different row count.
    return ref.build_prefill_case(
        PREFIX, NEW, HEADS, DIM, PAGE, seed=SEED, planted_shift_blocks=PLANTED_BLOCKS, integer_valued=True
    )


def _write(indexer, case, cache, tracker, keys, part):
    indexer.write_keys(
        keys.to(DEVICE),
        cache,
        case.slots[part].to(DEVICE),
        drift_tracker=tracker,
        positions=case.positions[part].to(DEVICE),
        request_ids=case.request_ids[part].to(DEVICE),
    )


def _fresh_state(case):
    cache = IndexerKeyCache(torch.zeros(case.batch.num_blocks, PAGE, DIM, device=DEVICE))
    tracker = BlockDriftTracker(len(PREFIX), case.batch.block_table.shape[1], DIM, block_size=PAGE, device=DEVICE)
    return cache, tracker


def single_process_ragged(mode: str) -> torch.Tensor:
    """The whole batch on one process, ragged path: the expected rows ``[R, W]``."""
    case = _case()
    indexer = Indexer(HEADS, DIM, topology=_settings(mode))
    cache, tracker = _fresh_state(case)
    _write(indexer, case, cache, tracker, case.keys[case.is_prefix], case.is_prefix)
    _write(indexer, case, cache, tracker, case.keys[~case.is_prefix], ~case.is_prefix)
    b = case.batch
    q, weights = case.q.to(DEVICE), case.weights.to(DEVICE)
    fmha, attn = _to(b.fmha_params), _to(b.attention_inputs)
    out = indexer._compute_topk(q, weights, cache, fmha, attn, None, drift_tracker=tracker)
    return out.cpu()


def _all_gather_rows(local: torch.Tensor, world: int):
    """All-gather variable-length row blocks (gloo needs equal shapes: pad, then trim)."""
    count = torch.tensor([local.shape[0]])
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    most = int(max(counts))
    padded = torch.full((most, *local.shape[1:]), -1, dtype=local.dtype)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [p[: int(c)] for p, c in zip(parts, counts)]


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        case = _case()  # every rank plans the same batch from the same seed
        b = case.batch
        rows = ref.zigzag_cp_rows(NEW, cp_size=world, cp_rank=rank)  # this rank's global query rows
        new_flat = torch.nonzero(~case.is_prefix).flatten()  # ragged key index of each query token
        # The keys this rank computes: those of its own query tokens.
        my_key_ids = new_flat[torch.tensor(rows, dtype=torch.int64)]
        gathered_ids = torch.cat(_all_gather_rows(my_key_ids.unsqueeze(1), world)).flatten()
        gathered_keys = torch.cat(_all_gather_rows(case.keys[my_key_ids], world))
        restore = torch.argsort(gathered_ids)  # back to the global (request-major) order
        assert torch.equal(gathered_ids[restore], new_flat), "the ranks' key shares do not cover the batch"

        cp, local_rows = ref.build_cp_params(b, rows, cp_size=world, cp_rank=rank, pad_rows=1)
        take = torch.tensor([max(g, 0) for g in local_rows])
        q_local, w_local = case.q[take].to(DEVICE), case.weights[take].to(DEVICE)
        for mode in MODES:
            indexer = Indexer(HEADS, DIM, topology=_settings(mode))
            cache, tracker = _fresh_state(case)
            _write(indexer, case, cache, tracker, case.keys[case.is_prefix], case.is_prefix)  # cached prefix
            _write(indexer, case, cache, tracker, gathered_keys[restore], ~case.is_prefix)  # this step, restored
            out = indexer._compute_topk(
                q_local, w_local, cache, _to(b.fmha_params), _to(b.attention_inputs), _to(cp), drift_tracker=tracker
            )
            assert out is not None and out.shape == (len(rows), WIDTH)
            all_rows = _all_gather_rows(torch.tensor(rows).unsqueeze(1), world)
            all_out = _all_gather_rows(out.cpu(), world)
            if rank == 0:
                full = torch.full((len(b.row_lengths), WIDTH), -7, dtype=torch.int32)
                for r, o in zip(all_rows, all_out):
                    full[r.flatten()] = o
                torch.save(full, os.path.join(out_dir, f"{mode}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_cp_two_processes_equal_single_process_ragged(tmp_path):
    init_file = str(tmp_path / "dist_init")
    mp.spawn(_rank_main, args=(CP_SIZE, init_file, str(tmp_path)), nprocs=CP_SIZE, join=True)
    expected = {mode: single_process_ragged(mode) for mode in MODES}
    for mode in MODES:
        gathered = torch.load(tmp_path / f"{mode}.pt")
        assert not bool((gathered == -7).any()), f"{mode}: some rows were not gathered from any rank"
        assert torch.equal(gathered, expected[mode]), f"{mode}: CP rows differ from the single-process ragged rows"
    # The policy changed the rows past the width (else the equality above would be weak).
    assert not torch.equal(expected["disabled"], expected["topology_sparse_merge"])
