"""PyTorch eager capture: a TorchDispatchMode below autograd plus module-scope tracking.

The mode sees every aten call (forward, and backward when ``.backward()`` runs inside the probe)
after autocast and autograd, so what is recorded is what the kernels computed.

Transparency: the mode runs the op first, untouched, and only then looks at its results, under
``no_grad`` with the mode popped (the probe's own ops are not recorded).  Never the global RNG.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
import weakref
from typing import NamedTuple

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import backend as torch_backend
from . import collectives, fused_stats, hooks, ops, tensor_kinds
from ..core.config import ConfigError
from ..core.session import ProbeSession
from .process_state import STATE
from .internals import autograd as torch_autograd
from .internals.autograd import current_autograd_node, current_graph_task_id
from .internals.dispatch import TorchDispatchMode, tree_flatten, tree_leaves
from .internals.dynamo import FRAMES, call_outside_dynamo, frame_callback, never_compiled


# where AOTAutograd's runtime wrappers live (not imported: that would import dynamo)
_AOT_RUNTIME = os.path.join(torch.__path__[0], "_functorch", "_aot_autograd", "runtime_wrappers.py")
_AOT_MODULE = "torch._functorch._aot_autograd.runtime_wrappers"
active_probes = STATE.active_probes      # DispatchProbes recording now, innermost last
_COLLECTIVES = tuple(f"{ns}." for ns in collectives.NAMESPACES)


def _in_compiled_code(fx: bool = False) -> bool:
    """Whether the op is called by a compiled graph (inductor's ``.out`` calls, an ``aot_eager``
    graph's ops, a probe backend's recording op): every AOTAutograd-compiled region, forward
    and backward, runs inside a function of ``runtime_wrappers.py`` (not even imported until
    something is compiled: eager-only training pays one dictionary lookup per op).

    The walk up the stack stops at the first module call with no FX code below it: a compiled
    graph never calls a module of the user's (dynamo inlines modules; a graph break runs in the
    user's frames, outside the graph), so the graph's frames, when there are any, lie below it,
    and a deep model's stack is not walked to its root per op.  An ``aot_eager`` graph is itself a module (an FX
    ``GraphModule``): from FX code the walk goes on to the root.  A backward op stops the walk at
    the autograd engine's entry: a compiled backward runs below it.  ``fx``: the caller is a module
    hook of an FX graph."""
    if _AOT_MODULE not in sys.modules:
        return False
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if name == _AOT_RUNTIME:
            return True
        if code is _CALL_IMPL or code is _WRAPPED_CALL_IMPL:     # (hashing a code object costs more)
            if not fx:
                return False
        elif code is _ENGINE_RUN:
            return False
        elif name.startswith(_FX_CODE):
            fx = True
        f = f.f_back
    return False


_CALL_IMPL, _WRAPPED_CALL_IMPL = torch_autograd.MODULE_CALL_CODES
_ENGINE_RUN = torch_autograd.ENGINE_RUN_CODE
_FX_CODE = ("<eval_with_key>", os.path.join(torch.__path__[0], "fx", ""))


class _ProbeMode(TorchDispatchMode):
    """Records the ops the user's eager code runs.  Compiled code keeps running compiled (a mode
    without ``ignore_compile_internals`` makes dynamo skip every frame, silently running the
    model eagerly); the calls compiled graphs make are not recorded: they are not the eager
    op granularity, and ``probe_backend`` records the graphs' own ops."""

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
        active_probes.append(self.probe)     # probe_backend's graphs record into it (same dump_path)
        return super().__enter__()

    def __exit__(self, *exc):
        active_probes.remove(self.probe)
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
        facts = probe._facts.get(id(func)) or probe._learn(func)
        # every collective is numbered on its group, recorded or not, so ranks' numbers agree
        called = probe.collective_seq.describe(func, args, kwargs) if facts.collective and not probe.busy else None
        if probe.busy or not facts.wanted or _in_compiled_code():
            out = func(*args, **kwargs)
            if not probe.busy:
                if facts.allocates_uninitialised:
                    probe.uninitialised.add(out)
                elif probe.uninitialised or facts.writes_unseen:      # an op not recorded still writes memory
                    probe.uninitialised.written(func, args, kwargs, out)
            return out
        where = probe._where()
        seen_args, seen_kwargs = args, kwargs
        undefined = probe.uninitialised.among(func, args, kwargs) if probe.uninitialised else None
        recorded = probe.would_record(where[0], where[1])
        written = facts.reads_written
        if written and recorded:  # in-place ops: record the inputs as they were *before* the op ran
            seen_args, seen_kwargs = _copy_written(probe, written, args, kwargs, undefined)
        if facts.out_args and recorded:   # out=: a destination, its prior contents are no input
            seen_args, seen_kwargs, undefined = _destinations(facts.out_args, seen_args, seen_kwargs, undefined)
        collective = recorded and facts.collective
        if collective:
            seen_args, seen_kwargs = collectives.copy_overwritten(
                func, seen_args, seen_kwargs, lambda t: probe.stand_in_for_written(t, False, torch_backend.clone))
        out = func(*args, **kwargs)
        if undefined is not None or facts.writes_unseen:
            probe.uninitialised.written(func, args, kwargs, out)
        if not recorded:          # stage or scope filtered out: nothing more to do
            return out
        if written or facts.out_args:
            # autograd moves a written tensor's version counter only once this call returns: count
            # the write now, so that the record measures the new values, not a cached earlier reading
            _replace_args(written + facts.out_args, args, kwargs, probe.count_write)
        if collective:            # outputs hold their values once the work is waited for
            collectives.settle(func, out)
            seen_args, seen_kwargs = collectives.named_groups(func, seen_args, seen_kwargs)
        stage, scope, grad_fn = where
        replaced = probe.on_op(facts.name, stage, scope, seen_args, seen_kwargs, out, func=func, grad_fn=grad_fn,
                               stack=ops.user_stack, undefined=undefined,
                               extra={"collective": called} if called else None)
        return out if replaced is None else replaced


