"""Two programs that build one value in other ways agree, whichever run is A.

transformers 5 builds the padding mask as ``where(mask, 0, -inf)``, transformers 4.57 as
``where(logical_not(mask'), -inf, 0)``: the same mask values.  compare paired the two
``scalar_tensor`` calls by their order (``0`` against ``-inf``: statistics could not pair infinite
values by value) and failed ``where``'s input rows (the mask against its negation, the branches
swapped) although ``where``'s output agrees: exit 2 and a prime suspect for runs that agree.
A wrong kernel making such a value is still named: its own output row fails.
"""

from __future__ import annotations

import pytest
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import NOT_JUDGED, compare

L, DIM = 8, 16


class PaddedAttention(torch.nn.Module):
    """One attention head whose key padding mask is built as transformers 5 builds it
    (``negated=False``: ``where(keep, 0, -inf)``) or as transformers 4.57 does (``negated=True``:
    ``where(logical_not(keep), -inf, 0)``, the ``-inf`` made first).  ``factor`` scales the
    masked scores after the mask is added (1.0: none; another value: a wrong kernel's output)."""

    def __init__(self, negated: bool, factor: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        self.negated, self.factor = negated, factor

    def mask(self, keep):
        if self.negated:
            lowest = torch.scalar_tensor(float("-inf"))
            dropped = torch.logical_not(keep)
            return torch.where(dropped, lowest, torch.scalar_tensor(0.0))
        return torch.where(keep, torch.scalar_tensor(0.0), torch.scalar_tensor(float("-inf")))

    def forward(self, x, attention_mask):
        keep = attention_mask > 0      # (a recorded op, as transformers' mask helpers run)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / DIM ** 0.5 + self.mask(keep)[:, None, :]
        if self.factor != 1.0:
            scores = scores * self.factor
        return self.out(scores.softmax(-1) @ v)


def _record(path, negated: bool, factor: float = 1.0):
    """One forward and backward (the same weights, batch and padding every run)."""
    model = PaddedAttention(negated, factor)
    x = torch.randn(2, L, DIM, generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, L, dtype=torch.long)
    attention_mask[1, 5:] = 0
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    with probe:
        model(x, attention_mask).square().mean().backward()
    probe.step()
    probe.close()
    return path


def _both_orders(x, y):
    return [compare(x, y), compare(y, x)]


def test_a_mask_built_with_the_other_polarity_agrees_in_both_orders(tmp_path):
    """The two masks' ``where`` agree at its output: no error row, no divergence, in both orders; the
    ``-inf`` and ``0`` constants pair by value, and ``where``'s input rows are not judged, saying why."""
    plain = _record(tmp_path / "plain", negated=False)
    negated = _record(tmp_path / "negated", negated=True)
    for table, v in _both_orders(plain, negated):
        assert v.passed and v.forward is None and v.backward is None, str(v)
        assert v.counts.get("error", 0) == 0, str(v)
        makers = table[table["op_a"] == "aten.scalar_tensor.default"]
        assert len(makers) == 2 and (makers["status"] == "pass").all(), makers[["call_a", "call_b", "status"]]
        where = table[(table["op_a"] == "aten.where.self") & (table["stage"] == "forward")]
        assert (where[where["io"] == "output"]["status"] == "pass").all()
        inputs = where[where["io"] == "input"]
        assert (inputs["status"] == NOT_JUDGED).sum() >= 2, inputs[["arg", "status", "reason"]]
        assert "inputs the programs build otherwise" in str(v).splitlines()[0], str(v)


@pytest.mark.parametrize("factor", [1.01])
def test_a_wrong_kernel_after_the_other_polarity_mask_is_still_named(tmp_path, factor):
    """The same two masks, one run scaling the masked scores (a wrong kernel's output): compare still
    fails and names that ``mul``, present in one run only, never the mask's ops, in both orders."""
    plain = _record(tmp_path / "plain", negated=False)
    planted = _record(tmp_path / "planted", negated=True, factor=factor)
    for _, v in _both_orders(plain, planted):
        assert not v.passed and v.forward is not None, str(v)
        assert v.forward.op == "aten.mul.Tensor", str(v)
        assert v.forward.op not in ("aten.where.self", "aten.scalar_tensor.default", "aten.logical_not.default")
