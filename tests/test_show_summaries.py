"""``dispatchprobe show`` from the per-part summaries written when a step closes
(``summary.json``, dispatchprobe/records/part_summary.py): the same text as from the records on
every kind of run, and the records read instead wherever a summary is missing, stale or damaged
(an old run, a killed process, records appended or cut since)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import DispatchProbe, load
from dispatchprobe.cli import main
from dispatchprobe.offline.summary import summarize
from dispatchprobe.records import part_summary

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record, record_net  # noqa: E402
from test_grad_show import _grad_run  # noqa: E402
from test_nonfinite_badges import inf_gelu  # noqa: E402

OPTIONS = [[], ["--stage", "forward"], ["--stage", "backward"], ["--top", "3"]]


@contextlib.contextmanager
def rank(n: int):
    """Record as rank ``n`` of a launcher (its RANK variable), for a two-rank run in one process."""
    old = os.environ.get("RANK")
    os.environ["RANK"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["RANK"]
        else:
            os.environ["RANK"] = old


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("summaries")
    out = {"statistics": record(root / "statistics", task="statistics", steps=2),
           "op level": record(root / "op_level", task="statistics", level="op"),
           "tensor": record(root / "tensor", task="tensor"),
           "no nan/inf": record_net(root / "finite", task="statistics", steps=2)}
    with inf_gelu():        # inf made from finite values, beside the causal mask's -inf constant
        out["nan/inf"] = record(root / "nonfinite", task="statistics", steps=2)
        out["overflow"] = record(root / "overflow", task="overflow", steps=2, overflow_nums=-1)
    for n in (0, 1):
        with rank(n):
            out["two ranks"] = record(root / "ranks", task="statistics", steps=2, level="op", batch=2 + n)
    out["grad probe"] = _grad_run(root / "grads", steps=2)
    return out


def without_summaries(run, tmp_path):
    """A copy of ``run`` as a run written before summaries were (or by a process killed at each
    step's close): its records only."""
    copy = tmp_path / f"{os.path.basename(run)}_records"
    shutil.copytree(run, copy)
    for folder, _, files in os.walk(copy):
        if part_summary.FILE in files:
            os.remove(os.path.join(folder, part_summary.FILE))
    return copy


def show(path, *options):
    result = CliRunner().invoke(main, ["show", str(path), *options])
    return result.exit_code, result.output


@pytest.mark.parametrize("kind", ["statistics", "op level", "tensor", "no nan/inf", "nan/inf", "overflow",
                                  "two ranks", "grad probe"])
def test_show_prints_the_same_from_summaries_as_from_records(runs, kind, tmp_path):
    run = runs[kind]
    parts = load(run).parts
    summaries = [part_summary.read(p.path) for p in parts.values()]
    if kind == "grad probe":        # no ops.jsonl: grads.jsonl, one small record per parameter, is read
        assert summaries == [None] * len(parts)
    else:
        assert None not in summaries and len(summaries) == len(parts), "every closed step has its summary"
    if kind == "no nan/inf":        # summarised from the records' first fields only
        for part in parts.values():
            with open(os.path.join(part.path, "ops.jsonl"), "rb") as f:
                assert part_summary._heads(f.read()) is not None
    copy = without_summaries(run, tmp_path)
    for options in OPTIONS:
        code, text = show(run, *options)
        assert code == 0, text
        assert show(copy, *options) == (code, text.replace(str(run), str(copy))), options


def test_summaries_hold_what_the_records_say(runs):
    """Independent of the merge: the counts `show` prints are those of the records' tables."""
    run = load(runs["nan/inf"])
    text = summarize(run)
    ops = run.ops
    kernel = ops[ops["kind"] == "op"]
    assert f"records {len(ops)}" in text
    for op, n in kernel["op"].value_counts().head(10).items():
        assert f"  {n:7d}  {op}" in text
    tensors = run.tensors
    bad = tensors[(tensors["nan"].fillna(0) > 0) | (tensors["inf"].fillna(0) > 0)]
    assert f"nan/inf    {len(bad)} tensors in {len(set(zip(bad['step'], bad['id'])))} records: " in text
    assert "step 0 rank 0 aten.gelu.default.0.forward output.0 [TinyTransformer.layers.0.mlp] nan=0 inf=1" in text
    two = summarize(load(runs["two ranks"]))
    assert "steps      0-1   ranks 0-1" in two


def test_stale_damaged_or_foreign_summaries_are_not_read(runs, tmp_path):
    """A summary counts only while it describes its part's ops.jsonl as it is: records appended
    after it, a summary cut short, or one of another version send `show` to the records."""
    run = tmp_path / "run"
    shutil.copytree(runs["statistics"], run)
    before = summarize(load(run))
    folder = run / "step1" / "rank0"
    ops = folder / "ops.jsonl"
    first = ops.read_bytes().split(b"\n", 1)[0] + b"\n"
    with open(ops, "ab") as f:          # one more record after the step closed
        f.write(first)
    assert part_summary.read(str(folder)) is None
    n = int(before.split("records ", 1)[1].split()[0])
    assert f"records {n + 1}" in summarize(load(run))
    ops.write_bytes(ops.read_bytes()[:-len(first)])
    assert part_summary.read(str(folder)) is not None and summarize(load(run)) == before
    summary = folder / part_summary.FILE
    whole = summary.read_bytes()
    summary.write_bytes(whole[:len(whole) // 2])        # the process died while writing it
    assert part_summary.read(str(folder)) is None and summarize(load(run)) == before
    foreign = json.loads(whole)
    foreign["version"] = part_summary.VERSION + 1
    summary.write_text(json.dumps(foreign))
    assert part_summary.read(str(folder)) is None and summarize(load(run)) == before


def test_a_torn_part_writes_no_summary(tmp_path):
    """A part whose last line is torn (the disk filled mid-record) is left to the reader, which
    reports it: its summary would hide that."""
    folder = tmp_path / "step0" / "rank0"
    folder.mkdir(parents=True)
    (folder / "ops.jsonl").write_bytes(b'{"id":0,"kind":"op","name":"a","op":"a","stage":"forward","scope":"m"}\n{"id":1')
    assert not part_summary.write(str(folder))
    assert not (folder / part_summary.FILE).exists()


def test_records_not_starting_with_the_skeleton_are_read_whole(tmp_path):
    """Lines whose first fields are not the recorder's (another writer's key order, a ``call`` key
    only nested) are summarised from whole records, to the same counts."""
    folder = tmp_path / "step0" / "rank0"
    folder.mkdir(parents=True)
    t = {"type": "tensor", "dtype": "float32", "shape": [2], "stats": {"max": 1.0, "min": 0.0, "nan": 0, "inf": 0}}
    lines = [{"id": 0, "kind": "op", "name": "aten.mm.default.0.forward", "op": "aten.mm.default",
              "stage": "forward", "scope": "M", "call": 0, "outputs": [t]},
             {"kind": "op", "id": 1, "op": "aten.add.Tensor", "name": "aten.add.Tensor.0.backward",
              "stage": "backward", "scope": "M", "outputs": [dict(t, call=3)], "call": 0}]
    (folder / "ops.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines))
    assert part_summary.write(str(folder))
    summary = part_summary.read(str(folder))
    assert summary == part_summary.reduce(lines, (folder / "ops.jsonl").stat().st_size)
    assert {name: st["ops"] for name, st in summary["stages"].items()} == \
        {"forward": {"aten.mm.default": 1}, "backward": {"aten.add.Tensor": 1}}


def test_only_the_records_holding_nan_inf_or_reruns_are_read_whole(tmp_path):
    """A part with a few records holding nan/inf (every attention's causal mask) and an eager re-run
    of a compiled record: those lines are parsed whole, the others by their first fields, and the
    summary equals the one reduced from every whole record."""
    folder = tmp_path / "step0" / "rank0"
    folder.mkdir(parents=True)

    def tensor(nan=0, inf=0):
        return {"type": "tensor", "dtype": "float32", "shape": [2], "stats": {"max": 1.0, "min": 0.0, "nan": nan,
                                                                              "inf": inf}}
    lines = []
    for i in range(12):
        r = {"id": i, "kind": "op", "name": f"aten.mm.default.{i}.forward", "op": "aten.mm.default",
             "stage": "forward", "scope": f"M.layers.{i % 3}", "call": i, "inputs": [tensor()],
             "outputs": [tensor(inf=2 if i in (3, 7) else 0, nan=1 if i == 7 else 0)]}
        if i == 9:
            r["compiled"] = {"rerun": True}
        lines.append(r)
    (folder / "ops.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines))
    assert part_summary.write(str(folder))
    summary = part_summary.read(str(folder))
    assert summary == part_summary.reduce(lines, (folder / "ops.jsonl").stat().st_size)
    assert summary["reruns"] == 1 and summary["stages"]["forward"]["records"] == 11
    nf = summary["stages"]["forward"]["nonfinite"]
    assert (nf["records"], nf["tensors"]) == (2, 2) and [row["nan"] for row in nf["first"]] == [0, 1]


TRAIN_FOREVER = textwrap.dedent("""
    import sys, time, torch
    from dispatchprobe import DispatchProbe
    from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
    model = TinyTransformer()
    probe = DispatchProbe(task="statistics", dump_path=sys.argv[1], level="op")
    step = 0
    while True:
        tokens, targets = lm_batch(seed=step)
        with probe:
            lm_loss(model, tokens, targets).backward()
            print("step", step, flush=True)
            if step == 2:           # mid-step, its records written: where the test kills it
                time.sleep(600)
        probe.step()
        step += 1
""")


def test_a_killed_run_reads_its_last_step_from_records(tmp_path):
    """A process killed mid-step: the steps it closed are read from their summaries, the one it was
    in from its records (partial, maybe torn), and `show` prints what the records alone say."""
    path = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_FOREVER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        for step in range(3):
            assert proc.stdout.readline().startswith(f"step {step}")
    finally:        # killed mid-step 2, or at once where it did not get there
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    run = load(path)
    closed = {key: part.closed for key, part in run.parts.items()}
    assert closed[(0, 0)] and not all(closed.values())
    for key, part in run.parts.items():     # a summary where the step closed, none where it did not
        assert (part_summary.read(part.path) is not None) == closed[key], key
    code, text = show(path)
    assert "partial" in text or "truncated" in text
    assert show(without_summaries(path, tmp_path)) == (code, text.replace(str(path), str(tmp_path / "killed_records")))


def test_show_reads_no_records_where_summaries_hold(runs, monkeypatch):
    """The fast path: a run whose parts all have summaries is summarised without one record read."""
    from dispatchprobe.records import reader
    monkeypatch.setattr(reader.Part, "records", property(lambda self: pytest.fail(f"read records of {self.path}")))
    for kind in ("statistics", "nan/inf", "two ranks"):
        assert "records " in summarize(load(runs[kind]))


def test_a_run_writes_a_summary_per_closed_step(tmp_path):
    """Both ways a step closes (probe.step() and close) leave the summary of the step's records;
    a step without records (no op selected, a grad-probe step) has none to summarise."""
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "r"), list=["aten.mul"])
    for op in (torch.add, torch.mul, torch.mul):
        with probe:
            op(torch.ones(3), 2)
        probe.step()
    with probe:
        torch.ones(3) * 2
        torch.ones(3) * 3
    probe.close()
    run = load(tmp_path / "r")
    assert list(run.parts) == [(1, 0), (2, 0), (3, 0)]
    assert [part_summary.read(p.path)["stages"]["forward"]["ops"] for p in run.parts.values()] == \
        [{"aten.mul.Tensor": 1}, {"aten.mul.Tensor": 1}, {"aten.mul.Tensor": 2}]
    assert not os.path.exists(tmp_path / "r" / "step0" / "rank0" / part_summary.FILE)


@pytest.mark.mindspore
def test_mindspore_steps_write_the_same_summaries(tmp_path):
    """The MindSpore adapter closes its steps through the same part writer: each step's summary,
    and `show` prints from them what it prints from the records.  The run is recorded in a process
    of its own: MindSpore keeps PyNative gradient state across the tests of one process."""
    pytest.importorskip("mindspore")
    path = tmp_path / "ms"
    script = textwrap.dedent(f"""
        import mindspore as ms
        ms.set_context(mode=ms.PYNATIVE_MODE)
        from dispatchprobe_ms import DispatchProbe
        from dispatchprobe_ms.demo import train
        train(DispatchProbe(task="statistics", dump_path={str(path)!r}, level="mix"), steps=2)
    """)
    env = {**os.environ, "MS_DEV_LAUNCH_BLOCKING": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    parts = load(path).parts
    assert len(parts) == 2 and all(part_summary.read(p.path) is not None for p in parts.values())
    copy = without_summaries(path, tmp_path)
    for options in OPTIONS:
        code, text = show(path, *options)
        assert code == 0 and "op calls" in text, text
        assert show(copy, *options) == (code, text.replace(str(path), str(copy))), options


def test_scanned_lines_summarise_as_parsed_records(tmp_path):
    """The scan of a part's lines (their first fields; nan/inf and re-run lines parsed whole) gives
    the summary of every record parsed whole, on lines that test the scan: escaped and non-ASCII
    strings, null scopes, counts written with spaces, a ``"rerun"`` inside a string, a re-run the
    only record of its op, a nan/inf count on the last line, and the same first fields on many
    lines (counted per line, in the order they first appear)."""
    def tensor(nan=0, inf=0):
        return {"type": "tensor", "dtype": "float32", "shape": [2], "stats": {"max": 1.0, "min": 0.0, "nan": nan,
                                                                              "inf": inf}}
    lines = []
    for i in range(40):
        lines.append({"id": i, "kind": "op" if i % 5 else "module", "name": f"n{i}", "op": f"aten.op{i % 4}",
                      "stage": ["forward", "backward", "b\u00e4ck \"w\"\\d"][i % 3], "scope": None if i % 7 == 0
                      else f"M.l\u00e9yer\t{i % 3}", "call": i, "inputs": [tensor(nan=int(i % 11 == 3))],
                      "outputs": [tensor(inf=2 if i % 9 == 4 else 0)], "kwargs": {"note": {"type": "str",
                                                                                       "value": "\"rerun\""}}})
    lines[5]["compiled"] = {"rerun": True}
    lines[5]["op"] = "aten.only_rerun"
    text = "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=i % 2 == 0) + "\n"
                   for i, r in enumerate(lines))
    text = text.replace('"nan":0,', '"nan": 0 ,', 3).replace('"inf":0}', '"inf" :0}', 2)
    last = dict(lines[-1], id=40, outputs=[tensor(inf=1)])
    text += json.dumps(last, separators=(",", ":")).replace('"inf":1', '"inf" : 1') + "\n"
    folder = tmp_path / "step0" / "rank0"
    folder.mkdir(parents=True)
    (folder / "ops.jsonl").write_text(text, encoding="utf-8")
    data = (folder / "ops.jsonl").read_bytes()
    assert part_summary._heads(data) is not None, "the scan path is the one tested"
    assert part_summary.write(str(folder))
    records = [json.loads(line) for line in text.splitlines()]
    assert part_summary.read(str(folder)) == part_summary.reduce(records, len(data))
    nf = part_summary.read(str(folder))["stages"]["forward"]["nonfinite"]
    assert nf is not None and nf["tensors"] > 0
