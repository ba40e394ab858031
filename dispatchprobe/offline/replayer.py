"""What a framework supplies to the framework-neutral run-ut driver: its replay of one record
(results as numpy arrays) and the few services around it.  ``dispatchprobe.torch.replay.REPLAYER``
is the torch one; another framework adds a :class:`Replayer` and one line to :data:`REPLAYERS`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from ..records.reader import Part, Run


class Skip(Exception):
    """This op cannot be replayed; the message is the stated reason."""


class ReplayError(Exception):
    """The replay itself failed (the op raised on the device)."""


@dataclass
class Output:
    """One compared output leaf, as numpy: floats widened to float64, complex to complex128."""

    name: str                      # "output.0", "output.1.2"
    device: np.ndarray             # the device result
    bench: np.ndarray              # the float64 (or exact dtype) benchmark result
    device_dtype: str = ""         # the framework's dtypes before conversion: "bfloat16", ...
    bench_dtype: str = ""
    shape: tuple = ()


@dataclass
class Replayed:
    outputs: list[Output] = field(default_factory=list)      # the replay's outputs on the device
    # the outputs the training process computed and saved, each against the same benchmark: an op
    # wrong only where it trained (another machine, a library loaded there) is caught here
    recorded: list[Output] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)   # keep_data: input.0, output.0.device/.bench, own dtypes
    # (kind) -> {output name: array}: the benchmark run on the absolute values of the floating
    # inputs ("magnitude": for a reduction, each element's sum of |terms|) or on ones ("count": its
    # number of terms); asked only for reductions not already a pass
    terms: Callable[..., dict[str, np.ndarray]] | None = None
    # () -> {output name: array}: how far each benchmark element moves when the floating inputs
    # move by a small relative amount, over that amount (the magnitude it is computed from);
    # asked only for outputs not already a pass
    spread: Callable[[], dict[str, np.ndarray]] | None = None
    written: bool = True           # the op writes some argument (False: an op returning nothing did nothing)
    note: str = ""                 # how the op was replayed, where the row should say (another benchmark)


class Distributed(Protocol):
    """The launcher's collective engine (torchrun's gloo group for torch): shards and merges run-ut."""

    rank: int
    world: int

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...
    def gather(self, obj: Any, dst: int = 0) -> list | None: ...   # the list on dst, None elsewhere
    def barrier(self) -> None: ...


# ---- defaults for a replay that reads saved tensors as numpy and needs no launcher --------------------
def part_arrays(part: Part) -> Part:
    """A part's saved tensors as numpy (``Part.tensor``)."""
    return part


def keep_threads(n: int) -> int:
    """For frameworks that fix their thread pool at start: nothing to change per worker."""
    return n


def save_numpy_error_data(path: str, data: dict, metadata: dict) -> None:
    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(v) for k, v in data.items()
               if isinstance(v, np.ndarray) and v.dtype.kind in "fiub"}, path, metadata=metadata)


def no_distributed() -> None:
    """No launcher engine: run-ut runs as one job (``-j`` workers on this machine)."""
    return None


@dataclass(frozen=True)
class Replayer:
    """A framework's replay for run-ut; functions at module level, so it pickles to spawned workers."""

    framework: str
    # (record, source or None with random inputs, device, random, keep_data) -> Replayed; raises Skip / ReplayError
    replay: Callable[..., Replayed]
    # the --device option (None: the framework's default) -> a device; ValueError with a one-line reason
    resolve_device: Callable[[str | None], Any]
    # a part's saved tensors as the framework reads them; made per process (handles do not survive fork)
    tensor_source: Callable[[Part], Any] = part_arrays
    # threads of one replaying process -> the previous setting
    set_threads: Callable[[int], int] = keep_threads
    # (safetensors path, Replayed.data, metadata) -> writes the file
    save_error_data: Callable[[str, dict, dict], None] = save_numpy_error_data
    # the engine when launched by the framework's launcher (torchrun), else None
    distributed: Callable[[], Distributed | None] = no_distributed
    # a second verdict msprobe defines for this framework (a rule of standards.yaml, e.g.
    # "mindspore_benchmark"), given beside the full one in the details' "MindSpore Rule" column
    seed_rule: str = ""
    # (record) -> how a standalone repro script calls the recorded op (JSON; ``dispatchprobe repro``),
    # ValueError with a one-line reason where it cannot; None where the op name says it all (torch)
    call_form: Callable[[dict], dict] | None = None


REPLAYERS = {"torch": "dispatchprobe.torch.replay", "mindspore": "dispatchprobe_ms.replay"}   # manifest "framework" -> module with REPLAYER


def replayer_for(run: Run) -> Replayer:
    """The replayer of the framework that recorded ``run`` (a bare step/rank folder: torch)."""
    framework = run.manifest.get("framework") or "torch"
    module = REPLAYERS.get(framework)
    if module is None:
        raise ValueError(f"{run.path}: records of framework {framework!r}, which run-ut cannot replay "
                         f"(known: {', '.join(sorted(REPLAYERS))})")
    return importlib.import_module(module).REPLAYER
