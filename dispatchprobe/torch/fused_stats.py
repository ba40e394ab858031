"""One pass over memory for the CPU statistics of a float32 or bfloat16 tensor (max, min, sum,
sum of squares), where torch needs three reductions: a small C++ kernel (``csrc/stats4.cpp``), built
with torch's extension builder the first time a probe starts on a machine, by a process of its
own (so a short run still completes the cache for the next), and kept in torch's extension cache
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``).  The same module reads the
facts the per-op path records of every tensor in one call (``describe``).  Until it is ready, where
no C++ compiler is found, or with ``DISPATCHPROBE_FUSED_STATS=0``, the statistics use torch's
reductions and the facts are read in Python; both give the same values (the statistics to float32
rounding).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "stats4.cpp"
_ISA_FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]}
_lock = threading.Lock()
_builder: threading.Thread | None = None
stats4 = None             # the kernel: float32/bfloat16 CPU tensor (contiguous rows) -> [max, min, sum, sum of squares]
extremes = None           # its second pass where those sums are not finite -> [nan, inf, max, min, finite max, finite min]
describe = None           # a plain tensor's description and cache keys in one call (backend.describe), or None
Encoder = None            # the statistics task's per-value encoding (backend.value_encoder), or None
cache_entry = None        # the recorder's cache pairs kept out of the cyclic GC (backend.cache_entry), or None
rows_into = None          # a compiled graph's window of CPU values -> their stats rows (compile/runtime.py), or None
error: str | None = None  # why it could not be built


def enabled() -> bool:
    return os.environ.get("DISPATCHPROBE_FUSED_STATS", "1").lower() not in ("0", "false", "no", "off")


def build(wait: bool = False):
    """Start loading (or building) the kernel, once per process; ``wait``: until it is done.
    Returns the kernel, or None (not ready yet, turned off, or failed: see :data:`error`)."""
    global _builder
    with _lock:
        if _builder is None and enabled() and _SOURCE.exists():
            _builder = threading.Thread(target=_load, name="dispatchprobe-stats4", daemon=True)
            _builder.start()
    if wait and _builder is not None:
        _builder.join()
    return stats4


def _target():
    """(the cached build's path, its module name, compiler flags) for this CPU, source and torch."""
    import torch
    from torch.utils.cpp_extension import _get_build_directory
    # built for the vector instructions torch found on this CPU, named by them and by the source,
    # so a cache shared by other CPUs or versions keeps one build each
    isa = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", *_ISA_FLAGS.get(isa, []), *_parallel_flags()]
    digest = hashlib.sha1(_SOURCE.read_bytes() + isa.encode() + torch.__version__.encode()
                          + " ".join(flags).encode()).hexdigest()[:12]
    name = f"dispatchprobe_stats4_{isa.lower()}_{digest}"
    path = pathlib.Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    return path, name, flags


def _parallel_flags() -> list[str]:
    """``at::parallel_for`` is inlined into the kernel: with torch's OpenMP backend it runs in
    parallel only when the kernel is compiled with OpenMP too (otherwise serially, on one core).
    The library it links is the one torch already loaded (same soname)."""
    import torch
    if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
        return ["-fopenmp"]
    return []


def _load() -> None:
    global stats4, extremes, describe, Encoder, cache_entry, rows_into, error
    try:
        path, name, _ = _target()
        if not path.exists():
            # built by a process of its own, which finishes the cache even when this one exits first
            done = subprocess.run([sys.executable, "-m", __name__], start_new_session=True,
                                  capture_output=True, text=True)
            if done.returncode or not path.exists():
                lines = (done.stderr or done.stdout).strip().splitlines()
                raise RuntimeError(lines[-1] if lines else f"the build exited with {done.returncode}")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        import torch
        from . import tensor_kinds
        module.configure(torch.nn.Parameter, tensor_kinds._unseen_writes)
        stats4, extremes, describe, Encoder = module.stats4, module.extremes, module.describe, module.Encoder
        cache_entry, rows_into = module.cache_entry, module.rows_into
    except Exception as exc:          # no compiler, no ninja, a read-only cache: torch's reductions
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


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
