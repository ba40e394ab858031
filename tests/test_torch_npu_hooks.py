"""``torch_npu.hooks``' tools (before msprobe) as a drop-in: the quick-start examples of the
precision-compare and overflow guide run with only the import changed (a small model in place of
ResNet-50, this machine's device in place of the NPU), and their records compare clean against the
native ``DispatchProbe``'s records of the same code."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from dispatchprobe import ConfigError
from dispatchprobe.cli import main
from dispatchprobe.core.overflow import OverflowDetected
from dispatchprobe.torch_npu_hooks import RUNS, register_hook, schedule, wrap_checkoverflow_hook


@pytest.fixture(autouse=True)
def fresh_process_state():
    """The hooks' state is the process's: each test starts as a new process would."""
    RUNS.close()
    RUNS.hooked.clear()
    RUNS.dump_path, RUNS.steps = None, []
    yield
    RUNS.close()
    RUNS.hooked.clear()
    RUNS.dump_path, RUNS.steps = None, []


def run_here(script: str, folder: Path, monkeypatch) -> None:
    """``python script.py`` in ``folder``, in this process; the runs it leaves open are closed as
    the process's exit closes them."""
    monkeypatch.chdir(folder)
    try:
        exec(compile(textwrap.dedent(script), str(folder / "train.py"), "exec"), {"__name__": "__main__"})
    finally:
        RUNS.close()


def compare_clean(a: Path, b: Path, every_record_paired: bool = True) -> str:
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert res.exit_code == 0, res.output
    assert "unmatched" not in res.output or not every_record_paired, res.output
    return res.output


NET = '''
import torch
import torch.nn as nn


class Net(nn.Module):         # in place of ResNet-50: its second layer overflows float16
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(8, 16)
        self.linear_2 = nn.Linear(16, 4)
        with torch.no_grad():
            self.linear_2.weight.mul_(3000.0)

    def forward(self, x):
        return self.linear_2(torch.relu(self.linear_1(x * 100)))


torch.manual_seed(0)
'''

# the overflow guide's quick-start example: the import changed, Net().half() for ResNet-50 on the
# NPU (its two .npu() lines left out), model_npu (undefined there) read as model
OVERFLOW_EXAMPLE = NET + '''
import os
import copy

#import溢出检测工具相关函数
from dispatchprobe.torch_npu_hooks import register_hook, wrap_checkoverflow_hook

# 需要定位问题的网络模型
model = Net().half()

#对模型注册溢出检测函数hook
register_hook(model,wrap_checkoverflow_hook)

inputs = torch.randn(1, 8).half()
labels = torch.randn(1).long()
criterion = nn.CrossEntropyLoss()

output = model(inputs)
loss = criterion(output, labels)
loss.backward()
'''

OVERFLOW_NATIVE = NET + '''
from dispatchprobe import DispatchProbe
from dispatchprobe.core.overflow import OverflowDetected

model = Net().half()
probe = DispatchProbe(task="overflow", model=model, dump_path="./native")
inputs = torch.randn(1, 8).half()
labels = torch.randn(1).long()
criterion = nn.CrossEntropyLoss()
try:
    with probe:
        output = model(inputs)
        loss = criterion(output, labels)
        loss.backward()
except OverflowDetected:
    pass
probe.close()
'''


def test_overflow_example_raises_at_the_layer_and_records_as_the_native_check(tmp_path, monkeypatch):
    """As torch_npu.hooks does, the overflow raises, naming the layer; its records are in the
    default dump path and are those of DispatchProbe(task='overflow')."""
    with pytest.raises(OverflowDetected, match=r"overflow in aten\.addmm\.default \(forward, scope 'Net\.linear_2'"):
        run_here(OVERFLOW_EXAMPLE, tmp_path, monkeypatch)
    run_here(OVERFLOW_NATIVE, tmp_path, monkeypatch)
    assert (tmp_path / "dispatchprobe_dump" / "step0" / "rank0" / "overflow.csv").exists()
    compare_clean(tmp_path / "dispatchprobe_dump", tmp_path / "native")


