"""Studies that test numscope's choices against measurements.

``synthetic``: the backward-error study on synthetic Gaussian and Student-t operands (``numscope study
synthetic``). The plan study (``numscope study plans``): ``config`` (its settings and the win rule),
``operands`` (what a plan assigns), ``plans`` (numscope's, the heuristics', random and inverse plans at a bit
budget), ``gap_models`` (predicting a plan's loss gap before training), ``limits`` (advisor limits from
training outcomes), ``calibrate`` (fitting a gap model on a user's model), ``table`` (verdicts and the
report) and ``plan_study`` (training every plan on every seed). Names are resolved lazily.
"""

from __future__ import annotations

from numscope._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "DOFS": "numscope.study.synthetic",
    "FORMATS": "numscope.study.synthetic",
    "StudyFormat": "numscope.study.synthetic",
    "StudyRow": "numscope.study.synthetic",
    "backward_error_study": "numscope.study.synthetic",
    "crossover": "numscope.study.synthetic",
    "plot_study": "numscope.study.synthetic",
    "read_csv": "numscope.study.synthetic",
    "run_study": "numscope.study.synthetic",
    "study_table": "numscope.study.synthetic",
    "write_csv": "numscope.study.synthetic",
    "PlanStudyConfig": "numscope.study.config",
    "StudyError": "numscope.study.config",
    "Operands": "numscope.study.operands",
    "StudyPlan": "numscope.study.plans",
    "budget_plans": "numscope.study.plans",
    "fill_order": "numscope.study.plans",
    "plan_of": "numscope.study.plans",
    "GapModel": "numscope.study.gap_models",
    "SensitivityModel": "numscope.study.gap_models",
    "study_sensitivity": "numscope.study.gap_models",
    "spearman": "numscope.study.gap_models",
    "derive_limits": "numscope.study.limits",
    "Calibration": "numscope.study.calibrate",
    "calibrate": "numscope.study.calibrate",
    "plan_study_table": "numscope.study.table",
    "paired_verdict": "numscope.study.table",
    "PlanStudyResult": "numscope.study.plan_study",
    "run_plan_study": "numscope.study.plan_study",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