if FRAMES is not None:        # the frame that hands an op on with dynamo off
    never_compiled(_ProbeMode.__torch_dispatch__.__code__)


class _Facts(NamedTuple):
    """What the mode asks of an overload on every call, looked up once per overload."""

    func: object                     # held, so that the id keying it stays this overload's
    wanted: bool
    name: str
    reads_written: tuple
    allocates_uninitialised: bool
    out_args: tuple
    writes_unseen: bool              # may write memory without moving version counters
    collective: bool                 # c10d / functional collectives (and wait_tensor)


def _replace_args(positions, args, kwargs, replace):
    """``args``/``kwargs`` with each tensor at ``positions`` ((index, name) pairs), and each
    tensor of a list there, replaced by ``replace(tensor)``."""
    args, kwargs = list(args), dict(kwargs)

    def swap(t):
        if isinstance(t, (list, tuple)):
            return type(t)(swap(x) for x in t)
        return replace(t) if isinstance(t, torch.Tensor) else t

    for i, name in positions:
        if i < len(args):
            args[i] = swap(args[i])
        elif name in kwargs:
            kwargs[name] = swap(kwargs[name])
    return tuple(args), kwargs


def _destinations(outs, args, kwargs, undefined: set | None):
    """``out=`` arguments recorded as undefined (shape and dtype only, never judged, replayed as
    zeros): aliases stand in for them, so the op's output, the same tensor, keeps its values."""
    undefined = set() if undefined is None else undefined

    def alias(t):
        new = t.detach()
        undefined.add(id(new))
        return new

    return (*_replace_args(outs, args, kwargs, alias), undefined)


