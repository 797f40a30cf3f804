"""What the report shows, as data: per-operand and per-analysis views, plan tables, format ranges, and
the number formatting every table uses."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from numscope._names import natural_key
from numscope.formats.scaling import UNSCALED_FORMATS
from numscope.formats.spec import BlockFormat, IntFormat, get_format
from numscope.report import plots
from numscope.report.plots import FormatRange, Histogram
from numscope.vocab import GEMMS, OPERAND_KEYS, Metric

REFERENCE_RUN = plots.REFERENCE_RUN
WITHIN_PERCENT = 1.0
"""A run whose validation loss is at most this many percent above the FP32 run's is highlighted."""

UNDERFLOW_FORMAT = "fp16"
UNDERFLOW, OVERFLOW, SQNR = Metric.UNDERFLOW.value, Metric.OVERFLOW.value, Metric.SQNR.value


# ============================================================================= plain views of the inputs
@dataclass(frozen=True)
class OperandView:
    """One operand of one GEMM at one site, summarised over the sampled steps.

    metrics: candidate format → metric name → mean over sampled steps (``underflow%``, ``sqnr_db``…).
    amax: median over sampled steps of the tensor's largest magnitude (units of the tensor).
    """

    site: str
    gemm: str
    operand: str
    elements: int
    histogram: Histogram | None
    amax: float | None
    metrics: Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class AnalysisView:
    """What the report shows of an analysis.

    backward_errors: gemm → site → column label → mean backward error. Columns are candidate formats
    (both operands in that format) when the analysis measured such pairs, then its mixed pairs as
    ``left×right`` (the fp8 hybrid's ``fp8_e5m2×fp8_e4m3``); else ``left×right`` labels of every pair.
    """

    candidates: tuple[str, ...]
    sites: tuple[str, ...]
    operands: tuple[OperandView, ...]
    backward_errors: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)
    backward_error_columns: tuple[str, ...] = ()

    def operand(self, site: str, gemm: str, operand: str) -> OperandView | None:
        for view in self.operands:
            if (view.site, view.gemm, view.operand) == (site, gemm, operand):
                return view
        return None


def analysis_tables(analysis: Any) -> AnalysisView:
    """The adapter from a :class:`numscope.Analysis` to the report's plain :class:`AnalysisView`."""
    sites = _site_order(analysis)
    position = {site: index for index, site in enumerate(sites)}
    operands = []
    for key in sorted(analysis.operands, key=lambda k: (position.get(k[0], len(position)), k[1], k[2])):
        site, gemm, operand = key
        per_step = analysis.operands[key]
        amaxes = [r.stats["amax"] for r in per_step.values() if math.isfinite(r.stats.get("amax", math.nan))]
        collected: dict[str, dict[str, list[float]]] = {}
        for record in per_step.values():
            for candidate, metrics in record.metrics.items():
                for metric, value in metrics.items():
                    collected.setdefault(candidate, {}).setdefault(metric, []).append(value)
        means = {c: {m: _nanmean(v) for m, v in metrics.items()} for c, metrics in collected.items()}
        histogram = None
        if key in analysis.histograms:
            source = analysis.histograms[key]
            counts = {e: c for e, c in zip(source.exponents, source.counts, strict=True) if c}
            histogram = Histogram(f"{site}  ·  {gemm}/{operand}", counts, source.zeros)
        elements = analysis.elements.get(key) or max((r.elements for r in per_step.values()), default=0)
        operands.append(
            OperandView(
                site,
                gemm,
                operand,
                int(elements),
                histogram,
                statistics.median(amaxes) if amaxes else None,
                means,
            )
        )

    pairs = {pair for per_pair in analysis.backward_errors.values() for pair in per_pair}
    same = sorted({left for left, right in pairs if left == right}, key=_candidate_order(analysis.candidates))
    if same:
        label = {(fmt, fmt): fmt for fmt in same}
        mixed = sorted(pair for pair in pairs if pair[0] != pair[1] and "fp32" not in pair)
        label.update({pair: f"{pair[0]}×{pair[1]}" for pair in mixed})  # e.g. the fp8 hybrid's E5M2 × E4M3
        columns = tuple(label.values())
    else:
        label = {pair: f"{pair[0]}×{pair[1]}" for pair in sorted(pairs)}
        columns = tuple(label.values())
    errors: dict[str, dict[str, dict[str, float]]] = {}
    for (site, gemm), per_pair in analysis.backward_errors.items():
        for pair, per_step in per_pair.items():
            if pair in label:
                value = _nanmean([stats["mean"] for stats in per_step.values() if "mean" in stats])
                errors.setdefault(gemm, {}).setdefault(site, {})[label[pair]] = value
    ordered_errors = {gemm: errors[gemm] for gemm in GEMMS if gemm in errors}
    return AnalysisView(
        candidates=tuple(analysis.candidates),
        sites=sites,
        operands=tuple(operands),
        backward_errors=ordered_errors,
        backward_error_columns=columns,
    )


