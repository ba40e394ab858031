"""The probe's graphs in torch's FX graph and AOTAutograd caches.

A cached graph is inductor's output code, instrumented, without the pass that made it: the pass's
record templates are kept beside it as JSON, in ``<torch cache dir>/dispatchprobe/<fx graph cache
key>.json``, written once the graph is compiled and read back when the cache returns it (nothing is
pickled: a damaged or foreign file is a miss, and the graph is compiled again).  The key covers what
the templates depend on and inductor's key does not see: the probe's own code, the config the
pass reads, the node metadata it groups by (``original_aten``, ``seq_nr``, scopes, traced calls)
and the graph's slot, the number the compiled code passes to the recording op.  A slot is the
backend's and the graph's order of creation in the process, so a rerun of the same script finds
its graphs again while two backends compiling the same graph in one process get two entries.

An AOTAutograd hit returns a forward and backward graph without compiling either: its key gets
the probe's through :class:`Keyed`, and its graphs find their templates by the FX graph cache keys
it loads them by (``internals.inductor.fx_cache_loads``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import json

import torch

from ..internals import inductor
from ..internals.dispatch import tree_map
from ..internals.inductor import CustomGraphPass
from .decompositions import CALL_KEY, OUTPUT_KEY, VALUE_KEY, Call, Value
from .graph_pass import Template

SLOT_BITS = 24          # a slot: backend number << SLOT_BITS | graph number in that backend


@functools.cache
def source_digest() -> str:
    """The code a cached graph's templates come from (the pass, how it encodes values)."""
    here = pathlib.Path(__file__).resolve().parent
    files = sorted(str(p) for p in here.glob("*.py"))
    files += [str(here.parent / "ops.py"), str(here.parent / "tensor_backend.py"), str(here.parent.parent / "core" / "recorder.py"),
              str(here.parent / "internals" / "inductor.py")]     # the lowering and schedule the pass's code comes from
    return inductor.hash_of_files(tuple(files)).hex()


def graph_digest(gm: torch.fx.GraphModule, roots) -> str:
    """The node metadata the pass reads, which inductor's key strips: autograd sequence numbers
    and traced value ids as their order of appearance (their absolute values depend on what the
    process ran before), scopes as the pass names them."""
    seq: dict = {}
    vids: dict = {}
    calls: dict = {}

    def rank(table, v):
        return None if v is None else table.setdefault(v, len(table))

    def plain(x):
        if isinstance(x, Value):
            return ("value", rank(vids, x.id), sorted((k, repr(v)) for k, v in x.spec.items()))
        return repr(x)

    h = hashlib.sha256()
    for n in gm.graph.nodes:
        m = n.meta
        call = m.get(CALL_KEY)
        call_fact = None
        if isinstance(call, Call):
            call_fact = calls.get(id(call))
            if call_fact is None:
                call_fact = calls[id(call)] = (len(calls), str(call.op), call.outputs,
                                               tree_map(plain, (list(call.args), dict(call.kwargs))))
        h.update(repr((n.name, str(m.get("original_aten")), rank(seq, m.get("seq_nr")), m.get("partitioner_tag"),
                       roots.scope(m.get("nn_module_stack")), roots.node_scope(m, "backward"),
                       call_fact, m.get(OUTPUT_KEY), rank(vids, m.get(VALUE_KEY)))).encode())
    return h.hexdigest()


def frame_digest(gm: torch.fx.GraphModule, roots) -> str:
    """What the templates of a dynamo graph's forward and backward depend on beyond the graph
    AOTAutograd hashes: its nodes' scopes as the pass names them (``nn_module_stack`` is keyed by
    module ids, which the AOTAutograd key does not see)."""
    h = hashlib.sha256(repr((roots.current, sorted(roots.local.items()))).encode())
    for n in gm.graph.nodes:
        h.update(repr((n.name, roots.scope(n.meta.get("nn_module_stack")))).encode())
    return h.hexdigest()


