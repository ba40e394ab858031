"""Memory from the ``empty`` family, tracked until an op writes it (records of it say
``undefined: true`` and are never judged)."""

from __future__ import annotations

import torch

from . import tensor_backend as torch_backend
from . import ops, tensor_kinds
from .internals.dispatch import tree_leaves


class Uninitialised:
    """Memory from the ``empty`` family holds no values until an op writes it: its bytes differ
    from run to run, so such tensors are recorded with ``undefined: true`` and never judged.

    Tracked by storage, byte range by byte range: a tensor is undefined while any byte of it is
    unwritten (FSDP2 copies a rank's shard into one slice of the all-gather buffer, and the
    all-gather fills the rest).  What counts as written is decided in :meth:`written` alone: the
    arguments an op's schema marks, those torch's or our tables add (``ops.defined_args``: batch
    norm's running statistics, collectives' output buffers), and the new outputs of a non-aten op
    that alias tracked memory (a custom op filling a view of a buffer it was given, as FSDP's
    ``all_gather_copy_in`` does: its Python kernel's writes run below the mode)."""

    def __init__(self):
        self._live: dict = {}            # storage address -> [weak reference, unwritten byte ranges]

    def __bool__(self) -> bool:
        return bool(self._live)

    @staticmethod
    def _key(t):
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None

    @staticmethod
    def _span(t) -> tuple[int, int]:
        """The bytes of its storage the tensor covers (from its first to its last element)."""
        size = t.element_size()
        start = t.storage_offset() * size
        if not t.numel():
            return start, start
        return start, start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * size

    def add(self, out) -> None:
        # plain memory only: a fake tensor (DTensor's sharding propagation allocates some) has none
        if isinstance(out, torch.Tensor) and tensor_kinds.readable(out) and out.numel():
            key = self._key(out)
            if key is not None:
                self._live[key] = [torch_backend.memory_ref(out), [self._span(out)]]

    def _hit(self, t) -> bool:
        key = self._key(t)
        entry = self._live.get(key)
        if entry is None:
            return False
        if not torch_backend.memory_alive(entry[0]):
            del self._live[key]
            return False
        a, b = self._span(t)
        return any(x < b and a < y for x, y in entry[1])

    def among(self, func, args, kwargs) -> set:
        """``id``s of the op's tensor arguments that are still undefined; the arguments an op
        fills without reading (``fill_``, ``copy_``, a collective's output buffer) are recorded
        after the op, so not these."""
        skip = {i for pair in ops.filled_args(func) for i in pair}
        found = set()
        for k, v in [*enumerate(args), *kwargs.items()]:
            if k in skip:
                continue
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor) and self._hit(t):
                    found.add(id(t))
        return found

    def written(self, func, args, kwargs, out) -> None:
        """Learns what the op wrote: the uninitialised bytes it filled are defined now, and a
        write no version counter sees is counted (:func:`tensor_kinds.unseen_write`), so that
        no cache takes what it held before for its values after.  An op outside aten (a
        collective, FSDP's custom ops) may have written any tensor it was given: counted all."""
        foreign = ops.unseen_writes(func) is True
        if foreign:
            given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            for t in given:
                tensor_kinds.unseen_write(t)
            if not self._live:
                return
        unmarked = () if foreign else ops.unseen_writes(func)
        for i, name in ops.defined_args(func):
            v = args[i] if i < len(args) else kwargs.get(name)
            for t in tree_leaves(v):
                if isinstance(t, torch.Tensor):
                    if (i, name) in unmarked:
                        tensor_kinds.unseen_write(t)
                    self._write(t)
        if foreign and not ops.is_alias(func):
            given_ids = {id(t) for t in given}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t) not in given_ids:
                    self._write(t)

    def _write(self, t) -> None:
        key = self._key(t)
        entry = self._live.get(key)
        if entry is None:
            return
        a, b = self._span(t)
        left = []
        for x, y in entry[1]:
            if b <= x or y <= a:
                left.append((x, y))
                continue
            if x < a:
                left.append((x, a))
            if b < y:
                left.append((b, y))
        if left:
            entry[1] = left
        else:
            del self._live[key]
