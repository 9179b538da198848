"""End-to-end decode benchmark, batched through the Indexer: dense decode equals
transformers' own greedy generate per request, a budget covering the context equals dense
(one row and several rows per request), the paged block-table path gives the rows of a
contiguous cache, every variant runs and reports sane numbers; the run's device is
threaded through every tensor the harness makes, and the CUDA timers and memory counter
are the ones a CUDA device selects. The device-placement test runs on the device under
test (``TOPOLOGY_KV_TEST_DEVICE``: the GPU in the ``_cuda_manual`` twin), the others on the CPU."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from benchmark.e2e import cli as e2e
from benchmark.e2e import clock, memory, runner
from benchmark.e2e.decode import BatchRun
from benchmark.e2e.indexers import make_indexer
from benchmark.e2e.layout import VariantState
from tools.device_under_test import DEVICE
from benchmark.quality.sample_text import PRIDE_AND_PREJUDICE_OPENING
from rtp_llm.models_py.modules.hybrid.indexer_params import IndexerKeyCache
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import paged_indexer_topk, paged_request_keys

NUM_LAYERS = 2  # truncated model: fast, and the comparisons are exact either way
CONTEXT = 160  # > 2 pages of 64, so sink/local/witness blocks all exist
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def loaded():
    return e2e.load_model(None, NUM_LAYERS)


@pytest.fixture(scope="module")
def text(loaded):
    ids = loaded.tokenizer(PRIDE_AND_PREJUDICE_OPENING, add_special_tokens=False)["input_ids"]
    assert len(ids) >= CONTEXT + 3 * NEW_TOKENS
    return ids


@pytest.fixture(scope="module")
def shape(loaded):
    return e2e.resolve_indexer_shape("dsa-ratio", None, None, *e2e.kv_geometry(loaded.model))


def _run(loaded, text, shape, lens, variants, width, next_n=0, steps=NEW_TOKENS):
    run = e2e.build_batch(loaded.model, text, lens, variants, steps, next_n, width, shape)
    return run, e2e.decode_batch(loaded.model, run, steps)


def test_indexer_presets_cost(loaded):
    H, Hkv, D = e2e.kv_geometry(loaded.model)
    dsa = e2e.resolve_indexer_shape("dsa-ratio", None, None, H, Hkv, D)
    assert (dsa.heads, dsa.dim) == (1, 64)
    assert 1 / 20 < dsa.ratio_to_attention < 1 / 15 and 1 / 18 < e2e.DSA_RATIO < 1 / 16
    own = e2e.resolve_indexer_shape("model", None, None, H, Hkv, D)
    assert (own.heads, own.dim, own.ratio_to_attention) == (H // Hkv, Hkv * D, 0.5)
    with pytest.raises(ValueError, match="indexer heads"):
        e2e.resolve_indexer_shape("model", H, None, H, Hkv, D)


def test_layout_shares_full_blocks_and_owns_the_rest():
    layout = e2e.Layout([200, 130, 64], variants=3, rows_per_step=2, steps=4)
    tables = [layout.block_table(v) for v in range(3)]
    for b, shared in enumerate(layout.shared_lens):
        n = shared // 64
        assert all(torch.equal(t[b, :n], tables[0][b, :n]) for t in tables)  # shared prefix blocks
        private = [set(t[b, n:].tolist()) - {-1} for t in tables]
        assert all(len(p) == layout.tail_blocks for p in private)
        assert not (private[0] & private[1]) and not (private[1] & private[2])
    used = torch.cat([t.flatten() for t in tables])
    assert int(used.max()) < layout.num_blocks


@torch.no_grad()
def test_dense_batch_matches_transformers_generate(loaded, text, shape):
    lens = [CONTEXT, CONTEXT - 37, CONTEXT - 90]  # different lengths: padding and masks
    run, out = _run(loaded, text, shape, lens, ["dense"], width=CONTEXT)
    model = loaded.model
    model.set_attn_implementation("sdpa")
    try:
        for b, n in enumerate(lens):
            prompt = torch.tensor([text[:n]])
            ref = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones_like(prompt))[0, n:].tolist()
            ours = [run.first_tokens[b]] + [step[b] for step in out["dense"]["argmax"][: NEW_TOKENS - 1]]
            assert ours == ref, f"request {b}"
    finally:
        model.set_attn_implementation(e2e.ATTENTION_NAME)


@pytest.mark.parametrize("next_n", [0, 2])
def test_full_budget_equals_dense_through_the_indexer(loaded, text, shape, next_n):
    lens = e2e.request_lengths(CONTEXT, 8, 0.5)  # B = 8, lengths 160 .. 90
    T = next_n + 1
    width = CONTEXT + NEW_TOKENS * T + 1
    run, out = _run(loaded, text, shape, lens, list(e2e.VARIANTS), width, next_n)
    dense = out["dense"]["argmax"]
    for variant in e2e.VARIANTS[1:]:
        rec = out[variant]
        assert rec["argmax"] == dense, variant
        assert all(all(step) for step in rec["top1"])
        assert max(max(step) for step in rec["kl"]) < 1e-4
        for i, s in enumerate(rec["steps"]):  # every row attends to its whole causal range
            rows = sum(n + i * T + t + 1 for n in lens for t in range(T))
            assert s["attended_tokens"] == NUM_LAYERS * rows
            assert s["scanned_keys"] == (0 if variant == "topology_only_noscan" else
                                         NUM_LAYERS * sum(n + (i + 1) * T for n in lens))


def test_block_table_rows_equal_a_contiguous_cache(loaded, text, shape):
    """The Indexer over the shared/private paged layout gives the rows of a plain cache."""
    lens = [CONTEXT, CONTEXT - 50, CONTEXT - 100]
    variants = ["dense", "learned", "learned+topology_sparse_merge"]
    run, _ = _run(loaded, text, shape, lens, variants, width=48, next_n=1, steps=2)
    gen = torch.Generator().manual_seed(0)
    for name in variants[1:]:
        st = run.states[name]
        for layer, pools in run.pools.items():
            B, T = len(lens), 2
            lengths = torch.tensor([n - T + t + 1 for n in st.lens for t in range(T)], dtype=torch.int32)
            tokens = torch.zeros(B, T, dtype=torch.int64)
            st.lens = [n - T for n in st.lens]  # plan the last step again (lengths as above)
            plan, _, _ = e2e.step_inputs(run, st, tokens)
            st.lens = [n + T for n in st.lens]
            q = torch.randn(B * T, shape.heads, shape.dim, generator=gen)
            rows = st.indexers[layer]._compute_topk(q, plan.weights, pools.index_cache, plan.fmha, plan.attn, None,
                                                    drift_tracker=st.trackers[layer].clone())
            keys = paged_request_keys(pools.index_cache.k_cache, st.block_table)  # [B, MB * 64, Di]
            contiguous = IndexerKeyCache(keys.reshape(-1, 64, shape.dim))
            mb = st.block_table.shape[1]
            table = torch.arange(B * mb, dtype=torch.int32).view(B, mb)
            ref = paged_indexer_topk(q, plan.weights, contiguous.k_cache, table, lengths,
                                     torch.arange(B).repeat_interleave(T), 48)
            if name == "learned":
                assert torch.equal(rows, ref)
            else:  # the policy on the contiguous rows, with the same drift
                plan.attn.kv_cache_kernel_block_id_device = table
                same = st.indexers[layer]._compute_topk(q, plan.weights, contiguous, plan.fmha, plan.attn, None,
                                                        drift_tracker=st.trackers[layer].clone())
                assert torch.equal(rows, same)
            for r in range(B * T):  # and the rows map to this request's own slots
                valid = rows[r][rows[r] >= 0].to(torch.int64)
                assert int(valid.max()) < int(lengths[r])
                slots = e2e.rows_to_slots(rows[r : r + 1], st.block_table, torch.tensor([r // T]))[0]
                expect = e2e.slots_of(st.block_table, torch.full_like(valid, r // T), valid)
                assert torch.equal(slots[: valid.numel()], expect)


def test_small_budget_selects_at_most_w_and_times_parts(loaded, text, shape):
    width, lens = 96, [CONTEXT, CONTEXT - 20]
    rows = e2e.run_one(loaded.model, text, lens, list(e2e.VARIANTS), 3, 0, width, shape, warmup=1)
    assert [r["variant"] for r in rows] == list(e2e.VARIANTS)
    for row in rows:
        variant = row["variant"]
        assert row["step_ms_median"] > 0 and 0 <= row["top1_agreement"] <= 1 and row["mean_kl"] >= 0
        assert row["peak_bytes"] is None or row["peak_bytes"] >= row["shared_state_bytes"]
        assert row["attention_ms"] > 0 and row["rest_ms"] >= 0
        if sys.platform.startswith("linux"):  # getrusage counts them there (None only off Unix)
            assert row["host_minor_faults_per_step"] is not None and row["host_minor_faults_per_step"] >= 0
        if variant == "dense":
            continue
        assert row["kv_bytes_vs_dense"] < 1
        assert (row["indexer_ms"] > 0) == (variant != "topology_only_noscan")
        if variant != "learned":
            assert row["policy_ms"] > 0
    table = e2e.format_table(rows)
    assert table.startswith("**Untrained proxy indexer `dsa-ratio` (1 head x 64 dims), W = 96, 1 row per request")
    assert "\n| context | B | rows | variant |" in table and all(v in table for v in e2e.VARIANTS)


def test_small_budget_steps(loaded, text, shape):
    width, lens = 96, [CONTEXT, CONTEXT - 20]
    _, out = _run(loaded, text, shape, lens, list(e2e.VARIANTS), width, steps=2)
    for variant in e2e.VARIANTS[1:]:
        for s in out[variant]["steps"]:
            assert 0 < s["attended_tokens"] <= NUM_LAYERS * len(lens) * width
            assert (s["scanned_keys"] > 0) == (variant != "topology_only_noscan")
            assert s["total_s"] > 0 and s["attention_s"] > 0
        # Step 0's memory is measured (malloc_trim first): its fault count would count the trim.
        assert out[variant]["steps"][0]["host_minor_faults"] is None
        if sys.platform.startswith("linux"):
            assert out[variant]["steps"][1]["host_minor_faults"] >= 0


def test_targets_report_pass_fail_without_asserting():
    def row(variant, batch, ms, context=8192):
        return {"variant": variant, "batch": batch, "context": context, "rows_per_request": 1,
                "step_ms_median": ms, "speedup_vs_dense": 100.0 / ms}

    rows = [row("dense", 8, 100.0), row("topology_only_noscan", 8, 90.0), row("learned", 1, 50.0),
            row("learned+topology_compress_sparse", 1, 51.0)]
    verdicts = {(t["batch"], t["passed"]) for t in e2e.targets(rows) if t["target"].startswith(
        ("topology_only_noscan", "learned+topology_compress_sparse within"))}
    assert verdicts == {(8, False), (1, True), (8, None)}  # compress_sparse at batch 8: not run
    text = e2e.format_targets(e2e.targets(rows))
    assert "FAIL" in text and "PASS" in text and "NOT RUN" in text


def test_bad_flags_name_the_flag(capsys):
    for argv, flag in [(["--contexts", "1"], "--contexts"), (["--new-tokens", "0"], "--new-tokens"),
                       (["--budget", "0"], "--budget"), (["--variants", "sparse"], "--variants"),
                       (["--warmup", "5", "--new-tokens", "3"], "--warmup"), (["--batches", "0"], "--batches"),
                       (["--next-n", "-1"], "--next-n"), (["--length-spread", "1"], "--length-spread"),
                       (["--indexer-preset", "big"], "--indexer-preset")]:
        with pytest.raises(SystemExit):
            e2e.parse_args(argv)
        assert flag in capsys.readouterr().err
    args = e2e.parse_args(["--contexts", "2048", "8192", "--new-tokens", "8", "--warmup", "2"])
    assert args.batches == [1] and args.variants[0] == "dense"


def test_trained_indexer_variants_write_the_projected_keys_and_decode(loaded, text):
    """The learned variants with the shipped trained indexer: the prefill keys in the index
    cache are the checkpoint's projections of the captured attention inputs (fp8
    round-tripped), decode runs every variant, and a budget covering every row is exact."""
    from benchmark.e2e.indexers import trained_indexer_shape
    from benchmark.indexer.checkpoints import find_shipped_checkpoint, load_trained_indexer
    from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip

    path = find_shipped_checkpoint(loaded.gguf_sha256)
    assert path is not None, "the SmolLM2 trained indexer must ship in benchmark/trained_indexers/"
    trained, info = load_trained_indexer(path, loaded.gguf_sha256)
    H, _, D = e2e.kv_geometry(loaded.model)
    shape = trained_indexer_shape(info.shape.heads, info.shape.head_dim, H, D)
    lens = [CONTEXT, CONTEXT - 30]
    variants = ["dense", "learned", "learned+topology_sparse_merge"]
    from benchmark.e2e.decode import prefill_text

    prefilled = prefill_text(loaded.model, text[:CONTEXT], [n - 1 for n in lens])
    X = prefilled[4]
    run = e2e.build_batch(loaded.model, text, lens, variants, 2, 0, CONTEXT + 8, shape,
                          (*prefilled, [n - 1 for n in lens]), trained)
    st = run.states["learned"]
    for layer, pools in run.pools.items():
        want = fp8_e4m3_round_trip(trained[layer].keys(X[layer], torch.arange(CONTEXT)))  # [C, Di]
        got = paged_request_keys(pools.index_cache.k_cache, st.block_table)[0, :CONTEXT]  # request 0's keys
        assert torch.equal(got, want), f"layer {layer}"
    out = e2e.decode_batch(loaded.model, run, 2)
    for name in variants[1:]:
        assert max(max(k) for k in out[name]["kl"]) < 1e-6, f"{name}: W covers every row, so it equals dense"


def test_a_layer_with_its_own_indexer_shape_gets_its_own_key_width(loaded, text):
    """A trained file whose layer 1 has 4 heads x 16 dims where layer 0 has 1 x 64 (the same
    cost per key): each layer's index cache and drift tracker have its own key width, its
    prefill keys are its projections', the modelled KV read counts each scanning layer's
    width, and a budget covering every row equals dense."""
    from benchmark.e2e.decode import prefill_text
    from benchmark.e2e.indexers import trained_indexer_shape
    from benchmark.e2e.runner import kv_bytes_per_step
    from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections, IndexerProjectionShape
    from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip

    H, Hkv, D = e2e.kv_geometry(loaded.model)
    C = loaded.model.config.hidden_size
    shapes = {0: IndexerProjectionShape(heads=1, head_dim=64, rope_dim=32, hidden_size=C, q_input_size=C),
              1: IndexerProjectionShape(heads=4, head_dim=16, rope_dim=16, hidden_size=C, q_input_size=C)}
    gen = torch.Generator().manual_seed(11)
    trained = {}
    for layer, s in shapes.items():
        m = IndexerProjections(s)
        with torch.no_grad():
            for prm in m.parameters():
                prm.copy_(torch.randn(prm.shape, generator=gen) * 0.05)
        trained[layer] = m.eval().requires_grad_(False)
    lens = [CONTEXT, CONTEXT - 30]
    prefilled = prefill_text(loaded.model, text[:CONTEXT], [n - 1 for n in lens])
    X = prefilled[4]
    variants = ["dense", "learned", "learned+topology_sparse_merge"]
    base = trained_indexer_shape(1, 64, H, D)
    for width, exact in ((CONTEXT + 8, True), (64, False)):
        run = e2e.build_batch(loaded.model, text, lens, variants, 2, 0, width, base,
                              (*prefilled, [n - 1 for n in lens]), trained)
        assert {x: (s.heads, s.dim) for x, s in run.layer_shapes.items()} == {0: (1, 64), 1: (4, 16)}
        st = run.states["learned"]
        for layer, pools in run.pools.items():
            assert pools.index_cache.k_cache.shape[-1] == shapes[layer].head_dim
            assert st.indexers[layer].index_head_dim == shapes[layer].head_dim
            assert st.indexers[layer].index_n_heads == shapes[layer].heads
            want = fp8_e4m3_round_trip(trained[layer].keys(X[layer], torch.arange(CONTEXT)))
            got = paged_request_keys(pools.index_cache.k_cache, st.block_table)[0, :CONTEXT]
            assert torch.equal(got, want), f"layer {layer}"
        out = e2e.decode_batch(loaded.model, run, 2)
        for name in variants[1:]:
            for step in out[name]["steps"]:
                assert step["scanned_key_bytes"] == step["scanned_keys"] // 2 * (64 + 16), name  # 2 scanning layers
                assert kv_bytes_per_step(step, Hkv, D) == (step["sparse_attended_tokens"] + step["dense_read_tokens"]) \
                    * Hkv * D * 8 + step["scanned_key_bytes"]
            if exact:
                assert max(max(k) for k in out[name]["kl"]) < 1e-6, f"{name}: W covers every row, so it equals dense"


def test_device_cuda_without_cuda_fails_at_parsing(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        e2e.parse_args(["--device", "cuda", "--indexer", "proxy"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: --device: expected a device torch can use, got cuda while torch.cuda.is_available() is False" \
        in err and "use --device cpu" in err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device", "tpu"])
    assert "--device: invalid choice: 'tpu'" in capsys.readouterr().err
    assert e2e.parse_args(["--indexer", "proxy"]).device == "cpu"


# The factory functions whose tensors land on the default device (the CPU) unless told.
FACTORIES = {torch.zeros, torch.empty, torch.full, torch.arange, torch.tensor, torch.ones, torch.randn}
HARNESS = str(Path(e2e.__file__).resolve().parent)


class HarnessFactoryCalls(TorchFunctionMode):
    """Records every factory call made from ``benchmark/e2e/`` without ``device=``: on a
    CUDA run each would put a tensor on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1)
            if str(Path(caller.f_code.co_filename).resolve()).startswith(HARNESS):
                self.calls.append(f"{func.__name__} at {caller.f_code.co_filename}:{caller.f_lineno}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def loaded_on_device(loaded):
    """The model on the device under test (the CPU fixture itself on the CPU)."""
    return loaded if DEVICE.type == "cpu" else e2e.load_model(None, NUM_LAYERS, DEVICE)


def _placed(run: BatchRun):
    """Every tensor a built batch holds, by name."""
    out = {}
    for layer, p in run.pools.items():
        out.update({f"k[{layer}]": p.k, f"v[{layer}]": p.v, f"index_keys[{layer}]": p.index_cache.k_cache})
    for name, st in run.states.items():
        out[f"{name}.block_table"] = st.block_table
        for layer, tr in st.trackers.items():
            if tr is not None:
                out.update({f"{name}.tracker[{layer}].{f}": getattr(tr, f)
                            for f in ("_sums", "_counts", "_drift_flat")})
    return out


@pytest.mark.parametrize("indexer", ["proxy", "trained"])
def test_every_tensor_of_a_run_is_on_the_model_device(loaded_on_device, text, indexer):
    """Prefill, layout and decode of every variant: no factory call in benchmark/e2e/ leaves
    out ``device=``, and the pools, tables, trackers and step inputs are on the model's device."""
    from benchmark.e2e.indexers import trained_indexer_shape
    from benchmark.indexer.checkpoints import find_shipped_checkpoint, load_trained_indexer

    model = loaded_on_device.model
    H, Hkv, D = e2e.kv_geometry(model)
    trained = None
    if indexer == "trained":
        trained, info = load_trained_indexer(find_shipped_checkpoint(loaded_on_device.gguf_sha256),
                                             loaded_on_device.gguf_sha256)
        for projections in trained.values():
            projections.to(DEVICE)
        shape = trained_indexer_shape(info.shape.heads, info.shape.head_dim, H, D)
    else:
        shape = e2e.resolve_indexer_shape("dsa-ratio", None, None, H, Hkv, D)
    lens = [CONTEXT, CONTEXT - 30]
    tokens = torch.zeros(len(lens), 2, dtype=torch.int64, device=DEVICE)
    with HarnessFactoryCalls() as calls:
        run = e2e.build_batch(model, text, lens, list(e2e.VARIANTS), 2, 1, 96, shape, trained=trained)
        out = e2e.decode_batch(model, run, 2)
        plan, ids, _ = e2e.step_inputs(run, run.states["learned"], tokens)
        dense_plan, _, _ = e2e.step_inputs(run, run.states["dense"], tokens)
    assert calls.calls == []
    assert run.layout.device == model.device and model.device.type == DEVICE.type
    placed = _placed(run)
    placed.update(slots=plan.slots, positions=plan.positions, request_ids=plan.request_ids, ids=ids,
                  row_lengths=plan.row_lengths, shared_lens=plan.shared_lens, weights=plan.weights,
                  cu_seqlens=plan.attn.decode_cu_seqlens_device, lengths=plan.fmha.expanded_seq_lens,
                  dense_mask=dense_plan.dense_mask)
    wrong = {name: t.device for name, t in placed.items() if t.device.type != DEVICE.type}
    assert not wrong, wrong
    for name, rec in out.items():
        assert all(s["total_s"] > 0 and s["attention_s"] > 0 for s in rec["steps"]), name
        if DEVICE.type == "cuda":  # the allocator's counter is always there (the host's may be missing)
            assert rec["steps"][0]["step_peak_bytes"] is not None, name


def test_step_inputs_follow_the_layout_device(shape):
    """A layout on the ``meta`` device: the block tables, every step input and the dense mask
    are made there (nothing is made on the CPU regardless of the run's device)."""
    layout = e2e.Layout([200, 130], variants=1, rows_per_step=2, steps=3, device="meta")
    st = VariantState("dense", 0, layout.block_table(0), {0: None}, {0: None}, [200, 130])
    run = BatchRun(layout, {}, {"dense": st}, [0, 0], None, [], shape, 64, 0.0, 0, (), None)
    plan, ids, positions = e2e.step_inputs(run, st, torch.zeros(2, 2, dtype=torch.int64, device="meta"))
    made = {"block_table": st.block_table, "slots": plan.slots, "positions": positions,
            "request_ids": plan.request_ids, "row_lengths": plan.row_lengths, "shared_lens": plan.shared_lens,
            "weights": plan.weights, "cu_seqlens": plan.attn.decode_cu_seqlens_device,
            "topk_indices_offset": plan.fmha.topk_indices_offset, "dense_mask": plan.dense_mask}
    assert {name: t.device.type for name, t in made.items()} == dict.fromkeys(made, "meta")
    assert plan.dense_mask.shape == (2, 1, 2, layout.shared_tokens + layout.tail_tokens)


class Synchronizations:
    """``torch.cuda.synchronize`` replaced by a recorder (no GPU needed)."""

    def __init__(self, monkeypatch) -> None:
        self.devices = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.devices.append(device))


