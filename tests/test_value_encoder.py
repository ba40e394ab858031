"""Records made with the native statistics (``fused_stats``: numbers from raw memory, the record
made and encoded in Python, ``records.writer.json_line``) are the records made with torch's
operations, byte for byte: on PyTorch's OpInfo samples (every dtype, layout and argument kind they
hold), on a transformers Llama trained with AdamW (in-place updates, parameter records), and on the
values the library leaves to torch's operations (other dtypes, subclasses, uninitialised memory,
integers whose sums would not be exact, finite values whose float32 sums overflow)."""

from __future__ import annotations

import gc
import glob
import json
import os

import pytest
import torch
from dispatchprobe import DispatchProbe
from dispatchprobe.torch import tensor_backend as backend, fused_stats


@pytest.fixture(autouse=True, scope="module")
def kernels():
    assert fused_stats.build_native() is None, f"the native library did not build: {fused_stats.error}"


def _lines(path) -> list[bytes]:
    return [line for f in sorted(glob.glob(os.path.join(path, "step*", "rank*", "ops.jsonl")))
            for line in open(f, "rb").read().splitlines()]


def _same_records(tmp_path, monkeypatch, run, **config) -> tuple[list, float]:
    """The records ``run(probe)`` writes with the native statistics, checked equal, byte for byte,
    to those it writes with torch's operations, as parsed JSON (NaN and Infinity kept as their
    spelling), and the share of the tensors measured whose numbers the library gave."""
    read, described = fused_stats.tree_rows, backend._described_records
    out = []
    # how many tensors were handed to the library, and measured: counts only, never the tensors (a
    # reference held would keep autograd from stealing a gradient, and change the ops recorded)
    handed, measured = [0], [0]

    def described_counted(ts, keys):      # the per-op path: read from the facts their description holds
        records = described(ts, keys)
        if records is not None:
            handed[0] += len(ts)
        return records

    def line_counted(keys, line=backend.line_stats):       # records joined from pieces: finite values read natively
        stats = line(keys)
        if stats is not None:
            handed[0] += len(keys)
            measured[0] += len(keys)
        return stats

    def rows_counted(ts):
        handed[0] += len(ts)
        return read(ts)

    def stats_counted(ts, keys=None, measure=backend.tensor_stats):
        measured[0] += len(ts)
        return measure(ts, keys)
    for native in (True, False):
        with monkeypatch.context() as m:
            m.setattr(backend, "tensor_stats", stats_counted)
            if native:
                m.setattr(fused_stats, "tree_rows", rows_counted)
                m.setattr(backend, "_described_records", described_counted)
                m.setattr(backend, "line_stats", line_counted)
            else:
                m.setattr(fused_stats, "tree_rows", None)
            probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / f"native{native}"), **config)
            run(probe)
            probe.close()
        out.append(_lines(tmp_path / f"native{native}"))
        if native:
            taken = handed[0] / max(measured[0], 1)
    assert out[0] == out[1]
    return [json.loads(line, parse_constant=str) for line in out[0]], taken


# ops leaving part of an output unwritten (its bytes differ from run to run)
UNWRITTEN_OUTPUTS = {"nn.functional.ctc_loss", "nn.functional.embedding_bag"}


def _op_db() -> list:
    """PyTorch's OpInfo list.  Importing its module freezes ``torch.backends``' global flags for
    the rest of the process (torch's own test suite wants that); other tests set them: undone."""
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db
    if not frozen:      # the flag lives in the module's namespace, which its functions hold
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return op_db


def _opinfo_samples(dtypes=(torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64)):
    torch.manual_seed(0)
    for info in _op_db()[::3]:
        if info.name in UNWRITTEN_OUTPUTS:
            continue
        for dtype in dtypes:
            if dtype not in info.supported_dtypes("cpu"):
                continue
            try:
                samples = list(info.sample_inputs("cpu", dtype, requires_grad=False))[:2]
            except Exception:       # noqa: BLE001 - a sample generator that needs what this CPU lacks
                continue
            for s in samples:
                yield info, s


