"""The package's layout, read from its code: torch's private APIs are used in
``dispatchprobe/torch/internals/`` only (one place changes when torch does), and no module reaches
into another's private names (a name starting with ``_`` is its module's business).

A private torch API is a module path with a part starting with ``_`` (``torch._C``,
``torch.utils._pytree``) or a ``_``-prefixed attribute that dispatchprobe does not define itself
(``mod._forward_hooks``, ``t._version``).  Python's own (``sys._getframe``) and aten op names
(``aten._softmax``: public ops whose names start with ``_``) are not torch internals."""

from __future__ import annotations

import ast
import pathlib

import dispatchprobe

PACKAGE = pathlib.Path(dispatchprobe.__file__).parent
INTERNALS = PACKAGE / "torch" / "internals"
# Python's private-looking public API, and a named tuple's methods
NOT_TORCH = {"_getframe", "_current_frames", "_filters_mutated", "_filters_mutated_lock_held", "_fields", "_asdict",
             "_replace", "_make"}


def _sources() -> dict[pathlib.Path, ast.Module]:
    return {p: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _own_private_attributes(trees) -> set[str]:
    """``_``-names dispatchprobe defines: module-level names, methods, class attributes, attributes it sets."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Module):           # module-level names (used across modules: the other test)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant):
                names.add(node.args[1].value)
    return {n for n in names if isinstance(n, str) and n.startswith("_")}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _under_aten(node: ast.Attribute) -> bool:
    """``torch.ops.aten._softmax`` / ``aten._softmax``: an op name, public."""
    value = node.value
    return (isinstance(value, ast.Name) and "aten" in value.id) or \
        (isinstance(value, ast.Attribute) and value.attr == "aten")


def _private_torch_uses(path: pathlib.Path, tree: ast.Module, ours: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            if any(_is_private(p) for p in node.module.split(".")) or any(_is_private(a.name) for a in node.names):
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(_is_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in ours \
                and node.attr not in NOT_TORCH and not _under_aten(node):
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value) \
                and node.args[1].value not in ours and node.args[1].value not in NOT_TORCH:
            found.append(f"{path.name}:{node.lineno} getattr .{node.args[1].value}")
    return found


def test_private_torch_apis_are_used_only_behind_the_boundary():
    trees = _sources()
    ours = _own_private_attributes(trees.values())
    outside = {p: _private_torch_uses(p, t, ours) for p, t in trees.items() if INTERNALS not in p.parents}
    outside = {str(p.relative_to(PACKAGE)): uses for p, uses in outside.items() if uses}
    assert not outside, f"private torch APIs outside dispatchprobe/torch/internals/: {outside}"
    inside = [p for p in trees if INTERNALS in p.parents]
    assert sum(len(_private_torch_uses(p, trees[p], ours)) for p in inside) >= 20    # the scan sees them there


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative ones resolved from ``path``)."""
    if not node.level:
        return node.module or ""
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _private_cross_module_uses(path: pathlib.Path, tree: ast.Module) -> list[str]:
    """``from .x import _name`` and ``x._name`` where ``x`` is a dispatchprobe module imported here."""
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(path, node)
            if not source.startswith("dispatchprobe"):
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{path.name}:{node.lineno} from {source} import {alias.name}")
                else:       # ``from . import ops``: a module, when a file or folder of that name exists
                    target = PACKAGE.parent.joinpath(*source.split("."), alias.name)
                    if target.with_suffix(".py").exists() or target.is_dir():
                        modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name.startswith("dispatchprobe") and a.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and _is_private(node.attr):
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = {str(p.relative_to(PACKAGE)): uses for p, t in _sources().items()
             if (uses := _private_cross_module_uses(p, t))}
    assert not found, f"private names used across modules (give them a public name): {found}"


def test_each_module_behind_the_boundary_says_which_torch_it_is_checked_on():
    """One place changes when torch does: each internals module names the releases it was checked on."""
    import re
    for path in sorted(INTERNALS.glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        assert re.search(r"torch (>= )?2\.\d+", doc), f"{path.name}: its docstring names no torch release"