def test_the_phase_clock_synchronizes_on_cuda_only(monkeypatch, shape):
    syncs = Synchronizations(monkeypatch)
    assert clock.phase_clock(torch.device("cpu")) is time.perf_counter  # the CPU: the plain clock, unchanged
    assert e2e.Layout([130], 1, 1, 2).clock is time.perf_counter
    assert make_indexer("learned", shape, 64, 0, torch.device("cpu")).clock is time.perf_counter
    assert syncs.devices == []
    cuda = torch.device("cuda", 0)
    before = time.perf_counter()
    assert clock.phase_clock(cuda)() >= before
    assert syncs.devices == [cuda]
    layout = e2e.Layout([130], 1, 1, 2, device=cuda)  # no tensor made: only the clock is read
    layout.clock()
    make_indexer("learned+topology_sparse_merge", shape, 64, 0, cuda).clock()
    assert syncs.devices == [cuda] * 3


def test_the_step_memory_counter_is_the_cuda_allocators_on_cuda(monkeypatch):
    calls = []
    allocated = iter([1000, 1500])  # before the step, its peak

    def fail(*_a, **_k):
        raise AssertionError("the host counters are read on a CUDA run")

    monkeypatch.setattr(memory, "_proc_status", fail)
    monkeypatch.setattr(memory, "_libc", fail)
    def counter(name):
        return lambda d=None: calls.append((name, d)) or next(allocated)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", counter("allocated"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", counter("peak"))
    cuda = torch.device("cuda", 0)
    result, peak = memory.measure_step_memory(lambda: calls.append("step") or "out", cuda)
    assert (result, peak) == ("out", 500)
    assert calls == [("reset", cuda), ("allocated", cuda), "step", ("peak", cuda)]
    assert memory.memory_counter(cuda) == memory.CUDA_COUNTER != memory.memory_counter(torch.device("cpu"))


