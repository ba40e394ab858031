"""``seed_all``: make two runs comparable with one call (msprobe's ``seed_all(seed, mode)``).

Seeds every generator a training step draws from (Python ``random``, numpy, torch on CPU and
every CUDA/NPU device, MindSpore where importable); ``mode=True`` also makes kernels
deterministic.  The probe calls it when its config holds ``seed`` or ``is_deterministic: true``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import random
import sys

CUBLAS_WORKSPACE = ":4096:8"
log = logging.getLogger("dispatchprobe")


class Seeded(dict):
    """What :func:`seed_all` changed, setting -> value; ``str()`` is the one line it logged."""

    def __str__(self) -> str:
        return "dispatchprobe.seed_all: " + "; ".join(f"{k}={v}" for k, v in self.items())


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False) -> Seeded:
    """Seed ``random``, numpy, torch (CPU, CUDA, NPU) and MindSpore with ``seed``.

    ``mode=True``: deterministic algorithms (``torch.use_deterministic_algorithms(True)``: an op
    without a deterministic kernel raises), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS reads it
    when its first handle is made: call this before any CUDA matmul), cuDNN deterministic with
    benchmarking off, ``HCCL_DETERMINISTIC=true`` for NPU collectives.  ``mode=False`` leaves
    those settings as they are.  ``PYTHONHASHSEED`` is set for child processes; this process's
    string hashing was fixed when it started.  ``rm_dropout=True`` (msprobe's switch): torch's
    functional dropouts, which ``nn.Dropout*`` modules call, and ``scaled_dot_product_attention``'s
    ``dropout_p`` run with ``p=0`` from then on, so runs on devices with different generators (or
    eager against compiled code) compare.  Returns what was changed and logs it as one line.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed_all: seed must be an integer in [0, 2**32), got {seed!r}")
    if not isinstance(mode, bool):
        raise ValueError(f"seed_all: mode must be True or False, got {mode!r}")
    if not isinstance(rm_dropout, bool):
        raise ValueError(f"seed_all: rm_dropout must be True or False, got {rm_dropout!r}")
    done = Seeded(seed=seed)
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    done["PYTHONHASHSEED"] = f"{seed} (child processes)"
    import numpy as np
    np.random.seed(seed)
    seeded = ["random", "numpy"]
    torch = _optional("torch")
    if torch is not None:
        torch.manual_seed(seed)                  # CPU and every CUDA device
        seeded.append("torch")
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)
            seeded.append("cuda")
        npu = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "manual_seed_all"):
            npu.manual_seed_all(seed)
            seeded.append("npu")
    ms = sys.modules.get("mindspore")      # seeded when the program uses it; never imported here (3 s)
    if ms is not None:
        ms.set_seed(seed)
        seeded.append("mindspore")
    done["seeded"] = ",".join(seeded)
    if mode:
        done.update(_deterministic(torch, ms))
    if rm_dropout and torch is not None:
        done["dropout p=0"] = ",".join(_without_dropout(torch.nn.functional)) or "already"
    elif rm_dropout:
        done["dropout p=0"] = "not done: only torch's dropouts are replaced"
    log.info(str(done))
    return done


def _deterministic(torch, ms) -> dict:
    changed = {}
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        changed["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    os.environ["HCCL_DETERMINISTIC"] = "true"
    changed["HCCL_DETERMINISTIC"] = "true"
    if torch is not None:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        changed["torch.use_deterministic_algorithms"] = True
        changed["cudnn.deterministic"] = True
        changed["cudnn.benchmark"] = False
    if ms is not None and hasattr(ms, "set_deterministic"):
        try:
            ms.set_deterministic(True)
        except RuntimeError:     # "can not be set repeatedly": set once per process, by an earlier call
            pass
        changed["mindspore.set_deterministic"] = True
    return changed


def _without_dropout(functional) -> list[str]:
    """msprobe's ``rm_dropout``: each dropout of ``torch.nn.functional`` replaced by one that runs it
    with ``p=0`` (modules look them up at each call; those made before are covered too)."""
    replaced = []
    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
        fn = getattr(functional, name, None)
        if fn is None or getattr(fn, "p_is_zero", False):
            continue

        def p_zero(input, p=0.5, *args, dropout=fn, **kwargs):
            return dropout(input, 0.0, *args, **kwargs)
        functools.update_wrapper(p_zero, fn)
        p_zero.p_is_zero = True
        setattr(functional, name, p_zero)
        replaced.append(name)
    attention = getattr(functional, "scaled_dot_product_attention", None)
    if attention is not None and not getattr(attention, "p_is_zero", False):
        # attention's own dropout (``dropout_p``, which transformers' models pass while training)

        def no_dropout_p(query, key, value, attn_mask=None, dropout_p=0.0, *args, attention=attention, **kwargs):
            return attention(query, key, value, attn_mask, 0.0, *args, **kwargs)
        functools.update_wrapper(no_dropout_p, attention)
        no_dropout_p.p_is_zero = True
        functional.scaled_dot_product_attention = no_dropout_p
        replaced.append("scaled_dot_product_attention")
    return replaced


def _optional(name: str):
    """The module if it is importable (and not blocked), else None."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
