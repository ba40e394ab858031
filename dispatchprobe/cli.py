"""The ``dispatchprobe`` command line (click).  Expected failures (bad paths, corrupt records, bad
options) are one line on stderr and exit code 1 (docs/architecture.md); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading

import click

from .core.config import ConfigError
from .records.reader import RecordError

# Errors a user can cause; anything else is our bug and keeps its traceback.
USER_ERRORS = (RecordError, ConfigError, FileNotFoundError, NotADirectoryError, PermissionError, ValueError)


class ProbeGroup(click.Group):
    """Runs every command with one-line errors unless ``--debug``."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            if ctx.meta.get("dispatchprobe.debug"):
                raise
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


@contextlib.contextmanager
def interruptible():
    """Ctrl-C (SIGINT) raises KeyboardInterrupt here whatever this process inherited: a shell starts
    background jobs with SIGINT ignored, and a test run or CI job started so hands that (or a blocked
    SIGINT) to every process it starts; run-ut's Ctrl-C is how --follow stops and how a run is left
    resumable.  The previous handling is put back after (a command run in-process leaves no trace)."""
    if threading.current_thread() is not threading.main_thread():
        yield                                           # only the main thread sets handlers and gets them
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = hasattr(signal, "pthread_sigmask") and signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        if previous in (signal.SIG_IGN, signal.SIG_DFL):
            signal.signal(signal.SIGINT, previous)


@click.group(cls=ProbeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="dispatchprobe")
@click.pass_context
def main(ctx, debug):
    """Find the op that made a training run go wrong."""
    ctx.meta["dispatchprobe.debug"] = debug


# an output folder: may not exist yet, must not be a file
OUT_DIR = click.Path(file_okay=False, writable=True)


def echo_table(df, max_rows: int = 40) -> None:
    import pandas as pd
    with pd.option_context("display.max_rows", max_rows, "display.max_columns", 30, "display.width", 200,
                           "display.max_colwidth", 60):
        click.echo(df.to_string(index=False) if len(df) <= max_rows else df.head(max_rows).to_string(index=False)
                   + f"\n... {len(df) - max_rows} more rows")


@main.command("build-native")
def build_native():
    """Build the native CPU statistics (once per source, compiler and platform; needs a C++ compiler).

    Without them probes record the same statistics, more slowly; a probe never builds them itself."""
    from .torch import fused_stats
    if not fused_stats.enabled():
        raise click.UsageError("DISPATCHPROBE_FUSED_STATS=0 turns the native statistics off: unset it to build")
    reason = fused_stats.build_native()
    if reason is not None:
        click.echo(f"error: the native CPU statistics did not build: {reason}", err=True)
        sys.exit(1)
    click.echo(f"built: {fused_stats.library_path()}")


@main.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--op", "--param", "op_pattern", default=None,
              help="List records whose op or name matches (substring or regex); a grad-probe run: the parameters "
                   "whose name matches, a row per step.")
@click.option("--stage", type=click.Choice(["forward", "backward"]), default=None, help="Only this stage.")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1),
              help="How many of the most frequent ops to list.")
@click.option("--limit", default=40, show_default=True, type=click.IntRange(min=1), help="Rows to print with --op.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False, writable=True),
              help="Overflow and free_benchmark runs: write the module tree with the op that first created "
                   "inf/nan (the first flagged op) marked to this file; grad-probe runs: each (--op selected) "
                   "parameter's gradient norm over the steps.")
