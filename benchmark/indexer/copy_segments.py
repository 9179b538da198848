"""Retrieval-shaped training windows: random token segments written twice into real text.

An indexer distilled on prose alone learns what prose attention needs and little about
retrieval: the induction heads' pull towards an earlier copy of the current context is rare
in a novel. Trained on plain text, an indexer keeps far less than the oracle's attention
mass on the copy probe's rows (:mod:`benchmark.quality.probe`), worst in the layers whose
heads copy (the trainer's ``copy probe`` evaluation set shows it per layer). A served DSA
indexer is trained on a corpus full of repeated strings (code, identifiers, quoted
passages); these windows stand in for that part of it.

:func:`write_copy_segments` overwrites ``n`` spans of a window with random token segments
(tokens drawn from a given vocabulary, lengths :data:`SEGMENT_RANGE`), each segment written
at two places, and returns the query rows of the second copies: position ``s + j - 1`` of
a second copy starting at ``s`` is the row whose next token is the segment's token ``j``,
the row that must find the first copy. Placement is seeded and never overlaps an earlier
span; the first 8 tokens (the sinks) are left alone.

The copy probe draws its segments the same way (random tokens of the text), so it checks
that retrieval survives the budget in this form, not that it generalises to another form
(repeating passages of the text itself, the other candidate, taught retrieval much less).
"""

from __future__ import annotations

import random
from typing import List, Sequence, Tuple

from benchmark.quality.text import TextWindow

SEGMENT_RANGE = (16, 64)  # tokens per segment, both ends included
FIRST_FREE = 8  # spans start at or after this position (clear of the sink tokens)
PER_TOKENS = 2048  # ``per_2k`` counts segments per this many tokens
MAX_TRIES = 200


def segments_for(length: int, per_2k: int) -> int:
    """Segments written into a window of ``length`` tokens: ``per_2k`` per 2,048, at least 1 when ``per_2k > 0``."""
    if per_2k <= 0:
        return 0
    return max(1, round(per_2k * length / PER_TOKENS))


def write_copy_segments(window: TextWindow, vocabulary: Sequence[int], per_2k: int,
                        seed: int) -> Tuple[TextWindow, List[int]]:
    """``(window with the segments written in, ascending query rows of the second copies)``.

    ValueError when the window is too short for one segment of the longest length, or the
    vocabulary is empty. When fewer spans fit than asked (a crowded short window), the ones
    that fit are written.
    """
    T = len(window.token_ids)
    lo, hi = SEGMENT_RANGE
    if T < FIRST_FREE + 4 * hi:
        raise ValueError(f"window: expected at least {FIRST_FREE + 4 * hi} tokens for copy segments, got {T}")
    vocab = sorted(set(int(v) for v in vocabulary))
    if not vocab:
        raise ValueError("vocabulary: expected at least one token id, got none")
    rng = random.Random(seed)
    ids = list(window.token_ids)
    taken: List[Tuple[int, int]] = []
    rows: List[int] = []
    for _ in range(segments_for(T, per_2k)):
        for _try in range(MAX_TRIES):
            S = rng.randint(lo, hi)
            second = rng.randint(max(T // 8, FIRST_FREE + S), T - S)
            first = rng.randint(FIRST_FREE, second - S)
            spans = [(first, first + S), (second, second + S)]
            if all(b <= a0 or a >= b0 for a, b in spans for a0, b0 in taken):
                break
        else:
            continue
        taken += spans
        segment = [vocab[rng.randrange(len(vocab))] for _ in range(S)]
        ids[first:first + S] = segment
        ids[second:second + S] = segment
        rows += range(second, second + S - 1)
    return TextWindow(f"{window.novel}+copies", window.token_start, tuple(ids)), sorted(rows)
