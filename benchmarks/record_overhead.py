"""Cost of recording a training step: uninstrumented vs statistics vs tensor vs DebugMode vs msprobe.

Prints one table (median step time over several steps, ratio to uninstrumented, bytes and
files written per step, peak resident memory) for a small transformer, an MLP and a transformers
Llama (random init), all measured in the same run.

Each step is timed as users train: forward and backward inside the probe's ``with``, then an AdamW
step (one optimizer per model, made once) and ``probe.step()`` outside it, one probe kept over the
whole loop, parameter records on (the default).  An empty ``TorchDispatchMode`` (each op passed
straight through) is timed beside the tools: the cost of intercepting ops at all, which no tool
below autograd can go under.  The tensor task's row prints beside it the memory floor: the time
to copy the bytes it writes per step once in memory.

    python benchmarks/record_overhead.py [--steps 8] [--quick] [--device cuda] [--cases llama] [--no-rss]
                                         [--modes empty,statistics] [--cpu-time]

Peak RSS: the modes are timed in turn in one process, so their memory cannot be told apart
there; each mode is run again alone in a child process (same model, same number of steps) and
its ``VmHWM`` (peak resident set of the whole process: torch, the model, the probe) is reported.
msprobe's child runs its own uninstrumented steps first, then msprobe's: its peak is msprobe's.

The statistics modes and DebugMode are timed one step each in turn with uninstrumented steps; the
tensor task, whose steps allocate and free hundreds of MB (slowing whatever step follows), in
rounds of its own with uninstrumented steps of its own, to which its ratio is taken.

``--device``: run the three steps on an accelerator (each timed step ends with a device
synchronisation, so queued kernels are inside the time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.models import MLPNet, TinyTransformer, lm_batch, lm_loss


DEVICE = "cpu"
clock = time.perf_counter      # what a step's time is read from (record_breakdown.py may change it)


def sync() -> None:
    if DEVICE != "cpu":
        torch.accelerator.synchronize()


def transformer_case(quick: bool):
    kw = dict(vocab=512, dim=128, heads=4, layers=2, seq=64) if quick else \
        dict(vocab=1024, dim=256, heads=8, layers=4, seq=128)
    model = TinyTransformer(**kw).to(DEVICE)
    tokens, targets = (t.to(DEVICE) for t in lm_batch(batch=8, seq=kw["seq"], vocab=kw["vocab"]))

    def step():
        lm_loss(model, tokens, targets).backward()
    return "transformer", model, step


def llama_case(quick: bool):
    """A transformers Llama (random init, no downloads): many small ops per step."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers, seq, batch = (128, 2, 64, 2) if quick else (256, 4, 128, 4)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    model = LlamaForCausalLM(cfg).to(DEVICE)
    ids = torch.randint(0, 1024, (batch, seq)).to(DEVICE)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
    return "llama", model, step


def mlp_case(quick: bool):
    model = MLPNet(dim=512, depth=4).to(DEVICE)
    x, y = torch.randn(256, 512).to(DEVICE), torch.randint(0, 10, (256,)).to(DEVICE)

    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return "mlp", model, step


def prefault(gb: float) -> None:
    """Writes ``gb`` GB of memory and frees it, so that pages a virtual machine's host backs on
    first touch are backed before the timing (until the host takes freed memory back)."""
    left = int(gb * 2**30)
    while left > 0:
        block = torch.empty(min(left, 2**30), dtype=torch.uint8)
        block.fill_(1)
        left -= block.numel()
        del block


def folder_size(path: str) -> tuple[int, int]:
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(root, n))
            files += 1
    return total, files


_OPTIMIZERS: dict[int, torch.optim.Optimizer] = {}


def optimizer_of(model) -> torch.optim.Optimizer:
    """The model's AdamW, made once (as a training loop makes it)."""
    if id(model) not in _OPTIMIZERS:
        _OPTIMIZERS[id(model)] = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return _OPTIMIZERS[id(model)]


def time_steps(model, step, steps: int, wrap) -> list[float]:
    """Run ``steps`` timed steps (after two warm-up steps); ``wrap(i)`` gives (context, end hook)."""
    return interleaved(model, step, steps, {"only": wrap})["only"]