def test_the_step_memory_counter_on_the_cpu_reads_no_cuda_statistics(monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("a CUDA counter is read on a CPU run")

    for name in ("reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, fail)
    result, peak = memory.measure_step_memory(lambda: torch.ones(1 << 20).sum(), torch.device("cpu"))
    assert float(result) == 1 << 20
    assert peak is None or peak >= 0
    assert memory.memory_counter(torch.device("cpu")) == memory.HOST_COUNTER


def test_the_environment_names_the_device(monkeypatch):
    cpu = runner.environment(torch.device("cpu"))
    assert cpu["device_type"] == "cpu" and "cuda_device" not in cpu and cpu["threads"] == torch.get_num_threads()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    gpu = runner.environment(torch.device("cuda"))
    assert (gpu["device_type"], gpu["cuda_device"]) == ("cuda", "NVIDIA H200")


def test_the_step_order_is_a_balanced_design_after_dense():
    from benchmark.e2e.decode import step_order

    names = ["dense", "a", "b", "c", "d"]
    orders = [step_order(names, i) for i in range(4)]
    # Williams rows 0,1,3,2 shifted by one per step (hand-computed)
    assert orders == [["dense", "a", "b", "d", "c"], ["dense", "b", "c", "a", "d"],
                      ["dense", "c", "d", "b", "a"], ["dense", "d", "a", "c", "b"]]
    assert step_order(names, 4) == orders[0] and step_order(names, -1) == orders[3]
    assert step_order(["dense"], 5) == ["dense"]
    assert step_order(["dense", "a"], 3) == ["dense", "a"]


SHARED = ["learned-shared:2", "learned-shared:2+topology_sparse_merge", "learned-shared:1"]


def test_shared_scans_scan_half_the_layers_and_a_full_budget_equals_dense(loaded, text, shape):
    lens = e2e.request_lengths(CONTEXT, 4, 0.5)
    width = CONTEXT + NEW_TOKENS + 1
    run, out = _run(loaded, text, shape, lens, ["dense"] + SHARED, width)
    dense = out["dense"]["argmax"]
    for variant in SHARED:
        assert out[variant]["argmax"] == dense, variant
        assert max(max(step) for step in out[variant]["kl"]) < 1e-4
        scanning = NUM_LAYERS if variant.endswith(":1") else NUM_LAYERS // 2  # every:2 of 2 layers: layer 0
        for i, s in enumerate(out[variant]["steps"]):
            assert s["scanned_keys"] == scanning * sum(n + i + 1 for n in lens), (variant, i)
    assert [run.states["learned-shared:2"].indexers[x].shares_rows_of for x in range(NUM_LAYERS)] == [None, 0]


def test_a_sharing_layer_attends_over_the_scanning_layers_rows(loaded, text, shape, monkeypatch):
    """learned-shared:2 at a small budget: layer 1 gets layer 0's op rows (the same tensor),
    writes no indexer key; learned-shared:1 decodes exactly as learned."""
    from rtp_llm.models_py.modules.hybrid.indexer import Indexer

    calls = []
    real_compute, real_write = Indexer._compute_topk, Indexer.write_keys

    def compute(self, *args, **kwargs):
        out = real_compute(self, *args, **kwargs)
        calls.append((self.layer_idx, self.shares_rows_of, out))
        return out

    writes = []
    monkeypatch.setattr(Indexer, "_compute_topk", compute)
    monkeypatch.setattr(Indexer, "write_keys", lambda self, *a, **k: (writes.append(self.layer_idx),
                                                                      real_write(self, *a, **k))[1])
    lens = [CONTEXT, CONTEXT - 20]
    run = e2e.build_batch(loaded.model, text, lens, ["dense", "learned-shared:2"], 2, 0, 96, shape)
    writes.clear()
    e2e.decode_batch(loaded.model, run, 2)
    assert [c[:2] for c in calls] == [(0, None), (1, 0)] * 2
    for step in range(2):
        assert calls[2 * step + 1][2] is calls[2 * step][2], "layer 1 did not take layer 0's rows"
    assert writes == [0, 0], "a sharing layer wrote indexer keys"
    monkeypatch.undo()
    _, out = _run(loaded, text, shape, lens, ["dense", "learned", "learned-shared:1"], 96, steps=3)
    assert out["learned-shared:1"]["argmax"] == out["learned"]["argmax"]
    assert out["learned-shared:1"]["kl"] == out["learned"]["kl"]


def test_shared_variant_names_are_checked(capsys):
    for bad in ("learned-shared:0", "learned-shared:x", "learned-shared:2+topology_only", "learned-shared:"):
        with pytest.raises(SystemExit):
            e2e.parse_args(["--variants", "learned", bad])
        assert (f"--variants: {bad}: expected learned-shared:<scan> or learned-shared:<scan>+<mode> with <scan> "
                "K (K >= 1), profile or a comma list of scanning layers") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--variants", "learned-shared:profile", "learned+profile"])
    assert ("--variants: ['learned-shared:profile', 'learned+profile'] need --profile FILE"
            in capsys.readouterr().err)
    args = e2e.parse_args(["--variants", "learned", "learned-shared:4+topology_compress_sparse",
                           "learned-shared:0,1+topology_sparse_merge"])
    assert args.variants == ["dense", "learned", "learned-shared:4+topology_compress_sparse",
                             "learned-shared:0,1+topology_sparse_merge"]
    from benchmark.e2e.indexers import share_plan

    assert share_plan("learned-shared:0,2,3", range(5)).scanning == (0, 2, 3)
    assert share_plan("learned-shared:3", range(5)).scanning == (0, 3)
    with pytest.raises(ValueError, match=r"learned-shared:1,2='1,2': expected the first scanning layer to be the first "
                                         r"sparse layer 0"):
        share_plan("learned-shared:1,2", range(5))


QUERY_SETTINGS = {"topology_sparse_merge": {"block_size": 8, "witness_blocks": 4, "local_blocks": 0, "sink_tokens": 0,
                                             "max_structural_fraction": 0.25, "witness_signal": "query_group_mass"}}


def test_query_witnesses_read_each_layers_attention_keys_and_queries(loaded, text, shape, monkeypatch):
    """query_group_mass: every layer's tracker holds its attention keys at 8-token blocks (fed
    by the prefill and each decoded token), its Indexer gets the step's scaled queries, the
    scanning layer still writes its indexer keys, and the witnesses reach the rows."""
    from rtp_llm.models_py.modules.hybrid.indexer import Indexer

    H, Hkv, D = e2e.kv_geometry(loaded.model)
    queries = []
    real_compute = Indexer._compute_topk

    def compute(self, *args, **kwargs):
        queries.append((self.layer_idx, kwargs.get("witness_queries")))
        return real_compute(self, *args, **kwargs)

    monkeypatch.setattr(Indexer, "_compute_topk", compute)
    lens = [CONTEXT, CONTEXT - 20]
    variant = "learned-shared:2+topology_sparse_merge"
    run = e2e.build_batch(loaded.model, text, lens, ["dense", variant], 2, 0, 48, shape,
                          mode_settings=QUERY_SETTINGS)
    st = run.states[variant]
    for layer in range(NUM_LAYERS):
        indexer, tracker = st.indexers[layer], st.trackers[layer]
        assert indexer.reads_queries and indexer.topology.policy.block_size == 8
        assert (tracker.key_dim, tracker.block_size) == (Hkv * D, 8)
        assert tracker.block_counts().sum(dim=1).tolist() == [float(n) for n in lens]
    out = e2e.decode_batch(loaded.model, run, 2)
    assert [q[0] for q in queries] == [0, 1] * 2
    assert all(q is not None and tuple(q.shape) == (len(lens), H, D) for _, q in queries)
    for layer in range(NUM_LAYERS):
        assert st.trackers[layer].block_counts().sum(dim=1).tolist() == [float(n + 2) for n in lens]
    from benchmark.e2e.policy_counters import sum_totals

    assert sum_totals(out[variant]["steps"])["structural_injected_tokens"] > 0


def test_structure_on_sharing_layers_only_disables_the_scanning_layers_policy(shape):
    from benchmark.e2e.indexers import share_plan

    settings = {"topology_sparse_merge": {**QUERY_SETTINGS["topology_sparse_merge"], "structure_layers": "sharing"}}
    variant = "learned-shared:2+topology_sparse_merge"
    plan = share_plan(variant, range(4))
    built = [make_indexer(variant, shape, 48, layer, torch.device("cpu"), share=plan, mode_settings=settings)
             for layer in range(4)]
    assert [x.topology.enabled for x in built] == [False, True, False, True]
    assert [x.reads_queries for x in built] == [False, True, False, True]
    everywhere = make_indexer(variant, shape, 48, 0, torch.device("cpu"), share=plan, mode_settings=QUERY_SETTINGS)
    assert everywhere.topology.enabled and everywhere.reads_queries


def test_structure_on_listed_layers_only(shape, capsys):
    from benchmark.e2e.indexers import share_plan

    args = e2e.parse_args(["--quick", "--policy-mode-settings",
                           "topology_sparse_merge:witness_signal=query_group_mass,block_size=8,structure_layers=3,1"])
    settings = args.mode_settings
    assert settings["topology_sparse_merge"]["structure_layers"] == "3,1"
    variant = "learned-shared:2+topology_sparse_merge"
    plan = share_plan(variant, range(4))
    built = [make_indexer(variant, shape, 48, layer, torch.device("cpu"), share=plan, mode_settings=settings)
             for layer in range(4)]
    assert [x.topology.enabled for x in built] == [False, True, False, True]
    assert [x.reads_queries for x in built] == [False, True, False, True]
    with pytest.raises(ValueError, match=r"expected sparse layers of the model \[0, 1, 2, 3\], got \[7\]"):
        make_indexer(variant, shape, 48, 0, torch.device("cpu"), share=plan,
                     mode_settings={"topology_sparse_merge": {"structure_layers": "1,7"}})


def test_policy_mode_settings_are_checked_before_the_load(capsys):
    args = e2e.parse_args(["--quick", "--policy-mode-settings",
                           "topology_sparse_merge:block_size=8,witness_signal=query_group_mass"])
    assert args.mode_settings == {"topology_sparse_merge": {"block_size": 8, "witness_signal": "query_group_mass"}}
    assert args.contexts == [512]  # --quick still fills the flags not typed
    for item, message in [
        ("topology_sparse_merge:witness_signal=query_mass", "witness_signal: expected one of [auto, key_drift"),
        ("topology_sparse_merge:scaffold_tokens=4", "scaffold_tokens is the quality harness's"),
        ("topology_sparse_merge:witness_exchange=2:1/2", "witness_exchange is the quality harness's; serving "
         "(and so the end-to-end benchmark) has no exchange"),
        ("sparse:block_size=8", "expected MODE:KEY=VALUE,... with MODE in"),
        ("topology_sparse_merge:block_size=0", "block_size"),
        ("topology_sparse_merge:structure_layers=some", "structure_layers: expected one of [all, sharing] or a "
         "comma list of layer indices"),
        ("topology_sparse_merge:structure_layers=1,1", "structure_layers: expected each layer once"),
    ]:
        with pytest.raises(SystemExit):
            e2e.parse_args(["--policy-mode-settings", item])
        err = capsys.readouterr().err
        assert "--policy-mode-settings" in err and message in err, (item, err)


def test_the_shared_target_takes_the_fastest_configuration_at_learned_quality():
    def row(variant, batch, ms, kl):
        return {"variant": variant, "batch": batch, "context": 8192, "rows_per_request": 1,
                "step_ms_median": ms, "step_ms": [ms, ms], "speedup_vs_dense": 1.0, "mean_kl": kl}

    rows = [row("dense", 1, 120.0, 0.0),  # never eligible: no sparse attention at learned's budget
            row("learned", 1, 100.0, 0.05), row("learned-shared:4", 1, 60.0, 0.04),  # no structure: not eligible
            row("learned-shared:2+topology_sparse_merge", 1, 78.0, 0.05),
            row("learned-shared:4+topology_sparse_merge", 1, 70.0, 0.06),  # faster, but worse KL
            row("dense", 8, 90.0, 0.0), row("learned", 8, 100.0, 0.01),
            row("learned+topology_sparse_merge", 8, 101.0, 0.02),
            row("learned-shared:2+topology_sparse_merge", 8, 80.0, 0.03)]  # faster, further from learned's KL
    got = {t["batch"]: t for t in e2e.targets(rows) if t["target"].startswith("a configuration with structure")}
    assert got[1]["passed"] is True and abs(got[1]["value"] - 100 / 78) < 1e-9
    assert "learned-shared:2+topology_sparse_merge 1.282x" in got[1]["detail"]
    assert got[8]["passed"] is False and got[8]["value"] is None
    # None as good: the detail names the one closest to learned's KL (not the fastest), with its speed.
    assert got[8]["detail"] == ("no configuration with structure has mean KL <= learned's (0.0100); the closest: "
                                "learned+topology_sparse_merge 0.990x learned's step (paired), mean KL 0.0200 vs "
                                "learned's 0.0100; speed interval [0.990, 0.990]")
    assert got[8]["closest"]["variant"] == "learned+topology_sparse_merge"
    assert got[8]["closest"]["speed"] == pytest.approx(100 / 101) and "kl_difference" not in got[8]["closest"]
    text = e2e.format_targets(e2e.targets(rows))
    assert "PASS: a configuration with structure >= 1.25x learned's step at mean KL <= learned's, batch 1" in text
    # Of any kind: sharing alone is eligible (learned itself is not); batch 8 has nothing as good.
    anyk = {t["batch"]: t for t in e2e.targets(rows) if t["target"].startswith("a configuration of any kind")}
    assert anyk[1]["passed"] is True and abs(anyk[1]["value"] - 100 / 60) < 1e-9
    assert "learned-shared:4 1.667x" in anyk[1]["detail"]
    assert anyk[8]["passed"] is False and "no configuration of any kind has mean KL" in anyk[8]["detail"]


# ----------------------------------------------------------------------------- sliding-window layers

WINDOW = 32  # < CONTEXT, so a sliding-window layer reads less than the whole row


@pytest.fixture(scope="module")
def tiny_gemma3():
    """A random Gemma-3 text model: sliding-window layers 0 and 2, full-attention 1 and 3."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    runner.use_decode_attention(model)
    return model


@pytest.mark.parametrize("indexer", ["proxy", "trained"])
def test_sliding_window_layers_stay_dense_and_need_no_indexer(tiny_gemma3, indexer):
    """Only the full-attention layers get an indexer (a trained checkpoint covers only
    them), indexer keys and scans; the sliding-window layers attend densely over their
    window, and their KV read is the window. A budget covering every row equals dense;
    a small one selects at most W on the full-attention layers."""
    from benchmark.e2e.decode import sparse_layers
    from benchmark.e2e.indexers import trained_indexer_shape
    from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections, IndexerProjectionShape

    model = tiny_gemma3
    assert sparse_layers(model) == [1, 3]
    H, Hkv, D = e2e.kv_geometry(model)
    trained = None
    if indexer == "trained":
        torch.manual_seed(1)
        pshape = IndexerProjectionShape(heads=1, head_dim=16, rope_dim=8, hidden_size=32, q_input_size=32)
        trained = {layer: IndexerProjections(pshape).eval() for layer in (1, 3)}
        shape = trained_indexer_shape(1, 16, H, D)
    else:
        shape = e2e.resolve_indexer_shape("dsa-ratio", None, None, H, Hkv, D)
    text = torch.randint(0, 512, (CONTEXT + 8,), generator=torch.Generator().manual_seed(2)).tolist()
    lens = [CONTEXT, CONTEXT - 40]
    variants = ["dense", "learned", "learned+topology_sparse_merge"]
    for width, exact in ((CONTEXT + 8, True), (64, False)):
        run = e2e.build_batch(model, text, lens, variants, 2, 0, width, shape, None, trained)
        for layer in (0, 2):
            assert run.pools[layer].index_cache is None and run.pools[layer].proxy is None
            assert all(st.indexers[layer] is None for st in run.states.values())
        for layer in (1, 3):
            assert run.pools[layer].index_cache is not None
            assert run.states["learned"].indexers[layer] is not None
        assert run.sparse == (1, 3) and run.window == WINDOW
        out = e2e.decode_batch(model, run, 2)
        for name in variants[1:]:
            for i, step in enumerate(out[name]["steps"]):
                after = [n + i + 1 for n in lens]
                assert step["scanned_keys"] == 2 * sum(after), (name, i)
                assert step["dense_read_tokens"] == 2 * sum(min(n, WINDOW) for n in after), (name, i)
                # sparse rows: one per request and full-attention layer, each at most W tokens
                assert step["sparse_attended_tokens"] <= 2 * len(lens) * width
            if exact:
                assert out[name]["argmax"] == out["dense"]["argmax"], name
                assert max(max(k) for k in out[name]["kl"]) < 1e-5, name
        dense_step = out["dense"]["steps"][0]
        assert dense_step["dense_read_tokens"] == 2 * sum(n + 1 for n in lens) + 2 * sum(min(n + 1, WINDOW) for n in lens)


# ----------------------------------------------------------------------------- profile variants

SKIP = {"max_structural_fraction": 0, "sink_tokens": 0, "local_blocks": 0, "witness_blocks": 0}
SINKS_LOCAL = {"max_structural_fraction": 0.5, "sink_tokens": 4, "local_blocks": 1, "witness_blocks": 0}


def _profile_data(fingerprint, layers, scanning=None, budgets=("1/4", "1/2"), contexts=(CONTEXT,)):
    data = {"format": "rtp_llm.topology_kv_profile", "version": 1, "model": fingerprint.to_json(),
            "text": {"name": "t", "sha256": "0"}, "command": "test",
            "settings": {"policy": "topology_sparse_merge", "block_size": 64, "contexts": list(contexts),
                         "budgets": list(budgets)},
            "layers": {str(i): entries for i, entries in layers.items()}}
    if scanning is not None:
        data["indexer_share"] = {"scanning": list(scanning)}
    return data


def _profile(loaded, layers, **kwargs):
    from benchmark.quality.calibration import model_fingerprint
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import parse_topology_profile

    fingerprint = model_fingerprint(loaded)
    return parse_topology_profile(_profile_data(fingerprint, layers, **kwargs), model_fingerprint=fingerprint)


def test_the_profile_budget_rules_pick_the_entry(loaded):
    """serving: nearest W / the profile's longest context; context: nearest W / the run's
    context; a budget: that entry (hand-computed, nearest in log scale)."""
    from fractions import Fraction

    from benchmark.e2e.indexers import E2EProfile

    both = {"1/16": SKIP, "1/8": SKIP, "1/4": SKIP}
    profile = _profile(loaded, {0: both, 1: both}, budgets=("1/16", "1/8", "1/4"), contexts=(2048, 4096))
    assert E2EProfile(profile, "serving").entry(1024, 8192) == Fraction(1, 4)  # 1024 / 4096
    assert E2EProfile(profile, "context").entry(1024, 8192) == Fraction(1, 8)  # 1024 / 8192
    assert E2EProfile(profile, "context").entry(256, 8192) == Fraction(1, 16)  # 1/32: nearest 1/16
    assert E2EProfile(profile, "context").entry(3, 32) == Fraction(1, 8)  # 3/32: 1.33x from 1/8, 1.5x from 1/16
    assert E2EProfile(profile, "1/16").entry(2048, 8192) == Fraction(1, 16)
    with pytest.raises(ValueError, match=r"--profile-budget: expected serving, context or one of the budgets of "
                                         r".*\[1/16, 1/8, 1/4\], got '1/32'"):
        E2EProfile(profile, "1/32")
    for bad in ("1/0", "0/4", "eighth", "1/8 ", ""):
        with pytest.raises(ValueError, match="--profile-budget: expected serving, context or a budget N/M"):
            E2EProfile(profile, bad)


def test_profile_flags_are_checked_before_the_model_loads(tmp_path, capsys):
    with pytest.raises(SystemExit):
        e2e.parse_args(["--variants", "learned+profile", "--profile", str(tmp_path / "missing.json")])
    assert "--profile: expected a profile file, got" in capsys.readouterr().err
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(SystemExit):
        e2e.parse_args(["--variants", "learned", "--profile", str(tmp_path / "p.json")])
    assert "--profile: expected a variant that uses it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--variants", "learned+profile", "--profile", str(tmp_path / "p.json"),
                        "--profile-budget", "half"])
    assert "--profile-budget: expected serving, context or a budget N/M (e.g. 1/8), got 'half'" in (
        capsys.readouterr().err)
    args = e2e.parse_args(["--variants", "learned+profile", "learned-shared:profile+profile",
                           "learned-shared:2+profile", "--profile", str(tmp_path / "p.json")])
    assert args.variants[1:] == ["learned+profile", "learned-shared:profile+profile", "learned-shared:2+profile"]
    assert args.profile_budget == "serving"


def test_load_profile_checks_the_model_and_the_scanning_set(loaded, tmp_path):
    import argparse
    import json

    from benchmark.quality.calibration import model_fingerprint
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import ModelFingerprint

    entries = {"1/4": SKIP, "1/2": SKIP}
    mine = model_fingerprint(loaded)
    path = tmp_path / "p.json"

    def load(data, variants, budget="serving"):
        path.write_text(json.dumps(data))
        return runner.load_profile(argparse.Namespace(profile=str(path), profile_budget=budget, variants=variants),
                                   loaded)

    got = load(_profile_data(mine, {0: entries, 1: entries}), ["dense", "learned+profile"], "context")
    assert got.budget == "context" and got.profile.layers[1]
    other = ModelFingerprint("11" * 32, "other.gguf", NUM_LAYERS, (0, 1))
    with pytest.raises(SystemExit,
                       match="error: --profile: .*the profile was made for .*other.gguf.*but this model is"):
        load(_profile_data(other, {0: entries, 1: entries}), ["learned+profile"])
    assert json.loads(path.read_text())["model"]["name"] == "other.gguf"  # the file is left as it was
    with pytest.raises(SystemExit, match="error: --variants: learned-shared:profile=profile: the profile .* has no "
                                         "indexer_share.scanning"):
        load(_profile_data(mine, {0: entries, 1: entries}), ["learned-shared:profile"])
    with pytest.raises(SystemExit, match=r"error: --profile: --profile-budget: expected serving, context or one of "
                                         r"the budgets"):
        load(_profile_data(mine, {0: entries, 1: entries}), ["learned+profile"], "1/8")
    assert runner.load_profile(argparse.Namespace(profile=None, variants=["learned"]), loaded) is None


def test_profile_variants_run_each_layers_entry(loaded, text, shape):
    """A profile that skips every layer decodes exactly as learned (and its shared form as
    the same scanning set without it); one that keeps structure in layer 1 only enables
    the policy there, with that entry's components; the profile's scanning set is the
    shared plan; a budget covering the rows still equals dense."""
    from benchmark.e2e.indexers import E2EProfile

    lens = [CONTEXT, CONTEXT - 20]
    width = 64  # 64 / 160: nearest 1/2 (log scale: 0.4 against 1/4 and 1/2)
    skip_all = E2EProfile(_profile(loaded, {0: {"1/4": SKIP, "1/2": SKIP}, 1: {"1/4": SKIP, "1/2": SKIP}},
                                   scanning=(0,)), "context")
    variants = ["dense", "learned", "learned+profile", "learned-shared:2", "learned-shared:profile",
                "learned-shared:profile+profile"]
    run = e2e.build_batch(loaded.model, text, lens, variants, 3, 0, width, shape, profile=skip_all)
    out = e2e.decode_batch(loaded.model, run, 3)
    assert out["learned+profile"]["kl"] == out["learned"]["kl"]
    assert out["learned-shared:profile"]["kl"] == out["learned-shared:2"]["kl"]
    assert out["learned-shared:profile+profile"]["kl"] == out["learned-shared:2"]["kl"]
    assert [run.states["learned-shared:profile"].indexers[x].shares_rows_of for x in range(NUM_LAYERS)] == [None, 0]
    assert not any(run.states["learned+profile"].indexers[x].topology.enabled for x in range(NUM_LAYERS))

    layer1 = E2EProfile(_profile(loaded, {0: {"1/4": SKIP, "1/2": SKIP}, 1: {"1/4": SKIP, "1/2": SINKS_LOCAL}}),
                        "context")
    run = e2e.build_batch(loaded.model, text, lens, ["dense", "learned+profile"], 2, 0, width, shape, profile=layer1)
    idx = run.states["learned+profile"].indexers
    assert not idx[0].topology.enabled and idx[1].topology.enabled
    assert (idx[1].topology.policy.sink_tokens, idx[1].topology.policy.local_blocks) == (4, 1)
    assert idx[1].topology.policy.max_structural_fraction == 0.5
    # The 1/4 entry (the override) skips layer 1 too.
    run = e2e.build_batch(loaded.model, text, lens, ["dense", "learned+profile"], 2, 0, width, shape,
                          profile=E2EProfile(layer1.profile, "1/4"))
    assert not run.states["learned+profile"].indexers[1].topology.enabled
    _, full = _run_profile(loaded, text, shape, layer1)
    assert full["learned+profile"]["argmax"] == full["dense"]["argmax"]
    assert max(max(step) for step in full["learned+profile"]["kl"]) < 1e-4


def _run_profile(loaded, text, shape, profile):
    lens = e2e.request_lengths(CONTEXT, 2, 0.25)
    width = CONTEXT + NEW_TOKENS + 1
    run = e2e.build_batch(loaded.model, text, lens, ["dense", "learned+profile"], NEW_TOKENS, 0, width, shape,
                          profile=profile)
    return run, e2e.decode_batch(loaded.model, run, NEW_TOKENS)


def test_a_profile_variant_counts_as_structure_in_the_targets():
    from benchmark.e2e.indexers import has_structure, needs_profile, runs_profile_entries

    assert has_structure("learned+profile") and has_structure("learned-shared:profile+profile")
    assert not has_structure("learned-shared:profile") and needs_profile("learned-shared:profile")
    assert runs_profile_entries("learned-shared:3+profile") and not runs_profile_entries("learned-shared:profile")
    assert not needs_profile("learned-shared:3+topology_sparse_merge")
