"""Every input a user can get wrong gets one line, no traceback, and the right exit code: the
real ``dispatchprobe`` command in a subprocess, and the Python API's construction errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dispatchprobe import ConfigError, DispatchProbe


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A tensor run, a copy with a cut-short shard, an overflow run that flagged nothing, junk."""
    root = tmp_path_factory.mktemp("bad")
    for name in ("tensor", "damaged"):
        probe = DispatchProbe(task="tensor", dump_path=str(root / name))
        with probe:
            (torch.randn(64, 64) @ torch.randn(64, 64)).exp()
        probe.close()
    shard = next((root / "damaged" / "step0" / "rank0" / "tensors").glob("shard_*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:4000])
    probe = DispatchProbe(task="statistics", dump_path=str(root / "stats"))
    with probe:
        (torch.randn(8, 8) @ torch.randn(8, 8)).exp()
    probe.close()
    probe = DispatchProbe(task="overflow", dump_path=str(root / "clean_overflow"))
    with probe:
        torch.randn(8, 8).relu().sum()
    probe.close()
    (root / "junk" / "step0" / "rank0").mkdir(parents=True)
    (root / "junk" / "step0" / "rank0" / "ops.jsonl").write_text("not json\n" * 20)
    (root / "a_file").write_text("x")
    return root


# (arguments, exit code, words the one line must contain); "{root}" is the fixture's folder
CASES = [
    (["show", "{root}/junk"], 1, "not a records file"),
    (["show", "{root}/damaged"], 1, "damaged shard"),
    (["show", "{root}/tensor", "--op", "("], 1, "no record matches"),
    (["show", "{root}/tensor", "--op", "no_such_op"], 1, "no record matches"),
    (["show", "{root}/tensor", "--limit", "0"], 2, "--limit"),
    (["show", "{root}/nowhere"], 2, "does not exist"),
    (["compare", "{root}/tensor", "{root}/tensor", "-o", "{root}/a_file"], 2, "is a file"),
    (["compare", "{root}/tensor", "{root}/tensor", "-j", "0"], 2, "--jobs"),
    (["compare", "{root}/tensor", "{root}/tensor", "-j", "-3"], 2, "--jobs"),
    (["run-ut", "{root}/tensor", "-o", "{root}/a_file"], 2, "is a file"),
    (["run-ut", "{root}/tensor", "-j", "0"], 2, "--jobs"),
    (["precision-compare", "{root}/tensor", "{root}/tensor", "-o", "{root}/a_file"], 2, "is a file"),
    (["demo", "-o", "{root}/a_file"], 2, "is a file"),
]

# (arguments, exit code, words on stdout): the terminal says what the CSVs say; a damaged record
# is a record problem (exit 1), never a precision verdict
STDOUT_CASES = [
    (["run-ut", "{root}/damaged", "-o", "{root}/ut_damaged"], 1, "damaged records"),
    (["run-ut", "{root}/stats", "-o", "{root}/ut_stats"], 1, "replay them with --random"),   # nothing judged
    (["compare", "{root}/damaged", "{root}/damaged"], 1, "damaged records were not compared"),
]


@pytest.mark.parametrize("args,code,words", STDOUT_CASES, ids=["run-ut damaged", "run-ut statistics-only",
                                                               "compare damaged"])
def test_run_ut_says_why_ops_were_not_replayed(records, args, code, words):
    args = [a.format(root=records) for a in args]
    out = subprocess.run([sys.executable, "-m", "dispatchprobe.cli", *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == code, (out.stdout, out.stderr)
    assert words in out.stdout and "Traceback" not in out.stderr


SLOW_RUN_UT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)   # as a shell's background job inherits it: Ctrl-C still stops run-ut
import dispatchprobe.offline.run_ut as m
_check = m.check_op
m.check_op = lambda *a: (time.sleep(1.5), _check(*a))[1]
from dispatchprobe.cli import main
sys.argv[0] = "dispatchprobe"
main()
"""


def test_ctrl_c_in_run_ut_names_the_file_to_resume(records, tmp_path):
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RUN_UT, "run-ut", str(records / "tensor"), "-o",
                             str(tmp_path / "ut")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the interrupt lands while the last op (exp) is replayed: wait for the row of the one before
    # it (rows of duplicate ops are written at once, before any replay)
    deadline = time.time() + 120
    while time.time() < deadline and not any("aten.mm" in p.read_text()
                                              for p in (tmp_path / "ut").glob("accuracy_checking_result_*.csv")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    saved = next((tmp_path / "ut").glob("accuracy_checking_result_*.csv"))
    assert f"--resume {saved}" in err and "{timestamp}" not in err and err.strip().count("\n") == 0


def test_run_ut_takes_sigint_back_and_then_returns_it():
    """run-ut's Ctrl-C works when the process got SIGINT ignored and blocked; after the command the
    process has them as before (run in-process, e.g. by CliRunner, it leaves nothing changed)."""
    import signal
    from dispatchprobe.cli import interruptible
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        with interruptible():
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("args,code,words", CASES, ids=[" ".join(a.replace("{root}/", "") for a in c[0]) for c in CASES])
def test_cli_bad_input(records, args, code, words):
    args = [a.format(root=records) for a in args]
    out = subprocess.run([sys.executable, "-m", "dispatchprobe.cli", *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == code, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and words in out.stderr
    problems = [line for line in out.stderr.splitlines() if line.lower().startswith(("error", "usage", "try"))
                or "damaged" in line]
    assert problems, out.stderr


def test_show_says_how_much_a_clean_inline_check_checked(records):
    out = subprocess.run([sys.executable, "-m", "dispatchprobe.cli", "show", str(records / "clean_overflow")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "op calls checked, none flagged" in out.stdout


@pytest.mark.parametrize("kwargs,words", [
    (dict(dump_path="{root}/a_file"), "is a file"),
    (dict(model=3), "model must be a torch.nn.Module"),
])
def test_probe_construction_errors(records, kwargs, words):
    kwargs = {k: v.format(root=records) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ConfigError, match=words) as err:
        DispatchProbe(**kwargs)
    assert "\n" not in str(err.value)


def test_summary_is_public(tmp_path):
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path))
    with probe:
        torch.ones(3).exp()                 # two op calls: ones, exp
    probe.close()
    assert probe.summary() == {"task": "overflow", "checked": 2, "flagged": 0, "critical": 0, "propagated": 0,
                               "suspicious growth": 0, "expected": 0, "scale collapse": 0, "discarded": 0}
