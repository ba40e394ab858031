"""The grad probe: each parameter's gradient at every optimizer step, and compare of two runs' gradients."""

import torch

from dispatchprobe.torch.parameters import clean_name, named_gradients, parameter_names


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
