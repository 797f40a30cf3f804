"""The studies' verbs: ``numscope calibrate`` (a gap model from FP32 and low-precision runs),
``numscope study plans`` (the plan study) and ``numscope study`` (the synthetic backward-error study).
The study package's own errors (``StudyError``, a :class:`numscope.errors.NumscopeError`) reach the
command line as they are: it prints every ``NumscopeError`` in one line."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numscope.errors import WorkflowError
from numscope.formats.spec import get_format
from numscope.run.config import SensitivitySettings, TrainConfig
from numscope.run.folders import check_output_folder
from numscope.run.sources import DataSettings, check_positive


@dataclass
class StudyResult:
    """The synthetic study's rows, its files, and the INT8/E4M3 crossover ν (None when not bracketed)."""

    rows: list[Any]
    png: Path
    csv: Path
    table: str
    crossover: float | None = None
    formats: list[str] = field(default_factory=list)


def calibrate_gap_model(
    model: str,
    data: DataSettings,
    out: str | os.PathLike[str],
    config: TrainConfig,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    low: str = "mxfp4_e2m1",
    also: Sequence[str] = (),
    objective: str = "auto",
    sensitivity: SensitivitySettings | None = None,
    jobs: int = 1,
) -> Any:
    """:func:`numscope.study.calibrate` into ``out``, with clear errors for bad settings."""
    from numscope.study import calibrate as run

    try:
        name = get_format(low).name
    except ValueError as error:
        raise WorkflowError(f"`low`: {error}") from error
    try:
        extra = [get_format(label).name for label in also]
    except ValueError as error:
        raise WorkflowError(f"`also`: {error}") from error
    return run(
        model,
        data,
        check_output_folder(out),
        config,
        seeds=seeds,
        low=name,
        also=extra,
        objective=objective,
        sensitivity=sensitivity,
        jobs=jobs,
    )


def plan_study(
    out: str | os.PathLike[str],
    *,
    quick: bool = False,
    demo_model: bool = False,
    budgets: Sequence[float] | None = None,
    seeds: Sequence[int] | None = None,
    random_plans: int | None = None,
    steps: int | None = None,
    jobs: int | None = None,
    text: Sequence[str] | None = None,
    target: str | None = None,
) -> Any:
    """The plan study (:func:`numscope.study.run_plan_study`) into ``out``; ``quick`` starts from
    :meth:`PlanStudyConfig.quick`, ``demo_model`` from :meth:`PlanStudyConfig.demo_model`, the other
    arguments override the configuration (``target``: numscope's plan also made for that stack)."""
    from dataclasses import replace

    from numscope.study import PlanStudyConfig, run_plan_study

    if quick and demo_model:
        raise WorkflowError("`quick` and `demo_model`: choose one (a small model, or the demo's)")
    start = PlanStudyConfig.quick if quick else PlanStudyConfig.demo_model if demo_model else PlanStudyConfig
    config = start()
    changes = {
        "budgets": tuple(budgets) if budgets else None,
        "seeds": tuple(seeds) if seeds else None,
        "random_plans": random_plans,
        "steps": steps,
        "jobs": jobs,
        "target": target,
    }
    config = replace(config, **{k: v for k, v in changes.items() if v is not None})
    for path in text or ():
        if not Path(path).is_file():
            raise WorkflowError(f"`text`: {path} is not a readable file")
    config.check()
    return run_plan_study(check_output_folder(out), config, text)


def study(
    out: str | os.PathLike[str],
    *,
    dofs: Sequence[float] | None = None,
    formats: Sequence[str] | None = None,
    size: int = 512,
    trials: int = 2,
    seed: int = 0,
) -> StudyResult:
    """Backward error of ``size``×``size`` Student-t(ν) products per format, as
    :func:`numscope.study.run_study`: ``backward_error_study.png`` and ``.csv`` written into ``out``."""
    from numscope.study import DOFS, FORMATS, StudyFormat, crossover, run_study, study_table

    dofs = tuple(DOFS if dofs is None else dofs)
    formats = tuple(FORMATS if formats is None else formats)
    check_positive("`size`", size)
    check_positive("`trials`", trials)
    if not dofs or not formats:
        raise WorkflowError("the study needs at least one `dofs` value and one `formats` name")
    for dof in dofs:
        if not dof > 0:
            raise WorkflowError(f"`dofs`: degrees of freedom must be > 0 (inf for Gaussian); got {dof}")
    labels = []
    for spec in formats:
        try:
            labels.append(StudyFormat.parse(spec).label)
        except ValueError as error:
            raise WorkflowError(f"`formats`: {error}") from error
    rows, png, table = run_study(
        check_output_folder(out), dofs=dofs, formats=formats, size=size, seed=seed, trials=trials
    )
    cross = None
    if "int8 per tensor" in labels and "fp8_e4m3" in labels and len(dofs) > 1:
        cross = crossover(rows, "int8 per tensor", "fp8_e4m3")
    return StudyResult(rows, png, table, study_table(rows), cross, labels)
