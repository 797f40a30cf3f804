"""The plan study: does a measured per-operand plan beat the plans people guess, at the same bits?

One model, one corpus, the same seeds for every plan. Every GEMM operand is either ``low`` (MXFP4 by
default, 4.25 bits with its block scale) or ``high`` (MXFP8, 8.25 bits), and each plan spends an average-bit
**budget** (bits per operand element, weighted by element counts) differently:

- ``numscope``: the advisor's bit-budget choice from the FP32 run's analysis (least total relative noise
  power Σ 10^(−SQNR/10), every operand alike; no limits, so that the budget alone decides);
- ``numscope calibrated``: the same with each GEMM role's noise weighted by its fitted loss impact
  (:class:`GapModel`, fitted on the calibration runs below before the budget plans are trained);
- heuristics practitioners use, each an *order* in which operands get the high format: ``first/last layers``
  (Megatron's ``--first-last-layers-bf16``: the layers at both ends and the head first), ``last layers``
  (the NVFP4 pretraining recipe's last ~15% of linear layers in BF16: the last sites first),
  ``wgrad high`` (torchao's ``rowwise_with_gw_hp``: the weight-gradient GEMM first), ``gradients high``
  (Transformer Engine's hybrid spends its range on gradients: every ``grad_output`` first);
- ``random k``: random orders (seeded);
- ``inverse``: the order of least benefit per bit by the advisor's own metric (where it says bits matter
  least).

An order becomes a plan by :func:`fill_order`: walking the order, an operand is upgraded to ``high`` when the
average stays within the budget, so every plan lands just under the budget. The study also trains FP32 on
every seed (the reference and the seed noise), the uniform formats, and the **calibration** plans: MXFP4 in
one GEMM role (fprop, dgrad or wgrad) at a time.

**Noise and claims.** Every plan is trained on the same seeds as FP32; its gap on a seed is its validation
loss minus FP32's on that seed (paired: same initialisation, batches and evaluation masks). "A beats B"
holds when the mean of the paired differences exceeds twice their standard deviation over ≥ 3 seeds; the
FP32 seed-to-seed standard deviation is printed beside every table as the noise floor of unpaired
comparisons.

**Predicted gap.** :class:`GapModel` predicts a plan's gap before it is trained: gap ≈ Σ_role c_role ·
Σ_{operands of that role} n(format), n the operand's relative noise power from the FP32 analysis, c ≥ 0 fitted
(non-negative least squares, each run weighted by its seed noise, with a prior towards the coefficient
every role would share: :meth:`GapModel.fit`) on the calibration runs. The study compares predicted and
measured gaps of every plan it trains (Spearman rank correlation).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from numscope._atomic import atomic_write_text
from numscope.analysis import Analysis, OperandKey
from numscope.plan import Plan
from numscope.run.folders import read_settings, setting_changes
from numscope.study.config import RESULT_NEUTRAL, PlanStudyConfig, StudyError
from numscope.study.gap_models import GapModel, SensitivityModel, role_noise, spearman, study_sensitivity
from numscope.study.limits import derive_limits, limits_text, worst_metrics
from numscope.study.operands import Operands
from numscope.study.plans import (
    StudyPlan,
    _preset_of,
    _slug,
    budget_plans,
    calibration_plans,
    uniform_formats,
)
from numscope.study.table import _rank, factor_two_share, paired_verdict, plan_study_table

_DATA: dict[Any, Any] = {}


def _data(config: PlanStudyConfig, text_paths: tuple[str, ...] | None) -> Any:
    key = (config.vocab_size, config.seq_len, config.val_blocks, text_paths)
    if key not in _DATA:
        _DATA[key] = config.experiment(0).data([Path(p) for p in text_paths] if text_paths else None)
    return _DATA[key]


def _run_all(tasks: list[dict[str, Any]], jobs: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Train every (plan, seed) task in its folder, ``jobs`` at a time in processes of one thread
    (:class:`numscope.run.pool.RunPool`); finished runs of the same plan are read back (train_run's
    contract), a run of a plan that has changed since (e.g. a numscope whose advisor decides otherwise) is
    moved aside and trained again."""
    from numscope.run.config import RunSpec
    from numscope.run.experiment import experiment_observer
    from numscope.run.pool import RunPool

    if not tasks:
        return []
    config = PlanStudyConfig(**tasks[0]["config"])
    data = _data(config, tasks[0]["text"])
    by_key = {f"{task['name']} seed {task['seed']}": task for task in tasks}
    results: list[dict[str, Any]] = []
    with RunPool(data, jobs=min(jobs, len(tasks)), threads=1) as pool:
        for key, task in by_key.items():
            experiment = config.experiment(task["seed"])
            plan = Plan.named(task["plan"]) if not task["plan"].endswith(".yaml") else Plan.load(task["plan"])
            pool.add(
                key,
                spec=RunSpec(task["name"], task["plan"]),
                model_config=experiment.model_config(data),
                cfg=experiment.train,
                out_dir=Path(task["folder"]),
                observer_factory=partial(experiment_observer, config=experiment) if task["observe"] else None,
                compiled=bool(plan.uses_block_formats()) and not task["observe"],
                save_model=bool(task.get("save_model", False)),
                replace_changed=True,  # a plan the advisor now makes otherwise is trained again
            )
        while pool:
            key, result = pool.next_finished()
            task = by_key[key]
            results.append(
                {
                    "name": task["name"],
                    "seed": task["seed"],
                    "val_loss": result.val_loss,
                    "wall": result.wall_seconds,
                }
            )
            log(f"  {task['name']} seed {task['seed']}: {result.val_loss:.4f} ({result.wall_seconds:.0f}s)")
    return results


