"""The quality harness's fast sparse path against plain references (no GGUF model needed).

The fast path (scratch buffers, one ``bmm`` per chunk on keys repeated and transposed
once per layer, in-place scoring, ``-inf`` only in the causal corner, chunked selection
masks, the bitmap duplicate check of the row contract) must select *exactly* the rows the plain form
selects: same ``torch.topk`` call on bit-identical scores, so ties (the proxy's relu zeroes
many keys) resolve the same way. Attention and perplexity are compared with a plain
fp64 reference within fp32 tolerance. About 1.5 minutes on 2 shared cores.
"""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from typing import Callable

import pytest
import torch

from benchmark.quality import cli, sparse_attention
from benchmark.quality.attention_reference import reference_sparse_attention
from benchmark.quality.errors import UsageError
from benchmark.quality.index_rows import check_engine_rows, dense_rows, rows_from_scores
from benchmark.quality.layer import LayerInputs, masked_softmax
from benchmark.quality.metrics import LayerMetrics
from benchmark.quality.model import LoadedModel, full_attention_layers
from benchmark.quality.report import NO_POLICY_MODE, markdown_report
from benchmark.quality.runner import GridSettings, auto_metric_stride, cell_summary, run_grid
from benchmark.quality.selector_base import (
    SelectorSettings,
    indexer_inputs,
    learned_rows_and_scores,
    proxy_index_scores_reference,
    proxy_rows_and_scores,
    trained_indexer_inputs,
)
from benchmark.quality.selectors import make_selector, select_oracle
from benchmark.quality.sparse_attention import PLAN_KWARG, STAGES, SparsePlan, sparse_layer_attention
from benchmark.quality.synthetic import synthetic_layer, synthetic_settings
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import weighted_relu_logits
from benchmark.quality.text import sample_windows

# The trained indexer of the synthetic layers: seeded random projections (the code path is
# what these tests pin, not a trained model).
SYNTHETIC = synthetic_settings()
# Query counts that leave the last 64-row chunk partly filled: 27 (one partial chunk),
# 61 (one chunk, 3 short of full), 1541 (24 full chunks + 5 rows).
LENGTHS = (27, 61, 1541)
QUERY_CHUNK = 64
# Widths: 1 (one key), 5 and 37 (inside a chunk), 64 (= the chunk), and the ones past the
# causal length (every row dense) are added per length in _widths.
WIDTHS = (1, 5, 37, 64)
# fp32 chunked attention vs the fp64 whole-row reference (logits ~N(0, 1) x D**-0.5).
ATTENTION_TOL = dict(atol=2e-5, rtol=1e-4)


def _widths(T: int):
    """WIDTHS below ``T``, plus ``T - 1``, ``T`` and ``T + 50`` (wider than any causal length)."""
    return tuple(w for w in WIDTHS if w < T) + (T - 1, T, T + 50)


def _layer(T: int, seed: int = 0, H: int = 9, Hkv: int = 3, L=None) -> LayerInputs:
    # SmolLM2's head layout (9 q / 3 kv), head dim 16 to keep 1541 tokens cheap.
    return synthetic_layer(seed=seed, layer_idx=seed, T=T, L=L, H=H, Hkv=Hkv, D=16, query_chunk=QUERY_CHUNK)


# ----------------------------------------------------------------------------- plain references


def _reference_top_rows(layer: LayerInputs, width: int, chunk_scores: Callable):
    """The plain top-W over chunks: fresh ``[Tc, lc]`` scores, ``rows_from_scores``, ``torch.cat``."""
    rows, scores = [], []
    for c0, c1, lc in layer.chunks():
        lengths = layer.lengths[c0:c1]
        if lc <= width:
            r = dense_rows(lengths, width)
            sc = torch.zeros(r.shape)
        else:
            s = chunk_scores(c0, c1, lc).clone()
            r = rows_from_scores(s, lengths, width)
            sc = torch.gather(s, 1, r.to(torch.int64).clamp(min=0))
        rows.append(r)
        scores.append(torch.where(r >= 0, sc, float("-inf")))
    return torch.cat(rows), torch.cat(scores)


def _reference_proxy(layer: LayerInputs, width: int, lowrank: bool = False):
    q, k = indexer_inputs(layer, SelectorSettings(), lowrank)
    return _reference_top_rows(layer, width, proxy_index_scores_reference(layer, q, k))