def interleaved(model, step, steps: int, wraps: dict) -> dict[str, list[float]]:
    """Time every mode one step at a time, in rounds, so drift in machine speed hits all alike."""
    times: dict[str, list[float]] = {label: [] for label in wraps}
    optimizer = optimizer_of(model)
    for i in range(steps + 2):          # two warm-up rounds
        for label, wrap in wraps.items():
            ctx, end = wrap(i)
            sync()
            t0 = clock()
            with ctx:
                step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            end()
            sync()
            dt = clock() - t0
            if i >= 2:
                times[label].append(dt)
    return times


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def empty_mode():
    """A ``TorchDispatchMode`` that runs each op and nothing else: the floor of intercepting ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class EmptyMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    return EmptyMode()


def copy_floor(nbytes: float) -> float:
    """Seconds to copy ``nbytes`` once in memory (median of three): the tensor task's floor."""
    if nbytes <= 0:
        return 0.0
    src = torch.ones(int(nbytes), dtype=torch.uint8)
    times = []
    for _ in range(3):
        dst = torch.empty_like(src)
        t0 = clock()
        dst.copy_(src)
        times.append(clock() - t0)
    return statistics.median(times)


# --modes: the tools timed beside the uninstrumented step, by the short name each label has
MODES = {"empty TorchDispatchMode": "empty", "dispatchprobe statistics": "statistics",
         "dispatchprobe tensor": "tensor", "torch DebugMode": "debugmode"}
TOOLS = (*MODES.values(), "msprobe")
SELECTED = set(TOOLS)


def mode_wraps(model, tmp: str, only: str | None = None) -> dict:
    """label -> wrap(i) giving (context, end hook) for one step of that mode (``only``: just it)."""
    def wanted(label: str) -> bool:
        return label == only if only is not None else MODES[label] in SELECTED
    wraps = {"uninstrumented": lambda i: (_Null(), lambda: None)}
    if wanted("empty TorchDispatchMode"):
        wraps["empty TorchDispatchMode"] = lambda i: (empty_mode(), lambda: None)
    for task in ("statistics", "tensor"):
        if not wanted(f"dispatchprobe {task}"):
            continue
        probe = DispatchProbe(task=task, dump_path=os.path.join(tmp, task), model=model)
        # step() closes the step's records (waits for its tensors): its cost is counted
        wraps[f"dispatchprobe {task}"] = lambda i, probe=probe: (probe, probe.step)
    if wanted("torch DebugMode"):
        try:
            from torch.utils._debug_mode import DebugMode
            wraps["torch DebugMode"] = lambda i: (DebugMode(), lambda: None)
        except ImportError:
            pass
    return wraps


def run_modes(case, steps: int, tmp: str, rss: bool = True):
    name, model, step = case
    wraps = mode_wraps(model, os.path.join(tmp, name))
    # the tensor task's steps allocate and free hundreds of MB: taken in turn with the others, the
    # step after each ran on memory given back and faulted in again; so it has rounds of its own,
    # against uninstrumented steps of its own (as msprobe's child has)
    tensor = "dispatchprobe tensor"
    times = interleaved(model, step, steps, {k: w for k, w in wraps.items() if k != tensor})
    own = {}
    if tensor in wraps:
        apart = interleaved(model, step, steps, {"uninstrumented": wraps["uninstrumented"], tensor: wraps[tensor]})
        times[tensor], own[tensor] = apart[tensor], apart["uninstrumented"]
    rows = []
    for label, ts in times.items():
        written = None
        if label.startswith("dispatchprobe "):
            probe = wraps[label](0)[0]
            probe.close()
            folder = os.path.join(tmp, name, label.removeprefix("dispatchprobe "))
            size, files = folder_size(folder)
            shutil.rmtree(folder, ignore_errors=True)    # a full /dev/shm slows every later copy
            written = (size / (steps + 2), files / (steps + 2))
        rows.append((label, ts, written, own.get(label), rss_of(name, label, steps, tmp) if rss else None))
    if "msprobe" in SELECTED:
        rows.append(msprobe_row(name, model, step, steps, tmp, "statistics"))
        rows.append(msprobe_row(name, model, step, steps, tmp, "tensor"))
    return name, rows


