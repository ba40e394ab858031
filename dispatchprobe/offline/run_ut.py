"""``run-ut``: replay every recorded op on the device and as a float64 CPU benchmark, judge it.

Results go to ``accuracy_checking_result_{ts}.csv`` (one row per op) and
``accuracy_checking_details_{ts}.csv`` (one row per output), appended and flushed op by op so
an interrupted run loses at most the op it was on; ``resume=`` continues it (see docs/run-ut.md).
Parallel: ``jobs`` worker processes on this host; across processes/nodes: launch under
``torchrun`` and each rank replays a disjoint shard, rank 0 writes the merged result.
Framework-neutral: the replay and its services come from a :class:`~.replayer.Replayer`.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib
import json
import multiprocessing as mp
import os
import re
import sys
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..standards.loader import is_float
from ..standards.metrics import binary_mismatch, columns, compare_arrays, derived
from ..records.format import call_signature, walk
from ..records.reader import Run, load
from ..standards.verdicts import (ERROR, NOT_JUDGED, PASS, SKIP, WARNING, cancelled_scale, category, component_dtype,
                                  direction_readable, expected_magnitude, is_staged, judge, judge_benchmark,
                                  judging_precision, output_category, output_trait, reduction_kind, unique_form,
                                  within_terms, worst)
from ..records.writer import atomic_write_text, write_csv
from .replayer import Distributed, Replayer, ReplayError, Skip, replayer_for

to_numpy = np.asarray   # replayers hand over numpy arrays

RESULT_COLUMNS = ["Step", "Rank", "API Name", "Op", "Stage", "Scope", "Category", "Judged", "Forward Test Success",
                  "Backward Test Success", "Message", "Elapsed (s)"]
_MESSAGE = RESULT_COLUMNS.index("Message")
METRIC_COLUMNS = derived(columns)   # metric column -> metric key (the metric registry)
DETAIL_COLUMNS = derived(lambda: ["Step", "Rank", "API Name", "Output", "Judged", "Category", "Bench Dtype", "Device Dtype",
                                  "Shape"] + list(columns()) + ["MindSpore Rule", "Status", "Message"])
TIMING_COLUMNS = ("Elapsed (s)",)
_NOT_SAVED = "statistics-only records"     # in the replayers' skip reason for inputs that were not saved
# the message of an op whose replay raised (on the device, or comparing its outputs): not judged
NOT_REPLAYED = "could not replay"
_DAMAGED = "damaged record"                # the replayers' skip reason for a saved tensor that cannot be read
_RESULT_RE = re.compile(r"^accuracy_checking_result_(.+)\.csv$")
# what a detail row judged against the float64 benchmark: run-ut's own run of the op on its device,
# or the output the training process computed and saved (an op wrong only where it trained)
REPLAY, RECORDED = "replay", "recorded"


@dataclass
class RunUTResult:
    """What :func:`run_ut` returns: the two tables and where they were written."""

    results: pd.DataFrame
    details: pd.DataFrame
    result_csv: str
    details_csv: str
    replayed: int          # ops replayed by this call (not counting resumed ones)
    seconds: float
    report_html: str = ""  # accuracy_checking_report_{ts}.html: the results by module (rank 0)

    @property
    def counts(self) -> dict:
        v = self.results["Forward Test Success"].fillna("").astype(str) + \
            self.results["Backward Test Success"].fillna("").astype(str)
        return v.value_counts().to_dict()


# ---- the per-op check (runs in workers) -----------------------------------------------------------
class ReplayState:
    """The run being judged in this process, read by :func:`check_op` (and by forked workers,
    which inherit it): records, options, the replayer, its device, open tensor files."""

    def __init__(self, run: Run, options: dict, replayer: Replayer):
        self.run = run
        self.options = options
        self.replayer = replayer
        self.device = replayer.resolve_device(options.get("device"))
        self.sources: dict = {}

    def source(self, key):
        src = self.sources.get(key)
        if src is None:
            src = self.sources[key] = self.replayer.tensor_source(self.run.parts[key])
        return src


_STATE: ReplayState | None = None


def replay_state() -> ReplayState | None:
    """The run :func:`check_op` judges now, or None."""
    return _STATE


@contextlib.contextmanager
def replaying(run: Run, options: dict, replayer: Replayer):
    """Makes ``run`` the one :func:`check_op` judges (here, and in workers forked meanwhile);
    the previous one is back afterwards."""
    global _STATE
    prev, _STATE = _STATE, ReplayState(run, options, replayer)
    try:
        yield _STATE
    finally:
        _STATE = prev


def _fmt(value) -> str:
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)


def output_metrics(device_t, bench_t, dtype: str, cat: str, scale=None) -> dict:
    """Metrics of one output leaf; float and complex outputs get the full set (complex judged by
    its component dtype's tolerances), others binary consistency."""
    d, b = to_numpy(device_t), to_numpy(bench_t)
    if d.shape != b.shape:
        raise ReplayError(f"shape {list(d.shape)} on the device but {list(b.shape)} in the benchmark")
    if is_float(component_dtype(dtype)) and d.dtype.kind in "fc":
        m = compare_arrays(d, b, dtype=component_dtype(dtype), scale=scale)
        m["abs_err_error_rate"] = m["small_value_error_rate"]
        m["binary_mismatch"] = binary_mismatch(d, b) if cat == "binary" else None
        return m
    return {"binary_mismatch": binary_mismatch(d, b)}


def check_op(step: int, rank: int, index: int, rec: dict | None = None,
             source=None) -> tuple[list, list, dict | None]:
    """Replay and judge one op record; returns (result row, detail rows, error data or None).
    ``rec``/``source``: a record and its tensors that arrived otherwise (online run-ut)."""
    st = _STATE
    if rec is None:
        rec = st.run.parts[(step, rank)].records[index]
    opts = st.options
    t0 = time.perf_counter()
    cat = category(rec["op"])
    head = [step, rank, rec["name"]]
    details, messages, verdicts, error_data, judged = [], [], [], None, []
    try:
        if source is None and not opts.get("random"):
            source = st.source((step, rank))
        rep = st.replayer.replay(rec, None if opts.get("random") else source, st.device,
                                 random=opts.get("random", False), keep_data=opts.get("save_error_data", False))
        unjudged, in_dtypes = [], input_dtypes(rec)
        inlined = (rec.get("compiled") or {}).get("inlined")
        for label, outs in ((REPLAY, rep.outputs), (RECORDED, rep.recorded)):
            if not outs:
                continue
            judged.append(label)
            view = dataclasses.replace(rep, outputs=outs)
            for out, (m, verdict, reason, shape) in zip(outs, judge_outputs(rec["op"], cat, view, in_dtypes)):
                if label == RECORDED and inlined and verdict not in (PASS, SKIP) \
                        and output_category(cat, out.device_dtype) == "binary":
                    verdict, reason = SKIP, inlined_reason(out.name, inlined, reason)
                    unjudged.append(f"{label} {reason}")
                if verdict != SKIP:
                    verdicts.append(verdict)
                    if verdict != PASS:
                        messages.append(f"{'' if label == REPLAY else label + ' '}{out.name}: {reason}")
                # msprobe's MindSpore rule (cosine and max abs error only), beside the full verdict
                ms_rule = judge_benchmark(m, out.device_dtype, st.replayer.seed_rule)[0] \
                    if st.replayer.seed_rule and verdict != SKIP else ""
                details.append(head + [out.name, label, output_category(cat, out.device_dtype), out.bench_dtype,
                                       out.device_dtype, json.dumps(list(shape))]
                               + [_fmt(m.get(k)) for k in METRIC_COLUMNS.values()] + [ms_rule, verdict, reason])
        if not rep.outputs and not rep.recorded and not rep.written:
            # a check such as _linalg_check_errors: running without raising is all it does
            verdicts, messages = [PASS], ["returns nothing and writes nothing: ran without error"]
        elif not rep.outputs and not rep.recorded:
            verdicts, messages = [SKIP], ["the op returned no tensor to compare"]
        elif not verdicts:
            verdicts, messages = [SKIP], unjudged or ["no output with defined contents to compare"]
        else:
            messages.extend(unjudged)
        if rep.note:
            messages.append(rep.note)
        status = SKIP if verdicts == [SKIP] else worst(verdicts)
        if status == SKIP:
            judged = []
        if status == ERROR and opts.get("save_error_data"):
            error_data = rep.data
    except Skip as exc:
        status, messages, details = SKIP, [str(exc)], []
    except ReplayError as exc:     # what could not run is not judged, never a precision error
        status, messages, details = SKIP, [f"{NOT_REPLAYED}: {exc}"], []
    except Exception as exc:  # noqa: BLE001 - one op's failure must not stop the run
        status, messages, details = SKIP, [f"{NOT_REPLAYED}: {type(exc).__name__}: "
                                           f"{' '.join(str(exc).split())[:300]}"], []
    return (*_op_rows(step, rank, rec, cat, status, "; ".join(messages), details,
                      f"{time.perf_counter() - t0:.6f}", "+".join(judged)), error_data)


def inlined_reason(name: str, inlined: list, found: str) -> str:
    """Why a compiled record's output is not judged bit for bit: the kernel that computed it
    computed its input inline, and the recorded input is the probe's own computation of that
    value, whose last bits may differ (``compiled.inlined``)."""
    return (f"{name} not judged bit for bit ({found}): its kernel computed {', '.join(inlined)} inline, and the "
            "recorded value is the probe's own computation of it, which may round differently")


def input_dtypes(rec: dict) -> list[str]:
    """The dtypes of a record's input tensors: the benchmark rule judges at their lowest float
    precision (:func:`~dispatchprobe.standards.verdicts.judging_precision`)."""
    return [spec["dtype"] for _, _, spec in walk(rec, outputs=False) if spec.get("dtype")]


def judge_outputs(op: str, cat: str, rep, in_dtypes=()) -> list[tuple[dict, str, str, tuple]]:
    """(metrics, verdict, reason, shape judged) of each output of a replayed op, by its traits
    (``api_precision_standard.yaml``): undefined outputs are SKIP; non-unique ones are judged by
    their unique form.  An output that is not a pass at first is judged again (the detail row
    keeps the first metrics): a reduction's errors within the rounding bound of its terms are
    discounted, and relative errors are measured against the magnitude each element is computed
    from (the benchmark's spread) where its value cancelled; when that leaves the cosine unable to
    tell a wrong output from tolerated rounding (the output is noise around zero), it is not read.
    The absolute-error shortcut is scaled by the benchmark's magnitude (and its spread's, where
    elements cancelled); ``in_dtypes``: the op's input dtypes (:func:`input_dtypes`)."""
    by_name = {o.name: o for o in rep.outputs}
    ordered = [by_name.get(f"output.{i}") for i in range(len(rep.outputs))]
    terms, counts, spread, judged = None, None, None, []
    for out in rep.outputs:
        trait = output_trait(op, out.name)
        if trait == "undefined":
            judged.append(({}, SKIP, "contents left undefined by the op: not judged", out.shape))
            continue
        d, b, note = out.device, out.bench, ""
        if trait and all(o is not None for o in ordered):
            try:
                label, d = unique_form(trait, [o.device for o in ordered])
                _, b = unique_form(trait, [o.bench for o in ordered])
                note = f"judged as {label} (the vectors' sign/phase is free)"
            except (ValueError, np.linalg.LinAlgError) as exc:   # non-finite vectors: judged as they are
                d, b, note = out.device, out.bench, f"no unique form ({exc})"
        m = output_metrics(d, b, out.device_dtype, cat)
        verdict, reason = judge(cat, m, out.device_dtype, magnitude=expected_magnitude(b), input_dtypes=in_dtypes)
        first = verdict, reason
        if verdict != PASS and not trait and output_category(cat, out.device_dtype) != "binary" \
                and np.asarray(d).dtype.kind in "fc":
            notes = []
            kind = reduction_kind(op, out.name)
            if kind and rep.terms is not None:
                terms = rep.terms() if terms is None else terms
                t = terms.get(out.name)
                k = None
                if is_staged(op):
                    counts = rep.terms("count") if counts is None else counts
                    k = counts.get(out.name)
                if t is not None and np.shape(t) == np.shape(b):
                    d = within_terms(d, b, t, judging_precision(out.device_dtype, in_dtypes), kind,
                                     k if np.shape(k) == np.shape(b) else None)
                    notes.append("errors within the rounding bound of its terms discounted")
            scale, direction = None, True
            if rep.spread is not None:
                spread = rep.spread() if spread is None else spread
                scale = spread.get(out.name)
                if scale is not None and np.shape(scale) == np.shape(b):
                    scale = cancelled_scale(b, scale)
                    notes.append("cancelled elements relative to the magnitude they are computed from")
                    direction = direction_readable(b, scale, out.device_dtype)
                    if not direction:
                        notes.append("cosine not read: errors the tiers tolerate against the spread could "
                                     "alone bring it to the minimum (the value is mostly rounding of larger terms)")
                else:
                    scale = None
            if notes:
                verdict, reason = judge(cat, output_metrics(d, b, out.device_dtype, cat, scale), out.device_dtype,
                                        direction, expected_magnitude(b, scale), in_dtypes)
                if verdict != first[0] or not direction:
                    note = f"{first[0]} ({first[1]}) -> {verdict}: {', '.join(notes)}"
        judged.append((m, verdict, "; ".join(x for x in (reason, note) if x), np.shape(d)))
    return judged


def _op_rows(step, rank, rec: dict, cat: str, status: str, message: str, details: list, elapsed: str,
             judged: str = ""):
    """(result row, detail rows) as CSV strings; an op that compared nothing gets one detail row.
    ``judged``: what was judged against the benchmark (``replay``, ``recorded``, both joined by +)."""
    head = [step, rank, rec["name"]]
    details = details or [head + ["", "", cat, "", "", ""] + [""] * len(METRIC_COLUMNS) + ["", status, message]]
    fwd, bwd = (status, "") if rec.get("stage") != "backward" else ("", status)
    row = head + [rec["op"], rec.get("stage", ""), rec.get("scope", ""), cat, judged, fwd, bwd, message, elapsed]
    return [_fmt(v) for v in row], [[_fmt(v) for v in d] for d in details]


def blas_limit(threads: int):
    """Limit numpy's BLAS threads while replaying (restored after)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        return None
    return threadpool_limits(limits=threads, user_api="blas")


def _check_chunk(tasks):
    return [(t, check_op(*t)) for t in tasks]


def _init_worker(path, options, threads, replayer):
    global _STATE
    for name in options.get("imports") or ():
        importlib.import_module(name)
    if _STATE is None or _STATE.run.path != path:
        _STATE = ReplayState(load(path), options, replayer)
    else:
        _STATE.sources = {}        # safetensors handles are not shared across fork
    replayer.set_threads(threads)
    blas_limit(threads)


# ---- CSV files -----------------------------------------------------------------------------------
def _repair_tail(path: str) -> None:
    """Cut a torn last line (the process was killed while writing it)."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def _read_rows(path: str) -> list[list[str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    return rows[1:] if rows else []


class Journal:
    """Appends result and detail rows, flushed per op, so a kill loses at most one op."""

    def __init__(self, result_path: str, details_path: str, redo=None):
        self.result_path, self.details_path = result_path, details_path
        for path in (result_path, details_path):
            _repair_tail(path)
        done_rows = _read_rows(result_path)
        if redo is not None:      # rows a resume judges again (skipped for want of an option it now has)
            done_rows = [r for r in done_rows if not (len(r) == len(RESULT_COLUMNS) and redo(r))]
        self.done = {tuple(r[:3]) for r in done_rows if len(r) == len(RESULT_COLUMNS)}
        # keep only the details of ops whose result row made it (written last)
        kept, seen = [], set()
        for r in _read_rows(details_path):
            key = tuple(r[:5])       # step, rank, op, output, judged
            if len(r) == len(DETAIL_COLUMNS) and tuple(r[:3]) in self.done and key not in seen:
                seen.add(key)
                kept.append(r)
        write_csv(details_path, DETAIL_COLUMNS, kept)
        if len(done_rows) != len(self.done) or redo is not None or not os.path.exists(result_path):
            write_csv(result_path, RESULT_COLUMNS, [r for r in done_rows if len(r) == len(RESULT_COLUMNS)])
        self._res = open(result_path, "a", newline="", encoding="utf-8")
        self._det = open(details_path, "a", newline="", encoding="utf-8")
        self._res_w, self._det_w = csv.writer(self._res), csv.writer(self._det)

    def write(self, row, details) -> None:
        self._det_w.writerows(details)
        self._det.flush()
        self._res_w.writerow(row)
        self._res.flush()
        self.done.add(tuple(row[:3]))

    def close(self) -> None:
        self._res.close()
        self._det.close()


def _save_error_data(out_dir: str, row, data: dict, replayer: Replayer) -> None:
    folder = os.path.join(out_dir, "error_data")
    os.makedirs(folder, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"step{row[0]}_rank{row[1]}_{row[2]}")
    tmp = os.path.join(folder, f".{name}.tmp")
    replayer.save_error_data(tmp, data, {"op": row[3], "name": row[2]})
    os.replace(tmp, os.path.join(folder, f"{name}.safetensors"))


# ---- the driver ----------------------------------------------------------------------------------
def import_modules(names) -> None:
    """``--import``: the user's modules that register kernels, references or overrides, imported
    before any op is replayed; a missing one is one line."""
    for name in names or ():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"--import {name}: {exc}") from None


