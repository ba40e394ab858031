"""run-ut false-error sweep over PyTorch's own op test database.

Records the CPU sample inputs of every OpInfo in
``torch.testing._internal.common_methods_invocations.op_db`` under ``DispatchProbe(task="tensor")``
(one step per OpInfo; random ops -- whose output changes with the seed, which also catches the
``empty`` family's uninitialised memory -- and sparse ops left out), replays them with ``run_ut`` and prints per dtype: OpInfos, calls (op records), judged,
false errors (the kernels are stock: every error is false but the known genuine findings in
:data:`GENUINE`), warnings, coverage (judged / calls) and skips by reason.  ``--show``
lists each error with its OpInfo.

    python benchmarks/opinfo_sweep.py [--dtypes float32 bfloat16] [--samples 1] [--only NAME ...] [--show]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import pandas as pd
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.run_ut import run_ut

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (dtype, aten op) whose errors are real: these stock CPU kernels are inaccurate
GENUINE = {("bfloat16", "aten.linalg_matrix_exp.default"),   # inf/nan where float64 is finite
           ("bfloat16", "aten.rsqrt.default"),               # relative error beyond bf16's 0.004
           # computes in bf16 arithmetic: 2-3 % error at well-conditioned elements (2-4 bf16
           # roundings of its terms), beyond the bf16 one-hundredth standard
           ("bfloat16", "aten.grid_sampler_2d.default")}


def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _is_sparse(op, samples) -> bool:
    if "sparse" in op.name or op.name.startswith("to_sparse"):
        return True
    for s in samples:
        for t in (s.input, *s.args, *s.kwargs.values()):
            if isinstance(t, torch.Tensor) and t.layout != torch.strided:
                return True
    return False


def _outputs(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    return []


def _comparable(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t.to(torch.complex128))
    return t.double().nan_to_num(0.0) if t.is_floating_point() else t


def _same(a, b) -> bool:
    if len(a) != len(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(_comparable(x), _comparable(y))
               for x, y in zip(a, b))


def _is_random(op, sample) -> bool:
    """The output changes with the global seed (or is uninitialised memory)."""
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        try:
            runs.append([t.clone() for t in _outputs(op(sample.input, *sample.args, **sample.kwargs))])
        except Exception:  # noqa: BLE001 - a failing sample is counted when recorded
            return False
    return not _same(*runs)


@dataclass
class Selection:
    ops: list = field(default_factory=list)        # (name, OpInfo, samples)
    left_out: collections.Counter = field(default_factory=collections.Counter)


def select(dtype: torch.dtype, samples: int = 1, only=None) -> Selection:
    """The OpInfos to sweep in ``dtype`` with their first ``samples`` sample inputs (0: all)."""
    from torch.testing._internal.common_methods_invocations import op_db
    sel = Selection()
    saved = warnings.filters[:]
    wanted = set(only) if only else None
    warnings.simplefilter("ignore")
    for op in op_db:
        name = full_name(op)
        if wanted is not None and name not in wanted:
            continue
        if dtype not in op.supported_dtypes("cpu"):
            sel.left_out["dtype not supported"] += 1
            continue
        try:
            torch.manual_seed(0)
            found = list(op.sample_inputs("cpu", dtype, requires_grad=False))
        except Exception:  # noqa: BLE001
            sel.left_out["no sample inputs"] += 1
            continue
        found = found[:samples] if samples else found
        if not found:
            sel.left_out["no sample inputs"] += 1
        elif _is_sparse(op, found):
            sel.left_out["sparse"] += 1
        elif _is_random(op, found[0]):
            sel.left_out["random or uninitialised"] += 1
        else:
            sel.ops.append((name, op, found))
    warnings.filters[:] = saved
    return sel


def record(path: str, sel: Selection) -> tuple[list[str], int]:
    """Record each OpInfo's samples as one step; returns (OpInfo name per step, failed samples)."""
    probe = DispatchProbe(task="tensor", dump_path=path)
    names, failed = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, op, samples in sel.ops:
            with probe:
                for s in samples:
                    try:
                        op(s.input, *s.args, **s.kwargs)
                    except Exception:  # noqa: BLE001 - a sample the op itself rejects
                        failed += 1
            probe.step()
            names.append(name)
    probe.close()
    return names, failed


