"""Which ranks must hold equal parameters, from the process groups the records name -- on any
device mesh, never assumed to be every rank or a contiguous range.

- A rank's **data-parallel groups** are the groups its gradients were reduced over: backward
  all-reduces and reduce-scatters with SUM or AVG (DDP's buckets, FSDP2's reduce-scatters, HSDP's
  all-reduces over the replicate dimension), except over a group that also reduces pieces of a
  sum in the forward (values of more than one element, summed or averaged; not a found-inf flag,
  a logged loss or a gradient norm): there the ranks sum the partial results of one split computation (tensor
  parallelism, whose backward all-reduces an input's gradient, not a parameter's).
- **Replicas** are the ranks joined by data-parallel groups, transitively: on a mesh the ranks
  that differ only in data-parallel coordinates (FSDP2 over ``dp`` with tensor parallelism over
  ``tp``: the ranks sharing a ``tp`` coordinate; HSDP: every rank of the replicate x shard mesh,
  which all see the same gathered parameters; DDP: its group).
- A DTensor's **shard holders** are the ranks whose coordinates agree on every mesh dimension
  the DTensor is sharded over (HSDP: the replicate dimension's groups hold equal shards); a
  ``Partial`` placement holds no equal values."""

from __future__ import annotations

import numpy as np

from ...core.collective_roles import may_join_partial_results, role
from ...records.format import walk

REDUCING = ("all_reduce", "reduce_scatter")


def group_of(record: dict) -> frozenset:
    """The global ranks of the process group a collective's record names (empty: none)."""
    group = next((v for v in record.get("inputs", ()) if v.get("type") == "process_group"), {})
    return frozenset(group.get("ranks") or ())


def reduces_pieces(record: dict) -> bool:
    """Whether a reducing collective's record may sum the pieces of a split computation (its given
    values, their reduce op: :func:`~dispatchprobe.core.collective_roles.may_join_partial_results`):
    not a found-inf flag, a logged loss or a gradient norm, which a plain data-parallel run reduces
    outside the backward too."""
    collective = role(record.get("op", ""))
    given = collective.given if collective is not None else None
    sizes = [int(np.prod(spec.get("shape") or [])) for _, arg, spec in walk(record, outputs=False)
             if given is not None and (arg == given or arg.startswith(given + ".")) and spec.get("shape") is not None]
    return may_join_partial_results((record.get("collective") or {}).get("reduce_op"), sizes)


def data_parallel_groups(records: list) -> set[frozenset]:
    """The groups one rank's gradients were reduced over (see the module's rule)."""
    backward, forward = set(), set()
    for r in records:
        info = r.get("collective") or {}
        if info.get("kind") not in REDUCING:
            continue
        group = group_of(r)
        if r.get("stage") != "backward":
            if reduces_pieces(r):
                forward.add(group)
        elif info.get("reduce_op") in ("SUM", "AVG"):
            backward.add(group)
    return {g for g in backward - forward if len(g) > 1}


def tensor_parallel_groups(records: list) -> set[frozenset]:
    """The groups over which one rank's forward reduces (all-reduce, reduce-scatter) values that may
    be pieces of a sum (:func:`reduces_pieces`): tensor parallelism summing the partial results of
    one split computation.  Its ranks compute on the same share of the batch: the layer's input is
    replicated over the group, its weights are not."""
    return {group_of(r) for r in records if (r.get("collective") or {}).get("kind") in REDUCING
            and r.get("stage") == "forward" and len(group_of(r)) > 1 and reduces_pieces(r)}


def data_shares(records: dict[int, list]) -> list[list[int]]:
    """The ranks grouped by the share of the batch they compute on, in data-parallel order: the
    members of one tensor-parallel group together (in group order), every other rank alone.  The
    shares are ordered by their members' place in their data-parallel groups (the batch's split),
    the lowest rank breaking ties, so that pieces laid side by side follow the batch."""
    joined = _components((g for recs in records.values() for g in tensor_parallel_groups(recs)), records)
    shares = [share for c in joined if (share := [r for r in c if r in records])]
    position = {r: _data_parallel_index(records[r]) for r in records}
    return sorted(shares, key=lambda share: (min(position[r] for r in share), share[0]))


def _data_parallel_index(records: list) -> tuple:
    """This rank's place in the batch's split: its index in each of its data-parallel groups, the
    group whose ranks lie furthest apart first.  On a mesh of several data-parallel dimensions
    (HSDP: replicate x shard) that is the flattened data-parallel rank, row-major in the mesh's
    order (``mesh["replicate", "shard"]._flatten()``, as torchtitan splits the batch), not one
    dimension's index alone; with one data-parallel group, its index.  Empty without one."""
    reduced_over = data_parallel_groups(records)
    index: dict[frozenset, int] = {}
    for r in records:
        info = r.get("collective") or {}
        group = group_of(r)
        if info.get("kind") in REDUCING and r.get("stage") == "backward" and group in reduced_over:
            process_group = next(v for v in r["inputs"] if v.get("type") == "process_group")
            index.setdefault(group, int(process_group.get("group_rank") or 0))
    return tuple(index[g] for g in sorted(index, key=lambda g: (-_spacing(g), sorted(g))))


def _spacing(group: frozenset) -> int:
    """The least distance between two of a group's ranks (a mesh dimension's stride)."""
    ranks = sorted(group)
    return min(b - a for a, b in zip(ranks, ranks[1:]))


def replicas(records: dict[int, list]) -> dict[int, frozenset]:
    """rank -> the ranks that hold the same parameters as it (itself included; ranks named by
    the groups whose records are not in ``records`` too), for ranks that have replicas."""
    joined = _components(g for recs in records.values() for g in data_parallel_groups(recs))
    return {r: frozenset(c) for c in joined if len(c) > 1 for r in c}


def _components(groups, ranks=()) -> list[list[int]]:
    """The ranks of ``ranks`` and of ``groups`` (iterables of ranks) joined wherever a group holds
    them together (union-find): each component's ranks in order."""
    parent: dict[int, int] = {r: r for r in ranks}

    def find(r):
        while parent.setdefault(r, r) != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r
    for group in groups:
        first, *rest = sorted(group)
        for r in rest:
            parent[find(r)] = find(first)
    members: dict[int, list] = {}
    for r in sorted(parent):
        members.setdefault(find(r), []).append(r)
    return list(members.values())


def shard_holders(dtensor: dict, rank: int) -> frozenset:
    """The ranks whose local shard of this DTensor equals ``rank``'s (empty: unknown or none)."""
    placements = dtensor.get("placements") or []
    mesh = np.asarray(dtensor.get("mesh") if dtensor.get("mesh") is not None else [])
    if any(str(p).startswith("Partial") for p in placements) or mesh.ndim != len(placements) or not mesh.size:
        return frozenset()
    where = np.argwhere(mesh == rank)
    if not len(where):
        return frozenset()
    sharded = [d for d, p in enumerate(placements) if not str(p).startswith("Replicate")]
    coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)
    same = np.all(coords[sharded] == where[0][sharded, None], axis=0) if sharded else np.ones(mesh.size, bool)
    return frozenset(int(r) for r in mesh.reshape(-1)[same])
