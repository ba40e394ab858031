"""compare's table columns, derived from the metric registry (documented in docs/compare.md)."""

from __future__ import annotations

from typing import NamedTuple

from ...standards import metrics as M, statistics as S, verdicts as V

STATS = S.KEYS
# the metrics compare shows (registry order; rel_l2_err also holds a binary row's mismatch rate)
TENSOR_METRICS = M.derived(M.compare_columns)
# CSV columns, in order (documented in docs/compare.md); stats_err and error are compare's own
COLUMNS = M.derived(lambda: ["step", "rank", "stage", "kind", "seq", "seq_b", "scope", "op_a", "op_b", "name_a", "name_b",
                             "call_a", "call_b", "match", "io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b"]
                    + [f"{s}_{side}" for s in STATS for side in ("a", "b")] + ["nan_a", "nan_b", "inf_a", "inf_b"]
                    + [f"{s}_diff" for s in STATS] + [f"{s}_rel_diff" for s in STATS] + ["checksum_match"]
                    + M.compare_columns() + ["stats_err", "error", "status", "reason", "origin", "stack"])
UNMATCHED_COLUMNS = ["step", "rank", "side", "stage", "kind", "seq", "scope", "op", "name", "call", "is_cast"]
# the metrics compare computes: its columns and what its verdicts read; and their values on equal tensors
COMPUTED = M.derived(lambda: set(M.compare_columns()) | set(V.COMPARE_READS))
PERFECT = M.derived(lambda: {m: M.METRICS[m].perfect for m in COMPUTED})


class TensorRow(NamedTuple):
    """One paired tensor's fields, the table's column order: ``compare_parts`` collects them as two
    plain tuples, its pair's (``HEAD_FIELDS``, once per pair) and its own (``TENSOR_FIELDS``), in
    this order (the hot loop of a 100k-op compare; a keyword-built record costs it seconds); read
    by name once they are table columns."""

    stage: object   # the paired records': forward/backward
    kind: object
    seq: object     # the place of A's record in its stage
    seq_b: object   # the place of B's paired record in its stage
    scope: object
    op_a: object
    op_b: object
    name_a: object
    name_b: object
    call_a: object
    call_b: object
    match: object   # how it paired (align)
    io: object   # the tensor's: input/output
    arg: object   # input.0, output.1.2
    dtype_a: object
    dtype_b: object
    shape_a: object
    shape_b: object
    nan_a: object
    nan_b: object
    inf_a: object
    inf_b: object
    checksum_a: object
    checksum_b: object
    data_a: object   # saved-tensor keys (None: statistics only)
    data_b: object
    stack: object   # A's last frames
    uid: object   # A's record index
    undef_a: object   # undefined contents (uninitialised memory)
    undef_b: object
    lineage_a: object   # precision rank its value carries when below its dtype's, else -1
    lineage_b: object
    spec_a: object   # id() of the specs (data flow)
    spec_b: object
    max_a: object   # statistics (``STATS`` order)
    max_b: object
    min_a: object
    min_b: object
    mean_a: object
    mean_b: object
    norm_a: object
    norm_b: object


ROW_FIELDS = TensorRow._fields
assert ROW_FIELDS[-8:] == tuple(f"{s}_{side}" for s in STATS for side in ("a", "b"))
# a pair's fields (the same for each of its tensors), and each tensor's own
HEAD_FIELDS = ROW_FIELDS[:ROW_FIELDS.index("match") + 1] + ("stack", "uid")
TENSOR_FIELDS = tuple(f for f in ROW_FIELDS if f not in HEAD_FIELDS)
FLOAT_FIELDS = frozenset(f"{s}_{side}" for s in STATS for side in ("a", "b"))
# typed columns made straight from the row tuples (pandas infers the type of a list element by element)
INT_FIELDS = frozenset(("uid", "lineage_a", "lineage_b", "spec_a", "spec_b"))
BOOL_FIELDS = frozenset(("undef_a", "undef_b"))
TEXT_FIELDS = frozenset(("stage", "kind", "scope", "op_a", "op_b", "name_a", "name_b", "match", "io", "arg",
                          "dtype_a", "dtype_b", "checksum_a", "checksum_b", "data_a", "data_b", "stack"))  # str or None
