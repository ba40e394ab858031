"""The grad probe (task ``grad_probe``): each parameter's gradient, read when its optimizer steps.

Framework-neutral: which parameters ``param_list`` selects, the statistics of a gradient (written
once against an array namespace ``xp``: numpy or torch, invariant 2), the step bookkeeping and the
records (``grads.jsonl`` and the packed sign bits, docs/grad-probe.md).  An adapter reads the
gradients (:mod:`dispatchprobe.torch.grad_probe`, ``dispatchprobe_ms.grad_probe``), reduces the
statistics of sharded ones over their ranks, and hands :class:`GradHandler` one entry per parameter.

Levels as msprobe's: L0 max, min, norm, shape and a checksum of the gradient's bytes (by default
the position-weighted sums of :func:`checksum_of`, computed where the gradient lives; msprobe's
MD5 when the config asks for checksums, ``checksum=True`` / ``summary_mode: md5``); L1 the same
(no checksum) and the sign of each element (``grad > 0``); L2 also the share of elements in each
interval of ``bounds`` (lower end open, upper closed: ``(-inf, b0], (b0, b1], ..., (bn, inf)``) and
the share exactly zero.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import threading
import warnings

import numpy as np

from ..records.writer import WriteFailed, JsonLines, write_safetensors
from .events import Handler


def has_signs(level: str) -> bool:
    return level in ("L1", "L2")


def interval_labels(bounds) -> list[str]:
    """msprobe's column names of the intervals ``bounds`` cut: ``(-inf, -1]``, ..., ``(1, inf)``."""
    ends = ["-inf", *bounds]
    return ["(%s, %s]" % (a, b) for a, b in zip(ends, bounds)] + ["(%s, inf)" % bounds[-1]]


class ParamSelector:
    """Which parameters ``param_list`` selects: an entry selects a name it equals, a name it is a
    dotted prefix of (``layers.1`` selects ``layers.1.mlp.weight``, not ``layers.10.bias``), or
    a name it matches whole as a regex (``.*\\.bias``).  Empty: every parameter."""

    def __init__(self, entries: list[str]):
        self.entries = list(entries)
        self._patterns = [re.compile(e) for e in entries]     # the config checked them
        self._memo: dict[str, bool] = {}
        self.hits = 0

    def __call__(self, name: str) -> bool:
        hit = self._memo.get(name)
        if hit is None:
            hit = self._memo[name] = not self.entries or any(
                name == e or name.startswith(e + ".") or p.fullmatch(name) for e, p in zip(self.entries, self._patterns))
        self.hits += hit
        return hit


def measures(x, xp, level: str, bounds, base=None) -> list:
    """The reducible measures of a gradient (or a shard of one) ``x``, as 0-d ``xp`` arrays or floats:
    ``[max, min, sum of squares]``, and at L2 ``[elements in each interval..., elements == 0]``.
    max/min reduce by max/min over shards, the rest by sum.  ``base``: [max, min, sum of squares]
    already computed (a backend's one-pass kernel; ``[]``: only the L2 counts are wanted).

    An interval's count is a difference of ``count(x <= b)`` (one comparison per bound, no sort):
    ``(b_i-1, b_i]`` as msprobe's ``torch.bucketize``; nan falls in the last interval, as there."""
    flat = x.reshape(-1)
    n = flat.shape[0]
    if n == 0:                                          # an empty shard (uneven FSDP2 sharding)
        return [-math.inf, math.inf, 0.0] + ([0.0] * (len(bounds) + 2) if level == "L2" else [])
    if flat.dtype != xp.float32 and flat.dtype != xp.float64:
        flat = xp.asarray(flat, dtype=xp.float32)       # half floats (msprobe widens bf16 too), ints
    out = list(base) if base is not None else [flat.max(), flat.min(), xp.dot(flat, flat)]
    if level == "L2":
        if xp is np:
            below, zero = _counts_in_chunks(flat, bounds)
        else:
            below = [xp.count_nonzero(flat <= b) for b in bounds]      # elements <= each bound
            zero = xp.count_nonzero(flat == 0)
        out += [below[0]] + [hi - lo for lo, hi in zip(below, below[1:])] + [n - below[-1]]
        out.append(zero)
    return out


def _counts_in_chunks(flat: np.ndarray, bounds) -> tuple[list[int], int]:
    """``[count(flat <= b) for b in bounds]`` and ``count(flat == 0)``, each chunk compared with every
    bound while it is in cache (one read of the gradient from memory)."""
    below, zero = [0] * len(bounds), 0
    mask = np.empty(min(flat.shape[0], _COUNT_CHUNK), bool)
    for start in range(0, flat.shape[0], _COUNT_CHUNK):
        chunk = flat[start:start + _COUNT_CHUNK]
        m = mask[:chunk.shape[0]]
        for i, b in enumerate(bounds):
            np.less_equal(chunk, b, out=m)
            below[i] += int(np.count_nonzero(m))
        np.equal(chunk, 0, out=m)
        zero += int(np.count_nonzero(m))
    return below, zero