def run_opinfo_samples(probe, **which) -> int:
    """Every sample of :func:`_opinfo_samples` (``which``: its arguments) run once under ``probe``,
    one step; made anew for each run (some ops write their inputs).  Returns how many ran."""
    samples = list(_opinfo_samples(**which))
    with probe:
        for info, s in samples:
            try:
                info.op(s.input, *s.args, **s.kwargs)
            except Exception:   # noqa: BLE001 - samples meant to raise; every run sees the same
                pass
    probe.step()
    return len(samples)


def test_opinfo_records_are_the_python_paths(tmp_path, monkeypatch):
    counted = []

    def run(probe):
        counted.append(run_opinfo_samples(probe))

    fast, taken = _same_records(tmp_path, monkeypatch, run)
    assert counted[0] == counted[1] > 500 and len(fast) > 1000
    assert taken > 0.3        # float32, bfloat16, integer and bool samples (complex ones are left to torch)


def train_llama(probe, padded: bool = False) -> None:
    """Two AdamW steps of a tiny transformers Llama under ``probe``, a step per part;
    ``padded``: the second sequence's first three tokens masked out (an attention mask)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 16))
    masked = {}
    if padded:
        mask = masked["attention_mask"] = torch.ones(2, 16, dtype=torch.long)
        mask[1, :3] = 0
    for _ in range(2):
        with probe:
            model(input_ids=ids, labels=ids, **masked).loss.backward()
            opt.step()
            opt.zero_grad()
        probe.step()


def test_training_records_are_the_python_paths(tmp_path, monkeypatch):
    fast, taken = _same_records(tmp_path, monkeypatch, train_llama)
    assert len(fast) > 500 and taken > 0.9


def test_values_it_hands_back(tmp_path, monkeypatch):
    """Non-finite values, empty and expanded tensors, parameters and their views, uninitialised
    memory, a subclass, non-finite floats and framework objects among the arguments; numbers in
    every form a float's shortest digits take, large integers and a module name JSON must escape."""
    class Sub(torch.Tensor):
        pass

    odd = torch.nn.ModuleDict({'na\u00efve "quoted" \\ \t': torch.nn.Linear(3, 2)})
    odd.forward = lambda x: [m(x) for m in odd.values()]

    def run(probe):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, 3))
        x = torch.tensor([1.0, float("inf"), float("nan"), -2.0])
        with probe:
            torch.exp(x)
            torch.add(torch.randn(0, 3), 1.0)
            torch.mul(torch.randn(3).expand(4, 3), p[1:].sum())
            torch.mm(p.t(), torch.randn(4, 2))
            torch.empty(3).add_(1.0)
            torch.clamp(torch.randn(5, dtype=torch.bfloat16), min=-float("inf"), max=0.5)
            torch.ones(2, dtype=torch.float16, device="cpu") * 2
            torch.randn(3).as_subclass(Sub).mul(2.0)
            torch.cat([torch.randn(2), torch.arange(3.0)], dim=0)
            torch.zeros(2, 2, dtype=torch.float64).add_(torch.full((2, 2), 1e300, dtype=torch.float64))
            for number in (1e16, 1e-7, 5e-324, 123456.0, -0.0, 0.1, 2.0 ** 70, 1e22, 2 ** 62):
                torch.full((2,), 3.0).mul(number)
            torch.tensor([1e-30, 3e38, 1.5]).mul(1.0)
            odd(torch.randn(2, 3))
        probe.step()

    fast, taken = _same_records(tmp_path, monkeypatch, run)
    assert len(fast) >= 10 and 0 < taken < 1
    flat = json.dumps(fast)
    assert '"undefined": true' in flat and '"nan": 1' in flat and 'na\\u00efve \\"quoted\\"' in flat


def test_integer_and_bool_values(tmp_path, monkeypatch):
    """Integer and bool tensors (token ids, labels, masks) are measured by the library, in any
    layout (a transpose, a strided slice, an expand), where its double sums are exact (sum of
    squares below 2**53), and left to torch's operations otherwise: the same records."""
    def run(probe):
        torch.manual_seed(0)
        with probe:
            ids = torch.randint(0, 64, (2, 16))
            torch.add(ids, 1)
            ids.t().clone()
            torch.arange(10, dtype=torch.int32).mul(3)
            (torch.randn(4, 4) > 0).logical_not()
            torch.ones(3, dtype=torch.int8).mul(-5)
            torch.ones(3, dtype=torch.uint8).add(200)
            torch.full((2,), 2 ** 26 - 1).add(0)         # squares just below 2**53: exact
            torch.full((2,), 2 ** 40).add(0)             # beyond: the Python path
            torch.arange(10)[::2].add(1)
            torch.arange(3).expand(4, 3).add(1)
            torch.tensor(5).add(1)                       # no dimension
        probe.step()

    fast, taken = _same_records(tmp_path, monkeypatch, run)
    assert len(fast) >= 10 and 0.8 < taken <= 1
    means = [t["stats"]["mean"] for r in fast for t in r["outputs"] if t.get("dtype") in ("int64", "int32", "bool")]
    assert 2 ** 40 in means and 2 ** 26 - 1 in means


