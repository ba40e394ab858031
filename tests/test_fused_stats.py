"""The native CPU statistics (a library of reductions over raw memory) give the records the Python
path gives, bit for bit: one summation order (``statistics.tree_sums``) on every path."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from dispatchprobe.torch import tensor_backend as backend, fused_stats


@pytest.fixture(scope="module")
def kernel():
    assert fused_stats.build_native() is None, f"the native library did not build: {fused_stats.error}"
    return fused_stats.tree_rows


def _same(a: dict, b: dict) -> bool:
    """Records equal bit for bit (nan equal to nan)."""
    return set(a) == set(b) and all(a[k] == b[k] or a[k] != a[k] and b[k] != b[k] for k in a)


def _torch_stats(t, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(fused_stats, "tree_rows", None)
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
    for name in ("tree_rows", "rows_into", "_native", "error"):
        monkeypatch.setattr(fused_stats, name, None)
    monkeypatch.setattr(fused_stats, "_loaded", False)
    reason = fused_stats.build_native()
    assert reason and "no-such-compiler" in reason and fused_stats.tree_rows is None
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
    monkeypatch.setattr(fused_stats, "tree_rows", lambda ts, k=fused_stats.tree_rows: handed.extend(ts) or k(ts))
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
    assert fused_stats.tree_rows([x])[0] == fused_stats.DECLINED
    handed = []
    monkeypatch.setattr(fused_stats, "tree_rows", lambda ts, k=fused_stats.tree_rows: handed.extend(ts) or k(ts))
    fused, reference, exact = backend._cpu_stats(x), _torch_stats(x, monkeypatch), x.double()
    assert [t.is_contiguous() for t in handed] == [False, True]      # declined, then the copy
    handed.clear()
    assert backend.tensor_stats([x])[0] == fused
    assert [t.is_contiguous() for t in handed] == [False, True]
    assert _same(fused, reference)
    assert fused["mean"] == pytest.approx(exact.mean().item(), rel=1e-6, abs=1e-7)
    assert fused["norm"] == pytest.approx(torch.linalg.vector_norm(exact).item(), rel=1e-6)
    assert backend.tensor_stats([x])[0] == fused


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


def test_a_window_leaves_values_past_their_storages_end(kernel):
    """A window reads a value only where its every element lies in its storage's bytes, judged
    from its storage offset, sizes and strides (contiguous or not): a storage shrunk under a view
    leaves the views that reach past its end to the Python path."""
    from dispatchprobe.standards import statistics
    base = torch.randn(16, 8)
    views = [base[2:4], base[10:12], base[2:4].t(), base[10:12].t(), base[9:11, 1:3]]
    base.untyped_storage().resize_(10 * 8 * 4)        # the first 10 rows stay
    rows, left = fused_stats.window_row_lists(views, statistics.nonfinite_row)
    assert left == [1, 3, 4]
    for i in (0, 2):
        assert rows[i] == pytest.approx(statistics.to_row(backend.tensor_stats([views[i]])[0], 16), rel=0, abs=0)
    assert [r is None for r in rows] == [False, True, False, True, True]


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
    """Two identical runs in fresh processes, one with the native statistics and one on the
    Python path, a second run with the native statistics, and a run where the compiler is broken
    (``CXX=false``: ``build-native`` fails in one line, the probe says in one line that it uses
    torch's operations): every record file is the same, byte for byte, from the first op (bf16
    autocast, and values holding inf and nan, included)."""
    import subprocess
    import sys
    broken = {"CXX": "false", "DISPATCHPROBE_NATIVE_DIR": str(tmp_path / "broken-cache")}
    built = subprocess.run([sys.executable, "-m", "dispatchprobe", "build-native"], env={**os.environ, **broken},
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 1 and len(built.stderr.splitlines()) == 1 and "false" in built.stderr, built.stderr
    runs, said = {}, {}
    for name, env in (("native", {}), ("python", {"DISPATCHPROBE_FUSED_STATS": "0"}), ("again", {}),
                      ("broken", broken)):
        done = subprocess.run([sys.executable, "-c", _TRAIN, str(tmp_path / name)], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = _record_bytes(tmp_path / name)
        said[name] = [line for line in done.stderr.splitlines() if line.startswith("dispatchprobe:")]
    assert len(runs["native"]) >= 4 and sum(len(b) for b in runs["native"].values()) > 100_000
    assert runs["native"] == runs["python"] == runs["again"] == runs["broken"]
    assert said["native"] == said["python"] == said["again"] == []
    assert len(said["broken"]) == 1 and "build failed" in said["broken"][0], said["broken"]
    written = b"".join(runs["native"].values())
    assert b'"Infinity"' not in written and b"Infinity" in written and b"e-07" in written   # json.dumps' format


_NUMBERS_ONLY = """
import ctypes, sys
import numpy as np
from dispatchprobe.standards import statistics
lib = ctypes.CDLL(sys.argv[1])
lib.dp_tree_stats.argtypes = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)
rng = np.random.default_rng(0)
x = (rng.standard_normal((300, 257)) * 1e3).astype(np.float32)
ids = rng.integers(-1000, 1000, (40, 30))
views = [(x, 0), (x[:, 5:200], 0), (x.T, 0), (ids, 2), (ids.T[::2], 2)]
desc, out = [], np.zeros(11 * len(views))
for v, code in views:
    desc += [v.ctypes.data, code, v.ndim, *v.shape, *(s // v.itemsize for s in v.strides)]
desc = np.array(desc, dtype=np.int64)
lib.dp_tree_stats(len(views), desc.ctypes.data, out.ctypes.data)
for k, (v, code) in enumerate(views):
    row = out[11 * k:11 * k + 11]
    flat = np.array(sorted(zip(v.strides, v.shape), reverse=True))   # memory order (no expands here)
    seq = np.lib.stride_tricks.as_strided(v, flat[:, 1], flat[:, 0]).reshape(-1)
    total, squares = statistics.sums(seq, np) if code == 0 else (float(seq.sum()), float((seq * seq).sum()))
    assert list(row[:5]) == [1, seq.max(), seq.min(), total, squares], (k, list(row[:5]), total, squares)
print("torch" in sys.modules)
"""


def test_the_library_is_numbers_only(kernel):
    """The native library needs neither torch nor Python objects: a process that never imports
    torch loads it with ctypes, hands it numpy memory (contiguous, sliced, transposed float32;
    integers) and gets the sums ``statistics.tree_sums`` defines, bit for bit (integers: exact)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _NUMBERS_ONLY, str(fused_stats.library_path())], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"]


def test_the_build_is_named_by_source_compiler_and_platform(monkeypatch):
    """No torch headers: another torch finds the same build; another compiler makes its own."""
    path = fused_stats.library_path()
    monkeypatch.setattr(torch, "__version__", "9.99.0")
    assert fused_stats.library_path() == path
    monkeypatch.setenv("CXX", "clang++ -O2")
    assert fused_stats.library_path() != path


def test_a_build_by_another_compiler_is_loaded(kernel, tmp_path, monkeypatch):
    """Built with one compiler (``CXX=...``), used where ``CXX`` names another or none: the probe
    loads the build of this source for this platform."""
    import shutil
    built = fused_stats.library_path()
    monkeypatch.setenv("DISPATCHPROBE_NATIVE_DIR", str(tmp_path))
    shutil.copyfile(built, tmp_path / built.name)
    monkeypatch.setenv("CXX", "clang++ -O2")
    assert not fused_stats.library_path().exists()
    for name in ("tree_rows", "rows_into", "stats4", "_native", "error"):
        monkeypatch.setattr(fused_stats, name, None)
    monkeypatch.setattr(fused_stats, "_loaded", False)
    assert fused_stats.load() is not None and fused_stats.error is None
    x = torch.randn(1000)
    assert backend.tensor_stats([x])[0] == _torch_stats(x, monkeypatch)


def _layouts() -> list:
    """Tensors across the kernel's paths: block and chunk tails, tensors long enough for its
    prefetches ahead, misaligned starts, strided rows, transposes, expands, inf, nan, huge values."""
    g = torch.Generator().manual_seed(7)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 17, 1023, 1024, 1025, 4096 + 33, 5 * 1024, 32768, 40000, 100003, 300000):
            x = (torch.randn(n + 1, generator=g) * 3 + 0.5).to(dtype)
            out += [x[:n], x[1:]]                                   # aligned and one element in
        m = torch.randn(300, 257, generator=g).to(dtype)
        out += [m[:, :200], m.t(), m[:1, :].expand(40, 257), m[5:, 3:]]
        specials = torch.randn(70000, generator=g)
        specials[[5, 40000]] = torch.tensor([math.inf, -math.inf])
        out.append(specials.to(dtype))
        specials = specials.clone()
        specials[69000] = math.nan
        out += [specials.to(dtype), (torch.randn(9000, generator=g) * 1e30).to(dtype), -torch.zeros(2048, dtype=dtype)]
    return out