def _copy_written(probe, written, args, kwargs, undefined: set | None):
    """Stand-ins for the tensors an op is about to overwrite (a tensor, or each tensor of a list:
    the optimizers' ``_foreach_*_``), in place of the originals: the record holds what the op
    received (:meth:`~dispatchprobe.core.session.ProbeSession.stand_in_for_written`: a copy, or
    the tensor's entry measured now).  A copy of an undefined tensor is undefined too."""
    def copy(old):
        new = torch_backend.clone(old)
        if undefined and id(old) in undefined:
            undefined.add(id(new))
        return new

    def stand_in(old):
        return probe.stand_in_for_written(old, bool(undefined) and id(old) in undefined, copy)

    return _replace_args(written, args, kwargs, stand_in)


class _Uninitialised:
    """Memory from the ``empty`` family holds no values until an op writes it: its bytes differ
    from run to run, so such tensors are recorded with ``undefined: true`` and never judged.

    Tracked by storage, byte range by byte range: a tensor is undefined while any byte of it is
    unwritten (FSDP2 copies a rank's shard into one slice of the all-gather buffer, and the
    all-gather fills the rest).  What counts as written is decided in :meth:`written` alone: the
    arguments an op's schema marks, those torch's or our tables add (``ops.defined_args``: batch
    norm's running statistics, collectives' output buffers), and the new outputs of a non-aten op
    that alias tracked memory (a custom op filling a view of a buffer it was given, as FSDP's
    ``all_gather_copy_in`` does: its Python kernel's writes run below the mode)."""

    def __init__(self):
        self._live: dict = {}            # storage address -> [weak reference, unwritten byte ranges]

    def __bool__(self) -> bool:
        return bool(self._live)

    @staticmethod
    def _key(t):
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None

    @staticmethod
    def _span(t) -> tuple[int, int]:
        """The bytes of its storage the tensor covers (from its first to its last element)."""
        size = t.element_size()
        start = t.storage_offset() * size
        if not t.numel():
            return start, start
        return start, start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * size

    def add(self, out) -> None:
        # plain memory only: a fake tensor (DTensor's sharding propagation allocates some) has none
        if isinstance(out, torch.Tensor) and tensor_kinds.readable(out) and out.numel():
            key = self._key(out)
            if key is not None:
                self._live[key] = [torch_backend.memory_ref(out), [self._span(out)]]

    def _hit(self, t) -> bool:
        key = self._key(t)
        entry = self._live.get(key)
        if entry is None:
            return False
        if not torch_backend.memory_alive(entry[0]):
            del self._live[key]
            return False
        a, b = self._span(t)
        return any(x < b and a < y for x, y in entry[1])

    def among(self, func, args, kwargs) -> set:
        """``id``s of the op's tensor arguments that are still undefined; the arguments an op
        fills without reading (``fill_``, ``copy_``, a collective's output buffer) are recorded
        after the op, so not these."""
        skip = {i for pair in ops.filled_args(func) for i in pair}
        found = set()
        for k, v in [*enumerate(args), *kwargs.items()]:
            if k in skip:
                continue
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor) and self._hit(t):
                    found.add(id(t))
        return found

    def written(self, func, args, kwargs, out) -> None:
        """Learns what the op wrote: the uninitialised bytes it filled are defined now, and a
        write no version counter sees is counted (:func:`tensor_kinds.unseen_write`), so that
        no cache takes what it held before for its values after.  An op outside aten (a
        collective, FSDP's custom ops) may have written any tensor it was given: counted all."""
        foreign = ops.unseen_writes(func) is True
        if foreign:
            given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            for t in given:
                tensor_kinds.unseen_write(t)
            if not self._live:
                return
        unmarked = () if foreign else ops.unseen_writes(func)
        for i, name in ops.defined_args(func):
            v = args[i] if i < len(args) else kwargs.get(name)
            for t in tree_leaves(v):
                if isinstance(t, torch.Tensor):
                    if (i, name) in unmarked:
                        tensor_kinds.unseen_write(t)
                    self._write(t)
        if foreign and not ops.is_alias(func):
            given_ids = {id(t) for t in given}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t) not in given_ids:
                    self._write(t)

    def _write(self, t) -> None:
        key = self._key(t)
        entry = self._live.get(key)
        if entry is None:
            return
        a, b = self._span(t)
        left = []
        for x, y in entry[1]:
            if b <= x or y <= a:
                left.append((x, y))
                continue
            if x < a:
                left.append((x, a))
            if b < y:
                left.append((b, y))
        if left:
            entry[1] = left
        else:
            del self._live[key]


