"""The module scope of each op, forward and backward: two global module hooks for the process
(:class:`ModuleHooks`, kept in the adapter's process state) feeding each recording probe's
tracker (:class:`ModuleScopes`), which names modules from the root down.  A backward op's scope
is the forward scope its autograd node was made in (nodes are numbered as they are made): a
module's backward is exactly what autograd runs for its forward, whether or not gradients flow
into its inputs.  Tensor and multi-grad hooks follow modules through backward for their module
records and for what runs outside any node of a forward (end-of-backward callbacks)."""

from __future__ import annotations

import re
import sys
from bisect import bisect_right
import warnings
import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from . import collectives, hooks
from .compiled_frames import in_compiled_code
from .internals.dynamo import is_optimized_module, wrapped_module
from .internals import autograd as torch_autograd
from .internals.autograd import (checkpoint_recomputing, current_autograd_node, current_graph_task_id, next_sequence_nr,
                                 node_sequence_nr)
from .internals.dispatch import tree_flatten
from .process_state import STATE

_MODULE_CALLS = frozenset(torch_autograd.MODULE_CALL_CODES)


class ModuleHooks:
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
        self.active: list["ModuleScopes"] = state.module_scopes
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

    def add(self, scopes: "ModuleScopes") -> None:
        if not self.active:
            self._put_back()
        self.active.append(scopes)

    def remove(self, scopes: "ModuleScopes") -> None:
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


_HOOKS = ModuleHooks(STATE)
_GraphModule = torch.fx.GraphModule


def _module_entered(mod, args) -> None:
    # is_compiling first: dynamo folds it and traces nothing else here (no guard on our state)
    if torch.compiler.is_compiling() or not _HOOKS.active or in_compiled_code(isinstance(mod, _GraphModule)):
        return
    if torch_autograd.forward_hooks(mod):
        _HOOKS.keep_exit_last(mod)
    for scopes in _HOOKS.active:
        scopes.enter(mod, args)


def _module_left_globally(mod, args, output) -> None:
    if torch.compiler.is_compiling() or not _HOOKS.active or _HOOKS.has_own_exit(mod) \
            or in_compiled_code(isinstance(mod, _GraphModule)):
        return
    for scopes in _HOOKS.active:
        scopes.leave(mod, args, output)


def _module_left(mod, args, output) -> None:
    if torch.compiler.is_compiling() or not _HOOKS.active or in_compiled_code(isinstance(mod, _GraphModule)):
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


