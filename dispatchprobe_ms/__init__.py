"""dispatchprobe for MindSpore (PyNative): ``from dispatchprobe_ms import DispatchProbe``.

The same config, tasks and records as the PyTorch probe; the offline tools (``dispatchprobe
compare``, ``run-ut``) read both.  Needs ``pip install "dispatchprobe[mindspore]"``.
"""

from dispatchprobe.core.tensor_backend import missing_members

from . import backend
from .capture import DispatchProbe

assert not missing_members(backend), missing_members(backend)

__all__ = ["DispatchProbe"]