def msprobe_row(name, model, step, steps, tmp, task):
    """msprobe's PrecisionDebugger is a process-wide singleton that logs every step: run it in a
    child process per model, which also times its own uninstrumented baseline."""
    import json
    import subprocess
    import sys
    try:
        import msprobe  # noqa: F401
    except Exception:
        return (f"msprobe {task} L1", None, "not installed (pip install mindstudio-probe)", None, None)
    out = subprocess.run([sys.executable, __file__, "--msprobe-child", f"{name}:{task}", "--steps", str(steps),
                          "--tmp", tmp, "--device", DEVICE]
                         + (["--quick"] if QUICK else []) + (["--cpu-time"] if clock is time.thread_time else []),
                         capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode or not lines:
        return (f"msprobe {task} L1", None, f"failed: {out.stderr.strip().splitlines()[-1:]}", None, None)
    res = json.loads(lines[-1])
    return (f"msprobe {task} L1", res["times"], (res["bytes"], res["files"]), res["base"], res.get("rss"))


def msprobe_child(spec: str, steps: int, tmp: str) -> None:
    import json
    name, task = spec.split(":")
    case = CASE_FNS[name](QUICK)
    _, model, step = case
    base = time_steps(model, step, steps, lambda i: (_Null(), lambda: None))   # before msprobe patches torch
    from msprobe.pytorch import PrecisionDebugger
    cfg = os.path.join(tmp, f"msprobe-{name}-{task}.json")
    dump = os.path.join(tmp, f"msprobe-{name}-{task}")
    with open(cfg, "w") as f:
        json.dump({"task": task, "dump_path": dump, "rank": [], "step": [], "level": "L1",
                   task: {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}, f)
    debugger = PrecisionDebugger(config_path=cfg)

    def wrap(i):
        debugger.start(model)

        def end():
            debugger.stop()
            debugger.step()
        return _Null(), end
    times = time_steps(model, step, steps, wrap)
    size, files = folder_size(dump)
    shutil.rmtree(dump, ignore_errors=True)
    print(json.dumps({"times": times, "base": base, "bytes": size / (steps + 2), "files": files / (steps + 2),
                      "rss": peak_rss()}))


def peak_rss() -> float | None:
    """This process's peak resident set (``VmHWM``), in bytes; None where the OS does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux
    except (ImportError, OSError):
        return None


def rss_child(spec: str, steps: int, tmp: str) -> None:
    """Run one mode alone (``case:mode``) for ``steps + 2`` steps and print its peak RSS."""
    import json
    name, label = spec.split(":", 1)
    torch.manual_seed(0)
    _, model, step = CASE_FNS[name](QUICK)
    folder = os.path.join(tmp, f"rss-{name}-{os.getpid()}")
    wrap = mode_wraps(model, folder, only=label)[label]
    probe = None
    optimizer = optimizer_of(model)
    for i in range(steps + 2):
        ctx, end = wrap(i)
        probe = ctx if isinstance(ctx, DispatchProbe) else None
        with ctx:
            step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end()
        sync()
    rss = peak_rss()
    if probe is not None:
        probe.close()
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({"rss": rss}))


def rss_of(name: str, label: str, steps: int, tmp: str) -> float | None:
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, __file__, "--rss-child", f"{name}:{label}", "--steps", str(steps),
                          "--tmp", tmp, "--device", DEVICE] + (["--quick"] if QUICK else []),
                         capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1])["rss"] if not out.returncode and lines else None


QUICK = False


CASE_FNS = {"transformer": transformer_case, "mlp": mlp_case, "llama": llama_case}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="smaller transformer (for smoke runs)")
    parser.add_argument("--dump-root", default=None,
                        help="where the runs are written (default: the system temp folder); the tensor modes "
                             "are bound by its write speed: /dev/shm measures the tools without the disk")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, npu, ...: where the steps run")
    parser.add_argument("--cases", default=",".join(CASE_FNS), help="which steps, comma-separated (default: all)")
    parser.add_argument("--prefault", type=float, default=0, metavar="GB",
                        help="write GB of memory once before timing: on a virtual machine whose memory the host backs "
                             "on first touch (about 0.4 GB/s), the run's first new pages (the tensor modes' files, "
                             "msprobe's) would otherwise pay that, not the tools")
    parser.add_argument("--modes", default=",".join(TOOLS),
                        help="which tools, comma-separated, from " + ", ".join(TOOLS) + " (default: all)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one intra-op thread, each step timed in CPU time of the stepping thread (a machine "
                             "shared with other work: wall time there measures the other work)")
    parser.add_argument("--no-rss", action="store_true",
                        help="skip the peak-RSS column (each mode run again alone in a child process)")
    parser.add_argument("--msprobe-child", help=argparse.SUPPRESS)
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global QUICK, DEVICE, SELECTED, clock
    QUICK, DEVICE, SELECTED = args.quick, args.device, set(args.modes.split(","))
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    if args.msprobe_child:
        msprobe_child(args.msprobe_child, args.steps, args.tmp)
        return
    if args.rss_child:
        rss_child(args.rss_child, args.steps, args.tmp)
        return
    prefault(args.prefault)
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="dp-bench-", dir=args.dump_root)
    where = f"device {DEVICE}" + (f" ({torch.cuda.get_device_name()})" if DEVICE == "cuda" else "")
    print(f"{where}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} timed steps per mode, "
          f"runs written under {tmp}\n")
    summary = []
    try:
        for case in (CASE_FNS[c](args.quick) for c in args.cases.split(",")):
            name, rows = run_modes(case, args.steps, tmp, rss=not args.no_rss)
            base = statistics.median(rows[0][1])
            print(f"{name}:")
            print(f"  {'mode':26s} {'median ms':>10s} {'ratio':>7s} {'MB/step':>9s} {'files/step':>10s} "
                  f"{'peak RSS MB':>11s}")
            cells = {}
            for label, times, written, own_base, rss in rows:
                if times is None:
                    print(f"  {label:26s} {written}")
                    cells[label] = "-"
                    continue
                med = statistics.median(times)
                ratio = med / (statistics.median(own_base) if own_base else base)
                mb = f"{written[0] / 1e6:9.2f}" if written else f"{'-':>9s}"
                nf = f"{written[1]:10.1f}" if written else f"{'-':>10s}"
                rs = f"{rss / 1e6:11.0f}" if rss else f"{'-':>11s}"
                floor = ""
                if written and label == "dispatchprobe tensor":
                    floor = f"  (copying its bytes once: {copy_floor(written[0]) * 1e3:.1f} ms)"
                print(f"  {label:26s} {med * 1e3:10.2f} {ratio:6.2f}x {mb} {nf} {rs}{floor}")
                cells[label] = f"{med * 1e3:.1f} ms" if label == "uninstrumented" else f"{ratio:.2f}x"
                extra = []
                if written and (label.startswith("msprobe tensor") or label == "dispatchprobe tensor"):
                    extra.append(f"{written[0] / 1e6:.0f} MB/step")
                if rss:
                    extra.append(f"RSS {rss / 1e6:.0f} MB")
                if extra:
                    cells[label] += f" ({', '.join(extra)})"
            summary.append((name, cells))
            print()
        print("msprobe runs in a child process (its debugger is a process-wide singleton); its ratio is to the\n"
              "child's own uninstrumented median.  Bytes and files: whole run folder / recorded steps.\n"
              "Peak RSS: VmHWM of a child process that ran that mode alone for the same steps (torch, the\n"
              "model and the tool together; msprobe's child ran its uninstrumented steps first).\n")
        print_summary(summary, args.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


CASES = {"transformer": ("transformer (dim 128, 2 layers, seq 64, batch 8)", "transformer (dim 256, 4 layers, seq 128, batch 8)"),
         "mlp": ("MLP (512 wide, 4 layers, batch 256)",) * 2,
         "llama": ("transformers Llama (hidden 128, 2 layers, seq 64, batch 2)",
                   "transformers Llama (hidden 256, 4 layers, seq 128, batch 4)")}
COLUMNS = ("uninstrumented", "empty TorchDispatchMode", "dispatchprobe statistics", "msprobe statistics L1", "torch DebugMode",
           "dispatchprobe tensor", "msprobe tensor L1")
TARGETS = {("transformer", "dispatchprobe statistics"): 1.10, ("mlp", "dispatchprobe statistics"): 1.20,
           ("llama", "dispatchprobe statistics"): 1.20,
           ("transformer", "dispatchprobe tensor"): 2.5, ("llama", "dispatchprobe tensor"): 3.0}


def print_summary(summary, quick: bool) -> None:
    """The table (markdown): step time uninstrumented, each tool's ratio to it."""
    print("| step | " + " | ".join(COLUMNS) + " |")
    print("| --- " * (len(COLUMNS) + 1) + "|")
    for name, cells in summary:
        print(f"| {CASES[name][0 if quick else 1]} | " + " | ".join(cells.get(c, "-") for c in COLUMNS) + " |")
    print("\ntargets (ratio to uninstrumented): " + ", ".join(f"{case} {mode.removeprefix('dispatchprobe ')} <= {v}x"
                                                       for (case, mode), v in TARGETS.items())
          + "; where the empty TorchDispatchMode alone is above a statistics target, that target is its ratio + 0.05x;"
          " statistics at or below DebugMode's ratio on every step")


if __name__ == "__main__":
    main()
