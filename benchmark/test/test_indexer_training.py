"""Training the indexer (DSA's dense warm-up) on a tiny random model, and the diagnosis of the
untrained proxy it replaces.

* training: the loss falls, and on a held-out window the trained indexer's recall beats the
  same indexer untrained and locality;
* the proxy on raw q/k with a key-independent negative offset (what real post-RoPE q/k
  show): its relu zeroes almost every score, and the engine's tie rule then keeps the
  oldest positions and drops the newest, the current token included.
"""

from __future__ import annotations

import pytest
import torch

from benchmark.indexer.capture import capture_window, sample_rows
from benchmark.indexer.distill import DistillSettings, held_out_kl, train_layer
from benchmark.indexer.evaluate import layer_recall, locality_scores, trained_scores
from benchmark.quality import sparse_attention
from benchmark.quality.index_rows import rows_from_scores
from benchmark.quality.layer import LayerInputs
from benchmark.quality.model import LoadedModel, full_attention_layers
from benchmark.quality.selector_base import SelectorSettings, proxy_rows_and_scores
from benchmark.quality.text import TextWindow
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjectionShape

T = 192  # window tokens: long enough that W = T/8 = 24 leaves most keys out
# q/k projections scaled up: the default init attends almost uniformly (KL to uniform ~0.1),
# which leaves an indexer nothing to learn.
SHARPEN = 8.0


def _tiny_model() -> LoadedModel:
    from transformers import AutoModelForCausalLM, LlamaConfig

    sparse_attention.register()
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)  # the random weights (this test owns the process's global stream here)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=sparse_attention.ATTENTION_NAME).eval()
    with torch.no_grad():  # sharper attention than the default init, so there is something to find
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    sparse_attention.install_hidden_capture(model)
    return LoadedModel(model=model, tokenizer=None, gguf_path=None, gguf_sha256="",
                       full_attention_layers=full_attention_layers(model.config))


def _window(seed: int) -> TextWindow:
    ids = torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(seed)).tolist()
    return TextWindow("random", 0, tuple(ids))


