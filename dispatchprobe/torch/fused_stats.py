"""The CPU statistics of many tensors in one native call: a small library of reductions over raw
memory (``csrc/tree_stats.cpp``: addresses, sizes, strides and dtype codes in, numbers out; no
torch headers, no Python objects), loaded with ctypes.  For float32 and bfloat16 values it reads
each tensor once where torch needs three reductions, summing in ``statistics.tree_sums``' order;
for integers and bools it sums exactly in double.  Records are made from its numbers in Python,
by ``standards/statistics`` (the one record encoder is ``records.writer.json_line``).

It is built once, by ``dispatchprobe build-native`` (a C++ compiler: ``$CXX``, else ``c++``), into
``DISPATCHPROBE_NATIVE_DIR`` (by default ``~/.cache/dispatchprobe/native``), named by its source,
compiler and platform: no torch headers, so a new torch needs no new build.  A probe only loads a
build that is there, never builds one.  A failed build is remembered beside it, with the
compiler's reason, until the next ``build-native``.  Without the library (not built, failed, or
``DISPATCHPROBE_FUSED_STATS=0``) the statistics use torch's operations in the same summation order:
the same records, bit for bit, more slowly; a probe says so once per process, in one line.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import math
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import threading

import torch

SOURCE = pathlib.Path(__file__).with_name("csrc") / "tree_stats.cpp"
ABI = 1                          # dp_tree_stats_abi() of the library this module reads
_ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
              "avx2": ["-mavx2", "-mfma"], "generic": []}
# no fused multiply-adds: a square is rounded before it is added, as the Python path does
_FLOAT_FLAGS = ["-ffp-contract=off", "-fno-fast-math"]

# A row of the library (ROW numbers per tensor): KIND, then max, min, sum, sum of squares, and for
# values holding inf or nan (or whose float32 sums overflowed) their nan and inf counts, max and
# min without nan, finite max and min.
ROW = 11
DECLINED, FINITE, NONFINITE, OVERFLOWED = 0, 1, 2, 3
_ZERO_ROW = array.array("d", bytes(8 * ROW))
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int64: 2, torch.int32: 3, torch.int16: 4, torch.int8: 5,
               torch.uint8: 6, torch.bool: 7}

_lock = threading.Lock()
_loaded = False
_native = None            # the library's dp_tree_stats, once loaded
_grad = None              # the library's dp_grad_stats, once loaded
tree_rows = None          # rows(tensors) -> the library's rows of CPU tensors (see rows), or None
rows_into = None          # a compiled graph's window of CPU values -> their stats rows (see window_rows), or None
row_lists = None          # the same rows as Python lists (see window_row_lists), or None
stats4 = None             # one float32/bfloat16 CPU tensor -> [max, min, sum, sum of squares] (see sums4), or None
grad_rows = None          # the grad probe's one read of contiguous CPU gradients (see grad_pass), or None
error: str | None = None  # why the library is not used


def enabled() -> bool:
    return os.environ.get("DISPATCHPROBE_FUSED_STATS", "1").lower() not in ("0", "false", "no", "off")


def rows(tensors) -> array.array:
    """The library's rows (:data:`ROW` numbers each, one after another) of CPU tensors whose dtype
    is in :data:`DTYPE_CODES`, in one call: each tensor read where it lies (its data pointer,
    sizes and strides).  A row's kind is DECLINED where the library does not read the tensor
    (empty, no dimension of stride 1 for floats, integers whose sums would not be exact)."""
    desc: list = []
    for t in tensors:
        shape = t.shape
        desc += (t.data_ptr(), DTYPE_CODES[t.dtype], len(shape), *shape, *t.stride())
    return described_rows(desc, len(tensors))


def described_rows(desc: list, count: int) -> array.array:
    """:func:`rows` of ``count`` tensors whose facts the caller has read already: ``desc`` holds
    each one's data pointer, dtype code, number of dimensions, sizes and strides, one after another."""
    described = array.array("q", desc)          # held here while the library reads it
    out = _ZERO_ROW * count
    _native(count, described.buffer_info()[0], out.buffer_info()[0])   # ctypes releases the GIL
    return out


def sums4(t: torch.Tensor) -> list:
    """[max, min, sum, sum of squares] of one float32 or bfloat16 CPU tensor (the sums inf or nan
    where its values hold inf or nan), or [] where the library does not read it in place."""
    r = rows([t])
    return [] if r[0] == DECLINED else list(r[1:5])


