"""Tensors that show their memory conjugated or negated (torch's lazy conj and neg bits: ``x.conj()``,
``x.conj().imag``) hold the same bytes as their base but other values.  The recorder must save and
measure each as the values the op read, never as the base's copy: ``torch.fft.hfft2``'s c2r input
was saved as the unconjugated c2c output, and run-ut called its right output an error."""

from __future__ import annotations

import pytest
import torch

from dispatchprobe import DispatchProbe, load
from dispatchprobe.offline.run_ut import run_ut
from dispatchprobe.torch.replay import TensorSource


def views(x):
    """The base and its two lazy views, each read by one ``mul``."""
    return {"base": x, "conj": x.conj(), "neg": x.conj().imag}


@pytest.mark.parametrize("order", [("base", "conj", "neg"), ("neg", "conj", "base")])
def test_saved_inputs_are_the_values_read(tmp_path, order):
    x = torch.randn(4, 6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    read = views(x)
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "run")) as probe:
        for name in order:
            torch.mul(read[name], 1)
        probe.step()
    part = load(str(tmp_path / "run")).parts[(0, 0)]
    source = TensorSource(part)
    muls = [r for r in part.records if r.get("op") == "aten.mul.Tensor"]
    assert len(muls) == len(order)
    for name, rec in zip(order, muls):
        saved = source.get(rec["inputs"][0]["data"])
        assert torch.equal(saved, read[name].resolve_conj().resolve_neg()), name
    stats = muls[order.index("neg")]["inputs"][0]["stats"]      # a real view: its statistics are its values
    shown = read["neg"].resolve_neg()
    assert (stats["max"], stats["min"]) == (float(shown.max()), float(shown.min()))
    assert stats["mean"] == pytest.approx(float(shown.double().mean()), rel=1e-6)


def test_hfft2_is_judged_right(tmp_path):
    x = torch.randn(4, 6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "run")) as probe:
        torch.fft.hfft2(x)
        probe.step()
    r = run_ut(str(tmp_path / "run"), str(tmp_path / "ut")).results
    c2r = r[r["Op"] == "aten._fft_c2r.default"]
    assert list(c2r["Judged"]) == ["replay+recorded"]
    assert list(c2r["Forward Test Success"]) == ["pass"], c2r["Message"].tolist()
