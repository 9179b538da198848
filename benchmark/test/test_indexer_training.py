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
