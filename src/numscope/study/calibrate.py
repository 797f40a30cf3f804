"""Calibrating the gap model on a user's model (``numscope calibrate``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
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
    also: Sequence[str] = (),
    objective: str = "auto",
    every: int = 25,
    sensitivity: Any = None,
    jobs: int = 1,
    log: Callable[[str], None] = print,
) -> Calibration:
    """Fit a :class:`GapModel` on any model :func:`numscope.run.runner.train` can train.

    Runs, each for ``config.steps`` steps and on every seed: FP32 (the first seed observed), ``low`` on the
    operands of one GEMM role at a time (fprop, dgrad, wgrad), and ``low`` everywhere: 5 × len(seeds) runs.
    ``sensitivity`` (a :class:`numscope.run.SensitivitySettings`; None: its defaults with 2 batches, per
    operand): the trained FP32 model of the first seed also has its operands' sensitivity measured as
    :func:`numscope.run.runner.analyze` measures it, and a second gap model is fitted on those sensitivities
    (``features="sensitivity"``, stored under ``sensitivity``), the one ``numscope recommend --minimize
    sensitivity`` weighs roles with (0 batches: none). Writes ``gap_model.json`` into
    ``out_dir``; finished runs are reused on a rerun. ``jobs`` > 1 trains the runs after the observed one
    that many at a time, each in its own process with an equal share of the cores (every run seeds
    itself: the results do not depend on ``jobs``).
    """
    from dataclasses import replace as replace_config

    from numscope.run import runner
    from numscope.run.config import SensitivitySettings
    from numscope.run.sources import resolve_workload

    if sensitivity is None:
        sensitivity = SensitivitySettings(batches=2)
    if sensitivity.granularity != "operand":
        raise StudyError("calibrate measures the sensitivity per operand (SensitivitySettings.granularity)")

    out_dir = Path(out_dir)
    seeds = tuple(seeds)
    if len(set(seeds)) != len(seeds) or len(seeds) < 2:
        raise StudyError(f"calibration needs at least two distinct seeds; got {list(seeds)}")
    also = tuple(dict.fromkeys(f for f in also if f != low))
    names = list(dict.fromkeys((low, *UNIFORM_CANDIDATES, *also)))  # an also beyond these re-observes
    first = out_dir / "fp32" / f"seed{seeds[0]}"
    results: dict[tuple[str, int], float] = {}
    cfg = replace_config(config, seed=seeds[0])
    log(f"[calibrate] fp32, observed (seed {seeds[0]})")
    work = resolve_workload(model, data, objective)  # the model, tokenizer and blocks: once in this process
    results[("fp32", seeds[0])] = runner.analyze(
        work,
        None,
        first,
        config=cfg,
        candidates=names,
        every=every,
        objective=objective,
        sensitivity=sensitivity,
    ).val_loss
    analysis = Analysis.load(first / "analysis")
    operands = Operands.from_analysis(analysis)
    preset = _preset_of(low)
    plans: list[StudyPlan] = calibration_plans(operands, PlanStudyConfig(low=low))
    for label in (low, *also):
        plans.append(StudyPlan(f"{label} everywhere", "calibration", None, {k: label for k in operands.keys}))
    (out_dir / "plans").mkdir(parents=True, exist_ok=True)
    paths = {}
    for plan in plans:
        paths[plan.name] = out_dir / "plans" / f"{_slug(plan.name)}.yaml"
        plan.plan().save(paths[plan.name])
    tasks = []  # (plan name, seed, folder, plan); fp32 of the first seed is the observed run above
    for seed in seeds:
        if seed != seeds[0]:
            tasks.append(("fp32", seed, out_dir / "fp32" / f"seed{seed}", "fp32"))
        for plan in plans:
            tasks.append((plan.name, seed, out_dir / _slug(plan.name) / f"seed{seed}", str(paths[plan.name])))

    # in this process the runs share the workload; workers get the spec and data (picklable) and resolve them
    where = (work, None) if jobs <= 1 else (model, data)
    train = partial(_train_one, *where, config, objective)
    if jobs <= 1:
        for task in tasks:
            log(f"[calibrate] {task[0]} (seed {task[1]})")
            results[task[:2]] = train(task)
    else:
        results.update(_train_side_by_side(tasks, train, jobs, log))
    rows = []
    for plan in plans:
        gaps = [results[(plan.name, s)] - results[("fp32", s)] for s in seeds]
        chosen = plan.formats or {}
        rows.append(
            {
                "name": plan.name,
                "noise_by_role": role_noise(analysis, chosen),
                **(
                    {"sensitivity_by_role": role_sensitivity(analysis.sensitivity, chosen, analysis)}
                    if analysis.sensitivity is not None
                    else {}
                ),
                "gaps": gaps,
                "gap_mean": float(np.mean(gaps)),
            }
        )
    gaps = [r["gaps"] for r in rows]
    formats = (low, *also)
    gap_model = GapModel.fit([r["noise_by_role"] for r in rows], gaps, formats=formats)
    extra: dict[str, Any] = {}
    fitted = None
    if analysis.sensitivity is not None:
        fitted = GapModel.fit([r["sensitivity_by_role"] for r in rows], gaps, "sensitivity", formats)
        extra["sensitivity"] = fitted.to_dict()
    fp32 = [results[("fp32", s)] for s in seeds]
    noise = float(np.std(fp32, ddof=1))
    path = out_dir / "gap_model.json"
    atomic_write_text(
        path,
        json.dumps(
            {**gap_model.to_dict(), "fp32_seed_sd": noise, "seeds": list(seeds), "low": low,
             "also": list(also), "runs": rows,
             "uniform_preset": preset, "analysis": str(first / "analysis"), **extra},
            indent=1,
        ),
    )  # fmt: skip
    return Calibration(gap_model, rows, noise, str(first / "analysis"), {"gap model": str(path)}, fitted)


def _train_one(model: str, data: Any, config: Any, objective: str, task: tuple[str, int, Path, str]) -> float:
    """One calibration run (:func:`numscope.run.runner.train`) on its seed; its validation loss."""
    from dataclasses import replace

    from numscope.run import runner

    name, seed, folder, plan = task
    cfg = replace(config, seed=seed)
    return runner.train(model, data, folder, plan=plan, config=cfg, objective=objective, name=name).val_loss


def _train_side_by_side(
    tasks: Sequence[tuple[str, int, Path, str]],
    train: Callable[[tuple[str, int, Path, str]], float],
    jobs: int,
    log: Callable[[str], None],
) -> dict[tuple[str, int], float]:
    """``train`` every task, ``jobs`` at a time in spawned processes of ``cores // jobs`` threads."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from numscope.run.pool import available_cores

    threads = max(1, available_cores() // jobs)
    context = multiprocessing.get_context("spawn")
    results = {}
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_set_threads, initargs=(threads,)) as pool:
        futures = {pool.submit(train, task): task for task in tasks}
        for future in as_completed(futures):
            name, seed = futures[future][:2]
            results[(name, seed)] = future.result()
            log(f"[calibrate] {name} (seed {seed}): {results[(name, seed)]:.4f}")
    return results


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
