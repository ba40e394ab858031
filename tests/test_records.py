"""Records on disk: crash safety, truncated tails, reading without torch, version checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from dispatchprobe import DispatchProbe, RecordError, load

TRAIN_FOREVER = textwrap.dedent("""
    import sys, torch
    from dispatchprobe import DispatchProbe
    from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
    model = TinyTransformer()
    probe = DispatchProbe(task="tensor", dump_path=sys.argv[1])
    step = 0
    while True:
        tokens, targets = lm_batch(seed=step)
        with probe:
            lm_loss(model, tokens, targets).backward()
            print("step", step, flush=True)
        probe.step()
        step += 1
""")


def test_sigkill_leaves_readable_records(tmp_path):
    path = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_FOREVER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        # let it finish a couple of steps, then kill it mid-step
        assert proc.stdout.readline().startswith("step 0")
        assert proc.stdout.readline().startswith("step 1")
        time.sleep(0.15)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    run = load(path)
    assert (0, 0) in run.parts and (1, 0) in run.parts
    done = run.part(0, 0)
    assert not done.truncated and len(done.records) > 100
    # every tensor of a finished step is readable
    keys = {t["data"] for r in done.records for t in r.get("outputs", []) if t.get("type") == "tensor"}
    assert len(done.tensors_of(keys)) == len(keys)
    # the last (killed) part reads up to its last flushed op without raising
    last = run.parts[max(run.parts)]
    assert isinstance(last.records, list)
    assert len(run.ops) >= 2 * len(done.records)


def test_truncated_tail_is_reported_not_fatal(tiny_run):
    ops = tiny_run / "step1" / "rank0" / "ops.jsonl"
    data = ops.read_bytes()
    ops.write_bytes(data[: len(data) - 37])        # a torn final line
    run = load(tiny_run)
    part = run.part(1, 0)
    assert part.truncated
    assert len(part.records) == data.count(b"\n") - 1
    assert any("incomplete" in p for p in run.problems)


def test_missing_and_corrupt_inputs(tmp_path, tiny_run):
    with pytest.raises(RecordError, match="no such records directory"):
        load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordError, match="no op records"):
        load(tmp_path / "empty")
    manifest = tiny_run / "manifest.json"
    m = json.loads(manifest.read_text())
    m["format_version"] = 99
    manifest.write_text(json.dumps(m))
    with pytest.raises(RecordError, match="newer than this"):
        load(tiny_run)
    manifest.write_text("{not json")
    with pytest.raises(RecordError, match="corrupt manifest"):
        load(tiny_run)


def test_step_rank_folder_loads_alone(tiny_run):
    run = load(tiny_run / "step1" / "rank0")
    assert list(run.parts) == [(1, 0)]
    assert run.manifest["format"] == "dispatchprobe-records"


def test_reader_needs_no_torch(tiny_run):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None          # any import of torch now fails
        import dispatchprobe
        run = dispatchprobe.load({str(tiny_run)!r})
        ops = run.ops
        part = run.part(0, 0)
        rec = next(r for r in part.records if r["op"] == "aten.mm.default")
        arr = part.tensor(rec["outputs"][0]["data"])
        assert list(arr.shape) == rec["outputs"][0]["shape"]
        print(len(ops), len(run.tensors))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n_ops, n_tensors = map(int, out.stdout.split())
    assert n_ops > 100 and n_tensors > n_ops


def test_bf16_tensors_read_exactly(tmp_path):
    import numpy as np
    import torch
    from dispatchprobe import DispatchProbe
    x = torch.randn(8, 8).bfloat16()
    probe = DispatchProbe(task="tensor", dump_path=str(tmp_path / "bf"))
    with probe:
        y = x * 3
    probe.close()
    part = load(tmp_path / "bf").part()
    rec = part.records[0]
    assert rec["outputs"][0]["dtype"] == "bfloat16"
    np.testing.assert_array_equal(part.tensor(rec["outputs"][0]["data"]), y.float().numpy())


def test_walk_names_arguments_and_signature_ignores_values():
    from dispatchprobe.records.format import call_signature, output_shapes, walk

    def t(key):
        return {"type": "tensor", "dtype": "float32", "shape": [2], "stride": [1], "data": key}
    rec = {"op": "aten.cat.out", "inputs": [{"type": "list", "value": [t("a"), t("b")]}, {"type": "int", "value": 0}],
           "kwargs": {"out": t("c")}, "outputs": [t("c")]}
    assert [arg for _, arg, _ in walk(rec)] == ["input.0.0", "input.0.1", "input.out", "output.0"]
    assert output_shapes(rec) == ((2,),)
    other = json.loads(json.dumps(rec))
    other["inputs"][0]["value"][0].update(data="x", stats={"max": 1.0})
    assert call_signature(other) == call_signature(rec)
    other["inputs"][1]["value"] = 1
    assert call_signature(other) != call_signature(rec)
    empty, none = dict(rec, inputs=[{"type": "list", "value": []}]), dict(rec, inputs=[{"type": "none"}])
    assert call_signature(empty) != call_signature(none)


def _every_dtype_tensor():
    """One small tensor of every dtype torch can make values of (sub-byte ints and quantized
    dtypes have no elementwise values to record), with extreme and awkward values."""
    import torch
    base = torch.tensor([0.0, 1.5, -2.0, 3.0e4, 1e-3, 7.0])
    out = {}
    for dt in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        try:
            if dt.is_complex:
                t = torch.complex(base, -base).to(dt)
            elif dt == torch.bool:
                t = base != 0
            elif dt.is_floating_point:
                t = base.to(dt)
            elif dt == torch.uint32:
                t = torch.tensor([4128883887, 1, 2, 3, 4, 5]).to(dt)
            elif dt == torch.uint64:
                t = torch.tensor([2**63 - 7, 1, 2, 3, 4, 5]).to(dt)
            else:
                t = base.to(torch.int64).to(dt)
        except (NotImplementedError, RuntimeError):
            continue
        out[str(dt).removeprefix("torch.")] = t
    return out


def test_every_dtype_round_trips_exactly(tmp_path):
    """Saved tensors keep their values whatever the dtype (never widened, narrowed or cut to
    real parts); the reader gives numpy arrays holding exactly those values."""
    import torch
    tensors = _every_dtype_tensor()
    assert {"complex128", "complex32", "complex64", "uint32", "uint64", "float8_e4m3fn", "float8_e8m0fnu",
            "bfloat16", "bool"} <= set(tensors)
    probe = DispatchProbe(task="tensor", dump_path=str(tmp_path / "run"))
    with probe:
        for t in tensors.values():
            t.clone()
    probe.close()
    part = load(tmp_path / "run").parts[(0, 0)]
    seen = set()
    for rec in part.records:
        spec = rec["outputs"][0]
        t = tensors[spec["dtype"]]
        if t.dtype == torch.complex32:
            want = t.to(torch.complex64).numpy()
        elif t.dtype == torch.bfloat16 or t.dtype.itemsize == 1 and t.dtype.is_floating_point:
            want = t.float().numpy()
        else:
            want = t.numpy()
        got = part.tensor(spec["data"])
        assert got.shape == want.shape and got.dtype == want.dtype, spec["dtype"]
        assert np.array_equal(got, want, equal_nan=True), spec["dtype"]
        assert spec["stats"] is not None
        seen.add(spec["dtype"])
    assert seen == set(tensors)


def _record_once(path, scale: float, **kw):
    import torch
    probe = DispatchProbe(task="tensor", dump_path=str(path), **kw)
    with probe:
        (torch.arange(6.0) * scale).exp()
    probe.close()


def test_a_run_directory_never_holds_two_runs(tmp_path):
    """Recording again into a run directory is refused with one line naming the option, and the
    first run stays as it was; with overwrite=True the first run's records are replaced whole."""
    from dispatchprobe import ConfigError
    path = tmp_path / "run"
    _record_once(path, 1.0)
    shard = next((path / "step0" / "rank0" / "tensors").glob("shard_*.safetensors"))
    before = (shard.read_bytes(), (path / "step0" / "rank0" / "ops.jsonl").read_text())
    with pytest.raises(ConfigError, match="already holds records of rank 0.*overwrite=True") as err:
        _record_once(path, 2.0)
    assert "\n" not in str(err.value)
    assert (shard.read_bytes(), (path / "step0" / "rank0" / "ops.jsonl").read_text()) == before
    _record_once(path, 2.0, overwrite=True)
    part = load(path).parts[(0, 0)]
    assert [r["id"] for r in part.records] == list(range(len(part.records)))
    exp = next(r for r in part.records if r["op"] == "aten.exp.default")
    assert np.allclose(part.tensor(exp["inputs"][0]["data"]), np.arange(6.0) * 2)


