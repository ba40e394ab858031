"""compare.csv and the other reports' CSV files: the fast writer reads back as what pandas writes."""

import io
import math

import numpy as np
import pandas as pd
import pytest

from dispatchprobe.offline.frame_csv import csv_pieces, csv_text


def _table(n: int = 257) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    floats = rng.standard_normal(n) * 10.0 ** rng.integers(-12, 12, n)
    floats[::7] = np.nan
    floats[3::11] = np.inf
    floats[5::13] = -np.inf
    floats[1] = -0.0
    words = np.array(['pass', 'with, comma', 'a "quoted" word', 'two\nlines', '', None, 'a | b'], dtype=object)
    return pd.DataFrame({
        "step": np.arange(n, dtype=np.int64),
        "rank": np.zeros(n, np.int64),
        "name": words[np.arange(n) % len(words)],
        "shape": pd.Series([(4, 4) if i % 2 else () for i in range(n)], dtype=object),
        "max_a": floats,
        "max_b": floats[::-1].copy(),
        "f32": (floats * 0.5).astype(np.float32),
        "u8": np.arange(n, dtype=np.int64) % 256,
        "all_nan": np.full(n, np.nan),
        "origin": np.arange(n) % 3 == 0,
        "reason": pd.Series(words[(np.arange(n) + 3) % len(words)]).astype("string"),
        "mixed": pd.Series([1, 2.5, None, "x", True] * (n // 5) + [None] * (n % 5), dtype=object),
    })


def _read(text: str, **kw) -> pd.DataFrame:
    return pd.read_csv(io.StringIO(text), **kw)


@pytest.mark.parametrize("rows", [0, 1, 257])
def test_reads_back_as_pandas_writes(rows):
    table = _table(257).iloc[:rows].reset_index(drop=True)
    ours, theirs = csv_text(table), table.to_csv(index=False)
    assert ours.count("\n") == theirs.count("\n")
    # every value the same once parsed (floats bit for bit, nan where pandas leaves the cell empty)
    pd.testing.assert_frame_equal(_read(ours), _read(theirs))
    # every cell that is not a float written exactly as pandas writes it
    as_text = dict(dtype=str, keep_default_na=False)
    a, b = _read(ours, **as_text), _read(theirs, **as_text)
    floats = [c for c in table.columns if table[c].dtype.kind == "f"]
    pd.testing.assert_frame_equal(a.drop(columns=floats), b.drop(columns=floats))
    for c in floats:    # nan empty, infinities spelled as pandas spells them
        assert [x for x in a[c] if not _finite(x)] == [x for x in b[c] if not _finite(x)]


def _finite(cell: str) -> bool:
    return cell != "" and math.isfinite(float(cell))


def test_header_only_no_header_and_pieces():
    table = _table(5)
    assert "".join(csv_pieces(_table(), rows=10)) == csv_text(_table())
    assert csv_text(table.iloc[:0]) == table.iloc[:0].to_csv(index=False)
    assert csv_text(table, header=False) == csv_text(table).split("\n", 1)[1]


def test_report_files_read_back(tmp_path):
    """compare's reports through the writer: compare.csv holds every row, the values intact."""
    from dispatchprobe.offline.report import ReportWriter
    table = _table(40)
    w = ReportWriter(str(tmp_path))
    w._append(table.iloc[:25])
    w._append(table.iloc[25:])
    w._file.close()
    back = pd.read_csv(str(tmp_path / "compare.csv.tmp"))
    pd.testing.assert_frame_equal(back, _read(table.to_csv(index=False)))
