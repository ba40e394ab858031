"""MindSpore's own dump of compiled graphs (GRAPH_MODE cells, ``@ms.jit`` functions), switched on
and read back for the probe.

A compiled graph's kernels never pass through the dispatch mode; MindSpore writes them itself
when ``MINDSPORE_DUMP_CONFIG`` names a dump config.  It reads that config once per process, at
its first graph compile: :func:`enable` writes the config and sets the variable (the probe does
it when it is created), pointing MindSpore at a private folder of this process.  After each
recorded region :meth:`DumpFolder.take` reads the kernels the graphs ran, in execution order,
and removes the files (or moves them to ``keep``).

The config itself cannot change once read, but its ``iteration`` is compared with a counter the
probe sets (``_set_init_iter``, MindSpore's user-step counter): the config selects the one
iteration :data:`ON`, and :meth:`DumpFolder.switch` sets the counter to it only inside a recorded
region.  A step the probe's ``step`` filter leaves out, graphs run outside ``with probe:``, and
everything after ``close()`` are then not dumped at all.  MindSpore's own counter (one per graph
run) starts at 0 and never reaches :data:`ON`, so nothing is dumped before the first region.

The config's ``kernels`` (``dump_mode`` 1) narrows the dump to the kernels the ``scope`` and
``list`` filters could select (:func:`dispatchprobe_ms.graph_scopes.dump_kernels`): a superset,
the exact filter is still applied when the records are made.  What the kernels' stage depends on
(an expanded kernel's is that of the next kernel) is read from the execution order, which holds
every kernel, so narrowing the dump changes no record.

One ``.npy`` per kernel input and output, named
``{type}.{scope_with_underscores}.{task}.{stream}.{timestamp}.{input|output}.{i}.{format}.{dtype}.npy``
under ``rank_{r}/{net}/{graph}/{iteration}/``, and each graph's kernel order in
``rank_{r}/execution_order/ms_execution_order_graph_{graph}.csv`` (full scope names).
"""

from __future__ import annotations

import atexit
import csv
import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

from . import graph_ir, graph_pairing
from .graph_pairing import parse_name

ENV = "MINDSPORE_DUMP_CONFIG"
ON, OFF = 2 ** 32 - 1, 2 ** 32 - 2      # dump iterations: the one the config selects, one it does not
_OP_NUMBER = re.compile(r"-op(\d+)$")
NET_NAME = "dispatchprobe"
_folder: "DumpFolder | None" = None         # this process's dump folder, once enabled

try:                                       # MindSpore's user-step dump counter, where it has one
    from mindspore._c_expression import _set_init_iter
except ImportError:
    _set_init_iter = None


@dataclass
class Kernel:
    """One kernel call of a graph run: its type (``Conv2D``), full scope name
    (``Default/network-WithLossCell/_backbone-Net/conv-Conv2d/Conv2D-op0``) and the files of its
    inputs and outputs by position."""

    type: str
    scope: str
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    first: int = 0                        # earliest timestamp of its files
    node: object = None                   # what the graph's IR says of it (graph_ir.Node), or None
    stage: str | None = None              # from the execution order; None: not known there
    unpaired: str = ""                    # why its files cannot be told to be this kernel's (graph_pairing)


def enable(kernels: list[str] = ()) -> tuple["DumpFolder | None", str]:
    """This process's dump folder, the dump switched on for it: (folder, "") or (None, why not).
    ``kernels``: MindSpore's kernel filter (empty: every kernel).  A later probe of the process
    rewrites the config while MindSpore has not read it; after that, a filter other than the one
    MindSpore read is said (the kernels it leaves out cannot be recorded)."""
    global _folder
    kernels = list(kernels)
    if _folder is not None:
        if kernels == _folder.kernels:
            return _folder, ""
        if not _compiled_before():
            _folder.write_config(kernels)
            return _folder, ""
        if _folder.kernels:
            return _folder, ("MindSpore read its dump config (filtered by an earlier probe's scope/list) at its first "
                             "compile: this probe's graph kernels outside that filter are not recorded")
        return _folder, ""
    if os.environ.get(ENV):
        return None, (f"{ENV} is already set ({os.environ[ENV]}): MindSpore dumps where that config says, "
                      "so compiled graphs are not recorded; unset it to let the probe record them")
    if _compiled_before():
        return None, ("MindSpore compiled a graph before the probe was created and reads its dump config only at "
                      "its first compile: compiled graphs (GRAPH_MODE cells, @jit functions, PyNative's nn.SGD/nn.Adam "
                      "updates) are not recorded in this process; create the probe before the first GRAPH_MODE or "
                      "@jit call and the first optimizer step")
    root = tempfile.mkdtemp(prefix=f"dispatchprobe_ms_{os.getpid()}_")
    _folder = DumpFolder(os.path.join(root, "dump"))
    _folder.write_config(kernels)
    os.environ[ENV] = _folder.config
    atexit.register(shutil.rmtree, root, True)
    return _folder, ""