def grad_pass(tensors, bounds, checksum: bool, signs: bool) -> list:
    """The grad probe's measures of contiguous float32 or bfloat16 CPU tensors, each read once from
    memory (max, min and sum of squares as :func:`sums4` gives them; the other measures of each
    chunk while it is in cache).  Per tensor ``(row, s0, s1, bits)``: ``row`` is [kind (FINITE, or
    OVERFLOWED where the sum of squares is inf or nan), max, min, sum of squares, count == 0,
    count <= each of ``bounds`` (compared in float32, as numpy and torch compare a float32 array
    with a Python float)]; ``s0``, ``s1`` the L0 checksum's sums of its bytes (0 without
    ``checksum``); ``bits`` its signs (``> 0``) packed as ``np.packbits`` packs them, or None."""
    import numpy as np
    width = 5 + len(bounds)
    desc = array.array("q")
    packed = []
    for t in tensors:
        n = t.numel()
        bits = np.empty((n + 7) // 8, np.uint8) if signs else None
        packed.append(bits)
        desc.extend((t.data_ptr(), DTYPE_CODES[t.dtype], n, bits.ctypes.data if signs else 0))
    out = array.array("d", bytes(8 * width * len(tensors)))
    sums = array.array("Q", bytes(16 * len(tensors)))
    low = array.array("f", bounds or [0.0])          # rounded to float32 as numpy rounds them
    _grad(len(tensors), desc.buffer_info()[0], len(bounds), low.buffer_info()[0], int(checksum),
          out.buffer_info()[0], sums.buffer_info()[0])   # ctypes releases the GIL
    return [(out[i * width:(i + 1) * width], sums[2 * i], sums[2 * i + 1], packed[i]) for i in range(len(tensors))]


def window_rows(values: list, out: torch.Tensor, nonfinite_row) -> list[int]:
    """A compiled graph's window of CPU values: the device stats row of each, [max, min, sum, L2
    norm, nan count, inf count], into row i of ``out`` (float64, (len, 6)), as
    :func:`window_row_lists` gives them.  Returns the indexes of the values it leaves to the
    Python path, whose rows are left untouched."""
    if out.dtype != torch.float64 or not out.is_contiguous() or out.dim() != 2 or tuple(out.shape) != (len(values), 6):
        raise RuntimeError("rows_into: a contiguous float64 (len, 6) tensor")
    rows, left = window_row_lists(values, nonfinite_row)
    done = [i for i, row in enumerate(rows) if row is not None]
    if done:
        out[done] = torch.tensor([rows[i] for i in done], dtype=torch.float64)
    return left


def window_row_lists(values: list, nonfinite_row) -> tuple[list, list[int]]:
    """A compiled graph's window of CPU values (compile/runtime.py), in one call: the device stats
    row of each as a list of floats, for plain tensors the library reads (float32/bfloat16,
    integers and bools with exact sums); values holding inf or nan get their row from
    ``nonfinite_row`` (``statistics.nonfinite_row``).  Returns (the rows, None for the values it
    leaves to the Python path: other dtypes, layouts not read in place, finite values whose
    float32 sums overflowed, subclasses, freed memory, ...; those values' indexes).  The rows
    stay Python numbers: a window's caller makes one tensor of them."""
    out: list = [None] * len(values)
    desc: list = []
    taken: list[int] = []
    left: list[int] = []
    for i, t in enumerate(values):
        described = _in_memory_desc(t)
        if described is None:
            left.append(i)
        else:
            desc += described
            taken.append(i)
    got = described_rows(desc, len(taken)).tolist() if taken else []
    sqrt = math.sqrt
    for k, i in enumerate(taken):
        at = k * ROW
        kind = got[at]
        if kind == FINITE:
            out[i] = [got[at + 1], got[at + 2], got[at + 3], sqrt(got[at + 4]), 0.0, 0.0]
        elif kind == NONFINITE:
            r = got[at:at + ROW]
            out[i] = [float(v) for v in nonfinite_row(r[3], r[4], int(r[5]), int(r[6]), r[7], r[8], r[9], r[10])]
        else:
            left.append(i)
    return out, sorted(left)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _in_memory_desc(t) -> tuple | None:
    """What :func:`described_rows` reads of ``t`` (data pointer, dtype code, ndim, sizes, strides)
    where it is a plain CPU tensor or parameter of a dtype the library reads, whose every element
    lies in its storage's allocated bytes (not a storage freed to size 0 between uses, as FSDP2
    does); else None.  Each fact is read once: a compiled window calls this for every value."""
    if type(t) not in _PLAIN:
        return None
    code = DTYPE_CODES.get(t.dtype)
    if code is None or t.layout != torch.strided or not t.is_cpu:
        return None
    shape = t.shape
    try:
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base == 0:
            return None
        ptr = t.data_ptr()                       # the storage offset's bytes are ptr - base
        if t.is_contiguous():
            size = t.nbytes
            if size == 0 or ptr - base + size > storage.nbytes():
                return None
            stride = t.stride()
        else:
            stride = t.stride()
            if 0 in shape or min(stride, default=0) < 0:
                return None
            last = sum((k - 1) * s for k, s in zip(shape, stride))
            if ptr - base + (last + 1) * t.element_size() > storage.nbytes():
                return None
    except (RuntimeError, NotImplementedError):
        return None
    return (ptr, code, len(shape), *shape, *stride)


def load():
    """The library's :func:`rows`, loaded once per process where a build of it is there (a probe
    calls this when it starts: every record of the process then comes from one path), or None,
    saying once why."""
    global _loaded
    with _lock:
        if _loaded:
            return tree_rows
        _loaded = True
        if not enabled():
            _unused("the native statistics are turned off (DISPATCHPROBE_FUSED_STATS=0)", say=False)
            return None
        try:
            path = library_path()
            failed = path.with_suffix(".failed")
            built = _built()
            if built is not None:
                _open(built)
            elif failed.exists():
                _unused(f"the native statistics' build failed ({failed.read_text().strip()}); "
                        "`dispatchprobe build-native` tries again")
            else:
                _unused("the native statistics are not built; `dispatchprobe build-native` builds them once")
        except Exception as exc:       # a damaged build, a read-only cache, ...
            _unused(f"the native statistics did not load ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''})")
    return tree_rows


def _unused(why: str, say: bool = True) -> None:
    global error
    error = why
    if say:
        print(f"dispatchprobe: CPU statistics use torch's operations (the same records, more slowly): {why}",
              file=sys.stderr)


def _open(path: pathlib.Path) -> None:
    global _native, tree_rows, rows_into, row_lists, stats4, _grad, grad_rows
    lib = ctypes.CDLL(str(path))
    lib.dp_tree_stats_abi.restype = ctypes.c_int64
    if lib.dp_tree_stats_abi() != ABI:
        raise RuntimeError(f"{path.name} speaks interface {lib.dp_tree_stats_abi()}, not {ABI}")
    fn = lib.dp_tree_stats
    fn.argtypes = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = None
    grad = lib.dp_grad_stats
    grad.argtypes = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_void_p)
    grad.restype = None
    _native, tree_rows, rows_into, row_lists, stats4, _grad, grad_rows = fn, rows, window_rows, window_row_lists, sums4, \
        grad, grad_pass


