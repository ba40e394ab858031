"""What MindSpore's dump says of each kernel in a graph's IR (``graphs/ms_output_trace_code_graph_{g}.ir``):
the shapes its inputs and outputs have in the graph, and the source lines that made it.

The dumped arrays carry the shape of the memory they were read from: a kernel after a no-op
reshape (``Flatten``) gets its input dumped in the shape before it, so the IR's shapes are
the record's.  The source trace (``# In file f.py:20, 32~41/    return self.act(self.fc(x))/``)
names the cells a kernel ran in where its scope name does not (``@ms.jit`` functions: every
kernel is ``Default/...``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

_FULLNAME = re.compile(r"# Fullname with scope: \((.*)\)$")
_FRAME = re.compile(r"# In file (.+?):(\d+)(?:~\d+)?, (\d+)~(\d+)/(.*)/$")
_ITEM = re.compile(r"<Tensor\[\w+\], \(([\d, ]*)\)>|<[^<>]*>")


@dataclass
class Node:
    inputs: list = field(default_factory=list)       # shape (tuple) of each input, None for non-tensors
    outputs: list = field(default_factory=list)
    frames: list = field(default_factory=list)       # (file, line, code, text the columns select)


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
    for line in lines:
        text = line.strip()
        if text.startswith(": (") and signature is None:
            signature = text
            continue
        hit = _FULLNAME.match(text)
        if hit:
            current = nodes[hit.group(1)] = Node()
            if signature:
                current.inputs, current.outputs = _shapes(signature)
            signature = None
            continue
        frame = _FRAME.match(text)
        if frame and current is not None:
            file, lineno, c1, c2, code = frame.groups()
            current.frames.append((file, int(lineno), code, code[int(c1):int(c2)]))
            continue
        if not text.startswith((": ", "#")):
            current, signature = None, None
    return nodes


def _shapes(signature: str) -> tuple[list, list]:
    """The tensor shapes of a node's ``: (<inputs>) -> (<outputs>)`` line."""
    left, _, right = signature[2:].partition(") -> (")
    return _items(left), _items(right)


def _items(side: str) -> list:
    out = []
    for m in _ITEM.finditer(side):
        dims = m.group(1)
        out.append(None if dims is None else tuple(int(d) for d in dims.split(",") if d.strip()))
    return out
