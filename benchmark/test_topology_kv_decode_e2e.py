"""End-to-end decode benchmark: dense decode equals transformers' own greedy generate, a
budget covering the context equals dense, every variant runs and reports sane numbers."""

from __future__ import annotations

import pytest
import torch

from benchmark import topology_kv_decode_e2e as e2e
from benchmark.quality.sample_text import PRIDE_AND_PREJUDICE_OPENING

NUM_LAYERS = 2  # truncated model: fast, and the comparison is exact either way
CONTEXT = 160  # > 2 pages of 64, so sink/local/witness blocks all exist
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def loaded():
    return e2e.load_model(None, NUM_LAYERS)


@pytest.fixture(scope="module")
def prompt(loaded):
    ids = loaded.tokenizer(PRIDE_AND_PREJUDICE_OPENING, add_special_tokens=False)["input_ids"]
    assert len(ids) >= CONTEXT
    return torch.tensor([ids[:CONTEXT]])


def _decode(loaded, prompt, variant, width):
    caches, first, _ = e2e.prefill(loaded.model, prompt, CONTEXT + NEW_TOKENS + 1)
    tokens, steps = e2e.decode(loaded.model, caches, first, CONTEXT, NEW_TOKENS, variant, width)
    return tokens, steps


@torch.no_grad()
def test_dense_matches_transformers_generate(loaded, prompt):
    tokens, _ = _decode(loaded, prompt, "dense", width=CONTEXT)
    model = loaded.model
    model.set_attn_implementation("sdpa")
    try:
        ref = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(prompt))
    finally:
        model.set_attn_implementation(e2e.ATTENTION_NAME)
    assert tokens == ref[0, CONTEXT:].tolist()


@pytest.mark.parametrize("variant", [v for v in e2e.VARIANTS if v != "dense"])
def test_full_budget_variant_equals_dense(loaded, prompt, variant):
    dense, _ = _decode(loaded, prompt, "dense", width=CONTEXT)
    tokens, steps = _decode(loaded, prompt, variant, width=CONTEXT + NEW_TOKENS + 1)
    assert tokens == dense
    assert all(s["selected_tokens"] == NUM_LAYERS * (CONTEXT + i + 1) for i, s in enumerate(steps))


@pytest.mark.parametrize("variant", [v for v in e2e.VARIANTS if v != "dense"])
def test_small_budget_selects_at_most_w_and_times_parts(loaded, prompt, variant):
    width = 96
    _, steps = _decode(loaded, prompt, variant, width=width)
    for s in steps:
        assert 0 < s["selected_tokens"] <= NUM_LAYERS * width
        assert s["total_s"] > 0 and s["attention_s"] > 0 and s["rest_s"] >= 0
        assert (s["scanned_keys"] > 0) == (variant not in ("topology_only_noscan",))
        assert (s["policy_s"] > 0) == (variant not in ("learned",))


def test_bad_flags_name_the_flag(capsys):
    for argv, flag in [(["--contexts", "1"], "--contexts"), (["--new-tokens", "0"], "--new-tokens"),
                       (["--budget", "0"], "--budget"), (["--variants", "sparse"], "--variants"),
                       (["--warmup", "5", "--new-tokens", "3"], "--warmup")]:
        with pytest.raises(SystemExit):
            e2e.parse_args(argv)
        assert flag in capsys.readouterr().err
