"""One config object from kwargs, dict, JSON or YAML; bad configs fail at construction."""

from __future__ import annotations

import json

import pytest

from dispatchprobe import Config, ConfigError


def test_sources_agree(tmp_path):
    data = {"task": "tensor", "dump_path": "out", "level": "L1", "step": [0, "2-4"], "rank": 1, "list": ["mm"]}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text("task: tensor\ndump_path: out\nlevel: L1\nstep: [0, '2-4']\nrank: 1\n"
                                     "list: [mm]\n")
    configs = [Config.load(data), Config.load(str(tmp_path / "c.json")), Config.load(tmp_path / "c.yaml"),
               Config.load(**data), Config.load(Config.load(data))]
    for cfg in configs:
        assert cfg == configs[0]
    cfg = configs[0]
    assert (cfg.level, cfg.step, cfg.rank, cfg.list) == ("op", [0, 2, 3, 4], [1], ["mm"])


def test_msprobe_config_file_accepted(tmp_path):
    msprobe = {
        "task": "free_benchmark", "dump_path": "./dump", "rank": [], "step": [], "level": "L1", "seed": 1234,
        "is_deterministic": False, "enable_dataloader": False,
        "free_benchmark": {"scope": [], "list": ["aten.mm"], "fuzz_device": "npu", "pert_mode": "improve_precision",
                           "handler_type": "check", "fuzz_level": "L1", "fuzz_stage": "forward",
                           "if_preheat": False, "preheat_step": 15, "max_sample": 20},
    }
    cfg = Config.load(msprobe)
    assert cfg.task == "free_benchmark" and cfg.list == ["aten.mm"]
    assert cfg.free_benchmark.fuzz_device == "same" and cfg.free_benchmark.pert_mode == "improve_precision"
    cfg = Config.load({"task": "statistics", "statistics": {"scope": ["Net.fc"], "list": [], "data_mode": ["all"],
                                                            "summary_mode": "md5"}})
    assert cfg.checksum and cfg.scope == ["Net.fc"]
    cfg = Config.load({"task": "overflow_check", "overflow_check": {"overflow_nums": 3, "check_mode": "all"}})
    assert cfg.task == "overflow" and cfg.overflow.overflow_nums == 3


@pytest.mark.parametrize("bad,message", [
    ({"tsk": "statistics"}, "unknown key 'tsk'; did you mean 'task'?"),
    ({"zzzqq": 1}, "unknown key 'zzzqq'; allowed keys: bounds, check_mode,"),
    ({"task": "dump"}, "task='dump' is not allowed; choose one of: statistics, tensor, overflow, free_benchmark"),
    ({"level": "L9"}, "level='L9' is not allowed; choose one of: op, module, mix"),
    ({"step": "x"}, "step"),
    ({"step": [-1]}, "step"),
    ({"stack": "yes"}, "stack"),
    ({"data_mode": ["sideways"]}, "data_mode='sideways' is not allowed"),
    ({"dump_path": ""}, "'dump_path' must not be empty"),
    ({"task": "free_benchmark", "handler_type": "fix", "pert_mode": "bit_noise"}, "handler_type='fix' needs"),
    ({"task": "overflow", "level": "module"}, "level must be 'op' or 'mix'"),
    ({"pert_mode": "to_cpu"}, "fuzz_device='cpu' goes with pert_mode='to_cpu'"),
])
def test_bad_configs_name_the_key(bad, message):
    with pytest.raises(ConfigError) as err:
        Config.load(bad)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        Config.load(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ConfigError, match="bad.json"):
        Config.load(str(tmp_path / "bad.json"))


def test_probe_rejects_bad_config_before_running(tmp_path):
    from dispatchprobe import DispatchProbe
    with pytest.raises(ConfigError, match="unknown key 'lvl'"):
        DispatchProbe(dump_path=str(tmp_path), lvl="op")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("source", [{"task": "free_benchmark", "free_benchmark": {"seed": 7}},
                                    {"task": "free_benchmark", "seed": 7}])
def test_free_benchmark_seed_is_kept(tmp_path, source):
    cfg = Config.load(source, dump_path=str(tmp_path))
    assert cfg.free_benchmark.seed == 7
    from dispatchprobe import DispatchProbe
    probe = DispatchProbe(cfg)
    assert probe.handlers[0].gen.initial_seed() == 7
