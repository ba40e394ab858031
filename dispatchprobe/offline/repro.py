"""``dispatchprobe repro``: one recorded op call as a standalone bug report.

A folder with the op's saved inputs (``inputs.safetensors``, their bytes copied unchanged from the
run's shards), the outputs the training process computed where they were saved
(``outputs.safetensors``), the record (``record.json``) and a script (``repro.py``) that re-runs the
call on the recorded device and dtypes and prints its error against float64 -- and the recorded
outputs' error against the same float64 run, as run-ut judges both -- with nothing but the framework
that recorded it (PyTorch, or MindSpore with numpy): what an upstream issue (the framework, a
vendor's kernel library) needs.  The script is the framework's call part (``templates/repro_<framework>.py``:
reading the inputs, running the op) followed by one driver for all (``templates/repro_driver.py``:
the run-ut rule that judges the outputs, the messages, the exit code).  Where the op name alone does
not say how to call it (MindSpore's primitive classes and call forms), the framework's replayer
resolves it when the script is written (``Replayer.call_form``), as run-ut's replay does.  The
user's own kernels (``torch.library``) travel as ``--prelude`` files the script imports.  Neutral:
no framework is imported here (but through that replayer).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
from dataclasses import dataclass, field

from ..core import op_traits
from ..records.format import walk
from ..records.reader import Part, Run, load
from ..records.writer import atomic_write_text, write_safetensors
from ..standards.loader import per_dtype, short_dtype, standard
from ..standards.metrics import FLOAT_LAYOUT
from ..standards.verdicts import category, component_dtype, judging_precision, output_trait, shortcut_floor
from .replayer import replayer_for

_TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
# manifest "framework" -> (its call part, whether the script needs the replayer's call form)
FRAMEWORKS = {"torch": ("repro_torch.py", False), "mindspore": ("repro_mindspore.py", True)}
_NAMES = {"torch": "PyTorch", "mindspore": "MindSpore"}
# the argument kinds the scripts rebuild (their ``decode``)
_REBUILT = {"tensor", "none", "bool", "int", "str", "symint", "symbool", "float", "symfloat", "complex", "list", "tuple",
            "dtype", "device", "memory_format", "layout"}
_CORE_NAMESPACES = {"aten", "prims", "quantized", "_c10d_functional", "c10d", "_quantized", "rngprims"}


@dataclass
class Repro:
    folder: str
    script: str
    record: str                  # the record's name
    step: int
    rank: int
    notes: list = field(default_factory=list)


def command(run_path, record_name: str, out: str | None = None) -> str:
    """The command line that writes the repro of ``record_name`` (what compare, run-ut and the
    overflow check print beside the op they name)."""
    folder = out or os.path.join("repro", _folder_name(record_name))
    return f"dispatchprobe repro {_quote(str(run_path))} {_quote(record_name)} -o {_quote(folder)}"


def hint(run_path, record_name: str, step: int | None = None, rank: int | None = None) -> str | None:
    """``"a standalone repro: <command>"`` for a record whose inputs were saved (None otherwise, or
    when the run cannot be read): the line compare and run-ut print under the op they name."""
    try:
        run = load(run_path)
        framework = _framework(run)
        part, rec, held = _find(run, record_name, step, rank)
        _check(rec, part, framework)
        if FRAMEWORKS[framework][1]:          # a primitive the script could not call: no command offered
            replayer_for(run).call_form(rec)
    except (ValueError, OSError, ImportError):
        return None
    where = f" --step {part.step} --rank {part.rank}" if len(held) > 1 or len(run.parts) > 1 else ""
    return f"a standalone repro: {command(run_path, record_name)}{where}"


def _folder_name(record_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", record_name)


def _quote(text: str) -> str:
    return text if re.fullmatch(r"[A-Za-z0-9_./:@+=-]+", text) else "'" + text.replace("'", "'\\''") + "'"


def write_repro(run_path, record_name: str, out: str, *, step: int | None = None, rank: int | None = None,
                preludes=()) -> Repro:
    """Write the repro folder ``out`` of the op record ``record_name`` (its name as compare, run-ut and
    overflow.csv print it) of run ``run_path``; ``step``/``rank`` choose among parts that hold it (default:
    the first, in step and rank order, whose inputs were saved).  ``preludes``: Python files defining
    custom ops, copied beside the script and imported by it first."""
    run = load(run_path)
    framework = _framework(run)
    part, rec, held_by = _find(run, record_name, step, rank)
    _check(rec, part, framework)
    form = replayer_for(run).call_form(rec) if FRAMEWORKS[framework][1] else {}
    modules = _prelude_modules(preludes)
    os.makedirs(out, exist_ok=True)
    tensors, metadata = _tensor_bytes(part, rec, _inputs(rec))
    write_safetensors(tensors, os.path.join(out, "inputs.safetensors"), metadata=metadata)
    recorded = _recorded_outputs(part, rec)
    if recorded:
        tensors, metadata = _tensor_bytes(part, rec, recorded)
        write_safetensors(tensors, os.path.join(out, "outputs.safetensors"), metadata=metadata)
    elif os.path.exists(os.path.join(out, "outputs.safetensors")):     # a folder written before
        os.remove(os.path.join(out, "outputs.safetensors"))
    for src, name in modules:
        shutil.copyfile(src, os.path.join(out, f"{name}.py"))
    atomic_write_text(os.path.join(out, "record.json"), json.dumps(rec, indent=1) + "\n")
    script = os.path.join(out, "repro.py")
    atomic_write_text(script, _script(run, part, rec, [name for _, name in modules], framework, form,
                                      {arg: f"{spec['dtype']} {list(spec['shape'])}" for arg, spec in recorded}))
    notes = []
    if len(held_by) > 1:
        notes.append(f"{len(held_by)} step/rank parts hold {record_name}: this is step {part.step} rank {part.rank} "
                     "(--step/--rank choose another)")
    namespace = rec["op"].split(".")[0]
    if framework == "torch" and namespace not in _CORE_NAMESPACES and not modules:
        notes.append(f"{rec['op']} is not a PyTorch op: the script needs the module that defines it "
                     "(--prelude FILE copies it beside the script)")
    return Repro(folder=out, script=script, record=record_name, step=part.step, rank=part.rank, notes=notes)


def _framework(run: Run) -> str:
    """The framework that recorded ``run``; a one-line error for one repro writes no script for."""
    framework = run.manifest.get("framework") or "torch"
    if framework not in FRAMEWORKS:
        raise ValueError(f"{run.path} is a {framework} run: repro writes scripts for "
                         f"{', '.join(_NAMES.get(f, f) for f in FRAMEWORKS)} (replay a {framework} op with "
                         "dispatchprobe run-ut --api)")
    return framework


def base(op: str) -> str:
    return op_traits.base_name(op)


def _find(run: Run, name: str, step, rank) -> tuple[Part, dict, list]:
    """(part, record, the parts holding it) of the record named ``name``; a one-line error naming
    the closest names when no part holds it."""
    held = []
    for key in sorted(run.parts):
        if (step is not None and key[0] != step) or (rank is not None and key[1] != rank):
            continue
        part = run.parts[key]
        for rec in part.records:
            if rec.get("name") == name:
                held.append((part, rec))
                break
    if not held:
        where = "".join(f" {w} {v}" for w, v in (("step", step), ("rank", rank)) if v is not None)
        names = {r.get("name") for p in run.parts.values() for r in p.records if r.get("kind") == "op"}
        near = difflib.get_close_matches(name, sorted(n for n in names if n), n=3, cutoff=0.85)
        raise ValueError(f"no record named {name!r} in {run.path}{where}"
                         + (f" (did you mean {', '.join(near)}?)" if near else
                            " (a record name as compare, run-ut and overflow.csv print it, e.g. "
                            f"{min(names) if names else 'aten.mm.default.0.forward'})"))
    saved = [(p, r) for p, r in held if _inputs_saved(r)]
    part, rec = (saved or held)[0]
    return part, rec, held


def _inputs_saved(rec: dict) -> bool:
    return "inputs" in rec and all(s.get("data") is not None or s.get("undefined")
                                   for _, _, s in walk(rec, outputs=False))


def _check(rec: dict, part: Part, framework: str = "torch") -> None:
    """One line for each record that cannot make a repro (before any file is written); a MindSpore
    primitive that cannot be called again (random, unknown) is refused by its replayer's call form."""
    name = rec.get("name")
    if rec.get("kind") != "op" or (framework == "torch" and len(rec["op"].split(".")) != 3):
        raise ValueError(f"{name} is a {rec.get('kind')} record, not an op call: repro one of the ops inside it")
    if framework == "torch" and op_traits.is_random(rec["op"]):
        raise ValueError(f"{name} is a random op ({base(rec['op'])}): its output cannot be reproduced from its inputs")
    if rec.get("inputs_overwritten"):
        raise ValueError(f"{name}: its inputs were written in place before they were saved: no repro")
    if "inputs" not in rec:
        raise ValueError(f"{name}: its inputs were not recorded (the config's io filter)")
    for _, arg, spec in walk(rec, outputs=False, tensors_only=False):
        if spec.get("type") == "generator":
            raise ValueError(f"{name}: {arg} is a random generator: the op is random")
        if spec.get("type") not in _REBUILT:
            raise ValueError(f"{name}: {arg} ({spec.get('repr', spec.get('type'))}) cannot be rebuilt from the record")
    for _, arg, spec in walk(rec, outputs=False):
        if spec.get("no_values"):
            raise ValueError(f"{name}: {arg} has no values to save ({spec['no_values']}): no repro")
    if not _inputs_saved(rec):
        raise ValueError(f"{name}: its input tensors were not saved ({part.path} holds statistics only): record "
                         "the run with task='tensor' (list=[...] or scope=[...] keep it small) to repro the op")
    missing = [arg for _, arg, s in walk(rec, outputs=False) if s.get("data") and not part.has_tensor(s["data"])]
    if missing:
        raise ValueError(f"{name}: saved tensor of {missing[0]} is missing from {part.path} (the run ended before "
                         "its shard was written)")


