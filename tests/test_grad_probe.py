"""The grad probe (task grad_probe): each parameter's gradient at every optimizer step, as msprobe
defines its levels, and compare of two runs' gradient directions (docs/grad-probe.md)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import dispatchprobe
from dispatchprobe import ConfigError, DispatchProbe
from dispatchprobe.cli import main
from dispatchprobe.core.grad_probe import read_signs
from dispatchprobe.torch.parameters import clean_name, named_gradients, parameter_names

SCRIPT = Path(__file__).with_name("grad_probe_train.py")


def test_named_gradients_reads_the_optimizers_parameters_by_model_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    got = named_gradients(model, opt)
    assert [g.name for g in got] == ["2.weight", "2.bias"]
    assert all(g.source == "grad" and g.placement is None and torch.equal(g.local, g.param.grad) for g in got)
    model[2].weight.main_grad = torch.ones(2, 3)          # a framework's fp32 gradient is read first
    assert named_gradients(model, opt)[0].source == "main_grad"
    assert clean_name("module._orig_mod.layers.0.weight") == "layers.0.weight"
    assert set(parameter_names(model).values()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


# ---- levels against numpy ----------------------------------------------------------------------

def _mlp_run(path, level, bounds=(-1, 0, 1), steps=2, **kw):
    """A ReLU MLP (dead units give exact zeros) with inputs large enough for gradients past +-1;
    returns the gradients each optimizer step applied, as numpy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    with torch.no_grad():
        model[0].bias[:4] = -100.0         # dead units: exact zeros in the gradients
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = DispatchProbe(task="grad_probe", dump_path=str(path), grad_level=level, bounds=list(bounds), model=model,
                          **kw)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        (model(torch.randn(16, 6, generator=gen) * 4) ** 2).sum().backward()
        seen.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    probe.close()
    return seen


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_levels_match_numpy(tmp_path, level):
    bounds = [-1, -0.25, 0, 0.5, 1]
    seen = _mlp_run(tmp_path / level, level, bounds)
    run = dispatchprobe.load(tmp_path / level)
    assert run.manifest["config"]["grad_probe"]["grad_level"] == level
    assert sorted(run.parts) == [(0, 0), (1, 0)]
    saw_zero = saw_big = False
    for step, grads in enumerate(seen):
        part = run.part(step, 0)
        recs = {r["param"]: r for r in part.grads}
        assert list(recs) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        for name, g in grads.items():
            r = recs[name]
            assert r["shape"] == list(g.shape) and r["numel"] == g.size and r["dtype"] == "float32"
            assert r["stats"]["max"] == float(g.max()) and r["stats"]["min"] == float(g.min())
            assert r["stats"]["norm"] == pytest.approx(np.linalg.norm(g.astype(np.float64)), rel=1e-6)
            assert ("checksum" in r) == (level == "L0") and ("sign" in r) == (level != "L0") and "md5" not in r
            assert ("distribution" in r) == (level == "L2")
            if level == "L0":
                assert r["checksum"] == {"kind": "wsum64", "value": _weighted_sums(g.tobytes())}
            else:
                assert np.array_equal(read_signs(part, r), g > 0)
                assert part.tensor(r["sign"]).dtype == np.uint8 and part.tensor(r["sign"]).size == -(-g.size // 8)
            if level == "L2":
                d = r["distribution"]
                edges = [-np.inf] + bounds + [np.inf]
                want = [float(((g > lo) & (g <= hi)).mean()) for lo, hi in zip(edges, edges[1:])]
                assert d["shares"] == pytest.approx(want, abs=1e-12) and d["bounds"] == bounds
                assert d["intervals"] == ["(-inf, -1]", "(-1, -0.25]", "(-0.25, 0]", "(0, 0.5]", "(0.5, 1]",
                                          "(1, inf)"]
                assert d["zero"] == pytest.approx(float((g == 0).mean()), abs=1e-12)
                saw_zero |= d["zero"] > 0
                saw_big |= d["shares"][0] + d["shares"][-1] > 0
    if level == "L2":
        assert saw_zero and saw_big        # the data exercises the zero share and the outer intervals
    table = run.grads
    assert len(table) == 8 and list(table["param"][:4]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert table["norm"].iloc[0] == run.part(0, 0).grads[0]["stats"]["norm"]


def _weighted_sums(data: bytes) -> str:
    """The L0 checksum by its definition, in Python integers: little-endian 64-bit words w_i (the last
    zero-padded), sum(w_i) and sum((i + 1) * w_i) modulo 2**64."""
    data += bytes(-len(data) % 8)
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
    return f"{sum(words) % 2 ** 64:016x}{sum((i + 1) * w for i, w in enumerate(words)) % 2 ** 64:016x}"


def test_l0_checksum_is_computed_where_the_gradient_is_and_md5_only_when_asked(tmp_path):
    from dispatchprobe.core.grad_probe import checksum_hex, checksum_of
    from dispatchprobe.torch.grad_probe import checksum_on_device
    gen = torch.Generator().manual_seed(0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for n in (1, 3, 8191, 8195, 40_000):       # tails of every length; several rows of words
            t = torch.randn(n, generator=gen).to(dtype)
            want = _weighted_sums(t.view(torch.uint8).numpy().tobytes())
            assert checksum_of(t.view(torch.uint8).numpy()) == want, (dtype, n)
            for device in devices:               # the torch formula on the gradient's device: the same digits
                got = checksum_on_device(t.to(device)).cpu()
                assert checksum_hex(*(int(v) for v in got)) == want, (dtype, n, device)
    shard = torch.randn(3, 1001, generator=gen)[:, 1:]      # not contiguous, not 8-byte aligned
    assert checksum_hex(*(int(v) for v in checksum_on_device(shard))) == _weighted_sums(
        shard.contiguous().numpy().tobytes())
    x = torch.randn(100_000, generator=gen)
    swapped, flipped = x.clone(), x.clone()
    swapped[[10, 70_000]] = swapped[[70_000, 10]]
    flipped.view(torch.int32)[5] ^= 1              # the lowest bit of one element
    sums = {checksum_of(v.numpy()) for v in (x, swapped, flipped)}
    assert len(sums) == 3                          # reordered or one bit changed: another checksum

    seen = _mlp_run(tmp_path / "md5", "L0", checksum=True)     # msprobe's MD5 column, when asked for
    for step, grads in enumerate(seen):
        for r in dispatchprobe.load(tmp_path / "md5").part(step, 0).grads:
            assert "checksum" not in r
            assert r["md5"] == hashlib.md5(grads[r["param"]].astype(np.float32).tobytes()).hexdigest()


class _Planted(torch.nn.Module):
    """Parameters whose gradient is a tensor the test plants: the loss ``sum(p * w)`` has gradient ``w``."""

    def __init__(self, grads: dict):
        super().__init__()
        self.grads = grads
        self.ps = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.zeros(v.shape, dtype=v.dtype)) for k, v in
                                          grads.items()})

    def loss(self):
        return sum((p * self.grads[k]).sum() for k, p in self.ps.items())


