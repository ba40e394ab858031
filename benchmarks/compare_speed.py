"""Speed of `dispatchprobe compare`: prints a table.

1. statistics compare of two synthetic 100k-op runs (records written as JSON lines directly);
2. tensor compare of two recorded transformer steps (a bigger TinyTransformer);
3. msprobe's compare (``pt_compare``, real-data mode) on msprobe's own dumps of the same two
   transformer steps (task "tensor", level "L1"), when mindstudio-probe is importable.  Each
   msprobe dump runs in its own interpreter (its debugger is a process-wide singleton).

``--phases``: where the statistics compare's time goes instead, CPU seconds per phase of one compare
(each phase a module-level call of the driver, timed in place; "rest of the part" is the pair loop,
the unmatched table and freeing the parsed records).

4. with ``--long-steps N[,N...]``: two identical N-step runs of ``show_speed.py``'s tiny transformers
   Llama (task statistics, about 295 records a step; the second a hard-linked copy), compared
   part by part: a long run's time and memory, twice: the Python call returning the whole table,
   and as ``dispatchprobe compare A B -o DIR`` runs it ("reports, no table": the reports written,
   ``keep_table=False``, whose memory should not grow with the run's length).

Every compare runs in a fresh interpreter: "seconds" is its whole wall time (imports included),
"in-call" the compare call alone, "CPU s" its user + system seconds (what other work on the machine
distorts least); peak RSS is the child's.  Children cache modules' bytecode as an installed package
does (each tree imported once, untimed, first).  ``--tree LABEL=PATH`` (repeatable)
compares with the dispatchprobe of each tree (``PYTHONPATH``) on the same runs, the trees
alternating ``--rounds`` times: an old and a new version side by side (the tensor case's rounds with
msprobe's compare after the trees', and each tool's medians over them at the end).  The tensor case is also
timed with torch imported before the call ("torch in"): its float64 re-runs import it, msprobe's
compare imports it before its timer.  Time it alone:
``flock /tmp/bench.lock python benchmarks/compare_speed.py ...``.

    python benchmarks/compare_speed.py [--ops 100000] [--skip-tensor] [--long-steps 250,1000]
                                       [--tree old=/tmp/old --tree new=. --rounds 2] [--phases]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def synthetic_run(path: str, n_ops: int, seed: int, noise: float) -> None:
    from dispatchprobe.records.writer import write_manifest
    rng = np.random.default_rng(seed)
    write_manifest(path, framework="synthetic", framework_version="0", device="cpu", config={"task": "statistics"})
    folder = os.path.join(path, "step0", "rank0")
    os.makedirs(folder, exist_ok=True)
    ops = ["aten.mm.default", "aten.add.Tensor", "aten.gelu.default", "aten._softmax.default"]
    base = np.random.default_rng(0).standard_normal((n_ops, 4))
    vals = base * (1 + noise * rng.standard_normal((n_ops, 4)))
    with open(os.path.join(folder, "ops.jsonl"), "w") as f:
        for i in range(n_ops):
            op = ops[i % 4]
            stage = "forward" if i < n_ops // 2 else "backward"
            mx, mn, mean, norm = abs(vals[i, 0]) + 1, -abs(vals[i, 1]) - 1, vals[i, 2] * 0.1, abs(vals[i, 3]) * 30 + 10
            t = {"type": "tensor", "dtype": "float32", "shape": [64, 64], "stride": [64, 1], "device": "cpu",
                 "requires_grad": False, "stats": {"max": mx, "min": mn, "mean": mean, "norm": norm, "nan": 0, "inf": 0}}
            rec = {"id": i, "kind": "op", "name": f"{op}.{i}.{stage}", "op": op, "stage": stage,
                   "scope": f"Model.layers.{(i // 40) % 500}", "call": i, "grad_fn": None, "stack": None,
                   "inputs": [t, t], "kwargs": {}, "output_type": "single", "outputs": [t]}
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def _child_env(tree: str | None) -> dict:
    """A child's environment: ``tree`` first on the path, and modules' bytecode cached as an installed
    package has it (``PYTHONDONTWRITEBYTECODE`` would compile every dispatchprobe module in every
    child, some 0.2 s that msprobe's pip-installed modules do not pay)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree)) if tree else dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def warm(tree: str | None = None) -> None:
    """Import what a compare imports once, untimed, so that the timed children find the bytecode cached."""
    subprocess.run([sys.executable, "-c", "import dispatchprobe.offline.compare, dispatchprobe.torch.replay"],
                   env=_child_env(tree), cwd=tempfile.gettempdir(), capture_output=True)


def timed_subprocess(code: str, tree: str | None = None) -> tuple[float, float, str, float]:
    """Run code in a fresh interpreter (``tree``: with that tree's dispatchprobe first on the path);
    (seconds, peak RSS MB, stdout or error, in-call seconds).  The code prints ``CALL_SECONDS <s>``
    around the call it times."""
    env = _child_env(tree)
    before = _children_cpu()
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code + "\nimport resource, sys\n"
                          "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                         capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    dt = time.perf_counter() - t
    LAST_CPU[0] = _children_cpu() - before
    if res.returncode:
        return dt, float("nan"), res.stderr.strip().splitlines()[-1], float("nan")
    rss = [l for l in res.stdout.splitlines() if l.startswith("RSS")]
    call = [l for l in res.stdout.splitlines() if l.startswith("CALL_SECONDS")]
    return dt, int(rss[-1].split()[1]) / 1024, res.stdout, float(call[-1].split()[1]) if call else float("nan")


LAST_CPU = [float("nan")]   # CPU seconds (user + system) of the last timed child: less distorted by other load


def _children_cpu() -> float:
    import resource
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _timed(call: str) -> str:
    return f"import time\n_t = time.perf_counter()\n{call}\nprint('CALL_SECONDS', time.perf_counter() - _t)"


def _compare_code(a: str, b: str, report: str | None) -> str:
    """The child's timed compare: the Python call (the table returned), or with ``report`` as the CLI
    runs it (the reports written there, no table kept where the tree can leave it)."""
    if report is None:
        return "from dispatchprobe import compare\n" + _timed(f"t, v = compare({a!r}, {b!r})")
    return ("import inspect\nfrom dispatchprobe import compare\n"
            "_kw = {'keep_table': False} if 'keep_table' in inspect.signature(compare).parameters else {}\n"
            + _timed(f"t, v = compare({a!r}, {b!r}, out={report!r}, **_kw)"))


def msprobe_dump(out: str, plant: bool, model_kw: dict, batch: int) -> None:
    """Child process: one training step of the benchmark's transformer under msprobe's
    PrecisionDebugger (task tensor, level L1), the same model, batch and planted op as ours."""
    import contextlib
    import torch
    from compare_helpers import planted_softmax
    from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
    from msprobe.pytorch import PrecisionDebugger
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.0, **model_kw)
    cfg = out + ".json"
    with open(cfg, "w") as f:
        json.dump({"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": "L1",
                   "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}, f)
    debugger = PrecisionDebugger(config_path=cfg)
    tokens, targets = lm_batch(batch=batch, seq=model_kw["seq"], vocab=model_kw["vocab"], seed=0)
    with planted_softmax(model) if plant else contextlib.nullcontext():
        debugger.start(model)
        loss = lm_loss(model, tokens, targets)
        loss.backward()
        debugger.stop()
        debugger.step()


def msprobe_setup(tmp: str, model_kw: dict, batch: int) -> tuple[str | None, str, str]:
    """msprobe dumps of the clean and the planted step; (the child code timing its compare, the case's
    name, note), the code None where msprobe is unavailable or failed."""
    try:
        import msprobe  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return None, "", f"msprobe unavailable ({type(exc).__name__}: {exc})"
    import glob
    dumps = {}
    for tag, plant in (("ma", False), ("mb", True)):
        out = os.path.join(tmp, tag)
        res = subprocess.run([sys.executable, __file__, "--msprobe-dump", out] + (["--plant"] if plant else []),
                             capture_output=True, text=True)
        found = glob.glob(os.path.join(out, "step0", "*", "dump.json"))
        if res.returncode or not found:
            why = (res.stderr.strip().splitlines() or ["no dump.json written"])[-1]
            return None, "", f"msprobe dump failed: {why}"
        dumps[tag] = found[0]
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.dirname(dumps["ma"]))
               for f in fs) / 2**20
    call = (f"pt_compare({{'npu_path': {dumps['ma']!r}, 'bench_path': {dumps['mb']!r}, "
            f"'is_print_compare_log': False}}, {os.path.join(tmp, 'msout')!r})")
    return ("from msprobe.pytorch.compare.pt_compare import pt_compare\n" + _timed(call),
            f"tensor, transformer step ({size:.0f} MB per dump)", "msprobe: pt_compare real-data mode on its own dumps")


