"""End-to-end decode benchmark, batched through the Indexer: dense decode equals
transformers' own greedy generate per request, a budget covering the context equals dense
(one row and several rows per request), the paged block-table path gives the rows of a
contiguous cache, every variant runs and reports sane numbers."""

from __future__ import annotations

import pytest
import torch

from benchmark.e2e import cli as e2e
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