def _prelude_modules(preludes) -> list[tuple[str, str]]:
    """(file, module name) of each prelude: a Python file whose name is a module name."""
    out = []
    for src in preludes:
        stem, ext = os.path.splitext(os.path.basename(src))
        if ext != ".py" or not stem.isidentifier() or stem == "repro":
            raise ValueError(f"--prelude {src}: a Python file named as a module (my_kernels.py), not 'repro.py'")
        if not os.path.isfile(src):
            raise FileNotFoundError(f"--prelude {src}: no such file")
        out.append((src, stem))
    return out


def _inputs(rec: dict) -> list:
    return [(arg, spec) for _, arg, spec in walk(rec, outputs=False) if spec.get("data") is not None]


def _recorded_outputs(part: Part, rec: dict) -> list:
    """[(output, spec)] of the outputs the training process saved that can be judged (as run-ut's
    recorded outputs): not undefined contents, not saved as the same tensor as an input (one saved
    value cannot be both an argument the op writes before the op and the output after it), its
    shard written."""
    def stored(key):
        return part.views[key]["base"] if key in part.views else key
    before = {stored(spec["data"]) for _, spec in _inputs(rec)}
    return [(arg, spec) for _, arg, spec in walk(rec, inputs=False)
            if spec.get("data") is not None and not spec.get("undefined")
            and output_trait(rec["op"], arg) != "undefined" and stored(spec["data"]) not in before
            and part.has_tensor(spec["data"])]


