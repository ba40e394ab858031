"""Cost of the grad probe on a training step (forward, backward, optimizer step), by level.

unprobed vs ``task="grad_probe"`` at L0 (its checksum computed where the gradients are), L0 with
``checksum=True`` (msprobe's MD5, on the host), L1 and L2 on the transformer and on a larger MLP, timed in
the same run, interleaved round by round (a fresh probe per round: a probe reads every optimizer
step from its construction to its close).  Prints the median seconds per step, the ratio to
the unprobed step, and the probe's own time per step (its optimizer pre-hook, timed inside:
the part of the difference that is the probe's, less sensitive to a busy machine).  The probe's cost is per parameter and per element of the gradients, once per
optimizer step: it does not depend on how many ops the step runs.

    python benchmarks/grad_probe_overhead.py [--rounds 5] [--steps 3] [--quick] [--threads N] [--device cpu]
        [--verify] [--modes unprobed,L0,L1]

``--verify`` first checks, on ``--device``, in float32 and bfloat16, that the probed training is
bit-identical to the unprobed one and that every record (max, min, norm, signs, L2 shares; the L0
checksum computed on the device) is what numpy computes from the gradients the optimizer applied.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.models import MLPNet, TinyTransformer, lm_batch, lm_loss

MODES = ("unprobed", "L0", "L0 md5", "L1", "L2")


def workloads(quick: bool, device: str):
    """(name, model, one training step) per model."""
    torch.manual_seed(0)
    kw = dict(vocab=256, dim=64, heads=4, layers=2, seq=32) if quick else \
        dict(vocab=1024, dim=256, heads=8, layers=4, seq=128)
    tf = TinyTransformer(**kw).to(device)
    tokens, targets = (t.to(device) for t in lm_batch(batch=8, seq=kw["seq"], vocab=kw["vocab"]))
    mlp_kw = dict(dim=256, depth=2) if quick else dict(dim=2048, depth=8)
    mlp = MLPNet(**mlp_kw).to(device)
    x = torch.randn(64, mlp_kw["dim"], device=device)
    y = torch.randint(0, 10, (64,), device=device)
    out = []
    for name, model, loss in ((f"transformer {kw}", tf, lambda m: lm_loss(m, tokens, targets)),
                              (f"MLP {mlp_kw}", mlp, lambda m: torch.nn.functional.cross_entropy(m(x), y))):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, loss=loss, opt=opt):
            loss(model).backward()
            opt.step()
            opt.zero_grad()
        n = sum(p.numel() for p in model.parameters())
        out.append((f"{name}: {n / 1e6:.2f}M params", model, step))
    return out


def verify(device: str) -> None:
    import numpy as np

    import dispatchprobe
    from dispatchprobe.core.grad_probe import checksum_of, read_signs
    tmp = tempfile.mkdtemp(prefix="grad-probe-verify-")

    def run(path, dtype, level="L2"):
        torch.manual_seed(0)
        model = MLPNet(dim=96, depth=2).to(device=device, dtype=dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        probe = DispatchProbe(task="grad_probe", dump_path=path, grad_level=level, bounds=[-0.01, 0, 0.01],
                              model=model) if path else None
        gen = torch.Generator(device=device).manual_seed(1)
        seen, raw = [], []
        for _ in range(3):
            x = torch.randn(32, 96, device=device, generator=gen).to(dtype)
            torch.nn.functional.cross_entropy(model(x).float(), torch.arange(32, device=device) % 10).backward()
            seen.append({n: p.grad.float().cpu().numpy() for n, p in model.named_parameters()})
            raw.append({n: p.grad.cpu().reshape(-1).view(torch.uint8).numpy() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        if probe is not None:
            probe.close()
        return seen, [p.detach().clone() for p in model.parameters()], raw

    for dtype in (torch.float32, torch.bfloat16):
        path = os.path.join(tmp, str(dtype))
        seen, probed, _ = run(path, dtype)
        _, plain, _ = run(None, dtype)
        assert all(torch.equal(a, b) for a, b in zip(probed, plain)), f"{dtype}: probed training differs"
        run_ = dispatchprobe.load(path)
        edges = [-np.inf, -0.01, 0, 0.01, np.inf]
        for step, grads in enumerate(seen):
            part = run_.part(step, 0)
            for rec in part.grads:
                g, st = grads[rec["param"]], rec["stats"]
                assert (st["max"], st["min"]) == (float(g.max()), float(g.min())), (rec["param"], st)
                assert abs(st["norm"] - np.linalg.norm(g.astype(np.float64))) <= 1e-5 * st["norm"], (rec["param"], st)
                assert np.array_equal(read_signs(part, rec), g > 0), rec["param"]
                want = [float(((g > lo) & (g <= hi)).mean()) for lo, hi in zip(edges, edges[1:])]
                assert np.allclose(rec["distribution"]["shares"], want, atol=1e-9), (rec["distribution"], want)
                assert abs(rec["distribution"]["zero"] - float((g == 0).mean())) < 1e-9
        _, _, raw = run(os.path.join(tmp, f"{dtype}-L0"), dtype, "L0")
        l0 = dispatchprobe.load(os.path.join(tmp, f"{dtype}-L0"))
        for step, grads in enumerate(raw):
            for rec in l0.part(step, 0).grads:
                assert rec["checksum"]["value"] == checksum_of(grads[rec["param"]]), (rec["param"], rec["checksum"])
        print(f"verify {device} {dtype}: training bit-identical, {len(seen)} steps x {len(part.grads)} parameters "
              "match numpy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and mode")
    ap.add_argument("--quick", action="store_true", help="tiny models (checks the script runs)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--verify", action="store_true", help="check the records against numpy first")
    opts = ap.parse_args()
    if opts.verify:
        verify(opts.device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    modes = [m.strip() for m in opts.modes.split(",")]
    if "unprobed" not in modes or not set(modes) <= set(MODES):
        ap.error(f"--modes: 'unprobed' and any of {', '.join(MODES[1:])}")
    sync = torch.cuda.synchronize if opts.device.startswith("cuda") else (lambda: None)
    tmp = tempfile.mkdtemp(prefix="grad-probe-bench-")
    print(f"torch {torch.__version__}  device {opts.device}  threads {torch.get_num_threads()}  "
          f"rounds {opts.rounds} x {opts.steps} steps")
    for name, model, step in workloads(opts.quick, opts.device):
        step()                                          # warm-up: optimizer state, allocator
        times = {m: [] for m in modes}
        own = {m: [] for m in modes}
        for _ in range(opts.rounds):
            for mode in modes:
                level, md5 = mode.split()[0], mode.endswith("md5")
                probe = None if mode == "unprobed" else DispatchProbe(
                    task="grad_probe", grad_level=level, checksum=md5, dump_path=os.path.join(tmp, mode.replace(" ", "-")),
                    model=model, overwrite=True)
                spent = [0.0]
                if probe is not None:
                    read = probe.grad_reader.on_step

                    def timed(optimizer, read=read, spent=spent):
                        t = time.perf_counter()
                        read(optimizer)
                        sync()
                        spent[0] += time.perf_counter() - t
                    probe.grad_reader.on_step = timed
                step()                                  # the probe's first step (opens its run)
                sync()
                spent[0] = 0.0
                t0 = time.perf_counter()
                for _ in range(opts.steps):
                    step()
                sync()
                times[mode].append((time.perf_counter() - t0) / opts.steps)
                own[mode].append(spent[0] / opts.steps)
                if probe is not None:
                    probe.close()
        base = statistics.median(times["unprobed"])
        print(f"\n{name}")
        print(f"{'mode':10} {'s/step':>10} {'ratio':>7} {'probe s/step':>13} {'probe/unprobed':>15}")
        for mode in modes:
            med, mine = statistics.median(times[mode]), statistics.median(own[mode])
            print(f"{mode:10} {med:10.5f} {med / base:7.3f}x {mine:13.5f} {mine / base:14.3f}x")


if __name__ == "__main__":
    main()
