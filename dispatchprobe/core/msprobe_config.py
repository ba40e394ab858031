"""msprobe's config.json read as dispatchprobe's config: every documented key, its sections, and
msprobe's module and API names in ``scope``/``list``.

Every key msprobe documents is in :data:`MSPROBE_KEYS`, honoured or ignored with one warning line
saying why (:func:`flatten_msprobe` collects those lines); msprobe's module and API names become
module scopes and aten ops (:func:`msprobe_scope`, :func:`msprobe_list`).  Kept apart from
``config.py`` so the config itself reads as dispatchprobe's own options.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from .config_values import ConfigError, choice, unknown_key
from .tasks import canonical

class MsprobeKey(NamedTuple):
    """How one msprobe key is read: ``honoured`` names the dispatchprobe option it becomes;
    otherwise ``how`` says why it is ignored, with one warning unless its value is in ``inert``
    (values that ask for what dispatchprobe does anyway; ``ANY``: every value)."""

    sections: str
    honoured: bool
    how: str
    inert: tuple = ()


ANY = ("*any*",)
_RUN_UT = "an option of msprobe's run_ut command; dispatchprobe's is `dispatchprobe run-ut RUN` (see docs/run-ut.md)"

#: Every key of msprobe's config.json documented in msprobe's documentation and in msprobe's
#: config introduction (1.0.x to 8.x): how dispatchprobe reads it.  Keys of the run_ut/acc_check
#: section (and of the sections of tasks other than ``task``) are accepted without a word, as
#: msprobe does: they configure another task.
MSPROBE_KEYS: dict[str, MsprobeKey] = {
    # top level
    "task": MsprobeKey("top", True, "task: statistics, tensor, overflow_check (= overflow), free_benchmark, "
                       "grad_probe; run_ut/acc_check, structure, exception_dump: one line naming the equivalent"),
    "dump_path": MsprobeKey("top", True, "dump_path: the run directory"),
    "rank": MsprobeKey("top", True, "rank: ints and 'a-b' ranges"),
    "step": MsprobeKey("top", True, "step: ints, 'a-b' ranges, 'a-b:stride' and schedule {begin, end, stride}"),
    "level": MsprobeKey("top", True, "level: L0 = module, L1 = op, mix; L2 (kernels) = op (aten kernels)"),
    "seed": MsprobeKey("top", True, "seed: dispatchprobe.seed_all(seed) when the probe is built, and the "
                       "free benchmark's noise seed"),
    "is_deterministic": MsprobeKey("top", True, "is_deterministic: seed_all(seed, mode=True) when the probe is "
                                   "built (deterministic algorithms, cuBLAS workspace, cuDNN)"),
    "enable_dataloader": MsprobeKey("top", False, "dispatchprobe never ends training; mark steps with "
                                    "probe.step() (msprobe deprecated this switch)", (False,)),
    "acl_config": MsprobeKey("top", False, "Ascend ACL kernel dumps (level L2) are device-specific; "
                             "dispatchprobe records aten kernels at level op", ("", None)),
    "async_dump": MsprobeKey("top", False, "dispatchprobe always writes in the background and never syncs "
                             "the device per op", (False,)),
    "dump_enable": MsprobeKey("top", False, "the config is read once; switch recording with probe.start()/"
                              "stop() or `with probe:`", (True,)),
    "extra_info": MsprobeKey("top", False, "the module tree is always written; Python stacks are recorded "
                             "with stack: true", (False,)),
    "precision": MsprobeKey("top, run_ut", False, "statistics are always accumulated in float32 or wider "
                            "(msprobe's 'high')", ("high",)),
    "risk_level": MsprobeKey("top", False, "every aten op is recorded, view/metadata ops only with "
                             "include_views: true (about msprobe's FOCUS)", ("FOCUS",)),
    "framework": MsprobeKey("top", False, "the framework is the probe's (DispatchProbe: torch)", ANY),
    # statistics / tensor sections
    "scope": MsprobeKey("statistics, tensor, free_benchmark", True,
                        "scope: module scopes; msprobe module names -> '*.<attribute path>'"),
    "list": MsprobeKey("statistics, tensor, free_benchmark", True,
                       "list: aten op names/regexes; msprobe and torch API names -> the aten ops they run"),
    "data_mode": MsprobeKey("statistics, tensor", True, "data_mode"),
    "summary_mode": MsprobeKey("statistics, tensor, grad_probe", True,
                               "checksum: md5/xor = CRC32 beside the statistics; grad_probe: md5 = msprobe's MD5 at L0"),
    "tensor_list": MsprobeKey("statistics, tensor", False, "tensors are saved for every selected op (task "
                              "tensor) or none (task statistics); select ops with list", ([],)),
    "file_format": MsprobeKey("tensor", False, "tensors are always safetensors", ("npy",)),
    "backward_input": MsprobeKey("tensor", False, "backward ops are recorded with their inputs in every run; "
                                 "no earlier dump is needed", ("", [])),
    "bench_path": MsprobeKey("tensor", False, "no live MD5 comparison with an earlier run: record both runs "
                             "(checksum: true) and `dispatchprobe compare A B`", ("",)),
    "diff_nums": MsprobeKey("tensor", False, "goes with bench_path (no live comparison)", (1,)),
    "device": MsprobeKey("statistics", False, "statistics are computed on the tensor's own device", ANY),
    "online_run_ut": MsprobeKey("tensor", True, "online_run_ut: stream each op to `dispatchprobe run-ut --listen` "
                                "(or record into nfs_path for `run-ut --follow`); docs/online.md"),
    "nfs_path": MsprobeKey("tensor, run_ut", True, "nfs_path: the run directory (replaces dump_path) that "
                           "`dispatchprobe run-ut NFS_PATH --follow` judges as it is written"),
    "host": MsprobeKey("tensor, run_ut", True, "host: the checker's address (`run-ut --listen HOST:PORT`)"),
    "port": MsprobeKey("tensor, run_ut", True, "port: the checker's port"),
    "tls_path": MsprobeKey("tensor, run_ut", True, "tls_path: a directory with ca.crt (and client.crt + client.key "
                           "for mutual TLS); the checker's --tls-path holds server.crt, server.key (+ ca.crt)"),
    # overflow_check
    "overflow_nums": MsprobeKey("overflow_check", True, "overflow_nums"),
    "check_mode": MsprobeKey("overflow_check", True, "check_mode: all = both; aicore/atomic (Ascend units) "
                             "= both, with a warning"),
    # free_benchmark
    **{k: MsprobeKey("free_benchmark", True, k) for k in ("pert_mode", "handler_type", "fuzz_stage", "if_preheat",
                                                             "preheat_step", "max_sample")},
    "fuzz_device": MsprobeKey("free_benchmark", True, "fuzz_device: npu/gpu/cuda = same device, cpu"),
    "fuzz_level": MsprobeKey("free_benchmark", False, "free_benchmark.csv has msprobe's L1 columns", ("L1",)),
    # run_ut / acc_check (msprobe's pre-check command): another task
    **{k: MsprobeKey("run_ut", False, _RUN_UT, ANY) for k in ("white_list", "black_list", "error_data_path",
                                                               "is_online", "rank_list")},
    # grad_probe
    "grad_level": MsprobeKey("grad_probe", True, "grad_level: L0, L1, L2 (docs/grad-probe.md)"),
    "param_list": MsprobeKey("grad_probe", True, "param_list: parameter names; also dotted prefixes and regexes"),
    "bounds": MsprobeKey("grad_probe", True, "bounds: ascending numbers within int64's range"),
}

MSPROBE_ONLY_TASKS = {
    "run_ut": "is msprobe's pre-check command; record with task='tensor' and run `dispatchprobe run-ut RUN` "
              "(online: `dispatchprobe run-ut --listen HOST:PORT` or `dispatchprobe run-ut NFS_PATH --follow`)",
    "acc_check": "is msprobe's pre-check command; record with task='tensor' and run `dispatchprobe run-ut RUN`",
    "structure": "is not a dispatchprobe task; level='module' with task='statistics' records the module tree",
    "exception_dump": "is Ascend's kernel exception dump; task='overflow' finds the first op making inf/nan",
}
_TASK_SECTION = {"statistics": "statistics", "tensor": "tensor", "overflow": "overflow_check",
                 "free_benchmark": "free_benchmark", "grad_probe": "grad_probe"}
_SECTION_KEYS = {      # what each msprobe section may hold (dispatchprobe's own keys included)
    "statistics": {"scope", "list", "data_mode", "summary_mode", "tensor_list", "device", "file_format"},
    "tensor": {"scope", "list", "data_mode", "summary_mode", "tensor_list", "file_format", "backward_input",
               "bench_path", "diff_nums", "online_run_ut", "nfs_path", "host", "port", "tls_path"},
    "run_ut": {"white_list", "black_list", "error_data_path", "is_online", "nfs_path", "host", "port",
               "rank_list", "tls_path", "precision"},
    "grad_probe": {"grad_level", "param_list", "bounds", "summary_mode"},
}
_SECTION_KEYS["acc_check"] = _SECTION_KEYS["run_ut"]


def flatten_msprobe(data: dict, task: str, notes: list[str]) -> dict:
    """msprobe's per-task sections: the one of ``task`` is lifted to the top level (its
    ``overflow_check``/``free_benchmark`` options to dispatchprobe's sections); the others configure
    another task and are dropped, as msprobe does, once their keys are known.  Ignored keys are
    dropped with a note unless their value is inert."""
    data = dict(data)
    chosen = _TASK_SECTION.get(canonical(task) if isinstance(task, str) else task)
    for name, allowed in _SECTION_KEYS.items():
        section = data.get(name)
        if not isinstance(section, dict):
            continue
        del data[name]
        for key in section:
            if key not in allowed:
                raise unknown_key(key, allowed, name)
        if name == chosen == "grad_probe":
            section = dict(section)
            if "summary_mode" in section:           # md5: msprobe's MD5 of each gradient at L0
                data["summary_mode"] = section.pop("summary_mode")
            data["grad_probe"] = section
        elif name == chosen:
            data.update(section)
    if isinstance(data.get("overflow_check"), dict):
        data["overflow"] = {**data.get("overflow", {}), **data.pop("overflow_check")}
    if isinstance(data.get("free_benchmark"), dict):
        section = dict(data["free_benchmark"])
        for key in ("scope", "list"):
            if key in section:
                value = section.pop(key)
                if chosen == "free_benchmark":
                    data[key] = value
        data["free_benchmark"] = section
    for where in (data, data.get("overflow"), data.get("free_benchmark")):
        if isinstance(where, dict):
            _drop_ignored(where, notes)
    overflow = data.get("overflow")
    if isinstance(overflow, dict) and overflow.get("check_mode") in ("aicore", "atomic"):
        notes.append(f"config: check_mode={overflow['check_mode']!r} selects Ascend hardware units; "
                     "dispatchprobe checks every op, forward and backward (check_mode='both')")
        overflow["check_mode"] = "both"
    if "summary_mode" in data:
        mode = data.pop("summary_mode")
        choice("summary_mode", mode, ("statistics", "md5", "xor"))
        data["checksum"] = mode != "statistics"
    if isinstance(data.get("data_mode"), str):
        data["data_mode"] = [data["data_mode"]]
    return data



def _drop_ignored(data: dict, notes: list[str]) -> None:
    for key in [k for k in data if k in MSPROBE_KEYS and not MSPROBE_KEYS[k].honoured]:
        value, row = data.pop(key), MSPROBE_KEYS[key]
        if row.inert is not ANY and value not in row.inert and value not in (None, [], {}):
            notes.append(f"config: {key}={value!r} ignored: {row.how}")



# ---- msprobe's names in scope and list ----------------------------------------------------------

#: A torch API -> the aten ops it runs below autograd, forward and backward kernels (measured under
#: TorchDispatchMode, torch 2.13 CPU).  An API name in ``list`` selects these ops wherever they run:
#: ``torch.matmul`` selects every ``aten.mm``, also those of a linear layer's backward.
API_TO_ATEN: dict[str, tuple[str, ...]] = {
    "linear": ("addmm", "mm", "linear"),
    "matmul": ("mm", "bmm", "mv", "dot", "matmul"),
    "addmm": ("addmm", "mm"), "baddbmm": ("baddbmm", "bmm"), "einsum": ("bmm", "mm"),
    **dict.fromkeys(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
                    ("convolution", "convolution_backward")),
    "softmax": ("_softmax", "_softmax_backward_data"),
    "log_softmax": ("_log_softmax", "_log_softmax_backward_data"),
    "gelu": ("gelu", "gelu_backward"), "relu": ("relu", "threshold_backward"),
    "silu": ("silu", "silu_backward"), "sigmoid": ("sigmoid", "sigmoid_backward"), "tanh": ("tanh", "tanh_backward"),
    "logsigmoid": ("log_sigmoid_forward", "log_sigmoid_backward"),
    "layer_norm": ("native_layer_norm", "native_layer_norm_backward"),
    "group_norm": ("native_group_norm", "native_group_norm_backward"),
    "batch_norm": ("native_batch_norm", "native_batch_norm_backward", r"_native_batch_norm_legit\w*",
                   r"cudnn_batch_norm\w*"),
    "embedding": ("embedding", "embedding_dense_backward"),
    "cross_entropy": ("_log_softmax", "_log_softmax_backward_data", r"nll_loss2?d?_forward", r"nll_loss2?d?_backward"),
    "nll_loss": (r"nll_loss2?d?_forward", r"nll_loss2?d?_backward"),
    "mse_loss": ("mse_loss", "mse_loss_backward"),
    "binary_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",),
    "scaled_dot_product_attention": (r"_scaled_dot_product_\w+",),
    "dropout": ("native_dropout", "native_dropout_backward", "bernoulli_"),
    "square": ("pow",), "norm": ("linalg_vector_norm", "norm"), "pad": ("constant_pad_nd",),
    "max_pool2d": ("max_pool2d_with_indices", "max_pool2d_with_indices_backward"),
    "avg_pool2d": ("avg_pool2d", "avg_pool2d_backward"),
    "to": ("_to_copy",), "float": ("_to_copy",), "half": ("_to_copy",), "bfloat16": ("_to_copy",),
    "type_as": ("_to_copy",), "contiguous": ("clone",), "chunk": ("split",),
    # the aten op of the same name
    **{name: (name,) for name in (
        "mm", "bmm", "mv", "add", "sub", "mul", "div", "pow", "sqrt", "rsqrt", "exp", "log", "log1p", "abs", "neg",
        "reciprocal", "sin", "cos", "erf", "floor", "sum", "mean", "var", "std", "prod", "max", "min", "amax", "amin",
        "argmax", "maximum", "minimum", "cumsum", "cat", "stack", "split", "permute", "transpose", "masked_fill",
        "clamp", "where", "softplus", "leaky_relu", "hardtanh", "elu", "hardswish", "mish", "glu", "topk", "sort",
        "gather", "scatter", "index_select", "tril", "triu", "repeat", "zeros_like", "ones_like", "full",
        "add_", "sub_", "mul_", "div_", "copy_", "fill_", "zero_", "masked_fill_", "clamp_")},
}
_DUNDER = {"add": "add", "radd": "add", "iadd": "add_", "sub": "sub", "rsub": "rsub", "mul": "mul",
           "rmul": "mul", "imul": "mul_", "truediv": "div", "rtruediv": "div", "div": "div", "matmul": "matmul",
           "pow": "pow", "neg": "neg", "getitem": "index", "setitem": "index_put_"}

_MODULE_NAME = re.compile(r"^(?:Module|Cell)\.(?:(?P<path>.+)\.)?(?P<cls>[A-Za-z_]\w*)\."
                          r"(?P<stage>forward|backward)\.(?P<call>\d+)$")
_API_NAME = re.compile(r"^(?P<prefix>Tensor|Torch|Functional|NPU|VF|Aten|Distributed|Jit|Mint|MintFunctional|"
                       r"Primitive|torch\.nn\.functional|torch\.Tensor|torch\.ops\.aten|torch\._VF|torch|F|"
                       r"nn\.functional|mindspore(?:\.\w+)*)\.(?P<api>\w+)"
                       r"(?:\.(?P<call>\d+|default|Tensor|Scalar|out))?(?:\.(?P<stage>forward|backward))?$")
_ATEN_PREFIXES = ("Aten", "torch.ops.aten")


def _aten_pattern(ops: tuple[str, ...]) -> str:
    return r"^aten\.(" + "|".join(ops) + r")\."       # names are identifiers or regexes


def _api_ops(entry: str, m: re.Match) -> tuple[str, ...]:
    """The aten ops of one API name, or a one-line ConfigError saying how to write them."""
    prefix, api = m["prefix"], m["api"]
    if prefix in _ATEN_PREFIXES:
        return (api,)
    if api.startswith("__") and api.endswith("__"):
        api = _DUNDER.get(api.strip("_"), api.strip("_"))
    if prefix.startswith("mindspore") or prefix in ("Mint", "MintFunctional", "Primitive", "NPU", "Distributed"):
        raise ConfigError(f"config: list entry {entry!r} names a {prefix.split('.')[0]} API, which this probe does "
                          "not map; write the op name as recorded (a regex, e.g. 'allreduce' or '^npu\\\\.'), "
                          "`dispatchprobe show RUN` lists them")
    if api not in API_TO_ATEN:
        raise ConfigError(f"config: list entry {entry!r} is an API name dispatchprobe does not map to aten ops; "
                          f"write the aten op it runs instead (e.g. '{api}' or '^aten\\\\.{api}\\\\.'), "
                          "`dispatchprobe show RUN` lists the recorded names")
    return API_TO_ATEN[api]


def msprobe_scope(entries: list[str], notes: list[str], *, may_move: bool) -> tuple[list[str], list[str]]:
    """msprobe module names (``Module.<attribute path>.<Class>.<forward|backward>.<call>``) become
    ``*.<attribute path>`` (any root module); API names go to ``list`` when ``may_move`` (msprobe's
    free benchmark takes API calls in scope).  Returns (scope, entries for list)."""
    scope, to_list, mapped = [], [], []
    for entry in entries:
        m = _MODULE_NAME.match(entry)
        if m:
            scope.append(f"*.{m['path']}" if m["path"] else "*")
            mapped.append(f"{entry!r} -> {scope[-1]!r}")
        elif _API_NAME.match(entry):
            if not may_move:
                raise ConfigError(f"config: scope entry {entry!r} is an API name, not a module scope, and list is "
                                  "set too; put API names in list (their aten ops, every call)")
            to_list.append(entry)
        else:
            scope.append(entry)
    if mapped:
        pair = "; msprobe reads two names as the range between them" if len(entries) == 2 else ""
        notes.append(f"config: scope: msprobe module names read as module scopes (the module and its submodules, "
                     f"every call, forward and backward{pair}): {', '.join(mapped)}")
    if to_list:
        notes.append(f"config: scope: API names {to_list} read as list entries (every call of their aten ops; "
                     "msprobe reads two API names in scope as the range of calls between them)")
    return scope, to_list


def msprobe_list(entries: list[str], notes: list[str], *, may_move: bool) -> tuple[list[str], list[str]]:
    """msprobe API names (``Functional.linear.0.forward``, ``Tensor.add``) and torch API names
    (``torch.nn.functional.linear``) become a regex of the aten ops they run (:data:`API_TO_ATEN`);
    msprobe module names (level mix) go to ``scope`` when nothing else is in list and scope is empty.
    Other entries are aten names, substrings or regexes.  Returns (list, entries for scope)."""
    names, modules, mapped = [], [], []
    for entry in entries:
        if _MODULE_NAME.match(entry):
            modules.append(entry)
            continue
        m = _API_NAME.match(entry)
        if m:
            names.append(_aten_pattern(_api_ops(entry, m)))
            mapped.append(f"{entry!r} -> {names[-1]!r}")
        else:
            names.append(entry)
    if modules:
        if names or not may_move:
            raise ConfigError(f"config: list entry {modules[0]!r} is a module name; list and scope both filter "
                              "(an op must pass both), so put module names in scope")
        notes.append(f"config: list: module names {modules} read as scope (every op inside them)")
    if mapped:
        notes.append("config: list: API names read as the aten ops they run (every call, forward and backward, "
                     f"wherever they run): {', '.join(mapped)}")
    to_scope, _ = msprobe_scope(modules, notes, may_move=False) if modules else ([], [])
    return list(dict.fromkeys(names)), to_scope
