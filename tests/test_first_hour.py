"""What a new user meets in the first hour: every message true.  Each test is one message that
once said something untrue (a mask counted as nan/inf trouble, two accounts of one overflow
run, a report that did not exist, nothing judged reported as success, a resume that skipped
everything, an agreement of a run with itself, a step folder refused, a partial run unmarked)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import dispatchprobe
from dispatchprobe import ConfigError, DispatchProbe
from dispatchprobe.cli import main
from dispatchprobe.offline.summary import summarize
from tests.conftest import train


@pytest.fixture
def stats_run(tmp_path):
    """One statistics step of the tiny transformer (its causal mask holds an intended -inf)."""
    path = tmp_path / "stats"
    train(DispatchProbe(task="statistics", dump_path=str(path)), steps=1)
    return path


def test_mask_inf_is_not_reported_as_trouble(stats_run, tmp_path):
    text = summarize(dispatchprobe.load(stats_run))
    assert "none made from finite values" in text and "intended" in text
    two_steps = tmp_path / "two"
    train(DispatchProbe(task="statistics", dump_path=str(two_steps)), steps=2)
    # each layer's mask and softmax input, in each step: 8 tensors of 8 records
    assert "nan/inf    8 tensors in 8 records: none made from finite values, 4 written from an inf/nan constant" \
        in summarize(dispatchprobe.load(two_steps))
    # an inf made from finite values is named first
    path = tmp_path / "made"
    with DispatchProbe(task="statistics", dump_path=str(path)) as probe:
        x = torch.full((4,), 1e30)
        (x * x).sum()
    probe.close()
    text = summarize(dispatchprobe.load(path))
    assert "1 made from finite values" in text and "first made from finite values" in text
    assert re.search(r"aten\.mul\.Tensor\.0\.forward output\.0 .* inf=4", text), text


def test_overflow_demo_finds_an_overflow_and_gives_one_account(tmp_path):
    """The overflow demo finds a real overflow (float16 attention scores past 65504 from finite inputs);
    the terminal, `show`, overflow.csv and the HTML page count the same run the same way."""
    out = tmp_path / "ovf"
    demo = CliRunner().invoke(main, ["demo", "--task", "overflow", "-o", str(out), "--steps", "2"])
    assert demo.exit_code == 0, demo.output
    rows = [r for f in sorted(out.glob("step*/rank*/overflow.csv")) for r in csv.DictReader(open(f))]
    critical = [r for r in rows if r["class"] == "critical"]
    assert len(critical) == 1 and critical[0]["op"] == "aten.bmm.default", rows
    assert critical[0]["dtype"] == "float16" and critical[0]["replay"] == "precision"   # float64 stays finite
    record = dispatchprobe.load(out).tensors
    record = record[record["name"] == critical[0]["name"]]
    inputs, outputs = record[record["io"] == "input"], record[record["io"] == "output"]
    assert (inputs["inf"] == 0).all() and (inputs["nan"] == 0).all() and (outputs["inf"] > 0).all(), record
    line = next(s for s in demo.output.splitlines() if "op calls checked" in s)
    assert line.endswith(", 1 flagged") and "none flagged" not in demo.output, demo.output
    show = CliRunner().invoke(main, ["show", str(out), "--html", str(tmp_path / "ovf.html")])
    assert show.exit_code == 0 and line in show.output, show.output
    assert "1 critical" in (tmp_path / "ovf.html").read_text()
    # the overflow's message names its standalone repro, which shows it again with torch alone
    command = f"dispatchprobe repro {out} {critical[0]['name']} -o repro"
    assert f"a standalone repro: {command}" in demo.output, demo.output
    assert f"a standalone repro: {command}/{critical[0]['name']}\n" in show.output, show.output     # show says it too
    made = CliRunner().invoke(main, command.split()[1:-1] + [str(tmp_path / "repro")])
    assert made.exit_code == 0, made.output
    again = subprocess.run([sys.executable, str(tmp_path / "repro" / "repro.py")], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2 and "output.0 float16" in again.stdout, again.stdout + again.stderr
    assert int(re.search(r"inf/nan mismatches (\d+)", again.stdout).group(1)) == int(critical[0]["inf"])


def test_free_benchmark_demo_counts_unchecked_ops_apart_from_flagged_ones(tmp_path):
    """The float32-only op calls improve_precision leaves alone are said to be unchecked, apart from
    the flagged ones (it read "12 flagged; 12 not widened", as if the flagged ones failed to widen)."""
    out = tmp_path / "fb"
    demo = CliRunner().invoke(main, ["demo", "--task", "free_benchmark", "-o", str(out), "--steps", "1"])
    assert demo.exit_code == 0, demo.output
    counts = __import__("json").loads((out / "step0" / "rank0" / "checks.json").read_text())
    line = next(s for s in demo.output.splitlines() if "op calls checked" in s)
    assert line == (f"free_benchmark: {counts['checked']} op calls checked, {counts['flagged']} flagged; "
                    f"{counts['not_widened']} other op calls left unchecked (float32 inputs only: improve_precision "
                    "re-runs 16-bit ones)"), line
    assert counts["flagged"] > 0 and counts["not_widened"] > 0 and "not widened" not in demo.output


def test_compare_of_an_overflow_run_with_a_statistics_run_says_the_tasks_differ(tmp_path):
    """The overflow demo's model recorded twice, by the overflow check (only the op it flagged) and by
    statistics (every op): the flagged op is judged against its twin and agrees; the ops only the
    statistics run has are explained, never suspects; the verdict says the tasks differ (it hinted
    "different models?"), whichever run is A."""
    from dispatchprobe.demo import demo_model, run_demo
    from dispatchprobe.models import lm_batch, lm_loss
    run_demo(str(tmp_path / "ovf"), task="overflow", steps=1)
    model = demo_model("overflow")
    tokens, targets = lm_batch(seed=0)
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "stats"), level="mix", model=model)
    with probe:
        lm_loss(model, tokens, targets).backward()
    probe.close()
    for a, b in (("ovf", "stats"), ("stats", "ovf")):
        res = CliRunner().invoke(main, ["compare", str(tmp_path / a), str(tmp_path / b)])
        assert res.exit_code == 0, res.output
        ta, tb = ("overflow", "statistics") if a == "ovf" else ("statistics", "overflow")
        side = "A" if a == "ovf" else "B"
        assert (f"the runs used different tasks, A {ta} and B {tb}: {side} (overflow) holds only the ops it "
                "flagged; compare judged those ops against the other run's same ops") in res.output, res.output
        assert "different models" not in res.output and "present only in run" not in res.output
        assert re.search(r"compared \d+ tensors .*: pass \d+, warning 0, error 0", res.output), res.output


def test_compare_without_out_says_how_to_list_problems(tmp_path):
    def run(path, steps, extra):
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        for _ in range(steps):
            with probe:
                y = torch.ones(3) * 2
                if extra:
                    y + 1
            probe.step()
        probe.close()
    run(tmp_path / "a", 7, True)     # each step: one record B does not have (a problem per step)
    run(tmp_path / "b", 7, False)
    _, verdict = dispatchprobe.compare(str(tmp_path / "a"), str(tmp_path / "b"))
    text = str(verdict)
    assert "more problems (add -o DIR to list them in DIR/compare.html)" in text and "see the report" not in text
    _, verdict = dispatchprobe.compare(str(tmp_path / "a"), str(tmp_path / "b"), out=str(tmp_path / "rep"))
    assert "more problems (listed in the report)" in str(verdict)
    assert "could not be aligned" in (tmp_path / "rep" / "compare.html").read_text()
    run(tmp_path / "c", 1, False)    # steps of one run only: one line, however many
    text = str(dispatchprobe.compare(str(tmp_path / "b"), str(tmp_path / "c")).verdict)
    assert f"steps 1..6 (6) x rank 0: 6 step/rank part(s) only in {tmp_path / 'b'}; not compared" in text, text


def test_compare_a_run_with_itself_says_so(stats_run):
    result = CliRunner().invoke(main, ["compare", str(stats_run), str(stats_run / "step0")])
    assert result.exit_code == 0 and "A and B are the same records" in result.output, result.output


def test_run_ut_judging_nothing_fails(stats_run, tmp_path):
    result = CliRunner().invoke(main, ["run-ut", str(stats_run), "-o", str(tmp_path / "ut"), "--api", "addmm"])
    assert result.exit_code == 1, result.output
    assert "error: no op was judged: all" in result.output and "--random" in result.output


INTERRUPT_AT_MM = '''
import torch
lib = torch.library.Library("aten", "IMPL")
def mm(a, b):
    raise KeyboardInterrupt
lib.impl("mm", mm, "CPU")
'''


def test_random_run_ut_resumes_as_it_ran(stats_run, tmp_path):
    """Interrupted, a --random run-ut prints a resume command that replays the rest with
    generated inputs (as would the printed command without --random, from the kept options)."""
    (tmp_path / "interrupt_at_mm.py").write_text(INTERRUPT_AT_MM)
    env_path = f"{tmp_path}:{':'.join(sys.path)}"
    out = subprocess.run([sys.executable, "-m", "dispatchprobe.cli", "run-ut", str(stats_run), "--random",
                          "-o", str(tmp_path / "ut"), "--import", "interrupt_at_mm"], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": env_path})
    assert out.returncode == 130, out.stderr
    saved = re.search(r"--resume (\S+)", out.stderr).group(1)
    assert f"run-ut {stats_run} --random --resume {saved}" in out.stderr
    done = len(list(csv.reader(open(saved)))) - 1
    assert done > 0
    # the command as a user might retype it, without --random: the kept options still apply
    res = dispatchprobe.run_ut(str(stats_run), resume=saved)
    assert not res.results["Message"].str.contains("statistics-only").any()
    assert res.replayed == len(res.results) - done
    # a resume by an older, option-less pass skipped them: --random judges those again
    (tmp_path / "ut" / re.sub(r"result_(.*)\.csv", r"options_\1.json", saved.split("/")[-1])).unlink()
    rows = list(csv.reader(open(saved)))
    for r in rows[done + 1:]:
        r[7], r[9] = "SKIP", "inputs were not saved (statistics-only records: replay them with --random)"
    with open(saved, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    res = dispatchprobe.run_ut(str(stats_run), resume=saved, random=True)
    assert not res.results["Message"].str.contains("statistics-only").any()
    assert len(res.results) == len(rows) - 1


def test_show_reads_a_step_folder_and_marks_a_partial_step(stats_run, tmp_path):
    result = CliRunner().invoke(main, ["show", str(stats_run / "step0")])
    assert result.exit_code == 0 and "steps      0   ranks 0" in result.output, result.output
    assert "partial" not in result.output
    path = tmp_path / "cut"
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    for _ in range(2):
        with probe:
            torch.ones(3) * 2
        probe.step()
    with probe:                  # the process "stops" here: no probe.step(), no probe.close()
        torch.ones(3) * 2
    text = summarize(dispatchprobe.load(path))
    assert "partial    step 2 rank 0: this step never closed" in text
    assert "step 0" not in text.split("partial", 1)[1] and text.count("partial ") == 1
    probe.close()
    assert "partial" not in summarize(dispatchprobe.load(path))


def test_rerun_into_the_same_dump_path_says_what_to_do(stats_run):
    with pytest.raises(ConfigError) as err:
        with DispatchProbe(task="statistics", dump_path=str(stats_run)):
            torch.ones(2) + 1
    msg = str(err.value)
    assert "a new dump_path" in msg and "overwrite=True" in msg and "probe.step()" in msg


def test_an_unclosed_check_that_flagged_nothing_says_why_it_is_empty(tmp_path):
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path / "ovf"))
    with probe:
        torch.ones(3) * 2
    with pytest.raises(dispatchprobe.RecordError, match=r"hold no records yet.*probe\.close\(\)"):
        dispatchprobe.load(tmp_path / "ovf")
    probe.close()
    assert "2 op calls checked, none flagged" in summarize(dispatchprobe.load(tmp_path / "ovf"))


def test_two_run_ut_in_one_second_keep_their_own_files(tmp_path):
    """A second run-ut into the same folder never reads the first one's rows as its own."""
    path = tmp_path / "t"
    with DispatchProbe(task="tensor", dump_path=str(path)) as probe:
        torch.ones(3) * 2
    probe.close()
    first = dispatchprobe.run_ut(str(path), str(tmp_path / "ut"))
    second = dispatchprobe.run_ut(str(path), str(tmp_path / "ut"))
    assert first.result_csv != second.result_csv and second.replayed == first.replayed == 2


@pytest.mark.parametrize("config, says", [
    ({"task": "overflow", "overflow_nums": 0}, "config: overflow_nums=0: the number of critical overflows to stop "
                                               "at (1 or more), or -1 to check on to the end"),
    ({"task": "overflow", "overflow_nums": -2}, "config: overflow_nums=-2:"),
    ({"task": "overflow", "overflow_num": 2}, "config: unknown key 'overflow_num'; did you mean 'overflow_nums'?"),
    ({"free_benchmark": {"pert_mod": "add_noise"}}, "unknown key 'pert_mod' in 'free_benchmark'; did you mean "
                                                     "'pert_mode'?"),
    ({"task": "statistics", "statistics": {"scop": []}}, "unknown key 'scop' in 'statistics'; did you mean 'scope'?"),
])
def test_config_mistakes_are_one_line_that_says_what_to_write(tmp_path, config, says):
    """overflow_nums=0 ran as 1; a misspelt key listed all 39 keys without naming the one meant."""
    with pytest.raises(ConfigError) as err:
        DispatchProbe({**config, "dump_path": str(tmp_path / "run")})
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert "allowed keys" not in str(err.value)
    assert not (tmp_path / "run").exists()

