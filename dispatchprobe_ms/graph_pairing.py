"""Which dumped files are which kernel's, where MindSpore's file names do not say it.

MindSpore numbers the kernels it expands from another (a cross-entropy's ``Expand/_SumExt/ReduceSum-op3``,
``Expand/_Muls/Mul-op1``) one way in its dump's file names and another in the graph's IR and execution
order, so a file named after one kernel may hold another's values.  An expanded kernel whose files disagree
with what the IR says of it (:func:`files_agree`) shows it; then every kernel of its family (the same name but
the ``-opN`` number) is paired again (:func:`repair`): each of the family's file sets with the kernels it
fits -- the IR's dtypes and element counts, its constant arguments, and the values of its neighbours in the
graph (an input equal to its producer's output, an output equal to its consumers' inputs), read only from
kernels whose files are known to be theirs.  A pairing is made only where the evidence forces it (a file
set fits one kernel only, or a kernel only one file set); a file set left with a choice is never guessed:
it keeps ``unpaired``, the reason its step is not recorded.  No MindSpore import: the files and the IR only.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import replace

import numpy as np

from . import graph_ir

_OP_NUMBER = re.compile(r"-op\d+$")
# the kernels MindSpore expands from another at compile time (a cross-entropy's SumExt and Muls): those its
# dump numbers apart from the IR.  Files that disagree with other kernels are not paired again: in a graph
# with control flow their values need not be the kernel's at all (docs/mindspore.md), so that step is not
# recorded.
EXPANDED = "Expand/"
_BOOKKEEPING = {"Load", "MakeTuple", "UpdateState", "Return"}     # no value a kernel's file holds


def parse_name(filename: str) -> tuple | None:
    """(type, scope name, timestamp, "input"/"output", position, dtype) of one dump file, or None."""
    parts = filename.removesuffix(".npy").split(".")
    if len(parts) < 9 or parts[-4] not in ("input", "output") or not parts[-5].isdigit():
        return None
    return parts[0], ".".join(parts[1:-7]), int(parts[-5]), parts[-4], int(parts[-3]), parts[-1]


def files_agree(kernel, node) -> bool:
    """Whether the kernel's files have the dtypes and element counts ``node`` (the graph's IR) gives its
    inputs and outputs, where it gives them (True without a node)."""
    if node is None:
        return True
    for files, shapes, dtypes in ((kernel.inputs, node.inputs, node.input_dtypes),
                                  (kernel.outputs, node.outputs, node.output_dtypes)):
        for i, path in files.items():
            if i >= len(shapes) or shapes[i] is None or dtypes[i] is None:
                continue
            dumped = parse_name(os.path.basename(path))
            if dumped is not None and dumped[5].lower() != dtypes[i].lower():
                return False
            if int(np.prod(shapes[i])) != numel(path):
                return False
    return True


def numel(path: str) -> int:
    """The element count of a .npy file, from its header (the data is not read)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        shape = np.lib.format._read_array_header(f, version)[0]
    return int(np.prod(shape))


def family(name: str) -> str:
    """A kernel's family: its full name without the ``-opN`` number MindSpore may give otherwise."""
    return _OP_NUMBER.sub("", name)


def repair(kernels: list, nodes: dict, order: dict, stages: list) -> list:
    """One graph run's kernels (graph_dump.Kernel, named after their files), those of every family holding a
    kernel whose files disagree with its IR paired again by the evidence (module docstring): a paired file
    set becomes the kernel it was paired with (its name, IR node, stage); one the evidence leaves with a
    choice keeps its name and gets ``unpaired`` (why), as does a kernel of another family the evidence says
    holds another's files (never renamed).  Files that disagree outside the expanded kernels: the run as
    it is (its step goes unrecorded, see EXPANDED).  The evidence starts from the kernels alone in their
    family (their files are surely theirs) and grows with every pairing made, in any family of several
    kernels (their shapes may be alike, their numbers apart unseen), so that a neighbour's values can
    tell two kernels of alike shapes apart.  ``nodes``: the graph's IR by full name; ``order``: {flat
    name: (position, full name)}; ``stages``: by execution-order position.  A run whose files all agree
    with the IR is returned as it is (nothing read)."""
    families: dict[str, list] = {}
    for k in kernels:
        families.setdefault(family(k.scope), []).append(k)
    broken = {f for f, ks in families.items() if not all(files_agree(k, k.node) for k in ks)}
    if not broken or not all(f.startswith(EXPANDED) for f in broken):
        return kernels          # nothing to pair, or files that disagree elsewhere: not to be trusted (control flow)
    several = {f for f, ks in families.items() if len(ks) > 1} | broken
    evidence = _Evidence(nodes, {ks[0].scope: ks[0] for f, ks in families.items() if f not in several})
    names = {f: [name for _, name in sorted(order.values()) if family(name) == f] for f in several}
    open_sets = {f: list(families[f]) for f in several}
    paired: dict[int, object] = {}             # id(file set) -> the kernel it was paired with
    while _pair_forced(open_sets, names, evidence, paired, nodes, order, stages):
        pass
    for f in broken:
        for k in open_sets[f]:
            fits = [n for n in names[f] if evidence.fits(k, n)]
            k.unpaired = (f"its files fit {len(fits)} kernels of {f} ({', '.join(fits[:3])}): the dump's names "
                          "do not say which" if fits else f"its files fit no kernel of {f}")
    for k in kernels:           # a family whose files agreed keeps its names; evidence against one is said
        made = paired.get(id(k))
        if made is not None and family(k.scope) not in broken and made.scope != k.scope:
            k.unpaired = f"its neighbours' values say its files are {made.scope}'s"
    return [paired[id(k)] if id(k) in paired and family(k.scope) in broken else k for k in kernels]


