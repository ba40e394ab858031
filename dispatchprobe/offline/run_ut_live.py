"""run-ut on a run that is still being written: ``run-ut RUN --follow`` (shared storage) and the
network checker (``run-ut --listen``, which writes what arrives into such a run).

A :class:`Follower` tails each ``step*/rank*`` folder: ``ops.jsonl`` grows one complete line per
op, ``tensors/index.jsonl`` one line per shard once the shard is renamed into place (the writer's
order), so an op is ready when every tensor its record names is listed, or when its folder is
``closed`` (a tensor still missing is then reported by the replay as missing).  Ready ops are
judged by the offline driver's ``check_op``, in this process or the same worker pool (``-j``), into
the same CSVs and report.  It stops when every rank of the manifest left its ``rank{R}.ended``
marker (the probe's close), or on Ctrl-C with everything judged so far written.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import re
import sys
import threading
import time
from typing import Callable

from ..records.format import ended_marker, walk
from ..records.reader import Part, Run, find_manifest
from . import run_ut as driver
from .replayer import Replayer, replayer_for

_STEP_RANK = re.compile(r"step(\d+)[/\\]rank(\d+)$")


def _tail(path: str, offset: int) -> tuple[list[dict], int]:
    """The complete JSON lines appended to ``path`` since ``offset``, and the new offset (a line
    still being written waits for the next call; a corrupt complete line is skipped)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].split(b"\n")[:-1]:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out, offset + end


class LivePart(Part):
    """A step/rank folder being written: its records and tensor index read as they grow."""

    def __init__(self, path: str, step: int, rank: int):
        super().__init__(path, step, rank, marks_closed=True)
        self._live_records: list[dict] = []
        self._shard_of: dict[str, str] = {}
        self._view_of: dict[str, dict] = {}
        self._ops_at = self._index_at = 0

    @property
    def records(self) -> list[dict]:
        return self._live_records

    @property
    def _index(self):
        return self._shard_of, self._view_of

    def new_records(self) -> list[dict]:
        rows, self._ops_at = _tail(os.path.join(self.path, "ops.jsonl"), self._ops_at)
        self._live_records.extend(rows)
        return rows

    def refresh_index(self) -> None:
        rows, self._index_at = _tail(os.path.join(self.path, "tensors", "index.jsonl"), self._index_at)
        for row in rows:
            self._shard_of.update(dict.fromkeys(row.get("keys", ()), row.get("shard")))
            self._view_of.update(row.get("views") or {})

    def has_all(self, record: dict) -> bool:
        return all(self.has_tensor(s["data"]) for _, _, s in walk(record) if s.get("data") is not None)

    def catch_up(self, record: dict) -> None:
        """Read the index on if ``record`` names a tensor not listed yet (a worker's older copy)."""
        if not self.has_all(record):
            self.refresh_index()