def show(path, op_pattern, stage, top, limit, html_path):
    """Summarise a run (steps, ranks, op counts, nan/inf), or list records with --op."""
    from .offline.grad_compare import is_grad_run
    from .offline.summary import summarize, matching_records
    from .records.reader import load

    run = load(path)
    page = None
    if is_grad_run(run):
        page = _show_grads(run, op_pattern, limit, html_path)
    else:
        if html_path:
            from .offline.check_pages import check_html
            page = check_html(run)
        if op_pattern:
            rows = matching_records(run, op_pattern, stage)
            if not len(rows):
                raise ValueError(f"no record matches {op_pattern!r}{f' in {stage}' if stage else ''} "
                                 "(a substring or regex of op or record names, e.g. aten.mm)")
            echo_table(rows, max_rows=limit)
        else:
            click.echo(summarize(run, top=top, stage=stage))
            _say_repro(_first_critical(run, path))
    if page is not None:
        from .records.writer import atomic_write_text
        atomic_write_text(html_path, page)
        click.echo(f"report: {html_path}")
    damaged = [line for part in run.parts.values() for line in part.damaged_shards()]
    for problem in run.problems + damaged:
        click.echo(f"warning: {problem}", err=True)
    if damaged:
        sys.exit(1)


def _show_grads(run, pattern, limit, html_path):
    """``show`` of a grad-probe run: the per-step summary, or with --op a row per step and matching
    parameter; with --html the norm chart of the same parameters (returned, written by ``show``)."""
    from .offline.summary import grad_parameter_rows, grad_summary
    rows = grad_parameter_rows(run, pattern)
    if pattern and not len(rows):
        names = grad_parameter_rows(run)["parameter"].unique()
        raise ValueError(f"no parameter matches {pattern!r} (a substring or regex of parameter names, e.g. "
                         f"{names[0] if len(names) else 'layers.0'})")
    if pattern:
        echo_table(rows, max_rows=limit)
    else:
        click.echo(grad_summary(run))
    if not html_path:
        return None
    if not len(rows):
        raise ValueError(f"{run.path}: no gradient records to chart")
    from .offline.grad_page import norms_page
    return norms_page(rows, run.manifest, str(run.path), pattern)


@main.command()
@click.option("-o", "--out", "dump_path", default="runs/demo", show_default=True, type=OUT_DIR,
              help="Where to write the records.")
@click.option("--task", type=click.Choice(["statistics", "tensor", "overflow", "free_benchmark"]), default="tensor",
              show_default=True)
@click.option("--steps", default=2, show_default=True, help="Training steps to record.")
@click.option("--framework", type=click.Choice(["torch", "mindspore"]), default="torch", show_default=True,
              help="mindspore: the MindSpore twin on its demo net (needs the mindspore extra).")
def demo(dump_path, task, steps, framework):
    """Record a few training steps of a built-in tiny model (no downloads)."""
    if framework == "mindspore":
        try:
            from dispatchprobe_ms.demo import run_demo
        except ImportError as exc:
            raise click.ClickException(f"--framework mindspore needs MindSpore ({exc}); "
                                       'pip install -e ".[mindspore]"') from None
    else:
        from .demo import run_demo
    run_demo(dump_path, task=task, steps=steps)


# ---- offline commands (torch is imported only when run-ut runs) --------------------------------
@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("-o", "--out", default=None, type=OUT_DIR,
              help="Write compare.csv, compare.xlsx, compare.html, unmatched.csv here.")
@click.option("--match", type=click.Choice(["fuzzy", "exact"]), default="fuzzy", show_default=True,
              help="fuzzy: sequence alignment over (scope, op, shapes); exact: by record name only.")
@click.option("--mapping", type=click.Path(), default=None, help="YAML file renaming A's ops/scopes to B's.")
@click.option("-j", "--jobs", default=1, show_default=True, type=click.IntRange(min=1),
              help="Worker processes for multi-step/rank runs.")
