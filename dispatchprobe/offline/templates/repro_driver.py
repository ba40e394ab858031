

# ---- the driver, the same for every framework (templates/repro_driver.py) ----
# The framework part above defines: OP, DEVICE, HERE, PRELUDES, RULE, RECORDED, FRAMEWORK (name and version),
# xp (its array module: torch or numpy), prepare, load_inputs, input_dtypes, run_device,
# run_benchmark, host_pair and describe.  The judging below uses only what torch and numpy share.


class CannotRun(Exception):
    """The call cannot be run here; the message says why (exit code 1, never a verdict)."""


def leaves(value, name="output"):
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in leaves(v, f"{name}.{i}")]
    return [(name if name != "output" else "output.0", value)]


def count(a):
    return int(math.prod(a.shape))


def share(mask):
    """The share of true elements (1.0 of none)."""
    n = count(mask)
    return float(mask.sum()) / n if n else 1.0


def judge(d, b, exact):
    """(verdict, the numbers) of one output against float64, by the rule run-ut judges this op's outputs
    with (RULE["category"], thresholds of the recorded dtype): inf/nan where float64 has none (or the
    other way) is an error under every rule; integer and bool outputs (``exact``) must be equal."""
    if exact:
        bad = int((d != b).sum())
        return ("pass" if bad == 0 else "error"), f"{bad} of {count(d)} elements differ (binary rule)"
    finite_d, finite_b = xp.isfinite(d), xp.isfinite(b)
    mismatch = int((finite_d != finite_b).sum()) + int(
        ((~finite_d & ~finite_b) & (d != b) & ~(xp.isnan(d) & xp.isnan(b))).sum())
    both = finite_d & finite_b
    d, b = d[both], b[both]
    err = xp.abs(d - b)
    mag = xp.abs(b)
    n = count(err)
    max_abs = float(err.max()) if n else 0.0
    rel = err / mag.clip(min=RULE["small_value"])
    nd, nb = float((xp.abs(d) ** 2).sum()) ** 0.5, float((xp.abs(b) ** 2).sum()) ** 0.5
    cosine = float((d * b.conj()).real.sum()) / (nd * nb) if nd and nb else (1.0 if nd == nb else float("nan"))
    tiers = RULE["tiers"]
    shares = {tol: share(rel <= tol) for tol in tiers}
    text = (f"max abs error {max_abs:.6g}, max rel error {float(rel.max()) if n else 0.0:.6g}, "
            f"cosine {cosine:.6f}, inf/nan mismatches {mismatch}, within relative error "
            + ", ".join(f"{tol:g}: {s:.4%}" for tol, s in shares.items())
            + ("" if n else " (no element is finite on both sides)"))
    rule = RULE["category"]
    if mismatch:
        return "error", text
    if rule == "binary":
        bad = int((err > 0).sum())
        return ("pass" if bad == 0 else "error"), text + f"; {bad} elements differ"
    if rule == "absolute_threshold":
        small = mag < RULE["small_value"]
        rel_rate = share(rel[~small] > RULE["relative_limit"]) if count(rel[~small]) else 0.0
        abs_rate = share(err[small] > RULE["small_value_atol"]) if count(err[small]) else 0.0
        text += f"; relative error rate {rel_rate:.3g}, small-value error rate {abs_rate:.3g}"
        return ("error" if rel_rate > 0 or abs_rate > 0 else "pass"), text
    if rule == "ulp":
        # the ULP at the float64 value: 2^(its exponent - mantissa bits), subnormals at the smallest normal's
        exponent = xp.floor(xp.log2(mag.clip(min=2.0 ** RULE["min_exponent"])))
        ulp = err / xp.exp2(exponent - RULE["mantissa"])
        over = share(ulp > RULE["ulp_threshold"]) if n else 0.0
        mean = float(ulp.sum()) / n if n else 0.0
        text += f"; ULP mean {mean:.3g}, share over {RULE['ulp_threshold']:g} ULP {over:.3g}"
        u = RULE["ulp"]
        if RULE["dtype"] in ("float16", "bfloat16"):
            return ("pass" if over < u["half_over_threshold"] else "error"), text
        return ("pass" if mean < u["float32_ulp_mean"] or over < u["float32_over_threshold"] else "error"), text
    if rule == "thousandth":
        return ("pass" if share(rel <= RULE["thousandth_tolerance"]) > RULE["thousandth_min"] or not n
                else "error"), text
    if not math.isnan(cosine) and cosine <= RULE["cosine_min"]:
        return "error", text
    limit = shortcut_limit(float(mag.max()) if n else 0.0)
    if math.isnan(cosine) and max_abs >= limit:
        return "error", text + f" (one side is all zeros; max abs error >= {limit:.3g})"
    if max_abs < limit:
        return "pass", text
    for (tol, s), verdict in zip(shares.items(), ("error", "warning")):
        if s < 1 - tol:
            return verdict, text
    return "pass", text