class Follower:
    """Tails a run directory; :meth:`poll` returns the ops that became ready since the last call
    as tasks ``(step, rank, index, record, folder)``.  ``ended``: when no more is coming (default:
    every rank of the manifest left its ended marker)."""

    def __init__(self, path: str, api: str | None = None, ended: Callable[[], bool] | None = None):
        self.path = os.path.normpath(path)
        self.api = re.compile(api) if api else None
        self.run = Run(self.path, {}, {})
        self._waiting: dict[tuple, list] = {}
        self._ended = ended
        self.dispatched: dict[tuple, int] = {}     # ops handed out per part
        self._closed: set[tuple] = set()           # parts closed with nothing waiting
        self._reaped: set[tuple] = set()
        self._lock = threading.Lock()              # poll (the pool's feeder thread) and finished (the judge)

    def manifest(self) -> dict:
        if not self.run.manifest:
            root, manifest = find_manifest(self.path)
            if manifest and root == self.path:
                self.run.manifest = manifest
        return self.run.manifest

    def ended(self) -> bool:
        if self._ended is not None:
            return self._ended()
        m = self.manifest()
        if not m:
            return False
        if not m.get("marks_ended_ranks"):     # written before probes marked their end: every step closed
            return bool(self.run.parts) and all(p.closed for p in self.run.parts.values())
        ranks = m.get("config", {}).get("rank") or range(int(m.get("world_size", 1)))
        return all(os.path.exists(os.path.join(self.path, ended_marker(r))) for r in ranks)

    @property
    def waiting(self) -> int:
        return sum(map(len, self._waiting.values()))

    def poll(self) -> list[tuple]:
        with self._lock:
            return self._poll()

    def _poll(self) -> list[tuple]:
        ready = []
        for folder in sorted(glob.glob(os.path.join(glob.escape(self.path), "step*", "rank*"))):
            m = _STEP_RANK.search(folder)
            if not m:
                continue
            key = (int(m.group(1)), int(m.group(2)))
            if key in self._reaped or key in self._closed:     # nothing more comes from it
                continue
            part = self.run.parts.get(key)
            if part is None:
                part = self.run.parts[key] = LivePart(folder, *key)
                self._waiting[key] = []
            closed = part.closed            # asked first: everything before the marker is read below
            start = len(part.records)
            new = part.new_records()
            part.refresh_index()
            waiting = self._waiting[key]
            for i, rec in enumerate(new, start):
                if rec.get("kind") == "op" and not (self.api and not self.api.search(rec.get("name", ""))):
                    waiting.append((i, rec))
            still = []
            for i, rec in waiting:
                if closed or part.has_all(rec):
                    ready.append((key[0], key[1], i, rec, folder))
                else:
                    still.append((i, rec))
            self._waiting[key] = still
            self.dispatched[key] = self.dispatched.get(key, 0) + len(waiting) - len(still)
            if closed and not still:
                self._closed.add(key)
        return ready

    def finished(self, judged: dict) -> list[tuple]:
        """[(part key, folder)] of closed parts whose every op is judged (``judged``: counts per
        part), each returned once: the network checker deletes them."""
        with self._lock:
            done = [k for k in self._closed - self._reaped if judged.get(k, 0) >= self.dispatched.get(k, 0)]
            self._reaped.update(done)
            return [(k, self.run.parts[k].path) for k in done]

    def tasks(self, poll_s: float = 0.2, stop: threading.Event | None = None):
        """Every ready task until :meth:`ended` and nothing waits; sleeps ``poll_s`` when idle.
        ``stop`` ends it within ``poll_s`` from another thread: a worker pool's feeder thread runs
        this loop, and the pool cannot be terminated while it waits for a run that never ends."""
        stop = stop or threading.Event()
        while not stop.is_set():
            ended = self.ended()         # before polling: what was written before the end is read
            batch = self.poll()
            for task in batch:
                if stop.is_set():
                    return
                yield task
            if ended and not self.waiting:
                return
            if not batch:
                stop.wait(poll_s)


def _check_live(task):
    """check_op for a task of a live run (in this process or a worker)."""
    step, rank, index, rec, folder = task
    st = driver.replay_state()
    part = st.run.parts.get((step, rank))
    if not isinstance(part, LivePart) or part.path != folder:
        part = st.run.parts[(step, rank)] = LivePart(folder, step, rank)
        st.sources.pop((step, rank), None)
    part.catch_up(rec)
    source = None if st.options.get("random") else st.source((step, rank))
    return task, driver.check_op(step, rank, index, rec, source)


def _init_live_worker(options, threads, replayer):
    driver.replay_state().sources = {}       # safetensors handles are not shared across fork
    replayer.set_threads(threads)
    driver.blas_limit(threads)


def wait_for_manifest(follower: Follower, poll_s: float = 0.2, say: Callable[[str], None] | None = None) -> dict:
    said = False
    while not follower.manifest():
        if say and not said:
            say(f"waiting for a run to start in {follower.path}")
            said = True
        time.sleep(poll_s)
    return follower.run.manifest


