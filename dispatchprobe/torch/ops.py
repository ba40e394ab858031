"""What the torch adapter knows about an aten op: its name and the traits its schema and
:mod:`dispatchprobe.core.op_traits` give it, memoised per overload.  Nothing else reads schemas.
"""

from __future__ import annotations

import functools

import torch

from ..core import nested_values, op_traits
from ..core.collective_roles import NAMESPACES
from .internals.dispatch import op_schema, schema_info


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``: how dtypes are named in records and to the core."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def op_name(func) -> str:
    """``aten.addmm.default`` (``str`` formats the schema name on every call)."""
    return str(func)


@functools.cache
def base(func) -> str:
    return op_traits.base_name(op_name(func))


@functools.cache
def written_args(func) -> tuple:
    """(position, name) of the arguments the op writes (``self`` of ``add_``, ``out=``).

    The schema's ``Tensor(a!)`` marks are not all: ``native_batch_norm`` updates ``running_mean``
    and ``running_var`` unmarked (and no version counter moves inside a dispatch mode, nor for
    such a write at all).  torch's ``_SchemaInfo`` knows those ops; the table in
    :mod:`dispatchprobe.core.op_traits` adds any it misses."""
    schema = op_schema(func)
    info = schema_info(schema)
    unmarked = op_traits.UNMARKED_WRITES.get(base(func), ())
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write
                 or a.name in unmarked or info.is_mutable(a.name))


@functools.cache
def reads_written(func) -> tuple:
    """:func:`written_args` whose old content the op reads: not those of ops that overwrite
    every element (``fill_``, ``copy_``, ``uniform_``), whose old content is often uninitialised,
    nor ``out=`` arguments (a destination, never an input)."""
    if base(func) in op_traits.OVERWRITE:
        return ()
    outs = out_args(func)
    return tuple(w for w in written_args(func) if w not in outs)


@functools.cache
def out_args(func) -> tuple:
    """(position, name) of the op's destinations: its ``out=`` arguments and the output buffers a
    collective fills (:data:`~dispatchprobe.core.op_traits.UNMARKED_FILLS`: an all-gather's or a
    reduce-scatter's ``output_tensor``).  Memory it writes without reading (DDP's gradient bucket
    views hold stale values there), so their prior contents are never an input: a collective's
    buffer measured as the collective left it would be an input that already holds the result, and
    a result that differs (another rank's values) would look like an input no op made differing."""
    fills = op_traits.UNMARKED_FILLS.get(base(func), ())
    return tuple((i, a.name) for i, a in enumerate(op_schema(func).arguments) if a.is_out or a.name in fills)


@functools.cache
def unreturned_destinations(func) -> tuple:
    """Every argument an op that returns nothing writes: its :func:`out_args` (FSDP2's ``chunk_cat``
    writing the flat buffer its reduce-scatter reads, ``split_with_sizes_copy`` writing the gathered
    parameters) and its in-place ones (:func:`written_args`: the lists of ``_foreach_copy_``, FSDP2's
    cast into its all-gather buffer, and of every other ``_foreach_*_``), in the order replay gives
    them back.  What it wrote there is its result, which its record's outputs hold, as an in-place
    op returning its ``self`` has its written value recorded.  Without them the value the next op
    reads has no producer, and a compare would say the runs differ at their inputs."""
    return tuple(dict.fromkeys(written_args(func) + out_args(func))) if not op_schema(func).returns else ()


def destination_values(func, args, kwargs):
    """The values an op returning nothing wrote into the arguments it writes
    (:func:`unreturned_destinations`): one tensor or list, or a tuple of several, each an alias of
    the argument after the write (among the inputs the argument stands for what it held before:
    undefined for a destination, as received for an in-place argument); None for an op that has none."""
    def alias(v):
        if isinstance(v, (list, tuple)):
            return [alias(x) for x in v]
        return v.detach() if isinstance(v, torch.Tensor) else v

    got = tuple(alias(args[i] if i < len(args) else kwargs.get(name)) for i, name in unreturned_destinations(func))
    return None if not got else got[0] if len(got) == 1 else got


@functools.cache
def overwritten_args(func) -> tuple:
    """(position, name) of the arguments an overwrite-only op (``fill_``, ``copy_``) writes:
    every element, none read."""
    return written_args(func) if base(func) in op_traits.OVERWRITE else ()


@functools.cache
def filled_args(func) -> tuple:
    """(position, name) of the arguments the op writes without reading them: those of an
    overwrite-only op (:func:`overwritten_args`) and the output buffers of collectives
    (:data:`~dispatchprobe.core.op_traits.UNMARKED_FILLS`, named as in the schema)."""
    fills = op_traits.UNMARKED_FILLS.get(base(func), ())
    own = tuple((i, a.name) for i, a in enumerate(op_schema(func).arguments) if a.name in fills)
    return overwritten_args(func) + own


@functools.cache
def defined_args(func) -> tuple:
    """(position, name) of every argument the op writes: :func:`written_args` and :func:`filled_args`."""
    return tuple(dict.fromkeys(written_args(func) + filled_args(func)))


@functools.cache
def unseen_writes(func):
    """The arguments the op may write without moving their version counters: every argument of
    an op outside aten (``True``: collectives, custom ops such as FSDP's, whose schemas need not
    say what they write), or those of an aten op written unmarked (batch norm's running
    statistics, :func:`defined_args` not marked in the schema); ``()`` for none."""
    if func.namespace != "aten":
        return True
    marked = {a.name for a in op_schema(func).arguments if a.alias_info is not None and a.alias_info.is_write}
    return tuple(w for w in defined_args(func) if w[1] not in marked)


@functools.cache
def returns_alias(func) -> bool:
    """The output aliases an input (in-place, out=, views): not replaceable by a re-run's."""
    return any(r.alias_info is not None for r in op_schema(func).returns)


@functools.cache
def is_random(func) -> bool:
    """Never run again by a check: draws random numbers (by name, or any op with a ``generator``
    argument), or talks to other ranks (a collective re-run on one rank desynchronises its group)."""
    return base(func) in op_traits.RANDOM or any(a.name == "generator" for a in op_schema(func).arguments) \
        or getattr(func, "namespace", None) in NAMESPACES


@functools.cache
def never_recorded(func) -> bool:
    return base(func) in op_traits.NOTHING_TO_CHECK


@functools.cache
def allocates_uninitialised(func) -> bool:
    return base(func) in op_traits.UNINITIALISED


@functools.cache
def is_alias(func) -> bool:
    """A view or alias of existing data (recorded only with ``include_views``)."""
    return func.is_view or base(func) in op_traits.ALIAS


def user_stack(skip: int = 3) -> tuple:
    """The Python frames of user code at this moment (torch and dispatchprobe frames left out)."""
    return nested_values.user_stack(torch.__path__[0], skip)
