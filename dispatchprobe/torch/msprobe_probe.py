"""The probe under msprobe's ``PrecisionDebugger``: a ``DispatchProbe`` with the two things
msprobe's interface adds to a recording.  ``forward_backward_dump_end()`` closes a forward window:
after it no forward op is recorded and, in backward, only what the window's ops made (autograd's
node numbers, and for module records the modules whose forward ran in it, msprobe's rule).
``overflow_nums`` ends the overflow checks with one warning while training goes on, where
``DispatchProbe`` raises ``OverflowDetected``."""

from __future__ import annotations

import warnings

import torch

from ..core.overflow import OverflowDetected
from .capture import DispatchProbe
from .internals.autograd import current_autograd_node, node_sequence_nr


def _next_node_number() -> int:
    """The sequence number autograd gives the next node made on this thread: one node is made
    to read it (numbers only order nodes ready together in backward; every later node moves by one),
    under inference mode too (a debugger started in an evaluation loop)."""
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros((), requires_grad=True)
        return node_sequence_nr(leaf.view(()).grad_fn) + 1


class MsprobeProbe(DispatchProbe):
    """A DispatchProbe with the two things msprobe's interface adds to a recording: a forward
    window whose backward alone is recorded after it closes, and overflow checks that end
    (rather than raise) after ``overflow_nums`` overflows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.window: range | None = None     # autograd node numbers of the ops started before forward_backward_dump_end
        self.window_start = 0
        self.window_modules: set[str] = set()    # the modules whose forward ran in the window (level module/mix)
        self._module_backward = False
        self.checks_ended: OverflowDetected | None = None

    def recording(self, stage: str, scope: str = "") -> bool:
        window = self.window
        if window is not None and not self._module_backward:
            if stage == "forward":
                return False
            node = current_autograd_node()
            if node is None or node_sequence_nr(node) not in window:
                return False
        return super().recording(stage, scope)

    def on_module(self, type_name: str, scope: str, stage: str, inputs, outputs, recompute: bool = False) -> None:
        """After forward_backward_dump_end a module's backward is recorded when its forward ran
        in the window (msprobe's rule), wherever autograd runs its hooks."""
        if self.window is None:
            if stage == "forward":
                self.window_modules.add(scope)
            super().on_module(type_name, scope, stage, inputs, outputs, recompute)
        elif stage == "backward" and scope in self.window_modules:
            self._module_backward = True
            try:
                super().on_module(type_name, scope, stage, inputs, outputs, recompute)
            finally:
                self._module_backward = False

    def mark_window_start(self) -> None:
        self.window = None
        self.window_modules.clear()
        self.window_start = _next_node_number()

    def close_window(self) -> None:
        """forward_backward_dump_end: nothing run from here on is recorded; the backward of the
        nodes made since start() is."""
        self.busy = True         # the marker's own ops are not the user's
        try:
            end = _next_node_number() - 1
        finally:
            self.busy = False
        self.window = range(self.window_start, end)

    # ---- overflow_nums: msprobe ends the checks, training goes on ----------------------------------
    def dispatch(self, event):
        if self.checks_ended is not None:
            return None
        try:
            return super().dispatch(event)
        except OverflowDetected as exc:
            self.end_checks(exc)
            return None

    def optimizer_stepping(self) -> None:
        try:
            super().optimizer_stepping()
        except OverflowDetected as exc:
            self.end_checks(exc)

    def end_checks(self, exc: OverflowDetected) -> None:
        if self.checks_ended is None:
            self.checks_ended = exc
            warnings.warn(f"{exc}; overflow_nums reached: the checks end here and training goes on (as msprobe's)",
                          RuntimeWarning, stacklevel=2)

    def retrying(self, call) -> None:
        """Run ``call`` (stop, step, close); an overflow it reports ends the checks, and the call
        runs again to finish what the exception interrupted."""
        try:
            call()
        except OverflowDetected as exc:
            self.end_checks(exc)
            call()
