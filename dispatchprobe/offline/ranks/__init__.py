"""``dispatchprobe ranks``: the ranks of one distributed run checked against each other --
collectives against their semantics, replicas for drift, inf/nan to the rank where they started
(docs/distributed.md).  Reads records only (numpy, pandas)."""

from .driver import COLUMNS, RanksVerdict, StepResult, check_parts, check_run, check_step, merge

__all__ = ["COLUMNS", "RanksVerdict", "StepResult", "check_parts", "check_run", "check_step", "merge"]
