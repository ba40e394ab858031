"""dispatchprobe: find the op that made a training run go wrong.

Capture (``DispatchProbe``) needs torch; the offline side (``load``, ``compare``, the run-ut
driver) needs only numpy and pandas, so importing this package does not import torch.
"""

from .core.config import Config, ConfigError
from .records.reader import RecordError, load
from .offline.compare import compare

__all__ = ["Config", "ConfigError", "DispatchProbe", "RecordError", "compare", "load", "run_ut"]
__version__ = "0.1.0"


def __getattr__(name):
    # torch is imported only when a capture class is asked for
    if name == "DispatchProbe":
        from .torch.capture import DispatchProbe
        return DispatchProbe
    if name == "run_ut":  # the run-ut driver (replay itself needs the run's framework)
        from .offline.run_ut import run_ut
        return run_ut
    raise AttributeError(f"module 'dispatchprobe' has no attribute {name!r}")
