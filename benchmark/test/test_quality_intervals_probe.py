"""Text windows, bootstrap intervals and the copy probe of the quality harness: --text,
spread windows, bootstrap intervals in the gates, the copy probe, the gather reference of
the sparse path, topology_only's recency default, and a model unlike SmolLM2 (tiny random Gemma-3: 4 q / 1 kv heads, head dim 256,
sliding-window layers, a 262k vocabulary). No GGUF model needed; well under a minute.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import re
from fractions import Fraction

import pytest
import torch

from benchmark.quality import cli
from benchmark.quality.errors import UsageError
from benchmark.quality.gate import GateThresholds, evaluate_gate
from benchmark.quality.index_rows import rows_to_mask
from benchmark.quality.intervals import BootstrapSettings, Interval, chunk_sums, ratio_interval
from benchmark.quality.metrics import LayerMetrics
from benchmark.quality.model import LoadedModel, full_attention_layers
from benchmark.quality.policy_selectors import RECENCY, PolicySettings
from benchmark.quality.probe import (
    ProbeCell,
    ProbeResult,
    ProbeSettings,
    make_probe_window,
    probe_layout,
    probe_scores,
    probe_summary,
)
from benchmark.quality.raised_gate import evaluate_raised_gate
from benchmark.quality.runner import CellResult, DenseResult, GridResult, GridSettings, run_grid
from benchmark.quality.selector_base import SelectorSettings
from benchmark.quality.selectors import make_selector
from benchmark.quality.sparse_attention import gather_sparse_attention, sparse_layer_attention
from benchmark.quality.synthetic import synthetic_layer, synthetic_settings
from benchmark.quality.text import TextWindow, load_text_file, parse_novels, sample_windows, sample_windows_from_each


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


# ----------------------------------------------------------------------------- --text


def test_text_file_is_read_as_utf8_with_its_sha256(tmp_path):
    path = tmp_path / "book.txt"
    body = "Ein Buch über Zürich. — «Ελληνικά» too.\n" * 50
    path.write_text(body, encoding="utf-8")
    text, source = load_text_file(path)
    assert text == body
    assert source["sha256"] == hashlib.sha256(body.encode("utf-8")).hexdigest()
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(UsageError, match="not UTF-8"):
        load_text_file(bad)
    with pytest.raises(UsageError, match="no such file"):
        load_text_file(tmp_path / "missing.txt")


def test_text_flag_is_checked_before_loading(capsys, tmp_path):
    assert cli.main(["--text", str(tmp_path / "nope.txt")]) == 2
    assert "--text: no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- windows


def test_several_windows_are_spread_disjoint_and_deterministic():
    tokens = list(range(10_000))
    ws = sample_windows(tokens, "x", 1000, 3, seed=7)
    assert ws == sample_windows(tokens, "x", 1000, 3, seed=7)
    assert len(ws) == 3 and all(len(w.token_ids) == 1000 for w in ws)
    starts = [w.token_start for w in ws]
    assert all(b - a >= 1000 for a, b in zip(starts, starts[1:])), starts  # no overlap
    slack = 10_000 - 3 * 1000
    for i, s in enumerate(starts):  # one per stratum
        assert i * slack // 3 <= s - i * 1000 <= (i + 1) * slack // 3
    assert sample_windows(tokens, "x", 1000, 3, seed=8) != ws
    # One window: its start is random.Random(seed).sample(range(len - context + 1), k=1)[0].
    rng = random.Random(5)
    assert sample_windows(tokens, "x", 1000, 1, seed=5)[0].token_start == rng.sample(range(9001), k=1)[0]
    # A text too short for disjoint windows still gets distinct, sorted starts.
    short = sample_windows(list(range(1500)), "x", 1000, 3, seed=1)
    assert [w.token_start for w in short] == sorted({w.token_start for w in short})


def test_windows_from_each_novel_of_a_list():
    a, b = list(range(5000)), list(range(100_000, 103_000))
    got = sample_windows_from_each([("emma", a), ("persuasion", b)], 1000, 2, seed=3)
    assert [w.novel for w in got] == ["emma", "emma", "persuasion", "persuasion"]
    assert got[:2] == sample_windows(a, "emma", 1000, 2, seed=3)
    assert got[2:] == sample_windows(b, "persuasion", 1000, 2, seed=3)
    assert all(w.token_ids[0] >= 100_000 for w in got[2:])  # cut from the second text
    assert sample_windows_from_each([("emma", a)], 1000, 2, seed=3) == sample_windows(a, "emma", 1000, 2, seed=3)


@pytest.mark.parametrize("value, words", [("emma,nope", "expected novels from"), ("emma,emma", "['emma'] more than once"),
                                          (" , ", "expected a novel or a comma list")])
def test_bad_novel_lists_name_the_flag(value, words):
    with pytest.raises(UsageError, match=re.escape("--novel: ") + ".*" + re.escape(words)):
        parse_novels(value)


def test_novel_lists_keep_their_order():
    assert parse_novels("prideprejudice") == ("prideprejudice",)
    assert parse_novels("persuasion, emma") == ("persuasion", "emma")


def test_default_run_has_several_windows():
    assert cli.build_parser().parse_args([]).windows >= 2


# ----------------------------------------------------------------------------- intervals


def test_chunk_sums_never_straddle_windows():
    sums, counts = chunk_sums([torch.ones(5), 2 * torch.ones(3)], chunk=2)
    assert counts.tolist() == [2, 2, 1, 2, 1] and sums.tolist() == [2, 2, 1, 4, 2]


def test_ratio_interval_paired_bootstrap():
    g = _gen(0)
    base = [torch.rand(3000, generator=g, dtype=torch.float64) * 6 for _ in range(4)]
    same = ratio_interval(base, base)
    assert (same.point, same.lo, same.hi) == (1.0, 1.0, 1.0)
    # A constant shift c per token: every replicate sees the same ratio exp(c) (paired).
    shifted = ratio_interval([b + 0.01 for b in base], base)
    assert shifted.lo == pytest.approx(math.exp(0.01)) and shifted.hi == pytest.approx(math.exp(0.01))
    # Noisy differences: the interval holds the point, is seeded, and narrows with more text.
    noisy = [b + 0.002 + 0.3 * torch.randn(b.shape, generator=g, dtype=torch.float64) for b in base]
    iv = ratio_interval(noisy, base)
    assert iv.lo < iv.point < iv.hi
    assert iv == ratio_interval(noisy, base)
    half = ratio_interval(noisy[:1], base[:1])
    assert (half.hi - half.lo) > (iv.hi - iv.lo)
    # The point estimate is the plain perplexity ratio.
    ppl = lambda ws: math.exp(float(torch.cat(ws).mean()))  # noqa: E731
    assert iv.point == pytest.approx(ppl(noisy) / ppl(base), rel=1e-12)
    # No per-token losses: the interval is the point.
    assert ratio_interval(None, None, point=1.23) == Interval(1.23, 1.23, 1.23)
    with pytest.raises(ValueError):
        ratio_interval(base, base[:2])


def _grid_with_losses(ppl_by_selector, noise, tokens=600, windows=2, budget=Fraction(1, 4)):
    """Cells whose per-token losses average to log(ppl), with per-token noise of std ``noise``."""
    g = _gen(1)
    base = [torch.full((tokens,), math.log(10.0), dtype=torch.float64) for _ in range(windows)]
    shared = [torch.randn(tokens, generator=g, dtype=torch.float64) for _ in range(windows)]
    dense = DenseResult(100, nll_sum=float(sum(b.sum() for b in base)), tokens=tokens * windows,
                        window_nll=[b + s for b, s in zip(base, shared)])
    dense.nll_sum = float(sum(w.sum() for w in dense.window_nll))
    cells = []
    for name, ppl in ppl_by_selector.items():
        ws = [torch.full((tokens,), math.log(ppl), dtype=torch.float64) + s
              + noise * torch.randn(tokens, generator=g, dtype=torch.float64) for s in shared]
        cells.append(CellResult(100, budget, 25, name, nll_sum=float(sum(w.sum() for w in ws)),
                                tokens=tokens * windows, window_nll=ws))
    return GridResult({100: dense}, cells, {}, bootstrap=BootstrapSettings(samples=500))


def test_gate_judges_regression_and_null_models_on_the_interval():
    # Point regression +0.1% (< 0.2%) but noisy: the upper bound exceeds +0.2% -> FAIL.
    noisy = _grid_with_losses({"learned": 10.0, "mode": 10.01, "locality": 10.02, "random": 12.0}, noise=0.2)
    v = evaluate_gate(noisy, ["mode"], GateThresholds(max_ppl_ratio=1.1))[0]
    checks = {c.name.split(" (")[0]: c for c in v.checks}
    reg = next(c for c in v.checks if c.name.startswith("ppl/learned"))
    assert reg.passed is False and "upper bound" in reg.name and "[" in reg.detail
    loc = next(c for c in v.checks if c.name.startswith("ppl < locality"))
    assert loc.passed is False  # 0.1% better on the point, not beyond the noise
    assert next(c for c in v.checks if c.name.startswith("ppl < random")).passed is True
    assert checks  # every check printed
    # Without noise the same points pass.
    clean = _grid_with_losses({"learned": 10.0, "mode": 10.01, "locality": 10.02, "random": 12.0}, noise=0.0)
    assert evaluate_gate(clean, ["mode"], GateThresholds(max_ppl_ratio=1.1))[0].status == "PASS"


def test_raised_gate_strictly_better_uses_the_interval():
    budget = Fraction(1, 4)
    for noise, expected in ((0.0, True), (0.3, False)):
        grid = _grid_with_losses({"learned": 10.0, "topology_sparse_merge": 9.99}, noise=noise, budget=budget)
        check = next(c for c in evaluate_raised_gate(grid) if c.name.startswith("best merge vs learned"))
        assert check.passed is expected, (noise, check)
        assert "95% CI" in check.name


# ----------------------------------------------------------------------------- copy probe


@pytest.mark.parametrize("context", [256, 512, 2048, 8192])
def test_probe_layout_fits_and_refuses_what_does_not(context):
    s = ProbeSettings(distances=(Fraction(1, 8), Fraction(1, 2), Fraction(3, 4)))
    first, second, dists = probe_layout(context, s)
    assert [b - a for a, b in zip(first, second)] == list(dists)
    assert second[-1] + s.segment == context and min(first) >= 8
    with pytest.raises(UsageError, match="do not fit"):
        probe_layout(64, s)


def test_probe_window_writes_each_segment_twice():
    base = TextWindow("t", 10, tuple(range(1000, 1512)))
    pw = make_probe_window(base, vocabulary=range(50, 90), settings=ProbeSettings())
    assert pw == make_probe_window(base, vocabulary=range(50, 90), settings=ProbeSettings())
    ids = pw.window.token_ids
    for f, s, seg in zip(pw.first, pw.second, pw.segments):
        assert ids[f:f + 32] == seg == ids[s:s + 32] and all(50 <= t < 90 for t in seg)
    untouched = set(range(512)) - {p for f in pw.first + pw.second for p in range(f, f + 32)}
    assert all(ids[p] == base.token_ids[p] for p in untouched)
    # context 512, 3 copies of 32 at the end: second copies start at 416, 448, 480; 31 predicting rows each
    assert pw.second == (416, 448, 480)
    assert pw.copy_rows() == list(range(416, 447)) + list(range(448, 479)) + list(range(480, 511))


def test_probe_scores_a_perfect_copier_and_keeps_only_selectors_near_dense():
    # A "model" whose hidden state at position p one-hot encodes the token at p + 1 copies perfectly.
    vocab = 64
    pw = make_probe_window(TextWindow("t", 0, tuple(range(256))), vocabulary=range(vocab),
                           settings=ProbeSettings(distances=(Fraction(1, 8), Fraction(1, 2))))
    ids = torch.tensor(pw.window.token_ids[1:] + (0,)) % vocab
    hidden = torch.nn.functional.one_hot(ids, vocab).float() * 20
    head = torch.nn.Linear(vocab, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(vocab))
    scores = probe_scores(hidden, head, pw)
    assert [c for _, c, _ in scores] == [31, 31] and all(n / t < 1e-3 for n, _, t in scores)
    dense = ProbeCell.empty(2)
    dense.add(scores)
    half = ProbeCell.empty(2)
    half.add([(10.0, 31, 31), (30.0, 0, 31)])
    result = ProbeResult(ProbeSettings(), {256: pw.distances}, {256: dense},
                         {(256, Fraction(1, 8), "good"): dense, (256, Fraction(1, 8), "bad"): half}, {256: [pw]})
    assert result.keepers(256, Fraction(1, 8)) == (["good"], ["bad"])
    assert "keep >= 90% of dense's copy accuracy (1.000): good; below: bad" in probe_summary(result)
    assert result.to_json()["keepers"][0]["keep"] == ["good"]


# ----------------------------------------------------------------------------- fast path


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("selector_name, width", [("learned", 37), ("random", 100), ("locality", 1), ("oracle", 64)])
def test_masked_fast_path_equals_gather_path(selector_name, width, softcap):
    layer = dataclasses.replace(synthetic_layer(seed=9, layer_idx=2, T=200, H=8, Hkv=2, D=32), softcap=softcap)
    rows = make_selector(selector_name, synthetic_settings())(layer, width, {})
    fast = sparse_layer_attention(layer, rows, width, None, sink_tokens=4)
    torch.testing.assert_close(fast, gather_sparse_attention(layer, rows), atol=1e-5, rtol=1e-4)
    # The metric pass leaves the output alone.
    torch.testing.assert_close(sparse_layer_attention(layer, rows, width, LayerMetrics(), sink_tokens=4), fast)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("compact_below", [0, 10**9])  # always / never attend over the used columns only
def test_column_path_and_full_mask_path_agree(monkeypatch, compact_below, softcap):
    from benchmark.quality import sparse_attention

    layer = dataclasses.replace(synthetic_layer(seed=5, layer_idx=1, T=300, H=6, Hkv=3, D=16), softcap=softcap)
    for name, width in (("locality", 40), ("learned", 50)):
        rows = make_selector(name, synthetic_settings())(layer, width, {})
        monkeypatch.setattr(sparse_attention, "COMPACT_BELOW", compact_below)
        out = sparse_layer_attention(layer, rows, width, None, sink_tokens=4)
        torch.testing.assert_close(out, gather_sparse_attention(layer, rows), atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- topology_only default


def test_topology_only_defaults_to_recency_and_selects_locality():
    p = PolicySettings()
    only, merge = p.for_mode("topology_only"), p.for_mode("topology_sparse_merge")
    # Both modes keep the engine's 64-token blocks (the engine cuts a block at its newest
    # tokens, so recency witnesses at 64 fill a row with the newest tokens).
    assert (only.witness_signal, only.block_size) == (RECENCY, 64)
    assert (merge.witness_signal, merge.block_size) == ("key_drift", 64)
    explicit = PolicySettings(witness_signal="key_drift").for_mode("topology_only")
    assert (explicit.witness_signal, explicit.block_size) == ("key_drift", 64)
    # Rows: exactly locality's token sets at 64-token blocks.
    layer = synthetic_layer(seed=3, T=600, H=6, Hkv=2, D=16, query_chunk=128)
    for width in (37, 64, 150):
        a = rows_to_mask(make_selector("topology_only", SelectorSettings(), p)(layer, width, {}), 600)
        b = rows_to_mask(make_selector("locality", SelectorSettings(), p)(layer, width, {}), 600)
        assert torch.equal(a, b), width


# ----------------------------------------------------------------------------- another model


def _tiny_gemma3():
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from benchmark.quality import sparse_attention

    sparse_attention.register()
    cfg = Gemma3TextConfig(vocab_size=262_144, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=32,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           max_position_embeddings=1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=sparse_attention.ATTENTION_NAME).eval()
    sparse_attention.install_hidden_capture(model)
    return LoadedModel(model=model, tokenizer=None, gguf_path=None, gguf_sha256="",
                       full_attention_layers=full_attention_layers(model.config))


def test_logits_rows_cap_large_vocabularies():
    from benchmark.quality.runner import logits_rows

    assert logits_rows(1024, 49_152) == 1024  # SmolLM2: the flag's value
    assert logits_rows(1024, 262_144) == 256  # 256 x 262k fp32 = 256 MB
    assert logits_rows(100, 262_144) == 100


def test_grid_on_gqa_256_dim_sliding_262k_vocab_model():
    lm = _tiny_gemma3()
    assert lm.full_attention_layers == (1,)
    tokens = torch.randint(0, 262_144, (2000,), generator=_gen(2)).tolist()
    windows = {128: sample_windows(tokens, "rand", 128, 2, seed=0)}
    settings = GridSettings(contexts=(128,), budgets=(Fraction(1, 4), Fraction(1, 1)),
                            selectors=("learned", "locality", "topology_only"), query_chunk=64, logits_chunk=100,
                            selector_settings=synthetic_settings(32),
                            metric_stride=4, bootstrap=BootstrapSettings(chunk=32, samples=200))
    probe = ProbeSettings(segment=16, distances=(Fraction(1, 4), Fraction(1, 2)))
    probes = {128: [make_probe_window(windows[128][0], tokens[:500], probe)]}
    grid = run_grid(lm, windows, settings, progress=False, probes=probes, probe_settings=probe)
    for cell in grid.cells:
        assert cell.sparse_layers == (1,) and len(cell.window_nll) == 2
        iv = grid.interval(128, cell.budget, cell.selector)
        assert iv.lo <= iv.point <= iv.hi
    # Budget 1 (W = L): every row is dense by convention, so every selector is dense exactly.
    for name in settings.selectors:
        assert grid.ppl_ratio(128, Fraction(1, 1), name) == pytest.approx(1.0, abs=1e-5)
        full = grid.probe.cells[(128, Fraction(1, 1), name)]
        assert full.correct == grid.probe.dense[128].correct
    assert grid.ppl_ratio(128, Fraction(1, 4), "locality") != pytest.approx(1.0, abs=1e-6)