def shortcut_limit(magnitude):
    """The max abs error below which a benchmark output passes, as run-ut's (verdicts.shortcut_limit):
    max_abs_pass scaled by the float64 output's magnitude below 1, never below the dtype's floor
    (its smallest normal, or small values' absolute tolerance where lower: verdicts.shortcut_floor)."""
    limit = RULE["max_abs_pass"] * (magnitude if 0.0 < magnitude < 1.0 else 1.0)
    return max(limit, RULE["shortcut_floor"])


_RULE_KEYS = {"benchmark": ("cosine_min", "max_abs_pass", "shortcut_floor", "tiers"), "ulp": ("ulp_threshold", "ulp"),
              "binary": (),
              "absolute_threshold": ("small_value", "small_value_atol", "relative_limit"),
              "thousandth": ("thousandth_min", "thousandth_tolerance")}


def rule_text():
    """The rule and the thresholds it used, for the verdict line."""
    used = {k: RULE[k] for k in _RULE_KEYS.get(RULE["category"], _RULE_KEYS["benchmark"])}
    judged_at = f" (judged at {RULE['judged_at']}, its lowest-precision float input)" \
        if RULE["category"] == "benchmark" and RULE["judged_at"] != RULE["dtype"] else ""
    return f"run-ut's {RULE['category']} rule for {RULE['dtype']}{judged_at}: {json.dumps(used)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=DEVICE, help=f"device of the recorded-dtype run (recorded: {DEVICE})")
    wanted = ap.parse_args().device
    sys.path.insert(0, HERE)
    for name in PRELUDES:          # the user's own kernels, copied beside this script
        __import__(name)
    try:
        device, func, bench_place = prepare(wanted)
    except CannotRun as exc:
        print(exc)
        return 1
    tensors = load_inputs(os.path.join(HERE, "inputs.safetensors"))
    try:
        dev = leaves(run_device(func, tensors, device))
    except Exception as exc:          # the op's own failure on the device
        print(f"{OP} failed on {device}: {type(exc).__name__}: {exc}")
        return 1
    try:
        bench = leaves(run_benchmark(func, tensors))
    except CannotRun as exc:
        print(f"{OP} could not run in float64 {bench_place} ({exc}): no benchmark, not judged")
        return 1
    dtypes = input_dtypes(tensors)
    print(f"{OP} on {device} ({', '.join(dtypes) or 'no tensor inputs'}) against float64 {bench_place}, {FRAMEWORK}")
    worst, worst_recorded = [], []
    for (out_name, d), (_, b) in zip(dev, bench):
        if d is None and b is None:
            continue
        if out_name in RULE["undefined_outputs"]:
            print(f"  {out_name} {describe(d)}: not judged: contents left undefined by the op")
            continue
        verdict, text = judge(*host_pair(d, b))
        print(f"  {out_name} {describe(d)}: {verdict}: {text}")
        worst.append(verdict)
    # what the training process computed from the same inputs, against the same float64 run
    recorded = load_inputs(os.path.join(HERE, "outputs.safetensors")) if RECORDED else {}
    bench_of = dict(bench)
    for out_name, kind in RECORDED.items():
        if bench_of.get(out_name) is None:
            continue
        r, b, exact = host_pair(recorded[out_name], bench_of[out_name])
        if tuple(r.shape) != tuple(b.shape):      # an auxiliary output whose size the kernel chooses
            print(f"  recorded {out_name} {kind}: not judged: shape {list(r.shape)}, {list(b.shape)} in float64")
            continue
        verdict, text = judge(r, b, exact)
        print(f"  recorded {out_name} {kind}: {verdict}: {text}")
        worst_recorded.append(verdict)
    if "error" in worst:
        print(f"differs from float64: error ({rule_text()})")
        return 2
    if "error" in worst_recorded:
        print(f"the recorded output differs from float64: error; this run agrees: the op erred where it was "
              f"recorded (its machine, library or kernel), not here ({rule_text()})")
        return 2
    print("agrees with float64" + (" (a warning: the finer relative-error share is not met)"
                                   if "warning" in worst + worst_recorded else "") + f" ({rule_text()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