@pytest.fixture(scope="module")
def captured():
    lm = _tiny_model()
    layers = list(lm.full_attention_layers)
    train = [capture_window(lm, _window(i), sample_rows(T, 96, 8, i), layers) for i in range(6)]
    held = capture_window(lm, _window(99), sample_rows(T, 96, T // 4, 99), layers)
    return lm, layers, train, held


def test_training_lowers_the_loss_and_beats_untrained_and_locality(captured):
    lm, layers, train, held = captured
    shape = IndexerProjectionShape(heads=2, head_dim=16, rope_dim=8, hidden_size=64, q_input_size=64)
    settings = DistillSettings(steps=150, lr=1e-2, batch_windows=3)
    for layer in layers:
        samples = [s[layer] for s in train]
        untrained, _ = train_layer(shape, samples, DistillSettings(steps=1, lr=1e-9), seed=layer)
        trained, losses = train_layer(shape, samples, settings, seed=layer)
        assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10, f"layer {layer}: loss {losses[:3]} -> {losses[-3:]}"
        assert held_out_kl(trained, [held[layer]]) < held_out_kl(untrained, [held[layer]])
        r = layer_recall([held[layer]], {"trained": trained_scores(trained), "untrained": trained_scores(untrained),
                                         "locality": locality_scores}, T)
        for budget in ("1/16", "1/8"):
            assert r["trained"][budget] > r["untrained"][budget], (layer, budget, r)
            assert r["trained"][budget] > r["locality"][budget], (layer, budget, r)


def test_training_is_seeded(captured):
    _, layers, train, _ = captured
    shape = IndexerProjectionShape(heads=1, head_dim=16, rope_dim=8, hidden_size=64, q_input_size=64)
    samples = [s[layers[0]] for s in train]
    a, la = train_layer(shape, samples, DistillSettings(steps=5), seed=3)
    b, lb = train_layer(shape, samples, DistillSettings(steps=5), seed=3)
    assert la == lb and all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_engine_tie_rule_keeps_the_lower_positions():
    scores = torch.zeros(3, 10)
    scores[1, 7] = 1.0  # one positive score; the rest ties at 0
    rows = rows_from_scores(scores, torch.tensor([10, 10, 4]), 4)
    assert rows[0].tolist() == [0, 1, 2, 3]
    assert rows[1].tolist() == [7, 0, 1, 2]
    assert rows[2].tolist() == [0, 1, 2, 3]  # a short row stays dense


def test_proxy_on_offset_keys_is_decided_by_ties_and_drops_the_newest():
    # Keys share a mean direction m with q . m = -20 (a key-independent offset, as real
    # post-RoPE q/k show), against a spread of about 1: relu(q . k) is 0 almost everywhere.
    gen = torch.Generator().manual_seed(0)
    H, Hkv, L, D = 2, 1, 256, 16
    m = torch.zeros(D)
    m[0] = 1.0
    key = (20.0 * m + 0.05 * torch.randn(Hkv, L, D, generator=gen))
    query = -1.0 * m.expand(H, L, D).clone() + 0.05 * torch.randn(H, L, D, generator=gen)
    layer = LayerInputs.build(0, query, key, torch.randn(Hkv, L, D, generator=gen), D**-0.5)
    q, k = query, key
    zero_share = float((torch.relu(torch.einsum("htd,hld->htl", q, k.expand(H, L, D))) == 0).float().mean())
    assert zero_share > 0.99
    W = 32
    rows, _ = proxy_rows_and_scores(layer, W, SelectorSettings(fp8=False))
    last = rows[-1].tolist()  # the newest row: length L
    assert sorted(last) == list(range(W)), "ties keep the oldest positions"
    assert L - 1 not in last, "the current token itself is dropped"


# ---------------------------------------------------------------------------
# The training loss's fast form, and the retrieval-shaped training windows.

from hypothesis import given, settings as hsettings, strategies as st  # noqa: E402

from benchmark.indexer.copy_segments import SEGMENT_RANGE, FIRST_FREE, segments_for, write_copy_segments  # noqa: E402
from benchmark.indexer.distill import _TrainingTarget, index_logits, kl_to_target  # noqa: E402
from benchmark.indexer.capture import LayerSample  # noqa: E402
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections  # noqa: E402


def _random_sample(L: int, R: int, seed: int):
    """A random indexer module and a sample of ``L`` keys with up to ``R`` query rows whose
    attention target has zeros inside the causal span (every row keeps mass on its own key)."""
    g = torch.Generator().manual_seed(seed)
    shape = IndexerProjectionShape(heads=2, head_dim=8, rope_dim=4, hidden_size=16, q_input_size=16)
    torch.manual_seed(seed)
    module = IndexerProjections(shape)
    rows = torch.randint(0, L, (R,), generator=g).unique()
    target = torch.rand(rows.numel(), L, generator=g) * (torch.arange(L)[None] <= rows[:, None])
    target[target < 0.3] = 0.0  # zeros inside the causal span too
    target[torch.arange(rows.numel()), rows] += 0.1  # every row keeps some mass
    target = target / target.sum(dim=1, keepdim=True)
    return module, LayerSample(hidden=torch.randn(L, 16, generator=g) * 3, rows=rows, target=target)


@hsettings(max_examples=25, deadline=None)
@given(L=st.integers(2, 80), R=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_training_loss_equals_the_kl_and_its_gradient(L, R, seed):
    module, sample = _random_sample(L, R, seed)
    target = sample.target
    reference = kl_to_target(index_logits(module, sample), target)
    (ref_grad,) = torch.autograd.grad(reference, module.wk.weight)
    fast = _TrainingTarget(sample).loss(module)
    (fast_grad,) = torch.autograd.grad(fast, module.wk.weight)
    assert torch.isfinite(fast)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_copy_segments_by_hand():
    assert [segments_for(n, 4) for n in (2048, 4096, 8192, 300)] == [4, 8, 16, 1]
    assert segments_for(2048, 0) == 0
    base = TextWindow("t", 5, tuple(range(1000, 3048)))
    out, rows = write_copy_segments(base, [1, 2, 3], 4, seed=7)
    assert (out.novel, out.token_start, len(out.token_ids)) == ("t+copies", 5, 2048)
    ids = out.token_ids
    changed = [i for i in range(2048) if ids[i] != base.token_ids[i]]
    assert set(ids[i] for i in changed) <= {1, 2, 3} and min(changed) >= FIRST_FREE
    # Each row r predicts token r + 1 from a second copy; the same two tokens sit earlier, at the first copy.
    assert rows == sorted(set(rows)) and len(rows) > 0
    for r in rows:
        pair = ids[r:r + 2]
        assert all(t in (1, 2, 3) for t in pair)
        assert any(ids[j:j + 2] == pair for j in range(FIRST_FREE, r - SEGMENT_RANGE[0] + 1))
    assert write_copy_segments(base, [1, 2, 3], 4, seed=7) == (out, rows)  # seeded
    assert write_copy_segments(base, [1, 2, 3], 0, seed=7) == (TextWindow("t+copies", 5, base.token_ids), [])


@hsettings(max_examples=40, deadline=None)
@given(T=st.integers(FIRST_FREE + 4 * SEGMENT_RANGE[1], 3000), per=st.integers(1, 12), seed=st.integers(0, 10**6))
def test_copy_segments_write_two_copies_of_each_segment_without_overlap(T, per, seed):
    base = TextWindow("t", 0, tuple([-1] * T))  # every written token is a vocabulary id >= 0
    out, rows = write_copy_segments(base, range(50), per, seed)
    ids = out.token_ids
    assert len(ids) == T and all(t == -1 for t in ids[:FIRST_FREE])
    # One run of S - 1 consecutive rows per second copy (a row past each run's end is never
    # included, so runs of adjacent copies stay apart).
    runs = []
    for r in rows:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    assert 1 <= len(runs) <= segments_for(T, per)
    written = 0
    for run in runs:
        second, S = run[0], len(run) + 1
        assert SEGMENT_RANGE[0] <= S <= SEGMENT_RANGE[1]
        segment = ids[second:second + S]
        assert all(t >= 0 for t in segment)
        firsts = [f for f in range(FIRST_FREE, second - S + 1) if ids[f:f + S] == segment]
        assert firsts, f"no earlier copy of the segment at {second}"
        written += 2 * S
    assert written == sum(t != -1 for t in ids), "every written token belongs to one copy of a segment"


def test_an_observing_selector_leaves_the_forward_dense(captured):
    """The training capture's selector returns no rows: the forward is the model's own, bit for bit."""
    from benchmark.quality.index_rows import dense_rows
    from benchmark.quality.metrics import LayerMetrics

    lm, layers = captured[0], captured[1]
    ids = torch.tensor([_window(5).token_ids])
    with torch.no_grad():
        plain = lm.model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        seen = []
        observe = sparse_attention.SparsePlan(lambda layer, width, stats: seen.append(layer.layer_idx), T,
                                              frozenset(layers), check_rows=False)
        observed = lm.model.base_model(input_ids=ids, use_cache=False,
                                       **{sparse_attention.PLAN_KWARG: observe}).last_hidden_state
        masked = sparse_attention.SparsePlan(lambda layer, width, stats: dense_rows(layer.lengths, width), T,
                                             frozenset(layers))
        all_rows = lm.model.base_model(input_ids=ids, use_cache=False,
                                       **{sparse_attention.PLAN_KWARG: masked}).last_hidden_state
    assert seen == layers
    assert torch.equal(observed, plain)
    torch.testing.assert_close(all_rows, plain, rtol=1e-5, atol=1e-5)  # the masked path: dense up to rounding
    with_metrics = sparse_attention.SparsePlan(lambda layer, width, stats: None, T, frozenset(layers),
                                               metrics=LayerMetrics())
    with pytest.raises(ValueError, match="returned no rows at layer 0"):
        with torch.no_grad():
            lm.model.base_model(input_ids=ids, use_cache=False, **{sparse_attention.PLAN_KWARG: with_metrics})


def test_training_windows_and_evaluation_sets_of_the_command(captured):
    """train_cli's window plan (copy segments in every second window) and its evaluation sets, on the tiny model."""
    import argparse
    import random

    from benchmark.indexer import train_cli
    from benchmark.quality.probe import ProbeSettings, make_probe_window

    lm, layers = captured[0], captured[1]
    rng = random.Random(3)
    texts = {n: "".join(chr(97 + rng.randrange(26)) for _ in range(4000)) for n in ("emma", "prideprejudice")}

    class Corpus:
        pass

    corpus = Corpus()
    corpus.texts = texts
    tiny = type(lm)(model=lm.model, tokenizer=lambda text: {"input_ids": [ord(c) % 97 for c in text]},
                    gguf_path=None, gguf_sha256="", full_attention_layers=lm.full_attention_layers)
    args = argparse.Namespace(novel="emma", eval_novel="prideprejudice", train_contexts=[512, 640],
                              train_windows=[2, 1], copy_segments=4, rows=32, seed=0, eval_contexts=[512],
                              eval_windows=2)
    tokens = tiny.tokenizer(texts["emma"])["input_ids"]
    plan = train_cli._training_windows(tokens, args)
    assert [len(w.token_ids) for w, _ in plan] == [512, 512, 640]
    assert [w.novel for w, _ in plan] == ["emma", "emma+copies", "emma"]
    assert plan[0][1] == [] and plan[2][1] == [] and 0 < len(plan[1][1]) <= args.rows // 4
    rows = train_cli._rows(512, args.rows, 16, 0, plan[1][1])
    assert rows.tolist() == sorted(set(rows.tolist())) and set(plan[1][1]) <= set(rows.tolist())

    projections = {x: train_layer(IndexerProjectionShape(heads=1, head_dim=16, rope_dim=8, hidden_size=64,
                                                         q_input_size=64), [s[x] for s in captured[2]],
                                  DistillSettings(steps=20, lr=1e-2), seed=x)[0] for x in layers}
    ev = train_cli.evaluate(args, tiny, corpus, layers, projections, progress=False)
    assert list(ev) == ["emma (held out) 512", "prideprejudice 512", "prideprejudice copy probe 512"]
    copy = ev["prideprejudice copy probe 512"]
    other = train_cli._windows(tiny.tokenizer(texts["prideprejudice"])["input_ids"], "prideprejudice", [512], [2], 3)
    probe = make_probe_window(other[0], sorted(set(tiny.tokenizer(texts["prideprejudice"])["input_ids"])),
                              ProbeSettings())
    assert copy["windows"] == [probe.window.describe()]
    for name, s in ev.items():
        for x in layers:
            r = s["layers"][x]
            assert set(r) == {"oracle", "trained", "trained, newest ties", "proxy", "proxy-pca", "locality",
                              "reuse below", "tie-decided slots"}
            for method, by_budget in r.items():
                for b, v in by_budget.items():
                    bound = 1.0 if method == "tie-decided slots" else r["oracle"][b]  # a share of W, not a recall
                    assert 0.0 <= v <= bound + 1e-9, (name, x, method, b)
        first = s["layers"][layers[0]]
        assert first["reuse below"] == first["trained"], "the first layer scans: its own rows"
    summary = train_cli.summarize(ev)
    text = train_cli.markdown(ev, summary)
    assert "prideprejudice copy probe 512" in text and "topology_kv_calibrate.py --scan K" in text
    assert "`trained, newest ties` (the same scores, ties to the newest position) below a null model" in text
    assert "newest_ties_layers_below_locality" in summary["emma (held out) 512"]
    share = summary["emma (held out) 512"]["share"]
    assert layers[0] not in share["ranked"] and sorted(share["ranked"]) == sorted(layers[1:])
    assert share["cost_1_16"][str(layers[0])] == 0


def test_the_share_costs_rank_the_layers_by_recall_lost_reusing_the_layer_below():
    from benchmark.indexer.train_cli import share_costs

    got = share_costs({0: 0.0, 1: 0.01, 2: 0.20, 3: 0.05, 4: -0.01, 5: 0.30, 6: 0.02, 7: 0.10, 8: 0.10})
    assert got["ranked"] == [5, 2, 7, 8, 3, 6, 1, 4]
    assert got["cost_1_16"]["4"] == -0.01 and set(got) == {"cost_1_16", "ranked"}


def test_the_shipped_checkpoints_are_one_per_model_and_shape_preset():
    from benchmark.indexer.checkpoints import SHAPE_PRESETS, find_shipped_checkpoint, shipped_checkpoints

    found = shipped_checkpoints()
    keys = [(info.model_sha256, info.extra.get("shape_preset")) for _, info in found]
    assert len(found) >= 3 and len(set(keys)) == len(keys)
    for path, info in found:
        preset = info.extra.get("shape_preset")
        assert preset in SHAPE_PRESETS and path.name.endswith(f".{preset}.safetensors"), path.name
        assert find_shipped_checkpoint(info.model_sha256, preset) == path


# ---------------------------------------------------------------------------
# The evaluation's tie diagnostics: the same scores with ties to the newest position, and the
# share of a row the tie rule decides.


def test_newest_ties_and_the_tie_decided_share_by_hand():
    from benchmark.indexer.capture import LayerSample
    from benchmark.indexer.evaluate import newest_ties, recall_at, tie_decided_share

    scores = torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0, 1.0],   # 2 keys above a 4-way tie at 0
                           [3.0, 2.0, 1.0, 0.5, 0.0, 0.0],   # no tie inside W = 3
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # causal length 2 <= W: every key kept
    lengths = torch.tensor([6, 6, 2])
    # W = 3: row 0 keeps 2 and 5 by score, its last slot by the tie rule (1 of 3 slots)
    share = tie_decided_share(scores, lengths, 3)
    assert share.tolist() == [1 / 3, 0.0, 0.0]
    # W = 5: row 1's 5th score (0.0) is shared by keys 4 and 5: one slot decided by position
    assert tie_decided_share(scores, lengths, 5).tolist() == [3 / 5, 1 / 5, 0.0]
    target = torch.tensor([[0.1, 0.0, 0.3, 0.0, 0.4, 0.2],
                           [0.0, 0.0, 0.0, 0.0, 0.5, 0.5],
                           [0.6, 0.4, 0.0, 0.0, 0.0, 0.0]])
    sample = LayerSample(hidden=torch.zeros(6, 1), rows=lengths - 1, target=target)
    ranked = newest_ties(lambda s: scores)(sample)
    assert ranked[0].tolist() == [0.0, 1.0, 5.0, 2.0, 3.0, 4.0]  # 2 > 5 > the ties, newest first
    # the engine keeps 2, 5 and the oldest tie (0): 0.3 + 0.2 + 0.1; newest ties keep 4: 0.3 + 0.2 + 0.4
    assert recall_at(scores, sample, 3).tolist() == pytest.approx([0.6, 0.0, 1.0])
    assert recall_at(ranked, sample, 3).tolist() == pytest.approx([0.9, 0.0, 1.0])
    assert recall_at(ranked, sample, 5).tolist() == pytest.approx([0.9, 0.5, 1.0])


@hsettings(max_examples=40, deadline=None)
@given(L=st.integers(1, 40), R=st.integers(1, 5), levels=st.integers(1, 4), W=st.integers(1, 45),
       seed=st.integers(0, 2**16))
def test_newest_ties_keeps_the_score_order_and_never_beats_it_by_score(L, R, levels, W, seed):
    """Over random tie-heavy scores: the ranks order distinct scores as the scores do, break
    equal ones newest first, and the rows they keep hold the same multiset of scores as the
    engine's rows (ties only swap keys of equal score); the tie-decided share is the share of
    W where the two rules may pick different keys."""
    from benchmark.indexer.capture import LayerSample
    from benchmark.indexer.evaluate import newest_ties, tie_decided_share

    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (R, L), generator=gen).to(torch.float32)  # few levels: many ties
    lengths = torch.randint(1, L + 1, (R,), generator=gen)
    sample = LayerSample(hidden=torch.zeros(L, 1), rows=lengths - 1, target=torch.zeros(R, L))
    ranked = newest_ties(lambda s: scores)(sample)
    for r in range(R):
        for i in range(L):
            for j in range(L):
                if scores[r, i] != scores[r, j]:
                    assert (ranked[r, i] > ranked[r, j]) == (scores[r, i] > scores[r, j])
                elif i != j:
                    assert (ranked[r, i] > ranked[r, j]) == (i > j)
    engine = rows_from_scores(scores, lengths, W)
    newest = rows_from_scores(ranked, lengths, W)
    share = tie_decided_share(scores, lengths, W)
    for r in range(R):
        a = sorted(float(scores[r, p]) for p in engine[r].tolist() if p >= 0)
        b = sorted(float(scores[r, p]) for p in newest[r].tolist() if p >= 0)
        assert a == b
        differ = len(set(engine[r].tolist()) - set(newest[r].tolist()))
        assert differ <= round(float(share[r]) * W)
        if int(lengths[r]) <= W:
            assert share[r] == 0.0


def test_retry_below_null_retrains_an_undertrained_layer_and_is_off_by_default(captured):
    """train_cli.train on the tiny model with 1 step per layer: every layer ends below the PCA
    proxy on the validation window; with --retry-below-null it gets a second attempt with
    NULL_RETRY_STEPS x the steps at NULL_RETRY_LR x the learning rate, and without the flag
    the run is the first attempt alone, the same one."""
    import random

    from benchmark.indexer import train_cli

    lm, layers = captured[0], captured[1]
    rng = random.Random(5)
    texts = {"emma": "".join(chr(97 + rng.randrange(26)) for _ in range(3000))}

    class Corpus:
        pass

    corpus = Corpus()
    corpus.texts = texts
    tiny = type(lm)(model=lm.model, tokenizer=lambda text: {"input_ids": [ord(c) % 97 for c in text]},
                    gguf_path=None, gguf_sha256="", full_attention_layers=lm.full_attention_layers)
    shape = IndexerProjectionShape(heads=1, head_dim=16, rope_dim=8, hidden_size=64, q_input_size=64)

    def run(flag):
        # Through the CLI's own parser, so every flag this test does not set takes its default.
        args = train_cli.parse_args(["--out", "unused.safetensors", "--train-contexts", "256", "--train-windows", "2",
                                     "--copy-segments", "0", "--rows", "32", "--steps", "1", "--lr", "1e-3",
                                     "--flag-margin", "0.99"] + (["--retry-below-null"] if flag else []))
        return train_cli.train(args, tiny, corpus, layers, {x: shape for x in layers}, progress=False)

    _, rec_on, _ = run(True)
    _, rec_off, _ = run(False)
    for x in layers:
        first, *rest = rec_on[x]["attempts"]
        assert first["reason"] is None and first["val_below"], (x, first)  # 1 step: under a null model
        assert len(rest) == 1 and rec_on[x]["flagged"]
        assert rest[0]["reason"] == "below a null model"
        assert rest[0]["steps"] == train_cli.NULL_RETRY_STEPS and rest[0]["lr"] == pytest.approx(1e-3 * train_cli.NULL_RETRY_LR)
        assert rec_on[x]["steps"] == 1 + train_cli.NULL_RETRY_STEPS
        assert len(rec_off[x]["attempts"]) == 1 and not rec_off[x]["flagged"]
        off = rec_off[x]["attempts"][0]
        for key in ("val_recall", "val_kl", "loss_first", "loss_last", "seed"):
            assert off[key] == first[key], (x, key)  # the flag adds an attempt, it does not change the first
        assert rec_off[x]["steps"] == 1


# ---------------------------------------------------------------------------
# Training through relu's dead region (DistillSettings.dead_slope): the score is DSA's,
# only the gradient below 0 differs.

import copy  # noqa: E402

from benchmark.indexer.distill import leaky_backward_relu  # noqa: E402


@hsettings(max_examples=40, deadline=None)
@given(n=st.integers(1, 64), slope=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_leaky_backward_relu_is_relu_forward_and_leaks_slope_backward(n, slope, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x = torch.where(x == 0, torch.ones_like(x), x).requires_grad_(True)  # relu's gradient at 0 is a convention
    y = leaky_backward_relu(x, slope)
    assert torch.equal(y, torch.relu(x.detach()))
    (grad,) = torch.autograd.grad(y.sum(), x)
    expected = torch.where(x.detach() > 0, torch.ones_like(grad), torch.full_like(grad, slope))
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-7)


def test_a_dead_row_learns_only_with_the_leak():
    # Every dot product negative (the key LayerNorm's bias points away from the query):
    # every score is relu's 0, so the KL is log(L) - H(p) whatever the target, and plain
    # relu passes no gradient at all; the leak passes one and lowers the loss.
    L, C = 24, 16
    g = torch.Generator().manual_seed(0)
    shape = IndexerProjectionShape(heads=1, head_dim=8, rope_dim=0, hidden_size=C, q_input_size=C)
    torch.manual_seed(0)
    module = IndexerProjections(shape)
    hidden = torch.randn(L, C, generator=g)
    with torch.no_grad():
        module.wq_b.weight.zero_()
        module.wq_b.weight[0, 0] = 1.0  # q = (x_0, 0, ...)
        module.k_norm.bias.zero_()
        module.k_norm.bias[0] = -1.0  # k_0 ~ -1: q . k ~ -3 on the row below
        module.k_norm.weight.fill_(0.01)
    rows = torch.tensor([L - 1])
    hidden[L - 1, 0] = 3.0  # the row's q_0 > 0: every dot product is negative
    target = torch.zeros(1, L)
    target[0, L - 1] = 1.0  # the dense attention puts its mass on the current token
    sample = LayerSample(hidden=hidden, rows=rows, target=target)
    raw = _TrainingTarget(sample)
    assert float(index_logits(module, sample)[0].detach().max()) == 0.0  # the row is all ties
    plain = raw.loss(module, 0.0)
    leaky = raw.loss(module, 0.1)
    assert float(plain.detach()) == pytest.approx(torch.log(torch.tensor(float(L))).item(), rel=1e-5)
    assert float(leaky.detach()) == float(plain.detach())  # the same value: the forward is DSA's
    plain_grads = torch.autograd.grad(plain, list(module.parameters()), allow_unused=True)
    assert all(g is None or float(g.abs().max()) == 0.0 for g in plain_grads)
    trajectories = {}
    for slope in (0.0, 0.1):
        m = copy.deepcopy(module)
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        losses = []
        for _ in range(60):
            opt.zero_grad()
            loss = raw.loss(m, slope)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        trajectories[slope] = losses
    assert trajectories[0.0][-1] == trajectories[0.0][0], "plain relu: a dead row never moves"
    assert trajectories[0.1][-1] < 0.5 * trajectories[0.1][0], trajectories[0.1]


# ---------------------------------------------------------------------------
# --layer-shape: some layers with another shape of the same cost per key.


def test_layer_shape_flag_parsing_and_refusals(capsys):
    from benchmark.indexer import train_cli

    assert train_cli.parse_layer_shapes(["0,19=4x16:16", " 3 = 2x32 "]) == [((0, 19), "4x16", 16), ((3,), "2x32", None)]
    for bad, said in (("0=4x16:", "expected LAYERS=HxD[:ROPE]"), ("=4x16", "expected LAYERS=HxD[:ROPE]"),
                      ("0=dsa-ratio", "expected LAYERS=HxD[:ROPE]"), ("0=0x16", "--shape: expected"),
                      ("a=4x16", "expected LAYERS=HxD[:ROPE]")):
        with pytest.raises(ValueError, match=r"--(layer-)?shape"):
            train_cli.parse_layer_shapes([bad])
        with pytest.raises(ValueError) as err:
            train_cli.parse_layer_shapes([bad])
        assert said in str(err.value), (bad, str(err.value))
    with pytest.raises(ValueError, match=r"layers \[0\] are given a shape more than once"):
        train_cli.parse_layer_shapes(["0,1=4x16", "0=2x32"])
    with pytest.raises(ValueError, match=r"layers \[1\] are given a shape more than once"):
        train_cli.parse_layer_shapes(["1,1=4x16"])
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--out", "x.safetensors", "--layer-shape", "0=4x16:x"])
    assert "--layer-shape: expected LAYERS=HxD[:ROPE]" in capsys.readouterr().err
    for flag in (["--shape", "1x64"], ["--rope-dim", "16"], ["--layer-shape", "0=4x16"]):
        with pytest.raises(SystemExit):
            train_cli.parse_args(["--evaluate", __file__] + flag)
        assert f"{flag[0]}: applies to training, not to --evaluate" in capsys.readouterr().err
    assert train_cli.parse_args(["--out", "x.safetensors"]).shape == "dsa-ratio"
    assert train_cli.parse_layer_steps(["0,19=1200", "3 = 7"]) == [((0, 19), 1200), ((3,), 7)]
    for bad in ("0=0", "0=", "0=1e3", "=5"):
        with pytest.raises(ValueError, match="--layer-steps: expected LAYERS=N with N >= 1"):
            train_cli.parse_layer_steps([bad])
    with pytest.raises(ValueError, match=r"--layer-steps: layers \[2\] are given steps more than once"):
        train_cli.parse_layer_steps(["1,2=4", "2=5"])
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--evaluate", __file__, "--layer-steps", "0=5"])
    assert "--layer-steps: applies to training, not to --evaluate" in capsys.readouterr().err

    base = IndexerProjectionShape(heads=1, head_dim=64, rope_dim=32, hidden_size=576, q_input_size=576)
    kw = dict(heads=9, head_dim=64, rope_theta=10000.0)
    shapes = train_cli.resolve_layer_shapes(base, [((0, 2), "4x16", 16)], [0, 1, 2], **kw)
    assert shapes[1] is base and shapes[0] == shapes[2] == IndexerProjectionShape(
        heads=4, head_dim=16, rope_dim=16, hidden_size=576, q_input_size=576)
    assert train_cli.resolve_layer_shapes(base, [((1,), "2x32", None)], [0, 1], **kw)[1].rope_dim == 16  # half
    with pytest.raises(ValueError, match=r"--layer-shape: layers \[5\] are not trained in this run \(\[0, 1\]\)"):
        train_cli.resolve_layer_shapes(base, [((5,), "4x16", None)], [0, 1], **kw)
    with pytest.raises(ValueError, match=r"4x32 costs 128 multiply-adds per key, expected the --shape's 64 \(1x64\)"):
        train_cli.resolve_layer_shapes(base, [((0,), "4x32", None)], [0, 1], **kw)
    with pytest.raises(ValueError, match="--layer-shape 4x16:18: rope_dim"):
        train_cli.resolve_layer_shapes(base, [((0,), "4x16", 18)], [0, 1], **kw)


def test_training_with_a_layer_shape_writes_each_layer_at_its_shape(captured, tmp_path):
    """train_cli.train with layer 1 at 4 heads x 4 dims (the 1 x 16 base's cost): each module has
    its layer's shape and the checkpoint round-trips it (format /2)."""
    import random

    from benchmark.indexer import train_cli
    from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import (
        IndexerCheckpointInfo,
        load_indexer_checkpoint,
        save_indexer_checkpoint,
    )

    lm, layers = captured[0], captured[1]
    rng = random.Random(7)

    class Corpus:
        texts = {"emma": "".join(chr(97 + rng.randrange(26)) for _ in range(3000))}

    tiny = type(lm)(model=lm.model, tokenizer=lambda text: {"input_ids": [ord(c) % 97 for c in text]},
                    gguf_path=None, gguf_sha256="", full_attention_layers=lm.full_attention_layers)
    args = train_cli.parse_args(["--out", "unused.safetensors", "--train-contexts", "256", "--train-windows", "2",
                                 "--copy-segments", "0", "--rows", "32", "--steps", "3", "--layer-shape", "1=4x4:4",
                                 "--layer-steps", "1=5", "--flag-margin", "0.99"])
    base = IndexerProjectionShape(heads=1, head_dim=16, rope_dim=8, hidden_size=64, q_input_size=64)
    shapes = train_cli.resolve_layer_shapes(base, args.layer_shape, layers, heads=4, head_dim=16, rope_theta=10000.0)
    projections, record, _ = train_cli.train(args, tiny, Corpus(), layers, shapes, progress=False)
    assert projections[0].shape == base and projections[1].shape == shapes[1] != base
    assert record[0]["steps"] == 3 and record[1]["steps"] == 5  # --layer-steps
    assert projections[1].wq_b.weight.shape == (16, 64) and projections[1].wk.weight.shape == (4, 64)
    info = IndexerCheckpointInfo(model_sha256="c" * 64, text_sha256="d" * 64, shape=base, layers=tuple(layers),
                                 steps={x: record[x]["steps"] for x in layers}, command="t",
                                 layer_shapes={1: shapes[1]})
    save_indexer_checkpoint(tmp_path / "ix.safetensors", projections, info)
    loaded, back = load_indexer_checkpoint(tmp_path / "ix.safetensors", model_sha256="c" * 64)
    assert back.shape_of(1) == shapes[1] and loaded[1].shape == shapes[1] and loaded[0].shape == base


# DSA's sparse stage (DistillSettings.sparse_steps): KL over the indexer's own selected keys.
from fractions import Fraction  # noqa: E402

from benchmark.indexer.distill import selected_keys  # noqa: E402


def test_selected_keys_by_hand():
    # Row 0: length 5, budget 1/2 -> floor(2.5) = 2 keys: scores 3 (pos 1) and the tie 2/2
    # at positions 2 and 4 -> the lower position (2). Row 1: length 1 -> max(1, 0) = 1 key.
    floor = -1e30
    scores = torch.tensor([[1.0, 3.0, 2.0, 0.0, 2.0, floor],
                           [5.0, floor, floor, floor, floor, floor]])
    got = selected_keys(scores, torch.tensor([5, 1]), Fraction(1, 2))
    assert got.tolist() == [[False, True, True, False, False, False],
                            [True, False, False, False, False, False]]


@hsettings(max_examples=25, deadline=None)
@given(L=st.integers(2, 60), R=st.integers(1, 10), num=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_sparse_loss_is_the_kl_over_the_selected_keys(L, R, num, seed):
    module, sample = _random_sample(L, R, seed)
    rows, target = sample.rows, sample.target
    budget = Fraction(num, 8)
    fast = _TrainingTarget(sample).sparse_loss(module, budget)
    # Plain reference, row by row: sort the causal scores (ties to the lower position), keep
    # max(1, floor(len * budget)), renormalise the attention there, KL to their softmax.
    logits = index_logits(module, sample).detach()
    total = 0.0
    for r in range(rows.numel()):
        n = int(rows[r]) + 1
        keep = max(1, (n * num) // 8)
        order = sorted(range(n), key=lambda s: (-float(logits[r, s]), s))[:keep]
        idx = torch.tensor(sorted(order))
        if float(target[r, idx].sum()) == 0:
            continue  # no attention on the selected keys: nothing to match, the row adds 0
        p = target[r, idx] / target[r, idx].sum()
        logq = torch.log_softmax(logits[r, idx].double(), 0)
        total += float(torch.xlogy(p.double(), p.double()).sum() - (p.double() * logq).sum())
    assert torch.isfinite(fast)
    assert abs(float(fast.detach()) - total / rows.numel()) < 1e-4 * max(1.0, abs(total / rows.numel()))


def test_the_sparse_stage_runs_after_the_dense_steps_and_lowers_its_loss(captured):
    lm, layers, train, held = captured
    shape = IndexerProjectionShape(heads=2, head_dim=16, rope_dim=8, hidden_size=64, q_input_size=64)
    samples = [s[layers[0]] for s in train]
    dense_only, dense_losses = train_layer(shape, samples, DistillSettings(steps=40, lr=1e-2, batch_windows=3), seed=1)
    settings = DistillSettings(steps=40, lr=1e-2, batch_windows=3, sparse_steps=60, sparse_budget=Fraction(1, 8),
                               sparse_lr=3e-3)
    both, losses = train_layer(shape, samples, settings, seed=1)
    assert len(losses) == 100 and losses[:40] == dense_losses  # the dense steps are the same, then the stage
    targets = [_TrainingTarget(s) for s in samples]
    with torch.no_grad():
        before = sum(float(t.sparse_loss(dense_only, Fraction(1, 8))) for t in targets)
        after = sum(float(t.sparse_loss(both, Fraction(1, 8))) for t in targets)
    assert after < 0.9 * before, (before, after)
    with pytest.raises(ValueError, match="sparse_budget"):
        DistillSettings(sparse_steps=1, sparse_budget=Fraction(0))
    with pytest.raises(ValueError, match="sparse_steps"):
        DistillSettings(sparse_steps=-1)


def test_sparse_stage_flags(capsys):
    from benchmark.indexer import train_cli

    args = train_cli.parse_args(["--out", "x.safetensors", "--sparse-steps", "300", "--sparse-budget", "1/4"])
    assert args.sparse_steps == 300 and args.sparse_budget == Fraction(1, 4) and args.sparse_lr == 3e-4
    assert train_cli.parse_args(["--out", "x.safetensors"]).sparse_steps == 0
    for flags, said in ((["--sparse-budget", "0"], "--sparse-budget: expected a budget > 0"),
                        (["--sparse-budget", "3/2"], "--sparse-budget: budget '3/2' exceeds the context"),
                        (["--sparse-budget", "x"], "got 'x'"),
                        (["--sparse-steps", "-1"], "--sparse-steps: expected >= 0"),
                        (["--sparse-lr", "0"], "--sparse-lr: expected > 0")):
        with pytest.raises(SystemExit):
            train_cli.parse_args(["--out", "x.safetensors"] + flags)
        assert said in capsys.readouterr().err, flags
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--evaluate", __file__, "--sparse-steps", "10"])
    assert "--sparse-steps: applies to training, not to --evaluate" in capsys.readouterr().err
