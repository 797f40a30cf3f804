"""Models that predict a plan's validation-loss gap to FP32 before it is trained: from the FP32 analysis's
tensor noise per GEMM role (:class:`GapModel`) or from measured gradient sensitivities
(:class:`SensitivityModel`), and the rank correlation that judges them."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from numscope.analysis import Analysis, OperandKey
from numscope.plan import HIGH, Plan
from numscope.study.config import PlanStudyConfig, StudyError
from numscope.study.operands import Operands
from numscope.vocab import GEMMS


def role_noise(analysis: Analysis, formats: Mapping[OperandKey, str]) -> dict[str, float]:
    """Σ relative noise power of the operands of each GEMM role under ``formats`` (every operand key of
    the plan → its format; the gap model's features)."""
    from numscope.advisor import operand_noise

    out = dict.fromkeys(GEMMS, 0.0)
    for key, label in formats.items():
        out[key[1]] += operand_noise(analysis, key, label)
    return out


def role_sensitivity(
    sensitivity: Any, formats: Mapping[OperandKey, str], analysis: Analysis | None = None
) -> dict[str, float]:
    """Σ measured loss impact (:func:`numscope.advisor.operand_impact`) of the operands of each GEMM role
    under ``formats`` (the sensitivity gap model's features)."""
    from numscope.advisor import AdvisorError, operand_impact

    out = dict.fromkeys(GEMMS, 0.0)
    for key, label in formats.items():
        try:
            out[key[1]] += operand_impact(sensitivity, key, label, analysis)
        except AdvisorError as error:
            raise StudyError(str(error)) from error
    return out


FEATURES: tuple[str, ...] = ("noise", "sensitivity")


@dataclass(frozen=True)
class GapModel:
    """gap (nats) ≈ Σ_role coefficients[role] · feature[role], the feature per GEMM role being the FP32
    analysis's relative noise power (``features="noise"``, :func:`role_noise`) or the measured loss impact
    of the operands (``"sensitivity"``, :func:`role_sensitivity`); ``spread`` is the residual standard
    deviation of the calibration fit (nats), the prediction's uncertainty."""

    coefficients: Mapping[str, float]
    spread: float
    points: int
    features: str = "noise"
    pooled: float | None = None
    """The prior every role's coefficient is drawn towards (:meth:`fit`); None for a model stored before
    the fit had one."""
    formats: tuple[str, ...] = ()
    """The formats the calibration runs used (empty: not recorded); a plan in others is extrapolated."""

    @classmethod
    def fit(
        cls,
        features: Sequence[Mapping[str, float]],
        gaps: Sequence[Sequence[float]],
        kind: str = "noise",
        formats: Sequence[str] = (),
    ) -> GapModel:
        """Fit on calibration points: per point its features per role and its paired gaps to FP32, one per
        seed.

        Non-negative least squares through the origin (no noise, no gap), each point weighted by its seed
        noise, with a prior that keeps a role's coefficient from being decided by a result inside its
        noise. Minimised over c ≥ 0::

            Σ_points (mean gap − Σ_role c_role · feature_role)² / sd²  +  Σ_role (c_role − c̄)² / c̄²

        sd is the point's standard deviation of the gap over the seeds (the study's noise convention: a
        difference is beyond the noise at 2 sd), floored at a millionth of the largest mean gap so that
        exact points stay finite. c̄, the **pooled** coefficient, is the weighted least-squares fit of one
        coefficient shared by every role (every role costing alike), and the prior says "a role costs what
        the average role costs, give or take that much again". A role whose own calibration point is
        resolved beyond its noise keeps about its own coefficient; one whose point is inside its noise (on
        the demo's model, forward noise alone: docs/results/plan-study.md) is drawn towards c̄ instead of
        reading as free, which the plain fit did (the plan then put every forward operand in the low
        format and lost to "keep the last layers high", docs/results/plan-study.md). With c̄ = 0 (no point
        shows any cost) there is no prior. A point with a single seed has no measured noise: it counts with
        the largest sd of the other points (or as exact when every point has one seed).
        """
        from scipy.optimize import nnls

        if len(features) != len(gaps) or not features:
            raise StudyError(
                f"a gap model needs matched calibration points; got {len(features)}, {len(gaps)}"
            )
        per_seed = [np.atleast_1d(np.asarray(g, dtype=float)) for g in gaps]
        if any(g.size == 0 or not np.isfinite(g).all() for g in per_seed):
            raise StudyError("every calibration point needs at least one finite gap (one per seed)")
        matrix = np.array([[f[g] for g in GEMMS] for f in features], dtype=float)
        target = np.array([g.mean() for g in per_seed])
        sds = [float(g.std(ddof=1)) if g.size > 1 else math.nan for g in per_seed]
        floor = 1e-6 * max(float(np.abs(target).max()), 1e-12)
        known = [sd for sd in sds if math.isfinite(sd)]
        sd = np.array([max(s if math.isfinite(s) else max(known, default=0.0), floor) for s in sds])
        totals = matrix.sum(axis=1)
        weight = 1.0 / sd**2
        shared = float((weight * totals * target).sum() / (weight * totals**2).sum()) if totals.any() else 0.0
        pooled = max(0.0, shared)
        rows, values = matrix / sd[:, None], target / sd
        if pooled > 0:
            rows = np.vstack([rows, np.eye(len(GEMMS)) / pooled])
            values = np.concatenate([values, np.ones(len(GEMMS))])
        coefficients, _ = nnls(rows, values)
        residual = target - matrix @ coefficients
        dof = max(1, len(per_seed) - int((coefficients > 0).sum()))
        spread = float(math.sqrt(float(residual @ residual) / dof))
        return cls(
            dict(zip(GEMMS, map(float, coefficients), strict=True)),
            spread,
            len(per_seed),
            kind,
            pooled,
            tuple(formats),
        )

    def formula(self) -> str:
        """The fitted model as text: ``c·noise(fprop) + … nats`` (``S(…)`` for sensitivity features), with
        the pooled coefficient every role's was drawn towards."""
        symbol = "S" if self.features == "sensitivity" else "noise"
        terms = " + ".join(f"{self.coefficients[g]:.4g}·{symbol}({g})" for g in GEMMS)
        prior = "" if self.pooled is None else f"; every role drawn towards {self.pooled:.4g}"
        return f"{terms} nats (residual sd {self.spread:.3g}{prior})"

    def predict(self, features: Mapping[str, float]) -> float:
        return float(sum(self.coefficients[g] * features[g] for g in GEMMS))

    def predict_plan(self, analysis: Analysis, plan: Plan) -> float:
        """The predicted gap (nats) of ``plan`` on the model ``analysis`` measured; every format the plan
        gives an operand must have been a candidate of the observer."""
        formats = self._plan_formats(analysis, plan)
        if self.features == "sensitivity":
            if analysis.sensitivity is None:
                raise StudyError(
                    "the sensitivity gap model needs the analysis's operand sensitivity (numscope analyze "
                    "`SensitivitySettings.batches` N, `SensitivitySettings.granularity` operand)"
                )
            return self.predict(role_sensitivity(analysis.sensitivity, formats, analysis))
        return self.predict(role_noise(analysis, formats))

    def uncalibrated(self, analysis: Analysis, plan: Plan) -> list[str]:
        """The formats ``plan`` gives a measured operand that no calibration run used (high precision
        aside): where its prediction extrapolates. Empty also when the model does not record its formats
        (a gap_model.json from before they were stored)."""
        if not self.formats:
            return []
        used = set(self._plan_formats(analysis, plan).values())
        return sorted(used - set(self.formats) - {HIGH, "fp32"})

    def _plan_formats(self, analysis: Analysis, plan: Plan) -> dict[OperandKey, str]:
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
        return formats

    def to_dict(self) -> dict[str, Any]:
        return {
            "coefficients": dict(self.coefficients),
            "spread": self.spread,
            "points": self.points,
            "features": self.features,
            "pooled": self.pooled,
            "formats": list(self.formats),
        }

    @classmethod
    def load(cls, path: str | Path, features: str = "noise") -> GapModel:
        """From ``gap_model.json`` of ``numscope calibrate`` (or a ``plan_study.json``, which holds one); a
        calibration that also measured sensitivities holds the ``features="sensitivity"`` model under the
        key ``sensitivity``."""
        if features not in FEATURES:
            raise StudyError(f"unknown gap-model features {features!r}; allowed: {', '.join(FEATURES)}")
        try:
            data = json.loads(Path(path).read_text())
            data = top = data.get("gap_model", data)
        except (OSError, ValueError, AttributeError) as error:
            raise StudyError(
                f"{path}: not a gap model (the gap_model.json of 'numscope calibrate'): {error}"
            ) from error
        if features == "sensitivity":
            if not isinstance(data.get("sensitivity"), dict):
                raise StudyError(
                    f"{path}: fitted without sensitivities; rerun 'numscope calibrate' (it now measures "
                    "them) to predict with the sensitivity objective"
                )
            data = data["sensitivity"]
        try:
            coefficients = {g: float(data["coefficients"][g]) for g in GEMMS}
            pooled = data.get("pooled")
            # older files name only calibrate's "low" (and "also") beside the model
            formats = data.get("formats") or [top[k] for k in ("low",) if isinstance(top.get(k), str)] + list(
                top.get("also") or ()
            )
            return cls(
                coefficients,
                float(data["spread"]),
                int(data.get("points", 0)),
                features,
                None if pooled is None else float(pooled),
                tuple(str(f) for f in formats),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise StudyError(
                f"{path}: not a gap model (the gap_model.json of 'numscope calibrate'): {error}"
            ) from error

    def role_weights(self) -> dict[str, float]:
        """Each role's coefficient relative to the largest (empty when every coefficient is 0)."""
        top = max(self.coefficients.values())
        return {g: self.coefficients[g] / top for g in GEMMS} if top > 0 else {}

    def noise_weights(self) -> dict[str, float]:
        """The advisor's ``noise_weights``: each role's coefficient relative to the largest."""
        return {f"*/{g}/*": weight for g, weight in self.role_weights().items()}


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
        from numscope.advisor import operand_impact

        scores: dict[OperandKey, dict[str, float]] = {}
        for key, per_format in sensitivity.results.items():
            scores[key] = {label: operand_impact(sensitivity, key, label) for label in per_format}
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


def study_sensitivity(model: Any, data: Any, config: PlanStudyConfig, batches: int = 4, seed: int = 0) -> Any:
    """Each operand of the trained ``model`` quantized alone in ``config.low`` and ``config.high`` on
    ``batches`` training batches (the loss change and the gradient's relative error against FP32)."""
    from numscope.run.objectives import get_objective
    from numscope.sensitivity import sensitivity

    objective = get_objective("mlm")
    stream = objective.batches(data.train_blocks, config.batch_size, data.tokenizer, seed, 0)
    sample = [next(stream) for _ in range(batches)]
    return sensitivity(model, sample, candidates=[config.low, config.high], granularity="operand", seed=seed)
