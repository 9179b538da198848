"""The checked block exchange (``checked_exchange_rows`` in ``benchmark/quality/witness_exchange.py``):
a row by hand, a plain per-row reference over random shapes with its invariants (the row's
mass never falls at margin >= 1), and the setting's errors."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from benchmark.quality.errors import UsageError
from benchmark.quality.witness_exchange import (CheckedExchange, Exchange, checked_exchange_rows,
                                                parse_any_exchange_setting)

F = Fraction
# One head, one dimension, query 1: each key is its logit. Blocks of two: {0,1} {2,3} {4,5} {6,7}.
KEYS = torch.tensor([[[0.0], [0.0], [0.0], [-0.5], [3.0], [3.0], [-5.0], [1.0]]])
QUERY = torch.ones(1, 2, 1)
ROWS = torch.tensor([[0, 1, 2, 7], [0, 1, 2, -1]], dtype=torch.int32)
LENGTHS = torch.tensor([8, 3])


@pytest.mark.parametrize("cap, margin, expected, swaps", [
    # Row mass: 0, 0, 0 (1/Z each) and 1 (e/Z), Z = 3 + e. Block {4,5} is outside, its bound
    # 2 e^3 / Z against the two least entries 2 / Z: it goes in for row slots 0 and 1.
    # Block {2,3}'s outsider 3 (bound e^-0.5/Z) would then need a third slot: over the cap of 2.
    (F(1, 2), 1.0, [4, 5, 2, 7], 2),
    # Cap 3: 3 (e^-0.5/Z) against entry 2 (1/Z) does not gain at margin 1 ...
    (F(3, 4), 1.0, [4, 5, 2, 7], 2),
    # ... and does at margin 1/2 (e^-0.5 > 1/2); block {6,7}'s outsider 6 (e^-5/Z) would need a fourth slot.
    (F(3, 4), 0.5, [4, 5, 3, 7], 3),
    # 2 e^3 is not above 30 x 2: nothing moves.
    (F(1, 2), 30.0, [0, 1, 2, 7], 0),
])
def test_a_row_by_hand(cap, margin, expected, swaps):
    before = (ROWS.clone(), KEYS.clone(), QUERY.clone())
    out, n = checked_exchange_rows(ROWS, LENGTHS, QUERY, KEYS, 1.0, 2, CheckedExchange(cap, margin))
    assert all(torch.equal(a, b) for a, b in zip(before, (ROWS, KEYS, QUERY)))
    assert out.dtype == torch.int32 and n.tolist() == [swaps, 0]
    assert sorted(out[0].tolist()) == sorted(expected)  # the engine reads a row as a set
    assert out[0, 3] == 7  # the entry of the most mass stays in its slot
    assert out[1].tolist() == [0, 1, 2, -1]  # a row no longer than W holds every token already


def test_the_bound_is_jensens_not_the_blocks_mass():
    # Block {4,5} with logits 4 and 2 has mass e^4 + e^2 but the bound 2 e^3 (its mean logit):
    # at margin 2 e^3 / 2 (two entries of mass 1 each, Z cancels) it stays out, just.
    keys = KEYS.clone()
    keys[0, 4, 0], keys[0, 5, 0] = 4.0, 2.0
    tight = 2 * math.exp(3) / 2
    out, n = checked_exchange_rows(ROWS[:1], LENGTHS[:1], QUERY[:, :1], keys, 1.0, 2,
                                   CheckedExchange(F(1, 2), tight * 1.001))
    assert n.tolist() == [0] and out[0].tolist() == [0, 1, 2, 7]
    out, n = checked_exchange_rows(ROWS[:1], LENGTHS[:1], QUERY[:, :1], keys, 1.0, 2,
                                   CheckedExchange(F(1, 2), tight * 0.999))
    assert n.tolist() == [2] and out[0].tolist() == [4, 5, 2, 7]


def row_logits(query, key, scaling, t, row):
    """Row ``t``'s float64 logits ``[H][L]`` and, per head, their log-normaliser over ``row``."""
    H, Hkv, L = query.shape[0], key.shape[0], key.shape[1]
    logit = [[float(query[h, t].double() @ key[h // (H // Hkv), j].double()) * scaling for j in range(L)]
             for h in range(H)]
    return logit, [math.log(sum(math.exp(logit[h][j]) for j in row)) for h in range(H)]


def reference(rows, lengths, query, key, scaling, block, ex):
    """Per row, in float64 with plain loops: (rows, swaps, closest decision's relative margin)."""
    T, W = rows.shape
    H = query.shape[0]
    L = key.shape[1]
    cap = int(ex.cap * W)
    out, swaps, closest = rows.clone(), [], float("inf")
    for t in range(T):
        n, row = int(lengths[t]), [int(x) for x in rows[t]]
        if n <= W or cap == 0:
            swaps.append(0)
            continue
        logit, log_z = row_logits(query, key, scaling, t, row)
        mass = {j: sum(math.exp(logit[h][j] - log_z[h]) for h in range(H)) for j in row}
        blocks = []
        for b in range(-(-L // block)):
            members = [j for j in range(b * block, min(L, (b + 1) * block)) if j < n and j not in mass]
            if members:
                bound = sum(len(members) * math.exp(sum(logit[h][j] for j in members) / len(members) - log_z[h])
                            for h in range(H))
                blocks.append((-bound / len(members), b, members, bound))
        blocks.sort()
        entries = sorted(range(W), key=lambda i: (mass[row[i]], i))  # slots, least mass first
        used, new = 0, list(row)
        for _, _, members, bound in blocks:
            if used + len(members) > cap:
                break
            evicted = sum(mass[row[i]] for i in entries[used:used + len(members)])
            closest = min(closest, abs(bound - ex.margin * evicted) / max(bound, ex.margin * evicted, 1e-30))
            if not bound > ex.margin * evicted:
                break
            for i, j in zip(entries[used:used + len(members)], members):
                new[i] = j
            used += len(members)
        out[t] = torch.tensor(new, dtype=rows.dtype)
        swaps.append(used)
    return out, swaps, closest


@st.composite
def cases(draw):
    T = draw(st.integers(1, 5))
    W = draw(st.integers(1, 10))
    block = draw(st.integers(1, 5))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))
    D = draw(st.integers(1, 4))
    L = draw(st.integers(1, 28))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.arange(L - T + 1, L + 1).clamp(min=1) if T <= L else torch.full((T,), L)
    rows = torch.full((T, W), -1, dtype=torch.int32)
    for t, n in enumerate(lengths.tolist()):
        if n <= W:
            rows[t, :n] = torch.arange(n, dtype=torch.int32)
        else:
            rows[t] = torch.randperm(n, generator=gen)[:W].to(torch.int32)
    query = torch.randn(H, T, D, generator=gen) * draw(st.sampled_from([0.5, 2.0]))
    key = torch.randn(Hkv, L, D, generator=gen)
    ex = CheckedExchange(F(draw(st.integers(1, 8)), 8), draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 10.0])))
    return rows, lengths, query, key, block, ex, draw(st.integers(1, 4))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_checked_exchange_matches_the_reference(case):
    rows, lengths, query, key, block, ex, chunk = case
    before = (rows.clone(), lengths.clone(), query.clone(), key.clone())
    out, swaps = checked_exchange_rows(rows, lengths, query, key, 0.7, block, ex, query_chunk=chunk)
    assert all(torch.equal(a, b) for a, b in zip(before, (rows, lengths, query, key)))
    want, want_swaps, closest = reference(rows, lengths, query, key, 0.7, block, ex)
    assume(closest > 1e-4)  # float32 against float64: no decision on a knife's edge
    T, W = rows.shape
    assert swaps.tolist() == want_swaps
    H, Hkv = query.shape[0], key.shape[0]
    for t in range(T):
        n, old, new = int(lengths[t]), rows[t].tolist(), out[t].tolist()
        assert sorted(new) == sorted(want[t].tolist())
        if n <= W:
            assert new == old
            continue
        assert len(set(new)) == W and all(0 <= x < n for x in new)  # engine rows: distinct, causal
        came = set(new) - set(old)
        assert len(came) == len(set(old) - set(new)) == swaps[t] <= int(ex.cap * W)
        for b in {x // block for x in came}:  # blocks go in whole: every outsider of a taken block
            assert all(x in came for x in range(b * block, min(n, (b + 1) * block)) if x not in set(old))
        if ex.margin >= 1:  # the row's mass, normalised over the old row per head, never falls
            logit = torch.einsum("hd,hld->hl", query[:, t].double(),
                                 key.double().repeat_interleave(H // Hkv, dim=0)) * 0.7
            log_z = torch.logsumexp(logit[:, old], dim=1, keepdim=True)
            assert torch.exp(logit[:, new] - log_z).sum() >= torch.exp(logit[:, old] - log_z).sum() - 1e-9


@pytest.mark.parametrize("text, message", [
    ("checked:x", "expected checked:MARGIN (e.g. checked:1), got 'checked:x'"),
    ("checked:-1", "margin: expected a finite number >= 0, got -1.0"),
    ("checked:inf", "margin: expected a finite number >= 0, got inf"),
])
def test_bad_settings_name_the_setting(text, message):
    with pytest.raises(UsageError, match="witness_exchange") as err:
        parse_any_exchange_setting(text, 0.25, "witness_exchange")
    assert message in str(err.value)


def test_the_setting_picks_the_exchange():
    assert parse_any_exchange_setting("checked:2", 0.25, "w") == CheckedExchange(F(1, 4), 2.0)
    assert parse_any_exchange_setting("checked:2", 0.25, "w").name == "checked:1/4:2"
    assert parse_any_exchange_setting("2:1/2", 0.25, "w") == Exchange(F(1, 4), 2.0, F(1, 2))


def assert_rows_match(reference_fn, got, swaps, rows, lengths, query, key, block, ex):
    """Each decode row (its own request at its full length) chose what ``reference_fn`` (the
    float64 per-row reference) chooses, wherever no decision is on a knife's edge."""
    for t in range(rows.shape[0]):
        n = int(lengths[t])
        want, want_swaps, closest = reference_fn(rows[t:t + 1], lengths[t:t + 1], query[:, t:t + 1], key[:, :n],
                                                 0.7, block, ex)
        if closest > 1e-4:  # float32 against float64: no decision on a knife's edge
            assert int(swaps[t]) == want_swaps[0]
            assert sorted(got[t].tolist()) == sorted(want[0].tolist())


@settings(max_examples=100, deadline=None)
@given(cases())
def test_the_decode_shape_matches_the_harness(case):
    """Each row its own request at its full length (a decode step): the block-sum formulation
    of ``benchmark/candidates/checked_exchange.py`` chooses what the full-logit one does."""
    from benchmark.candidates.checked_exchange import checked_exchange_decode

    rows, lengths, query, key, block, ex, _ = case
    T, W = rows.shape
    keys, queries, _ = decode_state(rows, lengths, query, key, block)
    sums, counts = block_sums_of(keys, lengths, block)
    before = (rows.clone(), keys.clone(), sums.clone(), queries.clone())
    cap = int(ex.cap * W)
    got, swaps = checked_exchange_decode(rows, lengths, queries, keys, sums, counts, torch.arange(T), block,
                                         ex.margin, cap)
    assert all(torch.equal(a, b) for a, b in zip(before, (rows, keys, sums, queries)))
    assert_rows_match(reference, got, swaps, rows, lengths, query, key, block, ex)


def verified_reference(rows, lengths, query, key, scaling, block, ex):
    """The verified exchange per row in float64 with plain loops: (rows, swaps, closest margin)."""
    T, W = rows.shape
    H = query.shape[0]
    Hkv, L, _ = key.shape
    group = H // Hkv
    cap = int(ex.cap * W)
    out, swaps, closest = rows.clone(), [], float("inf")
    for t in range(T):
        n, row = int(lengths[t]), [int(x) for x in rows[t]]
        if n <= W or cap == 0:
            swaps.append(0)
            continue
        qk, log_z = row_logits(query, key, scaling, t, row)

        def mass(j):
            return sum(math.exp(qk[h][j] - log_z[h]) for h in range(H))

        upper = []
        for b in range(-(-L // block)):
            members = range(b * block, min(L, (b + 1) * block))
            outside = [j for j in members if j < n and j not in row]
            if not outside:
                continue
            u = 0.0
            for h in range(H):
                if ex.rank == "mean":  # the mass at the outsiders' mean logit
                    top = sum(qk[h][j] for j in outside) / len(outside) / scaling
                else:  # the greatest logit any key in the block's bounding box can have
                    kv = key[h // group].double()
                    top = sum(max(float(query[h, t, d]) * float(kv[j, d]) for j in members)
                              for d in range(key.shape[2]))
                u += math.exp(top * scaling - log_z[h])
            upper.append((-u, b))
        upper.sort()
        cands = [j for _, b in upper[:ex.blocks] for j in range(b * block, min(n, (b + 1) * block)) if j not in row]
        cands.sort(key=lambda j: -mass(j))
        slots = sorted(range(W), key=lambda i: (mass(row[i]), i))
        new, used = list(row), 0
        for j, i in zip(cands[:cap], slots):
            closest = min(closest, abs(mass(j) - ex.margin * mass(row[i])) / max(mass(j), 1e-30))
            if not mass(j) > ex.margin * mass(row[i]):
                break
            new[i] = j
            used += 1
        out[t] = torch.tensor(new, dtype=rows.dtype)
        swaps.append(used)
    return out, swaps, closest


@settings(max_examples=120, deadline=None)
@given(cases(), st.integers(1, 6), st.sampled_from(["box", "mean"]))
def test_verified_exchange_matches_the_reference(case, blocks, rank):
    from benchmark.quality.witness_exchange import VerifiedExchange, verified_exchange_rows

    rows, lengths, query, key, block, checked, chunk = case
    ex = VerifiedExchange(checked.cap, checked.margin, blocks, rank)
    before = (rows.clone(), lengths.clone(), query.clone(), key.clone())
    out, swaps = verified_exchange_rows(rows, lengths, query, key, 0.7, block, ex, query_chunk=chunk)
    assert all(torch.equal(a, b) for a, b in zip(before, (rows, lengths, query, key)))
    want, want_swaps, closest = verified_reference(rows, lengths, query, key, 0.7, block, ex)
    assume(closest > 1e-4)
    assert swaps.tolist() == want_swaps
    T, W = rows.shape
    H, Hkv = query.shape[0], key.shape[0]
    for t in range(T):
        n, old, new = int(lengths[t]), rows[t].tolist(), out[t].tolist()
        assert sorted(new) == sorted(want[t].tolist())
        if n <= W:
            assert new == old
            continue
        assert len(set(new)) == W and all(0 <= x < n for x in new)
        assert len(set(new) - set(old)) == swaps[t] <= int(ex.cap * W)
        if ex.margin >= 1:  # exact masses on both sides: every swap gains
            logit = torch.einsum("hd,hld->hl", query[:, t].double(),
                                 key.double().repeat_interleave(H // Hkv, dim=0)) * 0.7
            log_z = torch.logsumexp(logit[:, old], dim=1, keepdim=True)
            assert torch.exp(logit[:, new] - log_z).sum() >= torch.exp(logit[:, old] - log_z).sum() - 1e-9


def test_the_verified_exchange_finds_a_spike_the_bound_misses():
    # Block {4,5}: logits 6 and -6. Its mean logit is 0, so the checked exchange's bound
    # (2 e^0) loses to the two least entries (logits 0, 0) at margin 1.5; the verified one reads
    # token 4 (e^6) and swaps it in for one entry.
    from benchmark.quality.witness_exchange import VerifiedExchange, verified_exchange_rows

    keys = KEYS.clone()
    keys[0, 4, 0], keys[0, 5, 0], keys[0, 3, 0] = 6.0, -6.0, -9.0
    rows, lengths, query = ROWS[:1], LENGTHS[:1], QUERY[:, :1]
    _, n = checked_exchange_rows(rows, lengths, query, keys, 1.0, 2, CheckedExchange(F(1, 2), 1.5))
    assert n.tolist() == [0]
    out, n = verified_exchange_rows(rows, lengths, query, keys, 1.0, 2, VerifiedExchange(F(1, 2), 1.5, 1))
    assert n.tolist() == [1] and sorted(out[0].tolist()) == [1, 2, 4, 7]  # entry 0 (first of the ties) goes


def test_candidates_named_by_the_outsiders_mean_find_a_dense_block_a_wide_box_hides():
    # Blocks of 2 outside the row {0, 1}: {2, 3} has logits 3 and -9 (mean -3, box bound 3:
    # its greatest key), {4, 5} logits 2 and 2 (mean 2, bound 2). Reading one block, `box`
    # reads {2, 3} and swaps in token 2 (e^3); `mean` reads {4, 5} and swaps in both (2 e^2).
    from benchmark.quality.witness_exchange import VerifiedExchange, verified_exchange_rows

    keys = torch.tensor([[[0.0], [0.0], [3.0], [-9.0], [2.0], [2.0]]])
    rows, lengths, query = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([6]), torch.ones(1, 1, 1)
    out, n = verified_exchange_rows(rows, lengths, query, keys, 1.0, 2, VerifiedExchange(F(1), 1.0, 1))
    assert n.tolist() == [1] and sorted(out[0].tolist()) == [1, 2]
    out, n = verified_exchange_rows(rows, lengths, query, keys, 1.0, 2, VerifiedExchange(F(1), 1.0, 1, "mean"))
    assert n.tolist() == [2] and sorted(out[0].tolist()) == [4, 5]


@settings(max_examples=40, deadline=None)
@given(cases())
def test_reading_every_block_makes_the_ranking_irrelevant(case):
    from benchmark.quality.witness_exchange import VerifiedExchange, verified_exchange_rows

    rows, lengths, query, key, block, checked, chunk = case
    every = -(-key.shape[1] // block)
    box, n_box = verified_exchange_rows(rows, lengths, query, key, 0.7, block,
                                        VerifiedExchange(checked.cap, checked.margin, every))
    mean, n_mean = verified_exchange_rows(rows, lengths, query, key, 0.7, block,
                                          VerifiedExchange(checked.cap, checked.margin, every, "mean"))
    assert torch.equal(n_box, n_mean)
    assert [sorted(r) for r in box.tolist()] == [sorted(r) for r in mean.tolist()]


@pytest.mark.parametrize("text, message", [
    ("verified:1", "expected verified:MARGIN:BLOCKS[:RANK] (e.g. verified:1:64 or verified:1:64:mean), "
                   "got 'verified:1'"),
    ("verified:1:x", "expected verified:MARGIN:BLOCKS[:RANK]"),
    ("verified:1:2:mean:3", "expected verified:MARGIN:BLOCKS[:RANK]"),
    ("verified:1:2:3", "rank: expected one of box, mean, got '3'"),
    ("verified:1:0", "blocks: expected an integer >= 1, got 0"),
])
def test_bad_verified_settings_name_the_setting(text, message):
    with pytest.raises(UsageError, match="witness_exchange") as err:
        parse_any_exchange_setting(text, 0.25, "witness_exchange")
    assert message in str(err.value)
    assert parse_any_exchange_setting("verified:2:64", 0.25, "w").name == "verified:1/4:2:64"
    assert parse_any_exchange_setting("verified:2:64:box", 0.25, "w").name == "verified:1/4:2:64"
    assert parse_any_exchange_setting("verified:2:64:mean", 0.25, "w").name == "verified:1/4:2:64:mean"


def decode_state(rows, lengths, query, key, block):
    """Each row its own request holding exactly the keys below its length (a decode step):
    ``(keys [T, L, Hkv * D], queries [T, H, D] times the scale 0.7, boxes)``."""
    from benchmark.candidates.verified_exchange import BlockBoxes

    T = rows.shape[0]
    H, _, D = query.shape
    Hkv, L, _ = key.shape
    keys = torch.zeros(T, L, Hkv * D)
    boxes = BlockBoxes(T, -(-L // block), Hkv * D, block_size=block)
    for t in range(T):
        n = int(lengths[t])
        keys[t, :n] = key[:, :n].transpose(0, 1).reshape(n, Hkv * D)
        boxes.update(keys[t, :n], torch.arange(n), torch.full((n,), t))
    return keys, query.transpose(0, 1) * 0.7, boxes


_MEAN_DECODERS = ["verified_exchange_mean_decode", "verified_exchange_mean_cpu"]


def _verified_decoders():
    from benchmark.candidates import verified_exchange as v

    return {"torch": v.verified_exchange_decode, "cpp": v.verified_exchange_cpu}


def block_sums_of(keys, lengths, block):
    """The drift tracker's tables for :func:`decode_state`'s requests: ``(sums [T, N, K], counts [T, N])``."""
    T, L, K = keys.shape
    N = -(-L // block)
    sums, counts = torch.zeros(T, N, K), torch.zeros(T, N)
    for t in range(T):
        for j in range(int(lengths[t])):
            sums[t, j // block] += keys[t, j]
            counts[t, j // block] += 1
    return sums, counts


@pytest.mark.parametrize("impl", _MEAN_DECODERS)
@settings(max_examples=100, deadline=None)
@given(case=cases(), blocks=st.integers(1, 6))
def test_the_mean_ranked_decode_shape_matches_the_harness(impl, case, blocks):
    """``verified_exchange_mean_decode`` (the drift tracker's block sums and counts) chooses what
    the full-logit ``verified_exchange_rows`` does with rank ``mean``."""
    from benchmark.candidates import verified_exchange as v
    from benchmark.quality.witness_exchange import VerifiedExchange

    rows, lengths, query, key, block, checked, _ = case
    ex = VerifiedExchange(checked.cap, checked.margin, blocks, "mean")
    T, W = rows.shape
    keys, queries, _ = decode_state(rows, lengths, query, key, block)
    sums, counts = block_sums_of(keys, lengths, block)
    before = (rows.clone(), keys.clone(), sums.clone(), counts.clone(), queries.clone())
    got, swaps = getattr(v, impl)(rows, lengths, queries, keys, sums, counts, torch.arange(T), block,
                                  ex.margin, int(ex.cap * W), blocks)
    assert all(torch.equal(a, b) for a, b in zip(before, (rows, keys, sums, counts, queries)))
    assert got.dtype == torch.int32
    assert_rows_match(verified_reference, got, swaps, rows, lengths, query, key, block, ex)


@pytest.mark.parametrize("impl", ["torch", "cpp"])
@settings(max_examples=100, deadline=None)
@given(case=cases(), blocks=st.integers(1, 6))
def test_the_verified_decode_shape_matches_the_harness(impl, case, blocks):
    """``verified_exchange_decode`` (block boxes kept as keys arrive) and its C++ pass choose
    what the full-logit ``verified_exchange_rows`` does."""
    from benchmark.quality.witness_exchange import VerifiedExchange

    verified_exchange_decode = _verified_decoders()[impl]

    rows, lengths, query, key, block, checked, _ = case
    ex = VerifiedExchange(checked.cap, checked.margin, blocks)
    T, W = rows.shape
    keys, queries, boxes = decode_state(rows, lengths, query, key, block)
    kmin, kmax = boxes.tables()
    before = (rows.clone(), keys.clone(), kmin.clone(), kmax.clone(), queries.clone())
    got, swaps = verified_exchange_decode(rows, lengths, queries, keys, kmin, kmax, torch.arange(T), block,
                                          ex.margin, int(ex.cap * W), blocks)
    assert all(torch.equal(a, b) for a, b in zip(before, (rows, keys, kmin, kmax, queries)))
    assert got.dtype == torch.int32
    assert_rows_match(verified_reference, got, swaps, rows, lengths, query, key, block, ex)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 4), st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_block_boxes_hold_each_blocks_least_and_greatest_key(B, N, block, T, seed):
    """Keys fed in any order, some past capacity (the dump column): every block's box is the
    column-wise min / max of its keys by loops; a block with no key stays empty; reset forgets."""
    from benchmark.candidates.verified_exchange import BlockBoxes

    gen = torch.Generator().manual_seed(seed)
    K = 3
    boxes = BlockBoxes(B, N, K, block_size=block)
    keys = torch.randn(T, K, generator=gen)
    positions = torch.randint(0, (N + 1) * block, (T,), generator=gen)  # some past the N blocks
    requests = torch.randint(0, B, (T,), generator=gen)
    before = (keys.clone(), positions.clone(), requests.clone())
    boxes.update(keys, positions, requests)
    assert all(torch.equal(a, b) for a, b in zip(before, (keys, positions, requests)))
    kmin, kmax = boxes.tables()
    assert kmin.shape == kmax.shape == (B, N, K)
    for b in range(B):
        for n in range(N):
            members = [keys[i] for i in range(T) if int(requests[i]) == b and int(positions[i]) // block == n]
            if members:
                assert torch.equal(kmin[b, n], torch.stack(members).amin(0))
                assert torch.equal(kmax[b, n], torch.stack(members).amax(0))
            else:
                assert bool((kmin[b, n] == float("inf")).all() and (kmax[b, n] == float("-inf")).all())
    boxes.reset(torch.tensor([0]))
    assert bool((boxes.tables()[0][0] == float("inf")).all() and (boxes.tables()[1][0] == float("-inf")).all())


def test_block_boxes_name_bad_arguments():
    from benchmark.candidates.verified_exchange import BlockBoxes

    with pytest.raises(ValueError, match=r"max_blocks: expected an int >= 1, got 0"):
        BlockBoxes(1, 0, 4, block_size=8)
    boxes = BlockBoxes(2, 4, 4, block_size=8)
    with pytest.raises(ValueError, match=r"keys, positions, request_ids: expected \[T, 4\], \[T\], \[T\], "
                                         r"got \[3, 5\], \[3\], \[3\]"):
        boxes.update(torch.zeros(3, 5), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))


def test_the_verified_kernel_names_a_bad_index_before_any_work():
    from benchmark.candidates.verified_exchange import BlockBoxes, verified_exchange_cpu

    boxes = BlockBoxes(1, 2, 4, block_size=2)
    keys = torch.randn(1, 4, 4)
    boxes.update(keys[0], torch.arange(4), torch.zeros(4, dtype=torch.int64))
    kmin, kmax = boxes.tables()
    rows = torch.tensor([[0, 3]], dtype=torch.int32)
    args = (torch.tensor([3]), torch.randn(1, 2, 2), keys, kmin, kmax, torch.tensor([0]), 2, 1.0, 1, 1)
    before = rows.clone()
    with pytest.raises(RuntimeError, match="rows: expected -1 or a position below the row's length 3, got 3 at row 0"):
        verified_exchange_cpu(rows, *args)
    assert torch.equal(rows, before)
    with pytest.raises(RuntimeError, match=r"row_to_request: expected values in \[0, 1\), got 1 at row 0"):
        verified_exchange_cpu(torch.tensor([[0, 1]]), *args[:5], torch.tensor([1]), *args[6:])


def test_the_mean_ranked_kernel_names_bad_tables_and_indices_before_any_work():
    from benchmark.candidates.verified_exchange import verified_exchange_mean_cpu

    keys = torch.randn(1, 4, 4)
    sums, counts = block_sums_of(keys, torch.tensor([4]), 2)
    rows = torch.tensor([[0, 3]], dtype=torch.int32)
    before = (rows.clone(), keys.clone(), sums.clone(), counts.clone())
    args = [torch.tensor([3]), torch.randn(1, 2, 2), keys, sums, counts, torch.tensor([0]), 2, 1.0, 1, 1]
    with pytest.raises(RuntimeError, match="rows: expected -1 or a position below the row's length 3, got 3 at row 0"):
        verified_exchange_mean_cpu(rows, *args)
    bad = list(args)
    bad[4] = counts[:, :1]
    with pytest.raises(RuntimeError, match=r"block_counts: expected contiguous float32 \[1, 2\], got Float of shape \[1, 1\]"):
        verified_exchange_mean_cpu(torch.tensor([[0, 1]]), *bad)
    bad = list(args)
    bad[3] = sums[:, :, :2]
    with pytest.raises(RuntimeError, match=r"block_sums: expected float32 \[1, N, 4\]"):
        verified_exchange_mean_cpu(torch.tensor([[0, 1]]), *bad)
    assert all(torch.equal(a, b) for a, b in zip(before, (rows, keys, sums, counts)))
