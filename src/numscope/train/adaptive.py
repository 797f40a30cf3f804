"""Adaptive precision: a plan that changes while the model trains, from the operands it measures.

A plan chosen once from an early window of training assumes the tensors keep their shape; gradients shrink as
the loss falls and outliers grow. :class:`Adapter` re-decides during training through the same interception
point that quantizes (an observer attached before :func:`numscope.convert`, sampling every ``every`` steps):

* **the guard** (per operand, each sampled step): the operand's *intended* format is measured on its
  high-precision tensor (the observer's ``plan`` label: exactly the format, scaling and, for delayed scaling,
  current scaling, as it would quantize this tensor). When a range statistic crosses its limit
  (``underflow%`` above ``max_underflow_pct``, ``overflow%`` above ``max_overflow_pct``, optionally
  ``sqnr_db`` below ``min_sqnr_db``), the operand moves to ``fallback`` for the next step; it returns to its
  format after ``clear_after`` consecutive sampled steps within every limit. A limit is *armed* for an
  operand once its format has met it there: a guard acts on a tensor that leaves its format's range, never on
  a choice the plan made knowingly (a budget may put MXFP4 where it underflows 60%; the guard then watches
  the limits that format did meet; ``arm="always"`` arms every limit from the first measurement, so that an
  operand out of range from the start falls back at once). The default limits are the advisor's
  (:class:`numscope.advisor.Limits`, derived from training outcomes: the worst values of an FP32 run that
  trained well); the SQNR limit is off by default, since it judges noise, which the plan's budget already
  traded, rather than range.
* **the re-plan** (every ``replan_every`` sampled steps): the advisor (:func:`numscope.advisor.advise`) is
  solved again for the operands the starting plan quantizes (those it keeps high stay high) on the last
  ``window`` sampled steps of the running model, under the same bit budget (by default the starting
  plan's own average bits over those operands, weighted as the advisor weighs them), with the objective
  ``recommend`` uses by default with a budget: given ``sensitivity_from`` (the analysis the plan was made
  from), each operand's measured sensitivity, the other formats estimated by the live noise ratios, limits
  off; without it, the least total noise (weighted by ``noise_weights``) within the advisor's limits. With
  hysteresis: an operand takes a new format only when ``patience`` consecutive re-plans chose it.

Every change is a :class:`Change` (the step after which it took effect, the operand, old → new, the cause and
the measurement that decided it), kept in :attr:`Adapter.history` and written by :func:`write_history`; the
average bits over training weigh each plan by the steps it ran. Decisions are pure functions of the
observer's records, which :meth:`numscope.observe.Observer.step` merges across ranks first, so every rank of
a DDP/FSDP2 run takes the same ones; :meth:`Adapter.state_dict` with the observer's state resumes a run with
the same plan history, bit for bit (tested).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from torch import nn

from numscope._atomic import atomic_write_text
from numscope._names import exact_pattern
from numscope._settings import setting
from numscope.advisor import AdvisorError, Limits, advise, sensitivity_objective
from numscope.analysis import PLAN_LABEL, Analysis, OperandKey, OperandRecord, Sensitivity, operand_name
from numscope.convert import converted_plan, site_sizes, switch_plan
from numscope.errors import NumscopeError
from numscope.formats.spec import get_format
from numscope.observe import Observer
from numscope.observe.config import DEFAULT_CANDIDATES
from numscope.plan import OperandSpec, Plan, SiteSpec

#: guard limit → (metric, whether the limit is a maximum)
GUARD_METRICS: dict[str, tuple[str, bool]] = {
    "max_underflow_pct": ("underflow%", True),
    "max_overflow_pct": ("overflow%", True),
    "min_sqnr_db": ("sqnr_db", False),
}
HISTORY_FIELDS = ("step", "site", "gemm", "operand", "old", "new", "cause", "measurement")


class AdaptiveError(NumscopeError, ValueError):
    """An adaptive-training setting that cannot work (what was wrong, what is allowed)."""


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdaptiveError(
            f"{name} must be a whole number ≥ 1{' or None' if allow_none else ''}, got {value!r}"
        )


def _share_limit(metric: str, default: float | None) -> Any:
    """The field of a guard limit on a share of values (``underflow`` or ``overflow``, in percent): the
    advisor's limit by default, ``--guard-<metric> none`` switches it off."""
    return setting(
        default,
        f"{metric}% limit, or none",
        flag=f"--guard-{metric}",
        kind=float,
        metavar="PCT",
        off=True,
        shown=f"{default:g}, the advisor's",
    )