# the precision-compare guide's quick-start example: the imports changed, model_cpu (undefined
# there) read as module, the device this machine has for the NPU; run twice, the runs agree
COMPARE_EXAMPLE = '''
# 根据需要import包
import os
import torch
import torch.nn as nn

from dispatchprobe.torch_npu_hooks import set_dump_path, seed_all, register_hook, wrap_acc_cmp_hook
from dispatchprobe.torch_npu_hooks import compare


# 定义一个简单的网络
class ModuleOP(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features=2, out_features=2)
        self.linear_2 = nn.Linear(in_features=2, out_features=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        x1 = self.linear_1(x)
        x2 = self.linear_2(x1)
        r1 = self.relu(x2)
        return r1

module = ModuleOP()
# 对模型注入forwar和backward的hooks，采样功能默认开启，如需关闭，请使用register_hook(model_cpu, wrap_acc_cmp_hook, sample=False)
register_hook(module, wrap_acc_cmp_hook)
seed_all()
x = torch.randn(2, 2)

# cpu上计算，dump数据
set_dump_path("./cpu_module_op.pkl")
out = module(x)
loss = out.sum()
loss.backward()

device = "cpu"        # the guide's NPU: a device this machine has
module.to(device)
x = x.to(device)
# npu上计算，dump数据
set_dump_path("./npu_module_op.pkl")
out = module(x)
loss = out.sum()
loss.backward()

# 对比dump出的数据精度，生成csv文件
compare("./npu_module_op.pkl", "./cpu_module_op.pkl", "./module_result.csv")
'''


def test_compare_example_records_both_runs_and_compares_them(tmp_path, monkeypatch, capsys):
    """Run twice: each run rewrites its dump files, as torch_npu.hooks did."""
    run_here(COMPARE_EXAMPLE, tmp_path, monkeypatch)
    RUNS.hooked.clear()
    run_here(COMPARE_EXAMPLE, tmp_path, monkeypatch)
    assert "the runs agree" in capsys.readouterr().out
    table = (tmp_path / "module_result.csv").read_text().splitlines()
    assert len(table) > 5 and "addmm" in "\n".join(table)
    for run in ("cpu_module_op.pkl", "npu_module_op.pkl"):
        ops = (tmp_path / run / "step0" / "rank0" / "ops.jsonl").read_text()
        assert '"scope":"ModuleOP.linear_1"' in ops.replace(" ", "") and '"backward"' in ops
    # the guide never zeroes the gradients: the second run's backward also adds into them (4 adds
    # more, unpaired), everything else pairs and agrees
    out = compare_clean(tmp_path / "npu_module_op.pkl", tmp_path / "cpu_module_op.pkl", every_record_paired=False)
    assert "unpaired: A 4, B 0" in out, out
    assert not (tmp_path / "dispatchprobe_dump").exists()     # nothing recorded before the first dump path


def test_schedule_selects_the_steps_step_schedule_counts(tmp_path, monkeypatch):
    """The guide's step control: register_hook(..., schedule=schedule(1, 2)) and
    step_schedule.step() at each step's end record steps 1 and 2 only."""
    run_here('''
import torch
from dispatchprobe.torch_npu_hooks import register_hook, schedule, set_dump_path, step_schedule, wrap_acc_cmp_hook

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
register_hook(model, wrap_acc_cmp_hook, schedule=schedule(1, 2))
set_dump_path("./steps.pkl")
step_schedule.reset_step()
for step in range(4):
    model(torch.randn(2, 4)).sum().backward()
    step_schedule.step()
''', tmp_path, monkeypatch)
    assert sorted(p.name for p in (tmp_path / "steps.pkl").glob("step*")) == ["step1", "step2"]


def test_async_datadump_saves_tensors_into_its_path(tmp_path, monkeypatch):
    """The guide's wrap_async_datadump_hook example: tensors of steps 1-2 in path='./output'."""
    run_here('''
import torch
from dispatchprobe.torch_npu_hooks import register_hook, wrap_async_datadump_hook, schedule, step_schedule

module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
# register wrap_async_datadump_hook and add datadump path
register_hook(module, wrap_async_datadump_hook, path='./output', schedule=schedule(1, 2))
for step in range(3):
    module(torch.randn(2, 2)).sum().backward()
    step_schedule.step()
''', tmp_path, monkeypatch)
    assert sorted(p.name for p in (tmp_path / "output").glob("step*")) == ["step1", "step2"]
    assert list((tmp_path / "output" / "step1" / "rank0" / "tensors").glob("*.safetensors"))


def test_schedule_and_bad_arguments():
    import torch
    assert schedule(4, 10, 2) == [4, 6, 8, 10] and schedule() == []
    assert schedule(end=10, stride=3) == [0, 3, 6, 9]
    with pytest.raises(ConfigError, match="give end="):
        schedule(begin=5, stride=3)
    with pytest.raises(ConfigError, match="hook must be one of"):
        register_hook(torch.nn.Linear(2, 2), print)
    with pytest.raises(ConfigError, match="unknown argument"):
        register_hook(torch.nn.Linear(2, 2), wrap_checkoverflow_hook, samples=True)
