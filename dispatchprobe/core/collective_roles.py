"""Collectives in neutral terms: what each c10d / functional collective op does, which of its
recorded arguments hold what it was given and what it gave back.  Capture numbers collectives
per process group from this table; ``dispatchprobe ranks`` checks them against their semantics."""

from __future__ import annotations

import functools
from typing import NamedTuple


class Role(NamedTuple):
    kind: str               # all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, gather,
                            # scatter, barrier, p2p, other
    given: str | None       # the argument (walk's name prefix: "input.1") holding the tensors the rank gave
    result: str | None      # the argument holding what the collective gave back ("output.0")
    root: str | None = None  # the schema argument naming the source/destination rank (an index into the group)


_R = Role
# op (namespace.name, without overload) -> role; ops not listed that take a group are "other"
ROLES = {
    "c10d.allreduce_": _R("all_reduce", "input.0", "output.0"),
    "c10d.allreduce_coalesced_": _R("all_reduce", "input.0", "output.0"),
    "_c10d_functional.all_reduce": _R("all_reduce", "input.0", "output.0"),
    "_c10d_functional.all_reduce_": _R("all_reduce", "input.0", "output.0"),
    "_c10d_functional.all_reduce_coalesced": _R("all_reduce", "input.0", "output.0"),
    "_c10d_functional.all_reduce_coalesced_": _R("all_reduce", "input.0", "output.0"),
    "c10d._allgather_base_": _R("all_gather", "input.1", "output.0"),
    "c10d.allgather_": _R("all_gather", "input.1", "output.0"),
    "c10d.allgather_into_tensor_coalesced_": _R("all_gather", "input.1", "output.0"),
    "c10d.allgather_coalesced_": _R("all_gather", "input.1", "output.0"),
    "_c10d_functional.all_gather_into_tensor": _R("all_gather", "input.0", "output.0"),
    "_c10d_functional.all_gather_into_tensor_out": _R("all_gather", "input.0", "output.0"),
    "_c10d_functional.all_gather_into_tensor_coalesced": _R("all_gather", "input.0", "output.0"),
    "c10d._reduce_scatter_base_": _R("reduce_scatter", "input.1", "output.0"),
    "c10d.reduce_scatter_": _R("reduce_scatter", "input.1", "output.0"),
    "c10d.reduce_scatter_tensor_coalesced_": _R("reduce_scatter", "input.1", "output.0"),
    "_c10d_functional.reduce_scatter_tensor": _R("reduce_scatter", "input.0", "output.0"),
    "_c10d_functional.reduce_scatter_tensor_out": _R("reduce_scatter", "input.0", "output.0"),
    "_c10d_functional.reduce_scatter_tensor_coalesced": _R("reduce_scatter", "input.0", "output.0"),
    "c10d.broadcast_": _R("broadcast", "input.0", "output.0", "root_rank"),
    "_c10d_functional.broadcast": _R("broadcast", "input.0", "output.0", "src"),
    "_c10d_functional.broadcast_": _R("broadcast", "input.0", "output.0", "src"),
    "c10d.reduce_": _R("reduce", "input.0", None, "root_rank"),
    "c10d.alltoall_": _R("all_to_all", "input.1", "output.0"),
    "c10d.alltoall_base_": _R("all_to_all", "input.1", "output.0"),
    "_c10d_functional.all_to_all_single": _R("all_to_all", "input.0", "output.0"),
    "c10d.gather_": _R("gather", "input.1", None, "root_rank"),
    "c10d.scatter_": _R("scatter", None, "output.0", "root_rank"),
    "c10d.barrier": _R("barrier", None, None),
    "c10d.monitored_barrier_": _R("barrier", None, None),
    # point to point: only two ranks of the group take part, so they get no group sequence number
    "c10d.send": _R("p2p", "input.0", None), "c10d.recv_": _R("p2p", None, "output.0"),
    "c10d.recv_any_source_": _R("p2p", None, "output.0"),
    "_c10d_functional.isend": _R("p2p", "input.0", None), "_c10d_functional.irecv": _R("p2p", None, "output.0"),
    "_c10d_functional.batch_p2p_ops": _R("p2p", None, None),
}
NOT_COLLECTIVES = frozenset({"_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd",
                             "c10d.check_for_nan"})
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


def op_key(op: str) -> str:
    """``c10d.allreduce_.default`` -> ``c10d.allreduce_`` (the table's key)."""
    parts = op.split(".")
    return ".".join(parts[:2])


@functools.lru_cache(maxsize=4096)
def role(op: str) -> Role | None:
    """The collective's role, ``None`` for an op that is no collective (wait_tensor included); asked
    once per record by compare's data flow, so each op name's answer is kept."""
    key = op_key(op)
    if key.startswith("_c10d_functional_autograd."):
        key = "_c10d_functional." + key.partition(".")[2]
    if key in NOT_COLLECTIVES:
        return None
    return ROLES.get(key) or (Role("other", None, None) if key.split(".")[0] in NAMESPACES else None)


def brings_values(op: str) -> bool:
    """Whether ``op`` is a collective whose result holds values other ranks gave (all-reduce,
    all-gather, reduce-scatter, broadcast, all-to-all, scatter, receive): where its result differs
    while what this rank gave agrees, the difference came from another rank, not from this rank's
    kernels."""
    r = role(op)
    return r is not None and r.result is not None


NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
# reduce ops that add the ranks' values up, as joining the partial results of a split computation does
SUMMING = frozenset({"SUM", "AVG", "PREMUL_SUM"})


def may_join_partial_results(reduce_op: str | None, sizes: list) -> bool:
    """Whether a reduction by ``reduce_op`` of given values of ``sizes`` elements each can be tensor
    parallelism summing the partial results of one split computation (a row-wise layer's output):
    a sum or average of values of more than one element.  A flag or a number the ranks agree on --
    a loss scaler's found-inf (MAX), a loss averaged for logging, a gradient norm's square summed
    for clipping -- holds one element, and a MAX or MIN adds nothing up: such a collective says
    nothing of how the ranks split the model.  An unknown reduce op or size counts as a sum."""
    if reduce_op is not None and reduce_op not in SUMMING:
        return False
    return not sizes or max(sizes) > 1
