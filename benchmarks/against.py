"""Run a benchmark script on an older commit and on this tree, side by side, in one invocation.

The older commit is checked out in a git worktree; the two versions run alternately (old, new,
old, new, ...) as child processes, each with its own copy of the script and its package first
on ``PYTHONPATH``, so drift in machine speed hits both alike.  Every table row a script prints
as ``<mode> <median> <ratio>x`` is collected, and the median ratio per mode and version printed.

    python benchmarks/against.py REV record_overhead.py --quick --steps 5 [--rounds 3] [--new REV2]
    python benchmarks/against.py REV inline_checks.py --quick --dtype bfloat16

``--new REV2`` measures commit REV2 (also in a worktree) instead of this working tree, so that
edits made while it runs cannot reach the measurement.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\s*(?P<mode>\S.*?)\s+(?P<median>[\d.]+)\s+(?P<ratio>[\d.]+)x\b")


def worktree(rev: str) -> str:
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    path = os.path.join(tempfile.gettempdir(), f"dispatchprobe-{sha}")
    if not os.path.isdir(path):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, sha], check=True,
                       capture_output=True)
    return path


def run(tree: str, script: str, args: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, os.path.join(tree, "benchmarks", script), *args], cwd=tree, env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{script} failed in {tree}:\n{out.stderr[-2000:]}")
    section, rows = "", {}
    for line in out.stdout.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            section = line[:-1] + " / "
        m = ROW.match(line)
        if m:
            rows[section + m["mode"]] = float(m["ratio"])
    return rows


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    rev, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    options = {"--rounds": "3", "--new": None}
    for name in options:
        if name in args:
            i = args.index(name)
            options[name] = args[i + 1]
            del args[i:i + 2]
    rounds, new = int(options["--rounds"]), options["--new"]
    trees = {f"old ({rev})": worktree(rev), f"new ({new})" if new else "new (this tree)": worktree(new) if new else ROOT}
    ratios: dict[str, dict[str, list[float]]] = {label: {} for label in trees}
    for r in range(rounds):
        for label, tree in trees.items():
            for mode, ratio in run(tree, script, args).items():
                ratios[label].setdefault(mode, []).append(ratio)
            print(f"round {r + 1}/{rounds}: {label} done", file=sys.stderr)
    modes = list(dict.fromkeys(m for label in trees for m in ratios[label]))
    labels = list(trees)
    print(f"{script} {' '.join(args)}: median ratio to uninstrumented over {rounds} rounds")
    print(f"{'mode':56s} " + " ".join(f"{label:>18s}" for label in labels))
    for mode in modes:
        cells = [ratios[label].get(mode) for label in labels]
        print(f"{mode:56s} " + " ".join(f"{statistics.median(c):17.2f}x" if c else f"{'-':>18s}" for c in cells))


if __name__ == "__main__":
    main()