class _ModuleHooks:
    """One global forward pre-hook and one global forward hook for the whole process, present
    while a probe is recording and handing module boundaries to the probes inside ``with probe:``.

    Each ``with probe:`` puts back the same two hooks under the same handle ids: dynamo guards on
    the global hooks, and new handles at every entry would recompile a compiled model each step
    until it gave up and ran eagerly; so a compiled model is compiled at most twice (without and
    with the probe).  Inside a graph dynamo traces, the hooks return at once.

    A module's own forward hooks (adapters, scaling, FSDP's) run after the global one: for a
    module that has some, the exit is a hook of its own kept last in its ``_forward_hooks``, so
    what those hooks run is recorded in the module's scope, and its backward too."""

    # torch warns at every call of a compiled module while global hooks exist; ours are the
    # probe's business, not the user's (the filter is there only while they are)
    _WARNING = ("ignore", re.compile(r"Using `torch\.compile\(module\)` when there are global hooks"), UserWarning,
                None, 0)

    def __init__(self, state):
        # in the adapter's process state: the trackers of the probes recording now, the probes
        # holding the hooks, (pre-hook id, hook id) reused at every entry, module -> its exit hook
        self.active: list["_ModuleScopes"] = state.module_scopes
        self.users: list = state.module_hook_users
        self._ids: list = state.module_hook_ids
        self._exits: weakref.WeakKeyDictionary = state.module_exits

    def acquire(self) -> None:
        self.users.append(True)

    def release(self) -> None:
        if self.users:
            self.users.pop()
        if not self.users:
            for h in list(self._exits.values()):
                h.remove()
            self._exits.clear()

    def add(self, scopes: "_ModuleScopes") -> None:
        if not self.active:
            self._put_back()
        self.active.append(scopes)

    def remove(self, scopes: "_ModuleScopes") -> None:
        if scopes in self.active:
            self.active.remove(scopes)
            if not self.active:
                self._take_out()

    def _put_back(self) -> None:
        if not self._ids:
            pre = register_module_forward_pre_hook(_module_entered)
            post = register_module_forward_hook(_module_left_globally, always_call=True)
            self._ids[:] = (pre.id, post.id)
        else:
            torch_autograd.put_back_global_hooks(self._ids, _module_entered, _module_left_globally)
        warnings.filters.insert(0, self._WARNING)
        _filters_changed()

    def _take_out(self) -> None:
        torch_autograd.take_out_global_hooks(self._ids)
        if self._WARNING in warnings.filters:
            warnings.filters.remove(self._WARNING)
            _filters_changed()

    def keep_exit_last(self, mod) -> None:
        """Registers (again) the module's own exit hook when another hook is now behind it."""
        handle = self._exits.get(mod)
        if handle is not None:
            if next(reversed(torch_autograd.forward_hooks(mod))) == handle.id:
                return
            handle.remove()
        self._exits[mod] = mod.register_forward_hook(_module_left, always_call=True)

    def has_own_exit(self, mod) -> bool:
        handle = self._exits.get(mod)
        return handle is not None and handle.id in torch_autograd.forward_hooks(mod)