def test_every_vector_width_gives_the_same_rows(kernel, tmp_path, monkeypatch):
    """The library built for each vector width this CPU runs (AVX-512, AVX2, the platform's
    baseline) gives the same rows and grad-probe measures, bit for bit (nan equal to nan), and
    the Python path's records: every width sums in the one order."""
    import shutil
    runs = {"avx512": ["avx512", "avx2", "generic"], "avx2": ["avx2", "generic"]}.get(fused_stats._isa(), ["generic"])
    tensors = _layouts()
    grads = [t for t in tensors if t.is_contiguous() and t.dtype in (torch.float32, torch.bfloat16)]
    built = fused_stats.library_path()                  # this CPU's width: built already (kernel)
    shutil.copyfile(built, tmp_path / built.name)
    monkeypatch.setenv("DISPATCHPROBE_NATIVE_DIR", str(tmp_path))
    for name in ("_native", "tree_rows", "rows_into", "row_lists", "stats4", "_grad", "grad_rows", "error", "_loaded"):
        monkeypatch.setattr(fused_stats, name, getattr(fused_stats, name))
    got = {}
    for isa in runs:
        monkeypatch.setattr(fused_stats, "_isa", lambda isa=isa: isa)
        assert fused_stats.build_native() is None, (isa, fused_stats.error)
        rows = list(fused_stats.rows(tensors))
        measured = fused_stats.grad_pass(grads, [-0.5, 0.0, 1.0], checksum=True, signs=True)
        grad = [(list(r), s0, s1, bits.tobytes()) for r, s0, s1, bits in measured]
        got[isa] = (rows, grad)
    assert len(list(tmp_path.glob("*.so"))) == len(runs)
    records = [backend._cpu_stats(t) for t in tensors]       # the last build's records: the Python path's
    assert all(_same(r, _torch_stats(t, monkeypatch)) for r, t in zip(records, tensors))
    def same(a: list, b: list) -> bool:               # nan equal to nan
        return len(a) == len(b) and all(x == y or x != x and y != y for x, y in zip(a, b))
    first, *others = runs
    for isa in others:
        assert same(got[first][0], got[isa][0]), (first, isa)
        for (r, *sums), (q, *other) in zip(got[first][1], got[isa][1]):
            assert same(r, q) and sums == other, (first, isa)


def test_compare_of_all_nan_statistics_warns_nothing():
    """Statistics that are nan on both sides (a record of values holding nan) are compared without
    a numpy warning reaching the user (``-W error`` would make it an exception)."""
    import warnings
    from dispatchprobe.standards import statistics
    nan = math.nan
    side = {"max": [nan, 1.0], "min": [nan, -1.0], "mean": [nan, 0.5], "norm": [nan, 2.0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert statistics.stats_error(side, side).tolist() == [0.0, 0.0]
        other = {**side, "norm": [nan, 3.0]}
        assert statistics.stats_error(side, other).tolist() == [0.0, pytest.approx(1 / 3)]
        statistics.compare_stats_columns(side, other)


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
from dispatchprobe.torch import tensor_backend as backend, device_stats
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