def _tensor_bytes(part: Part, rec: dict, specs: list) -> tuple[dict, dict]:
    """{argument: (safetensors dtype code, shape, bytes)} of saved tensors ``[(argument, spec)]``,
    copied from the run's shards unchanged, and the metadata of those stored in another form (a
    dtype safetensors lacks, a view rebuilt from its base)."""
    entries, metadata, headers = {}, {}, {}
    for arg, spec in specs:
        key = spec["data"]
        view = part.views.get(key)
        stored = view["base"] if view else key
        shard = os.path.join(part.path, "tensors", part.shards[stored])
        if shard not in headers:
            headers[shard] = _header(shard)
        head, start_of_data = headers[shard]
        info = head[stored]
        begin, end = info["data_offsets"]
        with open(shard, "rb") as f:
            f.seek(start_of_data + begin)
            data = f.read(end - begin)
        entries[arg] = (info["dtype"], info["shape"], memoryview(data))
        meta = json.loads((head.get("__metadata__") or {}).get(stored) or "{}")
        if view:
            meta["view"] = {"shape": view["shape"], "stride": view["stride"], "offset": view["offset"]}
        if meta:
            metadata[arg] = json.dumps(meta)
    return entries, metadata


def _header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _device(run: Run, rec: dict) -> str:
    for _, _, spec in walk(rec):
        if spec.get("device"):
            return spec["device"]
    return run.manifest.get("device") or "cpu"


