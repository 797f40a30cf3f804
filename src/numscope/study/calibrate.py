"""Calibrating the gap model on a user's model (``numscope calibrate``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from numscope._atomic import atomic_write_text
from numscope.analysis import Analysis
from numscope.study.config import UNIFORM_CANDIDATES, PlanStudyConfig, StudyError
from numscope.study.gap_models import GapModel, role_noise, role_sensitivity
from numscope.study.operands import Operands
from numscope.study.plans import StudyPlan, _preset_of, _slug, calibration_plans


@dataclass
class Calibration:
    gap_model: GapModel
    rows: list[dict[str, Any]]  # per calibration plan: name, role noise, gaps per seed
    noise: float  # FP32 seed-to-seed sd (nats)
    analysis: str  # the observed FP32 run's analysis folder
    files: dict[str, str] = field(default_factory=dict)
    sensitivity_model: GapModel | None = None  # fitted on measured sensitivities (None: not measured)


def calibrate(
    model: str,
    data: Any,
    out_dir: Path,
    config: Any,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    low: str = "mxfp4_e2m1",
    objective: str = "auto",
    every: int = 25,
    sensitivity_batches: int = 2,
    log: Callable[[str], None] = print,
) -> Calibration:
    """Fit a :class:`GapModel` on any model :func:`numscope.run.runner.train` can train.

    Runs, each for ``config.steps`` steps and on every seed: FP32 (the first seed observed), ``low`` on the
    operands of one GEMM role at a time (fprop, dgrad, wgrad), and ``low`` everywhere: 5 × len(seeds) runs.
    With ``sensitivity_batches`` > 0 the trained FP32 model of the first seed also has every operand
    quantized alone in every observed format on that many validation batches, and a second gap model is
    fitted on those measured sensitivities (``features="sensitivity"``, stored under ``sensitivity``), the
    one ``numscope recommend --objective sensitivity`` weighs roles with. Writes ``gap_model.json`` into
    ``out_dir``; finished runs are reused on a rerun.
    """
    from dataclasses import replace as replace_config

    from numscope.run import runner

    out_dir = Path(out_dir)
    seeds = tuple(seeds)
    if len(set(seeds)) != len(seeds) or len(seeds) < 2:
        raise StudyError(f"calibration needs at least two distinct seeds; got {list(seeds)}")
    names = [low, *(c for c in UNIFORM_CANDIDATES if c != low)]
    first = out_dir / "fp32" / f"seed{seeds[0]}"
    results: dict[tuple[str, int], float] = {}
    cfg = replace_config(config, seed=seeds[0])
    log(f"[calibrate] fp32, observed (seed {seeds[0]})")
    results[("fp32", seeds[0])] = runner.analyze(
        model,
        data,
        first,
        config=cfg,
        candidates=names,
        every=every,
        objective=objective,
        sensitivity_batches=sensitivity_batches,
        sensitivity_granularity="operand",
    ).val_loss
    analysis = Analysis.load(first / "analysis")
    operands = Operands.from_analysis(analysis)
    preset = _preset_of(low)
    plans: list[StudyPlan] = calibration_plans(operands, PlanStudyConfig(low=low))
    plans.append(StudyPlan(f"{low} everywhere", "calibration", None, {k: low for k in operands.keys}))
    (out_dir / "plans").mkdir(parents=True, exist_ok=True)
    paths = {}
    for plan in plans:
        paths[plan.name] = out_dir / "plans" / f"{_slug(plan.name)}.yaml"
        plan.plan().save(paths[plan.name])
    for seed in seeds:
        cfg = replace_config(config, seed=seed)
        if seed != seeds[0]:
            log(f"[calibrate] fp32 (seed {seed})")
            folder = out_dir / "fp32" / f"seed{seed}"
            results[("fp32", seed)] = runner.train(
                model, data, folder, plan="fp32", config=cfg, objective=objective, name="fp32"
            ).val_loss
        for plan in plans:
            log(f"[calibrate] {plan.name} (seed {seed})")
            folder = out_dir / _slug(plan.name) / f"seed{seed}"
            results[(plan.name, seed)] = runner.train(
                model,
                data,
                folder,
                plan=str(paths[plan.name]),
                config=cfg,
                objective=objective,
                name=plan.name,
            ).val_loss
    rows = []
    for plan in plans:
        gaps = [results[(plan.name, s)] - results[("fp32", s)] for s in seeds]
        rows.append(
            {
                "name": plan.name,
                "noise_by_role": role_noise(analysis, plan.formats or {}),
                **(
                    {"sensitivity_by_role": role_sensitivity(analysis.sensitivity, plan.formats or {})}
                    if analysis.sensitivity is not None
                    else {}
                ),
                "gaps": gaps,
                "gap_mean": float(np.mean(gaps)),
            }
        )
    gaps = [r["gaps"] for r in rows]
    gap_model = GapModel.fit([r["noise_by_role"] for r in rows], gaps)
    extra: dict[str, Any] = {}
    fitted = None
    if analysis.sensitivity is not None:
        fitted = GapModel.fit([r["sensitivity_by_role"] for r in rows], gaps, "sensitivity")
        extra["sensitivity"] = fitted.to_dict()
    fp32 = [results[("fp32", s)] for s in seeds]
    noise = float(np.std(fp32, ddof=1))
    path = out_dir / "gap_model.json"
    atomic_write_text(
        path,
        json.dumps(
            {**gap_model.to_dict(), "fp32_seed_sd": noise, "seeds": list(seeds), "low": low, "runs": rows,
             "uniform_preset": preset, "analysis": str(first / "analysis"), **extra},
            indent=1,
        ),
    )  # fmt: skip
    return Calibration(gap_model, rows, noise, str(first / "analysis"), {"gap model": str(path)}, fitted)
