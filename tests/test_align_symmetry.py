"""The alignment's ordered pass pairs the same records whichever run is A."""

from __future__ import annotations

import random

from dispatchprobe.offline.align import _match_blocks


def _pairs(ka, kb):
    found: list = []
    gaps = _match_blocks(ka, kb, list(range(len(ka))), list(range(100, 100 + len(kb))), "op", found)
    return sorted((i, j) for i, j, _ in found), sorted((tuple(a), tuple(b)) for a, b in gaps)


def test_equal_keys_in_other_orders_pair_alike_in_both_orders():
    """Two backward bmm run in other orders: difflib alone pairs the first of its first argument
    (bmm.q with A's order, bmm.k with B's); now the same pair and the same gaps, mirrored."""
    one, gaps_one = _pairs(["bmm.q", "bmm.k"], ["bmm.k", "bmm.q"])
    other, gaps_other = _pairs(["bmm.k", "bmm.q"], ["bmm.q", "bmm.k"])
    assert len(one) == 1
    mirror = lambda ps: sorted((j - 100, i + 100) for i, j in ps)    # noqa: E731
    assert one == mirror(other)
    assert gaps_one == sorted((tuple(j - 100 for j in b), tuple(i + 100 for i in a)) for a, b in gaps_other)


def test_random_key_sequences_pair_alike_in_both_orders():
    rng = random.Random(0)
    for _ in range(200):
        ka = [rng.choice("abcd") for _ in range(rng.randint(1, 12))]
        kb = [rng.choice("abcd") for _ in range(rng.randint(1, 12))]
        one, _ = _pairs(ka, kb)
        other, _ = _pairs(kb, ka)
        assert one == sorted((j - 100, i + 100) for i, j in other), (ka, kb)
