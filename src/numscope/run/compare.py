"""Finished run folders side by side: their results, whether a loss gap between them means anything
(:func:`comparability`), and the comparison table behind ``numscope compare``."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from numscope.errors import WorkflowError
from numscope.run.config import read_result
from numscope.run.folders import flat_settings, short_value
from numscope.run.loop import read_log

__all__ = ["LOSS_LABELS", "comparability", "compare", "comparison", "load_run", "load_runs"]


def load_run(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A finished run folder as a dict: ``result.json``'s fields, ``settings`` (run.json), ``train_log``,
    ``dir``."""
    path = Path(directory)
    if not path.is_dir():
        raise WorkflowError(f"{directory}: no such run folder")
    result = path / "result.json"
    if not result.is_file():
        if (path / "checkpoint.pt").is_file() or (path / "log.csv").is_file():
            raise WorkflowError(
                f"{directory}: the run has not finished (no result.json); rerun its numscope train/analyze "
                "command to resume it"
            )
        raise WorkflowError(f"{directory}: not a numscope run folder (no result.json)")
    try:
        run = read_result(result).to_dict()
        settings_file = path / "run.json"
        settings = json.loads(settings_file.read_text(encoding="utf-8")) if settings_file.is_file() else {}
        run["train_log"] = read_log(path / "log.csv") if (path / "log.csv").is_file() else []
    except (OSError, ValueError, KeyError) as error:
        raise WorkflowError(f"{directory}: unreadable run files ({error})") from error
    if not isinstance(settings, dict):
        raise WorkflowError(f"{directory}: run.json does not hold the run's settings (a JSON object)")
    run["settings"], run["dir"] = settings, str(path)
    return run


LOSS_LABELS = {"mlm": "MLM loss", "clm": "causal LM loss"}


def load_runs(directories: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    if not directories:
        raise WorkflowError("give at least one run folder")
    runs = [load_run(d) for d in directories]
    names = [r["name"] for r in runs]
    for run in runs:
        if names.count(run["name"]) > 1:
            run["name"] = f"{run['name']} ({run['dir']})"
    return runs


#: what must match for a gap between two runs to mean anything: (settings key, what a person calls it)
_COMPARABLE = (
    ("train.steps", "steps"),
    ("train.seed", "seed"),
    ("corpus_sha256", "training text"),
    ("data.vocab_size", "vocabulary size"),
    ("data.seq_len", "sequence length"),
    ("train.batch_size", "batch size"),
    ("train.lr", "learning rate"),
)


def comparability(runs: Sequence[Mapping[str, Any]], baseline: Mapping[str, Any]) -> list[str]:
    """Where runs differ from the baseline in what makes a loss gap meaningful, one line each.

    Runs of different models have no meaningful gap: that raises :class:`WorkflowError`. Runs whose folders
    lack the settings (``run.json``) are not checked.
    """
    base = flat_settings(baseline.get("settings") or {})
    notes = []
    for run in runs:
        if run is baseline or not run.get("settings") or not base:
            continue
        settings = flat_settings(run["settings"])
        if "model" in base and settings.get("model") != base["model"]:
            raise WorkflowError(
                f"{run['name']} trained the model {settings.get('model')!r}, the baseline "
                f"{baseline['name']} {base['model']!r}: a loss gap between different models means nothing; "
                "compare runs of one model"
            )
        differ = [
            f"{label} {short_value(settings.get(key))} vs {short_value(base.get(key))}"
            for key, label in _COMPARABLE
            if key in base and settings.get(key) != base.get(key)
        ]
        if differ:
            notes.append(
                f"{run['name']} differs from the baseline {baseline['name']} in {'; '.join(differ)}: its gap "
                "mixes that difference with the numerics"
            )
    return notes


def compare(
    directories: Sequence[str | os.PathLike[str]], baseline: str | None = None
) -> list[dict[str, str]]:
    """One row per run: validation loss and accuracy, gap to the baseline, average bits, skipped steps.

    baseline: a run name or folder; default the run named ``fp32`` (as :func:`analyze` names its run), else
    the first. Gap = (val loss − baseline val loss) / baseline val loss, in percent. Runs that differ from
    the baseline in steps, seed, data or optimisation settings are reported as a ``UserWarning`` (see
    :func:`comparison` for the rows and those lines together); runs of another model are refused.
    """
    rows, notes = comparison(directories, baseline)
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=2)
    return rows


def comparison(
    directories: Sequence[str | os.PathLike[str]], baseline: str | None = None
) -> tuple[list[dict[str, str]], list[str]]:
    """:func:`compare`'s rows and the lines of :func:`comparability` (what makes a gap misleading)."""
    runs = load_runs(directories)
    reference = _baseline(runs, baseline)
    notes = comparability(runs, reference)
    base = float(reference["val_loss"])
    rows = []
    for run in runs:
        loss = float(run["val_loss"])
        gap = 100 * (loss - base) / base if math.isfinite(loss) and base else math.nan
        bits = run.get("avg_bits")
        rows.append(
            {
                "run": run["name"],
                "plan": Path(run["plan"]).name if run["plan"].endswith((".yaml", ".yml")) else run["plan"],
                "loss scaling": run["loss_scaling"],
                "val loss": f"{loss:.4f}",
                "val acc": f"{100 * float(run['val_accuracy']):.2f}%",
                f"gap to {reference['name']}": "baseline" if run is reference else f"{gap:+.2f}%",
                "avg bits": "—" if bits is None else f"{bits:.2f}",
                "skipped": str(run["skipped_steps"]),
                "steps": str(run["steps"]),
                "wall": f"{run['wall_seconds']:.0f}s",
            }
        )
    return rows, notes


def _baseline(runs: list[dict[str, Any]], baseline: str | None) -> dict[str, Any]:
    if baseline is None:
        return next((r for r in runs if r["name"] == "fp32"), runs[0])
    for run in runs:
        if baseline == run["name"] or Path(baseline).resolve() == Path(run["dir"]).resolve():
            return run
    raise WorkflowError(
        f"`baseline` {baseline}: no such run; runs: {', '.join(r['name'] for r in runs)} (or their folders)"
    )