def test_values_holding_inf_or_nan(tmp_path, monkeypatch):
    """float32 and bfloat16 values holding inf or nan (a causal mask's -inf, a log of zeros, nan
    only, inf only, both infinities, in strided and expanded layouts, over a chunk of the kernel's
    parallel split) are measured by the library, counts and finite max/min included: the Python
    path's records.  Finite values whose float32 block sums overflow are summed again in float64
    lanes in Python."""
    def run(probe):
        torch.manual_seed(0)
        with probe:
            for dtype in (torch.float32, torch.bfloat16):
                scores = torch.randn(2, 4, 64, 64, dtype=dtype)
                mask = torch.ones(64, 64, dtype=torch.bool).triu(1)
                scores.masked_fill(mask, float("-inf")).softmax(-1)
                torch.zeros(300, 400, dtype=dtype).log()                       # every value -inf
                torch.tensor([1.0, float("nan"), -3.0], dtype=dtype).mul(2)
                torch.tensor([float("inf"), -float("inf"), 2.0], dtype=dtype).add(1)
                torch.full((3,), float("nan"), dtype=dtype).add(0)
                big = torch.randn(70000, dtype=dtype)
                big[12345] = float("inf")
                big.mul(1.5).view(700, 100)[:, 10:60].add(0)
                torch.tensor([float("inf"), 1.0], dtype=dtype).expand(3, 2).add(0)
            torch.full((2048,), 3e38).add(0)                                   # finite, block sums overflow
        probe.step()

    fast, taken = _same_records(tmp_path, monkeypatch, run)
    assert len(fast) >= 20 and 0.9 < taken <= 1
    flat = json.dumps(fast)
    assert '"finite_max"' in flat and '"inf": 120000' in flat and '"nan": 3' in flat


@pytest.mark.parametrize("config", [{"data_mode": ["input"]}, {"data_mode": ["output"]}, {"stack": True}])
def test_configs(tmp_path, monkeypatch, config):
    """Records of inputs only, of outputs only, and with stacks: the same from both paths."""
    def run(probe):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        with probe:
            model(torch.randn(3, 4)).sum().backward()
        probe.step()

    fast, taken = _same_records(tmp_path, monkeypatch, run, **config)
    assert len(fast) > 5 and taken > 0.9
    wanted = {"inputs", "outputs"} if "stack" in config else {"inputs" if config["data_mode"] == ["input"] else "outputs"}
    assert all(wanted <= set(r) and ({"inputs", "outputs"} - wanted).isdisjoint(r) for r in fast)
    if "stack" in config:
        assert any(r["stack"] is not None for r in fast)


@pytest.mark.parametrize("native", [True, False])
def test_cache_is_kept_out_of_the_garbage_collector(tmp_path, monkeypatch, native):
    """The recorder's cache (keys, entries, weak references) can hold no reference cycle, so
    Python's cyclic collector is told not to walk it (its entries and weak references at once; its
    keys, plain tuples of numbers, CPython stops tracking in the first collections that look at
    them), whichever path measured the values; collections would otherwise walk every value a
    step measured, again and again."""
    if not native:
        monkeypatch.setattr(fused_stats, "tree_rows", None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "run"))
    with probe:
        model(torch.randn(5, 8)).sum().backward()
    try:
        cached = list(probe.recorder._cache.items()) + list(probe.recorder._dense.items())
        assert len(cached) > 10
        for key, pair in cached:
            assert not any(gc.is_tracked(o) for o in (pair, *pair)), (key, pair)
        gc.collect()
        gc.collect()            # a key holding a younger tuple (the version) goes at the second
        for key, pair in cached:
            assert not gc.is_tracked(key), key
    finally:
        probe.close()
