"""What every torch capture path's session shares (:class:`TorchSession`): the torch backend,
the rank from torch.distributed, handlers under ``no_grad``, and torch's global optimizer step
hooks, which record parameters and follow optimizer steps."""

from __future__ import annotations

import weakref

import torch

from . import tensor_backend as torch_backend
from . import hooks
from .process_state import ProbeWork
from ..core.session import ProbeSession


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
        # a probe never closed (a notebook cell, an exception) leaves no hook behind once collected
        self._remove_step_hooks = (hooks.optimizer_hook(self, stepping), hooks.optimizer_hook(self, stepped, post=True))

    def close(self) -> None:
        try:
            super().close()
        finally:
            for remove in self._remove_step_hooks:
                remove()
            hooks.remove_collected()

    def module_names(self):
        """{module: its scope name} of the modules this session has seen run, or None."""
        scopes = getattr(self, "scopes", None)
        return scopes.names if scopes is not None else None

    def saw_modules(self) -> bool:
        """Whether this session has named any module, even one collected since."""
        scopes = getattr(self, "scopes", None)
        return scopes is not None and scopes.named_any

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
        one run; once the models it saw are gone, it owns none (a later model's, its parameters
        perhaps at the same addresses, is another training)."""
        roots = self.roots()
        if not roots:
            return not self.saw_modules()
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
        return ProbeWork()

    def _follow_optimizer(self) -> None:
        # torch's global optimizer step hook, holding the session weakly (a probe left unclosed
        # is not kept alive by it)
        ref = weakref.ref(self)

        def stepped(optimizer, args, kwargs) -> None:
            session = ref()
            if session is not None and session.owns(optimizer):
                session.optimizer_stepped(optimizer)
        self._remove_follower = hooks.optimizer_hook(self, stepped, post=True)

    def _unfollow_optimizer(self) -> None:
        self._remove_follower()
