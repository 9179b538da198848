"""``--init attention`` (:mod:`benchmark.indexer.warm_start`): the indexer started from the
layer's own q/k projections, checked against the projections a tiny random Gemma 3 computes
in its own forward.

* with ``rope_dim == head_dim`` the started indexer's query of head ``h``, divided by
  ``rms(q_proj_h(x))``, is the model's post-norm, post-RoPE query, and its key the model's
  key (where the key projection has zero mean, so LayerNorm and RMSNorm agree);
* with a smaller ``rope_dim`` its rotary dims are the model's dims of the same frequencies;
* ``weights_proj`` is the least-squares fit (the normal equations hold);
* models or shapes it cannot start (several KV heads, another shape, a RoPE split that
  does not divide the head) are refused with the reason, before any training.
"""

from __future__ import annotations

import pytest
import torch

from benchmark.indexer.capture import capture_window, sample_rows
from benchmark.indexer.checkpoints import model_rope_theta
from benchmark.indexer.distill import DistillSettings, train_layer
from benchmark.indexer.warm_start import attention_warm_start, check_warm_start, rope_permutation
from benchmark.quality import sparse_attention
from benchmark.quality.model import LoadedModel, full_attention_layers, layer_attention
from benchmark.quality.text import TextWindow
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections, IndexerProjectionShape

H, D, C, T = 4, 16, 64, 160


def _tiny_gemma(kv_heads: int = 1) -> LoadedModel:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    sparse_attention.register()
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=C, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=H, num_key_value_heads=kv_heads, head_dim=D,
                           query_pre_attn_scalar=D, max_position_embeddings=512, sliding_window=64,
                           layer_types=["full_attention", "full_attention"])
    torch.manual_seed(0)  # the random weights
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=sparse_attention.ATTENTION_NAME).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_norm.weight.uniform_(-0.5, 0.5)  # Gemma's gain is 1 + weight: not all ones
            attn.k_norm.weight.uniform_(-0.5, 0.5)
            # Zero mean over the key's dims for every input: LayerNorm then equals RMSNorm.
            attn.k_proj.weight.sub_(attn.k_proj.weight.mean(dim=0, keepdim=True))
    sparse_attention.install_hidden_capture(model)
    return LoadedModel(model=model, tokenizer=None, gguf_path=None, gguf_sha256="",
                       full_attention_layers=full_attention_layers(model.config))


@pytest.fixture(scope="module")
def gemma():
    lm = _tiny_gemma()
    ids = torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = sample_rows(T, 48, 8, 1)
    sample = capture_window(lm, TextWindow("random", 0, tuple(ids)), rows, list(lm.full_attention_layers),
                            keep_attention_qk=True)
    return lm, sample


def _shape(lm, rope_dim):
    return IndexerProjectionShape(heads=H, head_dim=D, rope_dim=rope_dim, hidden_size=C, q_input_size=C,
                                  rope_theta=model_rope_theta(lm.model.config))


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def test_rope_permutation_by_hand():
    assert rope_permutation(8, 8).tolist() == list(range(8))
    # pairs (i, i + 4) of the model; the indexer's rotary pairs (j, j + 2) take i = 0, 2.
    assert rope_permutation(8, 4).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert rope_permutation(8, 2).tolist() == [0, 4, 1, 2, 3, 5, 6, 7]
    for bad in (3, 6, 0, 16):
        with pytest.raises(ValueError, match="rope_dim"):
            rope_permutation(8, bad)


@pytest.mark.parametrize("layer", [0, 1])
def test_full_rope_start_is_the_models_own_query_and_key(gemma, layer):
    lm, sample = gemma
    s = sample[layer]
    attn = layer_attention(lm.model, layer)
    shape = _shape(lm, D)
    module = IndexerProjections(shape)
    module.load_state_dict(attention_warm_start(attn, shape, s.hidden))
    with torch.no_grad():
        x_rows = s.hidden.index_select(0, s.rows)
        q = module.queries(x_rows, s.rows)  # [R, H, D]
        rms = (x_rows @ attn.q_proj.weight.T).view(-1, H, D).pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        torch.testing.assert_close(q / rms, s.query.transpose(0, 1), rtol=1e-4, atol=1e-4)
        k = module.keys(s.hidden, torch.arange(T))  # [L, D]
        torch.testing.assert_close(k, s.key[0], rtol=1e-3, atol=1e-3)  # LayerNorm's eps vs RMSNorm's


