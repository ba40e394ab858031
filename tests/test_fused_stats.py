"""The one-pass CPU statistics kernel gives the records the Python path gives, bit for bit: one
summation order (``statistics.tree_sums``) on every path."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from dispatchprobe.torch import backend, fused_stats


@pytest.fixture(scope="module")
def kernel():
    assert fused_stats.build_native() is None, f"the kernel did not build: {fused_stats.error}"
    return fused_stats.stats4


def _same(a: dict, b: dict) -> bool:
    """Records equal bit for bit (nan equal to nan)."""
    return set(a) == set(b) and all(a[k] == b[k] or a[k] != a[k] and b[k] != b[k] for k in a)


def _torch_stats(t, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(fused_stats, "stats4", None)
        return backend._cpu_stats(t)


def _values(n, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if kind == "offset":
        return x * 1e-3 + 1e4                 # sums where a float32 accumulator would drift
    if kind == "huge":
        return x * 1e30                       # float32 squares overflow: redone in float64
    if kind == "nan":
        x[n // 2] = math.nan
    if kind == "inf":
        x[0], x[-1] = -math.inf, math.inf
    if kind == "mask":                        # a causal mask: -inf in places, nothing else
        x[::3] = -math.inf
    return x


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 1023, 1024, 1025, 40000, 100003, (1 << 20) + 7])
@pytest.mark.parametrize("kind", ["randn", "offset", "huge", "nan", "inf", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_statistics_equal_torchs(kernel, monkeypatch, n, kind, dtype):
    x = _values(n, kind, seed=n).to(dtype)
    fused, reference = backend._cpu_stats(x), _torch_stats(x, monkeypatch)
    assert _same(fused, reference), (fused, reference)
    if kind in ("nan", "inf", "mask"):
        return
    # sums in float32 lanes added pairwise, blocks in double: within 1e-6 of float64's
    exact = x.double()
    assert fused["mean"] == pytest.approx(exact.mean().item(), rel=1e-6, abs=1e-7 * exact.abs().max().item())
    assert fused["norm"] == pytest.approx(torch.linalg.vector_norm(exact).item(), rel=1e-6)


def test_numpy_and_torch_give_the_same_records():
    """A MindSpore run's statistics (numpy on the host) equal a PyTorch run's of the same values."""
    from dispatchprobe.standards import statistics
    g = torch.Generator().manual_seed(3)
    for n in (1, 100, 5000, 70000):
        for x in (torch.randn(n, generator=g), torch.randn(n, generator=g).to(torch.bfloat16).float() * 1e3):
            assert _same(statistics.record(x.numpy(), np), backend._cpu_stats(x))


def test_fused_statistics_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DISPATCHPROBE_FUSED_STATS", "0")
    assert not fused_stats.enabled()
    monkeypatch.setenv("DISPATCHPROBE_FUSED_STATS", "1")
    assert fused_stats.enabled()


def test_a_failed_build_is_remembered_said_once_and_records_stay_the_same(tmp_path, monkeypatch, capsys):
    """No usable C++ compiler: ``build_native`` returns the reason and remembers it beside the
    build; a probe never builds, says once in one line why it uses the Python path, and that path
    gives the kernel's records."""
    monkeypatch.setenv("DISPATCHPROBE_NATIVE_DIR", str(tmp_path / "native"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    for name in ("stats4", "extremes", "describe", "Encoder", "cache_entry", "rows_into", "error"):
        monkeypatch.setattr(fused_stats, name, None)
    monkeypatch.setattr(fused_stats, "_loaded", False)
    reason = fused_stats.build_native()
    assert reason and fused_stats.stats4 is None
    assert not list((tmp_path / "native").rglob("*.so"))
    assert [p.read_text().strip() for p in (tmp_path / "native").glob("*.failed")] == [reason]
    capsys.readouterr()
    monkeypatch.setattr(fused_stats, "_loaded", False)
    assert fused_stats.load() is None and fused_stats.load() is None
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "build failed" in said[0] and "build-native" in said[0]
    monkeypatch.setenv("DISPATCHPROBE_NATIVE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(fused_stats, "_loaded", False)
    assert fused_stats.load() is None
    assert "not built" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_are_read_in_place_and_agree_with_float64(kernel, monkeypatch, dtype):
    """Slices and transposes of leading dimensions (q/k/v heads, rotary halves) are read where
    they lie, row by row: the same record as torch's reductions over a contiguous copy."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(4, 128, 4, 64, generator=g).to(dtype)
    views = [big.transpose(1, 2), big[..., :32], big[..., :16], big[..., 3:23], big[:, 1:, :, 3:50], big[0, :, 1],
             torch.randn(1, 70).to(dtype).expand(9, 70), torch.randn(5, 3, generator=g).to(dtype)[:, :1]]
    for x in views:
        assert not x.is_contiguous() and x.stride(-1) == 1
        fused, reference = backend._cpu_stats(x), _torch_stats(x, monkeypatch)
        exact = x.double()
        assert _same(fused, reference)
        assert fused["mean"] == pytest.approx(exact.mean().item(), rel=1e-6, abs=1e-7)
        assert fused["norm"] == pytest.approx(torch.linalg.vector_norm(exact).item(), rel=1e-6)
        assert backend.tensor_stats([x])[0] == fused
    with_inf = big.transpose(1, 2).clone().transpose(1, 2)
    with_inf[0, 0, 0, 0] = -math.inf
    view = with_inf[..., :16]
    assert backend._cpu_stats(view) == _torch_stats(view, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanded_permuted_and_column_layouts_are_read_in_place(kernel, monkeypatch, dtype):
    """Layouts whose last dimension is not contiguous are read where they lie too: an expand reads
    each distinct value once and counts it as often as it repeats (RMSNorm's backward expands a
    (4, 128, 1) tensor to (4, 128, 256)), a transposed weight or a permute of dense memory is read
    as its block, and a k-transpose of a q/k/v slice reads rows along its stride-1 dimension.  No
    contiguous copy is made (the kernel is handed the tensor itself), and the records equal torch's
    reductions over a copy; inf and nan are counted once per element of the view."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 16, 3 * 64, generator=g).to(dtype)
    views = [torch.randn(4, 128, 1, generator=g).to(dtype).expand(4, 128, 256),     # stride 0 last
             torch.randn(1, 300, generator=g).to(dtype).expand(7, 300).t(),          # both at once
             torch.randn(256, 128, generator=g).to(dtype).t(),                        # a weight's t()
             torch.randn(4, 128, 4, generator=g).to(dtype).transpose(1, 2),           # permuted block
             qkv[..., 64:128].reshape(2, 16, 4, 16).permute(0, 2, 3, 1),             # k^T of a slice
             torch.randn(5, 1, generator=g).to(dtype).expand(5, 9)[:, 2:7],
             torch.tensor(3.0).to(dtype).expand(6, 4)]                                # one value
    handed = []
    monkeypatch.setattr(fused_stats, "stats4", lambda t, k=fused_stats.stats4: handed.append(t) or k(t))
    for x in views:
        assert x.stride(-1) != 1 or 0 in x.stride()
        handed.clear()
        fused = backend._cpu_stats(x)
        assert len(handed) == 1 and handed[0].data_ptr() == x.data_ptr() and handed[0].stride() == x.stride()
        reference = _torch_stats(x, monkeypatch)
        exact = x.double()
        assert _same(fused, reference)
        assert fused["mean"] == pytest.approx(exact.mean().item(), rel=1e-6, abs=1e-7)
        assert fused["norm"] == pytest.approx(torch.linalg.vector_norm(exact).item(), rel=1e-6)
    base = torch.randn(3, 1, generator=g).to(dtype)
    base[0, 0], base[1, 0] = math.nan, -math.inf
    wide = base.expand(3, 50)
    fused = backend._cpu_stats(wide)
    assert _same(fused, _torch_stats(wide, monkeypatch))
    assert fused["nan"] == 50 and fused["inf"] == 50


def test_layouts_without_a_contiguous_dimension_are_reduced_from_a_copy(kernel, monkeypatch):
    """Every other element of every other row: no dimension of stride 1, so the kernel declines
    (an empty result) and the record comes from a contiguous copy, the same as torch's."""
    x = torch.randn(40, 60, generator=torch.Generator().manual_seed(2))[::2, ::2]
    assert fused_stats.stats4(x) == []
    handed = []
    monkeypatch.setattr(fused_stats, "stats4", lambda t, k=fused_stats.stats4: handed.append(t) or k(t))
    fused, reference, exact = backend._cpu_stats(x), _torch_stats(x, monkeypatch), x.double()
    assert [t.is_contiguous() for t in handed] == [False, True]      # declined, then the copy
    assert _same(fused, reference)
    assert fused["mean"] == pytest.approx(exact.mean().item(), rel=1e-6, abs=1e-7)
    assert fused["norm"] == pytest.approx(torch.linalg.vector_norm(exact).item(), rel=1e-6)
    assert backend.tensor_stats([x])[0] == fused


def _tensors_of_every_kind():
    """Plain tensors the per-op path describes: every dtype in every layout a training step
    makes (contiguous, transposed, sliced, expanded, channels-last, overlapping, conjugate and
    negative views, 0-d, empty), leaves requiring grad, parameters and their views."""
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64,
              torch.int32, torch.int8, torch.uint8, torch.bool]
    layouts = [lambda x: x, lambda x: x.t(), lambda x: x[:, 1:5], lambda x: x[::2], lambda x: x[1],
               lambda x: x.unsqueeze(1).expand(6, 3, 8), lambda x: x[:0], lambda x: x[2, 3],
               lambda x: x.reshape(2, 3, 2, 4).permute(0, 2, 3, 1),
               lambda x: x.reshape(1, 6, 2, 4).contiguous(memory_format=torch.channels_last),
               lambda x: x.flatten().as_strided((3, 3), (1, 1))]
    tensors = []
    for dtype in dtypes:
        base = (torch.randn(6, 8, generator=g) * 10).to(dtype)
        tensors += [layout(base) for layout in layouts]
    complex_base = torch.randn(6, 8, dtype=torch.complex64, generator=g)
    param = torch.nn.Parameter(torch.randn(4, 4, generator=g))
    tensors += [complex_base.conj(), torch.randn(6, 8, generator=g).neg().t(), torch.tensor(2.5),
                torch.randn(3, 4, generator=g).requires_grad_(), param, param.t(), param[1], torch.zeros(0)]
    return tensors


def test_the_cpp_describe_gives_the_python_describe(kernel, monkeypatch):
    """The per-op facts from one C++ call (dtype, shape, stride, device, requires_grad, param,
    the cache keys) equal the Python path's for every tensor; tensors the C++ call declines
    (meta, wrappers) fall back to the Python path whole."""
    assert fused_stats.describe is not None
    tensors = _tensors_of_every_kind()
    assert sum(fused_stats.describe(t) is not None for t in tensors) > 100      # taken by the C++ call
    fast = [backend.describe(t) for t in tensors]
    monkeypatch.setattr(fused_stats, "describe", None)
    slow = [backend.describe(t) for t in tensors]
    for t, a, b in zip(tensors, fast, slow):
        assert a == b, (t.dtype, t.shape, t.stride())
        assert a[1] is None or hash(a[1]) == hash(b[1])
    declined = [torch.empty(3, device="meta"), torch.inference_mode()(lambda: torch.ones(2))(),
                torch.sparse_coo_tensor([[0]], [1.0], (2,)).coalesce()]
    monkeypatch.undo()
    for t in declined:
        assert fused_stats.describe(t) is None
    fast = [backend.describe(t) for t in declined]
    monkeypatch.setattr(fused_stats, "describe", None)
    assert fast == [backend.describe(t) for t in declined]


def test_a_windows_rows_in_one_call_are_the_python_paths(kernel):
    """``rows_into`` (a compiled graph's window of CPU values) gives each value the row the eager
    probe's statistics give it (integers too, exactly; values holding inf or nan, their counts
    and finite max and min), and leaves to the Python path the values it does not read in
    place: finite values whose float32 sums overflow, other dtypes, empty and subclass tensors,
    freed memory."""
    from dispatchprobe.standards import statistics
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g)
    inf = x.clone()
    inf[3, 4] = math.inf
    freed = torch.randn(8, 8)
    freed.untyped_storage().resize_(0)          # FSDP2's parameters between all-gathers
    nan = inf.clone()
    nan[5] = math.nan
    values = [x, x.t(), x[:, ::2], x.to(torch.bfloat16), x[:1].expand(5, 48), torch.nn.Parameter(x.clone()),
              inf, torch.zeros(0), torch.arange(6), x.double(), x.as_subclass(_Sub), freed,
              nan.to(torch.bfloat16), torch.full((3, 3), -math.inf), torch.full((2048,), 3e38)]
    out = torch.full((len(values), 6), -1.0, dtype=torch.float64)
    left = fused_stats.rows_into(values, out, statistics.nonfinite_row)
    assert left == [2, 7, 9, 10, 11, 14]      # [:, ::2]: no dimension of stride 1, read from a copy
    for i, v in enumerate(values):
        if i in left:
            assert out[i].tolist() == [-1.0] * 6      # untouched
            continue
        expected = statistics.to_row(backend.tensor_stats([v])[0], v.numel())
        assert out[i].tolist() == pytest.approx(expected, rel=0, abs=0, nan_ok=True), i
    assert out[12, 4:].tolist() == [48, 1] and out[13, 5] == 9
    with pytest.raises(RuntimeError, match="float64"):
        fused_stats.rows_into(values, torch.empty(len(values), 6), statistics.nonfinite_row)


class _Sub(torch.Tensor):
    pass


_TRAIN = """
import sys, torch, transformers
from dispatchprobe import DispatchProbe
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
model = transformers.LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 64, (2, 12))
probe = DispatchProbe(task="statistics", dump_path=sys.argv[1], model=model)
for step in range(2):
    with probe, torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
        (torch.tensor([1.5e-7, 2.0, 3.0]) / torch.tensor([0.0, 1.0, 1.0])).sum()   # a line holding inf
    opt.step(); opt.zero_grad()
    probe.step()
probe.close()
"""


def _record_bytes(run) -> dict:
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*.jsonl"))}


def test_fresh_runs_on_either_path_write_the_same_bytes(kernel, tmp_path):
    """Two identical runs in fresh processes, one with the C++ kernel and encoder and one on the
    Python path, and a second run with the kernel: every record file is the same, byte for byte,
    from the first op (bf16 autocast, and values holding inf and nan, included)."""
    import subprocess
    import sys
    runs = {}
    for name, env in (("native", {}), ("python", {"DISPATCHPROBE_FUSED_STATS": "0"}), ("again", {})):
        done = subprocess.run([sys.executable, "-c", _TRAIN, str(tmp_path / name)], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = _record_bytes(tmp_path / name)
    assert len(runs["native"]) >= 4 and sum(len(b) for b in runs["native"].values()) > 100_000
    assert runs["native"] == runs["python"] == runs["again"]
    written = b"".join(runs["native"].values())
    assert b'"Infinity"' not in written and b"Infinity" in written and b"e-07" in written   # json.dumps' format


def _device_cases():
    g = torch.Generator().manual_seed(4)
    for n in (1, 100, 1025, 40000):           # one chunk, and two
        for kind in ("randn", "huge", "inf", "nan"):
            yield _values(n, kind, seed=n)
    yield torch.randn(300, 7, generator=g).t()
    yield torch.randn(5, 1, 300, generator=g).expand(5, 3, 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_device_path_gives_the_cpu_record(dtype):
    """An accelerator tensor's statistics (partial rows on its device, combined when read; here
    torch's operations on CPU tensors stand in for the device) are the CPU path's, bit for bit."""
    for x in _device_cases():
        y = x.to(dtype)
        seq, repeat = backend._sequence(y)
        row = backend.torch_stats_row(seq, repeat)
        assert _same(backend.read_stats_rows([row], [y.numel()])[0], backend._cpu_stats(y))


_TRITON_CHECK = """
import torch
from dispatchprobe.torch import backend, device_stats
from tests.test_fused_stats import _device_cases, _same
wrong = []
for x in _device_cases():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        y = x.to(dtype)
        seq, repeat = backend._sequence(y)
        got = backend.read_stats_rows([device_stats.launch(seq, repeat)], [y.numel()])[0]
        if not _same(got, backend._cpu_stats(y)):
            wrong.append((tuple(y.shape), str(dtype)))
print("checked", len(list(_device_cases())) * 4, "wrong", wrong)
"""


def test_the_triton_kernel_gives_the_cpu_record():
    """The Triton kernel, run by Triton's interpreter on the CPU (in a process of its own, which
    reads TRITON_INTERPRET when Triton is imported), gives the CPU record, bit for bit.  Where
    Triton is missing (torch's CPU build) or older than the first release checked (torch 2.5's
    Triton 3.1 does not give it), the kernel is never used: torch's operations give the row."""
    import subprocess
    import sys
    from dispatchprobe.torch import device_stats
    release = device_stats.triton_release()
    if release is None or release < device_stats.MIN_TRITON:
        assert device_stats._kernels() is None
        assert device_stats.row(torch.ones(3), 1) is None
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _TRITON_CHECK], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:2] == ["checked", "72"] and done.stdout.rstrip().endswith("wrong []"), done.stdout