FULL_DISK = textwrap.dedent("""
    import contextlib, json, resource, signal, sys, warnings
    import torch
    from dispatchprobe import DispatchProbe
    from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss

    def train(probe):
        torch.manual_seed(0)
        model = TinyTransformer(dropout=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            tokens, targets = lm_batch(seed=step)
            with probe if probe is not None else contextlib.nullcontext():
                loss = lm_loss(model, tokens, targets)
                loss.backward()
            opt.step(); opt.zero_grad()
            if probe is not None:
                probe.step()
            losses.append(loss.item())
        return losses

    plain = train(None)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = DispatchProbe(task=sys.argv[3], dump_path=sys.argv[1])
        probed = train(probe)
        probe.close()
    print(json.dumps({"plain": plain, "probed": probed, "warnings": [str(w.message) for w in caught],
                      "failed": probe.failed}))
""")


@pytest.mark.parametrize("task,limit", [("tensor", 20_000), ("tensor", 400_000), ("statistics", 20_000)])
def test_full_disk_stops_recording_not_training(tmp_path, task, limit):
    """Records that cannot be written (here: a file size limit, as on a full disk) end the
    recording with one warning; training computes exactly what it computes unprobed, and what
    was written before stays readable.  The statistics task's records are written by its
    compiled encoder where it is loaded."""
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "run"), str(limit), task],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["probed"] == res["plain"]
    assert res["failed"] and "writing" in res["failed"]
    stopped = [w for w in res["warnings"] if "recording stopped" in w]
    assert len(stopped) == 1 and "\n" not in stopped[0]
    run = load(tmp_path / "run")
    for part in run.parts.values():
        for rec in part.records:
            for spec in (s for s in rec.get("outputs", ()) if s.get("type") == "tensor" and s.get("data")):
                if part.has_tensor(spec["data"]):
                    part.tensor(spec["data"])


