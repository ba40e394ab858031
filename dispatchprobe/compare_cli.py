"""``dispatchprobe compare A B``: registered into the CLI by ``cli._register``.  No torch."""

from __future__ import annotations

import sys

import click


@click.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("-o", "--out", default=None, help="Write compare.csv, compare.xlsx, compare.html, unmatched.csv here.")
@click.option("--match", type=click.Choice(["fuzzy", "exact"]), default="fuzzy", show_default=True,
              help="fuzzy: sequence alignment over (scope, op, shapes); exact: by record name only.")
@click.option("--mapping", type=click.Path(), default=None, help="YAML file renaming A's ops/scopes to B's.")
@click.option("-j", "--jobs", default=1, show_default=True, help="Worker processes for multi-step/rank runs.")
@click.option("--metric", default="cosine", show_default=True, help="Metric charted in the HTML report.")
@click.option("--stats-only", is_flag=True, help="Ignore saved tensors; compare recorded statistics only.")
def compare(a, b, out, match, mapping, jobs, metric, stats_only):
    """Compare run A (under test) with run B (benchmark); name the first op that diverged.

    A and B are run directories or single step*/rank* folders.  Exit code 0 when every
    compared tensor passes, 2 when some diverge, 1 when nothing could be compared.
    """
    from .compare import compare as run_compare
    _, verdict = run_compare(a, b, match=match, mapping=mapping, out=out, jobs=jobs, metric=metric,
                             progress=sys.stderr.isatty(), tensors=not stats_only)
    click.echo(str(verdict))
    if not verdict.passed:
        sys.exit(2)
