"""What the bit budget minimises per operand and format: the relative noise power of its measured SQNR
(optionally weighted per operand), or its measured loss impact (the gradient error quantizing it alone
adds), weighted by its GEMM's role."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping

from numscope.advisor.limits import SQNR, AdvisorError, _mean_sqnr
from numscope.analysis import Analysis, OperandKey, Sensitivity, operand_name
from numscope.plan import HIGH


def _noise_weights(weights: Mapping[str, float] | None) -> list[tuple[str, float]]:
    if weights is None:
        return []
    if not isinstance(weights, Mapping):
        raise AdvisorError(f"noise_weights must map 'site/gemm/operand' globs to numbers, got {weights!r}")
    out = []
    for pattern, value in weights.items():
        if (
            not isinstance(pattern, str)
            or isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise AdvisorError(
                f"noise_weights: {pattern!r}: {value!r} must be a finite number >= 0 keyed by a glob string"
            )
        out.append((pattern, float(value)))
    return out


def _weight_for(name: str, weights: list[tuple[str, float]]) -> float:
    factor = 1.0
    for pattern, value in weights:
        if fnmatch.fnmatchcase(name, pattern):
            factor = value
    return factor


def operand_noise(analysis: Analysis, key: OperandKey, label: str) -> float:
    """The relative noise power the bit-budget objective counts for ``label`` on one operand:
    10^(−SQNR/10) of its mean SQNR (dB, :func:`_mean_sqnr`); 0 for ``high``."""
    if label == HIGH:
        return 0.0
    return 10.0 ** (-_mean_sqnr(analysis.metric_values(key, label, SQNR)) / 10.0)


def operand_impact(
    sensitivity: Sensitivity, key: OperandKey, label: str, analysis: Analysis | None = None
) -> float:
    """An operand's measured loss impact in ``label``: the squared relative error that quantizing it alone
    adds to the parameter gradient of the trained model (``grad_rel_error`` of an operand-granularity
    :class:`~numscope.analysis.Sensitivity`), the noise power it adds to the update; 0 for ``high``.

    Where ``label`` was not measured for the operand but another format was, and ``analysis`` is given, the
    impact is **estimated**: the measured one of the noisiest format measured, times the ratio of the two
    formats' relative noise power on that operand in the analysis (:func:`operand_noise`). The gradient
    error an operand's noise causes is close to proportional to that noise's power (docs/results/plan-study.md
    measures how well the estimate from MXFP4 ranks the measured impacts of the other formats on two
    models), so that one measured format per operand serves them all.
    """
    if label == HIGH:
        return 0.0
    if sensitivity.granularity != "operand":
        raise AdvisorError(
            f"the sensitivity was measured per {sensitivity.granularity}; the sensitivity objective needs "
            "it per operand (numscope.sensitivity(..., granularity='operand'); numscope analyze "
            "`SensitivitySettings.batches` N, `SensitivitySettings.granularity` operand)"
        )
    measured = sensitivity.results.get(key, {})
    metrics = measured.get(label)
    if metrics is not None and "grad_rel_error" in metrics:
        return float(metrics["grad_rel_error"]) ** 2
    reference = _estimate_reference(analysis, key, label, measured) if analysis is not None else None
    if reference is None:
        raise AdvisorError(
            f"{operand_name(key)}: no sensitivity in {label!r} (measured: "
            f"{', '.join(sensitivity.candidates) or 'none'}); measure it among the sensitivity's candidates"
            + ("" if analysis is not None else ", or pass the analysis to estimate it from the measured ones")
        )
    ref_label, ref_noise = reference
    impact = float(measured[ref_label]["grad_rel_error"]) ** 2
    return impact * operand_noise(analysis, key, label) / ref_noise


def _estimate_reference(
    analysis: Analysis, key: OperandKey, label: str, measured: Mapping[str, Mapping[str, float]]
) -> tuple[str, float] | None:
    """The measured format an estimate of ``label`` scales from (the noisiest, for the measurement's own
    signal-to-noise) and its noise power; None where nothing usable was measured or observed."""
    if label not in analysis.candidates:
        return None
    options = []
    for other, metrics in measured.items():
        if "grad_rel_error" not in metrics or other not in analysis.candidates:
            continue
        noise = operand_noise(analysis, key, other)
        if noise > 0 and math.isfinite(noise):
            options.append((noise, other))
    if not options:
        return None
    noise, other = max(options)
    return other, noise


def sensitivity_objective(
    sensitivity: Sensitivity,
    role_weights: Mapping[str, float] | None = None,
    analysis: Analysis | None = None,
) -> Callable[[OperandKey, str], float]:
    """The bit-budget objective of measured sensitivities: :func:`operand_impact` times its GEMM role's
    weight (``role_weights``: gemm → factor, e.g. a gap model's fitted coefficients; default 1 each). The plan
    study found this objective, with fitted role weights, ranking plans as their trained loss gaps did
    (docs/results/plan-study.md). ``analysis``: estimate the formats the sensitivity did not measure
    (:func:`operand_impact`)."""
    weights = dict(role_weights or {})

    def impact(key: OperandKey, label: str) -> float:
        return weights.get(key[1], 1.0) * operand_impact(sensitivity, key, label, analysis)

    impact.covers = lambda key: key in sensitivity.results  # type: ignore[attr-defined]
    return impact


def objective_covers(objective: Callable[[OperandKey, str], float] | None, key: OperandKey) -> bool:
    """Whether ``objective`` can score ``key``: an objective of measured sensitivities covers the operands
    they measured (a forecast measures only the sites its stacks convert); any other objective covers all."""
    check = getattr(objective, "covers", None)
    return check is None or bool(check(key))
