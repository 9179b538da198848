"""The trained indexer's projections in DSA's form, and its checkpoint file.

RoPE is pinned by its defining properties (identity at position 0, norm kept, scores that
depend only on the position difference, the non-RoPE dims untouched) and one hand-computed
rotation; the weights by DSA's scale; the checkpoint by a round trip and each refusal.
"""

from __future__ import annotations

import math

import pytest
import torch

from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import (
    IndexerCheckpointInfo,
    load_indexer_checkpoint,
    read_checkpoint_info,
    round_to_stored_dtype_,
    save_indexer_checkpoint,
    tensor_name,
)
from rtp_llm.models_py.modules.hybrid.indexer_projections import (
    IndexerProjections,
    IndexerProjectionShape,
    rope_non_interleaved,
)

SHAPE = IndexerProjectionShape(heads=2, head_dim=8, rope_dim=4, hidden_size=12, q_input_size=12)
SHA_A = "a" * 64
SHA_B = "b" * 64


def _module(seed: int, shape: IndexerProjectionShape = SHAPE) -> IndexerProjections:
    gen = torch.Generator().manual_seed(seed)
    m = IndexerProjections(shape)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return m


def test_rope_hand_computed_rotation():
    # rope_dim 2: one frequency (theta ** 0 = 1); position 1 rotates (a, b) by 1 radian.
    x = torch.tensor([[0.0, 0.0, 5.0], [1.0, 2.0, 5.0]])
    out = rope_non_interleaved(x, torch.tensor([0, 1]), rope_dim=2, theta=10000.0)
    c, s = math.cos(1.0), math.sin(1.0)
    expected = torch.tensor([[0.0, 0.0, 5.0], [1.0 * c - 2.0 * s, 1.0 * s + 2.0 * c, 5.0]])
    torch.testing.assert_close(out, expected)


def test_rope_properties():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 8, generator=gen), torch.randn(1, 8, generator=gen)
    at = lambda x, p: rope_non_interleaved(x, torch.tensor([p]), 4, 10000.0)  # noqa: E731
    torch.testing.assert_close(at(q, 0), q, msg="position 0 is the identity")
    torch.testing.assert_close(at(q, 7).norm(dim=-1), q.norm(dim=-1), msg="a rotation keeps the norm")
    assert torch.equal(at(q, 7)[..., 4:], q[..., 4:]), "dims past rope_dim pass through"
    # q at m, k at n: the score depends on m - n only.
    s1 = torch.einsum("rhd,rd->rh", at(q, 9), at(k, 4))
    s2 = torch.einsum("rhd,rd->rh", at(q, 105), at(k, 100))
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)


def test_forward_matches_dsa_formulas():
    m = _module(1)
    gen = torch.Generator().manual_seed(2)
    x, pos = torch.randn(5, 12, generator=gen), torch.arange(3, 8)
    q, k, w = m(x, pos)
    assert q.shape == (5, 2, 8) and k.shape == (5, 8) and w.shape == (5, 2)
    torch.testing.assert_close(w, (x @ m.weights_proj.weight.T) * 2**-0.5 * 8**-0.5)
    k_ref = torch.nn.functional.layer_norm(x @ m.wk.weight.T, (8,), m.k_norm.weight, m.k_norm.bias)
    torch.testing.assert_close(k, rope_non_interleaved(k_ref, pos, 4, 10000.0))
    q_ref = (x @ m.wq_b.weight.T).view(5, 2, 8)
    torch.testing.assert_close(q, rope_non_interleaved(q_ref, pos, 4, 10000.0))
    q_lora = torch.randn(5, 12, generator=gen)
    torch.testing.assert_close(m(x, pos, q_lora)[0], m.queries(q_lora, pos), msg="wq_b reads the q-LoRA latent")


@pytest.mark.parametrize("field, value", [("heads", 0), ("head_dim", True), ("rope_dim", 3), ("rope_dim", 10),
                                          ("rope_theta", 0.0)])
def test_shape_errors_name_the_field(field, value):
    kwargs = dict(heads=2, head_dim=8, rope_dim=4, hidden_size=12, q_input_size=12)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        IndexerProjectionShape(**kwargs)


def test_indexer_computes_q_k_weights_with_its_projections():
    m = _module(3)
    idx = Indexer(2, 8, 16, 4, layer_idx=0, projections=m)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(4))
    for got, want in zip(idx.index_inputs(x, torch.arange(4)), m(x, torch.arange(4))):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="index_n_heads"):
        Indexer(1, 8, 16, 4, layer_idx=0, projections=m)
    with pytest.raises(ValueError, match="projections"):
        Indexer(2, 8, 16, 4, layer_idx=0).index_inputs(x, torch.arange(4))


def _info(layers=(0, 2), shape=SHAPE, sha=SHA_A):
    return IndexerCheckpointInfo(model_sha256=sha, text_sha256=SHA_B, shape=shape, layers=tuple(layers),
                                 steps={x: 10 for x in layers}, command="test")


def test_checkpoint_round_trip_uses_dsa_names_and_bf16(tmp_path):
    mods = {0: _module(5), 2: _module(6)}
    path = tmp_path / "ix.safetensors"
    save_indexer_checkpoint(path, mods, _info())
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor(tensor_name(0, "wq_b.weight")).dtype == torch.bfloat16
    assert tensor_name(2, "k_norm.bias") == "model.layers.2.self_attn.indexer.k_norm.bias"
    assert len(names) == 10 and tensor_name(0, "weights_proj.weight") in names
    loaded, info = load_indexer_checkpoint(path, model_sha256=SHA_A)
    assert info.layers == (0, 2) and info.steps == {0: 10, 2: 10} and read_checkpoint_info(path) == info
    for layer, m in mods.items():
        expected = round_to_stored_dtype_(m)
        for name, p in loaded[layer].state_dict().items():
            assert torch.equal(p, expected.state_dict()[name]), name