@dataclass
class PlanStudyResult:
    rows: list[dict[str, Any]]
    noise: float  # FP32 seed-to-seed standard deviation of validation loss (nats)
    gap_model: GapModel
    spearman: float
    table: str
    files: dict[str, str] = field(default_factory=dict)


def run_plan_study(
    out_dir: Path,
    config: PlanStudyConfig | None = None,
    text_paths: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> PlanStudyResult:
    """Train every plan on every seed (finished runs are reused), write ``plan_study.json``,
    ``plan_study.md``, ``pareto.png`` and ``predicted_vs_measured.png`` into ``out_dir``."""
    from numscope.run.data import unigram_loss

    config = config or PlanStudyConfig()
    config.check()
    out_dir = Path(out_dir)
    (out_dir / "plans").mkdir(parents=True, exist_ok=True)
    text = tuple(str(p) for p in text_paths) if text_paths else None
    settings = out_dir / "settings.json"
    run_settings = {k: v for k, v in asdict(config).items() if k not in RESULT_NEUTRAL}
    if config.target is None:  # as a folder made before the study had targets records it
        del run_settings["target"]
    wanted = json.loads(json.dumps({"config": run_settings, "text": text}))  # tuples as lists, as stored
    stored = read_settings(settings)
    if stored is not None and (changes := setting_changes(stored, wanted)):
        raise StudyError(
            f"{out_dir} holds runs trained with other settings ({'; '.join(changes[:3])}); use another `out` "
            "(budgets, seeds, random plans, uniform formats and jobs may change: finished runs are reused)"
        )
    atomic_write_text(settings, json.dumps(wanted, indent=1, sort_keys=True))
    cfg = asdict(config)

    def task(name: str, plan: str, seed: int, observe: bool = False) -> dict[str, Any]:
        folder = out_dir / "runs" / _slug(name) / f"seed{seed}"
        return dict(
            name=name, plan=plan, seed=seed, folder=str(folder), observe=observe, config=cfg, text=text
        )

    def save(plan: StudyPlan) -> str:
        if plan.preset:
            return plan.preset
        path = out_dir / "plans" / f"{_slug(plan.name)}.yaml"
        plan.plan().save(path)
        return str(path)

    log(f"[fp32] observed run (seed {config.seeds[0]}), then every seed")
    first = task("fp32", "fp32", config.seeds[0], observe=True)
    measured = _run_all([first], 1, log)
    analysis = Analysis.load(Path(first["folder"]) / "analysis")
    operands = Operands.from_analysis(analysis, _site_order(config, text))
    data = _data(config, text)
    unigram = {s: unigram_loss(data.train_blocks, data.val_blocks, data.tokenizer, s) for s in config.seeds}

    plans: list[StudyPlan] = [StudyPlan("fp32", "reference", None, None, "fp32")]
    plans += [StudyPlan(name, "uniform", None, None, name) for name in config.uniform]
    plans += calibration_plans(operands, config)
    phase1 = [
        task(p.name, save(p), s)
        for p in plans
        for s in config.seeds
        if (p.name, s) != ("fp32", config.seeds[0])
    ]
    log(f"[calibration] {len(phase1)} runs: fp32 seeds, uniform formats, one GEMM role in {config.low}")
    measured += _run_all(phase1, config.jobs, log)
    losses = _losses(measured)

    def gaps(name: str) -> list[float]:
        return [losses[(name, s)] - losses[("fp32", s)] for s in config.seeds]

    def formats_of(plan: StudyPlan) -> dict[OperandKey, str]:
        return plan.formats if plan.formats is not None else uniform_formats(plan.preset or "fp32", operands)

    # the calibration points: one GEMM role in the low format at a time, and the uniform low format
    calibration = [
        p
        for p in plans
        if p.family == "calibration" or (p.family == "uniform" and p.preset == _preset_of(config.low))
    ]
    gap_model = GapModel.fit(
        [role_noise(analysis, formats_of(p)) for p in calibration],
        [gaps(p.name) for p in calibration],
    )
    log(f"[model] gap ≈ {gap_model.formula()}")
    scores = _sensitivity_scores(out_dir, config, text, task, log)
    sensitivity_model = GapModel.fit(
        [scores.features(operands, formats_of(p)) for p in calibration],
        [gaps(p.name) for p in calibration],
        "sensitivity",
    )
    log(f"[model] from sensitivities: gap ≈ {sensitivity_model.formula()}")
    studied = budget_plans(analysis, operands, config, gap_model, (scores, sensitivity_model))
    phase2 = [task(p.name, save(p), s) for p in studied for s in config.seeds]
    log(f"[budgets] {len(phase2)} runs: {len(studied)} plans × {len(config.seeds)} seeds")
    measured += _run_all(phase2, config.jobs, log)
    losses = _losses(measured)
    plans += studied

    fp32 = [losses[("fp32", s)] for s in config.seeds]
    noise = float(np.std(fp32, ddof=1)) if len(fp32) > 1 else math.nan
    rows = []
    for plan in plans:
        formats = formats_of(plan)
        measured_gaps = gaps(plan.name)
        features = role_noise(analysis, formats)
        rows.append(
            {
                "name": plan.name,
                "family": plan.family,
                "budget": plan.budget,
                "bits": Plan.named(plan.preset).average_bits(operands.sizes())
                if plan.preset
                else operands.average_bits(formats),
                "high_share": sum(n for k, n in operands.elements.items() if formats[k] == config.high)
                / sum(operands.elements.values()),
                "val_loss": [losses[(plan.name, s)] for s in config.seeds],
                "gaps": measured_gaps,
                "gap_mean": float(np.mean(measured_gaps)),
                "gap_sd": float(np.std(measured_gaps, ddof=1)) if len(measured_gaps) > 1 else math.nan,
                "predicted_gap": gap_model.predict(features),
                "noise_by_role": features,
                "predicted_gap_sensitivity": _predict_or_nan(sensitivity_model, scores, operands, formats),
            }
        )
    _rank(rows)
    outcomes = []
    for plan in plans:
        if plan.family != "uniform":
            continue
        at_parity = paired_verdict(gaps(plan.name)) in ("tie", "same", "better")
        outcomes.append((plan.name, at_parity, worst_metrics(analysis, operands, formats_of(plan))))
    derived = derive_limits(outcomes)
    derived["worst"] = {name: metrics for name, _, metrics in outcomes}
    fitted = {p.name for p in calibration}
    scored = [r for r in rows if r["family"] != "reference" and r["name"] not in fitted]
    for row in rows:
        row["calibration"] = row["name"] in fitted
    rho = spearman([r["predicted_gap"] for r in scored], [r["gap_mean"] for r in scored])
    predictable = [r for r in scored if math.isfinite(r["predicted_gap_sensitivity"])]
    rho_sensitivity = spearman(
        [r["predicted_gap_sensitivity"] for r in predictable], [r["gap_mean"] for r in predictable]
    )
    within_two = {
        name: factor_two_share(predictable if name == "predicted_gap_sensitivity" else scored, name)
        for name in ("predicted_gap", "predicted_gap_sensitivity")
    }
    table = plan_study_table(rows, noise, config, unigram, fp32, rho, gap_model)
    table += "\n" + (
        "Predicted within a factor of 2 of the measured gap, over the plans whose gap exceeds 2 sd of its "
        f"paired noise: noise model {within_two['predicted_gap']}, sensitivity model "
        f"{within_two['predicted_gap_sensitivity']}."
    )
    table += (
        f"\nFrom sensitivities (each operand alone on the trained FP32 model): gap = "
        f"{sensitivity_model.formula()}; Spearman with the measured gap: {rho_sensitivity:.2f}.\n"
        + limits_text(derived)
    )
    result = PlanStudyResult(rows, noise, gap_model, rho, table)
    payload = {
        "config": asdict(config),
        "seeds": list(config.seeds),
        "fp32_val_loss": fp32,
        "context_free_loss": {str(s): v for s, v in unigram.items()},
        "fp32_seed_sd": noise,
        "gap_model": gap_model.to_dict(),
        "spearman_predicted_vs_measured": rho,
        "sensitivity_model": sensitivity_model.to_dict(),
        "spearman_sensitivity_vs_measured": rho_sensitivity,
        "within_factor_two": within_two,
        "derived_limits": derived,
        "rows": rows,
    }
    files = {
        "json": out_dir / "plan_study.json",
        "table": out_dir / "plan_study.md",
        "pareto": out_dir / "pareto.png",
        "predicted": out_dir / "predicted_vs_measured.png",
        "gap model": out_dir / "gap_model.json",
    }
    atomic_write_text(files["gap model"], json.dumps(gap_model.to_dict(), indent=1))
    atomic_write_text(files["json"], json.dumps(payload, indent=1, default=float))
    atomic_write_text(files["table"], table + "\n")
    from numscope.report.plots import plan_study_pareto, predicted_vs_measured

    files["pareto"].write_bytes(plan_study_pareto(rows, noise))
    files["predicted"].write_bytes(predicted_vs_measured(scored, rho, rho_sensitivity))
    result.files = {k: str(v) for k, v in files.items()}
    return result


def _predict_or_nan(
    model: GapModel, scores: SensitivityModel, operands: Operands, formats: Mapping[OperandKey, str]
) -> float:
    """The sensitivity model's prediction; nan for a plan using formats whose sensitivity was not measured
    (only the study's low and high formats are)."""
    try:
        return model.predict(scores.features(operands, formats))
    except StudyError:
        return math.nan


def _sensitivity_scores(
    out_dir: Path, config: PlanStudyConfig, text: tuple[str, ...] | None, task: Callable, log: Callable
) -> SensitivityModel:
    """Each operand's sensitivity on the trained FP32 model of the first seed (measured once, kept in
    ``sensitivity.json``)."""
    from numscope.analysis import Sensitivity

    path = out_dir / "sensitivity.json"
    if path.exists():
        return SensitivityModel.from_sensitivity(Sensitivity.from_dict(json.loads(path.read_text())))
    import torch

    from numscope.run.model import bert_mlm_from_config
    from numscope.train.checkpoint import load_checkpoint

    seed = config.seeds[0]
    trained = {**task("fp32 model", "fp32", seed), "save_model": True}
    _run_all([trained], 1, log)
    data = _data(config, text)
    model = bert_mlm_from_config(config.experiment(seed).model_config(data))
    model.load_state_dict(load_checkpoint(Path(trained["folder"]) / "model.pt")["model"])
    log(f"[sensitivity] every operand alone in {config.low} and {config.high} on the trained FP32 model")
    torch.set_num_threads(1)
    measured = study_sensitivity(model, data, config, seed=seed)
    atomic_write_text(path, json.dumps(measured.to_dict()))
    return SensitivityModel.from_sensitivity(measured)


def _site_order(config: PlanStudyConfig, text: tuple[str, ...] | None) -> list[str]:
    """The BERT's GEMM sites in call order (one forward of a training batch, no gradients)."""
    import torch

    from numscope.run.model import bert_mlm_from_config
    from numscope.sites import sites

    data = _data(config, text)
    model = bert_mlm_from_config(config.experiment(0).model_config(data))
    ids = data.train_blocks[:2].long()
    return [s.name for s in sites(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})]


def _losses(measured: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], float]:
    return {(m["name"], m["seed"]): float(m["val_loss"]) for m in measured}
