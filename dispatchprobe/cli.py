"""The ``dispatchprobe`` command line (click).

Every command turns expected failures (bad paths, corrupt records, bad options) into one line
on stderr and exit code 1 (DESIGN invariant 7); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import functools
import sys

import click

from .config import ConfigError
from .reader import RecordError

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


@click.group(cls=ProbeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="dispatchprobe")
@click.pass_context
def main(ctx, debug):
    """Find the op that made a training run go wrong."""
    ctx.meta["dispatchprobe.debug"] = debug


def echo_table(df, max_rows: int = 40) -> None:
    import pandas as pd
    with pd.option_context("display.max_rows", max_rows, "display.max_columns", 30, "display.width", 200,
                           "display.max_colwidth", 60):
        click.echo(df.to_string(index=False) if len(df) <= max_rows else df.head(max_rows).to_string(index=False)
                   + f"\n... {len(df) - max_rows} more rows")


@main.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--op", "op_pattern", default=None, help="List records whose op or name matches (substring or regex).")
@click.option("--stage", type=click.Choice(["forward", "backward"]), default=None, help="Only this stage.")
@click.option("--top", default=10, show_default=True, help="How many of the most frequent ops to list.")
@click.option("--limit", default=40, show_default=True, help="Rows to print with --op.")
def show(path, op_pattern, stage, top, limit):
    """Summarise a run (steps, ranks, op counts, nan/inf), or list records with --op."""
    from .summary import summarize, matching_records
    from .reader import load

    run = load(path)
    if op_pattern:
        echo_table(matching_records(run, op_pattern, stage), max_rows=limit)
    else:
        click.echo(summarize(run, top=top, stage=stage))
    for problem in run.problems:
        click.echo(f"warning: {problem}", err=True)


@main.command()
@click.option("-o", "--out", "dump_path", default="runs/demo", show_default=True, help="Where to write the records.")
@click.option("--task", type=click.Choice(["statistics", "tensor", "overflow", "free_benchmark"]), default="tensor",
              show_default=True)
@click.option("--steps", default=2, show_default=True, help="Training steps to record.")
def demo(dump_path, task, steps):
    """Record a few training steps of the built-in tiny transformer (no downloads)."""
    from .demo import run_demo
    run_demo(dump_path, task=task, steps=steps)


# ---- commands that live beside their implementation --------------------------------------------
from .compare_cli import compare  # noqa: E402  (numpy/pandas only)
from .run_ut_cli import precision_compare, run_ut  # noqa: E402  (torch imported when run-ut runs)

for _command in (compare, run_ut, precision_compare):
    main.add_command(_command)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