KILL_TRIALS = textwrap.dedent("""
    import os, random, signal, sys, time, torch
    from dispatchprobe import DispatchProbe
    from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
    torch.set_num_threads(1)
    model = TinyTransformer(dim=32, heads=2, layers=1, seq=16)
    warm = DispatchProbe(task="tensor", dump_path=os.path.join(sys.argv[1], "warm-up"))
    with warm:                                         # imports and first-use costs before forking
        lm_loss(model, *lm_batch(batch=2, seq=16, seed=0)).backward()
    warm.close()
    rng = random.Random(0)
    for trial in range(int(sys.argv[2])):
        delay = rng.uniform(0.05, 0.5)
        pid = os.fork()
        if pid == 0:                                   # the child records until it is killed
            probe = DispatchProbe(task="tensor", dump_path=os.path.join(sys.argv[1], str(trial)))
            step = 0
            while True:
                with probe:
                    lm_loss(model, *lm_batch(batch=2, seq=16, seed=step)).backward()
                probe.step()
                step += 1
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
""")


def test_random_sigkills_leave_records_whose_tensors_match_them(tmp_path):
    """20 recordings killed at random moments: every record that reads back references tensors
    that are complete, or reported missing, never changed: each one that loads matches the
    statistics recorded with it."""
    out = subprocess.run([sys.executable, "-c", KILL_TRIALS, str(tmp_path), "20"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    checked = 0
    for trial in range(20):
        if not list((tmp_path / str(trial)).glob("step*/rank*/ops.jsonl")):
            continue                                    # killed before its first record
        for part in load(tmp_path / str(trial)).parts.values():
            for rec in part.records:
                for spec in rec.get("outputs", ()):
                    if spec.get("type") != "tensor" or not spec.get("data") or not part.has_tensor(spec["data"]):
                        continue
                    arr = np.asarray(part.tensor(spec["data"]), dtype=np.float64)
                    stats = spec["stats"]
                    if arr.size and np.isfinite(arr).all():
                        assert arr.max() == stats["max"] and arr.min() == stats["min"], rec["name"]
                        assert np.isclose(arr.mean(), stats["mean"], rtol=1e-4, atol=1e-6), rec["name"]
                    checked += 1
    assert checked > 300


def test_step_end_writes_beside_the_writer_thread_in_closing_order(tmp_path, monkeypatch):
    """The step end writes the closed shards the writer thread has not taken while that thread
    is still writing its own (another file); the index lists every shard in the order it closed,
    numbered in that order, whichever thread wrote it, and each reads back as saved."""
    import threading
    import torch
    from dispatchprobe.records import writer
    from dispatchprobe.records.reader import read_safetensors
    from dispatchprobe.torch import tensor_backend as backend
    monkeypatch.setattr(writer, "SHARD_BYTES", 1024)       # one 16x16 float32 value a shard
    writing, wrote = threading.Event(), []

    def save(tensors, path):
        start = time.monotonic()
        if threading.current_thread().name == "dispatchprobe-writer" and not writing.is_set():
            writing.set()
            time.sleep(0.5)             # the writer thread still at its first shard at the flush
        backend.save_shard(tensors, path)
        wrote.append((threading.current_thread().name, start, time.monotonic()))
    w = writer.TensorShardWriter(str(tmp_path), save, backend.nbytes)
    values = {f"t{i}": torch.randn(16, 16) for i in range(5)}
    w.put("t0", backend.snapshot(values["t0"]))
    assert writing.wait(30)
    for key in list(values)[1:]:
        w.put(key, backend.snapshot(values[key]))
    w.put_view("v", "t4", 16, [16], [1])
    w.flush()
    first = {}
    for name, start, end in wrote:
        first.setdefault(name, (start, end))
    assert first["MainThread"][0] < first["dispatchprobe-writer"][1], wrote    # beside it, not after
    lines = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]
    assert [(line["shard"], line["keys"]) for line in lines] == \
        [(f"shard_{i:05d}.safetensors", [f"t{i}"]) for i in range(5)] + [(None, [])]
    assert lines[-1]["views"] == {"v": {"base": "t4", "offset": 16, "shape": [16], "stride": [1]}}
    for i, (key, value) in enumerate(values.items()):
        assert np.array_equal(read_safetensors(str(tmp_path / lines[i]["shard"]))[key], value.numpy())
    w.close()


def test_queued_tensors_reach_disk_without_a_flush(tmp_path, monkeypatch):
    """Tensors reach the writer thread in batches, yet a process that hangs mid-step (a collective
    that never returns) and is then killed leaves those queued up to ``SHARD_SECONDS`` before:
    the writer's own tick takes them, though they filled neither a batch nor a shard."""
    import torch
    from dispatchprobe.records import writer
    from dispatchprobe.records.reader import read_safetensors
    from dispatchprobe.torch import tensor_backend as backend
    monkeypatch.setattr(writer, "SHARD_SECONDS", 0.2)
    w = writer.TensorShardWriter(str(tmp_path), backend.save_shard, backend.nbytes)
    values = {f"t{i}": torch.randn(5, 3) for i in range(3)}
    for key, value in values.items():
        w.put(key, backend.snapshot(value))
    w.put_view("v", "t0", 3, [3], [1])
    index = tmp_path / "index.jsonl"
    deadline = time.monotonic() + 30
    while not (index.exists() and index.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "nothing written without a flush"
        time.sleep(0.05)
    line = json.loads(index.read_text().splitlines()[0])
    assert line["keys"] == list(values) and line["views"]["v"]["base"] == "t0"
    arrays = read_safetensors(str(tmp_path / line["shard"]))
    for key, value in values.items():
        assert np.array_equal(arrays[key], value.numpy())
    w.close()