def _reference_learned(layer: LayerInputs, width: int, settings: SelectorSettings = None):
    """The trained indexer's rows through the plain top-W (fresh per-chunk scores)."""
    q, w, k = trained_indexer_inputs(layer, settings or SYNTHETIC)
    return _reference_top_rows(layer, width, lambda c0, c1, lc: weighted_relu_logits(q[c0:c1], w[c0:c1], k[:lc]))


def _reference_oracle(layer: LayerInputs, width: int):
    return _reference_top_rows(layer, width, lambda c0, c1, lc: layer.dense_probabilities(c0, c1, lc).sum(dim=0))[0]


# ----------------------------------------------------------------------------- selectors


@pytest.mark.parametrize("T", LENGTHS)
def test_proxy_rows_and_scores_equal_the_plain_form(T):
    layer = _layer(T, seed=T)
    for width in _widths(T):
        rows, scores = proxy_rows_and_scores(layer, width, SelectorSettings())
        ref_rows, ref_scores = _reference_proxy(layer, width)
        assert torch.equal(rows, ref_rows), f"T {T} W {width}: rows differ"
        assert torch.equal(scores, ref_scores), f"T {T} W {width}: scores differ"


@pytest.mark.parametrize("T", LENGTHS)
def test_learned_rows_and_scores_equal_the_plain_form(T):
    layer = _layer(T, seed=T)
    for width in _widths(T):
        rows, scores = learned_rows_and_scores(layer, width, SYNTHETIC)
        ref_rows, ref_scores = _reference_learned(layer, width)
        assert torch.equal(rows, ref_rows), f"T {T} W {width}: rows differ"
        assert torch.equal(scores, ref_scores), f"T {T} W {width}: scores differ"


@pytest.mark.parametrize("T", LENGTHS)
def test_oracle_rows_equal_the_plain_form(T):
    layer = _layer(T, seed=T + 1)
    for width in _widths(T):
        assert torch.equal(select_oracle(layer, width, {}), _reference_oracle(layer, width)), f"T {T} W {width}"


@pytest.mark.parametrize("case", ["mha", "longer_keys", "softcap", "model_mask", "lowrank"])
def test_fast_selectors_equal_the_plain_form_on_other_layouts(case):
    # mha: one query head per KV head (the bmm then sees no repeated keys); longer_keys: the
    # queries are the last 61 of 100 positions; softcap: the oracle's in-place soft-capping;
    # model_mask: a mask of the model's own (the oracle masks all of it, not just the corner);
    # lowrank: the weak proxy (4 dims per head).
    T = 61
    layer = _layer(T, seed=7, H=4, Hkv=4) if case == "mha" else _layer(T, seed=7, L=100 if case == "longer_keys" else None)
    if case == "softcap":
        layer = dataclasses.replace(layer, softcap=2.0)
    if case == "model_mask":
        allowed = torch.arange(T)[None, :] < layer.lengths[:, None]
        allowed[:, 3:9] = False  # e.g. padding the model masked
        layer = dataclasses.replace(layer, allowed=allowed)
    for width in (5, 37, T + 50):
        lowrank = case == "lowrank"
        got = proxy_rows_and_scores(layer, width, SelectorSettings(), lowrank)
        ref = _reference_proxy(layer, width, lowrank)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), f"{case} W {width}: proxy"
        got = learned_rows_and_scores(layer, width, SYNTHETIC)
        ref = _reference_learned(layer, width)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), f"{case} W {width}: learned"
        assert torch.equal(select_oracle(layer, width, {}), _reference_oracle(layer, width)), f"{case} W {width}: oracle"


def test_random_and_failure_modes_equal_the_plain_form():
    # The random selector and the degraded proxies share top_rows_by_chunk; their chunk
    # scores are fresh tensors (random) or built on the proxy's scratch block (noisy, nosink).
    layer = _layer(1541, seed=3)
    width = 100
    gen = torch.Generator().manual_seed(3 * 1_000_003 + layer.layer_idx)  # layer_generator(seed 3, layer 3)
    ref_random = _reference_top_rows(layer, width, lambda c0, c1, lc: torch.rand(c1 - c0, lc, generator=gen))[0]
    got_random = make_selector("random", SelectorSettings(seed=3))(layer, width, {})
    assert torch.equal(got_random, ref_random)
    for name in ("learned-noisy", "learned-nosink"):
        rows = make_selector(name, SYNTHETIC)(layer, width, {})
        check_engine_rows(rows, layer.lengths, width, name=name)


