"""Parameter records: at each optimizer step, every parameter's gradient as the optimizer applies
it (after DDP's all-reduce or FSDP's reduce-scatter; :func:`.parameters.named_gradients`) and its
value after the step.

They are what two runs of different parallelism both hold (a 1-process run and a 2-rank DDP or
FSDP2 run of one model agree on them, not on each rank's share of the batch), so they are named
by parameter as in the model without wrapper attributes (``up.weight``) and written to the part's
``params.jsonl`` as ordinary records (kind ``param``, op ``param.grad`` / ``param.value``, stage
``optimizer``, scope the parameter's name).  A DTensor (FSDP2, tensor parallel) is recorded as
its local shard with its placement and offset in the whole tensor, which compare gathers offline.
"""

from __future__ import annotations

import torch

from ..core.events import OpEvent
from ..standards import statistics
from .returned_rows import returned_row
from .parameters import clean_name, kept_per_optimizer, named_gradients, parameter_names, placement_of
from .process_state import STATE


_NAMES = STATE.parameter_names      # optimizer -> its parameters' names


def _names(optimizer, roots) -> dict[int, str]:
    """``id(param)`` -> its name: the optimizer's own names (built from ``named_parameters()``),
    else the names in the outermost modules the probe has seen (``roots``)."""
    return kept_per_optimizer(_NAMES, optimizer, roots, _names_of)


def _names_of(optimizer, roots) -> dict[int, str]:
    names: dict[int, str] = {}
    for root in roots:
        for k, v in parameter_names(root).items():
            names.setdefault(k, v)
    for group in optimizer.param_groups:
        for p, name in zip(group["params"], group.get("param_names") or ()):
            names[id(p)] = clean_name(name)
    return names


def record_parameters(session, optimizer, what: str, roots) -> None:
    """Write one ``param.{what}`` record per parameter of ``optimizer`` that has a gradient
    (``what``: ``grad`` before its step, ``value`` after) into the open part."""
    op = f"param.{what}"
    for pg in named_gradients(optimizer=optimizer, names=_names(optimizer, roots)):
        if what == "grad":
            local, placement, shape = pg.local, pg.placement, pg.shape
            row = returned_row(local) if session.recorder.measures_only else None
            if row is not None:         # a compiled backward returned it and read it
                session.recorder.measured_elsewhere(local, statistics.from_row(row, local.numel()))
        else:
            value = pg.param.detach()
            placement = placement_of(value) if pg.dtensor is not None else None
            local, shape = (value.to_local().detach() if placement is not None else value), list(value.shape)
        call = session.next_call(f"{op}:{pg.name}", "optimizer")
        record = session.recorder.encode(OpEvent("param", op, "optimizer", pg.name, call, outputs=local))
        if not record.get("outputs"):       # data_mode input: nothing of it to write
            return
        record["name"] = f"{pg.name}.{what}.{call}"
        record["source"] = pg.source if what == "grad" else "param"
        for key in ("inputs", "kwargs"):
            record.pop(key, None)
        if placement is not None:          # the local shard of a DTensor of this shape
            spec = record["outputs"][0]
            spec["shape"] = shape
            spec["dtensor"] = placement.to_dict()
        session.part.params.append(record)


def roots_of(named) -> list[torch.nn.Module]:
    """The outermost modules among those the probe named (a name without a dot)."""
    return [m for m, name in list(named.items()) if "." not in name]
