"""The ops a compiled graph calls, and the records each call writes.

``dispatchprobe::record`` takes one graph call's statistics rows (and, with task ``tensor``,
its values; with task ``overflow``, its inputs); ``dispatchprobe::stats_rows`` completes the CPU
rows from the in-graph reductions.  :class:`GraphRecords` turns a call into records through the
session's public entry for calls measured elsewhere (:meth:`ProbeSession.measured`)."""

from __future__ import annotations

import array
import itertools
import math
import re
import secrets

import torch
import torch.fx

from .. import tensor_backend as torch_backend, fused_stats
from ..process_state import STATE
from ..returned_rows import remember_returned, returned_row
from ...records.format import fused_kernels
from ...records.writer import json_line
from ...standards import statistics
from .decompositions import hint
from .rerun import Rerun


STAT_FIELDS = 6          # max, min, sum, L2 norm, nan count, inf count: a device stats row


@torch.library.custom_op("dispatchprobe::record", mutates_args=())
def _record(stats: list[torch.Tensor], values: list[torch.Tensor], inputs: list[torch.Tensor], slot: int,
            sizes: list[int]) -> None:
    """One graph call: a row of ``STAT_FIELDS`` statistics per recorded tensor; with task ``tensor``
    the tensors themselves (copied here: inductor reuses its buffers after the call, and writes
    into them without bumping their version, the recorder's cache key); with task ``overflow``
    the graph's inputs, to re-run the graph eagerly on a hit; ``sizes``: the call's values of the
    graph's symbolic sizes (dynamic shapes), which give each record its shapes."""
    # six 0-d statistics per value (accelerators) or blocks of rows (CPU); cat promotes to float64
    block = torch.cat([s.reshape(-1) for s in stats]).to(torch.float64).view(-1, STAT_FIELDS)
    records = GRAPHS.get(slot)
    if records is None:
        raise RuntimeError(f"dispatchprobe: a compiled graph records under slot {slot}, which no probe_backend in this "
                           "process compiled (a graph from torch's caches without its record templates): remove "
                           "the torch cache dir (TORCHINDUCTOR_CACHE_DIR) or set "
                           "torch._functorch.config.enable_autograd_cache = False")
    if records.id is None:
        records.id = next(graph_ids)
    if records.overflow:
        records.check(block, inputs, sizes)
    else:
        records.emit(block, [v.clone() for v in values] if values else None, sizes)


@_record.register_fake
def _(stats, values, inputs, slot, sizes):
    return None


torch.fx.node.has_side_effect(torch.ops.dispatchprobe.record.default)


# CPU statistics rows: the graph computes max, min, sum and sum of squares of each value, the
# eager probe's reductions in its accumulator dtype, and this op, called by the compiled code once
# for a window of values, completes their rows.  Values whose sums are finite hold no inf/nan; the
# others (and sums that overflowed) are completed from the tensor by the eager probe's own code:
# counting nan/inf and the finite max/min in the graph would cost three more reductions per value
# on every call, for values that almost never hold them (a host read here costs no sync on a CPU).
_LIB = torch.library.Library("dispatchprobe", "FRAGMENT")
_LIB.define("stats_rows(Tensor[] values, Tensor[] reductions, int[] roles=[]) -> Tensor")

GRAPH_INPUT, GRAPH_OUTPUT = 1, 2     # a window value's roles: the graph's input, its output


def _stats_rows(values, reductions, roles=()):
    """``reductions``: (max, min, sum, sum of squares) of each of ``values``, or none (the values'
    statistics computed here, as the eager probe computes them); a (len, 6) row block.
    ``roles``: which values are the graph's inputs and outputs (:func:`_host_rows`)."""
    if not reductions:
        if not values:
            return torch.empty(0, STAT_FIELDS, dtype=torch.float64)
        # the rows' numbers as doubles, shared with the tensor: half the cost of torch.tensor's
        # walk over nested lists, a window's fixed cost
        flat = array.array("d", [v for row in _host_rows(values, roles) for v in row])
        return torch.frombuffer(flat, dtype=torch.float64).view(len(values), STAT_FIELDS)
    flat = torch.stack(reductions).tolist()
    rows = []
    for i, x in enumerate(values):
        hi, lo, total, sq = flat[4 * i:4 * i + 4]
        if math.isfinite(sq) and math.isfinite(total):
            rows.append([hi, lo, total, math.sqrt(sq), 0.0, 0.0])
        else:        # inf/nan among the values (counted, finite max/min carried), or an overflowed sum
            n = x.numel()
            stats = torch_backend.complete_stats(statistics.source(x.detach(), torch).reshape(-1),
                                                 [hi, lo, total, math.sqrt(sq)])
            rows.append([float(v) for v in statistics.to_row(stats, n)])
    return torch.tensor(rows, dtype=torch.float64)


