"""The test matrix: the torch releases users have and MindSpore, each leg in an environment of its own.

Four legs, each in an environment of its own so that none downgrades another's packages:

- ``pinned``: torch 2.13.0 (CPU build) in this interpreter, the whole suite but MindSpore's tests;
- ``mindspore``: MindSpore 2.10 with torch 2.13.0 in ``.venvs/mindspore`` (MindSpore needs
  numpy<2 and pandas<3), the tests marked ``mindspore`` (its adapter, cross-framework compare);
- ``newest``: torch 2.14.1, the CUDA build most users have, run on a CPU machine (``.venvs/torch2.14``);
- ``minimum``: torch 2.5.1, the oldest torch dispatchprobe supports (``.venvs/torch2.5``).

The two extra torch legs run :data:`EXTRA_LEG_TESTS` but those marked ``slow``: capture under
every task, compare, run-ut, the devices, ``probe_backend`` (refused in one line below the torch it
needs: its tests assert that refusal there), the native statistics kernel and the distributed
tests (on torch 2.5 without FSDP2's, marked ``fsdp2``: that FSDP2 needs CUDA).  Each leg installs the package with its
test extras, builds the native kernel (``dispatchprobe build-native``), then runs pytest.  An
environment is made once and reused while its torch, extras and ``pyproject.toml`` are the same.
The extra environments are prepared in the background while the pinned leg runs its tests.

Prints a table of the legs (tests, passed, failed, skipped, minutes) and exits 1 if any leg failed.
Usage: ``python ci/matrix.py [--legs pinned,mindspore,newest,minimum]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".venvs"
LOGS = VENVS / "logs"

# what the two extra torch legs run (the pinned leg runs every test file)
EXTRA_LEG_TESTS = (
    "tests/test_transparency.py",      # training is bit-identical under the statistics and tensor tasks
    "tests/test_tensor_kinds.py",      # every task over functorch transforms, subclasses, views
    "tests/test_capture.py",           # what the eager probe records
    "tests/test_compare.py",           # compare of two recorded runs
    "tests/test_run_ut.py",            # replay of a tensor run
    "tests/test_devices.py",           # the device run-ut picks, ops that cannot run
    "tests/test_compile.py",           # probe_backend (its refusal below torch 2.6)
    "tests/test_torch_versions.py",    # the torch each path needs
    "tests/test_fused_stats.py",       # the native statistics kernel and its Python twin
    "tests/test_distributed.py",       # DDP, FSDP2, tensor parallel on gloo ranks, every task
    "tests/test_distributed_compare.py",
    "tests/test_process_state.py",     # the adapter's process state, empty again once every probe is closed
    "tests/test_layout.py",            # torch's private APIs only behind torch/internals/
)


@dataclasses.dataclass(frozen=True)
class Leg:
    name: str
    torch: str                   # the torch release installed in the leg
    extras: str                  # the package's extras installed with it
    venv: str | None             # folder under .venvs, or None for this interpreter
    pytest_args: tuple[str, ...]
    pins: tuple[str, ...] = ()   # further requirements of this leg

    @property
    def python(self) -> Path:
        return Path(sys.executable) if self.venv is None else VENVS / self.venv / "bin" / "python"


LEGS = (
    Leg("pinned", "2.13.0", "test", None, ("-m", "not mindspore")),
    Leg("mindspore", "2.13.0", "test,mindspore", "mindspore", ("-m", "mindspore")),
    Leg("newest", "2.14.1", "test", "torch2.14", (*EXTRA_LEG_TESTS, "-m", "not slow")),
    # transformers 5 builds its models only on torch >= 2.6; torch 2.5's FSDP2 needs CUDA streams
    # (its CPU tests are left out there)
    Leg("minimum", "2.5.1", "test", "torch2.5", (*EXTRA_LEG_TESTS, "-m", "not slow and not fsdp2"), ("transformers<5",)),
)


@dataclasses.dataclass
class Result:
    leg: Leg
    torch: str = "?"
    prepare_s: float = 0.0
    test_s: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)
    failure: str | None = None      # why the leg failed, None when it passed


def environ(leg: Leg) -> dict:
    """The leg's interpreter first on PATH (its ``dispatchprobe`` and ``torchrun``), no prompts."""
    bindir = str(leg.python.parent)
    env = dict(os.environ, PATH=os.pathsep.join([bindir, os.environ.get("PATH", "")]), PIP_NO_INPUT="1")
    if leg.venv is not None:
        env["VIRTUAL_ENV"] = str(VENVS / leg.venv)
    env.pop("PYTHONHOME", None)
    return env


def run_logged(cmd: list[str], leg: Leg, log) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, cwd=ROOT, env=environ(leg), stdin=subprocess.DEVNULL, stdout=log,
                          stderr=subprocess.STDOUT).returncode


PIP_TRIES = 3          # a download cut short (a CUDA build is GBs) is tried again, a while later
PIP_WAIT_S = 30        # seconds before the second try; twice that before the third


def install(pip: list[str], leg: Leg, log) -> int:
    """pip's exit code after up to :data:`PIP_TRIES` tries: a flaky network does not fail the leg."""
    for attempt in range(1, PIP_TRIES + 1):
        code = run_logged(pip, leg, log)
        if code == 0 or attempt == PIP_TRIES:
            return code
        log.write(f"# pip exited {code}; try {attempt + 1} of {PIP_TRIES} in {PIP_WAIT_S * attempt} s\n")
        log.flush()
        time.sleep(PIP_WAIT_S * attempt)
    return code