class Keyed(CustomGraphPass):
    """A post-grad pass that does nothing, set while AOTAutograd computes its cache key, whose
    :meth:`uuid` puts the probe's key into it: the probe's graphs get entries of their own, apart
    from plain inductor's and from other configurations'.  (The pass that runs is the backend's
    own, set per graph.)  A hit's graphs are found by the FX graph cache keys it loads them by
    (``internals.inductor.fx_cache_loads``), each with its templates, slot and stage."""

    def __init__(self, key: str):
        self.key = key

    def uuid(self) -> str:
        return self.key

    def __call__(self, graph) -> None:
        pass


def cacheable(owner, example_inputs) -> bool:
    """Whether a graph may go through the FX graph cache: inductor only, the user's cache setting
    on, and what the templates hold all plain data (task ``overflow`` keeps an eager copy of the
    graph to re-run; symbolic sizes are resolved per call from sympy expressions)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols
    if owner.inner != "inductor" or owner.config.task == "overflow" or not inductor.config().fx_graph_cache:
        return False
    return not any(isinstance(x, (torch.Tensor, torch.SymInt, torch.SymFloat)) and free_symbols(x)
                   for x in example_inputs)


def _path(key: str) -> pathlib.Path:
    return pathlib.Path(inductor.cache_dir()) / "dispatchprobe" / f"{key}.json"


_FIELDS = ("op", "scope", "inputs", "kwargs", "outputs", "output_type", "compiled", "rows", "in_rows",
           "out_rows", "nonfinite_scalar")
_SLOT = "dispatchprobe-slot"     # marks a tensor spec of the arguments as the template's slot i


def _marked(value, slot_of: dict):
    """A template's argument tree as JSON data, each slot's spec marked with its slot number (the
    runtime finds a slot's place in the arguments by the spec's identity)."""
    if isinstance(value, (list, tuple)):
        return [_marked(v, slot_of) for v in value]
    if isinstance(value, dict):
        out = {k: _marked(v, slot_of) for k, v in value.items()}
        if id(value) in slot_of:
            out[_SLOT] = slot_of[id(value)]
        return out
    return value


def _unmarked(value, slots: dict):
    if isinstance(value, list):
        return [_unmarked(v, slots) for v in value]
    if isinstance(value, dict):
        out = {k: _unmarked(v, slots) for k, v in value.items() if k != _SLOT}
        if _SLOT in value:
            slots[value[_SLOT]] = out
        return out
    return value


def save(key: str, templates: list, slot: int, stage: str) -> None:
    """The templates of the graph inductor cached under ``key``, with the slot its code records
    under and its stage (best effort: without them a later hit is compiled again).  Templates with
    symbolic sizes are not kept."""
    if any(t.symbolic for t in templates):
        return
    path = _path(key)
    try:
        kept = []
        for t in templates:
            slot_of = {id(spec): i for i, spec in enumerate(t.slots)}
            kept.append({f: _marked(getattr(t, f), slot_of) for f in _FIELDS})
        data = json.dumps({"slot": slot, "stage": stage, "templates": kept})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(data)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        pass


def load(key: str) -> tuple[int, str, list] | None:
    """(slot, stage, templates) of the graph kept under ``key``; None where there are none or the
    file is not theirs."""
    try:
        graph = json.loads(_path(key).read_text())
        slot, stage = graph["slot"], graph["stage"]
        if not isinstance(slot, int) or stage not in ("forward", "backward"):
            return None
        templates = []
        for fields in graph["templates"]:
            t = Template(fields["op"], fields["scope"], [], True)
            slots: dict = {}
            for f in _FIELDS:
                setattr(t, f, _unmarked(fields[f], slots))
            t.slots = [slots[i] for i in range(len(slots))]
            if len(t.slots) != len(t.rows):
                return None
            templates.append(t)
        return slot, stage, templates
    except (OSError, ValueError, KeyError, TypeError):
        return None