def test_checkpoint_refusals_name_the_file_and_what_differs(tmp_path):
    path = tmp_path / "ix.safetensors"
    save_indexer_checkpoint(path, {0: _module(5), 2: _module(6)}, _info())
    with pytest.raises(ValueError, match="trained for the model with sha256 a+"):
        load_indexer_checkpoint(path, model_sha256=SHA_B)
    with pytest.raises(ValueError, match="trained for the model with sha256 a+"):  # the header-only check
        read_checkpoint_info(path, model_sha256=SHA_B)
    assert read_checkpoint_info(path, model_sha256=SHA_A).model_sha256 == SHA_A
    with pytest.raises(ValueError, match=r"no indexer for layers \[1\]"):
        load_indexer_checkpoint(path, model_sha256=SHA_A, layers=[0, 1])
    other = IndexerProjectionShape(heads=1, head_dim=8, rope_dim=4, hidden_size=12, q_input_size=12)
    with pytest.raises(ValueError, match="shape"):
        load_indexer_checkpoint(path, model_sha256=SHA_A, shape=other)
    with pytest.raises(ValueError, match="regular file"):
        load_indexer_checkpoint(tmp_path, model_sha256=None)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="bad.safetensors"):
        read_checkpoint_info(bad)
    with pytest.raises(ValueError, match="expected layers"):
        save_indexer_checkpoint(tmp_path / "x.safetensors", {0: _module(1)}, _info())
    with pytest.raises(ValueError, match="model_sha256"):
        _info(sha="none")


OTHER = IndexerProjectionShape(heads=4, head_dim=4, rope_dim=4, hidden_size=12, q_input_size=12)  # the same cost per key


def test_checkpoint_with_a_shape_per_layer_round_trips(tmp_path):
    mods = {0: _module(5), 2: _module(6, OTHER)}
    info = IndexerCheckpointInfo(model_sha256=SHA_A, text_sha256=SHA_B, shape=SHAPE, layers=(0, 2),
                                 steps={0: 10, 2: 10}, command="test", layer_shapes={2: OTHER})
    assert info.shape_of(0) == SHAPE and info.shape_of(2) == OTHER
    assert info.to_json()["format"] == "topology_kv_indexer/2" and _info().to_json()["format"] == "topology_kv_indexer/1"
    path = tmp_path / "ix.safetensors"
    save_indexer_checkpoint(path, mods, info)
    loaded, back = load_indexer_checkpoint(path, model_sha256=SHA_A)
    assert back == info and read_checkpoint_info(path) == info
    assert loaded[0].shape == SHAPE and loaded[2].shape == OTHER
    assert loaded[2].wq_b.weight.shape == (16, 12) and loaded[2].wk.weight.shape == (4, 12)
    for layer, m in mods.items():
        expected = round_to_stored_dtype_(m)
        for name, p in loaded[layer].state_dict().items():
            assert torch.equal(p, expected.state_dict()[name]), name
    # A caller that expects one shape: refused for the layer that has another, fine for the others.
    with pytest.raises(ValueError, match=r"layers \[2\] have shape .*heads=4.*expected .*heads=2"):
        load_indexer_checkpoint(path, model_sha256=SHA_A, shape=SHAPE)
    assert set(load_indexer_checkpoint(path, model_sha256=SHA_A, layers=[0], shape=SHAPE)[0]) == {0}
    # Saving a module of the wrong shape for its layer is refused.
    with pytest.raises(ValueError, match=r"projections\[2\].shape"):
        save_indexer_checkpoint(tmp_path / "y.safetensors", {0: _module(5), 2: _module(6)}, info)


def test_layer_shapes_refusals():
    def info(**kw):
        return IndexerCheckpointInfo(model_sha256=SHA_A, text_sha256=SHA_B, shape=SHAPE, layers=(0, 2),
                                     steps={0: 1, 2: 1}, command="t", **kw)

    with pytest.raises(ValueError, match=r"layer 1 is not one of the file's layers \[0, 2\]"):
        info(layer_shapes={1: OTHER})
    with pytest.raises(ValueError, match="the file's shape itself"):
        info(layer_shapes={2: SHAPE})
    wide = IndexerProjectionShape(heads=4, head_dim=4, rope_dim=4, hidden_size=16, q_input_size=16)
    with pytest.raises(ValueError, match="reads inputs of 16 / 16 .* expected the file's 12 / 12"):
        info(layer_shapes={2: wide})
    with pytest.raises(ValueError, match=r"expected one of the file's layers \[0, 2\], got 1"):
        info().shape_of(1)
    raw = info(layer_shapes={2: OTHER}).to_json()
    with pytest.raises(ValueError, match="src: format: 'topology_kv_indexer/1' with layer_shapes"):
        IndexerCheckpointInfo.from_json({**raw, "format": "topology_kv_indexer/1"}, "src")
    plain = info().to_json()
    with pytest.raises(ValueError, match="src: format: 'topology_kv_indexer/2' without layer_shapes"):
        IndexerCheckpointInfo.from_json({**plain, "format": "topology_kv_indexer/2"}, "src")
    with pytest.raises(ValueError, match="src: metadata"):
        IndexerCheckpointInfo.from_json({**raw, "layer_shapes": {"2": {"heads": 4}}}, "src")
    with pytest.raises(ValueError, match="src: format: expected"):
        IndexerCheckpointInfo.from_json({**plain, "format": "topology_kv_indexer/3"}, "src")
