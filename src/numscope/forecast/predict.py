"""A plan's loss gap to FP32, predicted from one observed FP32 run: the two terms of
:class:`numscope.forecast.measure.PlanEffect` in nats.

    gap ≈ ΔL_eval + (η / 4) · N

**ΔL_eval** is what the plan's forward costs the trained model on validation tokens: a run under the plan
is evaluated under it, so this much of its gap is there even if training were unchanged. **N** is the
power of the plan's gradient error in Adam's metric, Σ_i P_i (ĝ_i − g_i)² with P_i = 1/(√v̂_i + ε); for
training near a minimum with an update η·P·g, extra zero-mean update noise of that power raises the
expected loss by (η/4)·N whatever the curvature (the stationary solution of the Lyapunov equation of
preconditioned SGD: tr(H C) = (η/2) tr(P Σ)), the mechanism by which minibatch noise keeps SGD above the
minimum. η is the learning rate the noise sees: :func:`effective_lr` (docs/results/forecast.md says which was
chosen and how it was checked). The interval carries the measurement's own spread over its batches and the
predictor's accuracy as measured against trained runs (:data:`ACCURACY`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from numscope.forecast.measure import PlanEffect

SIGNAL_LOST_DB = 3.0
"""An operand whose SQNR falls below this at any observed step has lost half its power or more to the
quantization (a gradient flushed to zero sits at 0 dB): the plan then starves what learns from it, which the
noise model does not describe; its prediction says so instead of giving a number."""

SIGNAL_LOST_FLUSHED_PCT = 95.0
"""An operand of which this share of the nonzero elements or more is flushed to zero at an observed step
has lost its signal too, whatever its SQNR (an LM head's output gradient can keep the target token's large
entry, and a high SQNR, while losing every other token's small ones); the threshold and the runs it was
chosen between are in docs/results/forecast.md ("Where the model does not apply")."""

ACCURACY = 2.0
"""The factor within which a prediction is taken to hold (the interval is [gap / ACCURACY, gap · ACCURACY]
widened by the measurement's spread); docs/results/forecast.md shows how often predictions fell inside it."""

LR_RULES = ("mean", "final", "peak")


def effective_lr(schedule: list[float], rule: str = "mean") -> float:
    """The learning rate the update noise is weighed with, from the run's per-step rates: their ``mean``
    (default), the ``final`` one, or the ``peak``."""
    if not schedule:
        raise ValueError("effective_lr needs the run's learning rates")
    if rule == "mean":
        return sum(schedule) / len(schedule)
    if rule == "final":
        return schedule[-1]
    if rule == "peak":
        return max(schedule)
    raise ValueError(f"unknown rule {rule!r}; allowed: {', '.join(LR_RULES)}")


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted gap to FP32 (nats) with its parts and interval."""

    gap: float
    forward: float  # ΔL_eval
    update: float  # (η/4)·N
    low: float
    high: float
    lost: str = ""
    """Where an operand of the plan loses its signal (:data:`SIGNAL_LOST_DB`): the operand, its format, its
    SQNR and the step; the gap is then not predicted (inf) but the plan expected to fail."""

    def beyond(self, noise: float | None) -> bool | None:
        """Whether the predicted gap lies beyond 2 × FP32's seed standard deviation ``noise`` (None: not
        known)."""
        if self.lost:
            return True
        if noise is None or not math.isfinite(noise):
            return None
        return self.gap > 2.0 * noise

    def to_dict(self) -> dict[str, Any]:
        return {"gap": self.gap, "forward": self.forward, "update": self.update, "low": self.low,
                "high": self.high, "lost": self.lost}  # fmt: skip


def _mean_and_error(values: tuple[float, ...]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return math.inf, 0.0
    mean = statistics.fmean(values)
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, error


def predict(effect: PlanEffect, lr: float, accuracy: float = ACCURACY, lost: str = "") -> Prediction:
    """The predicted gap of a plan whose measured effect is ``effect``, for a run whose noise sees the
    learning rate ``lr`` (:func:`effective_lr`); ``lost``: where the plan loses an operand's signal
    (:func:`signal_lost`), which makes the prediction a failure instead of a number."""
    if lost:
        return Prediction(math.inf, math.nan, math.nan, math.inf, math.inf, lost)
    forward, forward_error = _mean_and_error(effect.loss_change)
    noise, noise_error = _mean_and_error(effect.update_noise)
    update = lr / 4.0 * noise
    gap = forward + update
    spread = 2.0 * math.hypot(forward_error, lr / 4.0 * noise_error)
    if not math.isfinite(gap):
        return Prediction(math.inf, forward, update, math.inf, math.inf)
    scaled = (gap / accuracy, gap * accuracy) if gap >= 0 else (gap * accuracy, gap / accuracy)
    return Prediction(gap, forward, update, scaled[0] - spread, scaled[1] + spread)


def signal_lost(
    analysis: Any, plan: Any, threshold: float = SIGNAL_LOST_DB, flushed: float = SIGNAL_LOST_FLUSHED_PCT
) -> str:
    """The first operand (in the analysis's order) to which ``plan`` gives a format the observer measured
    and whose SQNR in it falls below ``threshold`` dB, or whose flushed share of nonzeros reaches
    ``flushed`` %, at some observed step, described in a few words; '' where none does. Operands in formats
    the observer did not measure are not checked."""
    from numscope.plan import HIGH

    for key in analysis.keys():  # noqa: SIM118  (an Analysis is not a mapping)
        spec = plan.for_site(key[0]).operand(key[1], key[2])
        if spec.format == HIGH:
            continue
        label = spec.format_spec().name
        if label not in analysis.candidates:
            continue
        steps = sorted(analysis.operands.get(key, {}))
        for metric, worst, bad, say in (
            ("sqnr_db", min, lambda v: v < threshold, "SQNR {:.1f} dB"),
            ("underflow%", max, lambda v: v >= flushed, "{:.1f}% of its nonzeros flushed to zero"),
        ):
            try:
                values = analysis.metric_values(key, label, metric)
            except Exception:  # an operand the observer saw without this metric
                continue
            if values and bad(worst(values)):
                value = worst(values)
                step = steps[values.index(value)] if len(steps) == len(values) else "?"
                return f"{'/'.join(key)} in {label}: {say.format(value)} at step {step}"
    return ""


def agrees(predicted: float, measured: float, noise: float, factor: float = ACCURACY) -> bool:
    """The validation's criterion: both inside the noise (|gap| ≤ 2·noise), or the prediction within
    ``factor`` of the measured gap."""
    if abs(predicted) <= 2 * noise and abs(measured) <= 2 * noise:
        return True
    if predicted <= 0 or measured <= 0:
        return False
    return 1 / factor <= predicted / measured <= factor


def table_row(name: str, values: Mapping[str, Any]) -> dict[str, str]:
    """One row of the forecast's table (text)."""
    beyond = values.get("beyond_noise")
    lost = values.get("lost")
    return {
        "plan": name,
        "avg bits": f"{values['bits']:.2f}",
        "predicted gap": "fails" if lost else f"{values['gap']:+.4f}",
        "interval": f"signal lost: {lost}" if lost else f"[{values['low']:+.4f}, {values['high']:+.4f}]",
        "beyond noise": "—" if beyond is None else ("yes" if beyond else "no"),
        "high": values.get("high_summary", ""),
    }