_LIB.impl("stats_rows", _stats_rows, "CPU")
_LIB.impl("stats_rows", lambda values, reductions, roles=(): torch.empty(len(values), STAT_FIELDS, dtype=torch.float64,
                                                                          device=values[0].device), "Meta")

def _host_rows(values, roles) -> list:
    """The rows of ``values``: a backward graph's input its forward returned is not read again."""
    rows: list = [None] * len(values)
    todo = []
    for i, x in enumerate(values):
        if roles and roles[i] & GRAPH_INPUT:
            row = returned_row(x)
            if row is not None:
                rows[i] = row
                continue
        todo.append(i)
    for i, row in zip(todo, read_rows([values[i] for i in todo])):
        rows[i] = row
        if roles and roles[i] & GRAPH_OUTPUT:
            remember_returned(values[i], row)
    return rows


def read_rows(values: list) -> list:
    """One read of each of ``values``: their rows, by the compiled kernel in one call where it
    reads them (plain float32/bfloat16 values, a second pass for those holding inf or nan,
    integers and bools whose sums are exact in double), else by the eager probe's code."""
    if not values:
        return []
    fast = fused_stats.row_lists
    if fast is None:
        rows, left = [None] * len(values), range(len(values))
    else:
        rows, left = fast(values, statistics.nonfinite_row)
    if left:
        for i, st in zip(left, torch_backend.tensor_stats([values[i] for i in left])):
            rows[i] = statistics.to_row(st, values[i].numel())
    return rows


GRAPHS = STATE.graphs        # compiled graphs' GraphRecords by slot (cache.py), in the adapter's process state
_MARK = f"dispatchprobe-stats-{secrets.token_hex(8)}-"    # where a joined record's statistics go
graph_ids = itertools.count()