# ----------------------------------------------------------------------------- row check


@pytest.mark.parametrize("T", LENGTHS)
def test_row_check_rejects_each_broken_row(T):
    layer = _layer(T, seed=11)
    width = min(37, T - 1)
    rows = make_selector("learned", SYNTHETIC)(layer, width, {})
    check_engine_rows(rows, layer.lengths, width)
    t = T - 1  # the last row: a long row in every case
    for kind, value in (("repeat", int(rows[t, 0])), ("future", int(layer.lengths[t])), ("below -1", -2)):
        broken = rows.clone()
        broken[t, 1] = value
        with pytest.raises(ValueError, match=f"row {t} "):
            check_engine_rows(broken, layer.lengths, width, name=kind)
    repeated_padding = dense_rows(layer.lengths, T + 5)  # -1 repeats: allowed
    check_engine_rows(repeated_padding, layer.lengths, T + 5)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("T", LENGTHS)
def test_sparse_attention_equals_plain_reference(T):
    layer = _layer(T, seed=T + 2)
    for name in ("learned", "locality", "oracle"):
        for width in (5, T + 50):
            rows = make_selector(name, SYNTHETIC)(layer, width, {})
            stages = {}
            out = sparse_layer_attention(layer, rows, width, LayerMetrics(), sink_tokens=4, stage_seconds=stages)
            torch.testing.assert_close(out.double(), reference_sparse_attention(layer, rows), **ATTENTION_TOL,
                                       msg=f"{name} T {T} W {width}")
            assert set(stages) == {"attention", "metrics"} and min(stages.values()) >= 0


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("model_mask", [False, True])
def test_in_place_logits_and_softmax_equal_the_plain_ones_bit_for_bit(softcap, model_mask):
    # The metric pass and the oracle score in scratch buffers, in place (bmm on repeated,
    # transposed keys; scale, soft-cap, mask and softmax in place); the calibration and the
    # eager attention paths out of place. Both must give the same bits.
    layer = dataclasses.replace(_layer(150, seed=13, L=170), softcap=softcap)
    if model_mask:
        allowed = torch.arange(170)[None, :] < layer.lengths[:, None]
        allowed[:, 3:9] = False
        layer = dataclasses.replace(layer, allowed=allowed)
    for c0, c1, lc in layer.chunks():
        q = layer.query[:, c0:c1]
        plain = layer.query_logits(q, layer.key[:, :lc])
        fast = layer.query_logits_into(q, lc, "logits")
        assert torch.equal(fast, plain), (c0, lc)
        allowed = layer.allowed_chunk(c0, c1, lc)
        p = masked_softmax(plain, allowed)
        assert torch.equal(masked_softmax(fast, allowed, in_place=True), p)
        assert torch.equal(layer.dense_probabilities_into(c0, c1, lc, "probs"), p)
        assert torch.equal(layer.dense_probabilities(c0, c1, lc), p)
        assert not bool(p.masked_select(~allowed.expand_as(p)).any()), "masked keys must weigh exactly 0"


# ----------------------------------------------------------------------------- the model


TINY_HIDDEN = 144