@dataclass(frozen=True)
class AdaptiveConfig:
    """How :class:`Adapter` decides (see the module docstring).

    every: the observer's sampling interval in optimizer steps; a decision follows each sampled step.
    fallback: the format a guarded operand moves to (``bf16``; ``high`` keeps it in the model's precision).
    max_underflow_pct, max_overflow_pct, min_sqnr_db: the guard's limits (None: off).
    clear_after: sampled steps within every armed limit before a guarded operand returns to its format.
    arm: ``met`` (a limit is armed for an operand once its format has met it there) or ``always``.
    replan_every: sampled steps between re-plans (None or 0: the guard alone).
    window: sampled steps a re-plan reads (default: ``replan_every``).
    patience: consecutive re-plans that must choose an operand's new format before it changes.
    bit_budget: the re-plan's budget in average bits per operand element (default: the starting plan's).
    candidates: the formats the observer measures and a re-plan chooses among.
    noise_weights: factors on operands' noise in the re-plan's objective (:func:`numscope.advisor.advise`).
    sensitivity_from: an analysis folder (``numscope analyze``'s, or its run folder) holding each operand's
        sensitivity: the re-plans then score as ``recommend --bit-budget`` does by default (the measured
        sensitivity, limits off), so they re-solve the objective the starting plan was made with.
    """

    every: int = setting(10, "observe and decide every N steps", minimum=1, flag="--adapt-every")
    fallback: str = setting("bf16", "a guarded operand's format", metavar="FORMAT")
    max_underflow_pct: float | None = _share_limit("underflow", Limits.max_underflow_pct)
    max_overflow_pct: float | None = _share_limit("overflow", Limits.max_overflow_pct)
    min_sqnr_db: float | None = setting(
        None, "SQNR limit in dB, or none", flag="--guard-sqnr", kind=float, metavar="DB", off=True
    )
    clear_after: int = setting(3, "clean sampled steps before a guarded operand returns", minimum=1)
    arm: str = setting(
        "met",
        "met: a limit guards an operand once its format has met it there (a tensor leaving its format's "
        "range); always: from the first step (an operand out of range from the start falls back at once)",
        choices=("met", "always"),
        flag="--guard-arm",
    )
    replan_every: int | None = setting(
        10, "re-plan every N sampled steps; 0: the guard alone", minimum=0, kind=int
    )
    window: int | None = None
    patience: int = setting(2, "re-plans in a row that must choose an operand's new format", minimum=1)
    bit_budget: float | None = setting(
        None,
        "the re-plans' bit budget",
        positive=True,
        flag="--adapt-budget",
        kind=float,
        metavar="BITS",
        shown="the starting plan's average bits",
    )
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    noise_weights: Mapping[str, float] | None = None
    sensitivity_from: str | None = setting(
        None,
        "the analysis (or analyze run folder) the plan was recommended from: re-plans then score by its "
        "measured operand sensitivity with limits off, as 'recommend `bit_budget`' does",
        flag="--adapt-from",
        kind=str,
        metavar="RUN",
        shown="the least total noise within the advisor's limits",
    )

    def __post_init__(self) -> None:
        _positive_int("every", self.every)
        _positive_int("clear_after", self.clear_after)
        _positive_int("patience", self.patience)
        if self.replan_every == 0 and not isinstance(self.replan_every, bool):  # the guard alone
            object.__setattr__(self, "replan_every", None)
        _positive_int("replan_every", self.replan_every, allow_none=True)
        _positive_int("window", self.window, allow_none=True)
        if self.arm not in ("met", "always"):
            raise AdaptiveError(f"arm must be 'met' or 'always', got {self.arm!r}")
        if self.fallback != "high":
            try:
                get_format(self.fallback)
            except (KeyError, ValueError) as error:
                raise AdaptiveError(f"fallback: {error}") from error
        try:  # the advisor's checks of the same limits: numbers in their meaningful ranges
            Limits().replace({name: getattr(self, name) for name in GUARD_METRICS}, " (adaptive guard)")
        except AdvisorError as error:
            raise AdaptiveError(str(error)) from error
        if self.bit_budget is not None and (
            isinstance(self.bit_budget, bool)
            or not isinstance(self.bit_budget, int | float)
            or not 0 < self.bit_budget <= 32
        ):
            raise AdaptiveError(f"bit_budget must be a number of bits in (0, 32], got {self.bit_budget!r}")
        if self.sensitivity_from is not None and not Path(self.sensitivity_from).is_dir():
            raise AdaptiveError(f"sensitivity_from {self.sensitivity_from}: no such analysis folder")
        if self.sensitivity_from is not None:
            object.__setattr__(self, "sensitivity_from", str(Path(self.sensitivity_from).resolve()))
        candidates = tuple(self.candidates)
        if not candidates or any(not isinstance(c, str) for c in candidates):
            raise AdaptiveError(f"candidates must be format names, at least one; got {self.candidates!r}")
        object.__setattr__(self, "candidates", candidates)

    @property
    def window_steps(self) -> int:
        return self.window or self.replan_every or 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["candidates"] = list(self.candidates)
        data["noise_weights"] = None if self.noise_weights is None else dict(self.noise_weights)
        return data