#: The kind of checksum :func:`checksum_of` computes (a record's ``checksum.kind``).
CHECKSUM_KIND = "wsum64"
#: Words per row when the weighted sum is taken as row and column sums (any width gives the same
#: sums; 512 was the fastest in numpy here: 8.5 ms for 134 MB of gradients, 24 ms at 4096).
CHECKSUM_ROW = 512
#: Elements per chunk of the L2 counts in numpy: the comparisons of all bounds read a chunk while it
#: is in cache (134 MB of gradients, three bounds and zero: 33 ms against 42 ms in whole passes).
_COUNT_CHUNK = 1 << 18


def checksum_of(data: np.ndarray) -> str:
    """The gradient's bytes (C order) as little-endian 64-bit words ``w_0 .. w_n-1`` (the last one
    zero-padded): ``S0 = sum(w_i)`` and ``S1 = sum((i + 1) * w_i)``, both modulo 2**64, as 32 hex
    digits.  Integer sums do not depend on the order they are added in, so every device and
    framework gives the same digits for the same bytes; ``S1`` is taken as row and column sums of
    the words laid out in rows (two vectorised reductions, no weight array).  The torch adapter
    computes the same on the gradient's device (``dispatchprobe.torch.grad_probe``)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    full = raw.size // 8 * 8
    words = raw[:full].view(np.uint64)
    if full < raw.size:                                 # the last word, zero-padded
        last = np.zeros(8, np.uint8)
        last[:raw.size - full] = raw[full:]
        words = np.concatenate([words, last.view(np.uint64)])
    n = words.size
    rows = n // CHECKSUM_ROW
    block = words[:rows * CHECKSUM_ROW].reshape(rows, CHECKSUM_ROW)
    tail = words[rows * CHECKSUM_ROW:]
    row_sums, col_sums = block.sum(1, dtype=np.uint64), block.sum(0, dtype=np.uint64)
    index = np.arange(rows, dtype=np.uint64)
    cols = np.arange(1, CHECKSUM_ROW + 1, dtype=np.uint64)
    tail_w = np.arange(rows * CHECKSUM_ROW + 1, n + 1, dtype=np.uint64)
    s0 = int(row_sums.sum(dtype=np.uint64)) + int(tail.sum(dtype=np.uint64))      # arrays wrap; ints: mod 2**64
    s1 = CHECKSUM_ROW * int((index * row_sums).sum(dtype=np.uint64)) + int((cols * col_sums).sum(dtype=np.uint64)) \
        + int((tail_w * tail).sum(dtype=np.uint64))
    return checksum_hex(int(s0), int(s1))


def checksum_hex(s0: int, s1: int) -> str:
    """``S0`` and ``S1`` (any integers: taken modulo 2**64) as the record's 32 hex digits."""
    return f"{s0 % 2 ** 64:016x}{s1 % 2 ** 64:016x}"


def md5_of(x: np.ndarray) -> str:
    """msprobe's MD5 column: the digest of the gradient's float32 bytes (C order)."""
    return hashlib.md5(np.ascontiguousarray(x, dtype=np.float32).tobytes()).hexdigest()


def pack_signs(x: np.ndarray) -> np.ndarray:
    """``x > 0`` packed 8 elements to a byte, first element in the highest bit (``np.packbits``)."""
    return np.packbits(np.greater(np.asarray(x).reshape(-1), 0))


def grad_record(name: str, *, dtype: str, shape, values, level: str, bounds, source: str = "grad") -> dict:
    """One ``grads.jsonl`` line from the whole gradient's measures (host floats, as :func:`measures`
    orders them, reduced over shards); the adapter adds ``md5``, ``sign`` and ``dtensor``."""
    numel = math.prod(shape)
    hi, lo, sumsq = (float(v) for v in values[:3])
    rec = {"param": name, "dtype": dtype, "shape": list(shape), "numel": numel, "source": source,
           "stats": {"max": hi, "min": lo, "norm": math.sqrt(sumsq) if sumsq >= 0 else float("nan")}}
    if level == "L2":
        counts = [float(v) for v in values[3:]]
        rec["distribution"] = {"bounds": list(bounds), "intervals": interval_labels(bounds),
                               "shares": [c / numel if numel else 0.0 for c in counts[:-1]],
                               "zero": counts[-1] / numel if numel else 0.0}
    return rec


