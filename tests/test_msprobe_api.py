"""msprobe's ``PrecisionDebugger`` drop-in: the examples of msprobe's PyTorch guides (data dump 2.1-2.3,
overflow check, free benchmark) run with only the import changed, a small model in place of theirs,
and their records compare clean (``dispatchprobe compare`` exit 0) against the native
``DispatchProbe``'s records of the same loop.

The guides' scripts seed nothing: the test seeds before each run (both runs alike), and closes the
debugger the script leaves open as the process's exit does (one test leaves that to the exit itself).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import ConfigError, ConfigWarning, PrecisionDebugger, load, seed_all
from dispatchprobe.cli import main

MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModuleOP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features=8, out_features=4)
        self.linear_2 = nn.Linear(in_features=4, out_features=2)

    def forward(self, x):
        x1 = self.linear_1(x)
        x2 = self.linear_2(x1)
        r1 = F.relu(x2)
        return r1
'''

# msprobe's config.json as its config introduction shows it
STATISTICS_CONFIG = {"task": "statistics", "dump_path": "./dump_path", "rank": [], "step": [], "level": "L1",
                     "enable_dataloader": False,
                     "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}

# data-dump guide, 2.1: msprobe's example as it is, torch_npu's two lines (an Ascend device) left out
EXAMPLE_2_1 = MODEL.replace("import torch.nn.functional as F", '''import torch.nn.functional as F
from dispatchprobe import PrecisionDebugger''') + '''
if __name__ == "__main__":
    module = ModuleOP()
    # 注册工具
    debugger = PrecisionDebugger('./config.json', model=module)
    debugger.start()
    x = torch.randn(10,8)
    out = module(x)
    loss = out.sum()
    loss.backward()
    debugger.stop()
'''

NATIVE_2_1 = MODEL + '''
from dispatchprobe import DispatchProbe

module = ModuleOP()
probe = DispatchProbe('./config.json', model=module, dump_path='./native')
with probe:
    x = torch.randn(10,8)
    out = module(x)
    loss = out.sum()
    loss.backward()
probe.close()
'''

LOOP = MODEL + '''
model = ModuleOP()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(0)
data_loader = [(torch.randn(10, 8, generator=generator), torch.randn(10, 2, generator=generator)) for _ in range(3)]
'''

# data-dump guide, 2.2 (the guide's "..." filled with a loss and an optimizer step)
EXAMPLE_2_2 = '''
from dispatchprobe import PrecisionDebugger

# 请勿将PrecisionDebugger的初始化流程插入到循环代码中
debugger = PrecisionDebugger(config_path="./config.json", dump_path="./dump_path")
# 模型、损失函数的定义及初始化等操作
''' + LOOP + '''
# 数据集迭代的位置一般为模型训练开始的位置
for data, label in data_loader:
    debugger.start() # 开启数据dump
    # 如下是模型每个step执行的逻辑
    output = model(data)
    loss = F.mse_loss(output, label)
    loss.backward()
    debugger.stop() # 关闭数据dump
    optimizer.step()
    optimizer.zero_grad()
    debugger.step() # 结束一个step的dump
'''

# data-dump guide, 2.3: only the forward between start() and forward_backward_dump_end(), and its backward
EXAMPLE_2_3 = '''
from dispatchprobe import PrecisionDebugger

# 请勿将PrecisionDebugger的初始化流程插入到循环代码中
debugger = PrecisionDebugger(config_path="./config.json", dump_path="./dump_path")

# 模型、损失函数的定义及初始化等操作
''' + LOOP + '''
# 数据集迭代的位置一般为模型训练开始的位置
for data, label in data_loader:
    debugger.start() # 开启数据dump
    # 如下是模型每个step执行的逻辑
    output = model(data)
    debugger.forward_backward_dump_end() # 插入该函数到start函数之后，只dump start函数到该函数之间代码的前反向数据，本函数到stop函数之间的数据则不dump
    loss = F.mse_loss(output, label)
    loss.backward()
    debugger.stop() # 关闭数据dump
    optimizer.step()
    optimizer.zero_grad()
    debugger.step() # 结束一个step的dump
'''


def native_loop(dump_path: str, scope: list | None = None, **keys) -> str:
    """The loop of 2.2/2.3 under the native API (``with probe:`` around forward and backward)."""
    return LOOP + f'''
from dispatchprobe import DispatchProbe
probe = DispatchProbe("./config.json", dump_path={dump_path!r}, scope={scope or []!r}, **{keys!r})
for data, label in data_loader:
    with probe:
        output = model(data)
        loss = F.mse_loss(output, label)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    probe.step()
probe.close()
'''


def run_here(script: str, folder: Path, monkeypatch) -> None:
    """Run a script in this process as ``python script.py`` in ``folder`` would, seeded first,
    and close the debugger it leaves open as the process's exit would."""
    monkeypatch.chdir(folder)
    seed_all(1234)
    try:
        exec(compile(textwrap.dedent(script), str(folder / "train.py"), "exec"), {"__name__": "__main__"})
    finally:
        if PrecisionDebugger._instance is not None:
            PrecisionDebugger._instance.close()


