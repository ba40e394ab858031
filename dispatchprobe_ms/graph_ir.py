"""What MindSpore's dump says of each kernel in a graph's IR (``graphs/ms_output_trace_code_graph_{g}.ir``):
the shapes its inputs and outputs have in the graph, its constant arguments and primitive
attributes, and the source lines that made it.

The dumped arrays carry the shape of the memory they were read from: a kernel after a no-op
reshape (``Flatten``) gets its input dumped in the shape before it, so the IR's shapes are
the record's.  The source trace (``# In file f.py:20, 32~41/    return self.act(self.fc(x))/``)
names the cells a kernel ran in where its scope name does not (``@ms.jit`` functions: every
kernel is ``Default/...``).  Constants the graph passes (``Reshape``'s shape, a gradient kernel's
``filter_sizes``) are not dumped: they are read here, as are the attributes a legacy primitive is
built from (``Conv2D``'s ``out_channel``, ``kernel_size``, ...), which run-ut needs.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

_FULLNAME = re.compile(r"# Fullname with scope: \((.*)\)$")
_FRAME = re.compile(r"# In file (.+?):(\d+)(?:~\d+)?, (\d+)~(\d+)/(.*)/$")
_ITEM = re.compile(r"<Tensor\[(\w+)\], \(([\d, ]*)\)>|<[^<>]*>")
_NODE = re.compile(r"^(%[^\s(]+)\S* = (?:PrimFunc_)?(\w+)\((.*?)\)(?: \{instance name: [^}]*\})?(?: primitive_attrs: \{(.*?)\})?(?: cnode_attrs|$)")
_CONST_TENSOR = re.compile(r"Tensor\(shape=\[[\d, ]*\], dtype=(\w+), value=\[?([-\d. e+]*)\]?\)$")
_NUMBER = re.compile(r"^(I8|I16|I32|I64|U8|U16|U32|U64|F16|F32|F64|Bool)\((.*)\)$")
# graph bookkeeping nodes, never the user's numerics (not dumped as kernels on CPU either)
BOOKKEEPING = frozenset({"Depend", "UpdateState", "Load", "MakeTuple", "TupleGetItem"})


@dataclass
class Node:
    inputs: list = field(default_factory=list)       # shape (tuple) of each input, None for non-tensors
    outputs: list = field(default_factory=list)
    input_dtypes: list = field(default_factory=list)     # MindSpore's dtype name ("Float16"), None for non-tensors
    output_dtypes: list = field(default_factory=list)
    frames: list = field(default_factory=list)       # (file, line, code, text the columns select)
    args: list = field(default_factory=list)         # each argument's text: "%3" (a value) or a constant
    attrs: dict = field(default_factory=dict)        # primitive_attrs, as Python values
    op: str = ""                                     # the primitive (``MatMul``)
    ref: str = ""                                    # how other nodes' arguments name its value ("%49")
    sources: list = field(default_factory=list)      # per argument: (primitive, output position) that made it, or None
    name: str = ""                                   # its full scope name
    # per argument: the Node that made it (a tuple's maker for a TupleGetItem), or None (a constant,
    # a parameter, a name two nodes share); kept out of comparisons and repr (it links the graph)
    makers: list = field(default_factory=list, compare=False, repr=False)


@functools.lru_cache(maxsize=32)
def read(path: str, mtime: float = 0.0) -> dict[str, Node]:
    """{full scope name: Node} of one graph's IR file ({} when it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    nodes: dict[str, Node] = {}
    signature = None
    current = None
    node = None
    for line in lines:
        text = line.strip()
        if text.startswith("%") and " = " in text:
            node, signature, current = _NODE.match(text), None, None
            continue
        if text.startswith(": (") and signature is None:
            signature = text
            continue
        hit = _FULLNAME.match(text)
        if hit:
            current = nodes[hit.group(1)] = Node(name=hit.group(1))
            if signature:
                (current.inputs, current.input_dtypes), (current.outputs, current.output_dtypes) = _shapes(signature)
            if node is not None:
                current.ref, current.op = node.group(1), node.group(2)
                current.args = _split(node.group(3))
                current.attrs = {k: constant(v) for k, _, v in (a.partition(": ") for a in _split(node.group(4) or ""))}
            signature = node = None
            continue
        frame = _FRAME.match(text)
        if frame and current is not None:
            file, lineno, c1, c2, code = frame.groups()
            current.frames.append((file, int(lineno), code, code[int(c1):int(c2)]))
            continue
        if not text.startswith((": ", "#")):
            current, signature, node = None, None, None
    _link_sources(nodes)
    return nodes


