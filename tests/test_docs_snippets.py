"""Every code block of README.md and docs/*.md runs as written.

Each fenced block has an info string (``python``, ``bash``, ``text``, ``yaml``, ...), and each
``python``/``bash`` block has a marker on the line above it:

- ``<!-- run -->``: run here, in document order, in one temporary folder per document;
- ``<!-- run slow: why -->``: run in that document's slow test (inductor compiles, MindSpore,
  torchrun), also in order, in a folder of its own;
- ``<!-- skip: why -->``: never run (installs packages, times benchmarks, names your own
  script); each is reported as a skip with its reason.

Python blocks run in this process, in one namespace per document, after the PRELUDE below,
which stands in for the user's objects (``model``, ``loader``, ``loss_fn``, ``opt``, ``x``,
``y``, ``steps``; for MindSpore blocks ``net``, ``data``, ``loss_fn``, ``grad_fn``,
``optimizer``).  Bash blocks run line by line in the same folder, with ``dispatchprobe`` on PATH; each
line must exit 0 (``compare``, ``run-ut`` and ``precision-compare`` may also exit 2: the
documented "they differ").  Runs and files a document uses without making them (``runs/npu``, ``ut_npu/``, ...) are
made by :data:`FIXTURES` first, with the same prelude and loop.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / "docs" / "*.md")))
MARK = re.compile(r"^<!--\s*(run slow|run|skip)\s*(?::\s*(.*?))?\s*-->$")
CODE = ("python", "bash")
# commands whose exit code 2 is a documented result (the runs or ops differ), not a failure
JUDGES = re.compile(r"^(dispatchprobe|torchrun .* -m dispatchprobe\.cli) (compare|run-ut|precision-compare) ")

PRELUDE = '''
import torch
import torch.nn.functional as F
from dispatchprobe.models import TinyTransformer, lm_batch
torch.manual_seed(0)
model = TinyTransformer(layers=1)                          # your model
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = [lm_batch(seed=s) for s in range(2)]               # your data: (tokens, targets) batches
x, y = loader[0]
steps = len(loader)
def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
'''

MS_PRELUDE = '''
import mindspore as ms
from mindspore import nn
from dispatchprobe_ms.demo import TinyNet, batch
ms.set_seed(0)
net = TinyNet()                                             # your nn.Cell
def loss_fn(x, y):
    return ((net(x) - y) ** 2).mean()
grad_fn = ms.value_and_grad(loss_fn, None, net.trainable_params())
optimizer = nn.SGD(net.trainable_params(), learning_rate=0.5)
data = [batch(s) for s in range(2)]
x, y = data[0]
'''

# what each document uses without making it: a path -> how the fixture makes it
#   "statistics"/"tensor": the README's loop over PRELUDE's model and loader with that task
#   "run-ut": run-ut's output folder for a tensor run;  "kernels": an importable module of kernels
FIXTURES = {
    "README.md": {"runs/t": "tensor", "runs/b": "statistics", "runs/npu": "statistics", "runs/cpu": "statistics",
                  "ut_npu": "run-ut", "ut_gpu": "run-ut", "my_kernels.py": "kernels"},
    "docs/compare.md": {"runs/npu": "statistics", "runs/cpu": "statistics"},
    "docs/compile.md": {"runs/eager": "statistics"},
    "docs/inline-checks.md": {"runs/fb": "free_benchmark"},
    "docs/mindspore.md": {"runs/torch": "ms-torch", "runs/ms_fp16": "ms-fp16"},
    "docs/online.md": {"runs/t": "tensor"},
    "docs/record-format.md": {"runs/a": "tensor"},
    "docs/run-ut.md": {"runs/a": "tensor", "ut_npu": "run-ut", "ut_gpu": "run-ut", "my_kernels.py": "kernels"},
}

KERNELS = '''"""Your own kernels, registered with torch.library before run-ut replays the records."""
import torch
lib = torch.library.Library("dispatchprobe_docs", "DEF")
lib.define("scale(Tensor x) -> Tensor")
lib.impl("scale", lambda x: x * 2, "CPU")
'''


class Block:
    def __init__(self, doc: str, line: int, info: str, code: str, mark: str | None, why: str | None):
        self.doc, self.line, self.info, self.code, self.mark, self.why = doc, line, info, code, mark, why

    def __repr__(self):
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    lines = (ROOT / doc).read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            m = MARK.match(lines[i - 1].strip()) if i else None
            out.append(Block(doc, i + 1, lines[i][3:].strip(), "\n".join(lines[i + 1:j]) + "\n",
                             m.group(1) if m else None, m.group(2) if m else None))
            i = j + 1
        else:
            i += 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]


def test_every_block_is_marked():
    """No block escapes: each has an info string, each python/bash block says how it is run."""
    unlabelled = [b for b in ALL if not b.info]
    assert not unlabelled, f"blocks without an info string (python, bash, text, yaml): {unlabelled}"
    unmarked = [b for b in ALL if b.info in CODE and b.mark is None]
    assert not unmarked, f"python/bash blocks without <!-- run -->, <!-- run slow: why --> or <!-- skip: why -->: {unmarked}"
    no_reason = [b for b in ALL if b.mark in ("skip", "run slow") and not b.why]
    assert not no_reason, f"skip/slow markers need a reason: {no_reason}"
    stray = [b for b in ALL if b.info not in CODE and b.mark is not None]
    assert not stray, f"markers on blocks that are not python/bash: {stray}"


@pytest.mark.parametrize("block", [b for b in ALL if b.mark == "skip"], ids=repr)
def test_skipped_blocks_say_why(block):
    pytest.skip(f"{block}: {block.why}")


# ---- fixtures: runs made the way the documents make theirs ------------------------------------------
@pytest.fixture(scope="module")
def fixture_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("doc_fixtures")


def _record(path: Path, task: str) -> None:
    from dispatchprobe import DispatchProbe
    ns: dict = {}
    exec(PRELUDE, ns)
    probe = DispatchProbe(task=task, dump_path=str(path))
    for tokens, targets in ns["loader"]:
        with probe:
            loss = ns["loss_fn"](ns["model"](tokens), targets)
            loss.backward()
        ns["opt"].step(); ns["opt"].zero_grad()
        probe.step()
    probe.close()


def _make(kind: str, cache: Path) -> Path:
    target = cache / kind
    if target.exists():
        return target
    if kind in ("statistics", "tensor", "free_benchmark"):
        _record(target, kind)
    elif kind == "run-ut":
        import dispatchprobe
        dispatchprobe.run_ut(str(_make("tensor", cache)), str(target), api="forward$")
    elif kind == "kernels":
        target.write_text(KERNELS)
    elif kind in ("ms-torch", "ms-fp16"):     # the MindSpore demo net's PyTorch twin, or its float16 run
        if kind == "ms-torch":                 # MS_PRELUDE's net, weights and first batch, in PyTorch
            import mindspore as ms
            from dispatchprobe_ms.demo import TinyNet
            from tests.test_mindspore import record_torch, torch_twin
            ms.set_seed(0)
            record_torch(torch_twin(TinyNet()), target)
        else:
            import mindspore as ms
            from dispatchprobe_ms import DispatchProbe
            from dispatchprobe_ms.demo import train
            train(DispatchProbe(task="statistics", dump_path=str(target)), steps=1, dtype=ms.float16)
    else:
        raise AssertionError(kind)
    return target


def _place(doc: str, folder: Path, cache: Path) -> None:
    for name, kind in FIXTURES.get(doc, {}).items():
        src = _make(kind, cache)
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, folder / name)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- running the blocks ---------------------------------------------------------------------------------
def _run(doc: str, marks: tuple, folder: Path, cache: Path, monkeypatch) -> int:
    todo = [b for b in blocks(doc) if b.mark in marks]
    if not todo:
        return 0
    _place(doc, folder, cache)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))         # --import my_kernels, as from the user's folder
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               OMP_NUM_THREADS="1", PET_MASTER_PORT=str(_free_port()))   # torchrun's --master_port
    ns: dict = {"__name__": "__doc__"}
    exec(PRELUDE, ns)
    for b in todo:
        if b.info == "python":
            if "dispatchprobe_ms" in b.code and "net" not in ns:
                exec(MS_PRELUDE, ns)
            try:
                exec(compile(b.code, f"{b}", "exec"), ns)
            except Exception as exc:
                raise AssertionError(f"{b} failed: {type(exc).__name__}: {exc}\n{b.code}") from exc
        else:
            for line in b.code.splitlines():
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                done = subprocess.run(["bash", "-e", "-c", line], cwd=folder, env=env, capture_output=True,
                                      text=True, timeout=240)
                ok = (0, 2) if JUDGES.match(line) else (0,)
                assert done.returncode in ok, (f"{b}: exit {done.returncode}: {line}\n{done.stdout[-1500:]}\n"
                                               f"{done.stderr[-3000:]}")
    return len(todo)


def _docs(mark: str) -> list:
    """The documents with blocks of this mark; those that import MindSpore carry the ``mindspore``
    mark (they run in the MindSpore environment: ci/matrix.py)."""
    return [pytest.param(d, marks=pytest.mark.mindspore) if any(b.mark == mark and _uses_mindspore(b.code)
                                                                for b in blocks(d)) else d
            for d in DOCS if any(b.mark == mark for b in blocks(d))]


def _uses_mindspore(code: str) -> bool:
    """A block needs MindSpore when it names it or its adapter (``dispatchprobe_ms``: run with
    the MindSpore prelude's net)."""
    return "mindspore" in code.lower() or "dispatchprobe_ms" in code


@pytest.mark.parametrize("doc", _docs("run"))
def test_doc_blocks_run(doc, tmp_path, fixture_cache, monkeypatch):
    _run(doc, ("run",), tmp_path, fixture_cache, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("doc", _docs("run slow"))
def test_doc_slow_blocks_run(doc, tmp_path, fixture_cache, monkeypatch):
    assert _run(doc, ("run slow",), tmp_path, fixture_cache, monkeypatch)
