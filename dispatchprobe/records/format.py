"""The record format's identity and its one walk over a record's encoded values (see
docs/record-format.md).  Writer, reader, compare, align and every replay walk records through
here, so an argument is named the same way (``input.1.0``, ``input.weight``, ``output.0``) by all."""

from __future__ import annotations

import json

FORMAT_NAME = "dispatchprobe-records"
FORMAT_VERSION = 1
CLOSED_MARKER = "closed"     # an empty file the writer leaves in a step/rank folder it closed
# manifest key: the eager probe saw compiled graphs run (torch.compile) that no probe_backend recorded
UNRECORDED_GRAPHS = "compiled_graphs_unrecorded"
# manifest key: the higher-order ops (torch.cond, a checkpoint's rng wrapper) run outside compiled code,
# whose inner ops the eager probe does not see
UNRECORDED_HIGHER_ORDER = "higher_order_ops_unrecorded"
# manifest key: steps whose compiled-graph kernels were left unrecorded ({"step": why}): MindSpore's dump
# could not be matched to the graph's kernels, and a file given to the wrong kernel must not be its record
UNRECORDED_GRAPH_STEPS = "graph_steps_unrecorded"


# a compiled record's ``compiled.kernels`` names: calls of library kernels, each computing one op; any
# other name is a kernel generated from the graph's nodes, fusing several
LIBRARY_KERNELS = ("extern_kernels.", "torch.ops.")


def fused_kernels(record: dict) -> set:
    """The generated kernels a compiled record's nodes run in (``cpp_fused_...``, ``triton_...``), which
    other records' nodes may share, as (graph, kernel): a kernel's handle is counted per compile.  Empty
    for an eager record or one computed by library calls alone."""
    compiled = record.get("compiled") or {}
    return {(compiled.get("graph"), k) for k in compiled.get("kernels") or () if not k.startswith(LIBRARY_KERNELS)}


def unrecorded_steps_note(manifest: dict) -> str | None:
    """The one-line account of the steps whose graph kernels were not recorded (None: none)."""
    steps = manifest.get(UNRECORDED_GRAPH_STEPS)
    if not steps:
        return None
    first = min(steps, key=int)
    return (f"the graph kernels of step{'s' if len(steps) > 1 else ''} {', '.join(sorted(steps, key=int))} were "
            f"not recorded: {steps[first]}")


def ended_marker(rank: int) -> str:
    """The empty file a probe leaves in the run directory when it closes (``rank0.ended``):
    ``run-ut --follow`` stops once every rank of the manifest has one."""
    return f"rank{rank}.ended"

def base_name(op: str) -> str:
    """An op's name without namespace, overload and in-place ``_``, the key of op tables:
    ``aten.addmm.default`` -> ``addmm``; ``aten.add_.Tensor`` -> ``add``; ``Dense`` -> ``Dense``."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 else parts[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


_CONTAINERS = ("list", "tuple")
_ARG_NAMES = {io: [f"{io}.{i}" for i in range(256)] for io in ("input", "output")}


def _arg_name(io: str, i: int) -> str:
    return _ARG_NAMES[io][i] if i < 256 else f"{io}.{i}"


def _leaves(spec: dict, path: str, tensors_only: bool):
    """(path, value) for the leaves of an encoded value; an empty list is a leaf of its own."""
    kind = spec.get("type")
    if kind in _CONTAINERS and spec["value"]:
        for i, item in enumerate(spec["value"]):
            yield from _leaves(item, f"{path}.{i}", tensors_only)
    elif kind == "tensor" or not tensors_only:
        yield path, spec


def walk(record: dict, *, inputs: bool = True, outputs: bool = True, tensors_only: bool = True) -> list:
    """[(io, arg, spec)] for each tensor of a record (``tensors_only=False``: each leaf value), in
    a fixed order: positional inputs, keyword inputs, outputs; nested lists flattened."""
    out: list = []
    if inputs:
        _walk_args(out, "input", record.get("inputs", ()), tensors_only)
        for k, spec in (record.get("kwargs") or {}).items():
            out.extend(("input", arg, t) for arg, t in _leaves(spec, f"input.{k}", tensors_only))
    if outputs:
        _walk_args(out, "output", record.get("outputs", ()), tensors_only)
    return out


def _walk_args(out: list, io: str, specs, tensors_only: bool) -> None:
    """:func:`walk` of one side's positional values into ``out``: a flat tensor (the usual value)
    appended without a generator or a call."""
    names = _ARG_NAMES[io]
    for i, spec in enumerate(specs):
        kind = spec.get("type")
        if kind == "tensor" or (not tensors_only and kind not in _CONTAINERS):
            out.append((io, names[i] if i < 256 else f"{io}.{i}", spec))
        elif kind in _CONTAINERS:
            out.extend((io, arg, t) for arg, t in _leaves(spec, _arg_name(io, i), tensors_only))


def output_shapes(record: dict) -> tuple:
    """The shapes of a record's output tensors (alignment keys on them)."""
    outs = record.get("outputs", ())
    if len(outs) == 1 and outs[0].get("type") == "tensor":  # the common case
        return (tuple(outs[0]["shape"]),)
    return tuple(tuple(spec["shape"]) for _, _, spec in walk(record, inputs=False))


_VALUE_KEYS = frozenset({"data", "stats", "checksum", "requires_grad"})


def call_signature(record: dict) -> str:
    """The call a record makes, its tensors' values left out: records with equal signatures
    call the same op on the same shapes, dtypes, strides and scalar arguments."""
    leaves = [(arg, {k: v for k, v in spec.items() if k not in _VALUE_KEYS})
              for _, arg, spec in walk(record, outputs=False, tensors_only=False)]
    return json.dumps([record["op"], "inputs" in record, leaves], sort_keys=True)