class GraphRecords:
    """The records one compiled graph writes per call, and how its statistics map onto them."""

    def __init__(self, owner: "ProbeBackend", stage: str, roots: "FrameScopes", slot: int):
        self.owner = owner
        self.slot = slot                   # what the compiled code passes to the recording op
        self.stage = stage
        self.roots = roots
        self.id: int | None = None         # numbered at its first call (the same order cold and cached)
        self.templates: list = []           # graph_pass.Template, in graph order
        self.overflow = owner.config.task == "overflow"
        self.rerun: torch.fx.GraphModule | None = None
        self.symbols: list = []            # the sympy symbols of the graph's SymInt inputs
        self._resolved: dict[tuple, dict] = {}
        self._texts: dict[tuple, tuple] = {}     # (id(template), io filter) -> its JSON (_joined)
        GRAPHS[slot] = self

    def resolve(self, sizes) -> dict:
        """Dynamic shapes: {id(template spec): the spec with this call's shapes, strides and
        sizes}, from the call's values of the graph's symbolic sizes (one evaluation per distinct
        set of sizes).  Sizes of symbols the graph is not given (data-dependent) keep their hints."""
        if not sizes:
            return {}
        key = tuple(int(v) for v in sizes)
        hit = self._resolved.get(key)
        if hit is not None:
            return hit
        env = dict(zip(self.symbols, key))

        def value(size):
            if not isinstance(size, torch.SymInt):
                return int(size)
            expr = size.node.expr
            expr = expr.xreplace(env) if hasattr(expr, "xreplace") else expr
            return int(expr) if getattr(expr, "is_number", True) else hint(size)
        hit = self._resolved[key] = {}
        for t in self.templates:
            for spec, sym in t.symbolic:
                if isinstance(sym, tuple):
                    shape, stride = sym
                    hit[id(spec)] = {**spec, "shape": [value(d) for d in shape],
                                     "stride": [value(d) for d in stride] if stride is not None else None}
                else:
                    hit[id(spec)] = {**spec, "value": value(sym)}
        return hit

    def finish(self, order: list, source: dict | None = None) -> None:
        """Each template's rows: ``order``, the nodes read, in the order of their rows;
        ``source``: the node read for each other node of the same values."""
        row_of = {n: i for i, n in enumerate(order)}
        row_of.update({n: row_of[s] for n, s in (source or {}).items() if s in row_of})
        for t in self.templates:
            t.rows = [row_of[n] for _, n in t.slots]
            outs = {id(o) for o in t.outputs}
            t.out_rows = [r for (spec, _), r in zip(t.slots, t.rows) if id(spec) in outs]
            t.in_rows = [r for (spec, _), r in zip(t.slots, t.rows) if id(spec) not in outs] \
                + [row_of[n] for n in t.producers]
            t.producers = []
            t.read = [(spec, n) for spec, n in t.slots if id(spec) not in outs]   # until note_inlined
            t.slots = [spec for spec, _ in t.slots]
            t.tensor_nodes = []

    def set_kernels(self, kernels: dict, rounds_casts: bool = True) -> None:
        """Inductor provenance: each record names the generated kernels that compute its nodes
        (``cpp_fused_add_native_layer_norm_0:4``, ``extern_kernels.addmm:1``: name and debug handle,
        as in the provenance comments of inductor's output code), in the order inductor made them.
        ``rounds_casts`` False (inductor's default): a record making bfloat16 or float16 values in a
        fused kernel says ``fused_precision: float32``, since the ops fused with it there read its
        values unrounded, as the kernel computed them, while its record holds them as stored."""
        by_node: dict[str, list] = {}
        for kernel, names in sorted(kernels.items(), key=lambda kv: kernel_handle(kv[0])):
            for name in names:
                by_node.setdefault(name, []).append(kernel)
        for t in self.templates:
            found = []
            for name in t.compiled["nodes"]:
                found.extend(k for k in by_node.get(name, ()) if k not in found)
            t.compiled["kernels"] = sorted(found, key=kernel_handle)
            if not rounds_casts and fused_kernels({"compiled": t.compiled}) and any(
                    isinstance(o, dict) and o.get("dtype") in UPCAST_DTYPES for o in t.outputs):
                t.compiled["fused_precision"] = "float32"
        self._texts.clear()

    def emit(self, block: torch.Tensor, values: list | None = None, sizes=()) -> None:
        """One graph call: a record per template, in graph order;
        ``values``: the recorded tensors (task ``tensor``), saved with the records."""
        session = self.owner.target()
        if session is None or not session.recording(self.stage, self.templates[0].scope):
            return
        # a CPU block is read at once (no sync), each value's statistics made once for all its
        # records; an accelerator's rows wait in the recorder for one sync with its other rows
        host = block.device.type == "cpu"
        rows = block.tolist() if host else block.unbind(0)
        made: dict[int, dict] = {}
        resolved = self.resolve(sizes)
        recorder = session.recorder
        saving = values is not None and recorder.part.tensors is not None
        # the fields after the head as JSON kept per template, where they differ from call to
        # call only by their statistics (CPU rows, static shapes, nothing saved)
        joined = host and not resolved and not saving
        io = (recorder.io_filter("input"), recorder.io_filter("output"))
        texts: dict[tuple, bytes] = {}
        with session.writing():          # a failed save ends the recording, as a failed write does
            for t in self.templates:
                record = session.measured(t.op, self.stage, t.scope)
                if record is None:
                    continue
                if joined and recorder.write_joined(record, self._joined(t, io, rows, texts)):
                    continue
                fresh = dict(resolved)
                for spec, r in zip(t.slots, t.rows):
                    copy = fresh[id(spec)] = dict(resolved.get(id(spec), spec))
                    if not host:
                        recorder.defer_stats(copy, rows[r], math.prod(copy["shape"]))
                    elif r in made:
                        copy["stats"] = made[r]
                    else:
                        copy["stats"] = made[r] = statistics.from_row(rows[r], math.prod(copy["shape"]))
                    if saving:
                        copy["data"] = recorder.save(values[r])
                self._fill(record, t, fresh, recorder.io_filter)
                session.write(record)

    def _joined(self, t, io: tuple, rows: list, texts: dict) -> bytes:
        """A template's fields after the head, as JSON, with this call's statistics: the JSON of
        :meth:`_fill` with a marker for each tensor's statistics is made once per template and
        filter, and cut at the markers; ``texts``: each (row, size)'s statistics JSON this call."""
        pieces = self._texts.get((id(t), io))
        if pieces is None:
            marks = {id(spec): {**spec, "stats": f"{_MARK}{i}"} for i, spec in enumerate(t.slots)}
            rest: dict = {}
            self._fill(rest, t, marks, lambda which: io[which == "output"])
            cut = re.split(rb'"' + _MARK.encode() + rb'(\d+)"', json_line(rest)[1:-2])
            pieces = self._texts[(id(t), io)] = (cut[0::2], [int(i) for i in cut[1::2]])
        text, slots = pieces
        out = [text[0]]
        for slot, after in zip(slots, text[1:]):
            spec, r = t.slots[slot], t.rows[slot]
            key = (r, math.prod(spec["shape"]))
            stats = texts.get(key)
            if stats is None:
                stats = texts[key] = json_line(statistics.from_row(rows[r], key[1]))[:-1]
            out.append(stats)
            out.append(after)
        return b"".join(out)

    def _fill(self, record: dict, t, fresh: dict, io_filter=lambda io: True) -> None:
        """A template's arguments with this call's tensor specs, and the compiled graph's facts."""
        if io_filter("input"):
            record["inputs"] = fill(t.inputs, fresh)
            record["kwargs"] = {k: fill(v, fresh) for k, v in t.kwargs.items()}
        if io_filter("output"):
            record["output_type"] = t.output_type
            record["outputs"] = fill(t.outputs, fresh)
        record["compiled"] = {"graph": self.id, **t.compiled}

    def check(self, block: torch.Tensor, inputs: list, sizes=()) -> None:
        """Task overflow, one graph call: the first call whose outputs hold inf/nan while what it
        reads is finite (and it is given no inf/nan) is a hit.  Its compiled record is written
        (flag ``overflow``), then the graph is re-run eagerly, node by node, through the session's
        overflow check, which finds the node, saves its inputs and replays it in float64."""
        session = self.owner.target()
        if session is None or not session.recording(self.stage, self.templates[0].scope):
            return
        rows = block.tolist()            # one host read per graph call

        def bad(r):
            return rows[r][4] + rows[r][5] > 0
        hit = next((t for t in self.templates if any(bad(r) for r in t.out_rows)
                    and not t.nonfinite_scalar and not any(bad(r) for r in t.in_rows)), None)
        if hit is None:
            return
        # call indexes as the other tasks give them (every recorded call of the graph counts), so the
        # hit and its eager re-run are one op identity with the eager probe's numbering
        measured = {id(t): session.measured(t.op, self.stage, t.scope) for t in self.templates}
        record = measured.get(id(hit))
        if record is None:
            return
        fresh = dict(self.resolve(sizes))
        for spec, r in zip(hit.slots, hit.rows):
            copy = fresh[id(spec)] = dict(fresh.get(id(spec), spec))
            copy["stats"] = statistics.from_row(rows[r], math.prod(copy["shape"]))
        self._fill(record, hit, fresh)
        nan = sum(int(rows[r][4]) for r in hit.out_rows)
        inf = sum(int(rows[r][5]) for r in hit.out_rows)
        record["overflow"] = {"class": "critical", "nan": nan, "inf": inf,
                              "rerun": "the graph is re-run eagerly: see the records after this one"
                              if self.rerun is not None else "not re-run (symbolic sizes)"}
        session.write(record, now=True)
        if self.rerun is not None:
            node_calls = {name: m["call"] for t in self.templates if (m := measured[id(t)]) is not None
                          for name in t.compiled["nodes"]}
            Rerun(self.rerun, session, self.stage, self.roots, node_calls,
                  {"graph": self.id, "rerun_of": record["name"]}).run(*inputs)


# the dtypes inductor's kernels compute in float32 and round only where they store them
UPCAST_DTYPES = ("bfloat16", "float16")


def kernel_handle(kernel: str) -> int:
    """The provenance debug handle of ``"name:handle"`` (the order inductor generated the kernels)."""
    try:
        return int(kernel.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return -1


def fill(value, fresh: dict):
    """A template value with this call's tensor specs in place of the template's."""
    if isinstance(value, list):
        return [fill(v, fresh) for v in value]
    if isinstance(value, dict):
        hit = fresh.get(id(value))
        if hit is not None:
            return hit
        if value.get("type") in ("list", "tuple"):
            return {"type": value["type"], "value": [fill(v, fresh) for v in value["value"]]}
        return value
    return value
