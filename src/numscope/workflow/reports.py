"""``numscope report``'s verb: one self-contained HTML report of finished runs."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from numscope.analysis import Analysis
from numscope.plan import Plan
from numscope.run.compare import LOSS_LABELS, load_runs
from numscope.run.folders import check_output_file
from numscope.run.runner import plan_and_source
from numscope.workflow.advice import analysis_average_bits, find_analysis


def report(
    directories: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    analysis: str | os.PathLike[str] | None = None,
    plan: str | os.PathLike[str] | None = None,
    title: str = "numscope report",
    command: str | None = None,
) -> Path:
    """Write one self-contained HTML report of the runs (:func:`numscope.report.write_report`).

    analysis: an analysis folder (or run folder); default the first run folder holding ``analysis/``.
    plan: a plan YAML to show per site; default the plan of the first run trained from a plan file.
    The gap column is relative to the run named ``fp32``.
    """
    from numscope.report import write_report

    check_output_file(output, "`output`")
    runs = load_runs(directories)
    if analysis is not None:
        analysis_dir = find_analysis(analysis)
    else:
        analysis_dir = next(
            (Path(r["dir"]) / "analysis" for r in runs if (Path(r["dir"]) / "analysis").is_dir()), None
        )
    loaded = Analysis.load(analysis_dir) if analysis_dir is not None else None
    if plan is not None:
        shown, _ = plan_and_source(str(plan))
    else:
        planned = next((r for r in runs if r["plan"].endswith((".yaml", ".yml"))), None)
        shown = Plan.load(Path(planned["dir"]) / "plan.yaml") if planned is not None else None
    rows = []
    for run in runs:
        row = {k: v for k, v in run.items() if k not in ("settings", "dir")}
        if row.get("avg_bits") is None and loaded is not None:  # a run from before runs recorded it
            row["avg_bits"] = analysis_average_bits(Plan.load(Path(run["dir"]) / "plan.yaml"), loaded)
        rows.append(row)
    labels = {LOSS_LABELS.get(run["settings"].get("objective_resolved"), "loss") for run in runs}
    loss_label = labels.pop() if len(labels) == 1 else "loss"
    return write_report(
        output,
        title=title,
        runs=rows,
        analysis=loaded,
        plan=shown,
        command=command,
        loss_label=loss_label,
        extra_images=[_plan_history(run) for run in runs if (Path(run["dir"]) / "adaptive.json").is_file()],
    )


def _plan_history(run: dict) -> tuple[str, bytes]:
    """An adaptive run's plan history as a report figure (caption, PNG)."""
    from numscope.report.plots import plan_history_figure
    from numscope.train.adaptive import read_history

    folder = Path(run["dir"])
    summary = json.loads((folder / "adaptive.json").read_text(encoding="utf-8"))
    history = read_history(folder / "plan_history.csv")
    causes = ", ".join(f"{n} {cause}" for cause, n in sorted(summary["changes"].items())) or "no change"
    caption = (
        f"{run['name']}: the adaptive plan over training ({causes}; {summary['average_bits']:.2f} average "
        "bits over training; every change in plan_history.csv)"
    )
    png = plan_history_figure([c.row() for c in history], summary["bits_from_step"], int(run["steps"]))
    return caption, png
