"""compare's table columns, derived from the metric registry (documented in docs/compare.md)."""

from __future__ import annotations

from ...standards import metrics as M, statistics as S, verdicts as V

STATS = S.KEYS
# the metrics compare shows (registry order; rel_l2_err also holds a binary row's mismatch rate)
TENSOR_METRICS = M.derived(M.compare_columns)
# CSV columns, in order (documented in docs/compare.md); stats_err and error are compare's own
COLUMNS = M.derived(lambda: ["step", "rank", "stage", "kind", "seq", "scope", "op_a", "op_b", "name_a", "name_b",
                             "call_a", "call_b", "match", "io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b"]
                    + [f"{s}_{side}" for s in STATS for side in ("a", "b")] + ["nan_a", "nan_b", "inf_a", "inf_b"]
                    + [f"{s}_diff" for s in STATS] + [f"{s}_rel_diff" for s in STATS] + ["checksum_match"]
                    + M.compare_columns() + ["stats_err", "error", "status", "reason", "origin", "stack"])
UNMATCHED_COLUMNS = ["step", "rank", "side", "stage", "kind", "seq", "scope", "op", "name", "call", "is_cast"]
# the metrics compare computes: its columns and what its verdicts read; and their values on equal tensors
_COMPUTED = M.derived(lambda: set(M.compare_columns()) | set(V.COMPARE_READS))
_PERFECT = M.derived(lambda: {m: M.METRICS[m].perfect for m in _COMPUTED})
# the per-tensor row built by compare_parts, before the statistics columns
_ROW_FIELDS = ("stage", "kind", "seq", "scope", "op_a", "op_b", "name_a", "name_b", "call_a", "call_b", "match",
               "io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b", "nan_a", "nan_b", "inf_a", "inf_b",
               "checksum_a", "checksum_b", "data_a", "data_b", "stack", "uid",
               # internal: undefined contents; the precision a value carries when below its dtype's
               "undef_a", "undef_b", "lineage_a", "lineage_b", "spec_a", "spec_b")
_FLOAT_FIELDS = frozenset(f"{s}_{side}" for s in STATS for side in ("a", "b"))