def _link_sources(nodes: dict) -> None:
    """Set each node's ``sources``: which primitive's which output each argument is, a
    ``TupleGetItem(%6, I64(2))`` followed to output 2 of ``%6``, and ``makers``: the node making it.
    Why: a kernel may leave an output unwritten on a device (BatchNorm's 1 and 2 on the CPU), and
    the kernel that reads it reads undefined memory, which only the graph can tell; and a kernel
    with no source trace (a gradient ``AddN``) is placed by the kernels that made its inputs.  A
    name two nodes share says nothing (None)."""
    by_ref: dict = {}
    for n in nodes.values():
        if n.ref:
            by_ref[n.ref] = None if n.ref in by_ref else n
    for n in nodes.values():
        made = [_made(arg, by_ref) for arg in n.args]
        n.sources = [None if m is None else (m[0].op, m[1]) for m in made]
        n.makers = [None if m is None else m[0] for m in made]


def _made(arg: str, by_ref: dict) -> tuple | None:
    """(the node making argument ``arg``, which of its outputs), or None where the IR does not say."""
    made = by_ref.get(arg.strip())
    if made is None:
        return None
    if made.op == "TupleGetItem" and len(made.args) == 2:
        tuple_of, index = by_ref.get(made.args[0].strip()), constant(made.args[1])
        return (tuple_of, index) if tuple_of is not None and isinstance(index, int) else None
    return made, 0


def _shapes(signature: str) -> tuple[tuple[list, list], tuple[list, list]]:
    """((shapes, dtypes) of the inputs, (shapes, dtypes) of the outputs) of a node's
    ``: (<inputs>) -> (<outputs>)`` line."""
    left, _, right = signature[2:].partition(") -> (")
    return _items(left), _items(right)


def _items(side: str) -> tuple[list, list]:
    shapes, dtypes = [], []
    for m in _ITEM.finditer(side):
        dtype, dims = m.group(1), m.group(2)
        shapes.append(None if dims is None else tuple(int(d) for d in dims.split(",") if d.strip()))
        dtypes.append(dtype)
    return shapes, dtypes


def _split(text: str) -> list[str]:
    """``text`` split at its top-level commas (not those inside brackets or quotes)."""
    out, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "([{":
            depth += 1
        elif not quoted and ch in ")]}":
            depth -= 1
        elif not quoted and depth == 0 and ch == ",":
            out.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def constant(text: str):
    """A constant of the IR as a Python value (``I64(4)`` -> 4, ``(I64(2), I64(64))`` -> (2, 64),
    ``"same"`` -> "same", ``Tensor(shape=[4], dtype=Int64, value=[4 3 3 3])`` -> (dtype, [values]));
    a value reference (``%3``) or anything else unknown: None."""
    text = text.strip()
    m = _NUMBER.match(text)
    if m:
        kind, value = m.groups()
        return bool(int(value)) if kind == "Bool" else float(value) if kind.startswith("F") else int(value)
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if text.startswith("(") and text.endswith(")") or text.startswith("[") and text.endswith("]"):
        items = [constant(t) for t in _split(text[1:-1])]
        return tuple(items) if text[0] == "(" else items
    m = _CONST_TENSOR.match(text)
    if m:
        try:
            return ("tensor", m.group(1), [float(v) for v in m.group(2).split()])
        except ValueError:      # a long tensor the IR prints cut ("[0 0 ... 0]"): its values are not there
            return None
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return None