def _judged_dtype(rec: dict) -> str:
    """The dtype run-ut's tolerances come from: the first floating output's (else the first input's)."""
    for io_outputs in (True, False):
        for _, _, spec in walk(rec, inputs=not io_outputs, outputs=io_outputs):
            if "float" in str(spec.get("dtype")) or "complex" in str(spec.get("dtype")):
                return spec["dtype"]
    return "float32"


def _script(run: Run, part: Part, rec: dict, preludes: list, framework: str, form: dict, recorded: dict) -> str:
    dtype = component_dtype(_judged_dtype(rec))
    judged_at = short_dtype(judging_precision(dtype, [spec["dtype"] for _, _, spec in walk(rec, outputs=False)
                                                      if spec.get("dtype")]))
    mantissa, min_exponent = FLOAT_LAYOUT.get(dtype, FLOAT_LAYOUT["float32"])
    bench, thr = standard()["benchmark"], standard("api_precision_standard")["thresholds"]
    rule = {"category": category(rec["op"]), "dtype": dtype,
            "cosine_min": bench["cosine_min"], "max_abs_pass": bench["max_abs_pass"], "judged_at": judged_at,
            "shortcut_floor": shortcut_floor(judged_at),
            "tiers": [float(t) for t in per_dtype("benchmark.tiers", judged_at)],
            "small_value": float(per_dtype("small_value", dtype)),
            "small_value_atol": float(per_dtype("small_value_atol", dtype)),
            "relative_limit": float(per_dtype("free_benchmark_threshold", dtype)),
            "ulp_threshold": float(per_dtype("ulp_threshold", dtype)), "ulp": dict(thr["ulp"]),
            "mantissa": mantissa, "min_exponent": min_exponent,
            # outputs whose contents the op leaves undefined: never judged (as run-ut)
            "undefined_outputs": [arg for _, arg, spec in walk(rec, inputs=False, tensors_only=False)
                                  if spec.get("undefined") or output_trait(rec["op"], arg) == "undefined"],
            "thousandth_min": float(thr["thousandth_min"]),
            "thousandth_tolerance": float(per_dtype(thr["thousandth_tolerance"], dtype))}
    call = {"inputs": rec.get("inputs") or [], "kwargs": rec.get("kwargs") or {}}
    device = _device(run, rec)
    title = (f"Repro of {rec['op']}: record {rec['name']} ({rec.get('stage')}, module "
             f"{rec.get('scope') or '<top>'}), step {part.step} rank {part.rank} of {run.path}, {framework} "
             f"{run.manifest.get('framework_version')}")
    fills = {"title": title, "device": device, "op": repr(rec["op"]), "device_literal": repr(device),
             "call": repr(json.dumps(call, separators=(",", ":"))), "preludes": repr(list(preludes)),
             "rule": repr(json.dumps(rule)), "form": repr(json.dumps(form)),
             "recorded": repr(json.dumps(recorded))}
    with open(os.path.join(_TEMPLATES, FRAMEWORKS[framework][0]), encoding="utf-8") as f:
        text = f.read()
    with open(os.path.join(_TEMPLATES, "repro_driver.py"), encoding="utf-8") as f:
        fills["driver"] = f.read()
    return re.sub(r"\{\{(\w+)\}\}", lambda m: fills[m.group(1)], text)
