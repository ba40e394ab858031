"""The torch the compiled-graph path needs, checked where a user asks for it (``probe_backend``).

The path plugs into inductor's internals: a post-grad pass the FX graph cache can key
(``torch._inductor.custom_graph_pass``, ``output_code``, ``runtime.cache_dir_utils``: from torch
2.6), the call being decomposed as ``proxy_tensor.ORIGINAL_ATEN`` holds it (a context variable
from 2.12), and the shape of the graphs and functional tensors its decompositions trace, which 2.12
still lacks (its tests fail there: ``reversed(graph.nodes)`` is no iterator, FunctionalTensor
arithmetic).  2.13 is the first torch it passes its tests on.  The eager probe has no such need
(it works from torch 2.5), so ``import dispatchprobe`` never checks this: only the call does, in one
line naming both versions, instead of an ImportError or a failed compile deep inside inductor.
"""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 13)      # the first torch the compiled path passes its tests on


def installed_torch() -> str:
    """The installed torch's version, as it calls itself (``2.5.1+cu124``)."""
    return str(torch.__version__)


def release(version: str) -> tuple[int, int]:
    """``2.13.0a0+git1234`` -> (2, 13): a development build of a release counts as that release."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def minimum() -> str:
    return ".".join(map(str, MIN_TORCH))


def require_torch(what: str = "probe_backend") -> None:
    """Raise a one-line RuntimeError when the installed torch is older than :data:`MIN_TORCH`."""
    have = installed_torch()
    if release(have) < MIN_TORCH:
        raise RuntimeError(f"{what} needs torch >= {minimum()} (the inductor internals it plugs into); this is "
                           f"torch {have}: upgrade torch, or record eagerly with DispatchProbe (torch >= 2.5)")