def _reason(message: str) -> str:
    """A skip message without its specifics: ``random op (bernoulli): ...`` -> ``random op``."""
    return re.split(r"[:(]", message, maxsplit=1)[0].strip() or message


@dataclass
class Sweep:
    dtype: str
    opinfos: int
    left_out: dict
    failed_samples: int
    results: pd.DataFrame        # run-ut's result rows with an OpInfo column
    seconds: float

    @property
    def status(self) -> pd.Series:
        r = self.results
        return r["Forward Test Success"].where(r["Forward Test Success"] != "", r["Backward Test Success"])

    @property
    def calls(self) -> int:
        return len(self.results)

    @property
    def judged(self) -> int:
        return int(self.status.isin(["pass", "warning", "error"]).sum())

    @property
    def errors(self) -> pd.DataFrame:
        """Every error row (false ones and the known genuine findings)."""
        return self.results[self.status == "error"]

    @property
    def genuine(self) -> pd.DataFrame:
        e = self.errors
        return e[[(self.dtype, op) in GENUINE for op in e["Op"]]]

    @property
    def false_errors(self) -> pd.DataFrame:
        e = self.errors
        return e[[(self.dtype, op) not in GENUINE for op in e["Op"]]]

    @property
    def error_rate(self) -> float:
        return len(self.false_errors) / self.judged if self.judged else 0.0

    @property
    def coverage(self) -> float:
        return self.judged / self.calls if self.calls else 1.0

    @property
    def skips(self) -> dict:
        return collections.Counter(map(_reason, self.results[self.status == "SKIP"]["Message"]))


def sweep(dtype: str, samples: int = 1, only=None, jobs: int = 1, workdir: str | None = None) -> Sweep:
    t0 = time.perf_counter()
    sel = select(DTYPES[dtype], samples, only)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        names, failed = record(f"{tmp}/rec", sel)
        res = run_ut(f"{tmp}/rec", f"{tmp}/ut", jobs=jobs, progress=False)
    r = res.results.copy()
    r.insert(0, "OpInfo", [names[int(s)] for s in r["Step"]])
    return Sweep(dtype, len(sel.ops), dict(sel.left_out), failed, r, time.perf_counter() - t0)


def table(sweeps: list[Sweep]) -> str:
    lines = [f"{'dtype':<9} {'OpInfos':>7} {'calls':>6} {'judged':>6} {'false errors':>14} {'genuine':>7} "
             f"{'warnings':>8} {'coverage':>8}  skips by reason"]
    for s in sweeps:
        warn = int((s.status == "warning").sum())
        skips = ", ".join(f"{k}: {v}" for k, v in sorted(s.skips.items(), key=lambda kv: -kv[1])) or "none"
        lines.append(f"{s.dtype:<9} {s.opinfos:>7} {s.calls:>6} {s.judged:>6} "
                     f"{len(s.false_errors):>5} ({s.error_rate:6.2%}) {len(s.genuine):>7} {warn:>8} "
                     f"{s.coverage:>8.2%}  {skips}")
    for s in sweeps:
        left = ", ".join(f"{k}: {v}" for k, v in sorted(s.left_out.items()))
        lines.append(f"{s.dtype}: left out {left}; samples the op rejected: {s.failed_samples}; {s.seconds:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    ap.add_argument("--samples", type=int, default=1, help="sample inputs per OpInfo (0: all)")
    ap.add_argument("--only", nargs="*", help="OpInfo names (name or name.variant)")
    ap.add_argument("-j", "--jobs", type=int, default=1)
    ap.add_argument("--show", action="store_true", help="list every false error and skip")
    args = ap.parse_args(argv)
    sweeps = []
    for dtype in args.dtypes:
        s = sweep(dtype, args.samples, args.only, args.jobs)
        sweeps.append(s)
        if args.show:
            for _, row in s.errors.iterrows():
                kind = "genuine" if (dtype, row["Op"]) in GENUINE else "error"
                print(f"{dtype} {kind:<7} {row['OpInfo']:<32} {row['Op']:<40} {row['Message'][:200]}")
            st = s.status
            for _, row in s.results[st == "SKIP"].iterrows():
                print(f"{dtype} skip   {row['OpInfo']:<32} {row['Op']:<40} {row['Message'][:160]}")
    print(table(sweeps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
