"""dispatchprobe: find the op that made a training run go wrong.

Capture (``DispatchProbe``, msprobe's ``PrecisionDebugger``, Trainer's ``DispatchProbeCallback``) and
``seed_all`` need torch; the offline side (``load``, ``compare``, ``run_ut``) needs only numpy and pandas:
importing this package does not import torch."""

from .core.config import Config, ConfigError, ConfigWarning
from .records.reader import RecordError, load
from .offline.compare import compare

__all__ = ["Config", "ConfigError", "ConfigWarning", "DispatchProbe", "DispatchProbeCallback", "PrecisionDebugger",
           "RecordError", "compare", "load", "probe_backend", "run_ut", "seed_all"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "DispatchProbe":     # torch is imported only when asked for
        from .torch.capture import DispatchProbe
        return DispatchProbe
    if name == "DispatchProbeCallback":     # transformers.Trainer's callback (docs/integrations.md)
        from .torch.trainer_callback import DispatchProbeCallback
        return DispatchProbeCallback
    if name == "PrecisionDebugger":     # msprobe's interface (docs/integrations.md)
        from .torch.msprobe_api import PrecisionDebugger
        return PrecisionDebugger
    if name == "seed_all":
        from .core.seeding import seed_all
        return seed_all
    if name == "probe_backend":
        from .torch.compile import probe_backend
        return probe_backend
    if name == "run_ut":
        from .offline.run_ut import run_ut
        return run_ut
    raise AttributeError(f"module 'dispatchprobe' has no attribute {name!r}")