def _compiled_before() -> bool:
    try:
        from mindspore.graph import api
    except ImportError:                                   # mindspore < 2.9
        from mindspore.common import api
    cells = getattr(api, "cells_compile_cache", {})           # cell id -> the phases it compiled
    return bool(getattr(api, "ms_compile_cache", ())) or any(bool(c) for c in cells.values())


class DumpFolder:
    """The folder MindSpore dumps into: what the graphs ran since the last look."""

    def __init__(self, path: str):
        self.path = path
        self.config = os.path.join(os.path.dirname(path), "dump_config.json")
        self.kernels: list[str] = []      # MindSpore's kernel filter ([]: every kernel)
        self.regions = 0                  # recorded regions open now (the counter is ON while any is)
        self.missing: list[tuple] = []    # (full name, graph_ir.Node or None, stage) of the kernels the last
                                          # :meth:`take` found no file of, in the graphs that ran

    def write_config(self, kernels: list[str]) -> None:
        self.kernels = list(kernels)
        config = {"common_dump_settings": {"dump_mode": 1 if kernels else 0, "path": self.path, "net_name": NET_NAME,
                                           "iteration": str(ON) if _set_init_iter else "all", "saved_data": "tensor",
                                           "input_output": 0, "kernels": self.kernels,
                                           "support_device": list(range(8)), "op_debug_mode": 0},
                  "e2e_dump_settings": {"enable": True, "trans_flag": True}}
        with open(self.config, "w") as f:
            json.dump(config, f)

    @property
    def switchable(self) -> bool:
        """Whether MindSpore dumps only inside recorded regions (else it dumps every graph run,
        and what runs outside them is deleted unread)."""
        return _set_init_iter is not None

    def switch(self, on: bool) -> None:
        """A recorded region begins (``on``) or ends: MindSpore dumps the graphs run while any is
        open.  Call after :meth:`sync`: a kernel still queued checks the counter when it runs."""
        self.regions = max(0, self.regions + (1 if on else -1))
        if _set_init_iter is not None:
            _set_init_iter(ON if self.regions else OFF)

    def sync(self) -> None:
        """Wait until every graph launched so far has run (its kernels are on disk)."""
        try:
            from mindspore.graph.api import _pynative_executor
        except ImportError:                               # mindspore < 2.9
            from mindspore.common.api import _pynative_executor
        _pynative_executor.sync()

    def discard(self) -> None:
        """Drop what graphs ran outside a recorded region."""
        self.sync()
        for run in self._runs():
            shutil.rmtree(run, ignore_errors=True)

    def take(self) -> list[Kernel]:
        """The kernels of every graph run since the last look, in the order they ran (their files
        stay until :meth:`release`)."""
        self.sync()
        self.missing = []
        runs = [(min(k.first for k in kernels), kernels) for run in self._runs() for kernels in self._kernels(run)]
        runs.sort(key=lambda r: r[0])
        return [k for _, kernels in runs for k in kernels]

    def release(self, keep: str | None = None) -> None:
        """Remove (or move under ``keep``) the files :meth:`take` read."""
        for run in self._runs():
            if keep:
                target = os.path.join(keep, os.path.relpath(run, self.path))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.rmtree(target, ignore_errors=True)        # an earlier run's, in the same dump_path
                shutil.move(run, target)
            else:
                shutil.rmtree(run, ignore_errors=True)

    def _runs(self) -> list[str]:
        return sorted(glob.glob(os.path.join(glob.escape(self.path), "rank_*", NET_NAME, "*", "*")))

    def _kernels(self, run: str) -> list[list[Kernel]]:
        """The kernels of one graph's folder, one list per run of the graph, each in execution
        order.  MindSpore's counter stays at :data:`ON` through a region, so a graph run twice in
        it (two micro-batches) writes both runs into one folder: a kernel's n-th call (its files
        in time order, a position seen again starting the next) belongs to the n-th run (a kernel
        graph runs each of its kernels once: control flow makes graphs of its own)."""
        graph = os.path.basename(os.path.dirname(run))
        rank_dir = os.path.dirname(os.path.dirname(os.path.dirname(run)))
        order = _execution_order(os.path.join(rank_dir, "execution_order", f"ms_execution_order_graph_{graph}.csv"))
        ir = os.path.join(rank_dir, "graphs", f"ms_output_trace_code_graph_{graph}.ir")
        nodes = graph_ir.read(ir, os.path.getmtime(ir)) if os.path.isfile(ir) else {}
        calls: dict[str, list[Kernel]] = {}
        dumped = {p[1] for p in map(parse_name, os.listdir(run)) if p is not None}
        renamed = _renamed(order, dumped)
        stages = _order_stages([name for _, name in sorted(order.values())])
        taken = set(renamed.values())
        self.missing += [(name, nodes.get(name), stages[i]) for flat, (i, name) in order.items()
                         if flat not in dumped and flat not in taken]
        for name in sorted(os.listdir(run)):
            parsed = parse_name(name)
            if parsed is None or parsed[0] == "Parameter":     # parameters, not kernels
                continue
            kind, flat, stamp, io, pos, _ = parsed
            flat = flat if flat in order else renamed.get(flat)
            if flat is None:
                continue
            slots = calls.setdefault(flat, [])
            # a position seen again starts the kernel's next call (the graph's next run)
            if not slots or pos in (slots[-1].inputs if io == "input" else slots[-1].outputs):
                slots.append(Kernel(kind, order[flat][1], first=stamp, node=nodes.get(order[flat][1]),
                                    stage=stages[order[flat][0]]))
            k = slots[-1]
            (k.inputs if io == "input" else k.outputs)[pos] = os.path.join(run, name)
            k.first = min(k.first, stamp)
        runs: dict[int, list[Kernel]] = {}
        for slots in calls.values():
            for n, k in enumerate(slots):
                runs.setdefault(n, []).append(k)
        runs = {n: graph_pairing.repair(kernels, nodes, order, stages) for n, kernels in runs.items()}
        return [sorted(kernels, key=lambda k: (order[k.scope.replace("/", "_")][0], k.first))
                for _, kernels in sorted(runs.items())]


