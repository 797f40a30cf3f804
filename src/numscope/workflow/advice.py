"""``numscope recommend``'s verb: a plan from an analysis (its objective and budget by default, a gap
model's prediction), and the helpers the command line shows beside it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from numscope.advisor.limits import HIGH_BITS
from numscope.analysis import Analysis
from numscope.errors import WorkflowError
from numscope.plan import OperandSpec, Plan
from numscope.run.folders import check_output_file


def find_analysis(path: str | os.PathLike[str]) -> Path:
    """The analysis folder ``path`` names: itself, or the ``analysis/`` of a run folder."""
    candidate = Path(path)
    if (candidate / "analysis").is_dir() and not (candidate / "analysis.json").is_file():
        return candidate / "analysis"
    return candidate


def recommend_plan(
    analysis: str | os.PathLike[str] | Analysis,
    output: str | os.PathLike[str] | None = None,
    *,
    max_gap: float | None = None,
    gap_model: Any = None,
    **criteria: Any,
) -> tuple[Plan, list[dict[str, str]]]:
    """The plan :func:`numscope.recommend` makes from an analysis, its table of choices and reasons.

    analysis: an :class:`~numscope.Analysis`, its folder, or a run folder of :func:`analyze`.
    criteria: passed by keyword to :func:`numscope.recommend` (``max_be_ratio``, ``max_underflow_pct``,
    ``max_overflow_pct``, ``min_sqnr_db``, ``bit_budget``, ``candidates``, ``reference``, ``per_operand``
    and any it gains). max_gap: instead of a bit budget, the cheapest plan whose gap to FP32 ``gap_model``
    (a :class:`numscope.study.GapModel`) predicts within ``max_gap`` nats
    (:func:`numscope.advisor.advise_within_gap`). The plan is saved to ``output`` when given.
    """
    from numscope.advisor import advise_within_gap, recommend, recommend_table

    if output is not None:
        check_output_file(output, "`output`")
    loaded = analysis if isinstance(analysis, Analysis) else Analysis.load(find_analysis(analysis))
    if max_gap is None:
        plan = recommend(loaded, **criteria)
    else:
        if gap_model is None:
            raise WorkflowError(
                "`max_gap` needs `gap_model` (gap_model.json of 'numscope calibrate') to predict gaps"
            )
        if criteria.get("bit_budget") is not None:
            raise WorkflowError(
                "`max_gap` chooses the bit budget itself: give `max_gap` or `bit_budget`, not both"
            )
        criteria.pop("bit_budget", None)
        plan = advise_within_gap(
            loaded,
            predict=lambda candidate: predicted_gap(gap_model, loaded, candidate),
            max_gap=max_gap,
            **criteria,
        )[0].plan
    if output is not None:
        _save_plan(plan, Path(output))
    return plan, recommend_table(plan)


def _save_plan(plan: Plan, path: Path) -> None:
    check_output_file(path, "`output`")
    try:
        plan.save(path)
    except OSError as error:
        raise WorkflowError(f"`output` {path}: cannot write the plan ({error.strerror or error})") from error


def analysis_average_bits(plan: Plan, analysis: Analysis) -> float:
    """Average bits per operand element of ``plan`` over the analysis's operands, weighted by their size."""
    return plan.average_bits(analysis.operand_sizes())


def load_gap_model(path: str | os.PathLike[str], features: str = "noise") -> Any:
    """A :class:`numscope.study.GapModel` of ``features`` (noise or sensitivity) from a file; a clear error if
    it is not one."""
    from numscope.study import GapModel, StudyError

    try:
        return GapModel.load(path, features)
    except StudyError as error:
        raise WorkflowError(f"`gap_model`: {error}") from error


def has_sensitivity_model(path: str | os.PathLike[str]) -> bool:
    """Whether the gap model file also holds the model fitted on sensitivities (a calibration that measured
    them); False also for a file that is no gap model (loading it then says what is wrong)."""
    from numscope.study import GapModel, StudyError

    try:
        GapModel.load(path, "sensitivity")
    except StudyError:
        return False
    return True