def _tiny_llama() -> LoadedModel:
    """A random 2-layer llama with SmolLM2's head layout (9 q / 3 kv heads), head dim 16."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    sparse_attention.register()
    cfg = LlamaConfig(vocab_size=120, hidden_size=TINY_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)  # the model's random weights (the test owns this process's global stream)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=sparse_attention.ATTENTION_NAME).eval()
    sparse_attention.install_hidden_capture(model)
    return LoadedModel(model=model, tokenizer=None, gguf_path=None, gguf_sha256="",
                       full_attention_layers=full_attention_layers(model.config))


def _reference_plan_attention(layer, rows, width, metrics, sink_tokens, metric_stride=1, stage_seconds=None):
    return reference_sparse_attention(layer, rows).to(torch.float32)


@pytest.mark.parametrize("T", (27, 61))
def test_model_nll_equals_plain_reference(T, monkeypatch):
    lm = _tiny_llama()
    ids = torch.randint(0, 120, (1, T), generator=torch.Generator().manual_seed(T))
    layers = frozenset(lm.full_attention_layers)
    tiny = synthetic_settings(TINY_HIDDEN)
    references = {"learned": lambda layer, w, stats: _reference_learned(layer, w, tiny)[0],
                  "oracle": lambda layer, w, stats: _reference_oracle(layer, w),
                  "locality": make_selector("locality", SelectorSettings())}

    def nll(selector, width):
        plan = SparsePlan(selector, width, layers, query_chunk=16)
        with torch.inference_mode():
            logits = lm.model(input_ids=ids, use_cache=False, **{PLAN_KWARG: plan}).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:], reduction="none")

    for width in (5, 16, T + 50):
        fast = {name: nll(make_selector(name, tiny), width) for name in references}
        with monkeypatch.context() as m:
            m.setattr(sparse_attention, "sparse_layer_attention", _reference_plan_attention)
            plain = {name: nll(ref, width) for name, ref in references.items()}
        for name in references:
            torch.testing.assert_close(fast[name], plain[name], atol=1e-4, rtol=1e-5, msg=f"{name} T {T} W {width}")


def test_grid_reports_seconds_per_stage():
    lm = _tiny_llama()
    tokens = torch.randint(0, 120, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    windows = {64: sample_windows(tokens, "rand", 64, 1, seed=0)}
    settings = GridSettings(contexts=(64,), budgets=(Fraction(1, 4),), selectors=("learned", "locality"),
                            selector_settings=synthetic_settings(TINY_HIDDEN), query_chunk=16, metric_stride=None)
    grid = run_grid(lm, windows, settings, progress=False)
    for cell in grid.cells:
        per_forward = cell_summary(grid, cell)["seconds_per_forward"]
        assert set(per_forward) == {"total", "rest", *STAGES}
        assert all(per_forward[s] > 0 for s in STAGES), per_forward
        assert per_forward["total"] == pytest.approx(sum(per_forward[s] for s in (*STAGES, "rest")))
    report = markdown_report(grid, ["learned", "locality"], [], _report_settings())
    assert "## Where the time goes" in report
    # No policy mode among the selectors: the gate section says so instead of an empty table.
    gate = report.split("## Gate", 1)[1].split("##", 1)[0]
    assert NO_POLICY_MODE in gate and "| mode | verdict |" not in gate


def test_an_extra_gate_lands_in_the_report_and_the_json(tmp_path):
    from benchmark.quality.cli import _report_extra_gate
    from benchmark.quality.gate import Check

    (tmp_path / "report.md").write_text("# Topology KV quality\n")
    (tmp_path / "results.json").write_text(json.dumps({"cells": []}))
    checks = [Check("shared every 2 (ctx 64)", False, "1/8: +1.59%"), Check("shared every 4 (ctx 64)", True, "ok")]
    _report_extra_gate(tmp_path, "shared_gate", "Shared-scan gate", checks,
                       lambda cs: "\n".join(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in cs))
    assert (tmp_path / "report.md").read_text() == (
        "# Topology KV quality\n\n## Shared-scan gate\n\n```\n"
        "FAIL  shared every 2 (ctx 64): 1/8: +1.59%\nPASS  shared every 4 (ctx 64): ok\n```\n")
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["cells"] == [] and payload["shared_gate"] == [
        {"name": "shared every 2 (ctx 64)", "passed": False, "detail": "1/8: +1.59%"},
        {"name": "shared every 4 (ctx 64)", "passed": True, "detail": "ok"}]


def _report_settings():
    return {"model": {"gguf_path": "tiny.gguf", "gguf_sha256": "0" * 64, "num_hidden_layers": 2,
                      "num_attention_heads": 9, "num_key_value_heads": 3, "full_attention_layers": [0, 1]},
            "text": {"novel": "rand", "windows": 1}, "versions": {"torch": torch.__version__},
            "selector_settings": {"sink_tokens": 4}}


def test_metric_stride_scales_with_the_context():
    assert [auto_metric_stride(c) for c in (100, 2048, 8192)] == [1, 4, 16]
    assert GridSettings(contexts=(8192,), budgets=(), selectors=(), metric_stride=None).stride_for(8192) == 16
    assert GridSettings(contexts=(8192,), budgets=(), selectors=(), metric_stride=2).stride_for(8192) == 2
    assert cli.parse_metric_stride("auto") is None and cli.parse_metric_stride("3") == 3
    for bad in ("0", "x"):
        with pytest.raises(UsageError, match="--metric-stride: expected 'auto' or an integer >= 1"):
            cli.parse_metric_stride(bad)
