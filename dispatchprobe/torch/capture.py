"""PyTorch eager capture: a TorchDispatchMode below autograd plus module-scope tracking.

The mode sees every aten call (forward, and backward when ``.backward()`` runs inside the probe)
after autocast and autograd, so what is recorded is what the kernels computed.

Transparency: the mode runs the op first, untouched, and only then looks at its results, under
``no_grad`` with the mode popped (the probe's own ops are not recorded).  Never the global RNG.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import NamedTuple

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from . import backend as torch_backend
from . import fused_stats
from . import ops
from ..core.config import ConfigError
from ..core.session import ProbeSession


# where AOTAutograd's runtime wrappers live (not imported: that would import dynamo)
_AOT_RUNTIME = os.path.join(torch.__path__[0], "_functorch", "_aot_autograd", "runtime_wrappers.py")
_AOT_MODULE = "torch._functorch._aot_autograd.runtime_wrappers"
active_probes: list = []      # DispatchProbes recording now, innermost last


def _in_compiled_code() -> bool:
    """Whether the op is called by a compiled graph (inductor's ``.out`` calls, an ``aot_eager``
    graph's ops, a probe backend's recording op): every AOTAutograd-compiled region, forward
    and backward, runs inside a function of ``runtime_wrappers.py`` (not even imported until
    something is compiled: eager-only training pays one dictionary lookup per op)."""
    if _AOT_MODULE not in sys.modules:
        return False
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename == _AOT_RUNTIME:
            return True
        f = f.f_back
    return False


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

    def __enter__(self):
        active_probes.append(self.probe)     # probe_backend's graphs record into it (same dump_path)
        return super().__enter__()

    def __exit__(self, *exc):
        active_probes.remove(self.probe)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = self.probe
        facts = probe._facts.get(id(func)) or probe._learn(func)
        if probe.busy or not facts.wanted or _in_compiled_code():
            out = func(*args, **kwargs)
            if facts.allocates_uninitialised and not probe.busy:
                probe.uninitialised.add(out)
            return out
        where = probe._where()
        seen_args, seen_kwargs = args, kwargs
        undefined = probe.uninitialised.among(func, args, kwargs) if probe.uninitialised else None
        recorded = probe.would_record(where[0], where[1])
        written = facts.reads_written
        if written and recorded:  # in-place/out= ops: record the inputs as they were *before* the op ran
            seen_args, seen_kwargs = _copy_written(written, args, kwargs, undefined)
        out = func(*args, **kwargs)
        if undefined is not None:
            probe.uninitialised.written(func, args, kwargs)
        if not recorded:          # stage or scope filtered out: nothing more to do
            return out
        return probe._on_op(func, seen_args, seen_kwargs, out, undefined, facts.name, where)


class _Facts(NamedTuple):
    """What the mode asks of an overload on every call, looked up once per overload."""

    func: object                     # held, so that the id keying it stays this overload's
    wanted: bool
    name: str
    reads_written: tuple
    allocates_uninitialised: bool


def _copy_written(written, args, kwargs, undefined: set | None):
    """Copies of the tensors an op is about to overwrite (a tensor, or each tensor of a list:
    the optimizers' ``_foreach_*_``), in place of the originals: the record holds what the op
    received.  A copy of an undefined tensor is undefined too."""
    args, kwargs = list(args), dict(kwargs)

    def copy(old):
        if isinstance(old, (list, tuple)):
            return type(old)(copy(t) for t in old)
        if not isinstance(old, torch.Tensor):
            return old
        new = old.clone()
        if undefined and id(old) in undefined:
            undefined.add(id(new))
        return new

    with torch.no_grad():
        for i, name in written:
            if i < len(args):
                args[i] = copy(args[i])
            elif name in kwargs:
                kwargs[name] = copy(kwargs[name])
    return tuple(args), kwargs


class _Uninitialised:
    """Memory from the ``empty`` family holds no values until an op writes it: its bytes differ
    from run to run, so such tensors are recorded with ``undefined: true`` and never judged.
    Any write (in-place or ``out=``, even a partial one) counts as defining the whole tensor."""

    def __init__(self):
        self._live: dict = {}            # storage address -> weak reference to the storage

    def __bool__(self) -> bool:
        return bool(self._live)

    @staticmethod
    def _key(t):
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None

    def add(self, out) -> None:
        if isinstance(out, torch.Tensor) and out.numel() and out.layout == torch.strided:
            key = self._key(out)
            if key is not None:
                self._live[key] = torch_backend.memory_ref(out)

    def _hit(self, t) -> bool:
        key = self._key(t)
        ref = self._live.get(key)
        if ref is None:
            return False
        if ref.expired():
            del self._live[key]
            return False
        return True

    def among(self, func, args, kwargs) -> set:
        """``id``s of the op's tensor arguments that are still undefined; the arguments an
        overwrite-only op (``fill_``, ``copy_``) writes are recorded after the op, so not these."""
        skip = {i for pair in ops.written_args(func) for i in pair} if ops.reads_written(func) == () else ()
        found = set()
        for k, v in [*enumerate(args), *kwargs.items()]:
            if k in skip:
                continue
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor) and self._hit(t):
                    found.add(id(t))
        return found

    def written(self, func, args, kwargs) -> None:
        for i, name in ops.written_args(func):
            v = args[i] if i < len(args) else kwargs.get(name)
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor):
                    self._live.pop(self._key(t), None)


class _ModuleScopes(ModuleTracker):
    """torch's ``ModuleTracker``, keeping order and reporting module boundaries.

    It names modules (``Net.layers.1.mlp``) and follows them through forward (global module
    hooks) and backward (multi-grad hooks, which observe gradients without changing them); its
    ``parents`` is a set, so the active modules are also kept in entry order, for an op's
    innermost scope."""

    def __init__(self, probe: "DispatchProbe", root: torch.nn.Module | None):
        super().__init__()
        self.probe = probe
        self.forward_stack: list[str] = []
        self.backward_active: list[str] = []
        self._types: dict[str, str] = {}
        self._grad_out: dict = {}
        self._left_early: dict = {}      # backward exits seen before their module entered
        if root is not None:
            self._get_mod_name(root)

    @property
    def current(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return self._innermost_backward()
        return self.forward_stack[-1] if self.forward_stack else ""

    def _innermost_backward(self) -> str:
        # Modules sharing an output tensor (a model whose last layer's output is its own) enter
        # backward together, outer one last: prefer the deepest descendant of the latest entry.
        active = self.backward_active
        if not active:
            return ""
        current = active[-1]
        for name in reversed(active):
            if name.startswith(current + "."):
                current = name
        return current

    def install(self) -> None:
        self.__enter__()

    def uninstall(self) -> None:
        self.__exit__(None, None, None)
        self.forward_stack.clear()

    # Inside a graph dynamo traces, and in modules compiled code calls (an aot_eager graph is a
    # GraphModule), module hooks do nothing: that code runs compiled, its ops are not recorded
    # (and tracing the tracker's weak dictionaries fails).
    def _fw_pre_hook(self, mod, input) -> None:
        if torch.compiler.is_compiling() or _in_compiled_code():
            return
        self._types[self._get_mod_name(mod)] = type(mod).__name__
        super()._fw_pre_hook(mod, input)

    def _fw_post_hook(self, mod, input, output) -> None:
        if torch.compiler.is_compiling() or _in_compiled_code():
            return
        name = self._get_mod_name(mod)
        self._get_pop_fn(name, False)()
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(tensors) == 1:
            # one output: a plain tensor hook, which also fires on the root of backward (the loss
            # module's output), where torch's multi-grad hook never does
            enter = self._get_append_fn(name, True)
            self._hooks.append(tensors[0].register_hook(lambda grad: enter(grad) and None))
        elif tensors:
            self._hooks.append(register_multi_grad_hook(tensors, self._get_append_fn(name, True)))
        self.probe.on_module(self._types[self._get_mod_name(mod)], self._get_mod_name(mod), "forward",
                              input, output)

    def _get_append_fn(self, name, is_bw):
        base = super()._get_append_fn(name, is_bw)

        def enter(*grads) -> None:
            if is_bw and not self._has_callback:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            base(*grads)
            if not is_bw:
                self.forward_stack.append(name)
            elif name in self._left_early:
                # output and input are one tensor (Identity, Dropout(p=0) returns its input): the
                # module's exit hook fired first; it runs no backward op, so it never becomes a scope
                self.parents.discard(name)
                self.probe.on_module(self._types.get(name, ""), name, "backward", grads,
                                     self._left_early.pop(name))
            else:
                self.backward_active.append(name)
                self._grad_out[name] = grads
        return enter

    def _get_pop_fn(self, name, is_bw):
        base = super()._get_pop_fn(name, is_bw)

        def leave(*grads) -> None:
            base(*grads)
            stack = self.backward_active if is_bw else self.forward_stack
            if name in stack:
                del stack[len(stack) - 1 - stack[::-1].index(name)]
            elif is_bw:
                self._left_early[name] = tuple(grads)
                return
            if is_bw:
                self.probe.on_module(self._types.get(name, ""), name, "backward", self._grad_out.pop(name, ()),
                                      tuple(grads))
        return leave

    def _backward_done(self) -> None:
        # modules whose inputs need no gradient (the first layer, the root) never leave backward
        # by a hook: their module records are written when backward ends, innermost first
        for name in reversed(self.backward_active):
            self.parents.discard(name)
            self.probe.on_module(self._types.get(name, ""), name, "backward", self._grad_out.get(name, ()), ())
        self.backward_active.clear()
        self._grad_out.clear()
        self._left_early.clear()


class TorchSession(ProbeSession):
    """What every torch capture path's session shares: the torch backend, the rank from
    torch.distributed once it is initialised, handlers run under ``no_grad``."""

    backend = torch_backend

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
            if session is not None:
                session.optimizer_stepped(optimizer)
        self._optimizer_hook = register_optimizer_step_post_hook(stepped)

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
        fused_stats.build()             # the one-pass CPU statistics kernel, loaded in the background
        self._mode: _ProbeMode | None = None
        self.scopes = _ModuleScopes(self, model)
        self.uninitialised = _Uninitialised()
        self._facts: dict[int, _Facts] = {}

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
        self.scopes.uninstall()

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
                                                ops.allocates_uninitialised(func))
        return facts

    def _where(self) -> tuple[str, str, str | None]:
        """(stage, module scope, autograd node) of the op being called."""
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            return "backward", self.scopes._innermost_backward(), node.name() if node is not None else None
        forward = self.scopes.forward_stack
        return "forward", forward[-1] if forward else "", None

    def _on_op(self, func, args, kwargs, out, undefined=None, name=None, where=None):
        stage, scope, grad_fn = where or self._where()
        replaced = self.on_op(name or ops.op_name(func), stage, scope, args, kwargs, out, func=func,
                              grad_fn=grad_fn, stack=ops.user_stack, undefined=undefined)
        return out if replaced is None else replaced