class ModuleScopes:
    """The module scope of each op, forward and backward, for one probe.

    Modules are named from the root down (``Net.layers.1.mlp``, as torch's ``ModuleTracker``
    names them).  Forward: entered and left by :class:`ModuleHooks`.  Backward: a module is
    entered when the gradient of its output arrives and left when its inputs' gradients are done
    (tensor and multi-grad hooks, which observe gradients without changing them), for its module
    records.  A backward op's scope is not the module in backward then (a module whose inputs
    need no gradient would never leave, and own the ops autograd runs after it): it is the
    forward scope the running autograd node was made in.  Each change of the forward scope marks
    the next node's sequence number (``_starts``, ascending) with the new scope (``_marked``);
    a node's scope is the mark at or below its number."""

    #: marks kept: the oldest half goes past this many (a node older than them, or made while a
    #: backward ran, is scoped by the modules in backward, as a callback is)
    MARKS = 1 << 16

    def __init__(self, probe: "DispatchProbe", root: torch.nn.Module | None):
        self.probe = probe
        self.forward_stack: list[str] = []
        self._entered_in: list[int] = []     # per forward_stack entry: the graph task it was entered in (-1: none)
        self._rerun_around: tuple = ()       # (graph task, node's number, scope): what a recompute's first module sits in
        self.backward_active: list[str] = []
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._named: weakref.WeakSet = weakref.WeakSet()
        self.named_any = False           # once set, stays: the modules named may all be gone
        self._types: dict[str, str] = {}
        self.wrappers: set[str] = set()   # names of compiled modules (see running_module)
        self._grad_out: dict = {}
        self._left_early: dict = {}      # backward exits seen before their module entered
        self._hooks: list = []           # tensor hooks of this entry's backward
        self._has_callback = False
        self._starts: list[int] = []
        self._marked: list[str | None] = []
        self._holds: weakref.finalize | None = None    # the global hooks, held until close (or collection)
        if root is not None:
            self._name(root)

    @property
    def names(self) -> weakref.WeakKeyDictionary:
        """{module: its scope name} of the modules seen run."""
        return self._names

    @property
    def current(self) -> str:
        task = current_graph_task_id()
        if task != -1:
            node = current_autograd_node()
            recomputed = self.recomputed_scope(task, node)
            return recomputed if recomputed is not None else self.backward_scope(node)
        if not self.forward_stack:
            return ""
        top = self.forward_stack[-1]
        return self.running_module(top) if top in self.wrappers else top

    def running_module(self, wrapper: str) -> str:
        """The innermost module whose call is on the Python stack inside compiled module ``wrapper``
        (``torch.compile(model)``).  An op a graph break runs eagerly runs inside its modules' real
        calls, but their hooks do not scope it: called from code dynamo runs, the hooks are compiled
        (as they are traced: to nothing).  So the stack says where the op is, as eager names it."""
        f = sys._getframe(2)
        while f is not None:
            if f.f_code in _MODULE_CALLS:
                m = f.f_locals.get("self")
                if is_optimized_module(m):
                    break
                if isinstance(m, torch.nn.Module) and m in self._names:
                    return self._names[m]
            f = f.f_back
        return wrapper

    def recomputed_scope(self, task: int, node) -> str | None:
        """The forward scope activation checkpointing re-runs now inside backward ``task``, or None
        (a backward op).  A module entered while ``task`` runs is such a re-run (torch.utils.checkpoint,
        HF's gradient checkpointing, checkpoint_wrapper); a module entered before its backward began
        is not (``torch.autograd.grad`` inside a forward: a gradient penalty).  A checkpointed
        function entering no module is the scope of the node whose backward re-runs it."""
        if self._entered_in and self._entered_in[-1] == task:
            return self.forward_stack[-1]
        if checkpoint_recomputing(node):
            if self._rerun_around[:2] == (task, node_sequence_nr(node) if node is not None else None):
                return self._rerun_around[2]     # between the re-run modules (a layer checkpointing its forward)
            return self.backward_scope(node)
        return None

    def _new_nodes_scope(self) -> str | None:
        """The scope of the nodes made from now on: the innermost forward scope; outside any, none
        during backward (nodes made there, create_graph, belong to no forward scope), else the top."""
        if self.forward_stack:
            return self.forward_stack[-1]
        return None if current_graph_task_id() != -1 else ""

    def backward_scope(self, node) -> str:
        """The scope of an op autograd runs now for ``node`` (None: between nodes): the forward
        scope ``node`` was made in, else (a callback, a node made outside the marks) the module
        in backward."""
        if node is not None:
            seq = node_sequence_nr(node)
            starts = self._starts
            if starts and starts[0] <= seq < next_sequence_nr():
                scope = self._marked[bisect_right(starts, seq) - 1]
                if scope is not None:
                    return scope
        return self.innermost_backward(node is None)

    def _mark(self, scope: str | None) -> None:
        """Nodes made from now on belong to ``scope`` (None: to no forward scope)."""
        seq, starts = next_sequence_nr(), self._starts
        if starts and seq <= starts[-1]:
            if seq < starts[-1]:
                return          # another thread's numbers: they would not sort with these
            self._marked[-1] = scope        # no node made since the last mark
            return
        starts.append(seq)
        self._marked.append(scope)
        if len(starts) > self.MARKS:
            del starts[:self.MARKS // 2], self._marked[:self.MARKS // 2]

    def innermost_backward(self, after_graph: bool = False) -> str:
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
        if name is None and is_optimized_module(mod):
            # torch.compile's wrapper: named as the module it wraps, as compiled graphs name their ops
            name = self._names[mod] = self._name(wrapped_module(mod))
            self.wrappers.add(name)
            return name
        if name is None:
            name = self._names[mod] = type(mod).__name__
            self.named_any = True
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
        self._mark(self.forward_stack[-1] if self.forward_stack else "")

    def uninstall(self) -> None:
        _HOOKS.remove(self)
        self._mark(None)        # nodes made while not recording: their modules were not followed
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.forward_stack.clear()
        self._entered_in.clear()

    def release(self) -> None:
        """The probe is closed: the global hooks go when no probe holds them."""
        self.uninstall()
        if self._holds is not None:
            self._holds()           # once: a finalizer runs at most once
            hooks.remove_collected()

    # ---- forward --------------------------------------------------------------------------------
    def enter(self, mod, args) -> None:
        if self.forward_stack and mod not in self._names:
            # made and called inside a module's forward, registered under none (transformers' loss
            # modules, ``CrossEntropyLoss()`` in ``forward``): its ops are its caller's, as in the
            # graphs torch.compile makes (no module there), so eager and compiled runs pair them
            return
        name = self._name(mod)
        self._types[name] = type(mod).__name__
        task = current_graph_task_id()
        if task != -1 and not (self._entered_in and self._entered_in[-1] == task):
            # the outermost module a recompute re-runs: its ops between modules belong to its parent
            node = current_autograd_node()
            self._rerun_around = (task, node_sequence_nr(node) if node is not None else None, name.rpartition(".")[0])
        self.forward_stack.append(name)
        self._entered_in.append(task)
        self._mark(name)
        tensors = _needing_grad(args)
        if len(tensors) == 1:
            # one input (most modules): a plain tensor hook, called as torch's multi-grad hook
            # calls its function (with the list of gradients), without its per-call bookkeeping
            leave = self._backward_leave_fn(name)
            self._hooks.append(tensors[0].register_hook(lambda grad: leave([grad]) and None))
        elif tensors:
            self._hooks.append(register_multi_grad_hook(tensors, self._backward_leave_fn(name)))

    def leave(self, mod, args, output) -> None:
        if mod not in self._names:       # entered without a scope of its own (see enter)
            return
        name = self._name(mod)
        stack, recomputed = self.forward_stack, False
        if name in stack:
            at = len(stack) - 1 - stack[::-1].index(name)
            recomputed = self._entered_in[at] != -1 and self._entered_in[at] == current_graph_task_id()
            del stack[at], self._entered_in[at]
        self._mark(self._new_nodes_scope())
        tensors = _needing_grad(output)
        enter = self._backward_enter_fn(name)
        if len(tensors) == 1:
            # one output: a plain tensor hook, which also fires on the root of backward (the loss
            # module's output), where torch's multi-grad hook never does
            self._hooks.append(_run_first(tensors[0].register_hook(lambda grad: enter(grad) and None)))
        elif tensors:
            self._hooks.append(_run_first(register_multi_grad_hook(tensors, enter)))
        # a module re-run by activation checkpointing: recorded where it runs, in backward, marked
        self.probe.on_module(self._types.get(name, type(mod).__name__), name, "backward" if recomputed else "forward",
                             args, output, recompute=recomputed)

    # ---- backward -------------------------------------------------------------------------------
    def _backward_enter_fn(self, name):
        def enter(*grads) -> None:
            if not self._has_callback:
                torch_autograd.queue_backward_callback(self._backward_done)
                self._has_callback = True
                self._mark(None)        # nodes made in backward (create_graph) have no forward scope
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
        self._mark(self.forward_stack[-1] if self.forward_stack else "")
        for name in reversed(self.backward_active):
            self.probe.on_module(self._types.get(name, ""), name, "backward", self._grad_out.get(name, ()), ())
        self.backward_active.clear()
        self._grad_out.clear()
        self._left_early.clear()