def build_native() -> str | None:
    """Build the library for this source, compiler and platform unless it is built, and load it;
    a failure is remembered beside the build with the compiler's reason.  Returns None when the
    library is loaded, else the reason it is not."""
    global _loaded
    path = library_path()
    failed = path.with_suffix(".failed")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        reason = _compile(path)
        if reason is not None:
            failed.write_text(reason + "\n")
            return reason
    failed.unlink(missing_ok=True)
    with _lock:
        _loaded = False
    load()
    return None if tree_rows is not None else error


def _compile(path: pathlib.Path) -> str | None:
    """Compile into a file of this process's own and move it into place whole (a build that is
    stopped leaves nothing half-written); with OpenMP where the compiler has it (torch's CPU
    runtime is libgomp: the threads are torch's), else without.  None, or why it failed."""
    part = path.with_suffix(f".{os.getpid()}.part")
    base = [*_compiler(), "-O3", "-std=c++17", "-shared", "-fPIC", *_ISA_FLAGS[_isa()], *_FLOAT_FLAGS,
            str(SOURCE), "-o", str(part)]
    reason = None
    for extra in (["-fopenmp"], []):
        try:
            done = subprocess.run(base[:1] + extra + base[1:], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{base[0]}: {type(exc).__name__}: {exc}"[:300]
        if done.returncode == 0 and part.exists():
            os.replace(part, path)
            return None
        reason = _why(done.stderr or done.stdout) or f"{base[0]} exited with {done.returncode}"
    part.unlink(missing_ok=True)
    return reason


def _why(output: str) -> str:
    """The line of a failed build's output that says why: the compiler's first error, else the
    last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    cause = next((line for line in lines if re.search(r"\berror\b:|not found|No such file|fatal", line)), None)
    return (cause or (lines[-1] if lines else ""))[:300]


def _compiler() -> list[str]:
    """The C++ compiler's command: ``$CXX`` (which may carry flags), else ``c++``, ``g++`` or ``clang++``."""
    named = os.environ.get("CXX", "").split()
    if named:
        return named
    found = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), "c++")
    return [found]


def _isa() -> str:
    """The vector instructions the build uses, as this CPU has them (Linux reads /proc/cpuinfo;
    elsewhere none beyond the platform's baseline).  The sums do not depend on them."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "generic"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"} <= set(flags):
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= set(flags) else "generic"


def native_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DISPATCHPROBE_NATIVE_DIR") or pathlib.Path.home() / ".cache" / "dispatchprobe" / "native")


def library_path() -> pathlib.Path:
    """Where the build for this source, compiler and platform is (or goes): named by them, so a
    cache shared by other machines or compilers keeps one build each."""
    compiler = _compiler()
    resolved = os.path.realpath(shutil.which(compiler[0]) or compiler[0])
    by_compiler = hashlib.sha1("\0".join([resolved, *compiler[1:]]).encode()).hexdigest()[:8]
    return native_dir() / f"{_build_stem()}_{by_compiler}.so"


def _build_stem() -> str:
    """The name every build of this source for this platform starts with."""
    isa = _isa()
    key = "\0".join([SOURCE.read_text(), sys.platform, platform.machine(), isa, " ".join(_FLOAT_FLAGS)])
    return f"dispatchprobe_tree_stats_{isa}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def _built() -> pathlib.Path | None:
    """The build a probe loads: the one for this compiler, else one another compiler made of this
    source for this platform (built with ``CXX=clang++``, trained without ``CXX``), else None."""
    path = library_path()
    if path.exists():
        return path
    return next(iter(sorted(path.parent.glob(f"{_build_stem()}_*.so"))), None)