@dataclass(frozen=True)
class Change:
    """One operand's format changed after optimizer step ``step`` (1-based: the steps done before it; the next
    step runs under the new format). cause: ``guard`` (a limit crossed), ``clear`` (back after the guard) or
    ``replan``; measurement: what decided it."""

    step: int
    site: str
    gemm: str
    operand: str
    old: str
    new: str
    cause: str
    measurement: str

    @property
    def key(self) -> OperandKey:
        return (self.site, self.gemm, self.operand)

    def row(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class _State:
    """What :class:`Adapter` decides from, besides the observer's records (all of it in its state dict)."""

    chosen: dict[str, str] = field(default_factory=dict)  # operand name → format chosen by re-plans
    fallen: dict[str, int] = field(default_factory=dict)  # operand name → clear sampled steps since
    armed: dict[str, list[str]] = field(default_factory=dict)  # operand name → armed guard limits
    pending: dict[str, list[Any]] = field(default_factory=dict)  # operand name → [format, re-plans]
    sampled: int = 0
    budget: float | None = None
    bit_steps: list[list[float]] = field(default_factory=list)  # [first step, average bits] per plan


def _key(name: str) -> OperandKey:
    site, gemm, operand = name.rsplit("/", 2)
    return (site, gemm, operand)


class Adapter:
    """Adaptive precision for a converted ``model`` observed by ``observer`` (see the module docstring).

    Make the observer with :func:`observer_for` *before* converting the model, then call :meth:`after_step`
    after every optimizer step, after ``observer.step()``::

        observer = numscope.train.adaptive.observer_for(model, plan, config).attach()
        numscope.convert(model, plan)
        adapter = Adapter(model, plan, config, observer)
        for step, batch in enumerate(loader):
            ...; optimizer.step(); observer.step()
            adapter.after_step(step)
    """

    def __init__(self, model: nn.Module, plan: Plan, config: AdaptiveConfig, observer: Observer) -> None:
        if not isinstance(config, AdaptiveConfig):
            raise TypeError(f"config must be an AdaptiveConfig, got {type(config).__name__}")
        if observer.config.every != config.every:
            raise AdaptiveError(
                f"the observer samples every {observer.config.every} steps, the adaptive config every "
                f"{config.every}: make it with numscope.train.adaptive.observer_for"
            )
        self.model, self.start_plan, self.config, self.observer = model, plan, config, observer
        self.history: list[Change] = []
        self._state = _State()
        self._sensitivity = _sensitivity(config.sensitivity_from)
        self._apply(0, [])

    # -- the plans ------------------------------------------------------------------------------------
    def intended(self) -> Plan:
        """The starting plan with the re-plans' choices: what the guard measures."""
        return _overridden(self.start_plan, {_key(n): OperandSpec(f) for n, f in self._state.chosen.items()})

    def current(self) -> Plan:
        """The plan the model runs now: :meth:`intended` with the guarded operands in the fallback."""
        intended = self.intended()
        fallback = OperandSpec(self.config.fallback)
        return _overridden(intended, {_key(name): fallback for name in self._state.fallen})

    def average_bits(self, steps: int) -> float:
        """The average bits per operand element over the first ``steps`` steps, each plan weighted by the
        steps it ran (bits as :meth:`numscope.Plan.average_bits` counts them at the model's shapes)."""
        spans = self._state.bit_steps
        if not spans or steps <= 0:
            return math.nan
        total = 0.0
        for index, (first, bits) in enumerate(spans):
            last = spans[index + 1][0] if index + 1 < len(spans) else steps
            total += bits * max(0, min(last, steps) - first)
        return total / steps

    # -- deciding -------------------------------------------------------------------------------------
    def after_step(self, step: int) -> list[Change]:
        """Decide after optimizer step ``step`` (0-based; call it after ``observer.step()``): on a sampled
        step, the guard and, when due, a re-plan; returns the changes (they apply from the next step)."""
        if step != self.observer.current_step - 1:
            raise AdaptiveError(
                f"after_step({step}) must follow the observer's step() of that optimizer step (the observer "
                f"has counted {self.observer.current_step} steps): call observer.step() first, once a step"
            )
        if step % self.config.every:
            return []
        if not self._state.bit_steps or math.isnan(self._state.bit_steps[0][1]):
            self._state.bit_steps = [[0, self._bits(self.current())]]
        records = self.observer.records_at(step)
        changes = self._guard(step, records)
        self._state.sampled += 1
        if self.config.replan_every is not None and self._state.sampled % self.config.replan_every == 0:
            changes += self._replan(step)
        self._apply(step + 1, changes)
        self.observer.forget_before(step - (self.config.window_steps - 1) * self.config.every)
        return changes

    def _guard(self, step: int, records: Mapping[OperandKey, OperandRecord]) -> list[Change]:
        config, state = self.config, self._state
        intended = self.intended()
        changes = []
        for key in sorted(records):
            metrics = records[key].metrics.get(PLAN_LABEL)
            spec = intended.for_site(key[0]).operand(key[1], key[2])
            if metrics is None or spec.is_high or records[key].stats.get("zeros%") == 100.0:
                continue  # an all-zero tensor (a gradient that did not flow) says nothing about range
            name = operand_name(key)
            failed, met = [], []
            for limit, (metric, is_max) in GUARD_METRICS.items():
                bound = getattr(config, limit)
                value = metrics.get(metric)
                if bound is None or value is None:
                    continue
                crossed = value > bound if is_max else value < bound
                (failed if crossed else met).append((limit, metric, value, bound))
            if config.arm == "always":
                state.armed[name] = list(GUARD_METRICS)
            armed = state.armed.setdefault(name, [])
            tripped = [f for f in failed if f[0] in armed]
            if name in state.fallen:
                state.fallen[name] = 0 if tripped else state.fallen[name] + 1
                if state.fallen[name] >= config.clear_after:
                    del state.fallen[name]
                    changes.append(
                        Change(
                            step + 1,
                            *key,
                            config.fallback,
                            spec.format,
                            "clear",
                            f"{_describe(met)} for {config.clear_after} sampled steps",
                        )
                    )
                continue
            armed.extend(limit for limit, *_ in met if limit not in armed)
            if tripped:
                state.fallen[name] = 0
                changes.append(
                    Change(step + 1, *key, spec.format, config.fallback, "guard", _describe(tripped))
                )
        return changes

    def _replan(self, step: int) -> list[Change]:
        config, state = self.config, self._state
        measured = self.observer.analysis()
        # only what the starting plan quantizes: an operand it keeps high stays high
        keys = [key for key in measured.keys() if not _spec(self.start_plan, key).is_high]  # noqa: SIM118
        if not keys:
            return []
        analysis = replace(
            measured,
            operands={key: measured.operands[key] for key in keys},
            elements={key: measured.elements.get(key, 0) for key in keys},
        )
        intended = self.intended()
        if state.budget is None:
            state.budget = config.bit_budget or _analysis_bits(intended, analysis)
        candidates = [c for c in config.candidates if c in analysis.candidates]
        budget = state.budget
        if self._sensitivity is not None:  # recommend's default with a budget: sensitivity, limits off
            options: dict[str, Any] = {
                "objective": sensitivity_objective(self._sensitivity, None, analysis),
                **dict.fromkeys(GUARD_METRICS, None),
                "max_be_ratio": None,
            }
        else:
            options = {"noise_weights": config.noise_weights}
        try:
            # the least bits that meet the limits: where the tensors need more than the budget, that
            cheapest = advise(analysis, candidates=candidates, **options).average_bits
            if cheapest > budget:
                budget = cheapest * (1 + 1e-9)
            recommendation = advise(analysis, candidates=candidates, bit_budget=budget, **options)
        except AdvisorError as error:
            raise AdaptiveError(f"the re-plan after step {step + 1} failed: {error}") from error
        within = f"within {budget:.3g} bits" + (
            "" if budget == state.budget else f" (the budget {state.budget:.3g} cannot meet the limits)"
        )
        changes = []
        for choice in recommendation.choices:
            name = operand_name(choice.key)
            old = intended.for_site(choice.site).operand(choice.gemm, choice.operand)
            if old == OperandSpec(choice.format):
                state.pending.pop(name, None)
                continue
            proposed, count = state.pending.get(name, [None, 0])
            count = count + 1 if proposed == choice.format else 1
            if count < config.patience:
                state.pending[name] = [choice.format, count]
                continue
            state.pending.pop(name, None)
            state.chosen[name] = choice.format
            state.armed.pop(name, None)  # the new format's limits are armed as it meets them
            was_fallen = state.fallen.pop(name, None) is not None
            changes.append(
                Change(
                    step + 1,
                    *choice.key,
                    config.fallback if was_fallen else old.format,
                    choice.format,
                    "replan",
                    f"{config.patience} re-plans in a row {within}: {choice.reason}",
                )
            )
        return changes

    def _apply(self, step: int, changes: list[Change]) -> None:
        self.history.extend(changes)
        plan = self.current()
        self.observer.plan = self.intended()
        if converted_plan(self.model) != plan:
            switch_plan(self.model, plan)
        if changes:
            self._state.bit_steps.append([step, self._bits(plan)])

    def _bits(self, plan: Plan) -> float:
        try:
            return plan.average_bits(site_sizes(self.model))
        except Exception:  # no forward ran yet: no sizes
            return math.nan

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the decisions depend on besides the observer's state (save both for an exact resume)."""
        return {"state": asdict(self._state), "history": [change.row() for change in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the observer's) and switch the model to the plan it held."""
        self._state = _State(**{k: v for k, v in dict(state["state"]).items()})
        self.history = [Change(**row) for row in state["history"]]
        self._apply(0, [])


def observer_for(model: nn.Module, plan: Plan, config: AdaptiveConfig, **options: Any) -> Observer:
    """The observer :class:`Adapter` decides from (not attached): every ``config.every`` steps, monitoring
    ``plan``; ``config.candidates`` with backward errors for the re-plans, or, with the guard alone, only
    what the guard reads (the plan's own metrics, one candidate, no backward errors: cheaper). Attach it
    before :func:`numscope.convert`."""
    from numscope.observe import observe

    if config.replan_every is None:
        options = {"backward_error": False, **options}
        return observe(model, (_GUARD_CANDIDATE,), every=config.every, plan=plan, **options)
    return observe(model, config.candidates, every=config.every, plan=plan, **options)


_GUARD_CANDIDATE = "bf16"
"""What the observer measures besides the plan when only the guard decides (it needs one candidate)."""


def _sensitivity(folder: str | None) -> Sensitivity | None:
    """The operand sensitivity of the analysis in ``folder`` (or of a run folder's ``analysis/``)."""
    if folder is None:
        return None
    path = Path(folder)
    path = path / "analysis" if (path / "analysis").is_dir() else path
    try:
        sensitivity = Analysis.load(path).sensitivity
    except (OSError, ValueError) as error:
        raise AdaptiveError(f"sensitivity_from {folder}: not an analysis folder ({error})") from error
    if sensitivity is None or sensitivity.granularity != "operand":
        raise AdaptiveError(
            f"sensitivity_from {folder}: the analysis holds no operand sensitivity (numscope analyze "
            "measures it by default; `SensitivitySettings.batches` 0 skips it)"
        )
    return sensitivity


def _spec(plan: Plan, key: OperandKey) -> OperandSpec:
    return plan.for_site(key[0]).operand(key[1], key[2])


def _overridden(plan: Plan, specs: Mapping[OperandKey, OperandSpec]) -> Plan:
    """``plan`` with the given operands' specs replaced: one exact-name rule per site, after the others."""
    per_site: dict[str, dict[tuple[str, str], OperandSpec]] = {}
    for (site, gemm, operand), spec in sorted(specs.items()):
        per_site.setdefault(site, {})[(gemm, operand)] = spec
    for site, operands in per_site.items():
        base = plan.for_site(site)
        spec = SiteSpec({**base.operands, **operands}, base.accumulate)
        plan = plan.with_rule(exact_pattern(site), spec)
    return plan


def _analysis_bits(plan: Plan, analysis: Analysis) -> float:
    """``plan``'s average bits over the analysis's operands, weighted by their element counts (as the
    advisor's bit budget weighs them)."""
    total = bits = 0.0
    for site, gemm, operand in analysis.keys():  # noqa: SIM118 (a method, not a dict's)
        elements = analysis.elements.get((site, gemm, operand), 0)
        total += elements
        bits += elements * plan.for_site(site).operand(gemm, operand).bits_per_element()
    if not total:
        raise AdaptiveError("the re-plan's window holds no operand elements")
    return bits / total


def _describe(checks: Sequence[tuple[str, str, float, float]]) -> str:
    return (
        "; ".join(
            f"{metric} {value:.4g} {'>' if GUARD_METRICS[limit][1] else '<'} {bound:g}"
            if (value > bound if GUARD_METRICS[limit][1] else value < bound)
            else f"{metric} {value:.4g} within {bound:g}"
            for limit, metric, value, bound in checks
        )
        or "no armed limit"
    )


def write_history(path: str | Path, history: Sequence[Change]) -> Path:
    """The changes as CSV (``HISTORY_FIELDS``), written atomically."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=HISTORY_FIELDS)
    writer.writeheader()
    writer.writerows(change.row() for change in history)
    atomic_write_text(Path(path), text.getvalue())
    return Path(path)


def read_history(path: str | Path) -> list[Change]:
    """The changes :func:`write_history` wrote."""
    with Path(path).open(newline="", encoding="utf-8") as f:
        return [Change(**{**row, "step": int(row["step"])}) for row in csv.DictReader(f)]