def _filters_changed() -> None:
    """What ``warnings.filterwarnings`` does after changing the list (its caches are keyed on it)."""
    (getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held"))()


_HOOKS = _ModuleHooks(STATE)
_GraphModule = torch.fx.GraphModule


def _module_entered(mod, args) -> None:
    # is_compiling first: dynamo folds it and traces nothing else here (no guard on our state)
    if torch.compiler.is_compiling() or not _HOOKS.active or _in_compiled_code(isinstance(mod, _GraphModule)):
        return
    if torch_autograd.forward_hooks(mod):
        _HOOKS.keep_exit_last(mod)
    for scopes in _HOOKS.active:
        scopes.enter(mod, args)


def _module_left_globally(mod, args, output) -> None:
    if torch.compiler.is_compiling() or not _HOOKS.active or _HOOKS.has_own_exit(mod) \
            or _in_compiled_code(isinstance(mod, _GraphModule)):
        return
    for scopes in _HOOKS.active:
        scopes.leave(mod, args, output)


def _module_left(mod, args, output) -> None:
    if torch.compiler.is_compiling() or not _HOOKS.active or _in_compiled_code(isinstance(mod, _GraphModule)):
        return
    for scopes in _HOOKS.active:
        scopes.leave(mod, args, output)


def _run_first(handle):
    """Moves a just registered tensor hook before the tensor's other hooks: a module entering
    backward is then in scope when the hooks its own forward hooks put on its output run (FSDP's
    pre-backward all-gather), and its backward-done callback is queued before theirs."""
    for h in getattr(handle, "handles", (handle,)):
        hooks = h.hooks_dict_ref()
        if hooks is not None and h.id in hooks and next(iter(hooks)) != h.id:
            # rebuilt, not ``move_to_end``: autograd walks the dictionary's own order (PyDict_Next)
            entries = list(hooks.items())
            hooks.clear()
            hooks[h.id] = dict(entries)[h.id]
            hooks.update((k, v) for k, v in entries if k != h.id)
    return handle


_LEAVES = (int, float, bool, str, type(None))


def _needing_grad(obj) -> list:
    """The tensors requiring grad in a module's inputs or output, in pytree order: a tensor, or a
    flat tuple or list of tensors and plain values, directly (most module calls); anything
    nested through the pytree registry."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if type(obj) is tuple or type(obj) is list:
        found = []
        for x in obj:
            if isinstance(x, torch.Tensor):
                if x.requires_grad:
                    found.append(x)
            elif not isinstance(x, _LEAVES):
                break
        else:
            return found
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


class _ModuleScopes:
    """The module scope of each op, forward and backward, for one probe.

    Modules are named from the root down (``Net.layers.1.mlp``, as torch's ``ModuleTracker``
    names them).  Forward: entered and left by :class:`_ModuleHooks`.  Backward: a module is
    entered when the gradient of its output arrives and left when its inputs' gradients are done
    (tensor and multi-grad hooks, which observe gradients without changing them)."""

    def __init__(self, probe: "DispatchProbe", root: torch.nn.Module | None):
        self.probe = probe
        self.forward_stack: list[str] = []
        self.backward_active: list[str] = []
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._named: weakref.WeakSet = weakref.WeakSet()
        self._types: dict[str, str] = {}
        self._grad_out: dict = {}
        self._left_early: dict = {}      # backward exits seen before their module entered
        self._hooks: list = []           # tensor hooks of this entry's backward
        self._has_callback = False
        self._holds: weakref.finalize | None = None    # the global hooks, held until close (or collection)
        if root is not None:
            self._name(root)

    @property
    def current(self) -> str:
        if current_graph_task_id() != -1:
            return self._innermost_backward(current_autograd_node() is None)
        return self.forward_stack[-1] if self.forward_stack else ""

    def _innermost_backward(self, after_graph: bool = False) -> str:
        # Modules sharing an output tensor (a model whose last layer's output is its own) enter
        # backward together: prefer the deepest descendant of the latest entry.
        active = self.backward_active
        if not active:
            return ""
        if after_graph:
            # no node running: a callback queued for the end of backward (FSDP's root
            # post-backward, which reduce-scatters the gradients of modules whose inputs need
            # none): it belongs to the outermost module still in backward, whose hooks queued it
            return min(active, key=lambda name: name.count("."))
        current = active[-1]
        for name in reversed(active):
            if name.startswith(current + "."):
                current = name
        return current

    def _name(self, mod) -> str:
        name = self._names.get(mod)
        if name is None:
            name = self._names[mod] = type(mod).__name__
        if mod not in self._named:
            self._named.add(mod)
            collectives.note_meshes(mod._parameters.values())     # FSDP2's sharded parameters: their mesh
            for child_name, child in mod.named_children():
                self._names[child] = f"{name}.{child_name}"
                self._name(child)
        return name

    def install(self) -> None:
        hooks.remove_collected()
        if self._holds is None or not self._holds.alive:
            _HOOKS.acquire()
            self._holds = hooks.remove_when_collected(self.probe, _HOOKS.release)
        _HOOKS.add(self)

    def uninstall(self) -> None:
        _HOOKS.remove(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.forward_stack.clear()

    def release(self) -> None:
        """The probe is closed: the global hooks go when no probe holds them."""
        self.uninstall()
        if self._holds is not None:
            self._holds()           # once: a finalizer runs at most once
            hooks.remove_collected()

    # ---- forward --------------------------------------------------------------------------------
    def enter(self, mod, args) -> None:
        name = self._name(mod)
        self._types[name] = type(mod).__name__
        self.forward_stack.append(name)
        tensors = _needing_grad(args)
        if len(tensors) == 1:
            # one input (most modules): a plain tensor hook, called as torch's multi-grad hook
            # calls its function (with the list of gradients), without its per-call bookkeeping
            leave = self._backward_leave_fn(name)
            self._hooks.append(tensors[0].register_hook(lambda grad: leave([grad]) and None))
        elif tensors:
            self._hooks.append(register_multi_grad_hook(tensors, self._backward_leave_fn(name)))

    def leave(self, mod, args, output) -> None:
        name = self._name(mod)
        stack = self.forward_stack
        if name in stack:
            del stack[len(stack) - 1 - stack[::-1].index(name)]
        tensors = _needing_grad(output)
        enter = self._backward_enter_fn(name)
        if len(tensors) == 1:
            # one output: a plain tensor hook, which also fires on the root of backward (the loss
            # module's output), where torch's multi-grad hook never does
            self._hooks.append(_run_first(tensors[0].register_hook(lambda grad: enter(grad) and None)))
        elif tensors:
            self._hooks.append(_run_first(register_multi_grad_hook(tensors, enter)))
        self.probe.on_module(self._types.get(name, type(mod).__name__), name, "forward", args, output)

    # ---- backward -------------------------------------------------------------------------------
    def _backward_enter_fn(self, name):
        def enter(*grads) -> None:
            if not self._has_callback:
                torch_autograd.queue_backward_callback(self._backward_done)
                self._has_callback = True
            if name in self._left_early:
                # output and input are one tensor (Identity, Dropout(p=0) returns its input): the
                # module's exit hook fired first; it runs no backward op, so it never becomes a scope
                self.probe.on_module(self._types.get(name, ""), name, "backward", grads,
                                     self._left_early.pop(name))
            else:
                self.backward_active.append(name)
                self._grad_out[name] = grads
        return enter

    def _backward_leave_fn(self, name):
        def leave(*grads) -> None:
            stack = self.backward_active
            if name not in stack:
                self._left_early[name] = tuple(grads)
                return
            del stack[len(stack) - 1 - stack[::-1].index(name)]
            self.probe.on_module(self._types.get(name, ""), name, "backward", self._grad_out.pop(name, ()),
                                 tuple(grads))
        return leave

    def _backward_done(self) -> None:
        # queued by the first module entering backward: runs again after the callbacks queued
        # after it (by the modules' own hooks), so that those still see the modules in backward
        torch_autograd.queue_backward_callback(self._backward_closed)

    def _backward_closed(self) -> None:
        # modules whose inputs need no gradient (the first layer, the root) never leave backward
        # by a hook: their module records are written when backward ends, innermost first
        self._has_callback = False
        for name in reversed(self.backward_active):
            self.probe.on_module(self._types.get(name, ""), name, "backward", self._grad_out.get(name, ()), ())
        self.backward_active.clear()
        self._grad_out.clear()
        self._left_early.clear()


class TorchSession(ProbeSession):
    """What every torch capture path's session shares: the torch backend, the rank from
    torch.distributed once it is initialised, handlers run under ``no_grad``."""

    backend = torch_backend

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # optimizer steps about to run (a step skipped by a loss scaler never calls it): held
        # weakly, as the step hook below, and removed at close
        ref = weakref.ref(self)

        def stepping(optimizer, args, kwargs) -> None:
            session = ref()
            if session is not None and session.owns(optimizer):
                session.optimizer_stepping()
                session._parameters(optimizer, "grad")

        def stepped(optimizer, args, kwargs) -> None:
            session = ref()
            if session is not None and session.owns(optimizer):
                session._parameters(optimizer, "value")
        self._owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        hooks.remove_collected()
        self._stepping_hook = register_optimizer_step_pre_hook(stepping)
        self._stepped_hook = register_optimizer_step_post_hook(stepped)
        # a probe never closed (a notebook cell, an exception) leaves no hook behind once collected
        hooks.remove_when_collected(self, self._stepping_hook.remove, self._stepped_hook.remove)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stepping_hook.remove()
            self._stepped_hook.remove()
            hooks.remove_collected()

    def module_names(self):
        """{module: its scope name} of the modules this session has seen run, or None."""
        scopes = getattr(self, "scopes", None)
        return scopes._names if scopes is not None else None

    def roots(self) -> list:
        """The outermost modules among those this session has seen run."""
        from .param_records import roots_of
        names = self.module_names()
        return roots_of(names) if names is not None else []

    def owns(self, optimizer) -> bool:
        """Whether ``optimizer`` updates a parameter of a model this session has seen run (any
        optimizer while it has seen none, and one of tensors that are no module's parameters): a
        session left open (a backend never closed, held by dynamo's cache) neither records nor
        counts the steps of another model's optimizer, whose records would mix two trainings in
        one run."""
        roots = self.roots()
        if not roots:
            return True
        from .parameters import kept_per_optimizer, updates_any
        return kept_per_optimizer(self._owned, optimizer, roots, updates_any)

    def _parameters(self, optimizer, what: str) -> None:
        """Recording tasks: each parameter's gradient (``what="grad"``, before the step) or value
        (after it) as parameter records (:mod:`.parameters`), when the config asks (``parameters``)."""
        if self.part is None or self.failed or self.busy or not self.config.parameters \
                or self.recorder not in self.handlers:
            return
        from .param_records import record_parameters
        roots = self.roots()
        self.busy = True
        try:
            with self._quiet(), self.writing():
                record_parameters(self, optimizer, what, roots)
        finally:
            self.busy = False

    def _detect_rank(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return super()._detect_rank()

    def _open_part(self) -> None:
        self.rank = self._detect_rank()
        super()._open_part()

    def _quiet(self):
        return torch_backend.NoGrad()

    def _follow_optimizer(self) -> None:
        # torch's global optimizer step hook, holding the session weakly (a probe left unclosed
        # is not kept alive by it)
        ref = weakref.ref(self)

        def stepped(optimizer, args, kwargs) -> None:
            session = ref()
            if session is not None and session.owns(optimizer):
                session.optimizer_stepped(optimizer)
        self._optimizer_hook = register_optimizer_step_post_hook(stepped)
        hooks.remove_when_collected(self, self._optimizer_hook.remove)

    def _unfollow_optimizer(self) -> None:
        self._optimizer_hook.remove()


class DispatchProbe(TorchSession):
    """Record, check or perturb every op run inside ``with probe:``.

    ``DispatchProbe(task="statistics", dump_path="runs/a")``, ``DispatchProbe("config.yaml")``
    or ``DispatchProbe(config_dict, model=model)``.  Passing ``model`` names module scopes from
    it (``Transformer.layers.1.mlp``); without it the same names are derived on first use.
    """

    def __init__(self, config=None, *, model: torch.nn.Module | None = None, **overrides):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        super().__init__(config, **overrides)
        self.grad_reader = None
        if not self.task.intercepts_ops:    # the grad probe: gradients read at every optimizer step
            if model is None:
                raise ConfigError(f"task={self.task.name!r} needs model=<the torch.nn.Module being trained>: "
                                  "its parameter names name the gradients")
            from .grad_probe import GradReader
            self.grad_reader = GradReader(self, model)
        else:
            fused_stats.load()          # the one-pass CPU statistics kernel, where it is built
        self._mode: _ProbeMode | None = None
        self.scopes = _ModuleScopes(self, model)
        self.uninitialised = _Uninitialised()
        self._facts: dict[int, _Facts] = {}
        self.collective_seq = collectives.Sequence()     # per process group, from the probe's start
        self.written_last: list = []     # (tensor, version) written by the last recorded op (count_write)

    # ---- installation -------------------------------------------------------------------------
    def _install(self) -> None:
        self.scopes.install()
        if self.record_ops:
            self._mode = _ProbeMode(self)
            self._mode.__enter__()

    def _uninstall(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self.carry_over_written()
        self.scopes.uninstall()

    # ---- in-place writes --------------------------------------------------------------------------
    def count_write(self, t):
        """A recorded op wrote ``t``: its write is counted now (autograd moves the version counter
        only once the op returns), so its record measures the new values; and its measurement
        is noted, to be carried over to the version autograd gives it (:meth:`carry_over_written`)."""
        tensor_kinds.unseen_write(t)
        if tensor_kinds.readable(t):
            self.written_last.append((t, tensor_kinds.version(t)))
        return t

    def carry_over_written(self) -> None:
        """Once the op that wrote them has returned (at the next op, or when the mode exits): the
        statistics measured of its written tensors also stand for the version autograd moved
        their counters to, exactly one on, so the next op reading them (an optimizer's chain of
        in-place updates) takes them from the cache instead of reading the memory again.  A
        counter that moved otherwise (no autograd bump, or a write since) carries nothing."""
        written, self.written_last = self.written_last, []
        for t, before in written:
            moved = torch_backend.moved_keys(t, before)
            if moved is not None:
                self.recorder.carry_over(*moved)

    def optimizer_stepped(self, optimizer) -> None:
        if self.grad_reader is not None and not self.grad_reader.holds(optimizer):
            return                  # the grad probe's steps are its model's optimizers' steps
        super().optimizer_stepped(optimizer)

    def close(self) -> None:
        try:
            super().close()      # may raise OverflowDetected: a held overflow the last step did not catch
        finally:
            self.scopes.release()
            if self.grad_reader is not None:
                self.grad_reader.remove()

    # ---- per op -----------------------------------------------------------------------------------
    def _wants(self, func) -> bool:
        return (self._facts.get(id(func)) or self._learn(func)).wanted

    def _learn(self, func) -> _Facts:
        """The per-overload facts the mode needs on every call (keyed by ``id``: an overload's
        hash is a Python method)."""
        wanted = not ops.never_recorded(func) and self.selector.op_selected(ops.op_name(func))
        if not self.config.include_views and ops.is_alias(func):
            wanted = False
        facts = self._facts[id(func)] = _Facts(func, wanted, ops.op_name(func), ops.reads_written(func),
                                                ops.allocates_uninitialised(func), ops.out_args(func),
                                                bool(ops.unseen_writes(func)), ops.op_name(func).startswith(_COLLECTIVES))
        return facts

    def _where(self) -> tuple[str, str, str | None]:
        """(stage, module scope, autograd node) of the op being called."""
        if current_graph_task_id() != -1:
            node = current_autograd_node()
            return "backward", self.scopes._innermost_backward(node is None), node.name() if node is not None else None
        forward = self.scopes.forward_stack
        return "forward", forward[-1] if forward else "", None