@click.option("--metric", default="cosine", show_default=True, help="Metric charted in the HTML report.")
@click.option("--stats-only", is_flag=True, help="Ignore saved tensors; compare recorded statistics only.")
def compare(a, b, out, match, mapping, jobs, metric, stats_only):
    """Compare run A (under test) with run B (benchmark); name the first op that diverged.

    A and B are run directories or single step*/rank* folders.  Exit code 0 when the runs
    agree (no error row), 2 when some rows diverge (the verdict says where), 1 when the runs
    do not align, nothing could be compared, or the values first differ at a random op (dropout:
    each run drew its own numbers, no precision verdict).  Runs of different rank counts (1 process vs
    DDP/FSDP2) are compared on loss, forward ops and parameters; under torchrun the ranks share
    the parts and rank 0 writes the report (docs/distributed.md).
    """
    from .offline.compare import compare as run_compare
    try:
        _, verdict = run_compare(a, b, match=match, mapping=mapping, out=out, jobs=jobs, metric=metric,
                                 progress=sys.stderr.isatty(), tensors=not stats_only, keep_table=False)
    except KeyboardInterrupt:
        click.echo("interrupted: no verdict" + (f"; the report in {out} is incomplete (each file in it is whole "
                                                 "or absent)" if out and os.path.isdir(out) else ""), err=True)
        sys.exit(130)
    if int(os.environ.get("RANK", "0")) == 0:     # under torchrun: rank 0 merged and says it
        click.echo(str(verdict))
        named = [getattr(verdict, stage, None) for stage in ("forward", "backward")]     # none in a grad compare
        _say_repro([(a if d.side == "a" else b, d.name, d.step, d.rank) for d in named
                    if d is not None and d.cause == "op" and d.kind == "op" and not d.departure])
    if getattr(verdict, "undecided", False):         # a grad compare's verdict has no random op or choice
        sys.exit(1)
    if not verdict.passed:
        sys.exit(2)
    if verdict.damaged:
        sys.exit(1)


