"""align on records alone: a module's independent calls that one run makes in another order (a
compiled graph's loop over a ``set``) pair by their values, a call computing one value fewer
included; rounding noise and a value gone nan keep the order."""

from __future__ import annotations

import math

from dispatchprobe.offline.align import align


def _spec(mean: float, norm: float) -> dict:
    return {"type": "tensor", "dtype": "float32", "shape": [8], "stats": {"mean": mean, "norm": norm}}


def _op(scope: str, op: str, inp: tuple, out: tuple) -> dict:
    return {"kind": "op", "stage": "forward", "scope": scope, "op": op, "inputs": [_spec(*inp)],
            "outputs": [_spec(*out)]}


def _call(table: float, cast: bool = True) -> list:
    """One call of ``Net.rope`` on the frequency table of mean ``table``: a cast, a mul, a cos."""
    ops = [_op("Net.rope", "aten._to_copy.default", (table, 3 * table), (table, 3 * table))] if cast else []
    return ops + [_op("Net.rope", "aten.mul.Tensor", (table, 2 * table), (4 * table, 9 * table)),
                  _op("Net.rope", "aten.cos.default", (4 * table, 9 * table), (0.5 - table, 2.0 + table))]


def _run(calls: list) -> list:
    head = [_op("Net.embed", "aten.embedding.default", (0.1, 1.0), (0.2, 3.0))]
    tail = [_op("Net.proj", "aten.mm.default", (0.2, 3.0), (0.3, 4.0))]
    return head + [r for c in calls for r in c] + tail


def _pairs(a: list, b: list) -> dict:
    return {i: j for i, j, _ in align(a, b).pairs}


def test_calls_in_another_order_pair_by_values():
    # eager: the global table's call, then the local one's; compiled: the other way round, its
    # second call's cast folded away
    a = _run([_call(0.15), _call(0.18)])
    b = _run([_call(0.18), _call(0.15, cast=False)])
    pairs = _pairs(a, b)
    for i, j in pairs.items():
        assert a[i]["outputs"] == b[j]["outputs"] and a[i]["op"] == b[j]["op"], (i, j)
    assert len(pairs) == len(b), pairs           # every compiled record pairs; eager's second cast stays alone
    # either run as A: the same pairs
    assert {j: i for i, j in _pairs(b, a).items()} == pairs


def test_rounding_noise_keeps_the_order():
    """Two calls whose outputs are near-equal, one run's values off by rounding: a crosswise
    pairing that is not at least twice as close leaves the ordered pairs."""
    a = _run([_call(0.15), _call(0.1501)])
    b = _run([_call(0.15 * (1 + 4e-4)), _call(0.1501 * (1 - 4e-4))])
    assert _pairs(a, b) == {i: i for i in range(len(a))}


def test_a_value_gone_nan_stays_in_its_pair():
    """A's first cast gone nan: its pair is not traded for the unpaired cast of A's second call,
    which would leave the nan unpaired."""
    a = _run([_call(0.15), _call(0.18)])
    b = _run([_call(0.18), _call(0.15, cast=False)])
    a[1]["outputs"] = [_spec(math.nan, math.nan)]
    pairs = _pairs(a, b)
    assert pairs[1] == 1 and 4 not in pairs, pairs


def test_groups_sieved_at_once_pair_as_when_each_is_ranked(monkeypatch):
    """The sieve that decides for all groups at once which cannot move changes no pair: random
    stretches (calls shuffled, values exact, off by rounding, or by a ratio near the half the
    rule needs; a nan; a call left out) pair the same as with every group ranked on its own."""
    import random

    from dispatchprobe.offline import align as A

    rng = random.Random(0)

    def value(base: float) -> float:
        kind = rng.random()
        if kind < 0.05:
            return math.nan
        scale = rng.choice([0.0, 1e-7, 1e-3, 0.3, 0.5, 0.51, 1.0])
        return base * (1 + scale * rng.uniform(-1, 1))

    for _ in range(100):
        calls_a, calls_b = [], []
        for c in range(rng.randint(2, 6)):
            t = rng.uniform(0.1, 1.0)
            ops = [_op("Net.rope", op, (value(t), value(2 * t)), (value(3 * t), value(t))) for op in
                   ("aten.mul.Tensor", "aten.cos.default", "aten.mul.Tensor")]
            calls_a.append(ops)
            calls_b.append([_op("Net.rope", r["op"], (value(r["inputs"][0]["stats"]["mean"]),
                                                    value(r["inputs"][0]["stats"]["norm"])),
                                (value(r["outputs"][0]["stats"]["mean"]), value(r["outputs"][0]["stats"]["norm"])))
                            for r in ops])
        rng.shuffle(calls_b)
        if rng.random() < 0.5:
            calls_b[-1] = calls_b[-1][1:]
        a, b = _run(calls_a), _run(calls_b)
        sieved = align(a, b).pairs
        with monkeypatch.context() as m:
            m.setattr(A, "_movable", lambda recs_a, recs_b, groups: [None] * len(groups))
            ranked = align(a, b).pairs
        assert sieved == ranked


def test_centred_means_keep_the_order():
    """An optimizer's calls of one op and shape, one per parameter: AdamW's ``lerp_`` of four layer
    norm bias gradients, whose means cancel to ~1e-10 of values ~1e-2 (an eager and a compiled
    DistilBERT's numbers).  The runs' means differ by rounding noise, of any size relative to
    themselves, their norms by 1e-8: by the means' relative differences crosswise pairs looked
    more than twice as close (they paired each bias with another's).  Measured against the values'
    size the noise decides nothing: each call pairs with its own, either run as A."""
    def lerp(grad: tuple, out: tuple) -> dict:
        return {"kind": "op", "stage": "forward", "scope": "", "op": "aten.lerp_.Scalar",
                "inputs": [_spec(0.0, 0.0), _spec(*grad)], "outputs": [_spec(*out)]}
    a = [lerp((1.127773e-10, 0.028737492), (1.43245e-11, 0.002873749)),
         lerp((-2.91038e-11, 0.028694031), (-3.8654e-12, 0.002869403)),
         lerp((5.63887e-11, 0.028646261), (4.0927e-12, 0.002864626)),
         lerp((-9.0949e-12, 0.028602096), (2.2737e-12, 0.002860210))]
    b = [lerp((2.91038e-11, 0.028737492), (4.5475e-12, 0.002873749)),
         lerp((-1.09139e-11, 0.028694029), (4.5475e-12, 0.002869403)),
         lerp((-3.09228e-11, 0.028646262), (-5.6843e-12, 0.002864626)),
         lerp((8.00355e-11, 0.028602096), (8.4128e-12, 0.002860210))]
    assert _pairs(a, b) == {i: i for i in range(len(a))}
    assert _pairs(b, a) == {i: i for i in range(len(a))}
