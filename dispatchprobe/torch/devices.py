"""Which device this process can really run ops on: the one answer for the manifest's ``device``
and for run-ut's ``--device``.

The default torch wheel is a CUDA build, and on a machine without a GPU
``torch.accelerator.current_accelerator()`` still says ``cuda``: that names what torch was built
for, not what the machine has.  A device counts here only when its backend reports at least one
device.  That is torch's own fork-safe form of ``is_available()`` (with
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` CUDA's ``is_available`` is exactly ``device_count() > 0``): asking
the driver itself would stop run-ut's forked workers from using the GPU.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

# accelerator backends a torch without torch.accelerator (before 2.6) may have; npu once torch_npu is imported
_BACKENDS = ("cuda", "xpu", "npu", "mps", "hpu", "mtia")
# device plugins that register a backend when imported (the default device of run-ut tries them)
_PLUGINS = {"npu": "torch_npu"}


def device_count(kind: str) -> int:
    """Devices of backend ``kind`` this process sees; 0 when torch has no such backend or it fails."""
    mod = getattr(torch, kind, None)
    try:
        count = getattr(mod, "device_count", None)
        if count is not None:
            return int(count())
        avail = getattr(mod, "is_available", None)
        return int(bool(avail())) if avail is not None else 0
    except Exception:  # noqa: BLE001 - a backend that cannot even count its devices has none
        return 0


def built_accelerators() -> list[str]:
    """The accelerator backends this torch (with its loaded plugins) was built for, available or not."""
    acc = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    if acc is not None:
        try:
            dev = acc()
        except RuntimeError:
            dev = None
        return [dev.type] if dev is not None else []
    return [k for k in _BACKENDS if getattr(torch, k, None) is not None]


def available_accelerator(load_plugins: bool = False) -> str | None:
    """The type of an accelerator with a device here (``cuda``, ``npu``, ...), else None.
    ``load_plugins``: first import an installed device plugin (``torch_npu``) that is not loaded yet."""
    if load_plugins:
        for kind, module in _PLUGINS.items():
            if getattr(torch, kind, None) is None and importlib.util.find_spec(module) is not None:
                try:
                    importlib.import_module(module)
                except Exception:  # noqa: BLE001 - a broken plugin: its device is not available
                    continue
    return next((k for k in built_accelerators() if device_count(k) > 0), None)


def default_device(load_plugins: bool = False) -> str:
    """``cuda``/``npu``/... where one is available, else ``cpu``."""
    return available_accelerator(load_plugins) or "cpu"


def usable_device(name: str | None) -> torch.device:
    """``name`` (``cpu``, ``cuda[:i]``, ``npu[:i]``, any accelerator type; None or ``auto``: the
    default) as a device this machine has; ``ValueError`` naming it and why when it has not."""
    if name in (None, "", "auto"):
        return torch.device(default_device(load_plugins=True))
    kind = name.split(":")[0]
    plugin = _PLUGINS.get(kind)
    if plugin and getattr(torch, kind, None) is None:
        try:
            importlib.import_module(plugin)
        except ImportError:
            raise ValueError(f"--device {name}: needs {plugin} installed") from None
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: unknown device (expected cpu, cuda, npu, or a torch.accelerator "
                         "type)") from None
    if dev.type == "cpu":
        return dev
    count = device_count(dev.type)
    if count == 0:
        raise ValueError(f"--device {name}: not available on this machine ({_why_not(dev.type)})")
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"--device {name}: this machine has {count} {dev.type} device{'s' * (count > 1)} "
                         f"({dev.type}:0{f' to {dev.type}:{count - 1}' if count > 1 else ''})")
    return dev


def _why_not(kind: str) -> str:
    """Why backend ``kind`` has no device: its own initialisation error where it gives one."""
    mod = getattr(torch, kind, None)
    if mod is None:
        return f"this torch has no {kind} backend; a device plugin can be loaded with --import"
    if kind not in built_accelerators():
        return f"this torch ({torch.__version__}) is not built for {kind}"
    init = getattr(mod, "init", None)
    if init is not None:
        try:
            init()
        except Exception as exc:  # noqa: BLE001 - its message is the reason
            first = " ".join(str(exc).split()).split(". ")[0].rstrip(".")
            if first:
                return first
    return f"torch.{kind} sees no device"
