"""``transformers.Trainer``: ``callbacks=[DispatchProbeCallback(task=..., ...)]`` records its training.

Trainer's loop is the user's: the callback starts the probe at the first micro-batch of each
optimizer step, so the forward and backward of every gradient-accumulation micro-step are in
that step's records, stops it before the optimizer's step (as ``with probe:`` around forward and
backward does natively; parameter records are still taken there) and closes the step after it.
Tasks that intercept no op (the grad probe) follow the optimizer themselves.  Steps count as
Trainer's ``global_step`` before the update (0 at the start of training, G when resuming at G);
the rank is torch.distributed's, as for every ``DispatchProbe``.
"""

from __future__ import annotations

import warnings

from transformers import TrainerCallback

from ..core.config import Config, ConfigWarning
from .capture import DispatchProbe


class DispatchProbeCallback(TrainerCallback):
    """``DispatchProbeCallback(config=None, **keys)``: any ``DispatchProbe`` config (a path, a dict,
    a Config, msprobe's config.json) and keys.  The config is checked here, the probe built when
    training begins (``self.probe``) with Trainer's model naming module scopes."""

    def __init__(self, config=None, **keys):
        self.config = Config.load(config, **keys)       # a bad key fails here, in one line
        self.probe: DispatchProbe | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.probe is not None:        # a second train() call: a new run needs a new dump_path
            self.probe.close()
        with warnings.catch_warnings():   # Config.load said each line once already
            warnings.simplefilter("ignore", ConfigWarning)
            self.probe = DispatchProbe(self.config, model=model)
        self.probe.step_no = state.global_step

    @property
    def _records_ops(self) -> bool:
        return self.probe is not None and self.probe.task.intercepts_ops

    def on_step_begin(self, args, state, control, **kwargs):
        if self._records_ops:
            self.probe.start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._records_ops:
            self.probe.stop()

    def on_step_end(self, args, state, control, **kwargs):
        if self._records_ops:
            self.probe.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.probe is not None:
            self.probe.close()
