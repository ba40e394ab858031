"""Offline compare of two runs: align op by op, compute the metrics, name the first divergence.

Runs on numpy + pandas only (docs/architecture.md: the offline side reads only records): this module, ``align``, ``report``, ``reader``
and ``standards`` never import torch.  Every metric, statistic and verdict comes from
``dispatchprobe.standards`` (invariant 2); the metric columns derive from its registry
(invariant 8).  Run A is the run under test ("actual"), run B the benchmark ("expected").

    >>> table, verdict = dispatchprobe.compare("runs/npu", "runs/cpu")
    >>> print(verdict)
"""

from .columns import COLUMNS, TENSOR_METRICS, UNMATCHED_COLUMNS
from .driver import PartResult, compare, compare_parts
from .verdict import Divergence, Result, RunsDoNotAlign, Verdict
from ...standards.verdicts import NOT_JUDGED

__all__ = ["compare", "compare_parts", "Result", "Verdict", "Divergence", "RunsDoNotAlign", "PartResult", "COLUMNS",
           "UNMATCHED_COLUMNS", "TENSOR_METRICS", "NOT_JUDGED"]