def run_ut(records, out_dir: str | None = None, *, random: bool = False, device: str | None = None, jobs: int = 1,
           resume: str | None = None, filter_duplicates: bool = False, save_error_data: bool = False,
           imports=(), progress: bool | None = None, api: str | None = None, distributed="auto",
           limit: int | None = None, threads: int | None = None, replayer: Replayer | None = None) -> RunUTResult:
    """Replay the op records of ``records`` (a run directory, a step/rank folder, or a loaded
    :class:`~dispatchprobe.reader.Run`) and judge each op; see ``docs/run-ut.md``.

    Runs in this process with ``jobs=1`` (so ``torch.library`` kernels registered here are the
    ones replayed; with ``jobs>1`` forked workers inherit them).  ``resume``: an
    ``accuracy_checking_result_{ts}.csv`` of an interrupted run to continue.  ``api``: a regex
    selecting ops by name.  ``limit``: replay at most this many ops (then stop; resumable).
    ``threads``: framework/BLAS threads per replaying process (default 1: replayed ops are small).
    ``replayer``: the framework's replay (default: the one of the manifest's ``framework``).
    """
    global _STATE
    t_start = time.perf_counter()
    import_modules(imports)
    run = records if isinstance(records, Run) else load(records)
    replayer = replayer or replayer_for(run)
    replayer.resolve_device(device)   # a device this machine lacks is a one-line error before any work
    if resume:
        m = _RESULT_RE.match(os.path.basename(resume))
        if not m:
            raise ValueError(f"{resume}: --resume needs an accuracy_checking_result_{{timestamp}}.csv file")
        if not os.path.isfile(resume):
            raise FileNotFoundError(f"{resume}: no such result file to resume")
        ts, out_dir = m.group(1), out_dir or os.path.dirname(resume) or "."
        if os.path.abspath(os.path.dirname(resume) or ".") != os.path.abspath(out_dir):
            raise ValueError(f"--resume {resume} is not in the output directory {out_dir}")
    else:
        ts = time.strftime("%Y%m%d%H%M%S")
        n = 1    # a second run in the same second into the same folder must not resume the first
        while os.path.exists(os.path.join(out_dir or ".", f"accuracy_checking_result_{ts}.csv")):
            n += 1
            ts = f"{time.strftime('%Y%m%d%H%M%S')}-{n}"
    out_dir = out_dir or "."
    os.makedirs(out_dir, exist_ok=True)
    # a resume replays what the interrupted run would have: its options, kept beside its CSVs
    options_path = os.path.join(out_dir, f"accuracy_checking_options_{ts}.json")
    saved = _read_options(options_path) if resume else {}
    random = bool(random or saved.get("random"))
    filter_duplicates = bool(filter_duplicates or saved.get("filter_duplicates"))
    api = api if api is not None else saved.get("api")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    engine = replayer.distributed() if distributed is not False else None
    rank, world = (engine.rank, engine.world) if engine else (0, 1)
    if world > 1:
        ts = engine.broadcast(ts)
    options = {"random": random, "device": device, "save_error_data": save_error_data, "imports": list(imports or ())}

    # every op record in a fixed order; the same list on every rank
    api_re = re.compile(api) if api else None
    tasks, dup_of, seen = [], {}, {}
    for (step, prank), part in run.parts.items():
        for i, rec in enumerate(part.records):
            if rec.get("kind") != "op" or (api_re and not api_re.search(rec["name"])):
                continue
            task = (step, prank, i)
            if filter_duplicates:
                sig = call_signature(rec)
                first = seen.setdefault(sig, rec["name"])
                if first != rec["name"]:
                    dup_of[task] = first
            tasks.append(task)
    order = {(str(s), str(r), run.parts[(s, r)].records[i]["name"]): n for n, (s, r, i) in enumerate(tasks)}
    mine = tasks[rank::world]

    result_path = os.path.join(out_dir, f"accuracy_checking_result_{ts}.csv")
    details_path = os.path.join(out_dir, f"accuracy_checking_details_{ts}.csv")
    shard_suffix = f".rank{rank}-of-{world}.partial" if world > 1 else ""
    if rank == 0:
        atomic_write_text(options_path, json.dumps({"random": random, "filter_duplicates": filter_duplicates,
                                                    "api": api}))
    # ops an earlier pass skipped for want of --random are judged when this one has it
    redo = (lambda r: _NOT_SAVED in r[_MESSAGE]) if resume and random else None
    journal = Journal(result_path + shard_suffix, details_path + shard_suffix, redo)
    todo = [t for t in mine if (str(t[0]), str(t[1]), run.parts[t[:2]].records[t[2]]["name"]) not in journal.done]
    if limit is not None:
        todo = todo[:limit]

    show = sys.stderr.isatty() if progress is None else progress
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), disable=not show, unit="op", desc=f"run-ut{f' rank {rank}' if world > 1 else ''}")
    except ImportError:  # pragma: no cover
        bar = None
    replayed = 0
    try:
        runnable = []
        for t in todo:
            if t in dup_of:
                rec = run.parts[(t[0], t[1])].records[t[2]]
                journal.write(*_op_rows(t[0], t[1], rec, category(rec["op"]), SKIP,
                                        f"duplicate of {dup_of[t]} (same op, shapes, dtypes and arguments)", [], "0"))
                if bar is not None:
                    bar.update(1)
            else:
                runnable.append(t)
        threads = max(1, int(threads or 1))   # replayed ops are small: threads would only contend
        if jobs == 1 or len(runnable) <= 1:
            prev_threads = replayer.set_threads(threads)
            blas = blas_limit(threads)
            try:
                with replaying(run, options, replayer):
                    for t in runnable:
                        row, det, err = check_op(*t)
                        write_judged(journal, out_dir, row, det, err, replayer)
                        replayed += 1
                        if bar is not None:
                            bar.update(1)
            finally:
                replayer.set_threads(prev_threads)
                if blas is not None:
                    blas.restore_original_limits()
        else:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            ctx = mp.get_context(method)
            if method == "fork":
                _STATE = ReplayState(run, options, replayer)   # inherited by the workers: records parsed once
            chunk = max(1, min(16, len(runnable) // (jobs * 8) or 1))
            chunks = [runnable[i:i + chunk] for i in range(0, len(runnable), chunk)]
            with ctx.Pool(jobs, initializer=_init_worker, initargs=(run.path, options, threads, replayer)) as pool:
                try:
                    for results in pool.imap(_check_chunk, chunks):
                        for _, (row, det, err) in results:
                            write_judged(journal, out_dir, row, det, err, replayer)
                            replayed += 1
                        if bar is not None:
                            bar.update(len(results))
                except BaseException:
                    pool.terminate()
                    raise
    except KeyboardInterrupt as exc:
        exc.result_csv, exc.rows_saved = journal.result_path, len(journal.done)   # for the CLI's one line
        exc.resume_options = " --random" if random else ""
        raise
    finally:
        if bar is not None:
            bar.close()
        journal.close()

    if world > 1:
        _merge_ranks(result_path, details_path, shard_suffix, order, engine)
    results = pd.read_csv(result_path, dtype=str, keep_default_na=False)
    details = pd.read_csv(details_path, dtype=str, keep_default_na=False)
    res = RunUTResult(results, details, result_path, details_path, replayed, time.perf_counter() - t_start)
    if rank == 0:
        res.report_html = write_report(res, run, out_dir, ts, len(tasks))
    return res


def _read_options(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):     # a run from before options were kept, or a torn file
        return {}


def write_report(res: RunUTResult, run: Run, out_dir: str, ts: str, total: int) -> str:
    """The results by module as one HTML page beside the CSVs (rewritten by each resume)."""
    from .run_ut_page import run_ut_html
    path = os.path.join(out_dir, f"accuracy_checking_report_{ts}.html")
    lines = summary_text(res).splitlines()[:-2]
    if len(res.results) < total:
        lines.append(f"incomplete: {len(res.results)} of {total} ops judged; continue with --resume {res.result_csv}")
    atomic_write_text(path, run_ut_html(res.results, res.details, summary=lines, records=run.path,
                                        manifest=run.manifest or {}, result_csv=res.result_csv))
    return path


def write_judged(journal: Journal, out_dir: str, row, det, err, replayer: Replayer) -> None:
    """Writes one judged op's rows to ``journal``, and its error data when it has some."""
    if err:
        try:
            _save_error_data(out_dir, row, err, replayer)
        except Exception as exc:  # noqa: BLE001 - saving evidence must not lose the verdict
            row[_MESSAGE] = f"{row[_MESSAGE]}; error data not saved: {exc}".strip("; ")
    journal.write(row, det)


def _merge_ranks(result_path: str, details_path: str, suffix: str, order: dict, engine: Distributed) -> None:
    """Gather every rank's rows on rank 0 (works across nodes: no shared filesystem needed)."""
    gathered = engine.gather((_read_rows(result_path + suffix), _read_rows(details_path + suffix)), dst=0)
    if engine.rank == 0:
        res = [r for g in gathered for r in g[0]]
        det = [r for g in gathered for r in g[1]]
        big = len(order)
        res.sort(key=lambda r: order.get(tuple(r[:3]), big))
        det.sort(key=lambda r: order.get(tuple(r[:3]), big))     # stable: outputs stay in order
        write_csv(details_path, DETAIL_COLUMNS, det)
        write_csv(result_path, RESULT_COLUMNS, res)
    engine.barrier()
    for p in (result_path + suffix, details_path + suffix):
        if os.path.exists(p):
            os.remove(p)


def op_status(results: pd.DataFrame) -> pd.Series:
    """Each op's status: its forward or backward verdict (SKIP: not judged)."""
    fwd = results["Forward Test Success"]
    return fwd.where(fwd != "", results["Backward Test Success"])


def nothing_judged(res: RunUTResult) -> str:
    """Why a run-ut judged no op: the commonest skip reason, in one line."""
    if not len(res.results):
        return "the records hold no op call (or --api selected none)"
    msg = res.results["Message"]
    unsaved = msg[msg.str.contains(_NOT_SAVED, regex=False)]
    if len(unsaved):     # the reason a user can act on first
        return f"all {len(msg)} ops were skipped; {len(unsaved)} of them: {unsaved.iloc[0]}"
    reasons = msg.str.split(r" \(", n=1, regex=True).str[0].value_counts()
    why = msg[msg.str.startswith(reasons.index[0])].iloc[0]
    return f"all {len(msg)} ops were skipped; {reasons.iloc[0]} of them: {why}"


def exit_code(res: RunUTResult) -> tuple[int, str]:
    """(exit code, the line that says why, or ""): 2 when some op is an error (a precision verdict);
    1 when no op was judged (every op SKIP: an op that could not run is not judged, never an
    error) or when a saved tensor could not be read (a record problem, which the summary names);
    else 0."""
    status = op_status(res.results)
    if (status == ERROR).any():
        return 2, ""
    if not status.isin([PASS, WARNING]).any():
        return 1, f"no op was judged: {nothing_judged(res)}"
    return (1 if res.results["Message"].str.startswith(_DAMAGED).any() else 0), ""


def summary_text(res: RunUTResult) -> str:
    r = res.results
    status = op_status(r)
    counts = status.value_counts().to_dict()
    parts = ", ".join(f"{counts.get(k, 0)} {label}" for k, label in
                      ((PASS, PASS), (WARNING, WARNING), (ERROR, ERROR), (SKIP, NOT_JUDGED)))
    lines = [f"run-ut: {len(r)} ops: {parts}"]
    lines += [f"  error  {row['API Name']}  {row['Message'][:160]}" for _, row in r[status == ERROR].head(20).iterrows()]
    skipped = r["Message"].where(status == SKIP, "")
    failed = skipped[skipped.str.startswith(NOT_REPLAYED)]
    if len(failed):      # the op raised where it was replayed: not judged, and why
        lines.append(f"  {len(failed)} ops not judged: their replay raised "
                     f"({failed.iloc[0][len(NOT_REPLAYED) + 2:][:160]})")
    damaged = skipped[skipped.str.startswith(_DAMAGED)]
    if len(damaged):     # a record problem, not a precision verdict
        lines.append(f"  {len(damaged)} ops not replayed: damaged records ({damaged.iloc[0][16:][:160]})")
    unsaved = skipped.str.contains(_NOT_SAVED, regex=False).sum()
    if unsaved:
        lines.append(f"  {unsaved} ops not replayed: their inputs were not saved (statistics-only records); "
                     "replay them with --random, or record with task='tensor'")
    return "\n".join(lines + [f"results: {res.result_csv}", f"details: {res.details_csv}"]
                     + ([f"report: {res.report_html}"] if res.report_html else []))