def long_runs(tmp: str, steps: int) -> tuple[str, str]:
    """Two identical ``steps``-step runs of show_speed.py's tiny Llama: one recorded (in a child),
    the other its hard-linked copy."""
    a, b = os.path.join(tmp, f"la{steps}"), os.path.join(tmp, f"lb{steps}")
    res = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "show_speed.py"),
                          "--record", a, "--steps", str(steps)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"recording the long run failed: {res.stderr.strip().splitlines()[-1:]}")
    shutil.copytree(a, b, copy_function=os.link)
    return a, b


# (module, name, phase) of the statistics compare, each timed where the driver calls it
_PHASES = (("dispatchprobe.records.reader", "_read_jsonl", "parsing the records"),
           ("dispatchprobe.offline.compare.driver", "align", "alignment"),
           ("dispatchprobe.offline.compare.driver", "data_flow", "data flow"),
           ("dispatchprobe.offline.compare.driver", "_table", "paired tensors' table"),
           ("dispatchprobe.offline.compare.driver", "score_pairs", "scoring"),
           ("dispatchprobe.offline.compare.driver", "trace", "origin trace"),
           ("dispatchprobe.offline.compare.driver", "pairing_share", "pairing counts"),
           ("dispatchprobe.offline.compare.driver", "_merge", "merging the parts"))

