"""The grad probe's MindSpore side: the gradients MindSpore passes to the optimizer, read by a
forward pre-hook on the optimizer cell (as msprobe does: ``optimizer(grads)`` is the step), and
measured in numpy with the same statistics as torch's (:mod:`dispatchprobe.core.grad_probe`).

Gradient ``i`` belongs to the optimizer's parameter ``i``, named by ``Parameter.name``.  The
optimizer's forward hook reports the step's end, so steps follow the optimizer unless the user
calls ``probe.step()``.  Reading a gradient with ``asnumpy()`` shares its memory: it is only read.
"""

from __future__ import annotations

import weakref

import numpy as np

from dispatchprobe.core.grad_probe import CHECKSUM_KIND, checksum_of, grad_record, has_signs, md5_of, measures, \
    pack_signs


class GradReader:
    def __init__(self, session, optimizer):
        self.handler = session.handlers[0]
        self.optimizer = optimizer
        self.names = [p.name for p in optimizer.parameters]
        ref = weakref.ref(session)

        def pre(cell, inputs):
            s = ref()
            if s is not None and s.grad_reader is not None:
                s.grad_reader.on_step(cell, inputs[0] if len(inputs) == 1 else inputs)

        def post(cell, inputs, output):
            s = ref()
            if s is not None:
                s.optimizer_stepped(cell)
        self._handles = [optimizer.register_forward_pre_hook(pre), optimizer.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def on_step(self, optimizer, gradients) -> None:
        h = self.handler
        step_on, here = h.begin(optimizer)
        if not here:
            return
        items = []
        for name, grad in zip(self.names, gradients):
            if grad is None or not h.select(name):
                continue
            x = np.asarray(grad.asnumpy())
            rec = grad_record(name, dtype=x.dtype.name, shape=list(x.shape), level=h.level, bounds=h.bounds,
                              values=[float(v) for v in measures(x, np, h.level, h.bounds)])
            if h.level == "L0" and h.md5:
                rec["md5"] = md5_of(x)
            elif h.level == "L0":
                rec["checksum"] = {"kind": CHECKSUM_KIND, "value": checksum_of(x)}
            items.append((rec, pack_signs(x) if has_signs(h.level) else None))
        h.write(items)
