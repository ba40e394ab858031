"""Stage and cell scope of a compiled graph's kernel, from its full scope name or its source trace.

MindSpore names each kernel of a graph by the cells it sits in, ``attribute-Class`` per level,
backward kernels under ``Gradients/``:
``Gradients/Default/network-WithLossCell/_backbone-Net/fc-Dense/Grad_MatMul/MatMul-op1``.  The
probe's scopes are the ``model=`` cell's attribute paths, as in PyNative (``Net.fc``): the part of
the name below the model's own level, checked against the model's cells.  Kernels outside the
model (the loss cell, the optimizer) have no scope, as in PyNative.

An ``@ms.jit`` function's kernels are all named ``Default/...``: their cells are read from the
kernel's source trace in the graph's IR instead: from the frame of the model's ``construct``,
each call ``self.fc(...)`` that enters a ``construct`` is one level (``Net.fc``).  The trace comes
first wherever it says something: a kernel traced through cells' ``construct``s but never the
model's is outside it, whatever cell its name gives.

A kernel with no trace (the ``AddN`` summing a value's gradients) is in the cell its inputs were
made in: MindSpore names the sum after the cell that made the value (``up-Dense`` for the GELU's
two gradient branches), where the sum completes that one cell's backward (aten's ``gelu_backward``
sums inside).  Inputs from several cells: the one cell giving more than one of them (its branches,
a residual's gradient added in); none such, or several, keep the name's cell.
"""

from __future__ import annotations

import inspect
import re

from .graph_ir import BOOKKEEPING

_CALL = re.compile(r"^self\.(\w+)(?:\[(\d+)\])?$")


class GraphScopes:
    def __init__(self, model):
        self.root = type(model).__name__ if model is not None else None
        self.cells = {path: type(cell).__name__ for path, cell in model.cells_and_names()} if model is not None else {}
        self._memo: dict[str, tuple[str, str]] = {}
        self._construct = _where(type(model).construct) if model is not None else None
        self._traces_enter_model = False     # a kernel's trace went through the model's construct

    def __call__(self, full_name: str, frames=()) -> tuple[str, str]:
        """(stage, scope) of the kernel named ``full_name``, whose IR source trace is ``frames``."""
        hit = self._memo.get(full_name)
        if hit is None:
            parts = full_name.split("/")
            stage = stage_of(full_name)
            # the trace first: MindSpore's names merge the scopes of kernels it merged (the conv's
            # BiasAddGrad named after the dense's, a loss's division gradient after the first cell
            # that divided), and a jit function's names hold no cell
            traced = self._traced(frames)
            scope = traced if traced is not None else self._scope(parts[:-1])
            hit = self._memo[full_name] = stage, scope
        return hit

    def kernel(self, full_name: str, node=None) -> tuple[str, str]:
        """(stage, scope) of the kernel named ``full_name`` whose IR node is ``node`` (or None): its
        trace's cell, else, for a kernel with no trace, the one cell its inputs were made in, else
        its name's cell."""
        return self._kernel(full_name, node, {})

    def _kernel(self, full_name: str, node, seen: dict) -> tuple[str, str]:
        if node is not None and not node.frames:
            made_in = self._made_in(node, seen)
            if made_in is not None:
                return stage_of(full_name), made_in
        return self(full_name, node.frames if node is not None else ())

    def _made_in(self, node, seen: dict) -> str | None:
        """The cell ``node``'s value arguments were made in: the one cell making them all, else the
        one cell making more than one of them (its gradient branches, which mean something only
        summed, with a gradient from elsewhere added in); None where an argument's maker is unknown
        (a parameter, graph bookkeeping, a name the IR does not resolve) or no one cell is that.
        ``seen``: this lookup's answers by node (a chain of untraced kernels is walked once)."""
        if id(node) in seen:
            return seen[id(node)]
        seen[id(node)] = None
        terms: dict[str, int] = {}
        for arg, maker in zip(node.args, node.makers):
            if not arg.strip().startswith("%") or maker is not None and maker.op == "UpdateState":
                continue                               # a constant; a side-effect order, not a value
            if maker is None or maker.op in BOOKKEEPING:
                return None
            scope = self._kernel(maker.name, maker, seen)[1]
            terms[scope] = terms.get(scope, 0) + 1
        several = [scope for scope, n in terms.items() if n > 1]
        seen[id(node)] = next(iter(terms)) if len(terms) == 1 else several[0] if len(several) == 1 else None
        return seen[id(node)]

    def _traced(self, frames) -> str | None:
        """The scope the source trace gives: the cells entered below the model's ``construct``; ""
        (outside the model, as PyNative scopes it) for a trace through cells' ``construct`` that never
        enters the model's, once traces are seen to enter it; None where the trace cannot say."""
        if self.root is None or self._construct is None or not frames:
            return None
        start = next((i for i, (file, line, code, _) in enumerate(frames)
                      if (file, line) == self._construct and code.lstrip().startswith("def ")), None)
        if start is None:
            through_cells = any(code.lstrip().startswith("def construct(") for _, _, code, _ in frames)
            return "" if through_cells and self._traces_enter_model else None
        self._traces_enter_model = True
        path = ""
        for (_, _, _, called), (_, _, code, _) in zip(frames[start + 1:], frames[start + 2:]):
            m = _CALL.match(called)
            if m and code.lstrip().startswith("def construct("):
                attr = m.group(1) if m.group(2) is None else f"{m.group(1)}.{m.group(2)}"
                longer = f"{path}.{attr}" if path else attr
                if longer not in self.cells:
                    break
                path = longer
        return f"{self.root}.{path}" if path else self.root

    def _scope(self, parts: list[str]) -> str:
        if self.root is None:
            return ""
        cells = [tuple(p.split("-", 1)) for p in parts if "-" in p and not p.startswith("Grad_")]
        # the model is the graph's top cell (no level of its own), or one of the levels named by its class
        starts = [0] + [i + 1 for i, (_, cls) in enumerate(cells) if cls == self.root]
        best = None
        for start in starts:
            path = self._path(cells[start:])
            if path is not None and (start > 0 or path):
                best = path if best is None or path.count(".") > best.count(".") else best
        if best is None:
            return ""
        return f"{self.root}.{best}" if best else self.root

    def _path(self, cells: list[tuple[str, str]]) -> str | None:
        """The longest prefix of ``cells`` that is a cell path of the model ("" for its root)."""
        path = ""
        for attr, cls in cells:
            longer = f"{path}.{attr}" if path else attr
            if self.cells.get(longer) != cls:
                break
            path = longer
        return path