def compare_clean(a: Path, b: Path) -> str:
    res = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(a.parent / f"cmp_{a.name}_{b.name}")])
    assert res.exit_code == 0 and "unmatched" not in res.output, res.output      # every record paired
    return res.output


def records(run: Path, step: int = 0) -> list[dict]:
    return [json.loads(line) for line in (run / f"step{step}" / "rank0" / "ops.jsonl").read_text().splitlines()]


def write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config))


def test_example_2_1_as_a_script_closed_at_exit(tmp_path):
    """2.1 never calls step(): the run is closed when the process exits; level mix records modules too."""
    write_config(tmp_path, {**STATISTICS_CONFIG, "level": "mix"})
    for name, script in (("msprobe.py", EXAMPLE_2_1), ("native.py", NATIVE_2_1)):
        (tmp_path / name).write_text(script)
        seeded = f"from dispatchprobe import seed_all; seed_all(1234); import runpy; runpy.run_path({name!r}, run_name='__main__')"
        proc = subprocess.run([sys.executable, "-c", seeded], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    run = load(tmp_path / "dump_path")
    assert run.manifest["config"]["level"] == "mix"
    ops = records(tmp_path / "dump_path")
    assert {(r["kind"], r["stage"]) for r in ops} >= {("op", "forward"), ("op", "backward"), ("module", "forward")}
    assert (tmp_path / "dump_path" / "step0" / "rank0" / "closed").exists()
    compare_clean(tmp_path / "dump_path", tmp_path / "native")


def test_example_2_2_records_every_step_as_the_native_loop(tmp_path, monkeypatch):
    """Run twice, as msprobe scripts are: the second run replaces the first one's records."""
    write_config(tmp_path, STATISTICS_CONFIG)
    run_here(EXAMPLE_2_2.replace("for data, label in data_loader:", "for data, label in data_loader[:2]:"),
             tmp_path, monkeypatch)
    run_here(EXAMPLE_2_2, tmp_path, monkeypatch)
    run_here(native_loop("./native"), tmp_path, monkeypatch)
    for step in range(3):
        ops = records(tmp_path / "dump_path", step)
        assert {r["stage"] for r in ops} == {"forward", "backward"}
        assert any(r["op"] == "aten.mse_loss.default" for r in ops)
    out = compare_clean(tmp_path / "dump_path", tmp_path / "native")
    assert "steps 0-2" in out


@pytest.mark.parametrize("level", ["L1", "mix"])
def test_example_2_3_records_the_block_and_its_backward_only(tmp_path, monkeypatch, level):
    """forward_backward_dump_end(): the loss after it is not recorded, nor its backward; the
    model's backward is, ops and (level mix) modules.  Natively: the model's scope."""
    write_config(tmp_path, {**STATISTICS_CONFIG, "level": level})
    run_here(EXAMPLE_2_3, tmp_path, monkeypatch)
    run_here(native_loop("./native", scope=["ModuleOP"]), tmp_path, monkeypatch)
    for step in range(3):
        ops = records(tmp_path / "dump_path", step)
        assert not any("mse_loss" in r["op"] for r in ops)
        assert {r["op"] for r in ops if r["stage"] == "backward"} >= {"aten.threshold_backward.default", "aten.mm.default"}
        modules = {r["name"] for r in ops if r["kind"] == "module" and r["stage"] == "backward"}
        assert modules == (set() if level == "L1" else {f"ModuleOP{m}.backward.0" for m in ("", ".linear_1", ".linear_2")})
    compare_clean(tmp_path / "dump_path", tmp_path / "native")


OVERFLOW_CONFIG = {"task": "overflow_check", "dump_path": "./dump_path", "rank": [], "step": [], "level": "L1",
                   "overflow_check": {"overflow_nums": 1, "check_mode": "all"}}

# the overflow guide's example (a network, a cross-entropy loss, backward) under msprobe's
# PrecisionDebugger with task overflow_check; the network overflows float16 in its second layer
OVERFLOW_MODEL = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(8, 16)
        self.linear_2 = nn.Linear(16, 4)
        with torch.no_grad():
            self.linear_2.weight.mul_(3000.0)

    def forward(self, x):
        return self.linear_2(torch.relu(self.linear_1(x * 100)))


model = Net().half()
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
steps = [(torch.randn(4, 8).half(), torch.randint(0, 4, (4,))) for _ in range(3)]
'''

EXAMPLE_OVERFLOW = '''
from dispatchprobe import PrecisionDebugger
''' + OVERFLOW_MODEL + '''
debugger = PrecisionDebugger(config_path="./config.json")
for inputs, labels in steps:
    debugger.start()
    output = model(inputs)
    loss = criterion(output.float(), labels)
    loss.backward()
    debugger.stop()
    optimizer.step()
    optimizer.zero_grad()
    debugger.step()
'''

NATIVE_OVERFLOW = OVERFLOW_MODEL + '''
from dispatchprobe import DispatchProbe
from dispatchprobe.core.overflow import OverflowDetected

probe = DispatchProbe("./config.json", dump_path="./native")
try:
    for inputs, labels in steps:
        with probe:
            output = model(inputs)
            loss = criterion(output.float(), labels)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        probe.step()
except OverflowDetected:
    pass
probe.close()
'''


def test_overflow_example_ends_the_checks_and_trains_on(tmp_path, monkeypatch):
    """msprobe's overflow_nums: the checks end at the Nth overflow and the script runs to its end
    (the native API raises OverflowDetected there); the records are the native run's."""
    write_config(tmp_path, OVERFLOW_CONFIG)
    with pytest.warns(RuntimeWarning, match="overflow_nums reached: the checks end here and training goes on"):
        run_here(EXAMPLE_OVERFLOW, tmp_path, monkeypatch)
    run_here(NATIVE_OVERFLOW, tmp_path, monkeypatch)
    ops = records(tmp_path / "dump_path")
    critical = [r for r in ops if r.get("overflow", {}).get("class") == "critical"]
    assert critical and critical[0]["scope"] == "Net.linear_2", [(r["op"], r.get("overflow")) for r in ops]
    assert not (tmp_path / "dump_path" / "step1").exists()     # no checks after the overflow
    compare_clean(tmp_path / "dump_path", tmp_path / "native")


# the free-benchmark guide's default config.json (3.2) and its script (3.3)
FREE_BENCHMARK_CONFIG = {
    "task": "free_benchmark", "dump_path": "./dump_path", "rank": [], "step": [], "level": "L1",
    "free_benchmark": {"scope": [], "list": [], "fuzz_device": "npu", "pert_mode": "improve_precision",
                       "handler_type": "check", "fuzz_level": "L1", "fuzz_stage": "forward", "if_preheat": False,
                       "preheat_step": 15, "max_sample": 20}}

EXAMPLE_FREE_BENCHMARK = '''
from dispatchprobe import PrecisionDebugger

debugger = PrecisionDebugger(config_path='./config.json')

import torch
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss

model = TinyTransformer().to(torch.bfloat16)     # improve_precision widens 16-bit ops
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(2):
    debugger.start() # 一般在训练循环开头启动工具
    tokens, targets = lm_batch(seed=step)
    loss = lm_loss(model, tokens, targets)
    loss.backward()
    debugger.stop() # 一般在训练循环末尾结束工具
    optimizer.step()
    optimizer.zero_grad()
    debugger.step() # 在训练循环的最后需要重置工具，非循环场景不需要
'''


def test_free_benchmark_example(tmp_path, monkeypatch):
    write_config(tmp_path, FREE_BENCHMARK_CONFIG)
    run_here(EXAMPLE_FREE_BENCHMARK, tmp_path, monkeypatch)
    # natively: the same loop (DispatchProbe has start, stop and step too), closed at its end
    native = EXAMPLE_FREE_BENCHMARK.replace("import PrecisionDebugger", "import DispatchProbe") \
        .replace("PrecisionDebugger(config_path='./config.json')", "DispatchProbe('./config.json', dump_path='./native')") \
        + "\ndebugger.close()\n"
    run_here(native, tmp_path, monkeypatch)
    for step in range(2):
        checks = json.loads((tmp_path / "dump_path" / f"step{step}" / "rank0" / "checks.json").read_text())
        assert checks["task"] == "free_benchmark" and checks["flagged"] > 0, checks
        assert records(tmp_path / "dump_path", step)
    compare_clean(tmp_path / "dump_path", tmp_path / "native")


def test_one_debugger_per_process_callable_on_the_class(tmp_path, monkeypatch):
    """As msprobe's: a second construction returns the first debugger (its arguments ignored,
    in one line), and start/stop/step also work on the class; close() lets a new run begin."""
    monkeypatch.chdir(tmp_path)
    exec(compile(LOOP, "loop.py", "exec"), ns := {})
    debugger = PrecisionDebugger(task="statistics", dump_path="./a", step=[1])
    try:
        with pytest.warns(ConfigWarning, match="one per process"):
            assert PrecisionDebugger(dump_path="./b") is debugger
        for data, label in ns["data_loader"]:
            PrecisionDebugger.start()
            ns["F"].mse_loss(ns["model"](data), label).backward()
            PrecisionDebugger.stop()
            PrecisionDebugger.step()
    finally:
        debugger.close()
    assert sorted(p.name for p in (tmp_path / "a").glob("step*")) == ["step1"]      # step=[1] selects one step
    assert not (tmp_path / "b").exists()
    fresh = PrecisionDebugger(dump_path="./c")
    try:
        assert fresh is not debugger and fresh.config.dump_path == "./c"
    finally:
        fresh.close()
    with pytest.raises(RuntimeError, match="build PrecisionDebugger"):
        PrecisionDebugger.start()


def test_grad_probe_started_by_monitor(tmp_path, monkeypatch):
    """msprobe's grad probe: monitor(model) starts it, start/stop/step do nothing, steps are the
    optimizer's; its records are the native grad probe's."""
    monkeypatch.chdir(tmp_path)
    config = {"task": "grad_probe", "dump_path": "./dump_path", "rank": [], "step": [],
              "grad_probe": {"grad_level": "L1", "param_list": [], "bounds": [-1, 0, 1]}}
    write_config(tmp_path, config)
    msprobe = '''
from dispatchprobe import PrecisionDebugger
debugger = PrecisionDebugger("./config.json")
''' + LOOP + '''
debugger.monitor(model)
for data, label in data_loader:
    debugger.start()
    F.mse_loss(model(data), label).backward()
    debugger.stop()
    optimizer.step()
    optimizer.zero_grad()
    debugger.step()
'''
    run_here(msprobe, tmp_path, monkeypatch)
    run_here(LOOP + '''
from dispatchprobe import DispatchProbe
probe = DispatchProbe("./config.json", dump_path="./native", model=model)
for data, label in data_loader:
    F.mse_loss(model(data), label).backward()
    optimizer.step()
    optimizer.zero_grad()
probe.close()
''', tmp_path, monkeypatch)
    ours, native = (sorted(p.relative_to(tmp_path / run).as_posix() for p in (tmp_path / run).rglob("grads.jsonl"))
                    for run in ("dump_path", "native"))
    assert ours == native == [f"step{i}/rank0/grads.jsonl" for i in range(3)]
    for name in ours:
        assert (tmp_path / "dump_path" / name).read_bytes() == (tmp_path / "native" / name).read_bytes()


def test_arguments_that_cannot_mean_the_same_say_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.warns(ConfigWarning, match="a list of modules"):
        debugger = PrecisionDebugger(dump_path="./a", level="L0", model=[a, b])
    debugger.close()
    with pytest.raises(ConfigError, match="model must be a torch.nn.Module"):
        PrecisionDebugger(dump_path="./a", model="net")
    with pytest.raises(ConfigError, match="grad probe reads one model"):
        PrecisionDebugger(dump_path="./a", task="grad_probe", model=[a, b])
    with pytest.raises(ConfigError, match="task"):
        PrecisionDebugger(dump_path="./a", task="no_such_task")
    assert PrecisionDebugger._instance is None        # a failed construction leaves no debugger


def test_seed_all_rm_dropout_runs_dropouts_with_p_zero(monkeypatch):
    """msprobe's seed_all(seed, mode, rm_dropout): torch's functional dropouts, and the modules
    calling them (made before or after), and scaled_dot_product_attention's dropout_p (transformers'
    attention passes it while training), run with p=0; without it dropout is untouched."""
    functional = torch.nn.functional
    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                 "scaled_dot_product_attention"):
        monkeypatch.setattr(functional, name, getattr(functional, name))     # put back after the test
    q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)
    no_dropout = functional.scaled_dot_product_attention(q, k, v, None, 0.0, True)
    assert not torch.equal(functional.scaled_dot_product_attention(q, k, v, None, 0.5, True), no_dropout)
    x = torch.ones(4, 3, 8)
    made_before = torch.nn.Dropout(0.5)
    seed_all(1234)
    assert not torch.equal(made_before(x), x)
    done = seed_all(1234, mode=False, rm_dropout=True)
    assert done["dropout p=0"].startswith("dropout,dropout1d,dropout2d")
    images = torch.ones(2, 3, 4, 4)
    assert torch.equal(made_before(x), x) and torch.equal(torch.nn.Dropout2d(0.9)(images), images)
    assert torch.equal(functional.dropout(x, p=0.3, training=True), x)
    assert done["dropout p=0"].endswith("scaled_dot_product_attention")
    assert torch.equal(functional.scaled_dot_product_attention(q, k, v, None, 0.5, True), no_dropout)
    assert torch.equal(functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True), no_dropout)
    assert seed_all(1234, rm_dropout=True)["dropout p=0"] == "already"


def test_msprobe_calls_without_an_equivalent_say_so_and_set_init_step_numbers_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dispatchprobe.torch.msprobe_api._SAID", set())
    exec(compile(LOOP, "loop.py", "exec"), ns := {})
    debugger = PrecisionDebugger(dump_path="./a")
    try:
        debugger.set_init_step(5)
        data, label = ns["data_loader"][0]
        with pytest.warns(ConfigWarning, match="token_range"):
            debugger.start(ns["model"], token_range=[0, 10])
        with pytest.warns(ConfigWarning, match=r"save\('act'\) records nothing"):
            debugger.save(data, "act")
        with pytest.warns(ConfigWarning, match="scope"):
            debugger.module_dump(ns["model"].linear_1, "linear_1")
        ns["F"].mse_loss(ns["model"](data), label).backward()
        debugger.module_dump_end()
        with pytest.raises(ConfigError, match="before start"):
            debugger.set_init_step(1)
        debugger.stop()
        debugger.step()
    finally:
        debugger.close()
    assert sorted(p.name for p in (tmp_path / "a").glob("step*")) == ["step5"]


def test_started_in_inference_mode(tmp_path, monkeypatch):
    """An evaluation loop under torch.inference_mode(): its forward is recorded."""
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 2)
    debugger = PrecisionDebugger(dump_path="./eval")
    try:
        with torch.inference_mode():
            debugger.start()
            model(torch.randn(3, 4))
            debugger.forward_backward_dump_end()
            debugger.stop()
            debugger.step()
    finally:
        debugger.close()
    assert [r["op"] for r in records(tmp_path / "eval")] == ["aten.randn.default", "aten.linear.default"]