def _site_order(analysis: Any) -> tuple[str, ...]:
    """Sites in model order when the analysis records it (``meta["site_kinds"]``, the observer's, or
    ``meta["sites"]``), else in natural name order."""
    found = set(analysis.sites())
    names = [name for name, _ in analysis.meta.get("site_kinds", ())] or analysis.meta.get("sites", ())
    recorded = [site for site in dict.fromkeys(names) if site in found]
    rest = sorted(found - set(recorded), key=natural_key)
    return (*recorded, *rest)


def _candidate_order(candidates: Sequence[str]):
    order = {name: index for index, name in enumerate(candidates)}
    return lambda name: (order.get(name, len(order)), name)


def _nanmean(values: Iterable[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def plan_table(plan: Any, sites: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The adapter from a :class:`numscope.Plan` to rows ``site, gemm, operand, format, scaling, bits,
    reason``: one row per operand of each of ``sites`` when given, else one per operand of each rule
    pattern (``site`` then holds the pattern). ``bits`` are storage bits per element (32 for ``high``)."""
    if sites:
        entries = []
        for site in sites:
            rule = plan.rule_for(site)
            reasons = rule.reasons if rule is not None else plan.default_reasons
            entries.append((site, plan.for_site(site), reasons))
    else:
        entries = [("(default)", plan.default, plan.default_reasons)]
        entries += [(rule.pattern, rule.spec, rule.reasons) for rule in plan.rules]
    rows = []
    for site, spec, reasons in entries:
        for gemm, operand in OPERAND_KEYS:
            op = spec.operand(gemm, operand)
            rows.append(
                {
                    "site": site,
                    "gemm": gemm,
                    "operand": operand,
                    "format": op.format,
                    "scaling": op.describe_scaling(),
                    "bits": op.bits_per_element(),
                    "reason": reasons.get(f"{gemm}/{operand}", ""),
                }
            )
    return rows


def format_range(
    name: str, amax: float | None, metrics: Mapping[str, float] | None = None
) -> FormatRange | None:
    """The magnitudes candidate ``name`` represents, in log2 of the tensor's units (:class:`FormatRange`).

    Unscaled formats (fp32, tf32, bf16, fp16) keep their fixed range; other element formats are shown after
    per-tensor scaling (their max mapped onto ``amax``); block formats as one block whose amax is ``amax``.
    None for a label that is not a format (``plan``) or when a scaled format has no amax to scale by.
    """
    try:
        fmt = get_format(name)
    except (ValueError, KeyError):
        return None
    metrics = metrics or {}
    underflow, overflow = metrics.get(UNDERFLOW), metrics.get(OVERFLOW)
    if isinstance(fmt, BlockFormat):
        element, scaling = fmt.element, "block"
    elif name in UNSCALED_FORMATS:
        return FormatRange(
            name,
            math.log2(fmt.min_subnormal),
            math.log2(fmt.min_normal),
            math.log2(fmt.max),
            "none",
            underflow,
            overflow,
        )
    else:
        element, scaling = fmt, "tensor"
    if amax is None or not (math.isfinite(amax) and amax > 0):
        return None
    shift = math.log2(amax) - math.log2(element.max)
    low = math.log2(element.min_subnormal) + shift
    low_normal = low if isinstance(element, IntFormat) else math.log2(element.min_normal) + shift
    return FormatRange(name, low, low_normal, math.log2(amax), scaling, underflow, overflow)


def operand_ranges(view: OperandView, candidates: Sequence[str]) -> list[FormatRange]:
    """The candidates' ranges for one operand, in candidate order (labels that are not formats skipped)."""
    ranges = []
    for name in candidates:
        found = format_range(name, view.amax, view.metrics.get(name))
        if found is not None:
            ranges.append(found)
    return ranges


def short_site_names(sites: Sequence[str]) -> dict[str, str]:
    """Compact labels for figures: ``bert.encoder.layer.3.attention.self.query`` becomes
    ``L3.attention.self.query``; the full names are kept wherever two short names would collide."""
    pattern = re.compile(r"^(?:.*\.)?(?:layers?|h|blocks?)\.(\d+)\.")
    short = {site: pattern.sub(lambda m: f"L{m.group(1)}.", site) for site in sites}
    if len(set(short.values())) < len(short):
        return {site: site for site in sites}
    return short


# ================================================================================= number formatting
def fmt_number(value: Any, digits: int = 4) -> str:
    """4 significant digits; ``—`` for None, ``nan``/``inf`` spelled out."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "−inf"
    return f"{value:.{digits}g}"


def fmt_loss(value: float | None) -> str:
    """A loss with 4 significant digits, trailing zeros kept (``2.000``) so columns line up."""
    if value is None or not math.isfinite(value):
        return fmt_number(value)
    return f"{value:#.4g}"


def fmt_percent(value: float | None, signed: bool = False) -> str:
    """A percentage with 2 decimals (``+0.37%`` when ``signed``); ``—`` for None or nan."""
    if value is None or math.isnan(value):
        return "—"
    return f"{value:+.2f}%" if signed else f"{value:.2f}%"


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "—"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)} min {rest:02.0f} s"


def gap_to_reference(val_loss: float, reference: float | None) -> float | None:
    """(val_loss − reference) / reference in percent; None without a finite reference or loss."""
    if reference is None or not math.isfinite(reference) or reference == 0 or not math.isfinite(val_loss):
        return None
    return 100.0 * (val_loss - reference) / reference


# ========================================================================================= sections
