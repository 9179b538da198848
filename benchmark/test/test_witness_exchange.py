"""The mass-gated exchange into reused rows (``benchmark/quality/witness_exchange.py``): a
hand-computed row, the invariants over random rows, and the flag's errors."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

from benchmark.quality.errors import UsageError
from benchmark.quality.witness_exchange import Exchange, exchange_rows, parse_exchange, token_mass_estimates

F = Fraction
# Four blocks of two tokens; each token's estimate is its block's score over its visible tokens.
SCORES = torch.tensor([[0.1, 0.5, 0.05, 0.35]])


def test_token_estimates_split_each_block_over_its_visible_tokens():
    est = token_mass_estimates(SCORES, torch.tensor([8, 7]), 8, 2)
    assert est[0].tolist() == pytest.approx([0.05, 0.05, 0.25, 0.25, 0.025, 0.025, 0.175, 0.175])
    # Length 7: token 6 is alone in its block and carries all of it; token 7 is past the length.
    assert est[1].tolist() == pytest.approx([0.05, 0.05, 0.25, 0.25, 0.025, 0.025, 0.35, 0.0])


@pytest.mark.parametrize("exchange, expected, swaps", [
    # Token 0 is protected; 4 and 5 (0.025 each) go for 2 and 3 (0.25 each, above 2 x 0.025).
    (Exchange(F(1, 2), 2.0, F(1, 4)), [0, None, None, 6], 2),
    # No outsider carries 20 x 0.025: nothing moves.
    (Exchange(F(1, 2), 20.0, F(1, 4)), [0, 4, 5, 6], 0),
    # Nothing protected, three swaps allowed: 0 (0.05) goes too, for 7 (0.175 > 2 x 0.05).
    (Exchange(F(3, 4), 2.0, F(0)), [7, None, None, 6], 3),
    # The same at margin 4: 7 (0.175) is not above 4 x 0.05, so the swaps stop at two.
    (Exchange(F(3, 4), 4.0, F(0)), [0, None, None, 6], 2),
])
def test_a_row_by_hand(exchange, expected, swaps):
    rows = torch.tensor([[0, 4, 5, 6], [0, 1, 2, -1]], dtype=torch.int32)
    lengths = torch.tensor([8, 3])
    before = rows.clone()
    out, n = exchange_rows(rows, lengths, SCORES, 2, exchange)
    assert torch.equal(rows, before)
    assert out.dtype == torch.int32 and n.tolist() == [swaps, 0]
    got = out[0].tolist()
    for g, e in zip(got, expected):
        if e is not None:
            assert g == e
    if swaps >= 2:  # the two 0.25 tokens fill the two 0.025 slots, in either order
        assert sorted(got[1:3]) == [2, 3]
    assert out[1].tolist() == [0, 1, 2, -1]  # a row no longer than W holds every token already


@st.composite
def cases(draw):
    T = draw(st.integers(1, 6))
    W = draw(st.integers(1, 12))
    block = draw(st.integers(1, 5))
    lengths = [draw(st.integers(1, 30)) for _ in range(T)]
    L = max(lengths)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = torch.full((T, W), -1, dtype=torch.int32)
    for t, n in enumerate(lengths):
        if n <= W:
            rows[t, :n] = torch.arange(n, dtype=torch.int32)
        else:
            rows[t] = torch.randperm(n, generator=gen)[:W].to(torch.int32)
    N = -(-L // block)
    shared = draw(st.booleans())
    scores = torch.rand(1 if shared else T, N, generator=gen)
    if draw(st.booleans()):
        scores = torch.round(scores * 4) / 4  # ties
    exchange = Exchange(F(draw(st.integers(1, 8)), 8), draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 10.0])),
                        F(draw(st.integers(0, 7)), 8))
    return rows, torch.tensor(lengths), scores, block, exchange


@settings(max_examples=150, deadline=None)
@given(cases())
def test_exchange_invariants(case):
    rows, lengths, scores, block, ex = case
    before = (rows.clone(), lengths.clone(), scores.clone())
    out, swaps = exchange_rows(rows, lengths, scores, block, ex)
    assert all(torch.equal(a, b) for a, b in zip(before, (rows, lengths, scores)))
    T, W = rows.shape
    est = token_mass_estimates(scores, lengths, int(lengths.max()), block)
    protect, cap = int(ex.protect * W), min(int(ex.cap * W), W - int(ex.protect * W))
    for t in range(T):
        n, old, new = int(lengths[t]), rows[t].tolist(), out[t].tolist()
        if n <= W:
            assert new == old
            continue
        assert len(set(new)) == W and all(0 <= x < n for x in new)  # engine rows: distinct, causal
        assert new[:protect] == old[:protect]
        gone, came = set(old) - set(new), set(new) - set(old)
        changed = [i for i in range(W) if new[i] != old[i]]
        assert len(gone) == len(came) == len(changed) == int(swaps[t]) <= cap
        assert all(old[i] in gone and new[i] in came for i in changed)
        if came:  # every swap gains: the least of the new tokens beats margin x the most of the removed ones
            assert min(float(est[t, x]) for x in came) > ex.margin * max(float(est[t, x]) for x in gone)
        if len(came) < cap:  # and no further swap would: the best outsider left (outside the reused row, not
            # swapped in) loses to the least movable entry left
            outside = [float(est[t, x]) for x in range(n) if x not in set(old) and x not in came]
            movable = [float(est[t, x]) for i, x in enumerate(new) if i >= protect and x not in came]
            if outside and movable:
                assert not max(outside) > ex.margin * min(movable)


@pytest.mark.parametrize("text, message", [
    ("1/4,2", "expected CAP,MARGIN,PROTECT (e.g. 1/4,2,1/2), got '1/4,2'"),
    ("a,2,1/2", "expected CAP,MARGIN,PROTECT as fraction,number,fraction"),
    ("1/4,2,1/0", "expected CAP,MARGIN,PROTECT as fraction,number,fraction"),
    ("0,2,1/2", "cap: expected a share of W in (0, 1], got 0"),
    ("1/4,-1,1/2", "margin: expected a finite number >= 0, got -1.0"),
    ("1/4,inf,1/2", "margin: expected a finite number >= 0, got inf"),
    ("1/4,2,1", "protect: expected a share of W in [0, 1), got 1"),
])
def test_bad_exchanges_name_the_flag(text, message):
    with pytest.raises(UsageError, match="--exchange") as err:
        parse_exchange(text)
    assert message in str(err.value)


def test_an_exchange_is_named_by_its_settings():
    assert parse_exchange("1/4, 2, 1/2") == Exchange(F(1, 4), 2.0, F(1, 2))
    assert parse_exchange("1/4,2,1/2").name == "exchange:1/4:2:1/2"
