"""PyTorch eager capture: :class:`DispatchProbe`, a dispatch mode below autograd plus module scopes.

The mode (:mod:`.dispatch_mode`) sees every aten call (forward, and backward when ``.backward()``
runs inside the probe) after autocast and autograd, so what is recorded is what the kernels
computed; module scopes come from :mod:`.module_scopes`, optimizer steps from :mod:`.session`.

Transparency: the mode runs the op first, untouched, and only then looks at its results, under
``no_grad`` with the mode popped (the probe's own ops are not recorded).  Never the global RNG.
"""

from __future__ import annotations

import torch

from . import tensor_backend as torch_backend
from . import collectives, fused_stats, ops, tensor_kinds
from ..core.config import ConfigError
from ..records.format import UNRECORDED_GRAPHS, UNRECORDED_HIGHER_ORDER
from .compiled_frames import in_compiled_code
from .dispatch_mode import OpFacts, ProbeMode
from .internals.dispatch import HigherOrderOperator
from .internals.autograd import current_autograd_node, current_graph_task_id
from .module_scopes import ModuleScopes
from .session import TorchSession
from .uninitialised import Uninitialised

_COLLECTIVES = tuple(f"{ns}." for ns in collectives.NAMESPACES)


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
        self._mode: ProbeMode | None = None
        self.scopes = ModuleScopes(self, model)
        self.uninitialised = Uninitialised()
        self._facts: dict[int, OpFacts] = {}
        self._hops_unrecorded: set[str] = set()      # higher-order ops run outside compiled code
        self.collective_seq = collectives.Sequence()     # per process group, from the probe's start
        self.pending = collectives.Pending(self)         # collectives called, recorded once complete
        self.written_last: list = []     # (tensor, version) written by the last recorded op (count_write)
        # ops of compiled graphs the mode passed on unrecorded, and whether a probe_backend graph
        # recorded into this probe: graphs without one leave a note in the manifest (flush)
        self.graph_ops = 0
        self.graphs_recorded = False

    # ---- installation -------------------------------------------------------------------------
    def _install(self) -> None:
        self.scopes.install()
        if self.record_ops:
            self._mode = ProbeMode(self)
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

    def flush(self) -> None:
        # the step ends or the probe stops: the program has waited for its collectives
        self.pending.settle()
        if self.graph_ops and not self.graphs_recorded:
            # torch.compile without probe_backend: the records hold only the code around the graphs,
            # which compare and show say rather than leaving a reader to guess at different models
            self.note_in_manifest(UNRECORDED_GRAPHS, True)
        super().flush()

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
        return self.facts(func).wanted

    def facts(self, func) -> OpFacts:
        """The per-overload facts the mode needs on every call, learnt once per overload."""
        return self._facts.get(id(func)) or self._learn(func)

    def _learn(self, func) -> OpFacts:
        """Learns an overload's facts (keyed by ``id``: an overload's hash is a Python method).  A
        higher-order op is run, never recorded: the ops it runs inside pass below this mode.  Inside
        compiled code that is every call of a graph's (``probe_backend`` records the graph); one
        run outside it is noted in the manifest, which ``show`` says."""
        if isinstance(func, HigherOrderOperator):
            if not in_compiled_code():
                self._hops_unrecorded.add(func.name())
                self.note_in_manifest(UNRECORDED_HIGHER_ORDER, sorted(self._hops_unrecorded))
            facts = self._facts[id(func)] = OpFacts(func, False, f"higher_order.{func.name()}", (), False, (), (),
                                                    False, False)
            return facts
        wanted = not ops.never_recorded(func) and self.selector.op_selected(ops.op_name(func))
        if not self.config.include_views and ops.is_alias(func):
            wanted = False
        reads_written, out_args = ops.reads_written(func), ops.out_args(func)
        counted = tuple(dict.fromkeys(reads_written + out_args + ops.overwritten_args(func)))
        facts = self._facts[id(func)] = OpFacts(func, wanted, ops.op_name(func), reads_written,
                                                ops.allocates_uninitialised(func), out_args, counted,
                                                bool(ops.unseen_writes(func)), ops.op_name(func).startswith(_COLLECTIVES))
        return facts

    def where(self) -> tuple[str, str, str | None, bool]:
        """(stage, module scope, autograd node, recomputed) of the op being called.  A forward op
        activation checkpointing re-runs inside backward runs there (stage backward) but belongs to
        the forward scope it re-runs, under no node of its own: ``recomputed``."""
        task = current_graph_task_id()
        if task != -1:
            node = current_autograd_node()
            recomputed = self.scopes.recomputed_scope(task, node)
            if recomputed is not None:
                return "backward", recomputed, None, True
            return "backward", self.scopes.backward_scope(node), node.name() if node is not None else None, False
        forward = self.scopes.forward_stack
        if not forward:
            return "forward", "", None, False
        top = forward[-1]        # inside a compiled module: where its graph break runs the op
        return "forward", top if top not in self.scopes.wrappers else self.scopes.running_module(top), None, False
