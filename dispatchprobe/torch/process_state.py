"""The torch adapter's process state, in one object (:data:`STATE`).

Torch's hooks and caches are per process, so some of the adapter's state is too.  Two kinds:

- what probes hold while they record: the probes recording now, the module-hook trackers and
  their users, the module exit hooks, the hook removals finalizers queued, the global optimizer
  step hooks (every probe kind's, until it is closed or collected).  Once every probe is
  closed or collected none is left (:meth:`AdapterState.held` is empty); a test asserts it.
- what the process keeps across probes, keyed by memory or names that stay valid: process
  groups' record values and DeviceMesh dimensions, the writes no version counter saw, the rows of
  values compiled graphs returned, compiled graphs' records by slot (compiled code calls them by
  that number), parameter names per optimizer, the tensors the offline tools' ranks exchanged
  (freed only after their process group is destroyed: see ``replay.TorchDistributed``).

:meth:`AdapterState.reset` empties both (tests, a process starting over); it refuses while a
probe records or holds hooks.  Containers are emptied in place: modules may hold them under a short name on
their per-op paths.  Memo tables of facts that never change in a process (an overload's schema
facts, a class's kind) are not state and stay beside the functions they speed up.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields

import torch

from .internals.dispatch import set_grad_enabled


@dataclass(eq=False)
class AdapterState:
    """Everything the torch adapter keeps between calls; one instance, :data:`STATE`."""

    # held while probes record
    active_probes: list = field(default_factory=list)       # eager probes recording now, innermost last
    module_scopes: list = field(default_factory=list)       # their module-scope trackers, fed by the global hooks
    module_hook_users: list = field(default_factory=list)   # one entry per probe holding the global hooks
    module_exits: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)   # module -> exit hook
    pending_removals: list = field(default_factory=list)    # hook removals queued by finalizers
    probe_work: list = field(default_factory=list)          # probes doing their own work now (ProbeWork)
    optimizer_hooks: dict = field(default_factory=dict)     # torch's global optimizer step hooks: handle id -> holder
    # kept across probes
    module_hook_ids: list = field(default_factory=list)     # (pre-hook id, hook id), reused: dynamo guards on them
    process_groups: dict = field(default_factory=dict)      # group name -> its record value
    mesh_dims: dict = field(default_factory=dict)           # group name -> the DeviceMesh dimension that made it
    meshes_seen: set = field(default_factory=set)
    unseen_writes: dict = field(default_factory=dict)       # storage address -> writes no version counter saw
    returned_rows: dict = field(default_factory=dict)       # compiled graphs' returned values -> their rows
    graphs: dict = field(default_factory=dict)              # compiled graphs' records by slot
    parameter_names: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    collective_tensors: list = field(default_factory=list)  # the offline tools' gloo tensors, kept until the group ends

    HELD = ("active_probes", "module_scopes", "module_hook_users", "module_exits", "pending_removals", "probe_work",
            "optimizer_hooks")

    def held(self) -> dict:
        """What probes still hold, by field ({} once every probe is closed or collected)."""
        return {name: len(getattr(self, name)) for name in self.HELD if len(getattr(self, name))}

    def reset(self) -> None:
        """Empties every container in place; refuses while a probe records or holds hooks."""
        if self.held():
            raise RuntimeError("dispatchprobe: the torch adapter's state cannot be reset while a probe records "
                               "or holds hooks; close it first")
        for f in fields(self):
            getattr(self, f.name).clear()


STATE = AdapterState()


class ProbeWork:
    """A probe's own work (its handlers, parameter records, a grad probe's reading), marked for
    every probe of the process: another probe's dispatch mode, active around it (a probe left open,
    a grad probe beside a recording one), passes those ops through instead of recording them as the
    user's.  Gradients off, as for any of a probe's own calls."""

    __slots__ = ("prev",)

    def __enter__(self):
        STATE.probe_work.append(self)
        self.prev = torch.is_grad_enabled()
        set_grad_enabled(False)

    def __exit__(self, *exc):
        set_grad_enabled(self.prev)
        STATE.probe_work.pop()
