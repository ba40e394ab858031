"""A table's CSV text, column by column: what ``DataFrame.to_csv(index=False)`` writes, read back as
the same values, in a fraction of its time.

pandas formats each float by itself (numpy's ``str``, about 1 µs a value): compare's table of a
long run holds tens of millions of them, and writing ``compare.csv`` took longer than comparing.
Here each run of adjacent columns of one numeric dtype is written by one ``orjson`` call as a 2-D
array (the shortest text that reads back as the same number, ``1e-5`` where numpy writes
``1e-05``), whose rows are already their cells joined; text columns are quoted once per distinct
value.  Empty cells stand for nan and missing values, ``inf``/``-inf`` for infinities, as pandas
writes them; quoting is the ``csv`` module's minimal quoting."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pandas as pd

_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_QUOTE_IF = ('"', ",", "\n", "\r")


def csv_text(frame: pd.DataFrame, header: bool = True) -> str:
    """``frame``'s rows (and its column names first, with ``header``) as CSV text, each line ending
    in a newline."""
    return "".join(csv_pieces(frame, header))


def csv_pieces(frame: pd.DataFrame, header: bool = True, rows: int = 4096):
    """:func:`csv_text` in pieces of at most ``rows`` rows, to be written one after the other: the
    cells of a few thousand rows are held at a time, not a whole table's."""
    if header:
        yield ",".join(_quoted(str(c)) for c in frame.columns) + "\n"
    runs = _runs(frame)
    for start in range(0, len(frame), rows):
        part = frame.iloc[start:start + rows]
        segments = [_block(part, cols) if numeric else _cells(part.iloc[:, cols[0]]) for numeric, cols in runs]
        if not segments:       # no columns: pandas writes an empty line per row
            yield "\n" * len(part)
        else:
            yield "\n".join(map(",".join, zip(*segments))) + "\n"


def _runs(frame: pd.DataFrame) -> list:
    """``(numeric, column positions)``: adjacent columns of one float or integer numpy dtype as one
    run, every other column a run of its own."""
    runs: list = []
    last = None
    for k, dtype in enumerate(frame.dtypes):
        key = dtype if isinstance(dtype, np.dtype) and dtype.kind in "fiu" and dtype.itemsize in (4, 8) else None
        if key is not None and last is not None and key == last:   # (numpy reads a None dtype as float64)
            runs[-1][1].append(k)
        else:
            runs.append((key is not None, [k]))
        last = key
    return runs


def _block(frame: pd.DataFrame, cols: list) -> list:
    """One string per row: the cells of numeric columns ``cols`` (one dtype) joined by commas."""
    values = np.ascontiguousarray(frame.iloc[:, cols].to_numpy())
    if values.ndim == 1:
        values = values.reshape(-1, 1)
    rows = orjson.dumps(values, option=_NUMPY).decode()[2:-2].split("],[")
    if values.dtype.kind == "f" and not np.isfinite(values).all():   # orjson writes both nan and inf as null
        infinite = np.isinf(values)
        for i in np.flatnonzero(infinite.any(axis=1)).tolist():
            rows[i] = ",".join(_float_cell(v) for v in values[i].tolist())
        rows = [r.replace("null", "") if "null" in r else r for r in rows]
    return rows


def _float_cell(v: float) -> str:
    if v != v:
        return ""
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return orjson.dumps(v).decode()


def _cells(col: pd.Series) -> list:
    """A column's cells as text: booleans ``True``/``False``, missing values empty, anything else its
    ``str`` (quoted where it holds a comma, a quote or a line break), each distinct value made once."""
    values = col.to_numpy()
    if values.dtype == bool:
        return np.where(values, "True", "False").tolist()
    made: dict = {}
    out = []
    append = out.append
    for v in values.tolist() if isinstance(values, np.ndarray) else list(values):
        key = v if type(v) is str else (type(v), v)     # True and 1 are equal keys, not equal cells
        try:
            text = made[key]
        except KeyError:
            text = made[key] = _text(v)
        except TypeError:      # unhashable (a list)
            text = _text(v)
        append(text)
    return out


def _text(v) -> str:
    if v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float) and v != v):
        return ""
    return _quoted(str(v))


def _quoted(s: str) -> str:
    return '"' + s.replace('"', '""') + '"' if any(c in s for c in _QUOTE_IF) else s