@main.command()
@click.argument("run", type=click.Path())
@click.option("-o", "--out", default=None, type=OUT_DIR, help="Write ranks.csv and ranks.html here.")
@click.option("--stats-only", is_flag=True, help="Ignore saved tensors; judge from recorded statistics only.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
def ranks(run, out, stats_only, progress):
    """Check the ranks of one distributed run against each other.

    Collectives against their semantics across each group, replicas of data-parallel groups for
    drift, inf/nan to the rank and op where they started.  Exit code 0 when the ranks agree, 2
    when they do not, 1 when it cannot judge (a rank's records missing, one rank only).
    """
    from .offline.ranks import check_run
    _, verdict = check_run(run, out, tensors=not stats_only,
                           progress=sys.stderr.isatty() if progress is None else progress)
    if int(os.environ.get("RANK", "0")) == 0:     # under torchrun: rank 0 merged and says it
        click.echo(str(verdict))
        if out:
            click.echo(f"table: {os.path.join(out, 'ranks.csv')}\nreport: {os.path.join(out, 'ranks.html')}")
        for problem in getattr(verdict, "problems", ()):
            click.echo(f"warning: {problem}", err=True)
    sys.exit(verdict.code)


@main.command("run-ut")
@click.argument("records", type=click.Path(), required=False)
@click.option("-o", "--out", "out_dir", default=None, type=OUT_DIR,
              help="Output directory for the result CSVs (default: . or the --resume file's).")
@click.option("--random", "random_inputs", is_flag=True,
              help="Generate inputs from the recorded statistics/shapes/dtypes (for statistics-only records).")
@click.option("--resume", "-csv_path", "--result-csv-path", "resume", default=None, type=click.Path(),
              help="Continue an interrupted run: its accuracy_checking_result_{timestamp}.csv.")
@click.option("-j", "--jobs", default=1, show_default=True, type=click.IntRange(min=1), help="Worker processes.")
@click.option("--device", default=None, help="Device for the device run: cpu, cuda[:i], npu[:i], ... (default: the accelerator, else cpu).")
@click.option("--filter-duplicates", is_flag=True, help="Replay only the first of ops with identical op, shapes, dtypes and arguments.")
@click.option("--save-error-data", is_flag=True, help="Save inputs and outputs of failing ops to OUT/error_data/*.safetensors.")
@click.option("--import", "imports", multiple=True, help="Import this module first (custom kernels, a device plugin). Repeatable.")
@click.option("--api", default=None, help="Only ops whose record name matches this regex.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@click.option("--follow", is_flag=True,
              help="RECORDS is being written (shared storage): judge each op once saved, stop when every rank ended.")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Online run-ut: judge the ops training processes stream here (DispatchProbe(online_run_ut=True)).")
@click.option("--tls-path", default=None, type=click.Path(),
              help="With --listen: a directory with server.crt, server.key and optionally ca.crt (mutual TLS).")
@click.option("--keep-records", is_flag=True, help="With --listen: keep the streamed records in OUT/records.")
def run_ut(records, out_dir, random_inputs, resume, jobs, device, filter_duplicates, save_error_data, imports, api,
           progress, follow, listen, tls_path, keep_records):
    """Replay each recorded op on the device and as a float64 CPU benchmark; judge it.

    Writes accuracy_checking_result_{ts}.csv and accuracy_checking_details_{ts}.csv.  Exit code 0
    when no op errs, 2 when some do, 1 when no op was judged or a record is damaged (an op that
    could not run is not judged, never an error).  Under torchrun, ranks share the work and rank 0 merges.
    Online (docs/online.md): --follow a run being written, or --listen for streaming training.
    """
    from .offline.run_ut import run_ut as do_run_ut, summary_text
    if follow or listen:
        with interruptible():
            _run_ut_online(records, out_dir, follow, listen, tls_path, keep_records, jobs=jobs, device=device,
                           save_error_data=save_error_data, imports=imports, progress=progress, api=api,
                           random_inputs=random_inputs, resume=resume, filter_duplicates=filter_duplicates)
        return
    if records is None:
        raise ValueError("run-ut needs RECORDS (a run directory), or --listen HOST:PORT")
    with interruptible():
        try:
            res = do_run_ut(records, out_dir, random=random_inputs, device=device, jobs=jobs, resume=resume,
                            filter_duplicates=filter_duplicates, save_error_data=save_error_data, imports=imports,
                            progress=progress, api=api)
        except KeyboardInterrupt as exc:
            saved = getattr(exc, "result_csv", None)
            if saved and getattr(exc, "rows_saved", 0):
                click.echo(f"interrupted: {exc.rows_saved} ops are saved in {saved}; continue with: dispatchprobe "
                           f"run-ut {records}{getattr(exc, 'resume_options', '')} --resume {saved}", err=True)
            else:
                click.echo("interrupted before any op was judged: nothing to resume", err=True)
            sys.exit(130)
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(summary_text(res))
        if not random_inputs:
            _say_repro(_first_errors(res, records))
    _run_ut_exit(res)


def _say_repro(named: list) -> None:
    """Under the ops a verdict names, the command of each one's standalone repro (where its inputs
    were saved): the next step from a verdict to an upstream bug report."""
    from .offline.repro import hint
    for run, name, step, rank in dict.fromkeys(named):
        line = hint(run, name, step, rank)
        if line:
            click.echo(f"{name}: {line}")


def _first_critical(run, path) -> list:
    """(run, record, step, rank) of an overflow run's first critical op (the one it stopped at)."""
    from .offline.check_pages import overflow_rows
    if not any(os.path.isfile(os.path.join(p.path, "overflow.json")) for p in run.parts.values()):
        return []
    rows = overflow_rows(run)
    rows = rows[(rows["class"] == "critical") & (rows["name"] != "")]
    return [(path, r["name"], int(r["step"]), int(r["rank"])) for _, r in rows.head(1).iterrows()]


def _first_errors(res, records) -> list:
    """(run, record, step, rank) of the first op run-ut judged error (with saved inputs to repro)."""
    from .offline.run_ut import op_status
    rows = res.results[op_status(res.results) == "error"]
    return [(records, row["API Name"], int(row["Step"]), int(row["Rank"])) for _, row in rows.head(1).iterrows()]


def _run_ut_exit(res) -> None:
    """Exit 2 for a precision error, 1 for a damaged record or when nothing was judged (one line)."""
    from .offline.run_ut import exit_code
    code, why = exit_code(res)
    if why:
        raise ValueError(why)
    if code:
        sys.exit(code)


def _run_ut_online(records, out_dir, follow, listen, tls_path, keep_records, *, random_inputs, resume,
                   filter_duplicates, api, **options):
    """run-ut --follow / --listen: one summary at the end (or at Ctrl-C), exit codes as offline."""
    from .offline.run_ut import summary_text
    for flag, given in (("--random", random_inputs), ("--resume", resume), ("--filter-duplicates", filter_duplicates)):
        if given:
            raise ValueError(f"{flag} does not go with --follow/--listen (online run-ut judges every op as it comes)")
    if follow and listen:
        raise ValueError("--follow judges a run directory, --listen a stream: choose one")
    if tls_path and not listen:
        raise ValueError("--tls-path goes with --listen")
    if keep_records and not listen:
        raise ValueError("--keep-records goes with --listen (--follow never deletes the run it follows)")
    say = functools.partial(click.echo, err=True)
    try:
        if follow:
            if records is None:
                raise ValueError("run-ut --follow needs RECORDS: the run directory training writes")
            from .offline.run_ut_live import Follower, run_ut_live
            res = run_ut_live(Follower(records, api=api), out_dir, say=say, **options)
        else:
            if records is not None:
                raise ValueError("run-ut --listen takes no RECORDS: the training processes stream them")
            from .offline.online_checker import listen as do_listen
            res = do_listen(listen, out_dir, tls_path=tls_path, keep_records=keep_records, api=api, say=say, **options)
    except KeyboardInterrupt as exc:
        res = getattr(exc, "result", None)
        if res is None:
            click.echo("interrupted before any op was judged", err=True)
            sys.exit(130)
        click.echo(summary_text(res))
        click.echo(f"interrupted: the {len(res.results)} ops judged so far are written", err=True)
        sys.exit(130)
    click.echo(summary_text(res))
    _run_ut_exit(res)


@main.command()
@click.argument("run", type=click.Path())
@click.argument("record")
@click.option("-o", "--out", "out_dir", required=True, type=OUT_DIR, help="Folder for repro.py and its inputs.")
@click.option("--step", default=None, type=int, help="The step whose call to take (default: the first that saved it).")
@click.option("--rank", default=None, type=int, help="The rank whose call to take.")
@click.option("--prelude", "preludes", multiple=True, type=click.Path(dir_okay=False),
              help="A Python file defining custom ops (torch.library): copied beside the script, imported first. "
                   "Repeatable.")
def repro(run, record, out_dir, step, rank, preludes):
    """Write a standalone repro of one recorded op call: a script needing only the framework that recorded
    it (PyTorch, or MindSpore) and the op's saved inputs, re-running it on the recorded device and dtypes
    against float64 (and judging the recorded outputs against that float64 run).

    RECORD is the record's name as compare, run-ut and overflow.csv print it (aten.mm.default.0.forward).
    Run it with: python OUT/repro.py (exit 0: agrees with float64, 2: differs, 1: could not run)."""
    from .offline.repro import write_repro
    made = write_repro(run, record, out_dir, step=step, rank=rank, preludes=preludes)
    click.echo(f"repro of {made.record} (step {made.step} rank {made.rank}): {made.script}")
    for note in made.notes:
        click.echo(f"note: {note}")
    click.echo(f"run it: python {made.script}")


@main.command("precision-compare")
@click.argument("dut", type=click.Path())
@click.argument("ref", type=click.Path())
@click.option("-o", "--out", "out_dir", default=".", show_default=True, type=OUT_DIR, help="Output directory.")
def precision_compare(dut, ref, out_dir):
    """Three-way verdict: DUT's run-ut errors against a reference device's, both vs float64.

    DUT and REF are accuracy_checking_details_{ts}.csv files (or run-ut output directories).
    Exit code 0 when no op errs, 2 when some do, 1 when no op was judged.
    """
    from .offline.precision_compare import exit_code, precision_compare as do_compare, summary_text
    results, _, res_path, det_path = do_compare(dut, ref, out_dir)
    click.echo(summary_text(results))
    click.echo(f"results: {res_path}\ndetails: {det_path}")
    code, why = exit_code(results)
    if why:
        raise ValueError(why)
    if code:
        sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
