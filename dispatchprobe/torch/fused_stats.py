"""One pass over memory for the CPU statistics of a float32 or bfloat16 tensor (max, min, sum,
sum of squares), where torch needs three reductions: a small C++ kernel (``csrc/stats4.cpp``).
The same module reads the facts the per-op path records of every tensor in one call
(``describe``).

It is built once, on command (``dispatchprobe build-native``, which needs a C++ compiler and
``ninja``), for this CPU, source and torch, into ``DISPATCHPROBE_NATIVE_DIR`` (by default
``~/.cache/dispatchprobe/native``); a probe only loads a build that is there, never builds one.
A failed build is remembered beside it, with its reason, until the next ``build-native``.
Without the kernel (not built, failed, or ``DISPATCHPROBE_FUSED_STATS=0``) the statistics use
torch's operations in the same summation order (``statistics.tree_sums``): the same records,
bit for bit, more slowly; a probe says so once per process, in one line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "stats4.cpp"
_ISA_FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]}
# no fused multiply-adds: a square is rounded before it is added, as the Python path does
_FLOAT_FLAGS = ["-ffp-contract=off", "-fno-fast-math"]
_lock = threading.Lock()
_loaded = False
stats4 = None             # the kernel: float32/bfloat16 CPU tensor -> [max, min, sum, sum of squares]
extremes = None           # its second pass where those sums are not finite -> [nan, inf, max, min, finite max, finite min]
describe = None           # a plain tensor's description and cache keys in one call (backend.describe), or None
Encoder = None            # the statistics task's per-value encoding (backend.value_encoder), or None
cache_entry = None        # the recorder's cache pairs kept out of the cyclic GC (backend.cache_entry), or None
rows_into = None          # a compiled graph's window of CPU values -> their stats rows (compile/runtime.py), or None
error: str | None = None  # why the kernel is not used


def enabled() -> bool:
    return os.environ.get("DISPATCHPROBE_FUSED_STATS", "1").lower() not in ("0", "false", "no", "off")


def load():
    """The kernel, loaded once per process where a build of it is there (a probe calls this when
    it starts: every record of the process then comes from one path), or None, saying once why."""
    global _loaded
    with _lock:
        if _loaded:
            return stats4
        _loaded = True
        if not enabled():
            _unused("the native kernel is turned off (DISPATCHPROBE_FUSED_STATS=0)", say=False)
            return None
        try:
            path, _, _ = _target()
            failed = path.with_suffix(".failed")
            if path.exists():
                _load_module(path)
            elif failed.exists():
                _unused(f"the native kernel's build failed ({failed.read_text().strip()}); `dispatchprobe build-native` tries again")
            else:
                _unused("the native kernel is not built; `dispatchprobe build-native` builds it once for this torch")
        except Exception as exc:       # a damaged build, a read-only cache, ...
            _unused(f"the native kernel did not load ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    return stats4


def _unused(why: str, say: bool = True) -> None:
    global error
    error = why
    if say:
        print(f"dispatchprobe: CPU statistics use torch's operations (the same records, more slowly): {why}",
              file=sys.stderr)


def build_native() -> str | None:
    """Build the kernel for this CPU, source and torch unless it is built (in a process of its
    own, so a build that is stopped leaves nothing half-written), and load it; a failure is
    remembered beside the build with its reason.  Returns None when the kernel is loaded, else
    the reason it is not."""
    global _loaded
    path, _, _ = _target()
    failed = path.with_suffix(".failed")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", __name__], start_new_session=True, capture_output=True, text=True)
        if done.returncode or not path.exists():
            reason = _why(done.stderr or done.stdout) or f"the build exited with {done.returncode}"
            failed.write_text(reason + "\n")
            return reason
    failed.unlink(missing_ok=True)
    with _lock:
        _loaded = False
    load()
    return None if stats4 is not None else error


def _why(output: str) -> str:
    """The line of a failed build's output that says why: the compiler's first error, a missing
    program, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    cause = next((line for line in lines if re.search(r"\berror\b:|not found|No such file|fatal", line)
                  and not line.startswith(("RuntimeError", "subprocess."))), None)
    return (cause or (lines[-1] if lines else ""))[:300]


def native_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DISPATCHPROBE_NATIVE_DIR") or pathlib.Path.home() / ".cache" / "dispatchprobe" / "native")


def _target():
    """(the build's path, its module name, compiler flags) for this CPU, source and torch."""
    import torch
    # built for the vector instructions torch found on this CPU, named by them and by the source,
    # so a cache shared by other CPUs or versions keeps one build each
    isa = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", *_ISA_FLAGS.get(isa, []), *_FLOAT_FLAGS, *_parallel_flags()]
    digest = hashlib.sha1(_SOURCE.read_bytes() + isa.encode() + torch.__version__.encode()
                          + " ".join(flags).encode()).hexdigest()[:12]
    name = f"dispatchprobe_stats4_{isa.lower()}_{digest}"
    return native_dir() / f"{name}.so", name, flags


def _parallel_flags() -> list[str]:
    """``at::parallel_for`` is inlined into the kernel: with torch's OpenMP backend it runs in
    parallel only when the kernel is compiled with OpenMP too (otherwise serially, on one core).
    The library it links is the one torch already loaded (same soname)."""
    import torch
    if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
        return ["-fopenmp"]
    return []


def _load_module(path: pathlib.Path) -> None:
    global stats4, extremes, describe, Encoder, cache_entry, rows_into
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch
    from . import tensor_kinds
    module.configure(torch.nn.Parameter, tensor_kinds._unseen_writes)
    stats4, extremes, describe, Encoder = module.stats4, module.extremes, module.describe, module.Encoder
    cache_entry, rows_into = module.cache_entry, module.rows_into


def _build_into_cache() -> None:
    """Compile in a directory of its own and move the result into place whole: a build that is
    stopped leaves no lock behind for the next one to wait on."""
    from torch.utils.cpp_extension import load
    path, name, flags = _target()
    with tempfile.TemporaryDirectory(prefix="dispatchprobe-stats4-") as tmp:
        load(name, [str(_SOURCE)], extra_cflags=flags, extra_ldflags=[f for f in flags if f == "-fopenmp"],
             build_directory=tmp, verbose=False)
        part = path.with_suffix(f".{os.getpid()}.part")
        shutil.copyfile(pathlib.Path(tmp) / f"{name}.so", part)
        os.replace(part, path)


if __name__ == "__main__":
    _build_into_cache()
