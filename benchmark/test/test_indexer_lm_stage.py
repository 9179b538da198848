"""The indexer's model-loss stage (benchmark/indexer/lm_stage.py): the soft top-W by hand and
against the hard selection it relaxes, the plan inside a model's forward, and training on a
tiny random model (the KL to the dense model falls; the model is left as it was).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

from benchmark.indexer.lm_stage import (
    OBJECTIVES,
    LMStageSettings,
    SoftSelectionPlan,
    _soft_attention,
    _layer_input,
    first_and_last,
    layers_skipped,
    sample_positions,
    soft_selection_bias,
    step_objective,
    train_lm_stage,
)
from benchmark.quality import sparse_attention
from benchmark.quality.model import LoadedModel, decoder_layers, full_attention_layers
from benchmark.quality.sparse_attention import PLAN_KWARG
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections, IndexerProjectionShape
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import weighted_relu_logits

T = 96
SHAPE = IndexerProjectionShape(heads=2, head_dim=16, rope_dim=8, hidden_size=64, q_input_size=64)


def test_soft_selection_bias_by_hand():
    scores = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0], [1.0, 4.0, 2.0, 0.0]])
    lengths = torch.tensor([4, 1, 3])
    bias = soft_selection_bias(scores, lengths, width=2, tau=1.0)
    # Row 0: 4 > W = 2 keys; theta = (2 + 1) / 2, std of 0, 1, 2, 3 = sqrt(1.25).
    want = torch.nn.functional.logsigmoid((scores[0] - 1.5) / math.sqrt(1.25))
    torch.testing.assert_close(bias[0], want)
    # Row 1: one causal key <= W: dense; past the length -inf.
    assert bias[1, 0] == 0 and torch.isinf(bias[1, 1:]).all() and (bias[1, 1:] < 0).all()
    # Row 2: 3 keys, theta = (2 + 1) / 2, std of 1, 4, 2 = sqrt(14/9); key 3 is in the future.
    want2 = torch.nn.functional.logsigmoid((scores[2, :3] - 1.5) / math.sqrt(14 / 9))
    torch.testing.assert_close(bias[2, :3], want2)
    assert bias[2, 3] == float("-inf")


@settings(max_examples=40, deadline=None)
@given(T_=st.integers(1, 24), extra=st.integers(0, 8), W=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_soft_selection_bias_keeps_order_and_tends_to_the_hard_top_w(T_, extra, W, seed):
    L = T_ + extra
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(T_, L, generator=gen)  # continuous: no ties
    lengths = torch.arange(extra + 1, L + 1)
    bias = soft_selection_bias(scores, lengths, W, tau=1e-4)
    causal = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)
    assert torch.isneginf(bias[~causal]).all()
    for t in range(T_):
        n = int(lengths[t])
        b, s = bias[t, :n], scores[t, :n]
        if n <= W:
            assert (b == 0).all()
            continue
        hard = torch.zeros(n, dtype=torch.bool)
        hard[s.topk(W).indices] = True
        assert torch.equal(b > -math.log(2), hard), (t, n, W)
        order = torch.argsort(s)
        assert (b[order].diff() >= 0).all()  # a higher score never gets a lower bias


def test_soft_selection_bias_argument_errors():
    with pytest.raises(ValueError, match="lengths: expected shape"):
        soft_selection_bias(torch.zeros(3, 4), torch.tensor([1, 2]), 1, 0.1)
    with pytest.raises(ValueError, match="width: expected >= 1"):
        soft_selection_bias(torch.zeros(2, 4), torch.tensor([1, 2]), 0, 0.1)


@settings(max_examples=15, deadline=None)
@given(L=st.integers(8, 40), W=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_soft_attention_at_a_small_temperature_is_the_hard_top_w_attention(L, W, seed):
    """Against a row-by-row gather of each row's top-W keys (the sparse kernel's maths)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    module = IndexerProjections(SHAPE).eval()
    H, Hkv, D = 4, 2, 8
    q = torch.randn(H, L, D, generator=gen)
    k = torch.randn(Hkv, L, D, generator=gen)
    v = torch.randn(Hkv, L, D, generator=gen)
    hidden = torch.randn(L, 64, generator=gen)
    with torch.no_grad():
        out = _soft_attention(q, k, v, hidden, None, 0.5, None, module, W, 1e-5)  # [L, H, D]
        pos = torch.arange(L)
        scores = weighted_relu_logits(module.queries(hidden, pos), module.weights(hidden), module.keys(hidden, pos))
    checked = 0
    for t in range(L):
        s = scores[t, : t + 1]
        if t + 1 > W:
            top = torch.sort(s, descending=True).values
            if top[W - 1] - top[W] < 1e-3 * float(s.std()) + 1e-6:
                continue  # a tie at the boundary: the soft mask splits it, the hard one cannot
            keys = s.topk(W).indices
        else:
            keys = torch.arange(t + 1)
        for h in range(H):
            p = torch.softmax(k[h // 2, keys] @ q[h, t] * 0.5, dim=0)
            torch.testing.assert_close(out[t, h], p @ v[h // 2, keys], atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= L // 2


def _tiny_loaded(cfg, sharpen) -> LoadedModel:
    """A random model of ``cfg`` on the harness's attention; ``sharpen(self_attn)`` scales
    each layer's logits up (sharp attention, so the selection matters)."""
    from transformers import AutoModelForCausalLM

    sparse_attention.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=sparse_attention.ATTENTION_NAME).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            sharpen(layer.self_attn)
    sparse_attention.install_hidden_capture(model)
    return LoadedModel(model=model, tokenizer=None, gguf_path=None, gguf_sha256="",
                       full_attention_layers=full_attention_layers(model.config))


def _tiny_model() -> LoadedModel:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return _tiny_loaded(cfg, lambda attn: (attn.q_proj.weight.mul_(8.0), attn.k_proj.weight.mul_(8.0)))


def _tiny_gemma() -> LoadedModel:
    """Gemma 3's layout: sliding-window layers (their own RoPE base and a window shorter than
    ``T``) below and between the full-attention layers, scaled embeddings, q/k norms."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                           max_position_embeddings=512, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    # q and k are normed after the projection: scale the norms' gains (1 + weight) instead.
    return _tiny_loaded(cfg, lambda attn: (attn.q_norm.weight.fill_(3.0), attn.k_norm.weight.fill_(3.0)))


def _ids(seed: int):
    return torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def _projections(lm, seed=0):
    torch.manual_seed(seed)
    return {layer: IndexerProjections(SHAPE).eval() for layer in lm.full_attention_layers}


def _kl_to_dense(lm, projections, ids, width, tau=1e-4):
    x = torch.tensor([ids])
    with torch.no_grad():
        dense = torch.log_softmax(lm.model(input_ids=x, use_cache=False).logits[0], -1)
        plan = SoftSelectionPlan(projections, width, tau, frozenset(lm.full_attention_layers))
        sparse = torch.log_softmax(lm.model(input_ids=x, use_cache=False, **{PLAN_KWARG: plan}).logits[0], -1)
    rows = slice(width, T)
    return float((dense[rows].exp() * (dense[rows] - sparse[rows])).sum(-1).mean())


HELD_OUT = tuple(_ids(99 + k) for k in range(3))
TRAINING = tuple(_ids(i) for i in range(8))  # fewer windows overfit: the held-out KL then rises at some thread counts


def _held_out_kl(lm, projections):
    """Mean KL to dense at W = T/8 (near-hard selection) over three windows never trained on."""
    return sum(_kl_to_dense(lm, projections, ids, T // 8) for ids in HELD_OUT) / len(HELD_OUT)


def test_the_plan_with_no_long_row_is_the_dense_forward():
    lm = _tiny_model()
    projections = _projections(lm)
    x = torch.tensor([_ids(1)])
    with torch.no_grad():
        dense = lm.model(input_ids=x, use_cache=False).logits
        plan = SoftSelectionPlan(projections, T, 0.1, frozenset(lm.full_attention_layers))
        soft = lm.model(input_ids=x, use_cache=False, **{PLAN_KWARG: plan}).logits
    torch.testing.assert_close(soft, dense, atol=1e-4, rtol=1e-4)
    assert plan.layer_hidden == {}  # every layer took its input
    # With a budget below T the forward differs: the plan is really in the attention.
    with torch.no_grad():
        plan = SoftSelectionPlan(projections, 8, 1e-3, frozenset(lm.full_attention_layers))
        sparse = lm.model(input_ids=x, use_cache=False, **{PLAN_KWARG: plan}).logits
    assert (sparse - dense).abs().max() > 1e-2


@pytest.mark.parametrize("make, trained", [(_tiny_model, (1,)), (_tiny_gemma, (1, 3)), (_tiny_gemma, (3,))])
def test_a_forward_from_a_layers_input_with_the_layers_below_skipped_is_the_full_forward(make, trained):
    lm = make()
    base = lm.model.base_model
    n = len(decoder_layers(lm.model))
    first = min(trained)  # the layers below it run dense: the stage starts at its input
    projections = {layer: module for layer, module in _projections(lm).items() if layer in trained}
    x = torch.tensor([_ids(2)])
    with torch.no_grad():
        plan = SoftSelectionPlan(projections, 8, 0.1, frozenset(projections))
        full = base(input_ids=x, use_cache=False, **{PLAN_KWARG: plan}).last_hidden_state
        prefix, dense = _layer_input(lm.model, first, lambda: base(input_ids=x, use_cache=False))
        assert dense.last_hidden_state.shape == full.shape
        assert (dense.last_hidden_state - full).abs().max() > 1e-3  # the plan changes the output
        layers = list(decoder_layers(lm.model))
        with layers_skipped(lm.model, first):
            assert all(decoder_layers(lm.model)[i] is not layers[i] for i in range(first))
            assert all(decoder_layers(lm.model)[i] is layers[i] for i in range(first, n))
            plan = SoftSelectionPlan(projections, 8, 0.1, frozenset(projections))
            skipped = base(inputs_embeds=prefix, use_cache=False, **{PLAN_KWARG: plan}).last_hidden_state
        assert list(decoder_layers(lm.model)) == layers
        with pytest.raises(RuntimeError, match="boom"), layers_skipped(lm.model, n):
            raise RuntimeError("boom")
        assert list(decoder_layers(lm.model)) == layers  # restored on an error too
    torch.testing.assert_close(skipped, full, atol=0, rtol=0)
    with pytest.raises(ValueError, match=rf"count: expected 0 .. {n}, got {n + 1}"):
        with layers_skipped(lm.model, n + 1):
            pass


@pytest.mark.parametrize("make, trained_layers", [(_tiny_model, (0, 1)), (_tiny_model, (1,)),
                                                  (_tiny_gemma, (1, 3)), (_tiny_gemma, (3,))])
def test_the_stage_loss_is_the_kl_to_the_dense_model(make, trained_layers):
    """The first step's loss (before any update) by hand: full forwards with and without the
    plan, the KL at the stage's sampled positions; layers below the lowest trained one skipped."""
    lm = make()
    projections = {x: m for x, m in _projections(lm).items() if x in trained_layers}
    ids = _ids(5)
    stage = LMStageSettings(steps=1, lr=1e-2, budgets=(Fraction(1, 8),), positions=16)
    x = torch.tensor([ids])
    with torch.no_grad():
        dense = torch.log_softmax(lm.model(input_ids=x, use_cache=False).logits[0].float(), -1)
        plan = SoftSelectionPlan(projections, T // 8, stage.tau, frozenset(projections))
        soft = torch.log_softmax(lm.model(input_ids=x, use_cache=False, **{PLAN_KWARG: plan}).logits[0].float(), -1)
    rows = sample_positions(T, T // 8, 16, seed=0)
    want = float((dense[rows].exp() * (dense[rows] - soft[rows])).sum(-1).mean())
    (_, _, got), = train_lm_stage(lm, projections, [ids], stage, seed=0)
    assert want > 1e-4 and got == pytest.approx(want, rel=1e-2, abs=1e-6)  # the plan matters: 100x the tolerance


def test_the_stage_lowers_the_kl_to_dense_and_leaves_the_model_unchanged():
    lm = _tiny_model()
    projections = _projections(lm)
    before_params = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    flags = {n: p.requires_grad for n, p in lm.model.named_parameters()}
    kl_before = _held_out_kl(lm, projections)
    stage = LMStageSettings(steps=40, lr=1e-2, tau=0.1, budgets=(Fraction(1, 8),), positions=48, warmup_steps=2)
    losses = train_lm_stage(lm, projections, TRAINING, stage, seed=0)
    assert len(losses) == 40 and {b for b, _, _ in losses} == {"1/8"} and {w for _, w, _ in losses} == set(range(8))
    first, last, n = first_and_last(losses)["1/8"]
    assert n == 8 and last < 0.8 * first, (first, last)
    kl_after = _held_out_kl(lm, projections)
    assert kl_after < kl_before, (kl_before, kl_after)
    for n, p in lm.model.named_parameters():
        assert torch.equal(p, before_params[n]), n
        assert p.requires_grad == flags[n], n
    for m in projections.values():
        assert not m.training and not any(p.requires_grad for p in m.parameters())


def test_the_log_objective_divides_each_steps_gradient_by_its_kl():
    for value in (3e-4, 0.02, 1.5):
        for objective, want in (("kl", 1.0), ("log-kl", 1.0 / value)):
            kl = torch.tensor(value, requires_grad=True)
            step_objective(kl, objective).backward()
            assert kl.grad.item() == pytest.approx(want, rel=1e-6), (objective, value)
    with pytest.raises(ValueError, match="objective: expected one of kl, log-kl, got 'l2'"):
        step_objective(torch.tensor(1.0), "l2")
    with pytest.raises(ValueError, match="objective: expected one of kl, log-kl, got 'l2'"):
        LMStageSettings(objective="l2")


def test_the_stage_with_the_log_objective_lowers_the_kl_too():
    lm = _tiny_model()
    projections = _projections(lm)
    kl_before = _held_out_kl(lm, projections)
    stage = LMStageSettings(steps=40, lr=1e-2, tau=0.1, budgets=(Fraction(1, 8),), positions=48, warmup_steps=2,
                            objective="log-kl")
    losses = train_lm_stage(lm, projections, TRAINING, stage, seed=0)
    first, last, _ = first_and_last(losses)["1/8"]
    assert last < 0.8 * first, (first, last)  # the recorded loss is the KL, not its log
    assert all(kl > 0 for _, _, kl in losses)
    kl_after = _held_out_kl(lm, projections)
    assert kl_after < kl_before, (kl_before, kl_after)


def test_the_stage_is_seeded():
    lm = _tiny_model()
    stage = LMStageSettings(steps=3, lr=1e-2, budgets=(Fraction(1, 8), Fraction(1, 4)), positions=16)
    a, b = _projections(lm), _projections(lm)
    la = train_lm_stage(lm, a, [_ids(0), _ids(1)], stage, seed=3)
    lb = train_lm_stage(lm, b, [_ids(0), _ids(1)], stage, seed=3)
    assert la == lb and [b for b, _, _ in la] == ["1/8", "1/4", "1/8"]
    for layer in a:
        for pa, pb in zip(a[layer].parameters(), b[layer].parameters()):
            assert torch.equal(pa, pb)


def test_stage_argument_errors():
    lm = _tiny_model()
    for bad in ({}, {2: IndexerProjections(SHAPE)}):
        with pytest.raises(ValueError, match=r"projections: expected full-attention layers of the model \(\[0, 1\]\)"):
            train_lm_stage(lm, bad, [_ids(0)], LMStageSettings(steps=1), seed=0)
    with pytest.raises(ValueError, match="windows: expected at least one"):
        train_lm_stage(lm, _projections(lm), [], LMStageSettings(steps=1), seed=0)
    for kwargs, match in (({"steps": 0}, "steps: expected an int >= 1"), ({"tau": 0.0}, "tau: expected > 0"),
                          ({"budgets": (Fraction(1, 1),)}, "budgets: expected Fractions in"),
                          ({"positions": 0}, "positions: expected an int >= 1")):
        with pytest.raises(ValueError, match=match):
            LMStageSettings(**kwargs)
    with pytest.raises(ValueError, match="no position in"):
        sample_positions(10, 9, 4, 0)
    assert sample_positions(10, 4, 100, 0).tolist() == [4, 5, 6, 7, 8]


def test_lm_stage_flags(capsys, tmp_path):
    from benchmark.indexer import train_cli

    args = train_cli.parse_args(["--out", "x.safetensors", "--lm-steps", "12"])
    assert (args.lm_steps, args.lm_lr, args.lm_tau, args.lm_positions, args.lm_objective, args.start_from) == (
        12, 1e-5, 0.1, 256, "kl", None)
    assert train_cli.parse_args(["--out", "x.safetensors", "--lm-steps", "2", "--lm-objective", "log-kl"]
                                ).lm_objective == "log-kl"
    assert train_cli.build_parser()._option_string_actions["--lm-objective"].choices == OBJECTIVES
    assert train_cli.parse_args(["--out", "x.safetensors"]).lm_steps == 0
    start = tmp_path / "start.safetensors"
    start.write_bytes(b"x")
    for flags, said in ((["--lm-steps", "-1"], "--lm-steps: expected >= 0"),
                        (["--lm-lr", "0"], "--lm-lr: expected > 0"),
                        (["--lm-tau", "-1"], "--lm-tau: expected > 0"),
                        (["--lm-positions", "0"], "--lm-positions: expected >= 1"),
                        (["--lm-objective", "log-kl"], "--lm-objective: applies to the model-loss stage"),
                        (["--lm-steps", "2", "--lm-objective", "l1"], "--lm-objective: invalid choice"),
                        (["--start-from", str(start)], "--start-from: expected --lm-steps >= 1"),
                        (["--start-from", str(start), "--lm-steps", "2", "--shape", "1x64"],
                         "--shape: applies to the per-layer stages, which --start-from skips"),
                        (["--start-from", str(start), "--lm-steps", "2", "--init", "attention"],
                         "--init: applies to the per-layer stages"),
                        (["--start-from", str(tmp_path / "missing"), "--lm-steps", "2"], "--start-from: no such file")):
        with pytest.raises(SystemExit):
            train_cli.parse_args(["--out", str(tmp_path / "o.safetensors")] + flags)
        assert said in capsys.readouterr().err, flags
    for flag in (["--lm-steps", "3"], ["--lm-objective", "log-kl"], ["--start-from", str(start)]):
        with pytest.raises(SystemExit):
            train_cli.parse_args(["--evaluate", str(start)] + flag)
        assert f"{flag[0]}: applies to training, not to --evaluate" in capsys.readouterr().err


def test_the_command_runs_the_stage_on_its_shortest_training_windows(capsys):
    """train_cli.model_loss_stage: the windows of the shortest --train-contexts length, the
    steps asked for, the modules rounded to the stored dtype, and a record of the KL."""
    import random

    from benchmark.indexer import train_cli
    from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import STORED_DTYPE

    lm = _tiny_model()
    rng = random.Random(7)

    class Corpus:
        texts = {"emma": "".join(chr(97 + rng.randrange(26)) for _ in range(3000))}

    tiny = type(lm)(model=lm.model, tokenizer=lambda text: {"input_ids": [ord(c) % 97 for c in text]},
                    gguf_path=None, gguf_sha256="", full_attention_layers=lm.full_attention_layers)
    args = train_cli.parse_args(["--out", "unused.safetensors", "--train-contexts", "96,128", "--train-windows", "3,1",
                                 "--copy-segments", "0", "--lm-steps", "4", "--lm-positions", "16",
                                 "--lm-lr", "1e-2"])
    projections = _projections(lm)
    before = {x: [p.clone() for p in m.parameters()] for x, m in projections.items()}
    record = train_cli.model_loss_stage(args, tiny, Corpus(), projections, progress=False)
    assert record["windows"] == 3 and record["context"] == 96 and len(record["losses"]) == 4
    assert record["budgets"] == ["1/16", "1/8", "1/4"] and record["steps"] == 4
    assert [x["budget"] for x in record["losses"]] == ["1/16", "1/8", "1/4", "1/16"]
    for x, m in projections.items():
        for p, q in zip(m.parameters(), before[x]):
            assert not torch.equal(p, q)  # trained
            assert torch.equal(p, p.to(STORED_DTYPE).to(p.dtype))  # what a load gives back
    assert "model-loss stage: 4 steps on 3 windows of 96 tokens" in capsys.readouterr().out
    assert set(record["kl_first_last"]) <= {"1/16"}  # only 1/16 came twice (steps 0 and 3), on one window if the same


def test_first_and_last_pairs_each_window_with_itself():
    losses = [("1/8", 0, 4.0), ("1/4", 0, 9.0), ("1/8", 1, 2.0), ("1/8", 0, 3.0), ("1/8", 1, 1.0), ("1/8", 0, 1.0),
              ("1/4", 1, 5.0)]
    # 1/8: window 0 first 4 last 1, window 1 first 2 last 1; 1/4 met each window once: no pair.
    assert first_and_last(losses) == {"1/8": (3.0, 1.0, 2)}
    assert first_and_last([]) == {}
