"""Reading one framework's records in another's vocabulary, for cross-framework ``compare``.

A MindSpore run and a PyTorch run of one model record different ops for the same maths:
``Dense`` is ``MatMul`` + ``BiasAdd`` where aten has one ``addmm`` with its arguments in another
order; ``LayerNorm``'s third output is a variance where aten's is a reciprocal std.  A
:class:`Translation` (shipped as ``standards/data/mindspore_to_aten.yaml``, extended by the user's
``--mapping`` file) rewrites records: ops renamed with their inputs and outputs re-placed at
aten's positions, regions of primitives merged into the one op they make up (compared at its
boundary), layout-only primitives left out.  The aligner and every metric then run unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import yaml

_DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "standards", "data")
_NONE = {"type": "none"}


@dataclass
class Translation:
    ops: dict = field(default_factory=dict)        # primitive -> {op, inputs, outputs}
    regions: list = field(default_factory=list)    # [{primitives, op, inputs, outputs}]
    layout: set = field(default_factory=set)
    unobservable: dict = field(default_factory=dict)   # aten backward op -> the framework's unseen kernel
    no_counterpart: dict = field(default_factory=dict)  # aten op with integer outputs -> what it keeps (a counter)

    @classmethod
    def shipped(cls, framework: str, extra: dict | None = None) -> "Translation | None":
        """The shipped translation of ``framework``'s records into aten's, with ``extra`` (the
        same keys, from a mapping file) merged over it; None when none ships."""
        path = os.path.join(_DATA, f"{framework}_to_aten.yaml")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
        extra = extra or {}
        return cls({**data.get("ops", {}), **extra.get("ops", {})},
                   list(extra.get("regions", [])) + list(data.get("regions", [])),
                   set(data.get("layout", [])) | set(extra.get("layout", [])),
                   {**data.get("unobservable", {}), **extra.get("unobservable", {})},
                   {**data.get("no_counterpart", {}), **extra.get("no_counterpart", {})})

    def records(self, recs: list) -> list:
        """``recs`` in aten's vocabulary (new dicts; tensor specs shared, saved data unchanged)."""
        out, calls, i = [], {}, 0
        while i < len(recs):
            r = recs[i]
            if r["kind"] != "op":
                out.append(r)
                i += 1
                continue
            region = self._region_at(recs, i)
            if region is not None:
                group = recs[i:i + len(region["primitives"])]
                new = _rewrite(group[-1], region["op"], [_pick(group, "inputs", p) for p in region["inputs"]],
                               [_pick(group, "outputs", p) for p in region["outputs"]])
                i += len(group)
            elif r["op"] in self.layout:
                i += 1
                continue
            else:
                new = self._op(r)
                i += 1
            if new is not r:
                key = (new["op"], new["stage"])
                new["call"] = calls.get(key, 0)
                calls[key] = new["call"] + 1
                new["name"] = f"{new['op']}.{new['call']}.{new['stage']}"
            out.append(new)
        return out

    def _op(self, r: dict) -> dict:
        spec = self.ops.get(r["op"])
        if spec is None:
            return r
        ins = r.get("inputs", [])
        scalars = [k for k, s in enumerate(ins) if s.get("type") == "tensor" and s.get("shape") == []]
        if spec.get("scalar") and scalars and len(scalars) < len(ins):
            new = _rewrite(r, spec["scalar"], [s for k, s in enumerate(ins) if k not in scalars],
                           _place(r.get("outputs", []), spec.get("outputs")))
        else:
            full = spec.get("no_dim") and len(ins) > 1 and ins[1].get("type") == "none"   # a reduction over all dims
            new = _rewrite(r, spec["no_dim"] if full else spec["op"], _place(ins, spec.get("inputs")),
                           _place(r.get("outputs", []), spec.get("outputs")))
        if spec.get("stage"):
            new["stage"] = spec["stage"]
        return new

    def without_counterpart(self, record: dict) -> str | None:
        """What an aten ``record`` of the other run keeps, where this framework has no counterpart of
        it (an integer counter such as BatchNorm's ``num_batches_tracked``); else None."""
        what = self.no_counterpart.get(record["op"]) if record["kind"] == "op" else None
        outs = [s for s in record.get("outputs") or () if s.get("type") == "tensor"]
        if what and outs and all(s.get("dtype", "").startswith(("int", "uint")) for s in outs):
            return what
        return None

    def _region_at(self, recs: list, i: int):
        for region in self.regions:
            names = region["primitives"]
            group = recs[i:i + len(names)]
            if len(group) == len(names) and all(g["kind"] == "op" and g["op"] == n and g["stage"] == group[0]["stage"]
                                                and g["scope"] == group[0]["scope"] for g, n in zip(group, names)):
                return region
        return None


def _place(specs: list, positions) -> list:
    if positions is None:
        return list(specs)
    return [specs[p] if p is not None and p < len(specs) else _NONE for p in positions]


def _pick(group: list, key: str, where) -> dict:
    k, p = where
    specs = group[k].get(key, [])
    return specs[p] if p < len(specs) else _NONE


def _rewrite(record: dict, op: str, inputs: list, outputs: list) -> dict:
    new = dict(record, op=op, inputs=inputs, outputs=outputs, kwargs={}, translated_from=record["op"])
    return new
