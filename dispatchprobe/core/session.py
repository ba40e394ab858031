"""A probe session: config, step/rank bookkeeping, the open part writer and the task's handlers.

Framework-neutral.  The torch and MindSpore adapters subclass it, set ``backend`` (a
:class:`~dispatchprobe.core.tensor_backend.TensorBackend`) and add only the interception (a dispatch
mode, module hooks) that turns calls into :class:`OpEvent` objects for :meth:`ProbeSession.dispatch`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import sys
import warnings
import weakref
from collections import defaultdict

from .config import Config, ConfigError
from .events import OpEvent
from .recorder import Recorder
from .tasks import TASKS
from ..records.format import ended_marker
from ..records.writer import PartWriter, atomic_write_text, make_manifest, write_manifest


class OpSelector:
    """Which ops a config selects: by name (exact, substring or regex) and module scope.

    A scope selects the modules whose name holds it as whole dot-separated parts
    (``layers.1`` selects ``Net.layers.1.mlp``, not ``Net.layers.10``); ``*.`` stands for the
    root module, whatever its name (msprobe module names are read so).  ``hits`` counts the
    selected calls, for the empty-selection warning at close."""

    def __init__(self, names: list[str], scopes: list[str]):
        try:
            self._patterns = [re.compile(n) for n in names]
        except re.error as exc:
            raise ConfigError(f"config: list entry {exc.pattern!r} is not a valid regex ({exc})") from None
        self._scopes = tuple(scopes)
        self._memo: dict[str, bool] = {}
        self._scope_memo: dict[str, bool] = {}
        self.hits = 0

    @property
    def filters(self) -> bool:
        return bool(self._patterns or self._scopes)

    def op_selected(self, op: str) -> bool:
        if not self._patterns:
            return True
        hit = self._memo.get(op)
        if hit is None:
            short = op.removeprefix("aten.")
            hit = self._memo[op] = any(p.search(op) or p.search(short) for p in self._patterns)
        return hit

    def scope_selected(self, scope: str) -> bool:
        hit = self.in_scope(scope)
        self.hits += hit
        return hit

    def in_scope(self, scope: str) -> bool:
        """:meth:`scope_selected` without counting a hit (a capture path asking ahead)."""
        hit = self._scope_memo.get(scope)
        if hit is None:
            hit = self._scope_memo[scope] = not self._scopes or any(self._in_scope(s, scope) for s in self._scopes)
        return hit

    @staticmethod
    def _in_scope(wanted: str, scope: str) -> bool:
        if wanted == "*":
            return bool(scope)
        if wanted.startswith("*."):
            _, _, path = scope.partition(".")
            wanted = wanted[2:]
            return path == wanted or path.startswith(wanted + ".")
        return f".{wanted}." in f".{scope}."


class ProbeSession:
    """Holds what every adapter shares.  Subclasses implement ``_install``/``_uninstall``."""

    backend = None            # set by subclasses: a TensorBackend such as dispatchprobe.torch.tensor_backend

    def __init__(self, config: Config | str | dict | None = None, **overrides):
        self.config = Config.load(config, **overrides)
        if os.path.exists(self.config.dump_path) and not os.path.isdir(self.config.dump_path):
            raise ConfigError(f"dump_path {self.config.dump_path!r} is a file, not a directory")
        self.selector = OpSelector(self.config.list, self.config.scope)
        self.seeded = None             # what seed_all changed, for configs with seed/is_deterministic
        if self.config.seed is not None or self.config.is_deterministic:
            from .seeding import seed_all
            seed = self.config.seed if self.config.seed is not None else 1234
            self.seeded = seed_all(seed, mode=self.config.is_deterministic)
        self.step_no = 0
        self.rank = self._detect_rank()
        self._parts_written: set[str] = set()
        self._claimed_rank: int | None = None     # the rank whose earlier records were looked for
        self.failed: str | None = None     # why recording stopped (records could not be written)
        self.online = None                 # online run-ut over the network: the sender (nothing on disk)
        self.online_account = ""           # its one-line account at close
        if self.config.streams and self._enabled_rank():
            from ..online.sender import OnlineSender
            from ..records.writer import launcher_world_size
            self.online = OnlineSender(self.config.host, self.config.port, self.config.tls_path,
                                       queue_mb=self.config.online_queue_mb, wait_s=self.config.online_wait_s,
                                       rank=self.rank, world_size=launcher_world_size())
        else:
            self._claim_run_dir()
        self.part: PartWriter | None = None
        self._calls: dict = defaultdict(int)
        self._manifest_written = False
        self._manifest_notes: dict = {}    # run-level facts learnt while recording (note_in_manifest)
        self._active = False
        self.task = TASKS[self.config.task]
        self.recorder = Recorder(self.backend, save_tensors=self.task.saves_tensors,
                                 checksum=self.config.checksum, io_filter=self.config.io_enabled)
        self.handlers = self.task.handlers(self, self.recorder)
        # what an op is about to overwrite is kept for its record as a copy, or, where records
        # need only statistics, as its entry measured before the write (stand_in_for_written);
        # then an op's record also goes to the recorder without an event (on_op)
        self._measure_written = self.handlers == [self.recorder] and self.recorder.measures_only
        # the recording tasks: an op goes to the recorder as its fields, without an event (unless
        # a session class decides per event, overriding dispatch)
        self._recorder_only = self.handlers == [self.recorder] and type(self).dispatch is ProbeSession.dispatch
        self.busy = False              # handlers are running: their own calls are not the user's
        self.record_ops = self.config.level in ("op", "mix")
        self.record_modules = self.config.level in ("module", "mix") and self.task.records_modules
        self._stage_on = {s: self.config.stage_enabled(s) for s in ("forward", "backward")}
        # until step() is called, steps follow the training loop's optimizer (adapters report its
        # steps to optimizer_stepped): a loop that never calls step() still gets one part per step
        self.follows_optimizer = True
        self.step_pending = False      # the optimizer stepped; the step ends at the next recording
        self._stepping_optimizer = None
        self._follow_optimizer()

    # ---- what users call ------------------------------------------------------------------
    def start(self) -> None:
        if not self.task.intercepts_ops:      # the grad probe needs no `with`: nothing to start
            return
        if self.part is not None and not self._active:
            self._boundary()
        if self.step_pending:
            self._end_pending_step()
        if self._active or self.failed or not self._enabled_here():
            return
        with self.writing():
            self._open_part()
        if self.failed:
            return
        self._active = True
        self._install()

    def stop(self) -> None:
        if not self._active:
            return
        self._uninstall()
        self._active = False
        with self.writing():
            self.flush()

    def step(self) -> None:
        """End of a training step: close this step's records and count on.  The first call
        makes the user's calls the only step boundaries (no more following the optimizer)."""
        if self.follows_optimizer:
            self.follows_optimizer = False
            self._unfollow_optimizer()
        self.step_pending = False
        self.stop()
        try:
            with self.writing():
                self._close_part()
        finally:
            self.step_no += 1

    def optimizer_stepped(self, optimizer) -> None:
        """An optimizer finished a step (adapters call this from the framework's global hook).
        While no step() was called, the first optimizer that steps ends each step (a loop with
        two optimizers counts one).  The step ends later, at the next :meth:`start` or module
        forward (:meth:`recording`), so that a step() called after the optimizer's counts once."""
        if not self.follows_optimizer:
            return
        first = self._stepping_optimizer() if self._stepping_optimizer is not None else None
        if first is None:
            self._stepping_optimizer = weakref.ref(optimizer)
        elif first is not optimizer:
            return
        self.step_pending = True

    def _end_pending_step(self) -> None:
        """The step the optimizer ended: its part closes; a session recording now records on in
        the next step's part (if the config's steps select it)."""
        self.step_pending = False
        with self.writing():
            if self.part is not None:
                self.flush()
                self._close_part()
        self.step_no += 1
        if self._active and self._enabled_here():
            with self.writing():
                self._open_part()

    def _follow_optimizer(self) -> None:
        """Adapters: report the framework's optimizer steps to :meth:`optimizer_stepped`."""

    def _unfollow_optimizer(self) -> None:
        """Adapters: stop reporting optimizer steps."""

    def close(self) -> None:
        if self.follows_optimizer:
            self.follows_optimizer = False
            self._unfollow_optimizer()
        self.stop()
        try:
            with self.writing():
                self._close_part()
        finally:
            for h in self.handlers:
                h.close()
            self._mark_ended()
        self._warn_if_nothing_selected()

    def _mark_ended(self) -> None:
        """This rank is done: ``run-ut --follow`` stops once every rank has said so (online over
        the network: the stream ends, and the probe says what was sent, judged and dropped)."""
        if self.online is not None:
            if not self.online_account:
                self.online.start(make_manifest(**self._manifest_info()))   # a rank that recorded nothing ends too
                self.online_account = self.online.close()
                print(self.online_account, file=sys.stderr, flush=True)
            return
        with contextlib.suppress(OSError):
            follow = self.config.online_run_ut and self._enabled_rank()
            if follow and not self._manifest_written and not os.path.isfile(os.path.join(self.run_dir, "manifest.json")):
                # nfs_path: a rank that recorded nothing still ends, so that --follow can stop
                write_manifest(self.run_dir, **self._manifest_info())
            if self._manifest_written or follow:
                open(os.path.join(self.run_dir, ended_marker(self.rank)), "wb").close()

    def _warn_if_nothing_selected(self) -> None:
        """A run whose filters selected nothing says so once, naming them."""
        cfg = self.config
        if getattr(self, "_selection_checked", False) or (cfg.rank and self.rank not in cfg.rank):
            return
        self._selection_checked = True
        if not self._manifest_written and cfg.step:
            steps = cfg.step if len(cfg.step) <= 8 else f"[{cfg.step[0]}, {cfg.step[1]}, ..., {cfg.step[-1]}]"
            warnings.warn(f"dispatchprobe: step={steps} selected none of the {self.step_no} step(s) this probe "
                          "saw (steps count from 0 at each probe.step() or, while step() is never called, "
                          "each optimizer step)", RuntimeWarning, stacklevel=3)
        elif self._manifest_written and self.selector.filters and not self.selector.hits and not self.failed:
            warnings.warn(f"dispatchprobe: the filters selected no op in {self.run_dir}: list={cfg.list} "
                          f"scope={cfg.scope}; list holds aten op names or regexes (e.g. 'addmm', "
                          "'^aten\\.mm\\.'), scope module names such as 'Net.layers.1' or '*.layers.1'",
                          RuntimeWarning, stacklevel=3)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    @property
    def run_dir(self) -> str:
        return self.config.dump_path

    @property
    def part_dir(self) -> str:
        return os.path.join(self.config.dump_path, f"step{self.step_no}", f"rank{self.rank}")

    # ---- for adapters and handlers ----------------------------------------------------------
    @property
    def active(self) -> bool:
        """Started and not stopped (a capture path that starts the session itself asks)."""
        return self._active

    def would_record(self, stage: str, scope: str, op: str | None = None) -> bool:
        """Whether :meth:`on_op` would record an op at ``stage`` and ``scope``: a capture path asks
        before the op runs, so that a filtered op costs nothing more (no copies of what it writes)."""
        return self.recording(stage, scope) and self.selector.in_scope(scope) \
            and (op is None or self.selector.op_selected(op))

    def stand_in_for_written(self, t, undefined: bool, copy):
        """What an op's record shows for tensor ``t`` the op is about to overwrite: ``copy(t)``,
        or, where the records need only statistics, ``t``'s entry measured now (no copy made).
        ``undefined``: ``t``'s memory was never written (no values to measure)."""
        if not self._measure_written:
            return copy(t)
        self.busy = True
        try:
            with self._quiet():
                return self.recorder.measured_now(t, undefined)
        finally:
            self.busy = False

    def count_call(self, op: str, stage: str, scope: str) -> int | None:
        """One op call's filters (op name, module scope, stage, step) and its call index, in one
        place for every capture path: the index, or None when the call is not recorded."""
        if not self.recording(stage, scope) or not self.selector.op_selected(op) \
                or not self.selector.scope_selected(scope):
            return None
        return self.next_call(op, stage)

    def measured(self, op: str, stage: str, scope: str, *, call: int | None = None) -> dict | None:
        """A call measured elsewhere (a compiled graph's op, whose statistics the graph computed):
        its record's skeleton (name, call index, stage, scope), or None when the config does not
        record it.  ``call``: an index already counted.  The capture path adds the arguments and
        hands the record to :meth:`write`."""
        if call is None:
            call = self.count_call(op, stage, scope)
        if call is None:
            return None
        return self.recorder.skeleton("op", op, stage, scope, call)

    def write(self, record: dict, *, now: bool = False) -> None:
        """Write a record made from :meth:`measured`: in order with the records whose device
        statistics are pending, or ``now`` (after them)."""
        with self.writing():
            if now:
                self.recorder.flush()
            self.recorder.emit(record)      # written now unless a reserved place holds it back

    def recording(self, stage: str, scope: str = "") -> bool:
        """Whether records of ``stage`` are written now.  After the optimizer's step, the first
        forward op inside a module begins the next step (the optimizer's, zero_grad's and other
        optimizers' ops outside modules stay in the step they end)."""
        if self.step_pending and scope and stage == "forward":
            self._end_pending_step()
        return self.part is not None and not self.failed and self._stage_on[stage]

    def on_op(self, op: str, stage: str, scope: str, args, kwargs, outputs, *, func=None, grad_fn=None,
              stack=None, undefined=None, call: int | None = None, extra: dict | None = None,
              selected: bool = False):
        """What every capture path does with one op call: :meth:`count_call` (filters, call index),
        an :class:`OpEvent` for the handlers (run with the framework's tracing off, :meth:`_quiet`);
        a task whose one handler is the recorder gets the call's fields (:meth:`Recorder.record_op`).
        ``stack``: a callable giving the user's frames, called only when the config asks for stacks
        of forward ops; ``call``: an index already counted (a compiled graph's op run again);
        ``extra``: fields added to its records; ``selected``: the capture path found the call
        recorded (:meth:`would_record` and :meth:`OpSelector.op_selected` before it ran), so only
        its index is counted here.  Returns replacement outputs (``fix``) or None."""
        if selected:
            self.selector.hits += 1
            call = self.next_call(op, stage)
        elif call is None:
            call = self.count_call(op, stage, scope)
        elif not self.recording(stage, scope):
            call = None
        if call is None:
            return None
        frames = stack() if stack is not None and self.config.stack and stage == "forward" else None
        self.busy = True
        try:
            if self._recorder_only:
                # a record the recorder joins from pieces runs no framework operation: no own-work marker
                if frames is None and not undefined and not extra \
                        and self.recorder.record_line(op, stage, scope, call, grad_fn, args, kwargs, outputs, func):
                    return None
                with self._quiet():
                    self.recorder.record_op(op, stage, scope, call, args, kwargs, outputs, func=func, grad_fn=grad_fn,
                                            stack=frames, undefined=undefined or None, extra=extra)
                return None
            with self._quiet():
                event = OpEvent("op", op, stage, scope, call, args, kwargs, outputs, grad_fn=grad_fn,
                                stack=frames, func=func, undefined=undefined or None, extra=extra)
                return self.dispatch(event)
        except OSError as exc:          # per op: a plain except, not the writing() context
            self._write_failed(exc)
            return None
        finally:
            self.busy = False

    @property
    def records_later(self) -> bool:
        """Whether an op's record may be made after the op returned (:meth:`reserve`): the task
        only records (an inline check judges outputs at the call)."""
        return self.handlers == [self.recorder]

    def reserve(self, op: str, stage: str, scope: str, *, stack=None) -> tuple | None:
        """For a call whose outputs hold their values only later (an asynchronous collective):
        its filters and call index now (:meth:`count_call`), and its record's place in the part,
        which the records after it wait behind until :meth:`fill`.  None: not recorded."""
        call = self.count_call(op, stage, scope)
        if call is None:
            return None
        frames = stack() if stack is not None and self.config.stack and stage == "forward" else None
        with self.writing():
            return call, frames, self.recorder.reserve()
        return None

    def fill(self, place: tuple, op: str, stage: str, scope: str, args, kwargs, outputs, *, func=None,
             grad_fn=None, undefined=None, extra: dict | None = None) -> None:
        """The record of a call :meth:`reserve` placed, made now that its outputs hold their values."""
        call, frames, slot = place
        record = None
        self.busy = True
        try:
            with self._quiet(), self.writing():
                record = self.recorder.encode(OpEvent("op", op, stage, scope, call, args, kwargs, outputs,
                                                      grad_fn=grad_fn, stack=frames, func=func,
                                                      undefined=undefined or None, extra=extra), defer=True)
        finally:
            self.busy = False
            with self.writing():
                self.recorder.fill(slot, record)

    def on_module(self, type_name: str, scope: str, stage: str, inputs, outputs, recompute: bool = False) -> None:
        """A module boundary (level ``module``/``mix``): one module record, in the module tree;
        ``recompute``: a forward activation checkpointing re-runs in backward (marked so)."""
        if not self.record_modules or self.busy or not self.recording(stage, scope) \
                or not self.selector.scope_selected(scope):
            return
        event = OpEvent("module", type_name, stage, scope, self.next_call(scope, stage),
                        tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {}, outputs,
                        extra={"recompute": True} if recompute else None)
        self.busy = True
        try:
            with self._quiet(), self.writing():
                self.recorder.module(scope, type_name)
                self.recorder.emit(self.recorder.encode(event, defer=True))
        finally:
            self.busy = False

    @contextlib.contextmanager
    def writing(self):
        """Records that cannot be written (disk full, quota) end the recording, not the training:
        one warning, nothing more is recorded, what was written stays readable."""
        try:
            yield
        except OSError as exc:
            self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> None:
        if not self.failed:
            self.failed = str(exc)
            warnings.warn(f"dispatchprobe: recording stopped: {exc}; the records written before are "
                          "readable, training goes on unrecorded", RuntimeWarning, stacklevel=4)

    def _quiet(self):
        """A context with the framework's autograd/tracing off, for the handlers (adapters override)."""
        return contextlib.nullcontext()

    def next_call(self, op: str, stage: str) -> int:
        key = (op, stage)
        n = self._calls[key]
        self._calls[key] = n + 1
        return n

    def flush(self) -> None:
        """Wait until every record and tensor so far is on disk (handlers finish pending work first)."""
        try:
            for h in self.handlers:
                h.flush()
            if self.recorder not in self.handlers:
                self.recorder.flush()
        finally:
            if self.part is not None:
                self.part.ops.flush()
                if self.part.tensors is not None:
                    self.part.tensors.flush()

    # ---- internals --------------------------------------------------------------------------
    def _enabled_here(self) -> bool:
        cfg = self.config
        return (not cfg.step or self.step_no in cfg.step) and self._enabled_rank()

    def _enabled_rank(self) -> bool:
        return not self.config.rank or self.rank in self.config.rank

    def _claim_run_dir(self) -> None:
        """A run directory never holds two runs: this rank's records of an earlier run (or an
        earlier probe) are refused, or deleted first with ``overwrite=True``.  Asked again only
        when the rank changed (``torch.distributed`` initialised after the probe was made): a
        look through every step folder at each step would grow with the run."""
        if self._claimed_rank == self.rank:
            return
        self._claimed_rank = self.rank
        old = [os.path.dirname(f) for name in ("ops.jsonl", "grads.jsonl") for f in
               glob.glob(os.path.join(glob.escape(self.run_dir), "step*", f"rank{self.rank}", name))]
        old = sorted({d for d in old if d not in self._parts_written})
        if not old:
            return
        if not self.config.overwrite:
            raise ConfigError(f"{self.run_dir} already holds records of rank {self.rank} from an earlier run "
                              f"({len(old)} step folder(s)); a run directory holds one run: record this one into "
                              f"a new dump_path (e.g. {self.run_dir.rstrip('/')}_2, or one per run such as "
                              f"dump_path=f\"{self.run_dir.rstrip('/')}_{{time.strftime('%m%d-%H%M')}}\"), "
                              "or pass overwrite=True to delete the earlier records first; build one probe per run "
                              "and call probe.step() between steps (a new probe each step is a new run)")
        for folder in old:
            shutil.rmtree(folder)

    def _open_part(self) -> None:
        if self.online is None:
            self._claim_run_dir()
        if not self._manifest_written:
            info = self._manifest_info()
            if self.online is not None:
                self.online.start(make_manifest(**info))
            else:
                write_manifest(self.run_dir, **info)
            self._manifest_written = True
        if self.part is None:
            if self.online is not None:
                from ..online.sender import StreamPart
                self.part = StreamPart(self.online, self.step_no, self.rank, self.backend.save_shard,
                                       self.backend.nbytes)
            else:
                self.part = PartWriter(self.part_dir, self.backend.save_shard, self.backend.nbytes)
            self._parts_written.add(self.part_dir)
            self._calls.clear()
            self.recorder.start_part(self.part)
            for h in self.handlers:
                if h is not self.recorder:
                    h.start_part()
            self._summary_at_open = self.summary()

    def _manifest_info(self) -> dict:
        return dict(framework=self.backend.name, framework_version=self.backend.version,
                    device=self.backend.accelerator(), config=self.config.to_dict(),
                    extra={"rank": self.rank, **self._manifest_notes})

    def note_in_manifest(self, key: str, value) -> None:
        """A fact about the whole run learnt while recording (what its records leave out), added to
        ``manifest.json`` so that readers can say it: the manifest is written again where the fact
        is new."""
        if self._manifest_notes.get(key) == value:
            return
        self._manifest_notes[key] = value
        if self._manifest_written and self.online is None:
            write_manifest(self.run_dir, **self._manifest_info())

    def summary(self) -> dict:
        """What the task's checks counted over the whole run so far, e.g. ``{"task": "overflow",
        "checked": 812, "flagged": 0, ...}`` (recording tasks: the task only)."""
        out = {"task": self.task.name}
        for h in self.handlers:
            out.update(h.summary())
        return out

    def _boundary(self) -> None:
        for h in self.handlers:
            h.boundary()

    def optimizer_stepping(self) -> None:
        """An optimizer is about to step (adapters call this from the framework's global pre-hook)."""
        if self.part is not None:
            for h in self.handlers:
                h.optimizer_stepping()

    def loss_scale_seen(self, scale=None, found_inf: bool | None = None) -> None:
        """A framework's dynamic loss scaler, as the adapter recognised it: ``scale`` (the 0-dim
        scale multiplied into the loss) or ``found_inf`` (what its check of the gradients found:
        MindSpore's ``amp.all_finite``).  Adapters call it where the framework's scaler does not
        run on the ops the handlers recognise (torch's ``GradScaler``)."""
        if self.part is not None:
            for h in self.handlers:
                h.loss_scale_seen(scale, found_inf)

    def _close_part(self) -> None:
        if self.part is not None:
            try:
                self._boundary()
            finally:
                self._finish_part()

    def _finish_part(self) -> None:
        if self.part is not None:
            self.part.close()
            counts = self.summary()
            if len(counts) > 1:      # inline checks: this part's counts, so that `show` can say
                at_open = self._summary_at_open   # how much was checked when nothing was flagged
                part = {k: v - at_open.get(k, 0) if isinstance(v, int) else v for k, v in counts.items()}
                atomic_write_text(os.path.join(self.part.folder, "checks.json"), json.dumps(part))
            self.part = None

    @staticmethod
    def _detect_rank() -> int:
        for var in ("RANK", "LOCAL_RANK", "RANK_ID"):
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        return 0

    def _install(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _uninstall(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def dispatch(self, event: OpEvent):
        """Give an event to each handler; a handler may replace the outputs (``fix``)."""
        out = None
        for h in self.handlers:
            replaced = h.on_op(event)
            if replaced is not None:
                event.outputs = out = replaced
        return out