def pip_error(log_path: Path) -> str:
    """pip's last ``ERROR:`` line (what the table shows), or a pointer to the log where it printed none."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return errors[-1][:200] if errors else f"see {log_path}"


def stamp(leg: Leg) -> str:
    """What an environment was installed from: reinstalled when this changes."""
    pyproject = hashlib.sha1((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return json.dumps({"torch": leg.torch, "extras": leg.extras, "pins": leg.pins, "pyproject": pyproject})


def prepare(leg: Leg, result: Result) -> None:
    """:func:`make`, a failure of its own (a full disk, ...) kept as the leg's."""
    try:
        make(leg, result)
    except Exception as exc:            # noqa: BLE001 - the table still prints, the leg fails
        result.failure = f"preparing failed: {type(exc).__name__}: {exc}"


def make(leg: Leg, result: Result) -> None:
    """Make (or reuse) the leg's environment, install the package and torch, build the kernel."""
    start = time.monotonic()
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / f"{leg.name}-prepare.log", "w") as log:
        stamp_file = None
        if leg.venv is not None:
            stamp_file = VENVS / leg.venv / "dispatchprobe-ci.json"
            if not leg.python.exists() and run_logged([sys.executable, "-m", "venv", str(VENVS / leg.venv)], leg, log):
                result.failure = "could not make its virtual environment"
        installed = stamp_file is not None and stamp_file.exists() and stamp_file.read_text() == stamp(leg)
        if result.failure is None and not installed:
            pip = [str(leg.python), "-m", "pip", "install", "-q", f"torch=={leg.torch}", "-e", f".[{leg.extras}]", *leg.pins]
            if install(pip, leg, log):
                result.failure = "pip install failed: " + pip_error(LOGS / f"{leg.name}-prepare.log")
            elif stamp_file is not None:
                stamp_file.write_text(stamp(leg))
        if result.failure is None:
            done = subprocess.run([str(leg.python), "-c", "import torch; print(torch.__version__)"], cwd=ROOT,
                                  env=environ(leg), stdin=subprocess.DEVNULL, capture_output=True, text=True)
            result.torch = done.stdout.strip() or "?"
            if not result.torch.startswith(leg.torch):
                result.failure = f"installed torch is {result.torch}, not {leg.torch}"
        if result.failure is None and run_logged([str(leg.python), "-m", "dispatchprobe", "build-native"], leg, log):
            result.failure = "dispatchprobe build-native failed"
    result.prepare_s = time.monotonic() - start
    if result.failure is not None:
        print(f"[{leg.name}] {result.failure}; its log ({LOGS / f'{leg.name}-prepare.log'}) ends:", flush=True)
        print("".join(open(LOGS / f"{leg.name}-prepare.log").readlines()[-30:]), flush=True)


def test(leg: Leg, result: Result) -> None:
    """Run the leg's tests, streaming pytest's output; counts read from its JUnit file."""
    start = time.monotonic()
    junit = LOGS / f"{leg.name}.xml"
    junit.unlink(missing_ok=True)
    print(f"\n==== {leg.name}: torch {result.torch} ({leg.python}) ====", flush=True)
    cmd = [str(leg.python), "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *leg.pytest_args]
    code = subprocess.run(cmd, cwd=ROOT, env=environ(leg), stdin=subprocess.DEVNULL).returncode
    result.test_s = time.monotonic() - start
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        result.counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    if code != 0:
        result.failure = f"pytest exited {code}"


def table(results: list[Result]) -> str:
    head = ("leg", "torch", "tests", "passed", "failed", "skipped", "prepare min", "test min", "result")
    rows = [head]
    for r in results:
        c = r.counts
        passed = c.get("tests", 0) - c.get("failures", 0) - c.get("errors", 0) - c.get("skipped", 0)
        rows.append((r.leg.name, r.torch, str(c.get("tests", "-")), str(passed if c else "-"),
                     str(c.get("failures", 0) + c.get("errors", 0)) if c else "-", str(c.get("skipped", "-")),
                     f"{r.prepare_s / 60:.1f}", f"{r.test_s / 60:.1f}", "passed" if r.failure is None else r.failure))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--legs", default=",".join(leg.name for leg in LEGS),
                        help="comma-separated legs to run (default: all)")
    names = parser.parse_args(argv).legs.split(",")
    unknown = set(names) - {leg.name for leg in LEGS}
    if unknown:
        parser.error(f"unknown leg(s): {', '.join(sorted(unknown))}")
    legs = [leg for leg in LEGS if leg.name in names]
    results = [Result(leg) for leg in legs]
    start = time.monotonic()
    # the first leg is prepared here; the others in the background while earlier legs test
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        prepare(legs[0], results[0])
        ready = [None] + [pool.submit(prepare, leg, r) for leg, r in zip(legs[1:], results[1:])]
        for leg, result, future in zip(legs, results, ready):
            if future is not None:
                future.result()
            if result.failure is None:
                test(leg, result)
    print(f"\n{table(results)}\nall legs: {(time.monotonic() - start) / 60:.1f} min", flush=True)
    return 1 if any(r.failure is not None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
