"""dispatchprobe for MindSpore (PyNative, and GRAPH_MODE / ``@ms.jit`` graphs through MindSpore's
dump): ``from dispatchprobe_ms import DispatchProbe``.

The same config, tasks and records as the PyTorch probe; the offline tools (``dispatchprobe
compare``, ``run-ut``) read both.  Needs ``pip install "dispatchprobe[mindspore]"``.
"""

from dispatchprobe.core.tensor_backend import missing_members

from . import tensor_backend
from .capture import DispatchProbe

assert not missing_members(tensor_backend), missing_members(tensor_backend)

__all__ = ["DispatchProbe"]
