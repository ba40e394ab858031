"""msprobe configs as users bring them: every documented key honoured or ignored with one line,
msprobe module/API names selecting the right ops, seed_all, step schedules, empty selections."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

from dispatchprobe import Config, ConfigError, ConfigWarning, load
from dispatchprobe.core.msprobe_config import API_TO_ATEN, MSPROBE_KEYS
from dispatchprobe.core.session import OpSelector
from conftest import train

# ---- msprobe's example configs, verbatim -----------------------------------------------------
FREE_BENCHMARK_DEFAULT = {      # free_benchmark.zh.md, 3.2 (msprobe's default)
    "task": "free_benchmark", "dump_path": "./dump_path", "rank": [], "step": [], "level": "L1",
    "free_benchmark": {"scope": [], "list": [], "fuzz_device": "npu", "pert_mode": "improve_precision",
                       "handler_type": "check", "fuzz_level": "L1", "fuzz_stage": "forward", "if_preheat": False,
                       "preheat_step": 15, "max_sample": 20}}
ONLINE_GPU_LAN = {              # msprobe_1.0.4_diff.zh.md, online pre-check 3.1.3, GPU side
    "task": "run_ut", "run_ut": {"white_list": [], "black_list": [], "error_data_path": "./", "is_online": True,
                                 "nfs_path": "", "host": "127.0.0.1", "port": 59208, "rank_list": [0]}}
ONLINE_NPU_LAN = {              # 3.1.3, NPU side
    "task": "tensor", "dump_path": "./dump_path", "rank": [0], "step": [0], "level": "L1", "seed": 1234,
    "is_deterministic": True,
    "tensor": {"scope": [], "list": [], "online_run_ut": True, "nfs_path": "", "host": "xx.xx.xx.x", "port": 59208}}
ONLINE_GPU_NFS = {              # 3.1.4, GPU side
    "task": "run_ut", "run_ut": {"white_list": [], "black_list": [], "error_data_path": "./", "is_online": True,
                                 "nfs_path": "/nfs/xxx/data", "host": "", "port": -1, "rank_list": [0]}}
ONLINE_NPU_NFS = {              # 3.1.4, NPU side
    "task": "tensor", "dump_path": "./dump_path", "rank": [0], "step": [0], "level": "L1", "seed": 1234,
    "is_deterministic": True,
    "tensor": {"scope": [], "list": [], "online_run_ut": True, "nfs_path": "/nfs/xxx/data", "host": "", "port": -1}}
# msprobe's own config docs (the keys the issue names): its default config.json and examples
MSPROBE_DEFAULT = {
    "task": "statistics", "dump_path": "./dump_path", "rank": [], "step": [], "level": "L1",
    "enable_dataloader": False,
    "tensor": {"scope": [], "list": [], "data_mode": ["all"], "file_format": "npy"},
    "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
    "overflow_check": {"overflow_nums": 1, "check_mode": "all"},
    "run_ut": {"white_list": [], "black_list": [], "error_data_path": "./"},
    "grad_probe": {"grad_level": "L1", "param_list": [], "bounds": [-1, 0, 1]},
    "free_benchmark": {"scope": [], "list": [], "fuzz_device": "npu", "pert_mode": "improve_precision",
                       "handler_type": "check", "fuzz_level": "L1", "fuzz_stage": "forward", "if_preheat": False,
                       "preheat_step": 15, "max_sample": 20}}
STATISTICS_EXAMPLE = {
    "task": "statistics", "dump_path": "/home/data_dump", "rank": [], "step": [], "level": "L1",
    "async_dump": False, "extra_info": True,
    "statistics": {"scope": [], "list": [], "tensor_list": [], "data_mode": ["all"], "summary_mode": "statistics"}}
TENSOR_EXAMPLE = {
    "task": "tensor", "dump_path": "/home/data_dump", "rank": [], "step": [], "level": "L1", "async_dump": False,
    "tensor": {"scope": [], "list": [], "data_mode": ["all"], "bench_path": "/home/bench_data_dump",
               "summary_mode": "md5", "diff_nums": 5}}


def load_quietly(source, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config.load(source, **kw)
    notes = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert all("\n" not in n for n in notes)
    return cfg, notes


def warned_keys(notes):
    return {m[1] for n in notes for m in [re.match(r"config: (\w+)=", n)] if m}


@pytest.mark.parametrize("source,warned", [
    (FREE_BENCHMARK_DEFAULT, set()),
    (ONLINE_NPU_LAN, set()),
    (ONLINE_NPU_NFS, set()),
    (MSPROBE_DEFAULT, set()),
    (STATISTICS_EXAMPLE, {"extra_info"}),
    (TENSOR_EXAMPLE, {"bench_path", "diff_nums"}),
])
def test_example_configs_load_with_one_line_per_ignored_key(source, warned):
    cfg, notes = load_quietly(source)
    assert warned_keys(notes) == warned and len(notes) == len(warned), notes
    assert cfg.task == {"run_ut": "tensor"}.get(source["task"], source["task"])
    if source is TENSOR_EXAMPLE:
        assert cfg.checksum                          # summary_mode md5, from the tensor section
    if source in (ONLINE_NPU_LAN, ONLINE_NPU_NFS):
        assert (cfg.seed, cfg.is_deterministic, cfg.step, cfg.rank) == (1234, True, [0], [0])
        assert cfg.free_benchmark.seed == 1234      # the top-level seed also seeds the free benchmark
        assert cfg.online_run_ut
    if source is ONLINE_NPU_LAN:                    # streams to the checker at host:port
        assert cfg.streams and (cfg.host, cfg.port) == ("xx.xx.xx.x", 59208)
    if source is ONLINE_NPU_NFS:                    # records into the shared directory a checker follows
        assert not cfg.streams and cfg.dump_path == "/nfs/xxx/data"
    if source is MSPROBE_DEFAULT:                   # only the task's own section counts, as in msprobe
        assert (cfg.scope, cfg.list, cfg.checksum, cfg.overflow.check_mode) == ([], [], False, "both")
    for note in notes:
        key = re.match(r"config: (\w+)=", note)[1]
        assert MSPROBE_KEYS[key].how in note


@pytest.mark.parametrize("source", [ONLINE_GPU_LAN, ONLINE_GPU_NFS])
def test_run_ut_task_names_the_command(source):
    with pytest.raises(ConfigError) as err:
        Config.load(source)
    assert "dispatchprobe run-ut" in str(err.value) and "\n" not in str(err.value)


def keys_of(config: dict) -> set[str]:
    return {k for k, v in config.items() for k in ([k] if not isinstance(v, dict) else [k, *keys_of(v)])}


SEED_DATA = Path(__file__).parent / "data" / "msprobe_seed_configs.json"


def documented_configs() -> tuple[list, set]:
    """msprobe's documented config examples and the online pre-check's key tables (msprobe 1.0.4,
    config.json sections 3.1.1 and 3.1.2), as extracted verbatim into tests/data."""
    data = json.loads(SEED_DATA.read_text(encoding="utf-8"))
    return data["configs"], set(data["table_keys"])


def test_every_key_msprobe_documents_is_in_the_table():
    configs, table_keys = documented_configs()
    assert len(configs) >= 5
    documented = set().union(*map(keys_of, configs)) | table_keys
    assert {"tls_path", "online_run_ut", "is_deterministic", "rank_list"} <= documented
    sections = {"tensor", "statistics", "run_ut", "free_benchmark", "overflow_check", "grad_probe"}
    assert documented - sections <= set(MSPROBE_KEYS), documented - sections - set(MSPROBE_KEYS)
    for config in configs:
        if config["task"] != "run_ut":
            load_quietly(config)


def test_ignored_keys_warn_only_when_they_ask_for_something():
    _, notes = load_quietly({"async_dump": False, "enable_dataloader": False, "dump_enable": True})
    assert notes == []
    _, notes = load_quietly({"async_dump": True, "statistics": {"tensor_list": ["relu"]}})
    assert warned_keys(notes) == {"async_dump", "tensor_list"} and len(notes) == 2
    assert "unknown key" in str(pytest.raises(ConfigError, Config.load, {"tensor": {"bench": 1}}).value)
    cfg, notes = load_quietly({"task": "overflow_check", "overflow_check": {"check_mode": "aicore"}})
    assert cfg.overflow.check_mode == "both" and len(notes) == 1 and "aicore" in notes[0]


def test_warned_once_when_built():
    cfg, notes = load_quietly(TENSOR_EXAMPLE)
    assert len(notes) == 2
    _, again = load_quietly(cfg)                  # a built config carries no ignored keys
    assert again == []


@pytest.mark.parametrize("task", ["structure", "acc_check", "exception_dump"])
def test_msprobe_only_tasks_say_what_to_use(task):
    with pytest.raises(ConfigError, match=f"task='{task}'") as err:
        Config.load({"task": task})
    assert "\n" not in str(err.value)


def test_grad_probe_section_is_read():
    """msprobe's grad_probe example (docs/17.grad_probe.md) as it is; its section applies to task
    grad_probe only, and its values are checked as msprobe checks them."""
    example = {"task": "grad_probe", "dump_path": "./dump_path", "rank": [], "step": [],
               "grad_probe": {"grad_level": "L1", "param_list": [], "bounds": [-1, 0, 1]}}
    cfg, notes = load_quietly(example)
    assert notes == [] and cfg.task == "grad_probe"
    assert (cfg.grad_probe.grad_level, cfg.grad_probe.param_list, cfg.grad_probe.bounds) == ("L1", [], [-1, 0, 1])
    cfg, _ = load_quietly({**example, "task": "statistics", "grad_probe": {"grad_level": "L2"}})
    assert cfg.grad_probe.grad_level == "L1"      # another task's section: accepted, not applied
    for bad in ({"grad_level": "L9"}, {"bounds": [0, 0]}, {"bounds": [1, "2"]}, {"unknown": 1}):
        with pytest.raises(ConfigError) as err:
            Config.load({**example, "grad_probe": {**example["grad_probe"], **bad}})
        assert "\n" not in str(err.value)


# ---- msprobe values ------------------------------------------------------------------------------
def test_msprobe_names_are_mapped():
    cfg, notes = load_quietly({"scope": ["Module.layers.1.mlp.MLP.forward.0", "Module.head.Linear.backward.2"],
                               "list": ["torch.nn.functional.linear", "Functional.gelu.0.forward", "Tensor.__add__",
                                        "torch.ops.aten.mm.default", "softmax"]})
    assert cfg.scope == ["*.layers.1.mlp", "*.head"]
    assert cfg.list == [r"^aten\.(addmm|mm|linear)\.", r"^aten\.(gelu|gelu_backward)\.", r"^aten\.(add)\.",
                        r"^aten\.(mm)\.", "softmax"]
    assert len(notes) == 2 and "range" in notes[0]
    cfg, notes = load_quietly({"task": "free_benchmark", "free_benchmark": {"scope": ["Torch.matmul.0.forward"]}})
    assert cfg.scope == [] and cfg.list == [r"^aten\.(mm|bmm|mv|dot|matmul)\."] and len(notes) == 2
    cfg, _ = load_quietly({"level": "mix", "list": ["Module.module.layers.0.Block.forward.0"]})
    assert (cfg.scope, cfg.list) == (["*.module.layers.0"], [])


@pytest.mark.parametrize("bad,message", [
    ({"list": ["torch.nn.functional.fold"]}, "'torch.nn.functional.fold' is an API name dispatchprobe does not map"),
    ({"list": ["mindspore.ops.add"]}, "names a mindspore API"),
    ({"list": ["relu", "Module.fc.Linear.forward.0"]}, "put module names in scope"),
    ({"list": ["relu"], "scope": ["Tensor.add.0.forward"]}, "is an API name, not a module scope"),
    ({"list": ["add_("]}, "list entry 'add_(' is not a valid regex"),
    ({"list": ["[mm"]}, "list entry '[mm' is not a valid regex"),
])
def test_msprobe_values_that_cannot_work_fail_in_one_line(bad, message):
    with pytest.raises(ConfigError) as err:
        Config.load(bad)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_mapped_api_compiles():
    for api, ops in API_TO_ATEN.items():
        cfg, _ = load_quietly({"list": [f"torch.{api}"]})
        for op in ops:
            example = op.replace("\\w+", "flash").replace("\\w*", "").replace("2?d?", "")
            assert re.compile(cfg.list[0]).search(f"aten.{example}.default"), (api, op)


def test_scopes_match_whole_parts():
    sel = OpSelector([], ["layers.1", "*.head"])
    assert sel.scope_selected("Net.layers.1.mlp") and sel.scope_selected("Net.layers.1")
    assert not sel.scope_selected("Net.layers.10") and not sel.scope_selected("Net.sublayers.1x")
    assert sel.scope_selected("Other.head") and not sel.scope_selected("Net.x.head")
    assert sel.hits == 3
    with pytest.raises(ConfigError, match="not a valid regex"):
        OpSelector(["(mm"], [])


def test_msprobe_values_select_the_right_ops(tmp_path):
    from dispatchprobe import DispatchProbe
    runs = {"scope": {"scope": ["Module.layers.1.mlp.MLP.forward.0"]},
            "linear": {"list": ["torch.nn.functional.linear"]},
            "gelu": {"list": ["Functional.gelu.0.forward"], "scope": ["Module.layers.0.Block.forward.0"]}}
    for name, cfg in runs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)     # no empty-selection warning
            warnings.simplefilter("ignore", ConfigWarning)
            train(DispatchProbe(dump_path=str(tmp_path / name), **cfg), steps=1)
    recs = {n: [r for r in load(tmp_path / n).part(0, 0).records if r["kind"] == "op"] for n in runs}
    assert recs["scope"] and {r["scope"] for r in recs["scope"]} <= {"TinyTransformer.layers.1.mlp",
                                                                      "TinyTransformer.layers.1.mlp.up",
                                                                      "TinyTransformer.layers.1.mlp.down",
                                                                      "TinyTransformer.layers.1.mlp.dropout"}
    assert {r["stage"] for r in recs["scope"]} == {"forward", "backward"}
    assert {r["op"] for r in recs["linear"]} == {"aten.addmm.default", "aten.mm.default"}
    gelu = {(r["op"], r["stage"], r["scope"]) for r in recs["gelu"]}
    assert gelu == {("aten.gelu.default", "forward", "TinyTransformer.layers.0.mlp"),
                    ("aten.gelu_backward.default", "backward", "TinyTransformer.layers.0.mlp")}


def test_empty_selection_warns_at_close(tmp_path):
    from dispatchprobe import DispatchProbe
    probe = DispatchProbe(dump_path=str(tmp_path / "a"), list=["linear"], scope=["*.layers"])
    with pytest.warns(RuntimeWarning) as caught:
        train(probe, steps=1)
    [w] = [w for w in caught if "selected no op" in str(w.message)]
    assert "list=['linear']" in str(w.message) and "scope=['*.layers']" in str(w.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        probe.close()                                       # said once
    with pytest.warns(RuntimeWarning, match=r"step=\[5\] selected none of the 2 step"):
        train(DispatchProbe(dump_path=str(tmp_path / "b"), step=[5]), steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train(DispatchProbe(dump_path=str(tmp_path / "c"), list=["gelu"]), steps=1)


def test_invalid_regex_fails_when_the_probe_is_built(tmp_path):
    from dispatchprobe import DispatchProbe
    with pytest.raises(ConfigError, match=r"list entry '\(mm' is not a valid regex") as err:
        DispatchProbe(dump_path=str(tmp_path / "x"), list=["(mm"])
    assert "\n" not in str(err.value) and not (tmp_path / "x").exists()


# ---- step schedules ------------------------------------------------------------------------------
@pytest.mark.parametrize("step,expected", [
    (["0-10:5"], [0, 5, 10]), ("4-10:2", [4, 6, 8, 10]), ({"begin": 4, "end": 10, "stride": 2}, [4, 6, 8, 10]),
    ("schedule(4, 10, 2)", [4, 6, 8, 10]), (["schedule(end=10, stride=3)"], [0, 3, 6, 9]),
    ([7, "0-2", {"end": 3}], [0, 1, 2, 3, 7]),
])
def test_step_schedules(step, expected):
    assert Config.load(step=step).step == expected


@pytest.mark.parametrize("step,message", [
    ({"begin": 5, "stride": 3}, "a schedule needs an end"), ("3-1", "end >= begin"), ("0-9:0", "stride >= 1"),
    ({"begin": 1, "end": 4, "every": 2}, "not 'every'"), ("0-9999999", "at most"),
])
def test_bad_schedules(step, message):
    with pytest.raises(ConfigError, match=message) as err:
        Config.load(step=step)
    assert "\n" not in str(err.value)


def test_step_stride_records_those_steps(tmp_path):
    from dispatchprobe import DispatchProbe
    train(DispatchProbe(dump_path=str(tmp_path), step="0-4:2", list=["gelu"]), steps=5)
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step0", "step2", "step4"]


# ---- seed_all ------------------------------------------------------------------------------------
@pytest.fixture
def restore_determinism():
    env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC", "PYTHONHASHSEED")}
    state = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(state[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = state[1:]
    for k, v in env.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def dropout_run():
    import random

    import numpy as np
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    loss = model(x).square().mean()
    loss.backward()
    return (loss.detach(), [p.grad.clone() for p in model.parameters()], random.random(), np.random.rand())


def test_seed_all_makes_two_runs_bit_identical(restore_determinism):
    import dispatchprobe
    runs = []
    for _ in range(2):
        done = dispatchprobe.seed_all(7)
        runs.append(dropout_run())
    assert "seeded=random,numpy,torch" in str(done) and "\n" not in str(done)
    (la, ga, ra, na), (lb, gb, rb, nb) = runs
    assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb)) and (ra, na) == (rb, nb)
    assert not torch.equal(dropout_run()[0], dropout_run()[0])          # unseeded runs differ


def test_seed_all_deterministic_mode(restore_determinism):
    import dispatchprobe
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    done = dispatchprobe.seed_all(3, mode=True)
    assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert done["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["PYTHONHASHSEED"] == "3"
    with pytest.raises(ValueError, match="seed must be"):
        dispatchprobe.seed_all("7")


def test_config_seed_and_is_deterministic_are_honoured(tmp_path, restore_determinism):
    from dispatchprobe import DispatchProbe
    probe = DispatchProbe(ONLINE_NPU_LAN, dump_path=str(tmp_path / "a"), online_run_ut=False)   # no checker here
    assert probe.seeded["seed"] == 1234 and torch.are_deterministic_algorithms_enabled()
    first = torch.rand(3)
    DispatchProbe(dump_path=str(tmp_path / "b"), seed=1234)
    assert torch.equal(torch.rand(3), first)
    assert DispatchProbe(dump_path=str(tmp_path / "c")).seeded is None       # no seed key: RNGs untouched


def test_seed_all_is_lazy():
    import subprocess
    import sys
    code = ("import sys, dispatchprobe; a = 'torch' in sys.modules; dispatchprobe.seed_all(1); "
            "print(a, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_docs_list_every_key():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "msprobe-config.md").read_text()
    for key, row in MSPROBE_KEYS.items():
        assert f"| `{key}` |" in doc and row.how in doc.replace("&#124;", "|"), key
    for api in API_TO_ATEN:
        assert f"`{api}`" in doc, api
