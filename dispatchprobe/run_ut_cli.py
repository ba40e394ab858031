"""``dispatchprobe run-ut`` and ``dispatchprobe precision-compare`` (registered by ``cli._register``).

torch is imported only when ``run-ut`` runs; ``precision-compare`` needs only pandas.
"""

from __future__ import annotations

import sys

import click


@click.command("run-ut")
@click.argument("records", type=click.Path())
@click.option("-o", "--out", "out_dir", default=None, help="Output directory for the result CSVs (default: . or the --resume file's).")
@click.option("--random", "random_inputs", is_flag=True,
              help="Generate inputs from the recorded statistics/shapes/dtypes (for statistics-only records).")
@click.option("--resume", "-csv_path", "--result-csv-path", "resume", default=None, type=click.Path(),
              help="Continue an interrupted run: its accuracy_checking_result_{timestamp}.csv.")
@click.option("-j", "--jobs", default=1, show_default=True, help="Worker processes.")
@click.option("--device", default=None, help="Device for the device run: cpu, cuda[:i], npu[:i], ... (default: the accelerator, else cpu).")
@click.option("--filter-duplicates", is_flag=True, help="Replay only the first of ops with identical op, shapes, dtypes and arguments.")
@click.option("--save-error-data", is_flag=True, help="Save inputs and outputs of failing ops to OUT/error_data/*.safetensors.")
@click.option("--import", "imports", multiple=True, help="Import this module first (custom kernels, a device plugin). Repeatable.")
@click.option("--api", default=None, help="Only ops whose record name matches this regex.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
def run_ut(records, out_dir, random_inputs, resume, jobs, device, filter_duplicates, save_error_data, imports, api,
           progress):
    """Replay each recorded op on the device and as a float64 CPU benchmark; judge it.

    Writes accuracy_checking_result_{ts}.csv and accuracy_checking_details_{ts}.csv.  Exit code 0
    when no op errs, 2 when some do.  Under torchrun, ranks share the work and rank 0 merges.
    """
    from .run_ut import run_ut as do_run_ut, summary_text
    try:
        res = do_run_ut(records, out_dir, random=random_inputs, device=device, jobs=jobs, resume=resume,
                        filter_duplicates=filter_duplicates, save_error_data=save_error_data, imports=imports,
                        progress=progress, api=api)
    except KeyboardInterrupt:
        click.echo("interrupted: rows so far are saved; continue with --resume "
                   "OUT/accuracy_checking_result_{timestamp}.csv", err=True)
        sys.exit(130)
    import os
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(summary_text(res))
    statuses = set(res.results["Forward Test Success"]) | set(res.results["Backward Test Success"])
    if "error" in statuses:
        sys.exit(2)


@click.command("precision-compare")
@click.argument("dut", type=click.Path())
@click.argument("ref", type=click.Path())
@click.option("-o", "--out", "out_dir", default=".", show_default=True, help="Output directory.")
def precision_compare(dut, ref, out_dir):
    """Three-way verdict: DUT's run-ut errors against a reference device's, both vs float64.

    DUT and REF are accuracy_checking_details_{ts}.csv files (or run-ut output directories).
    Exit code 0 when no op errs, 2 when some do.
    """
    from .precision_compare import precision_compare as do_compare, summary_text
    results, _, res_path, det_path = do_compare(dut, ref, out_dir)
    click.echo(summary_text(results))
    click.echo(f"results: {res_path}\ndetails: {det_path}")
    statuses = set(results["Forward Test Success"]) | set(results["Backward Test Success"])
    if "error" in statuses:
        sys.exit(2)