# the child of --phases: CPU seconds of each phase (process time, so other work on the machine
# inflates them less than wall time), of the part's compare (``_worker``) and of the whole call
_PHASES_CHILD = """
import importlib, time
spent, in_part = {}, [0.0, False]     # in_part: the phases' seconds inside a part's compare, whether inside one
def timed(mod, name, label):
    inner = getattr(mod, name)
    def call(*args, **kwargs):
        start, outer = time.process_time(), in_part[1]
        in_part[1] = outer or label == "part"
        try:
            return inner(*args, **kwargs)
        finally:
            seconds = time.process_time() - start
            spent[label] = spent.get(label, 0.0) + seconds
            in_part[1] = outer
            if outer:
                in_part[0] += seconds
    setattr(mod, name, call)
for module, name, label in PHASES + (("dispatchprobe.offline.compare.driver", "_worker", "part"),):
    timed(importlib.import_module(module), name, label)
from dispatchprobe import compare
start = time.process_time()
compare(A, B)
total = time.process_time() - start
spent["rest of the part"] = spent.pop("part") - in_part[0]
for label, seconds in spent.items():
    print(f"PHASE {label}|{seconds:.2f}")
print(f"PHASE whole call|{total:.2f}")
"""


def phase_rows(a: str, b: str) -> list:
    """(phase, CPU seconds) of one statistics compare of ``a`` against ``b`` in a fresh interpreter."""
    code = f"PHASES = {_PHASES!r}\nA, B = {a!r}, {b!r}\n" + _PHASES_CHILD
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if res.returncode:
        raise SystemExit(f"--phases: compare failed: {res.stderr.strip().splitlines()[-1:]}")
    return [tuple(line[6:].rsplit("|", 1)) for line in res.stdout.splitlines() if line.startswith("PHASE ")]