def _pair_forced(open_sets: dict, names: dict, evidence, paired: dict, nodes: dict, order: dict,
                 stages: list) -> bool:
    """Make the pairings the evidence forces now, one per family (a file set with one fitting kernel;
    with as many file sets as kernels, a kernel one file set fits); True when one was made (its files
    are then known: evidence for its neighbours)."""
    made_any = False
    for f, sets in open_sets.items():
        fits = {id(k): [n for n in names[f] if evidence.fits(k, n)] for k in sets}
        if any(not v for v in fits.values()):
            continue                          # a file set no kernel fits: the family's names cannot be trusted
        pair = next(((k, fits[id(k)][0]) for k in sets if len(fits[id(k)]) == 1), None)
        if pair is None and len(sets) == len(names[f]):
            for n in names[f]:
                takers = [k for k in sets if n in fits[id(k)]]
                if len(takers) == 1:
                    pair = (takers[0], n)
                    break
        if pair is None:
            continue
        k, name = pair
        made = replace(k, scope=name, node=nodes.get(name), stage=stages[order[name.replace("/", "_")][0]])
        paired[id(k)] = made
        sets.remove(k)
        names[f].remove(name)
        evidence.known[name] = made
        made_any = True
    return made_any


class _Evidence:
    """Whether a file set fits a kernel of the IR: dtypes and element counts, constant arguments, and
    the values its neighbours' files hold (only kernels in ``known``: their files are theirs)."""

    def __init__(self, nodes: dict, known: dict):
        self.nodes, self.known = nodes, known
        self.by_ref = {n.ref: name for name, n in nodes.items() if n.ref}
        self.consumers: dict[tuple, list] = {}      # (producer name, output) -> [(consumer name, input)]
        for name, n in nodes.items():
            for i, arg in enumerate(n.args):
                source = self.source(arg)
                if source is not None:
                    self.consumers.setdefault(source, []).append((name, i))
        self.digests: dict[str, tuple] = {}
        self.shapes_fit: dict[tuple, bool] = {}     # (id(file set), kernel name) -> dtypes, sizes, constants agree

    def source(self, arg: str) -> tuple | None:
        """(kernel name, output position) whose value argument ``arg`` ("%12") is, through tuple items
        and ``Depend``; None for a parameter, a constant or bookkeeping."""
        index = None
        while arg in self.by_ref:
            name = self.by_ref[arg]
            node = self.nodes[name]
            if node.op == "TupleGetItem" and len(node.args) == 2:
                arg, index = node.args[0], graph_ir.constant(node.args[1])
            elif node.op == "Depend" and node.args:
                arg = node.args[0]
            elif node.op in _BOOKKEEPING:
                return None
            else:
                return name, index if isinstance(index, int) else 0
        return None

    def fits(self, files, name: str) -> bool:
        node = self.nodes.get(name)
        key = (id(files), name)
        if key not in self.shapes_fit:          # what the files say of themselves: read once
            self.shapes_fit[key] = node is not None and files_agree(files, node) and self._constants_agree(files, node)
        if not self.shapes_fit[key]:
            return False
        if _writes(node):
            return True                       # its dumped inputs are the written values: no evidence
        for i, arg in enumerate(node.args):
            source = self.source(arg)
            if source is not None and i in files.inputs and not self._same_as(files.inputs[i], *source, "outputs"):
                return False
        for j, path in files.outputs.items():
            for consumer, i in self.consumers.get((name, j), ()):
                if not self._same_as(path, consumer, i, "inputs"):
                    return False
        return True

    def _same_as(self, path: str, name: str, position: int, side: str) -> bool:
        """False only where kernel ``name``'s file (its input or output ``position``) is known and holds
        other values than ``path`` (same dtype and size); True where nothing can be said."""
        other = self.known.get(name)
        node = self.nodes.get(name)
        if other is None or node is None or _writes(node) or position not in getattr(other, side):
            return True
        (dtype_a, size_a, bytes_a), (dtype_b, size_b, bytes_b) = self._digest(path), \
            self._digest(getattr(other, side)[position])
        return dtype_a != dtype_b or size_a != size_b or bytes_a == bytes_b

    def _constants_agree(self, files, node) -> bool:
        """The dumped values of the arguments the IR gives as constants (an axis, ``keep_dims``) are them."""
        for i, path in files.inputs.items():
            value = graph_ir.constant(node.args[i]) if i < len(node.args) else None
            if value is None or isinstance(value, str) or isinstance(value, tuple) and value[:1] == ("tensor",):
                continue
            try:
                want = np.asarray(value, dtype=np.float64).ravel()
            except (TypeError, ValueError):
                continue
            got = np.load(path).astype(np.float64).ravel()
            if got.size != want.size or not np.array_equal(got, want):
                return False
        return True

    def _digest(self, path: str) -> tuple:
        """(dtype, size, digest of the bytes) of a file's array, read once: an edge's two ends hold the
        same memory, so equal values are equal bytes; only digests are kept, never the arrays."""
        if path not in self.digests:
            a = np.load(path)
            self.digests[path] = (a.dtype.str, a.size, hashlib.blake2b(np.ascontiguousarray(a).tobytes(),
                                                                      digest_size=16).digest())
        return self.digests[path]


def _writes(node) -> bool:
    """Whether the kernel writes its inputs (``side_effect_mem``: an assignment, an optimizer's update)."""
    return bool(node.attrs.get("side_effect_mem"))
