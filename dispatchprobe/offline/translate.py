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
from collections import Counter
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
    aten_layout: set = field(default_factory=set)    # aten copies standing for left-out layout primitives
    fused: list = field(default_factory=list)        # [{op, ops, inputs, outputs}]: an aten kernel vs its pieces

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
                   {**data.get("no_counterpart", {}), **extra.get("no_counterpart", {})},
                   set(data.get("aten_layout", [])) | set(extra.get("aten_layout", [])),
                   list(extra.get("fused", [])) + list(data.get("fused", [])))

    def records(self, recs: list) -> list:
        """``recs`` in aten's vocabulary (new dicts; tensor specs shared, saved data unchanged)."""
        out, calls, i, passed = [], {}, 0, []
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
                passed.append(r)
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
            if passed:
                new, passed = _through(new, r, passed), []
            out.append(new)
        return out

    def fuse(self, recs: list, other: list) -> list:
        """``recs`` (already translated) with each run of a ``fused`` entry's ops merged into one
        record of its aten op, compared at the region's boundary, where the ``other`` run records
        that op in the same cell and stage (as often as it does there): a fused kernel
        (``scaled_dot_product_attention``) against the matmuls and softmax it is made of.  Where the
        other run records the pieces too, they stay op by op."""
        if not self.fused:
            return recs
        want = Counter((r["op"], r["stage"], r["scope"]) for r in other if r["kind"] == "op")
        if not {f["op"] for f in self.fused} & {op for op, _, _ in want}:
            return recs
        ops = [k for k, r in enumerate(recs) if r["kind"] == "op"]
        drop, new_at, calls = set(), {}, Counter(r["op"] + r["stage"] for r in recs if r["kind"] == "op")
        k = 0
        while k < len(ops):
            r = recs[ops[k]]
            for f in self.fused:
                group = [recs[i] for i in ops[k:k + len(f["ops"])]]
                key = (f["op"], r["stage"], r["scope"])
                if want[key] and len(group) == len(f["ops"]) and all(
                        g["op"] == n and g["stage"] == r["stage"] and g["scope"] == r["scope"]
                        for g, n in zip(group, f["ops"])):
                    want[key] -= 1
                    new = _rewrite(group[-1], f["op"], [_pick(group, "inputs", p) for p in f["inputs"]],
                                   [_pick(group, "outputs", p) for p in f["outputs"]])
                    new["fused"] = len(group)
                    new["through"] = [t for g in group for t in g.get("through", ())]   # layout ops among them
                    new["call"] = calls[f["op"] + r["stage"]]
                    calls[f["op"] + r["stage"]] += 1
                    new["name"] = f"{new['op']}.{new['call']}.{new['stage']}"
                    drop.update(ops[k:k + len(group) - 1])
                    new_at[ops[k + len(group) - 1]] = new
                    k += len(group) - 1
                    break
            k += 1
        return [new_at.get(i, r) for i, r in enumerate(recs) if i not in drop]

    def aten_side(self, recs: list) -> list:
        """The PyTorch run's ``recs`` without the copies that stand for this framework's layout
        primitives, which are left out (``clone`` of a transposed view: MindSpore's ``Transpose``)."""
        if not self.aten_layout:
            return recs
        out, passed = [], []
        for r in recs:
            if r["kind"] == "op" and r["op"] in self.aten_layout:
                passed.append(r)
                continue
            out.append(_through(r, r, passed) if passed else r)
            passed = []
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
        placed = {id(x) for x in new["inputs"]}
        left = [x for x in ins if x.get("type") == "tensor" and id(x) not in placed]
        if left:   # not compared (a transposed operand), but the data flow still reads them (compare's origin)
            new["kwargs"] = {"unpaired": {"type": "list", "value": left}}
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


def _through(new: dict, old: dict, passed: list) -> dict:
    """``new`` (a copy where it is ``old``) carrying the left-out layout records run just before
    it (``through``), so the data flow still passes from their inputs to their outputs."""
    new = dict(new) if new is old else new
    new["through"] = list(old.get("through", ())) + passed
    return new


def _place(specs: list, positions) -> list:
    if positions is None:
        return list(specs)
    return [specs[p] if p is not None and p < len(specs) else _NONE for p in positions]


def _pick(group: list, key: str, where) -> dict:
    if where is None:
        return _NONE
    k, p = where
    specs = group[k].get(key, [])
    return specs[p] if p < len(specs) else _NONE


def _rewrite(record: dict, op: str, inputs: list, outputs: list) -> dict:
    new = dict(record, op=op, inputs=inputs, outputs=outputs, kwargs={}, translated_from=record["op"])
    return new