def test_half_rope_start_keeps_the_matching_frequencies(gemma):
    lm, sample = gemma
    s = sample[0]
    attn = layer_attention(lm.model, 0)
    shape = _shape(lm, D // 2)
    perm = rope_permutation(D, D // 2)
    module = IndexerProjections(shape)
    module.load_state_dict(attention_warm_start(attn, shape, s.hidden))
    with torch.no_grad():
        x_rows = s.hidden.index_select(0, s.rows)
        q = module.queries(x_rows, s.rows)  # [R, H, D]: a permutation of the model's dims, norm kept
        model_q = s.query.transpose(0, 1)[..., perm]
        torch.testing.assert_close(_unit(q)[..., : D // 2], _unit(model_q)[..., : D // 2], rtol=1e-4, atol=1e-4)
        k = module.keys(s.hidden, torch.arange(T))
        torch.testing.assert_close(k[:, : D // 2], s.key[0][:, perm][:, : D // 2], rtol=1e-3, atol=1e-3)


def test_weights_are_the_least_squares_fit(gemma):
    lm, sample = gemma
    s = sample[1]
    attn = layer_attention(lm.model, 1)
    shape = _shape(lm, D)
    state = attention_warm_start(attn, shape, s.hidden)
    x = s.hidden.to(torch.float64)
    rms = (x @ attn.q_proj.weight.detach().T.to(torch.float64)).view(-1, H, D).pow(2).mean(-1).add(1e-6).sqrt()
    target = attn.scaling / rms / shape.weight_scale
    residual = x @ state["weights_proj.weight"].T.to(torch.float64) - target
    # Normal equations: the residual is orthogonal to every input column (fp32 storage of the fit).
    assert float((x.T @ residual).abs().max()) < 1e-3 * float((x.T @ target).abs().max())


def test_training_starts_from_the_given_state(gemma):
    lm, sample = gemma
    s = sample[0]
    shape = _shape(lm, D)
    state = attention_warm_start(layer_attention(lm.model, 0), shape, s.hidden)
    before = {k: v.clone() for k, v in state.items()}
    module, _ = train_layer(shape, [s], DistillSettings(steps=1, lr=1e-12, warmup_steps=1), seed=0, init=state)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=1e-6, atol=1e-9)
    assert all(torch.equal(before[k], state[k]) for k in state)  # the start is copied, not trained in place


def test_refused_with_the_reason():
    lm2 = _tiny_gemma(kv_heads=2)
    shape = IndexerProjectionShape(heads=H, head_dim=D, rope_dim=D, hidden_size=C, q_input_size=C)
    with pytest.raises(ValueError, match="one KV head"):
        check_warm_start(layer_attention(lm2.model, 0), shape)
    lm = _tiny_gemma()
    attn = layer_attention(lm.model, 0)
    with pytest.raises(ValueError, match="proxy-cost"):
        check_warm_start(attn, IndexerProjectionShape(heads=1, head_dim=D, rope_dim=8, hidden_size=C, q_input_size=C))
    with pytest.raises(ValueError, match="rope_dim"):
        check_warm_start(attn, IndexerProjectionShape(heads=H, head_dim=D, rope_dim=6, hidden_size=C, q_input_size=C))
    with pytest.raises(ValueError, match="hidden"):
        attention_warm_start(attn, shape, torch.zeros(8, C))  # fewer rows than columns: no fit


def test_cli_flags_are_checked_before_loading(capsys):
    from benchmark.indexer import train_cli

    with pytest.raises(SystemExit):
        train_cli.parse_args(["--out", "x.safetensors", "--rope-dim", "3"])
    assert "--rope-dim: expected an even int >= 0, got 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--evaluate", __file__, "--init", "attention"])
    assert "--init: applies to training" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--out", "x.safetensors", "--init", "pretrained"])
    assert "--init: invalid choice" in capsys.readouterr().err