def run_ut_live(follower: Follower, out_dir: str | None = None, *, jobs: int = 1, device: str | None = None,
                save_error_data: bool = False, imports=(), progress: bool | None = None, threads: int | None = None,
                replayer: Replayer | None = None, poll_s: float = 0.2,
                on_judged: Callable[[int, int], None] | None = None,
                say: Callable[[str], None] | None = None) -> driver.RunUTResult:
    """Judge the ops of a run while it is written, as :func:`~.run_ut.run_ut` judges a finished
    one (same rows, same files).  Returns when the follower says the run ended; on Ctrl-C the
    rows so far are written and the KeyboardInterrupt carries the result (``exc.result``)."""
    t_start = time.perf_counter()
    driver.import_modules(imports)
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    wait_for_manifest(follower, poll_s, say)
    run = follower.run
    replayer = replayer or replayer_for(run)
    replayer.resolve_device(device)
    out_dir = out_dir or "."
    os.makedirs(out_dir, exist_ok=True)
    ts = time.strftime("%Y%m%d%H%M%S")
    n = 1
    while os.path.exists(os.path.join(out_dir, f"accuracy_checking_result_{ts}.csv")):
        n += 1
        ts = f"{time.strftime('%Y%m%d%H%M%S')}-{n}"
    result_path = os.path.join(out_dir, f"accuracy_checking_result_{ts}.csv")
    details_path = os.path.join(out_dir, f"accuracy_checking_details_{ts}.csv")
    journal = driver.Journal(result_path, details_path)
    options = {"random": False, "device": device, "save_error_data": save_error_data, "imports": list(imports or ())}
    threads = max(1, int(threads or 1))
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm
    bar = tqdm(disable=not show, unit="op", desc="run-ut (live)")
    replayed = 0
    interrupted = None

    def emit(task, result):
        nonlocal replayed
        row, det, err = result
        driver.write_judged(journal, out_dir, row, det, err, replayer)
        replayed += 1
        bar.update(1)
        if on_judged is not None:
            on_judged(task[0], task[1])

    try:
        with driver.replaying(run, options, replayer):
            _judge_all(follower, replayer, emit, jobs, threads, options, poll_s)
    except KeyboardInterrupt as exc:
        interrupted = exc
    finally:
        bar.close()
        journal.close()
    import pandas as pd
    results = pd.read_csv(result_path, dtype=str, keep_default_na=False)
    details = pd.read_csv(details_path, dtype=str, keep_default_na=False)
    res = driver.RunUTResult(results, details, result_path, details_path, replayed, time.perf_counter() - t_start)
    if run.parts:
        res.report_html = driver.write_report(res, run, out_dir, ts, len(results))
    if interrupted is not None:
        interrupted.result = res
        raise interrupted
    return res


def _judge_all(follower: Follower, replayer: Replayer, emit, jobs: int, threads: int, options: dict,
               poll_s: float) -> None:
    """Judges the follower's ops as they come, here (``jobs == 1``) or in forked workers."""
    if jobs == 1:
        prev_threads = replayer.set_threads(threads)
        blas = driver.blas_limit(threads)
        try:
            for task in follower.tasks(poll_s):
                emit(*_check_live(task))
        finally:
            replayer.set_threads(prev_threads)
            if blas is not None:
                blas.restore_original_limits()
    else:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        if method != "fork":
            raise ValueError("run-ut --follow/--listen with -j > 1 needs the fork start method (Linux, macOS "
                             "with fork); use -j 1")
        stop = threading.Event()
        with mp.get_context(method).Pool(jobs, initializer=_init_live_worker,
                                         initargs=(options, threads, replayer)) as pool:
            try:
                for task, result in pool.imap(_check_live, follower.tasks(poll_s, stop), chunksize=1):
                    emit(task, result)
            except BaseException:
                stop.set()           # the feeder thread leaves follower.tasks: else terminate waits on it forever
                pool.terminate()
                raise
