"""align's closeness of many record pairs at once (numpy) is the per-pair sum of
``stats_distance`` bit for bit: pairs re-chosen by value keep the same ties and choices."""

from __future__ import annotations

import math
import random

from dispatchprobe.offline.align import _closeness, _closeness_many
from dispatchprobe.offline.regions import stats_distance


def _scalar(ra: dict, rb: dict) -> tuple:
    out = []
    for io in ("outputs", "inputs"):
        d = sum(stats_distance(sa, sb) for sa, sb in zip(ra.get(io) or (), rb.get(io) or ())
                if isinstance(sa, dict) and isinstance(sb, dict))
        out.append(d if math.isfinite(d) else math.inf)
    return tuple(out)


def _value(rng: random.Random):
    return rng.choice([rng.uniform(-5, 5), rng.uniform(-1e-20, 1e-20), 0.0, 0, 3, -7, 1e308, math.nan,
                       math.inf, None, "nan", True, rng.random() * 1e-300])


def _spec(rng: random.Random):
    kind = rng.random()
    if kind < 0.1:
        return None                                  # not a spec (an optional argument left out)
    if kind < 0.2:
        return {"type": "none"}                      # a spec without statistics
    stats = {k: _value(rng) for k in ("mean", "norm") if rng.random() < 0.9}
    return {"type": "tensor", "stats": stats}


def _record(rng: random.Random) -> dict:
    return {io: [_spec(rng) for _ in range(rng.randint(0, 4))] for io in ("outputs", "inputs")
            if rng.random() < 0.95}


def test_matrix_equals_per_pair_sum_bit_for_bit():
    rng = random.Random(0)
    for _ in range(200):
        recs_a = [_record(rng) for _ in range(rng.randint(1, 5))]
        recs_b = [_record(rng) for _ in range(rng.randint(1, 5))]
        cand_a, cand_b = list(range(len(recs_a))), list(range(len(recs_b)))
        far_out, far_in = _closeness(recs_a, recs_b, cand_a, cand_b)
        assert far_out.shape == far_in.shape == (len(recs_a), len(recs_b))
        for x in cand_a:
            for y in cand_b:
                want = _scalar(recs_a[x], recs_b[y])
                got = (far_out[x, y].item(), far_in[x, y].item())
                assert got == want, (recs_a[x], recs_b[y], got, want)
                assert sum(got) == sum(want)


def test_integer_statistics_float64_would_round_are_measured_exactly():
    big = 2 ** 60 + 1
    ra = {"outputs": [{"stats": {"mean": big, "norm": 1.0}}]}
    rb = {"outputs": [{"stats": {"mean": big - 2, "norm": 2.0}}]}
    far_out, _ = _closeness([ra], [rb], [0], [0])
    assert far_out[0, 0].item() == _scalar(ra, rb)[0] == stats_distance(ra["outputs"][0], rb["outputs"][0])


def test_many_groups_at_once_equal_each_group_bit_for_bit():
    """``_closeness_many`` (groups of one size computed together, for the re-pairing's first
    sieve) gives each group's ``far_out + far_in`` exactly; a group with an integer statistic
    float64 would round is left to the group's own measure."""
    rng = random.Random(1)
    recs_a = [_record(rng) for _ in range(60)]
    recs_b = [_record(rng) for _ in range(60)]
    recs_a[7] = {"outputs": [{"stats": {"mean": 2 ** 60 + 1, "norm": 1.0}}]}
    groups = []
    for _ in range(300):
        groups.append((sorted(rng.sample(range(60), rng.randint(1, 4))),
                       sorted(rng.sample(range(60), rng.randint(1, 4)))))
    seen = set()
    for idx, far in _closeness_many(recs_a, recs_b, groups):
        for n, g in enumerate(idx):
            out, inp = _closeness(recs_a, recs_b, *groups[g])
            want = out + inp
            assert far[n].shape == want.shape
            assert far[n].tobytes() == want.tobytes(), groups[g]
            seen.add(g)

    def measured_big(ca, cb):    # record 7's integer mean lies in the outputs' slots both sides measure
        return 7 in ca and min(max(len(recs.get("outputs") or ()) for recs in side)
                               for side in ([recs_a[i] for i in ca], [recs_b[j] for j in cb])) >= 1
    assert seen == {g for g, (ca, cb) in enumerate(groups) if not measured_big(ca, cb)}
    assert len(seen) < len(groups)