def _planted_grads() -> dict:
    """Gradients around the one-pass kernel's edges: sizes past a vector, a block (1024) and a chunk
    (32768), not whole 64-bit words; values equal to the bounds (0.1 is not a float32: numpy
    compares in float32), -0.0, exact zeros, inf and nan (those measured by numpy); bfloat16,
    float16, float64, and a gradient that is not contiguous."""
    gen = torch.Generator().manual_seed(3)
    out = {}
    for n in (1, 7, 17, 1023, 1025, 32768 + 5, 3 * 32768 + 1029):
        for dtype in (torch.float32, torch.bfloat16):
            g = (torch.randn(n, generator=gen) * 0.2).to(dtype)
            g[::5] = 0
            g[1::7] = 0.1
            g[2::11] = -0.0
            g[3::13] = -0.25
            out[f"n{n}_{str(dtype)[6:]}"] = g
    out["nan"] = torch.randn(2000, generator=gen)
    out["nan"][[3, 1500]] = float("nan")
    out["inf"] = torch.randn(2000, generator=gen)
    out["inf"][7] = float("-inf")
    out["huge"] = torch.randn(100, generator=gen) * 1e30        # float32 squares overflow
    out["f16"] = torch.randn(301, generator=gen).half()
    out["f64"] = torch.randn(301, generator=gen).double()
    out["strided"] = torch.randn(30, 40, generator=gen).t()
    return out


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_the_one_pass_kernel_writes_the_bytes_numpy_writes(tmp_path, monkeypatch, level):
    """Contiguous float32 and bfloat16 gradients are read once by the native kernel (statistics,
    checksum, signs and counts together); the records and sign bits are byte for byte those of the
    per-measure numpy path."""
    from dispatchprobe.torch import fused_stats
    assert fused_stats.build_native() is None, f"the native library did not build: {fused_stats.error}"
    grads = _planted_grads()

    def run(path, one_pass):
        model = _Planted(grads)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        probe = DispatchProbe(task="grad_probe", dump_path=str(path), grad_level=level, bounds=[-0.25, 0, 0.1, 0.5],
                              model=model)
        handed = []
        with monkeypatch.context() as m:
            if one_pass:
                kernel = fused_stats.grad_rows
                m.setattr(fused_stats, "grad_rows", lambda ts, *a: handed.extend(ts) or kernel(ts, *a))
            else:
                m.setattr(fused_stats, "grad_rows", None)
            model.loss().backward()
            model.ps["strided"].grad = grads["strided"]      # as it was planted: not contiguous
            opt.step()
        probe.close()
        return handed

    handed = run(tmp_path / "one", True)
    run(tmp_path / "numpy", False)
    assert {t.dtype for t in handed} == {torch.float32, torch.bfloat16} and len(handed) == 17   # not f16, f64, strided
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file()
                   and p.name != "manifest.json")
    assert len(files) >= 2
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "numpy" / f).read_bytes(), f
    part = dispatchprobe.load(tmp_path / "one").part(0, 0)
    for r in part.grads:
        g = grads[r["param"].removeprefix("ps.")].float().numpy()
        if level != "L0":
            assert np.array_equal(read_signs(part, r), g > 0), r["param"]
        if level == "L2" and np.isfinite(g).all():
            assert r["distribution"]["shares"][2] == pytest.approx(float(((g > 0) & (g <= np.float32(0.1))).mean()))


