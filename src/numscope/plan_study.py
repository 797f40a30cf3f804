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
(non-negative least squares) on the calibration runs. The study compares predicted and measured gaps of
every plan it trains (Spearman rank correlation).
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import math
import multiprocessing
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from numscope._atomic import atomic_write_text
from numscope._names import layer_index, natural_key
from numscope.analysis import Analysis, OperandKey
from numscope.plan import HIGH, OperandSpec, Plan
from numscope.run.folders import read_settings, setting_changes

GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
FAMILIES: tuple[str, ...] = (
    "reference",
    "uniform",
    "calibration",
    "numscope",
    "heuristic",
    "random",
    "inverse",
)
HEURISTICS: tuple[str, ...] = ("first/last layers", "last layers", "wgrad high", "gradients high")
UNIFORM: tuple[str, ...] = ("bf16", "fp8", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
RESULT_NEUTRAL = ("budgets", "seeds", "random_plans", "uniform", "jobs")
"""Settings that choose which runs the study makes, not what a (plan, seed) run computes: a rerun with other
values reuses every finished run."""
WIN_SIGMAS = 2.0
"""A paired difference counts as a win when its mean exceeds this many standard deviations of it."""


class StudyError(ValueError):
    """Settings the plan study cannot run with."""


# -- operands and orders ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Operands:
    """The operands a plan assigns: keys in the model's site order, and each one's element count."""

    keys: tuple[OperandKey, ...]
    elements: Mapping[OperandKey, int]

    @classmethod
    def from_analysis(cls, analysis: Analysis, site_order: Sequence[str] | None = None) -> Operands:
        """Every operand the analysis measured, ordered by ``site_order`` (the model's call order; sites it
        does not list follow in natural order), then GEMM and operand."""
        order = {site: i for i, site in enumerate(site_order or ())}
        measured = analysis.keys()
        keys = [k for k in measured if analysis.elements.get(k, 0) > 0]
        if not keys:
            raise StudyError("the analysis holds no operand with elements; observe at least one step first")

        def sort_key(key: OperandKey) -> tuple:
            site, gemm, operand = key
            return (order.get(site, len(order)), natural_key(site), GEMMS.index(gemm), operand)

        keys.sort(key=sort_key)
        return cls(tuple(keys), {k: int(analysis.elements[k]) for k in keys})

    def sites(self) -> list[str]:
        return list(dict.fromkeys(k[0] for k in self.keys))

    def sizes(self) -> dict[str, dict[tuple[str, str], int]]:
        """``site → (gemm, operand) → elements``, as :meth:`Plan.average_bits` takes them."""
        out: dict[str, dict[tuple[str, str], int]] = {}
        for site, gemm, operand in self.keys:
            out.setdefault(site, {})[(gemm, operand)] = self.elements[(site, gemm, operand)]
        return out

    def average_bits(self, formats: Mapping[OperandKey, str]) -> float:
        total = sum(self.elements.values())
        return sum(_bits(formats[k]) * n for k, n in self.elements.items()) / total


def _bits(label: str) -> float:
    return OperandSpec(label).bits_per_element()


def order_first_last(operands: Operands) -> list[OperandKey]:
    """Megatron's ``--first-last-layers-bf16``: sites outside the layers (embeddings, head) first, then the
    first and last layer, then inwards; site order within a rank."""
    sites = operands.sites()
    layers = sorted({i for s in sites if (i := layer_index(s)) is not None})
    if not layers:
        return list(operands.keys)
    first, last = layers[0], layers[-1]

    def rank(key: OperandKey) -> int:
        layer = layer_index(key[0])
        return -1 if layer is None else min(layer - first, last - layer)

    return sorted(operands.keys, key=lambda k: (rank(k), operands.keys.index(k)))


def order_last_layers(operands: Operands) -> list[OperandKey]:
    """The NVFP4 recipe's last linear layers in high precision: the last sites (call order) first."""
    sites = operands.sites()
    position = {site: i for i, site in enumerate(sites)}
    return sorted(operands.keys, key=lambda k: (-position[k[0]], operands.keys.index(k)))


def order_wgrad_high(operands: Operands) -> list[OperandKey]:
    """torchao's ``rowwise_with_gw_hp``: the weight-gradient GEMM's operands first, then gradients."""
    role = {"wgrad": 0, "dgrad": 1, "fprop": 2}
    return sorted(operands.keys, key=lambda k: (role[k[1]], k[2] != "grad_output", operands.keys.index(k)))


def order_gradients_high(operands: Operands) -> list[OperandKey]:
    """Per GEMM role, as Transformer Engine's hybrid gives gradients the wide format: every
    ``grad_output`` operand first, then the rest, in site order."""
    return sorted(operands.keys, key=lambda k: (k[2] != "grad_output", operands.keys.index(k)))


HEURISTIC_ORDERS: dict[str, Callable[[Operands], list[OperandKey]]] = {
    "first/last layers": order_first_last,
    "last layers": order_last_layers,
    "wgrad high": order_wgrad_high,
    "gradients high": order_gradients_high,
}


def order_random(operands: Operands, seed: int) -> list[OperandKey]:
    rng = np.random.default_rng(seed)
    return [operands.keys[i] for i in rng.permutation(len(operands.keys))]


def benefit_per_bit(analysis: Analysis, operands: Operands, low: str, high: str) -> dict[OperandKey, float]:
    """The advisor's metric of where bits pay: noise removed by going ``low`` → ``high``, per bit spent."""
    from numscope.advisor import operand_noise

    extra = _bits(high) - _bits(low)
    return {
        k: (operand_noise(analysis, k, low) - operand_noise(analysis, k, high))
        / (extra * operands.elements[k])
        for k in operands.keys
    }


def order_inverse(analysis: Analysis, operands: Operands, low: str, high: str) -> list[OperandKey]:
    """Bits where the metrics say they matter least: ascending benefit per bit."""
    benefit = benefit_per_bit(analysis, operands, low, high)
    return sorted(operands.keys, key=lambda k: (benefit[k], operands.keys.index(k)))


def fill_order(
    order: Sequence[OperandKey], operands: Operands, budget: float, low: str, high: str
) -> dict[OperandKey, str]:
    """Every operand ``low``; then, walking ``order``, each one ``high`` when the average stays within the
    budget. A budget below all-``low`` is an error."""
    formats = {k: low for k in operands.keys}
    total = sum(operands.elements.values())
    used = sum(operands.elements.values()) * _bits(low)
    if used > budget * total + 1e-9:
        raise StudyError(f"budget {budget:g} bits is below all-{low} ({_bits(low):g} bits per element)")
    extra = _bits(high) - _bits(low)
    for key in order:
        cost = extra * operands.elements[key]
        if used + cost <= budget * total + 1e-9:
            formats[key] = high
            used += cost
    return formats


def plan_of(formats: Mapping[OperandKey, str], reason: str = "") -> Plan:
    """A plan with one exact-name rule per site giving each operand its format; other sites stay high."""
    return Plan.per_operand(formats, dict.fromkeys(formats, reason) if reason else None)


def role_plan(operands: Operands, gemm: str, low: str) -> dict[OperandKey, str]:
    """Calibration: ``low`` on every operand of one GEMM role, the rest high."""
    return {k: (low if k[1] == gemm else HIGH) for k in operands.keys}


# -- the loss-impact model ---------------------------------------------------------------------------------


def role_noise(analysis: Analysis, formats: Mapping[OperandKey, str]) -> dict[str, float]:
    """Σ relative noise power of the operands of each GEMM role under ``formats`` (every operand key of
    the plan → its format; the gap model's features)."""
    from numscope.advisor import operand_noise

    out = dict.fromkeys(GEMMS, 0.0)
    for key, label in formats.items():
        out[key[1]] += operand_noise(analysis, key, label)
    return out


@dataclass(frozen=True)
class GapModel:
    """gap (nats) ≈ Σ_role coefficients[role] · noise[role]; ``spread`` is the residual standard deviation
    of the calibration fit (nats), the prediction's uncertainty."""

    coefficients: Mapping[str, float]
    spread: float
    points: int

    @classmethod
    def fit(cls, features: Sequence[Mapping[str, float]], gaps: Sequence[float]) -> GapModel:
        """Non-negative least squares through the origin (no noise, no gap) on calibration points."""
        from scipy.optimize import nnls

        if len(features) != len(gaps) or not features:
            raise StudyError(
                f"a gap model needs matched calibration points; got {len(features)}, {len(gaps)}"
            )
        matrix = np.array([[f[g] for g in GEMMS] for f in features], dtype=float)
        target = np.array(gaps, dtype=float)
        coefficients, _ = nnls(matrix, target)
        residual = target - matrix @ coefficients
        dof = max(1, len(gaps) - int((coefficients > 0).sum()))
        spread = float(math.sqrt(float(residual @ residual) / dof))
        return cls(dict(zip(GEMMS, map(float, coefficients), strict=True)), spread, len(gaps))

    def predict(self, features: Mapping[str, float]) -> float:
        return float(sum(self.coefficients[g] * features[g] for g in GEMMS))

    def predict_plan(self, analysis: Analysis, plan: Plan) -> float:
        """The predicted gap (nats) of ``plan`` on the model ``analysis`` measured; every format the plan
        gives an operand must have been a candidate of the observer."""
        formats = {}
        measured = analysis.keys()
        for key in measured:
            spec = plan.for_site(key[0]).operand(key[1], key[2])
            label = spec.format if spec.format == HIGH else spec.format_spec().name
            if label != HIGH and label not in analysis.candidates:
                raise StudyError(
                    f"{'/'.join(key)}: the plan's {label!r} was not measured (measured: "
                    f"{', '.join(analysis.candidates)}); observe with it among the candidates"
                )
            formats[key] = label
        return self.predict(role_noise(analysis, formats))

    def to_dict(self) -> dict[str, Any]:
        return {"coefficients": dict(self.coefficients), "spread": self.spread, "points": self.points}

    @classmethod
    def load(cls, path: str | Path) -> GapModel:
        """From ``gap_model.json`` (or a ``plan_study.json``, which holds one) of ``numscope study plans``."""
        try:
            data = json.loads(Path(path).read_text())
            data = data.get("gap_model", data)
            coefficients = {g: float(data["coefficients"][g]) for g in GEMMS}
            return cls(coefficients, float(data["spread"]), int(data.get("points", 0)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise StudyError(
                f"{path}: not a gap model (the gap_model.json of 'numscope study plans'): {error}"
            ) from error

    def noise_weights(self) -> dict[str, float]:
        """The advisor's ``noise_weights``: each role's coefficient relative to the largest."""
        top = max(self.coefficients.values())
        if top <= 0:
            return {}
        return {f"*/{g}/*": self.coefficients[g] / top for g in GEMMS}


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan for fewer than 3 points."""
    from scipy.stats import spearmanr

    if len(a) < 3:
        return math.nan
    return float(spearmanr(a, b).statistic)


# -- the sensitivity model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SensitivityModel:
    """A loss model from measured sensitivities instead of tensor noise: each operand quantized alone in a
    format on the trained FP32 model (:func:`numscope.sensitivity`, ``granularity="operand"``) perturbs the
    parameter gradient by a relative error e; its score is e² (the noise power it adds to the update; for
    fprop operands this includes what their forward noise does downstream, e.g. at the MLM head). The
    study fits a :class:`GapModel` on the per-role sums of these scores."""

    scores: Mapping[OperandKey, Mapping[str, float]]

    @classmethod
    def from_sensitivity(cls, sensitivity: Any) -> SensitivityModel:
        scores: dict[OperandKey, dict[str, float]] = {}
        for key, per_format in sensitivity.results.items():
            scores[key] = {label: float(m["grad_rel_error"]) ** 2 for label, m in per_format.items()}
        return cls(scores)

    def score(self, key: OperandKey, label: str) -> float:
        if label == HIGH:
            return 0.0
        try:
            return self.scores[key][label]
        except KeyError as error:
            raise StudyError(f"no sensitivity of {'/'.join(key)} in {label}: measure it first") from error

    def features(self, operands: Operands, formats: Mapping[OperandKey, str]) -> dict[str, float]:
        out = dict.fromkeys(GEMMS, 0.0)
        for key in operands.keys:
            out[key[1]] += self.score(key, formats[key])
        return out


def measure_sensitivity(
    model: Any, data: Any, config: PlanStudyConfig, batches: int = 4, seed: int = 0
) -> Any:
    """Each operand of the trained ``model`` quantized alone in ``config.low`` and ``config.high`` on
    ``batches`` training batches (the loss change and the gradient's relative error against FP32)."""
    from numscope.run.objectives import get_objective
    from numscope.sensitivity import sensitivity

    objective = get_objective("mlm")
    stream = objective.batches(data.train_blocks, config.batch_size, data.tokenizer, seed, 0)
    sample = [next(stream) for _ in range(batches)]
    return sensitivity(model, sample, candidates=[config.low, config.high], granularity="operand", seed=seed)


# -- limits from training outcomes -----------------------------------------------------------------------

LIMIT_METRICS: dict[str, tuple[str, str]] = {
    # advisor criterion: (metric, the direction a worse value goes)
    "min_sqnr_db": ("sqnr_db", "down"),
    "max_underflow_pct": ("underflow%", "up"),
    "max_overflow_pct": ("overflow%", "up"),
    "max_be_ratio": ("be_ratio", "up"),
}


def worst_metrics(
    analysis: Analysis, operands: Operands, formats: Mapping[OperandKey, str]
) -> dict[str, float]:
    """The worst value, over the quantized operands of a plan and the sampled steps, of each metric an
    advisor limit checks (the criterion's name → value)."""
    from numscope.advisor import be_ratio

    worst = {"min_sqnr_db": math.inf, "max_underflow_pct": 0.0, "max_overflow_pct": 0.0, "max_be_ratio": 0.0}
    for key in operands.keys:
        label = formats[key]
        if label == HIGH:
            continue
        worst["min_sqnr_db"] = min(worst["min_sqnr_db"], *analysis.metric_values(key, label, "sqnr_db"))
        worst["max_underflow_pct"] = max(
            worst["max_underflow_pct"], *analysis.metric_values(key, label, "underflow%")
        )
        worst["max_overflow_pct"] = max(
            worst["max_overflow_pct"], *analysis.metric_values(key, label, "overflow%")
        )
        ratio = be_ratio(analysis, key, label)
        if ratio is not None:
            worst["max_be_ratio"] = max(worst["max_be_ratio"], ratio)
    return worst


def derive_limits(outcomes: Sequence[tuple[str, bool, Mapping[str, float]]]) -> dict[str, Any]:
    """The loosest advisor limits that accept every format that trained at FP32 parity.

    outcomes: (plan name, at parity?, :func:`worst_metrics` of the plan). Each limit is set at the worst
    value any parity plan reached (rounded outwards: SQNR down to 0.5 dB, the others up to 2 significant
    digits), so that no format shown to train at parity is rejected; returned with the plans that fell
    behind and which derived limit (if any) still rejects each of them.
    """
    parity = [m for _, ok, m in outcomes if ok]
    if not parity:
        return {"limits": {}, "parity": [], "behind": [], "note": "no uniform format trained at FP32 parity"}
    limits: dict[str, float] = {}
    for criterion, (_, direction) in LIMIT_METRICS.items():
        values = [m[criterion] for m in parity if math.isfinite(m[criterion])]
        if not values:
            continue
        if direction == "down":
            limits[criterion] = math.floor(min(values) * 2) / 2
        else:
            top = max(values)
            limits[criterion] = _round_up(top) if top > 0 else 0.0
    behind = []
    for name, ok, metrics in outcomes:
        if ok:
            continue
        failed = [
            criterion
            for criterion, limit in limits.items()
            if (
                metrics[criterion] < limit
                if LIMIT_METRICS[criterion][1] == "down"
                else metrics[criterion] > limit
            )
        ]
        behind.append({"plan": name, "rejected_by": failed})
    return {"limits": limits, "parity": [n for n, ok, _ in outcomes if ok], "behind": behind}


def _round_up(value: float) -> float:
    digits = 1 - math.floor(math.log10(value))
    factor = 10.0**digits
    return math.ceil(value * factor) / factor


# -- calibrating on a user's model ----------------------------------------------------------------------


@dataclass
class Calibration:
    gap_model: GapModel
    rows: list[dict[str, Any]]  # per calibration plan: name, role noise, gaps per seed
    noise: float  # FP32 seed-to-seed sd (nats)
    analysis: str  # the observed FP32 run's analysis folder
    files: dict[str, str] = field(default_factory=dict)


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
    log: Callable[[str], None] = print,
) -> Calibration:
    """Fit a :class:`GapModel` on any model :func:`numscope.workflow.train` can train.

    Runs, each for ``config.steps`` steps and on every seed: FP32 (the first seed observed), ``low`` on the
    operands of one GEMM role at a time (fprop, dgrad, wgrad), and ``low`` everywhere: 5 × len(seeds) runs.
    Writes ``gap_model.json`` into ``out_dir``; finished runs are reused on a rerun.
    """
    from dataclasses import replace as replace_config

    from numscope import workflow

    out_dir = Path(out_dir)
    seeds = tuple(seeds)
    if len(set(seeds)) != len(seeds) or len(seeds) < 2:
        raise StudyError(f"calibration needs at least two distinct seeds; got {list(seeds)}")
    names = [low, *(c for c in UNIFORM_CANDIDATES if c != low)]
    first = out_dir / "fp32" / f"seed{seeds[0]}"
    results: dict[tuple[str, int], float] = {}
    cfg = replace_config(config, seed=seeds[0])
    log(f"[calibrate] fp32, observed (seed {seeds[0]})")
    results[("fp32", seeds[0])] = workflow.analyze(
        model, data, first, config=cfg, candidates=names, every=every, objective=objective
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
            results[("fp32", seed)] = workflow.train(
                model, data, folder, plan="fp32", config=cfg, objective=objective, name="fp32"
            ).val_loss
        for plan in plans:
            log(f"[calibrate] {plan.name} (seed {seed})")
            folder = out_dir / _slug(plan.name) / f"seed{seed}"
            results[(plan.name, seed)] = workflow.train(
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
                "gaps": gaps,
                "gap_mean": float(np.mean(gaps)),
            }
        )
    gap_model = GapModel.fit([r["noise_by_role"] for r in rows], [r["gap_mean"] for r in rows])
    fp32 = [results[("fp32", s)] for s in seeds]
    noise = float(np.std(fp32, ddof=1))
    path = out_dir / "gap_model.json"
    atomic_write_text(
        path,
        json.dumps(
            {**gap_model.to_dict(), "fp32_seed_sd": noise, "seeds": list(seeds), "low": low, "runs": rows,
             "uniform_preset": preset, "analysis": str(first / "analysis")},
            indent=1,
        ),
    )  # fmt: skip
    return Calibration(gap_model, rows, noise, str(first / "analysis"), {"gap model": str(path)})


# -- configuration ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanStudyConfig:
    """What the study trains: the demo's BERT knobs and training; budgets in bits per operand element;
    ``jobs`` runs train side by side in processes of one thread each.

    Why these defaults (measured with FP32 runs, 1 thread each, 2 side by side): a 1,000-token vocabulary
    and 128-token blocks learn context faster per second than the demo's 4,000 and 64 (−0.41 nats below the
    context-free loss after 500 steps at lr 2e-3, against −0.20); but at lr 2e-3 one seed in three stayed on
    the context-free plateau for all 500 steps (5.61 against 5.27–5.31 nats), which would make seed noise
    swamp every gap. At lr 1e-3 four seeds of four left the plateau by step 150 and ended 300 steps at
    5.47–5.52 nats (−0.17 to −0.23 below the context-free loss), 32 s per run; 300 steps keep the whole
    study (about 140 runs) under an hour on two cores."""

    budgets: tuple[float, ...] = (5.0, 6.0, 7.0)
    seeds: tuple[int, ...] = (0, 1, 2)
    random_plans: int = 5
    low: str = "mxfp4_e2m1"
    high: str = "mxfp8_e4m3"
    uniform: tuple[str, ...] = UNIFORM
    jobs: int = 2
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    hidden: int = 128
    layers: int = 2
    heads: int = 2
    intermediate: int = 512
    seq_len: int = 128
    vocab_size: int = 1000
    observe_every: int = 25

    @classmethod
    def quick(cls) -> PlanStudyConfig:
        return cls(
            budgets=(6.0,),
            seeds=(0, 1),
            random_plans=2,
            uniform=("mxfp8", "mxfp4"),
            steps=40,
            hidden=64,
            intermediate=128,
            seq_len=64,
            observe_every=10,
        )

    def check(self) -> None:
        if len(set(self.seeds)) != len(self.seeds) or not self.seeds:
            raise StudyError(f"seeds must be distinct and at least one; got {list(self.seeds)}")
        for budget in self.budgets:
            if not _bits(self.low) <= budget <= _bits(self.high):
                raise StudyError(
                    f"budget {budget:g} must lie between {self.low} ({_bits(self.low):g} bits) and "
                    f"{self.high} ({_bits(self.high):g} bits)"
                )
        if self.jobs < 1 or self.random_plans < 0:
            raise StudyError(f"jobs must be >= 1 and random_plans >= 0; got {self.jobs}, {self.random_plans}")
        for name in self.uniform:
            Plan.named(name)

    def demo_config(self, seed: int) -> Any:
        from numscope.demo.main import DemoConfig
        from numscope.run.config import TrainConfig

        train = TrainConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            warmup_steps=max(1, self.steps // 16),
            eval_every=max(1, self.steps // 10),
            checkpoint_every=max(1, self.steps // 5),
            seed=seed,
        )
        candidates = tuple(dict.fromkeys((self.low, self.high, *UNIFORM_CANDIDATES)))
        return DemoConfig(
            train=train,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            intermediate=self.intermediate,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            observe_every=self.observe_every,
            candidates=candidates,
        )


UNIFORM_CANDIDATES = (
    "bf16",
    "fp16",
    "fp8_e4m3",
    "fp8_e5m2",
    "mxfp8_e4m3",
    "mxfp6_e3m2",
    "mxfp4_e2m1",
    "nvfp4",
)
"""What the FP32 run measures: every format the uniform plans use (their predicted gaps need them)."""


# -- plans -----------------------------------------------------------------------------------------------


@dataclass
class StudyPlan:
    name: str
    family: str
    budget: float | None
    formats: dict[OperandKey, str] | None  # None: a named plan (uniform, fp32)
    preset: str | None = None

    def plan(self) -> Plan:
        return Plan.named(self.preset) if self.preset else plan_of(self.formats or {}, self.name)


def budget_plans(
    analysis: Analysis,
    operands: Operands,
    config: PlanStudyConfig,
    gap_model: GapModel | None = None,
    sensitivity: tuple[SensitivityModel, GapModel] | None = None,
) -> list[StudyPlan]:
    """Every plan of every budget: numscope's (and its calibrated variant given ``gap_model``), the
    heuristics, the random orders and the inverse, each filled to the budget."""
    from numscope.advisor import advise

    off = dict(max_be_ratio=None, max_underflow_pct=None, max_overflow_pct=None, min_sqnr_db=None)
    variants: dict[str, dict[str, Any]] = {"numscope": {}}  # name → how the advisor is asked
    if gap_model is not None and gap_model.noise_weights():
        variants["numscope calibrated"] = {"noise_weights": gap_model.noise_weights()}
    if sensitivity is not None:
        scores, fitted = sensitivity

        def loss_impact(key: OperandKey, label: str) -> float:
            return fitted.coefficients[key[1]] * scores.score(key, label)

        variants["numscope sensitivity"] = {"objective": loss_impact}
    plans = []
    for budget in config.budgets:
        tag = f"@{budget:g}"
        for name, asked in variants.items():
            rec = advise(analysis, candidates=[config.low, config.high], bit_budget=budget, **asked, **off)
            formats = {c.key: c.format for c in rec.choices}
            plans.append(StudyPlan(f"{name}{tag}", "numscope", budget, formats))
        for name, order in HEURISTIC_ORDERS.items():
            formats = fill_order(order(operands), operands, budget, config.low, config.high)
            plans.append(StudyPlan(f"{name}{tag}", "heuristic", budget, formats))
        for index in range(config.random_plans):
            seed = int(1000 * budget) * 100 + index
            formats = fill_order(order_random(operands, seed), operands, budget, config.low, config.high)
            plans.append(StudyPlan(f"random {index + 1}{tag}", "random", budget, formats))
        inverse = order_inverse(analysis, operands, config.low, config.high)
        plans.append(
            StudyPlan(
                f"inverse{tag}",
                "inverse",
                budget,
                fill_order(inverse, operands, budget, config.low, config.high),
            )
        )
    for plan in plans:  # the advisor also assigns operands without elements; keep the study's operands
        plan.formats = {k: (plan.formats or {}).get(k, config.low) for k in operands.keys}
    return plans


def calibration_plans(operands: Operands, config: PlanStudyConfig) -> list[StudyPlan]:
    return [
        StudyPlan(
            f"{config.low.split('_')[0]} {gemm} only",
            "calibration",
            None,
            role_plan(operands, gemm, config.low),
        )
        for gemm in GEMMS
    ]


def uniform_formats(name: str, operands: Operands) -> dict[OperandKey, str]:
    """The format a preset gives each operand (for its bits and its predicted gap)."""
    plan = Plan.named(name)
    return {k: plan.for_site(k[0]).operand(k[1], k[2]).format for k in operands.keys}


# -- running ---------------------------------------------------------------------------------------------

_DATA: dict[Any, Any] = {}


def _data(config: PlanStudyConfig, text_paths: tuple[str, ...] | None) -> Any:
    from numscope.demo.main import prepare_data

    key = (config.vocab_size, config.seq_len, text_paths)
    if key not in _DATA:
        _DATA[key] = prepare_data(
            config.demo_config(0), [Path(p) for p in text_paths] if text_paths else None
        )
    return _DATA[key]


def _train(task: dict[str, Any]) -> dict[str, Any]:
    """One (plan, seed) run in its folder; resumes or returns a finished result (train_run's contract)."""
    import torch

    from numscope.demo.main import model_config, training_observer
    from numscope.run.config import RunSpec
    from numscope.run.loop import train_run

    torch.set_num_threads(1)
    config = PlanStudyConfig(**task["config"])
    data = _data(config, task["text"])
    demo = config.demo_config(task["seed"])
    plan = Plan.named(task["plan"]) if not task["plan"].endswith(".yaml") else Plan.load(task["plan"])
    observer = (lambda model: training_observer(model, demo)) if task["observe"] else None
    result = train_run(
        RunSpec(task["name"], task["plan"]),
        model_config(demo, data),
        demo.train,
        data,
        Path(task["folder"]),
        observer_factory=observer,
        compiled=bool(plan.uses_block_formats()) and not task["observe"],
        save_model=bool(task.get("save_model", False)),
    )
    return {
        "name": task["name"],
        "seed": task["seed"],
        "val_loss": result.val_loss,
        "wall": result.wall_seconds,
    }


def _run_all(tasks: list[dict[str, Any]], jobs: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    if jobs == 1 or len(tasks) == 1:
        out = []
        for task in tasks:
            out.append(_train(task))
            log(f"  {task['name']} seed {task['seed']}: {out[-1]['val_loss']:.4f}")
        return out
    results: list[dict[str, Any]] = []
    context = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        pending = {pool.submit(_train, task): task for task in tasks}
        for done in futures.as_completed(pending):
            result = done.result()
            results.append(result)
            log(f"  {result['name']} seed {result['seed']}: {result['val_loss']:.4f} ({result['wall']:.0f}s)")
    return results


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", name)


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
    wanted = json.loads(json.dumps({"config": run_settings, "text": text}))  # tuples as lists, as stored
    stored = read_settings(settings)
    if stored is not None and (changes := setting_changes(stored, wanted)):
        raise StudyError(
            f"{out_dir} holds runs trained with other settings ({'; '.join(changes[:3])}); use another --out "
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
        [float(np.mean(gaps(p.name))) for p in calibration],
    )
    log(
        "[model] gap ≈ "
        + " + ".join(f"{gap_model.coefficients[g]:.4g}·noise({g})" for g in GEMMS)
        + f" nats (residual {gap_model.spread:.3g})"
    )
    scores = _sensitivity_scores(out_dir, config, text, task, log)
    sensitivity_model = GapModel.fit(
        [scores.features(operands, formats_of(p)) for p in calibration],
        [float(np.mean(gaps(p.name))) for p in calibration],
    )
    log(
        "[model] from sensitivities: gap ≈ "
        + " + ".join(f"{sensitivity_model.coefficients[g]:.4g}·S({g})" for g in GEMMS)
        + f" nats (residual {sensitivity_model.spread:.3g})"
    )
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
        at_parity = verdict(gaps(plan.name)) in ("tie", "same", "better")
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
    table = study_table(rows, noise, config, unigram, fp32, rho, gap_model)
    table += "\n" + (
        "Predicted within a factor of 2 of the measured gap, over the plans whose gap exceeds 2 sd of its "
        f"paired noise: noise model {within_two['predicted_gap']}, sensitivity model "
        f"{within_two['predicted_gap_sensitivity']}."
    )
    table += (
        "\nFrom sensitivities (each operand alone on the trained FP32 model): gap = "
        + " + ".join(f"{sensitivity_model.coefficients[g]:.4g}·S({g})" for g in GEMMS)
        + f" (residual sd {sensitivity_model.spread:.3g} nats); Spearman with the measured gap: "
        f"{rho_sensitivity:.2f}.\n" + limits_text(derived)
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

    from numscope.demo.main import model_config
    from numscope.run.model import bert_mlm_from_config
    from numscope.train.checkpoint import load_checkpoint

    seed = config.seeds[0]
    trained = {**task("fp32 model", "fp32", seed), "save_model": True}
    _run_all([trained], 1, log)
    data = _data(config, text)
    model = bert_mlm_from_config(model_config(config.demo_config(seed), data))
    model.load_state_dict(load_checkpoint(Path(trained["folder"]) / "model.pt")["model"])
    log(f"[sensitivity] every operand alone in {config.low} and {config.high} on the trained FP32 model")
    torch.set_num_threads(1)
    measured = measure_sensitivity(model, data, config, seed=seed)
    atomic_write_text(path, json.dumps(measured.to_dict()))
    return SensitivityModel.from_sensitivity(measured)


def _site_order(config: PlanStudyConfig, text: tuple[str, ...] | None) -> list[str]:
    """The BERT's GEMM sites in call order (one forward of a training batch, no gradients)."""
    import torch

    from numscope.demo.main import model_config
    from numscope.run.model import bert_mlm_from_config
    from numscope.sites import sites

    data = _data(config, text)
    model = bert_mlm_from_config(model_config(config.demo_config(0), data))
    ids = data.train_blocks[:2].long()
    return [s.name for s in sites(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})]


def _preset_of(label: str) -> str | None:
    """The uniform preset whose every operand is ``label`` (e.g. ``mxfp4`` for ``mxfp4_e2m1``), if any."""
    for name in Plan.presets():
        formats = {spec.format for spec in Plan.named(name).default.operands.values()}
        if formats == {label}:
            return name
    return None


def _losses(measured: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], float]:
    return {(m["name"], m["seed"]): float(m["val_loss"]) for m in measured}


def _rank(rows: list[dict[str, Any]]) -> None:
    """Per budget: each plan's rank by mean gap, and its paired verdict against numscope's reference plan
    of that budget (:func:`reference_plan`)."""
    for budget in sorted({r["budget"] for r in rows if r["budget"] is not None}):
        group = sorted((r for r in rows if r["budget"] == budget), key=lambda r: r["gap_mean"])
        ours = reference_plan(group)
        for rank, row in enumerate(group, 1):
            row["rank"] = rank
            row["of"] = len(group)
            diff = np.array(row["gaps"]) - np.array(ours["gaps"])
            row["vs_numscope"] = verdict(diff)


def factor_two_share(rows: Sequence[Mapping[str, Any]], field_name: str) -> str:
    """``k of n``: of the plans whose mean gap exceeds twice its paired standard deviation (a gap beyond
    the noise), how many have a prediction within a factor of 2 of it."""
    clear = [
        r
        for r in rows
        if r["gap_mean"] > 0 and math.isfinite(r["gap_sd"]) and r["gap_mean"] > 2 * r["gap_sd"]
    ]
    good = sum(1 for r in clear if 0.5 * r["gap_mean"] <= r[field_name] <= 2.0 * r["gap_mean"])
    return f"{good} of {len(clear)}"


def reference_plan(group: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The numscope plan the others of a budget are compared with: the sensitivity-driven one where the
    study made it (the advisor's best-informed choice), else the plain bit-budget one."""
    numscope = [r for r in group if r["family"] == "numscope"]
    return next((r for r in numscope if r["name"].startswith("numscope sensitivity@")), numscope[0])


def verdict(differences: Sequence[float]) -> str:
    """``worse``/``better`` than the comparison when the paired differences' mean exceeds WIN_SIGMAS of
    their standard deviation over ≥ 3 seeds (positive = this plan's loss is higher), else ``tie``."""
    diff = np.asarray(differences, dtype=float)
    if len(diff) < 3:
        return "n/a (<3 seeds)"
    mean, sd = float(diff.mean()), float(diff.std(ddof=1))
    if sd == 0.0:
        return "same" if mean == 0.0 else ("worse" if mean > 0 else "better")
    if abs(mean) < WIN_SIGMAS * sd:
        return "tie"
    return "worse" if mean > 0 else "better"


def limits_text(derived: Mapping[str, Any]) -> str:
    if not derived.get("limits"):
        return f"\nAdvisor limits from these outcomes: none ({derived.get('note', 'no data')})."
    limits = ", ".join(f"{k} {v:g}" for k, v in derived["limits"].items())
    behind = "; ".join(
        f"{b['plan']} (rejected by {', '.join(b['rejected_by']) or 'none of them'})"
        for b in derived["behind"]
    )
    return (
        f"\nAdvisor limits from these outcomes (the loosest that accept every uniform format at FP32 parity: "
        f"{', '.join(derived['parity'])}): {limits}. Behind FP32 beyond the noise: {behind or 'none'}."
    )


def budget_summary(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per budget, where each numscope plan stands: its rank by mean gap and the paired verdicts of every
    other plan of that budget against it."""
    lines = []
    for budget in sorted({r["budget"] for r in rows if r["budget"] is not None}):
        group = [r for r in rows if r["budget"] == budget]
        for ours in (r for r in group if r["family"] == "numscope"):
            others = [r for r in group if r is not ours]
            counts = {"better": 0, "tie": 0, "worse": 0}
            for row in others:
                outcome = verdict(np.array(row["gaps"]) - np.array(ours["gaps"]))
                if outcome in counts:
                    counts[outcome] += 1
            random = [r["gap_mean"] for r in group if r["family"] == "random"]
            random_text = f"; random plans {np.mean(random):+.4f} on average" if random else ""
            lines.append(
                f"- {budget:g} bits: {ours['name']} ranks {ours['rank']}/{ours['of']} "
                f"(gap {ours['gap_mean']:+.4f} ± {ours['gap_sd']:.4f}){random_text}; of the other "
                f"{len(others)} plans, {counts['worse']} are worse beyond the noise, {counts['tie']} tie and "
                f"{counts['better']} are better"
            )
    return lines


def study_table(
    rows: Sequence[Mapping[str, Any]],
    noise: float,
    config: PlanStudyConfig,
    unigram: Mapping[int, float],
    fp32: Sequence[float],
    rho: float,
    gap_model: GapModel,
) -> str:
    n = len(config.seeds)
    lines = [
        f"FP32 validation loss {np.mean(fp32):.4f} ± {noise:.4f} nats (sd over {n} seeds; the context-free "
        f"loss is {np.mean(list(unigram.values())):.4f}); gaps are paired by seed, mean ± sd over {n} seeds.",
        f"low = {config.low}, high = {config.high}; 'vs numscope': this plan against numscope sensitivity "
        "(numscope's plain plan where the sensitivity one was not made), better/worse when the paired "
        "difference is beyond "
        f"{WIN_SIGMAS:g} sd counts (needs ≥ 3 seeds).",
        "",
        "| plan | family | avg bits | gap (nats) | predicted: noise | sensitivity | rank | vs numscope |",
        "|------|--------|----------|------------|------------------|-------------|------|-------------|",
    ]
    for row in sorted(rows, key=lambda r: (r["budget"] is not None, r["budget"] or 0, r["gap_mean"])):
        rank = f"{row['rank']}/{row['of']}" if "rank" in row else ""
        sd = "" if math.isnan(row["gap_sd"]) else f" ± {row['gap_sd']:.4f}"
        lines.append(
            f"| {row['name']} | {row['family']} | {row['bits']:.2f} | {row['gap_mean']:+.4f}{sd} | "
            f"{row['predicted_gap']:+.4f} | {row.get('predicted_gap_sensitivity', math.nan):+.4f} | {rank} | "
            f"{row.get('vs_numscope', '')} |"
        )
    lines += ["", *budget_summary(rows)]
    lines += [
        "",
        "Predicted gap = "
        + " + ".join(f"{gap_model.coefficients[g]:.4g}·noise({g})" for g in GEMMS)
        + f" (fitted on {gap_model.points} calibration runs, residual sd {gap_model.spread:.3g} nats); "
        f"Spearman rank correlation with the measured gap over the uniform and budget plans: {rho:.2f}.",
    ]
    return "\n".join(lines)


__all__ = [
    "GapModel",
    "Operands",
    "PlanStudyConfig",
    "PlanStudyResult",
    "StudyError",
    "budget_plans",
    "fill_order",
    "plan_of",
    "run_plan_study",
    "spearman",
    "verdict",
]