def _order_stages(names: list[str]) -> list[str | None]:
    """Each kernel's stage, by its position in the execution order: ``Gradients/`` kernels are
    backward; a kernel MindSpore expanded from another (``Expand/_PowTensorScalar/Pow-op0``) has
    no stage in its name and takes the stage of the next kernel that has one (the gradient it is
    part of), None when none follows."""
    out: list[str | None] = [None] * len(names)
    after = None
    for i in range(len(names) - 1, -1, -1):
        if not names[i].startswith("Expand/"):
            after = "backward" if names[i].startswith("Gradients/") else "forward"
        out[i] = after
    return out


def _renamed(order: dict, dumped: set) -> dict[str, str]:
    """Dumped names missing from the execution order, matched to its entries that no file has:
    MindSpore may number a kernel differently in the two (``Conv2DBackpropFilter-op0`` in the
    file name, ``-op1`` in the order); matched by the name without the number, in order."""
    missing = sorted(n for n in dumped if n not in order)
    free: dict[str, list[str]] = {}
    for name in sorted((n for n in order if n not in dumped), key=lambda n: order[n][0]):
        free.setdefault(_OP_NUMBER.sub("", name), []).append(name)
    out = {}
    for name in sorted(missing, key=lambda n: int(_OP_NUMBER.search(n).group(1)) if _OP_NUMBER.search(n) else 0):
        slots = free.get(_OP_NUMBER.sub("", name))
        if slots:
            out[name] = slots.pop(0)
    return out


def _execution_order(path: str) -> dict[str, tuple[int, str]]:
    """{scope name as in file names: (position, full scope name)} of one graph's kernels."""
    try:
        with open(path, newline="") as f:
            rows = [r[0] for r in csv.reader(f) if r]
    except OSError:
        return {}
    return {name.replace("/", "_"): (i, name) for i, name in enumerate(rows[1:])}