def _l0_run(path, nudge_from=None, **kw):
    """Three SGD steps of a small net at L0; from step ``nudge_from`` one bias gradient is nudged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    probe = DispatchProbe(task="grad_probe", dump_path=str(path), grad_level="L0", model=model, **kw)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        model(torch.randn(8, 6, generator=gen)).square().sum().backward()
        if nudge_from is not None and step >= nudge_from:
            model[2].bias.grad[0] += 1e-6
        opt.step()
        opt.zero_grad()
    probe.close()


def test_l0_runs_compare_by_checksum_and_kinds_that_differ_are_not_a_difference(tmp_path):
    for name, kw in (("a", {}), ("b", {}), ("c", {"nudge_from": 1}), ("md5", {"checksum": True})):
        _l0_run(tmp_path / name, **kw)
    res = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "ab")])
    assert res.exit_code == 0, res.output
    assert "12 equal, 0 unequal" in res.output and "agree: every compared gradient has the same bytes" in res.output
    table, verdict = dispatchprobe.compare(tmp_path / "a", tmp_path / "b")
    assert verdict.passed and set(table.loc[table["param"] != "summary", "checksum"]) == {"equal"}

    res = CliRunner().invoke(main, ["compare", str(tmp_path / "c"), str(tmp_path / "a")])
    assert res.exit_code == 2, res.output
    assert "first difference: step 1, parameter 2.bias: its checksums differ" in res.output
    table, verdict = dispatchprobe.compare(tmp_path / "c", tmp_path / "a")
    # step 1 changed only 2.bias; step 2 follows from different parameters: every gradient differs
    unequal = table[table["checksum"] == "unequal"]
    assert list(unequal[unequal["step"] == 1]["param"]) == ["2.bias"] and (table[table["step"] == 0]
                                                                           ["checksum"] != "unequal").all()

    res = CliRunner().invoke(main, ["compare", str(tmp_path / "md5"), str(tmp_path / "a")])
    assert res.exit_code == 1, res.output       # MD5 against the weighted sums: cannot judge, no false mismatch
    assert "run A's checksums are md5, run B's wsum64" in res.output and "unequal" not in res.output


# ---- the tiny transformer: identical runs, a planted sign flip ------------------------------------

def _transformer_run(path, flip_from=None, probe=True, steps=5):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = model.model.layers[0].mlp.up_proj.weight
    step = [0]
    if flip_from is not None:       # from step `flip_from`, 10% of this layer's gradient elements change sign
        flip = torch.rand(target.shape, generator=torch.Generator().manual_seed(7)) < 0.1
        target.register_hook(lambda g: torch.where(flip, -g, g) if step[0] >= flip_from else g)
    p = DispatchProbe(task="grad_probe", dump_path=str(path), grad_level="L2", model=model) if probe else None
    gen = torch.Generator().manual_seed(3)
    for i in range(steps):
        step[0] = i
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    if p is not None:
        p.close()
    return [t.detach().clone() for t in model.parameters()]


def test_transformer_runs_compare_and_a_flipped_layer_is_named(tmp_path):
    probed = _transformer_run(tmp_path / "a")
    _transformer_run(tmp_path / "b")
    plain = _transformer_run(None, probe=False)
    assert all(torch.equal(x, y) for x, y in zip(probed, plain))      # transparent: bit-identical training

    res = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "ab")])
    assert res.exit_code == 0, res.output
    assert "agree" in res.output
    table, verdict = dispatchprobe.compare(tmp_path / "a", tmp_path / "b")
    assert verdict.passed and verdict.steps == [0, 1, 2, 3, 4]
    assert (table["similarity"] == 1.0).all() and table["param"].nunique() == len(probed) + 1   # and "summary"
    assert {"grad_compare.csv", "similarities.csv", "grad_compare.html"} <= set(os.listdir(tmp_path / "ab"))

    _transformer_run(tmp_path / "c", flip_from=2)
    res = CliRunner().invoke(main, ["compare", str(tmp_path / "c"), str(tmp_path / "a"), "-o", str(tmp_path / "ca")])
    assert res.exit_code == 2, res.output
    name = "model.layers.0.mlp.up_proj.weight"
    assert f"first divergence: step 2, parameter {name}" in res.output
    table, verdict = dispatchprobe.compare(tmp_path / "c", tmp_path / "a")
    assert (verdict.first["step"], verdict.first["param"]) == (2, name)
    row = table[(table["step"] == 2) & (table["param"] == name)].iloc[0]
    assert 0.85 < row["similarity"] < 0.95
    early = table[(table["step"] < 2)]
    assert (early["similarity"] == 1.0).all()
    page = (tmp_path / "ca" / "grad_compare.html").read_text()
    assert name in page and 'class="s flag"' in page

    shown = CliRunner().invoke(main, ["show", str(tmp_path / "a")])
    assert shown.exit_code == 0, shown.output
    assert "grad_level L2" in shown.output and "global norm" in shown.output and "zero share" in shown.output


# ---- config, steps and selection -------------------------------------------------------------------

@pytest.mark.parametrize("bad, says", [
    ({"grad_level": "L3"}, "grad_level='L3' is not allowed"),
    ({"bounds": [1, 0]}, "strictly ascending"),
    ({"bounds": ["a"]}, "numbers"),
    ({"bounds": []}, "non-empty"),
    ({"bounds": [2 ** 64]}, "int64"),
    ({"param_list": ["layers.("]}, "not a valid regex"),
    ({"param_list": "x", "grad_level": 1}, "grad_level=1"),
])
def test_bad_values_fail_at_construction_in_one_line(tmp_path, bad, says):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as exc:
        DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "g"), model=model, **bad)
    assert says in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "g").exists()


def test_needs_a_model_and_reads_msprobes_config_json(tmp_path):
    with pytest.raises(ConfigError, match="needs model="):
        DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "g"))
    cfg = {"task": "grad_probe", "dump_path": str(tmp_path / "g"), "rank": [], "step": ["0-2"],
           "grad_probe": {"grad_level": "L2", "param_list": ["weight"], "bounds": [-10, 0, 10]},
           "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probe = DispatchProbe(str(tmp_path / "config.json"), model=torch.nn.Linear(2, 2))
    g = probe.config.grad_probe
    assert (g.grad_level, g.param_list, g.bounds, probe.config.step) == ("L2", ["weight"], [-10, 0, 10], [0, 1, 2])
    with pytest.warns(RuntimeWarning, match="selected none of the 0 step"):
        probe.close()


def test_msprobes_summary_mode_md5_asks_for_the_md5(tmp_path):
    cfg = {"task": "grad_probe", "dump_path": str(tmp_path / "g"),
           "grad_probe": {"grad_level": "L0", "summary_mode": "md5"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert DispatchProbe(str(tmp_path / "config.json"), model=torch.nn.Linear(2, 2)).config.checksum
    cfg["grad_probe"]["summary_mode"] = "statistics"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert not DispatchProbe(str(tmp_path / "config.json"), model=torch.nn.Linear(2, 2)).config.checksum
    assert DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "h"), summary_mode="md5",
                         model=torch.nn.Linear(2, 2)).config.checksum


def test_steps_follow_the_optimizer_and_params_are_selected(tmp_path):
    # steps 1 and 3 of 4; param_list: a dotted prefix and a regex over whole names
    _mlp_run(tmp_path / "sel", "L1", steps=4, step=[1, 3], param_list=["0", r".*\.bias"])
    run = dispatchprobe.load(tmp_path / "sel")
    assert sorted(run.parts) == [(1, 0), (3, 0)]
    assert [r["param"] for r in run.part(1, 0).grads] == ["0.weight", "0.bias", "2.bias"]
    with pytest.warns(RuntimeWarning, match="selected no parameter"):
        _mlp_run(tmp_path / "none", "L0", param_list=["layers"])


def test_probe_step_and_two_optimizers(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.Adam(model[1].parameters(), lr=0.1)]
    other = torch.nn.Linear(2, 2)       # another model's optimizer, stepping first: not this probe's
    probe = DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "two"), model=model)
    for _ in range(3):               # two optimizers, one step each: one step
        model(torch.randn(2, 3)).sum().backward()
        other(torch.randn(1, 2)).sum().backward()
        for o in [torch.optim.SGD(other.parameters(), lr=0.1)] + opts:
            o.step()
            o.zero_grad()
    probe.close()
    run = dispatchprobe.load(tmp_path / "two")
    assert sorted(run.parts) == [(0, 0), (1, 0), (2, 0)]
    assert [r["param"] for r in run.part(2, 0).grads] == ["0.weight", "0.bias", "1.weight", "1.bias"]

    probe = DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "manual"), model=model)
    for _ in range(3):               # probe.step() after the optimizer's step: one step, not two
        model(torch.randn(2, 3)).sum().backward()
        opts[0].step()
        opts[0].zero_grad()
        probe.step()
    probe.close()
    run = dispatchprobe.load(tmp_path / "manual")
    assert sorted(run.parts) == [(0, 0), (1, 0), (2, 0)]
    assert [r["param"] for r in run.part(1, 0).grads] == ["0.weight", "0.bias"]
    with pytest.raises(ConfigError, match="already holds records"):
        DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "manual"), model=model).step()


# ---- DDP, FSDP2, tensor parallel on 2 gloo ranks --------------------------------------------------

def _norms(path) -> dict:
    run = dispatchprobe.load(path)
    return {(s, r["param"]): r["stats"] for (s, _), part in run.parts.items() for r in part.grads}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsingle")
    subprocess.run([sys.executable, str(SCRIPT), "single", str(out)], check=True, timeout=300)
    return out / "single"


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("kind", ["ddp", "fsdp", "tp"])
def test_distributed_runs_record_the_whole_gradient(tmp_path, single_run, kind):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), kind, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"result-{kind}{rank}.json").read_text()) == {"identical": True}
    want, got = _norms(single_run), _norms(tmp_path / kind)
    assert set(got) == set(want)
    for key, st in want.items():          # every rank's record: the whole gradient's statistics
        for name in ("norm", "max", "min"):
            assert got[key][name] == pytest.approx(st[name], rel=1e-5, abs=1e-7), (kind, key, name)
    run = dispatchprobe.load(tmp_path / kind)
    up = next(r for r in run.part(0, 1).grads if r["param"] == "up.weight")
    if kind == "ddp":
        assert "dtensor" not in up
    else:                                 # sharded on dim 0: rank 1 holds rows 8..15
        assert up["dtensor"]["placements"] == ["Shard(dim=0)"] and up["dtensor"]["offset"] == [8, 0]
        assert up["dtensor"]["local_shape"] == [8, 8] and up["shape"] == [16, 8]
    assert sorted(dispatchprobe.load(tmp_path / f"{kind}-rank1").parts) == [(0, 1), (1, 1), (2, 1)]
    for other in (kind, f"{kind}-rank1"):     # shards placed whole: the same directions as one process
        table, verdict = dispatchprobe.compare(tmp_path / other, single_run)
        assert verdict.passed and not verdict.problems, str(verdict)
        assert (table["similarity"] == 1.0).all()


def test_a_model_sharded_after_the_probe_is_built_is_still_named_and_no_step_is_said(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    probe = DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "late"), model=model)
    model.weight = torch.nn.Parameter(model.weight.detach().clone())     # as fully_shard replaces parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    probe.close()
    assert [r["param"] for r in dispatchprobe.load(tmp_path / "late").part(0, 0).grads] == ["weight", "bias"]
    idle = DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "idle"), model=model)
    with pytest.warns(RuntimeWarning, match="saw no optimizer step"):
        idle.close()


def test_step_files_written_off_the_training_thread_are_all_there_at_close_and_a_failed_write_stops_recording(
        tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    probe = DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "g"), grad_level="L1", model=model)
    (tmp_path / "g" / "step1" / "rank0").mkdir(parents=True)
    (tmp_path / "g" / "step1" / "rank0" / "tensors").write_text("")      # step 1's sign bits cannot be written
    with pytest.warns(RuntimeWarning, match="recording stopped: .*step1/rank0/tensors"):
        for _ in range(4):
            model(torch.randn(8, 6)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        probe.close()
    run = dispatchprobe.load(tmp_path / "g")
    part = run.part(0, 0)
    assert [r["param"] for r in part.grads] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(read_signs(part, r).shape == tuple(r["shape"]) for r in part.grads)
    assert not (tmp_path / "g" / "step1" / "rank0" / "grads.jsonl").exists()     # no record without its bits
    assert not (tmp_path / "g" / "step2").exists() and not (tmp_path / "g" / "step3").exists()

    probe = DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "h"), grad_level="L2", model=model)
    for _ in range(3):
        model(torch.randn(8, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    probe.close()                       # the last step's files are written before close returns
    last = dispatchprobe.load(tmp_path / "h").part(2, 0)
    assert len(last.grads) == 4 and all(read_signs(last, r).size == r["numel"] for r in last.grads)


def _as_shard(run, param: str, rows: int, offset: int) -> None:
    """Rewrite ``run``'s records of ``param`` as a Shard(dim=0) piece of ``rows`` rows at ``offset``
    (the first ``rows`` rows' signs): a run that recorded one rank's shard of it."""
    for path in Path(run).glob("step*/rank0/grads.jsonl"):
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        for r in recs:
            if r["param"] == param:
                r["dtensor"] = {"placements": ["Shard(dim=0)"], "offset": [offset, 0],
                                "local_shape": [rows, *r["shape"][1:]]}
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_a_parameter_no_element_of_which_both_runs_know_is_not_compared_and_the_verdict_says_so(tmp_path, order):
    """Run A holds rows 0..15 of 0.weight, run B rows 16..31: nothing of it is compared.  Its similarity
    is no number (was 0.0, flagged as a divergence), and the verdict counts it as not compared
    instead of saying the runs agree (either order)."""
    for name, offset in (("a", 0), ("b", 16)):
        _mlp_run(tmp_path / name, "L1")
        _as_shard(tmp_path / name, "0.weight", 16, offset)
    first, second = (tmp_path / order[0], tmp_path / order[1])
    table, verdict = dispatchprobe.compare(first, second)
    weight = table[table["param"] == "0.weight"]
    assert weight["similarity"].isna().all() and (weight["flag"] == "").all(), weight
    others = table[~table["param"].isin(["0.weight", "summary"])]
    assert len(others) == 3 * 2 and (others["similarity"] == 1.0).all()
    said = str(verdict)
    assert verdict.passed and verdict.not_compared == ["0.weight"], said
    assert "agree" not in said and "1 parameter(s) not compared" in said, said
    assert "step 0: 0.weight: no element of it is known in both runs" in said, said
    res = CliRunner().invoke(main, ["compare", str(first), str(second)])
    assert "1 parameter(s) not compared" in res.output and "agree" not in res.output, res.output