def tree_rows(cases: list, trees: list, rounds: int, preload: bool = False) -> list:
    """Each case compared by each tree's dispatchprobe, the trees alternating ``rounds`` times; the
    rows name the tree.  ``preload``: also each tree with torch imported before the timed call (the
    tensor compare imports it for its float64 re-runs; msprobe's compare has it imported before)."""
    rows = []
    for _, path in trees:
        warm(path)
    for _ in range(rounds):
        for case, a, b, report in cases:
            for label, path in trees:
                for first in ("", "import torch\n") if preload else ("",):
                    dt, rss, out, call = timed_subprocess(first + _compare_code(a, b, report), tree=path)
                    if rss != rss:
                        raise SystemExit(f"tree {label}: compare failed: {out}")
                    rows.append((case, f"dispatchprobe {label}".strip() + (", torch in" if first else ""), dt, call,
                                 rss, LAST_CPU[0]))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--skip-tensor", action="store_true")
    ap.add_argument("--long-steps", default="", help="also compare two identical runs of this many steps (a comma list: "
                    "several lengths)")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="compare with this tree's dispatchprobe (repeatable): the trees side by side, alternating")
    ap.add_argument("--rounds", type=int, default=1, help="--tree: rounds, the trees alternating")
    ap.add_argument("--phases", action="store_true",
                    help="instead of the table: CPU seconds per phase of the statistics compare")
    ap.add_argument("--msprobe-dump", help=argparse.SUPPRESS)
    ap.add_argument("--plant", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    kw = {"dim": 256, "heads": 8, "layers": 4, "seq": 128, "vocab": 1024}
    batch = 8
    if args.msprobe_dump:
        msprobe_dump(args.msprobe_dump, args.plant, kw, batch)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "sa"), os.path.join(tmp, "sb")
        t = time.perf_counter()
        synthetic_run(a, args.ops, 1, 0.0)
        synthetic_run(b, args.ops, 2, 1e-4)
        gen = time.perf_counter() - t
        cases = [(f"statistics, {args.ops:,} ops x 3 tensors", a, b, None)]
        if args.phases:
            print(f"statistics, {args.ops:,} ops x 3 tensors: CPU seconds per phase")
            for phase, seconds in phase_rows(a, b):
                print(f"  {phase:28s} {float(seconds):6.2f}")
            return
        for steps in [int(n) for n in args.long_steps.split(",") if n]:
            la, lb = long_runs(tmp, steps)
            cases.append((f"statistics, {steps:,}-step Llama runs", la, lb, None))
            cases.append((f"statistics, {steps:,}-step Llama runs, reports, no table", la, lb,
                          os.path.join(tmp, f"report{steps}")))
        if args.tree:
            rows += tree_rows(cases, [t.split("=", 1) for t in args.tree], args.rounds)
        else:
            warm()
            for case, x, y, report in cases:
                dt, rss, _, call = timed_subprocess(_compare_code(x, y, report))
                rows.append((case, "dispatchprobe", dt, call, rss, LAST_CPU[0]))
        if not args.skip_tensor:
            from compare_helpers import record
            ta, tb = os.path.join(tmp, "ta"), os.path.join(tmp, "tb")
            record(ta, model_kw=kw, batch=batch)
            record(tb, model_kw=kw, batch=batch, plant=True)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ta) for f in fs) / 2**20
            case = f"tensor, transformer step ({size:.0f} MB per run)"
            ms_code, ms_case, ms_note = msprobe_setup(tmp, kw, batch)
            trees = [t.split("=", 1) for t in args.tree] or [("", None)]
            # each round: each tree, each also with torch imported before the call ("torch in"), then msprobe
            for _ in range(args.rounds if args.tree else 1):
                rows += tree_rows([(case, ta, tb, None)], trees, 1, preload=True)
                if ms_code is not None:
                    dt, rss, out, in_call = timed_subprocess(ms_code)
                    if rss != rss:  # nan: it failed
                        ms_code, ms_note = None, f"msprobe compare failed: {out}"
                    else:
                        rows.append((ms_case, "msprobe", dt, in_call, rss, LAST_CPU[0]))
            ms_note += "\n" + speedups(rows, case, ms_case)
        else:
            ms_note = "tensor compare skipped"
    print(f"(synthetic runs generated in {gen:.1f} s)")
    print(f"{'case':64s} {'tool':28s} {'seconds':>8s} {'in-call':>8s} {'CPU s':>8s} {'peak RSS MB':>12s}")
    for case, tool, dt, call, rss, cpu in rows:
        print(f"{case:64s} {tool:28s} {dt:8.2f} {call:8.2f} {cpu:8.2f} {rss:12.0f}")
    print(ms_note)


def speedups(rows: list, case: str, ms_case: str) -> str:
    """Per tool of the tensor case, the medians over the rounds and msprobe's median over them."""
    def medians(tool_case, tool):
        picked = [r for r in rows if r[0] == tool_case and r[1] == tool]
        return [float(np.median([r[k] for r in picked])) for k in (2, 3, 5)]
    tools = list(dict.fromkeys(r[1] for r in rows if r[0] == case))
    ms = medians(ms_case, "msprobe") if any(r[1] == "msprobe" for r in rows) else None
    lines = ["tensor compare, medians over the rounds (wall s / in-call s / CPU s)"
             + (", and msprobe's median over each:" if ms else ":")]
    for tool in tools + (["msprobe"] if ms else []):
        m = medians(ms_case if tool == "msprobe" else case, tool)
        ratio = f"   msprobe / this: {ms[0] / m[0]:.1f}x wall, {ms[1] / m[1]:.1f}x in-call, {ms[2] / m[2]:.1f}x CPU" \
            if ms and tool != "msprobe" else ""
        lines.append(f"  {tool:28s} {m[0]:6.2f} / {m[1]:6.2f} / {m[2]:6.2f}{ratio}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