OBJECTIVE_WHY = {
    "sensitivity": "the analysis measured the sensitivity per operand and a bit budget or gap is given",
    "sensitivity default budget": "the analysis measured the sensitivity per operand; with no `bit_budget` "
    "or `max_gap` the budget is the bits of FP8 everywhere (the stack's FP8 recipe with `target`): the same "
    "cost as uniform FP8, spent where the measurement says",
    "noise limits": "limits or candidates are given without a `bit_budget` or `max_gap`: the cheapest format "
    "within them per operand",
    "noise gap model": "the gap model was fitted without sensitivities, so it weighs noise; a 'numscope "
    "calibrate' that measures them (its default) fits both",
    "noise": "the analysis holds no operand sensitivity, or no bit budget or gap is given; 'numscope "
    "analyze' measures it by default (`SensitivitySettings.batches` N, `SensitivitySettings.granularity` "
    "operand)",
}


def default_objective(analysis: Analysis, bit_budget: float | None, max_gap: float | None = None) -> str:
    """``sensitivity`` where the analysis measured the sensitivity per operand (the objective that tied the
    best heuristics in the plan study; without a bit budget or a gap target it takes
    :func:`default_budget`), else ``noise``. Operands it did not measure (a forecast measures only the
    sites its stacks convert) stay high."""
    measured = analysis.sensitivity is not None and analysis.sensitivity.granularity == "operand"
    return "sensitivity" if measured else "noise"


def default_budget(analysis: Analysis, target: str | None = None) -> float:
    """The bit budget ``recommend`` takes with the sensitivity objective when none is given: the average bits
    of FP8 everywhere (``fp8_e4m3`` on every measured operand; for a training stack, its FP8 recipe on
    everything it converts, the rest high), so that the plan costs what uniform FP8 costs."""
    from numscope.advisor.target import recipe_bits
    from numscope.plan.targets import get_target

    if target and target != "emulation":
        bits = recipe_bits(analysis, get_target(target), analysis.candidates)
        if "fp8" not in bits:
            raise WorkflowError(
                f"`target` {target}: its FP8 recipe's formats were not observed; give `bit_budget`"
            )
        return round(bits["fp8"], 2)
    # FP8 on every operand the sensitivity measured, the others high (the advisor keeps them there)
    unmeasured = unmeasured_operands(analysis)
    fp8 = OperandSpec("fp8_e4m3").bits_per_element()
    total = sum(analysis.elements.values())
    spent = sum(count * (HIGH_BITS if key in unmeasured else fp8) for key, count in analysis.elements.items())
    return round(spent / total, 2)


def unmeasured_operands(analysis: Analysis) -> set[Any]:
    """The analysis's operands its per-operand sensitivity did not measure (none without a sensitivity)."""
    sensitivity = analysis.sensitivity
    if sensitivity is None or sensitivity.granularity != "operand":
        return set()
    keys = analysis.keys()
    return {key for key in keys if key not in sensitivity.results}


def analysis_objective(analysis: Analysis, gap_model: Any = None) -> Callable[[Any, str], float]:
    """The advisor's sensitivity objective from the analysis's operand sensitivity, its GEMM roles weighted
    by a sensitivity ``gap_model``'s coefficients (equal without one); a clear error if not measured."""
    from numscope.advisor import sensitivity_objective as objective

    sensitivity = analysis.sensitivity
    if sensitivity is None or sensitivity.granularity != "operand":
        measured = "none" if sensitivity is None else f"per {sensitivity.granularity}"
        raise WorkflowError(
            f"`objective` sensitivity needs the sensitivity of every operand (measured: {measured}); run "
            "numscope analyze ... `SensitivitySettings.batches` N, `SensitivitySettings.granularity` operand"
        )
    return objective(sensitivity, gap_model.role_weights() if gap_model is not None else None, analysis)


def predicted_gap(gap_model: Any, analysis: Analysis, plan: Plan) -> float:
    from numscope.study import StudyError

    try:
        return gap_model.predict_plan(analysis, plan)
    except StudyError as error:
        raise WorkflowError(f"`gap_model`: {error}") from error


def extrapolation(gap_model: Any, analysis: Analysis, plan: Plan) -> str:
    """'' where the gap model was calibrated on every format the plan uses, else one sentence naming the
    formats its prediction extrapolates to and how to calibrate them."""
    outside = gap_model.uncalibrated(analysis, plan)
    if not outside:
        return ""
    return (
        f"an extrapolation: calibrated on {', '.join(gap_model.formats)} only, the plan also uses "
        f"{', '.join(outside)} ('numscope calibrate `also` {' '.join(outside)}' calibrates them)"
    )