class GradHandler(Handler):
    """The task's handler: no op reaches it; the adapter calls :meth:`begin` when an optimizer is
    about to step and :meth:`write` with the records of that optimizer's parameters."""

    def __init__(self, session, recorder):
        self.session = session
        cfg = session.config.grad_probe
        self.level, self.bounds = cfg.grad_level, list(cfg.bounds)
        self.md5 = session.config.checksum      # L0: msprobe's MD5 (checksum=True, summary_mode md5), on the host
        self.select = ParamSelector(cfg.param_list)
        self._lines = self._index = None
        self._keys = self._shards = 0
        self._writer: threading.Thread | None = None      # the last step's files, being written
        self._failures: list[Exception] = []       # what stopped the writer, raised at the next wait
        self.steps_seen = 0             # optimizer steps of the model's parameters

    def begin(self, optimizer) -> tuple[bool, bool]:
        """An optimizer is about to step: the step the last optimizer step left pending ends here
        (while steps follow the optimizer).  Returns (this step is selected, this rank writes)."""
        s = self.session
        self.steps_seen += 1
        if s.follows_optimizer and s.step_pending:
            first = s._stepping_optimizer() if s._stepping_optimizer is not None else None
            if first is None or first is optimizer:
                s._end_pending_step()
        cfg = s.config
        step_on = not cfg.step or s.step_no in cfg.step
        here = step_on and (not cfg.rank or s.rank in cfg.rank) and not s.failed
        if here and s.part is None:
            with s.writing():
                s._open_part()
        return step_on, here and s.part is not None

    def write(self, items: list) -> None:
        """Append the records of one optimizer step's parameters: ``items`` of (record, packed sign
        bits or None).  The files are written off the training thread, one step at a time in step
        order (a step waits for the last one's files first; a part's end and the probe's close wait
        for all): the sign bits first into one safetensors shard of their own (temp file + rename,
        then listed in ``tensors/index.jsonl``), then the records that name them, so a killed
        process leaves no record whose bits are missing.  A write that fails stops the recording at
        the next step, the part's end or close (``session.writing``)."""
        if not items:
            return
        with self.session.writing():
            self._wait()
            folder = self.session.part.folder
            if self._lines is None:
                self._lines = JsonLines(os.path.join(folder, "grads.jsonl"))
                self._index = JsonLines(os.path.join(folder, "tensors", "index.jsonl"))
            arrays = {}
            for record, signs in items:
                if signs is not None:
                    record["sign"] = key = f"g{self._keys}"
                    self._keys += 1
                    arrays[key] = signs
            shard = None
            if arrays:
                shard = f"shard_{self._shards:05d}.safetensors"
                self._shards += 1
            args = (folder, shard, arrays, [record for record, _ in items], self._lines, self._index, self._failures)
            # a function, not a method: the thread holds no reference to the probe, which a user who
            # drops it may have collected while the step's files are still being written
            self._writer = threading.Thread(target=_write_step_files, args=args, name="dispatchprobe-grad-writer")
            self._writer.start()        # not a daemon: an interpreter that exits finishes the step's files

    def _wait(self) -> None:
        """The last step's files are written (raises what stopped them: an OSError stops the recording)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failures:
            raise self._failures.pop()

    # -- handler ------------------------------------------------------------------------------
    def start_part(self) -> None:
        self._keys = self._shards = 0

    def flush(self) -> None:
        with self.session.writing():
            self._wait()

    def boundary(self) -> None:
        """The part closes: its files are written and closed."""
        try:
            with self.session.writing():
                self._wait()
        finally:
            if self._lines is not None:
                self._lines.close()
                self._index.close()
                self._lines = self._index = None

    def close(self) -> None:
        with self.session.writing():
            self._wait()
        cfg = self.session.config
        if not self.steps_seen and not cfg.step and not self.session.failed \
                and (not cfg.rank or self.session.rank in cfg.rank):
            warnings.warn("dispatchprobe: the grad probe saw no optimizer step of the model's parameters: build it "
                          "with the model (torch) or optimizer (MindSpore) that training steps, before training",
                          RuntimeWarning, stacklevel=4)
        seen = bool(self.select._memo)       # some parameter was asked about
        if seen and self.select.entries and not self.select.hits and (not cfg.rank or self.session.rank in cfg.rank):
            warnings.warn(f"dispatchprobe: param_list={self.select.entries} selected no parameter; entries are "
                          "parameter names as model.named_parameters() gives them (without 'module.'), dotted "
                          "prefixes of them ('layers.1') or regexes matching whole names", RuntimeWarning,
                          stacklevel=4)


def read_signs(part, record: dict) -> np.ndarray:
    """A record's sign bits as a bool array of the local gradient's shape (offline readers)."""
    local = (record.get("dtensor") or {}).get("local_shape", record["shape"])
    n = math.prod(local)
    return np.unpackbits(part.tensor(record["sign"]), count=n).astype(bool).reshape(local)


def _write_step_files(folder: str, shard, arrays: dict, records: list, lines, index, failures: list) -> None:
    """One optimizer step's files, in the writer thread: the sign-bit shard (temp file + rename),
    its index line, then the records that name it.  What stops it goes to ``failures``, raised on
    the training thread at its next wait, as it was raised there."""
    try:
        if shard is not None:
            os.makedirs(os.path.join(folder, "tensors"), exist_ok=True)
            path = os.path.join(folder, "tensors", shard)
            try:
                write_safetensors({k: ("U8", [a.size], memoryview(a)) for k, a in arrays.items()}, path + ".tmp")
                os.replace(path + ".tmp", path)
            except OSError as exc:
                raise WriteFailed(f"{exc.strerror or exc} writing {path}") from None
            index.append({"shard": shard, "keys": list(arrays)})
        lines.extend(records)
    except Exception as exc:        # noqa: BLE001 - raised on the training thread at the next wait
        failures.append(exc)