def stage_of(full_name: str) -> str:
    return "backward" if full_name.startswith("Gradients/") else "forward"


def _where(fn) -> tuple[str, int] | None:
    """(file, first line) of a function's definition, as MindSpore's trace names it."""
    try:
        return inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return None


_PLAIN = re.compile(r"^\w+$")
_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def _escape(text: str) -> str:
    """``text`` literal in MindSpore's regexes (C++ ECMAScript syntax)."""
    return _SPECIAL.sub(r"\\\1", text)


def dump_kernels(model, scopes: list[str], names: list[str], in_scope, stages=("forward", "backward")) -> list[str]:
    """MindSpore dump ``kernels`` entries (``name-regex(...)``, matched against whole full
    names) selecting every kernel the ``scope`` and ``list`` filters could select, or [] (dump
    all) where no narrowing is safe.  The read filter stays the exact one; this only keeps
    MindSpore from writing kernels it would drop.

    A ``list`` entry narrows only when it is a plain name (a substring of the kernel type, which
    the name's last part holds).  A ``scope`` narrows forward kernels named under the selected
    cells (``.../fc-Dense/...``); backward kernels (MindSpore names a primitive's gradient after
    the first cell that used that primitive), expanded ones and those whose names hold no cell
    (``@ms.jit`` functions) are kept whatever the scope.  A stage ``data_mode`` leaves out
    narrows by the ``Gradients/`` prefix (expanded kernels, whose stage the name does not give,
    are kept).  ``in_scope``: the session's selector; ``stages``: those recorded."""
    kind = "[^/]*"
    if names and all(_PLAIN.match(n) for n in names):
        kind = f"[^/]*({'|'.join(names)})[^/]*"
    places = ["(.*/)?"]
    if scopes and model is not None:
        root = type(model).__name__
        if not in_scope(root):
            cells = {path: type(cell).__name__ for path, cell in model.cells_and_names() if path}
            chosen = [p for p in cells if in_scope(f"{root}.{p}")]
            chosen = [p for p in chosen if not any(p.startswith(q + ".") for q in chosen)]
            chains = []
            for path in chosen:
                parts = path.split(".")
                chains.append("/".join(_escape(f"{a}-{cells['.'.join(parts[:i + 1])]}") for i, a in enumerate(parts)))
            places = [f"(.*/)?{c}/(.*/)?" for c in chains] + ["Gradients/(.*/)?", "Expand/(.*/)?",
                                                             "Default/(Grad_[^/]*/)*"]
    if "backward" not in stages:
        places = [p if p.startswith("Expand/") else "(?!Gradients/)" + p
                  for p in places if not p.startswith("Gradients/")]
    elif "forward" not in stages:
        places = ["Gradients/(.*/)?", "Expand/(.*/)?"]
    if places == ["(.*/)?"] and kind == "[^/]*":
        return []
    return [f"name-regex(^{p}{kind}$)" for p in places]
