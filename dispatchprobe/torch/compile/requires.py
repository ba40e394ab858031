"""The torch the compiled-graph path needs, checked where a user asks for it (``probe_backend``).

The path plugs into inductor through ``torch._inductor.custom_graph_pass`` (a post-grad pass the
FX graph cache can key), ``torch._inductor.output_code`` and
``torch._inductor.runtime.cache_dir_utils``, which first shipped in torch 2.6.  The eager probe has
no such need (it works from torch 2.5), so ``import dispatchprobe`` never checks this: only the
call does, in one line naming both versions, instead of an ImportError deep inside inductor.
"""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 6)      # the first torch whose inductor has what the compiled path plugs into


def installed_torch() -> str:
    """The installed torch's version, as it calls itself (``2.5.1+cu124``)."""
    return str(torch.__version__)


def release(version: str) -> tuple[int, int]:
    """``2.6.0a0+git1234`` -> (2, 6): a development build of a release counts as that release."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def require_torch(what: str = "probe_backend") -> None:
    """Raise a one-line RuntimeError when the installed torch is older than :data:`MIN_TORCH`."""
    have = installed_torch()
    if release(have) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise RuntimeError(f"{what} needs torch >= {need} (its inductor's custom graph passes); this is torch "
                           f"{have}: upgrade torch, or record eagerly with DispatchProbe (torch >= 2.5)")
