"""What the MindSpore adapter knows about a primitive call, by the primitive's name.

``MsDispatchMode`` hands over calls in two conventions: pyboost ops (the flat argument list the
generated ``pyboost_<name>`` function takes, dtypes as type ids) and legacy ``Primitive`` ops
(``(prim, name, inputs)``, attributes inside ``prim``).  :func:`normalise` turns both into one
form -- inputs as positional arguments, dtypes as MindSpore dtypes, a legacy op's attributes as
keyword arguments -- and a :class:`Call` that runs the op again from that form.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import textwrap

import mindspore as ms
from mindspore import _c_expression
from mindspore._c_expression import typing
from mindspore.ops import Primitive

from dispatchprobe.core import nested_values as values
from dispatchprobe.core import op_traits

# ops of the framework's own machinery, never the user's numerics
NOT_RECORDED = {"typeof", "CellBackwardHook"}
_RANDOM = re.compile(r"random|dropout|uniform|normal|bernoulli|multinomial|randperm|randint|rand\b|gamma$", re.I)


@functools.cache
def primitive_class(name: str):
    """The Primitive class named ``name`` (generated ops, then hand-written ones), or None."""
    from mindspore.ops.auto_generate import gen_ops_prim
    from mindspore.ops.operations.manually_defined import ops_def
    import mindspore.ops.operations as operations
    from mindspore.ops.operations import _grad_ops           # gradient kernels of compiled graphs
    for module in (gen_ops_prim, ops_def, operations, _grad_ops):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, Primitive):
            return cls
    return None


@functools.cache
def pyboost_form(name: str) -> tuple[str, tuple[int, ...]] | None:
    """(``pyboost_<name>`` function, positions of its dtype arguments) of a pyboost op, read from
    the generated ``__call__`` that converts them (``dtype_to_type_id``), or None."""
    cls = primitive_class(name)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__call__))) if cls is not None else None
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Call) and getattr(node.func, "id", "").startswith("pyboost_") \
                and len(node.args) == 2 and isinstance(node.args[1], ast.List) and hasattr(_c_expression, node.func.id):
            return node.func.id, tuple(i for i, e in enumerate(node.args[1].elts) if "dtype_to_type_id" in ast.unparse(e))
    return None


def constructor_attrs(name: str, attrs: dict) -> dict:
    """Of a compiled graph's primitive attributes, those a hand-written (legacy) primitive is built
    from (``Conv2D(out_channel, kernel_size, ...)``), as PyNative records them (``init_attrs``);
    {} for generated primitives, whose arguments are inputs."""
    cls = primitive_class(name)
    if cls is None or cls.__module__.endswith("gen_ops_prim") or pyboost_form(name) is not None:
        return {}
    try:
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    except (TypeError, ValueError):
        return {}
    aliases = {"data_format": "format"}
    out = {}
    for p in params:
        key = p if p in attrs else aliases.get(p)
        if key in attrs and attrs[key] is not None:
            out[p] = attrs[key]
    return out


def dtype_to_id(dtype) -> int:
    from mindspore.ops.auto_generate.gen_ops_prim import dtype_to_type_id
    return dtype_to_type_id("Cast", "dtype", dtype)


class Call:
    """One primitive, callable again from the normalised arguments (the free benchmark's
    re-runs): a legacy op with its ``Primitive`` instance, a pyboost op with dtypes back as ids."""

    def __init__(self, func, name: str, prim=None, dtype_positions: tuple = ()):
        self.func, self.name, self.prim, self.dtype_positions = func, name, prim, dtype_positions

    def __call__(self, *args, **attrs):
        if self.prim is not None:
            return self.func(self.prim, self.name, tuple(args))
        args = [dtype_to_id(a) if i in self.dtype_positions and isinstance(a, ms.dtype.Type) else a
                for i, a in enumerate(args)]
        return self.func(*args)

    def __repr__(self) -> str:
        return self.name


def normalise(func, args) -> tuple[str, Call, tuple, dict]:
    """(op name, re-runnable call, inputs, attributes) of one intercepted call."""
    if len(args) == 3 and isinstance(args[0], Primitive) and isinstance(args[1], str):
        prim, name, inputs = args
        return name, Call(func, name, prim), tuple(inputs), dict(prim.init_attrs)
    name = func.name
    form = pyboost_form(name)
    positions = form[1] if form else ()
    if positions:
        args = tuple(typing.type_id_to_type(a) if i in positions and isinstance(a, int) else a for i, a in enumerate(args))
    return name, Call(func, name, dtype_positions=positions), tuple(args), {}


@functools.cache
def is_random(name: str) -> bool:
    return bool(_RANDOM.search(name))


def writes_first(name: str) -> bool:
    """In-place primitives write their first input (``InplaceAddExt``, ``Assign``, ``ScatterUpdate``)."""
    return name.startswith(("Inplace", "Assign", "Scatter")) or name.endswith("_")


# optimizer kernels update their parameter and state inputs in place
_OPTIMIZER_WRITES = {"SGD": (0, 3, 5), "ApplyMomentum": (0, 1), "Adam": (0, 1, 2), "AdamWeightDecay": (0, 1, 2),
                     "ApplyAdam": (0, 1, 2), "ApplyAdagrad": (0, 1), "ApplyRMSProp": (0, 1, 2)}

# outputs a kernel leaves unwritten on the CPU (memory as it was: zeros or an earlier tensor's
# values): BatchNorm's outputs 1 and 2 (MindSpore's CPU kernel keeps the batch statistics in 3, 4)
CPU_UNWRITTEN_OUTPUTS = {"BatchNorm": (1, 2)}


@functools.cache
def written_positions(name: str) -> tuple[int, ...]:
    """Positions of the inputs the primitive writes: the first of in-place ones, an optimizer
    kernel's parameter and state, and those :data:`~dispatchprobe.core.op_traits.UNMARKED_WRITES`
    names (``BatchNorm``'s moving statistics)."""
    extra = [i for i in op_traits.UNMARKED_WRITES.get(name, ()) if isinstance(i, int)]
    extra += _OPTIMIZER_WRITES.get(name, ())
    return tuple(sorted({0, *extra} if writes_first(name) else set(extra)))


def unwritten_outputs(name: str, device: str) -> tuple[int, ...]:
    """Positions of the outputs the kernel does not write on ``device``: undefined contents."""
    return CPU_UNWRITTEN_OUTPUTS.get(name, ()) if device == "cpu" else ()


def user_stack() -> tuple:
    """The user's Python frames (MindSpore's and dispatchprobe's own left out), innermost last."""
    return values.user_stack(os.path.dirname(ms.__file__))
