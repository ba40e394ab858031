"""The eager probe's ``TorchDispatchMode``: every aten call below autograd, run first, untouched,
then handed to the probe with what it read and wrote (:class:`ProbeMode`), and the per-overload
facts it asks on every call (:class:`OpFacts`)."""

from __future__ import annotations

from typing import NamedTuple

from . import tensor_backend as torch_backend
from . import collectives, ops, tensor_kinds
from .compiled_frames import in_compiled_code
from .internals.dispatch import TorchDispatchMode
from .internals.dynamo import FRAMES, call_outside_dynamo, frame_callback, never_compiled
from .process_state import STATE
from .written_args import copy_written, destinations, replace_args


class OpFacts(NamedTuple):
    """What the mode asks of an overload on every call, looked up once per overload."""

    func: object                     # held, so that the id keying it stays this overload's
    wanted: bool
    name: str
    reads_written: tuple
    allocates_uninitialised: bool
    out_args: tuple
    counted_writes: tuple            # every argument whose write the record must see: in place, out=, overwritten
    writes_unseen: bool              # may write memory without moving version counters
    collective: bool                 # c10d / functional collectives (and wait_tensor)


class ProbeMode(TorchDispatchMode):
    """Records the ops the user's eager code runs.  Compiled code keeps running compiled (a mode
    without ``ignore_compile_internals`` makes dynamo skip every frame, silently running the
    model eagerly); the calls compiled graphs make are not recorded: they are not the eager
    op granularity, and ``probe_backend`` records the graphs' own ops."""

    # higher-order ops (a compiled graph's rng wrapper around activation checkpointing's random ops,
    # torch.cond) reach the mode too, popped as for any op: they run, unrecorded (see capture._learn)
    supports_higher_order_operators = True

    def __init__(self, probe: "DispatchProbe"):
        super().__init__()
        self.probe = probe

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's recursive disable (a few µs per
        # op); the mode keeps dynamo out of its frames itself, paying that only inside a call of
        # compiled code, where dynamo's frame callback is set (see internals.dynamo.call_outside_dynamo)
        return frame_callback is None

    def __enter__(self):
        STATE.active_probes.append(self.probe)     # probe_backend's graphs record into it (same dump_path)
        return super().__enter__()

    def __exit__(self, *exc):
        STATE.active_probes.remove(self.probe)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if frame_callback is not None and frame_callback() is not None:    # inside compiled code: dynamo off
            return call_outside_dynamo(self.__torch_dispatch__, func, types, args, kwargs)
        if self.probe.written_last:         # the previous op returned: autograd has moved their counters
            self.probe.carry_over_written()
        if types and tensor_kinds.desugars(types):
            if tensor_kinds.desugars(types) == tensor_kinds.FAKE:
                return func(*args, **(kwargs or {}))
            # a wrapper subclass (DTensor, AsyncCollectiveTensor) runs first and turns the call into
            # plain ops and collectives, which come back here: the probe records local values only
            # (torch's CommDebugMode and DebugMode do the same)
            collectives.note_meshes(args)
            return NotImplemented
        kwargs = kwargs or {}
        probe = self.probe
        if probe.pending.entries and not probe.busy and not STATE.probe_work:
            probe.pending.poll(func, args, kwargs)      # collectives complete now: recorded before this op
        facts = probe.facts(func)
        # every collective is numbered on its group, recorded or not, so ranks' numbers agree
        called = probe.collective_seq.describe(func, args, kwargs) if facts.collective and not probe.busy else None
        busy = probe.busy or STATE.probe_work      # this probe's own work, or another probe's
        if busy or not facts.wanted or in_compiled_code():
            out = func(*args, **kwargs)
            if not busy:
                if facts.wanted:        # an op of a compiled graph (its records, if any, are probe_backend's)
                    probe.graph_ops += 1
                if facts.allocates_uninitialised:
                    probe.uninitialised.add(out)
                elif probe.uninitialised or facts.writes_unseen:      # an op not recorded still writes memory
                    probe.uninitialised.written(func, args, kwargs, out)
            return out
        where = probe.where()
        seen_args, seen_kwargs = args, kwargs
        undefined = probe.uninitialised.among(func, args, kwargs) if probe.uninitialised else None
        recorded = probe.would_record(where[0], where[1])
        written = facts.reads_written
        if written and recorded:  # in-place ops: record the inputs as they were *before* the op ran
            seen_args, seen_kwargs = copy_written(probe, written, args, kwargs, undefined)
        if facts.out_args and recorded:   # out=: a destination, its prior contents are no input
            seen_args, seen_kwargs, undefined = destinations(facts.out_args, seen_args, seen_kwargs, undefined)
        collective = recorded and facts.collective
        extra = {"collective": called} if called else None
        if where[3]:               # a forward op re-run by activation checkpointing
            extra = {**(extra or {}), "recompute": True}
        if collective:
            seen_args, seen_kwargs = collectives.copy_overwritten(
                func, seen_args, seen_kwargs, lambda t: probe.stand_in_for_written(t, False, torch_backend.clone))
        out = func(*args, **kwargs)
        if undefined is not None or facts.writes_unseen:
            probe.uninitialised.written(func, args, kwargs, out)
        if not recorded:          # stage or scope filtered out: nothing more to do
            return out
        if facts.counted_writes:
            # autograd moves a written tensor's version counter only once this call returns: count
            # the write now, so that the record measures the new values, not a cached earlier reading
            # (``copy_``'s and ``fill_``'s too, which read nothing of what they overwrite)
            replace_args(facts.counted_writes, args, kwargs, probe.count_write)
        if collective:            # outputs hold their values once the work completes: recorded then
            seen_args, seen_kwargs = collectives.named_groups(func, seen_args, seen_kwargs)
            if probe.pending.defer(func, out, facts.name, where[:3], seen_args, seen_kwargs, undefined, extra):
                return out
            collectives.settle(func, out)
        stage, scope, grad_fn, _ = where
        # an op returning nothing holds its results in the arguments it wrote: its record's outputs
        results = ops.destination_values(func, args, kwargs) if out is None and facts.counted_writes else out
        # facts.wanted holds the op's selection, would_record the stage's and scope's
        replaced = probe.on_op(facts.name, stage, scope, seen_args, seen_kwargs, results, func=func, grad_fn=grad_fn,
                               stack=ops.user_stack, undefined=undefined,
                               extra=extra, selected=True)
        return out if replaced is None or results is not out else replaced




if FRAMES is not None:        # the frame that hands an op on with dynamo off
    never_compiled(ProbeMode.__torch_dispatch__.__code__)
