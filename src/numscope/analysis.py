"""What an observer gathered: operand statistics, candidate-format metrics, histograms, backward errors.

An :class:`Analysis` is plain data, keyed by names a person can read:

* an **operand key** ``(site, gemm, operand)``, e.g. ``("bert.encoder.layer.0.attention.self.query",
  "wgrad", "grad_output")``; per key and sampled step an :class:`OperandRecord` holds ``stats`` (of the
  high-precision tensor) and ``metrics`` per candidate format (``sqnr_db``, ``rel_error``, ``underflow%``,
  ``overflow%``…, see :mod:`numscope.metrics`);
* a **log2 histogram** per operand key, summed over the sampled steps
  (:class:`numscope.metrics.stats.Log2Histogram`: fixed integer binade bins, mergeable with ``+``);
* **backward errors** per ``(site, gemm)`` and operand-format pair ``(left, right)`` and step: the mean,
  p99 and max of BE = |L·R − Q(L)·Q(R)| / (|L|·|R|) over the measured output entries whose denominator
  |L|·|R| is nonzero (``count`` of them; ``excluded``: those with a zero denominator, whose product is
  exactly 0 in every format — e.g. the rows of a gradient that is zero at unmasked positions; see
  :func:`numscope.metrics.backward_error.backward_error_stats`). The pair ``(fmt, "fp32")``
  quantizes only the left operand (``fprop``: input, ``dgrad``: grad_output, ``wgrad``: grad_output — the
  first operand in :data:`numscope.plan.OPERANDS`), ``("fp32", fmt)`` only the right one, ``(fmt, fmt)``
  both;
* the **element count** of every operand (the full tensor, not the sample), for bit budgets;
* under a plan (monitoring) the format each operand was quantized to, whose metrics are stored under the
  candidate label ``"plan"``.

Flat names join the parts with ``/``: ``<site>/<gemm>/<operand>/<candidate>/<metric>`` for candidate
metrics, ``<site>/<gemm>/<operand>/<stat>`` for statistics and ``<site>/<gemm>/be/<left>*<right>/<stat>``
for backward errors; :meth:`Analysis.flat` and the CSV use them.

A :class:`Sensitivity` (what quantizing one site at a time does to the loss and the gradient, measured by
:func:`numscope.sensitivity`) can travel with the analysis (``analysis.sensitivity``), saved in its JSON.

On disk (:meth:`Analysis.save`): ``analysis.json`` (everything, read back by :meth:`Analysis.load`) and
``analysis.csv`` (one row per sampled step, one column per flat name, for spreadsheets), both written
atomically. :meth:`Analysis.write_tensorboard` writes the same scalars to TensorBoard when
``torch.utils.tensorboard`` and ``tensorboard`` are installed and does nothing otherwise.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numscope._atomic import atomic_write_text
from numscope.errors import NumscopeError
from numscope.metrics.stats import Log2Histogram

OperandKey = tuple[str, str, str]
GemmKey = tuple[str, str]
Pair = tuple[str, str]

__all__ = [
    "Analysis",
    "AnalysisError",
    "OperandRecord",
    "Sensitivity",
    "default_reduce",
    "merge",
    "merge_be_stats",
    "merge_records",
    "operand_name",
]

FILE_VERSION = 1
JSON_NAME = "analysis.json"
CSV_NAME = "analysis.csv"
PLAN_LABEL = "plan"

_MAX_STATS = ("amax", "max", "abs_max")
_MIN_STATS = ("amin", "min", "abs_min", "min_nonzero")


class AnalysisError(NumscopeError, ValueError):
    """An analysis that cannot be read, merged or queried as asked."""


def operand_name(key: OperandKey) -> str:
    """``site/gemm/operand``: the legible prefix of every flat name of one operand."""
    return "/".join(key)


@dataclass
class OperandRecord:
    """One operand at one sampled step.

    stats: statistics of the high-precision tensor (see :func:`numscope.metrics.tensor_stats`).
    metrics: candidate label -> metric name -> value (see :func:`numscope.metrics.operand_metrics`).
    sampled: how many elements the statistics and the metrics were computed on (≤ the observer's
        ``max_elements``), except for the candidates in ``sampled_by_candidate``.
    elements: how many elements the full tensor had.
    sampled_by_candidate: candidate label -> elements its metrics were computed on, where that is not
        ``sampled`` (the observer measures block formats on a sample of whole rows).
    """

    stats: dict[str, float]
    metrics: dict[str, dict[str, float]]
    sampled: int
    elements: int
    sampled_by_candidate: dict[str, int] = field(default_factory=dict)

    def sample_size(self, candidate: str) -> int:
        """How many elements the metrics of ``candidate`` were computed on (their weight in a merge)."""
        return self.sampled_by_candidate.get(candidate, self.sampled)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stats": self.stats,
            "metrics": self.metrics,
            "sampled": self.sampled,
            "elements": self.elements,
            **({"sampled_by_candidate": self.sampled_by_candidate} if self.sampled_by_candidate else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OperandRecord:
        return cls(
            {k: float(v) for k, v in data["stats"].items()},
            {c: {k: float(v) for k, v in m.items()} for c, m in data["metrics"].items()},
            int(data["sampled"]),
            int(data["elements"]),
            {c: int(n) for c, n in data.get("sampled_by_candidate", {}).items()},
        )


@dataclass
class Analysis:
    """Everything an observer recorded (see the module docstring for the layout)."""

    candidates: tuple[str, ...] = ()
    operands: dict[OperandKey, dict[int, OperandRecord]] = field(default_factory=dict)
    histograms: dict[OperandKey, Log2Histogram] = field(default_factory=dict)
    backward_errors: dict[GemmKey, dict[Pair, dict[int, dict[str, float]]]] = field(default_factory=dict)
    elements: dict[OperandKey, int] = field(default_factory=dict)
    plan_formats: dict[OperandKey, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    sensitivity: Sensitivity | None = None

    # -- queries ----------------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """Every sampled step, ascending."""
        found: set[int] = set()
        for per_step in self.operands.values():
            found.update(per_step)
        for pairs in self.backward_errors.values():
            for per_step in pairs.values():
                found.update(per_step)
        return sorted(found)

    def weight_shapes(self) -> dict[str, list[int]]:
        """Each observed Linear site's weight shape (``meta["weight_shapes"]``; empty for analyses that
        predate it), for the stacks' shape rules."""
        return {str(name): [int(d) for d in shape] for name, shape in self.meta.get("weight_shapes", [])}

    def operand_sizes(self) -> dict[str, dict[tuple[str, str], int]]:
        """Each operand's full element count by site, then ``(gemm, operand)``: the weights
        :meth:`numscope.Plan.average_bits` takes."""
        sizes: dict[str, dict[tuple[str, str], int]] = {}
        for (site, gemm, operand), count in self.elements.items():
            sizes.setdefault(site, {})[(gemm, operand)] = count
        return sizes

    def keys(self) -> list[OperandKey]:
        """Every operand key, sorted."""
        return sorted(self.operands)

    def sites(self) -> list[str]:
        return sorted({key[0] for key in self.operands} | {key[0] for key in self.backward_errors})

    def record(self, key: OperandKey, step: int) -> OperandRecord:
        per_step = self.operands.get(key)
        if per_step is None:
            raise AnalysisError(
                f"no operand {operand_name(key)!r} in this analysis; known: "
                f"{', '.join(operand_name(k) for k in self.keys()) or '(none)'}"
            )
        if step not in per_step:
            raise AnalysisError(
                f"operand {operand_name(key)!r} was not sampled at step {step}; sampled: {sorted(per_step)}"
            )
        return per_step[step]

    def metric_values(self, key: OperandKey, candidate: str, metric: str) -> list[float]:
        """The values of one candidate metric of one operand, over the sampled steps in order."""
        per_step = self.operands.get(key, {})
        values = []
        for step in sorted(per_step):
            metrics = per_step[step].metrics.get(candidate)
            if metrics is None:
                known = sorted(per_step[step].metrics)
                raise AnalysisError(
                    f"candidate {candidate!r} was not measured for {operand_name(key)!r}; "
                    f"measured: {', '.join(known)}"
                )
            if metric not in metrics:
                raise AnalysisError(
                    f"metric {metric!r} is not recorded for {operand_name(key)}/{candidate}; "
                    f"recorded: {', '.join(sorted(metrics))}"
                )
            values.append(metrics[metric])
        return values

    def be_values(self, gemm_key: GemmKey, pair: Pair, stat: str = "mean") -> list[float]:
        """The backward error ``stat`` (mean, p99, max) of one GEMM and operand-format pair over steps."""
        per_pair = self.backward_errors.get(gemm_key, {})
        per_step = per_pair.get(pair)
        if per_step is None:
            known = ", ".join(f"{a}*{b}" for a, b in sorted(per_pair)) or "(none)"
            raise AnalysisError(
                f"no backward error for {'/'.join(gemm_key)} with pair {pair[0]}*{pair[1]}; recorded: {known}"
            )
        return [per_step[step][stat] for step in sorted(per_step)]

    # -- flat names -------------------------------------------------------------------------------
    def flat(self) -> dict[int, dict[str, float]]:
        """step -> flat name -> value, for every recorded number (the CSV's rows)."""
        rows: dict[int, dict[str, float]] = {}
        for key, per_step in self.operands.items():
            prefix = operand_name(key)
            for step, record in per_step.items():
                row = rows.setdefault(step, {})
                for stat, value in record.stats.items():
                    row[f"{prefix}/{stat}"] = value
                for candidate, metrics in record.metrics.items():
                    for metric, value in metrics.items():
                        row[f"{prefix}/{candidate}/{metric}"] = value
        for (site, gemm), pairs in self.backward_errors.items():
            for (left, right), per_step in pairs.items():
                for step, stats in per_step.items():
                    row = rows.setdefault(step, {})
                    for stat, value in stats.items():
                        row[f"{site}/{gemm}/be/{left}*{right}/{stat}"] = value
        return dict(sorted(rows.items()))

    def summary(self) -> dict[str, dict[str, float]]:
        """flat name -> ``{"mean", "min", "max", "steps"}`` over the sampled steps.

        ``mean`` is the plain average of the per-step values; ``min`` and ``max`` the extremes (the advisor
        judges limits on the worst step: ``max`` for errors and under/overflow, ``min`` for SQNR).
        """
        collected: dict[str, list[float]] = {}
        for row in self.flat().values():
            for name, value in row.items():
                collected.setdefault(name, []).append(value)
        out = {}
        for name, values in sorted(collected.items()):
            finite = [v for v in values if not math.isnan(v)]
            out[name] = {
                "mean": sum(finite) / len(finite) if finite else math.nan,
                "min": min(finite) if finite else math.nan,
                "max": max(finite) if finite else math.nan,
                "steps": float(len(values)),
            }
        return out

    # -- persistence ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "numscope_analysis": FILE_VERSION,
            "candidates": list(self.candidates),
            "meta": self.meta,
            "operands": [
                {
                    "site": key[0],
                    "gemm": key[1],
                    "operand": key[2],
                    "elements": self.elements.get(key, 0),
                    "plan_format": self.plan_formats.get(key),
                    "histogram": self.histograms[key].to_dict() if key in self.histograms else None,
                    "steps": {str(step): record.to_dict() for step, record in sorted(per_step.items())},
                }
                for key, per_step in sorted(self.operands.items())
            ],
            "backward_errors": [
                {
                    "site": site,
                    "gemm": gemm,
                    "left": left,
                    "right": right,
                    "steps": {str(step): stats for step, stats in sorted(per_step.items())},
                }
                for (site, gemm), pairs in sorted(self.backward_errors.items())
                for (left, right), per_step in sorted(pairs.items())
            ],
            **({"sensitivity": self.sensitivity.to_dict()} if self.sensitivity is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Analysis:
        """Rebuild an analysis from :meth:`to_dict`'s output (errors name what is missing)."""
        version = data.get("numscope_analysis") if isinstance(data, Mapping) else None
        if version != FILE_VERSION:
            raise AnalysisError(
                f"not a numscope analysis of version {FILE_VERSION}: 'numscope_analysis' is {version!r}"
            )
        try:
            analysis = cls(candidates=tuple(data["candidates"]), meta=dict(data.get("meta", {})))
            for entry in data["operands"]:
                key = (entry["site"], entry["gemm"], entry["operand"])
                analysis.operands[key] = {
                    int(step): OperandRecord.from_dict(record) for step, record in entry["steps"].items()
                }
                analysis.elements[key] = int(entry["elements"])
                if entry.get("plan_format"):
                    analysis.plan_formats[key] = entry["plan_format"]
                if entry.get("histogram") is not None:
                    analysis.histograms[key] = Log2Histogram.from_dict(entry["histogram"])
            for entry in data["backward_errors"]:
                pairs = analysis.backward_errors.setdefault((entry["site"], entry["gemm"]), {})
                pairs[(entry["left"], entry["right"])] = {
                    int(step): {k: float(v) for k, v in stats.items()}
                    for step, stats in entry["steps"].items()
                }
            if data.get("sensitivity") is not None:
                analysis.sensitivity = Sensitivity.from_dict(data["sensitivity"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise AnalysisError(f"malformed analysis data: {type(error).__name__}: {error}") from error
        return analysis

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``analysis.json`` and ``analysis.csv`` into ``directory`` (created), each atomically."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path / JSON_NAME, json.dumps(self.to_dict(), indent=1, allow_nan=True))
        atomic_write_text(path / CSV_NAME, self._csv_text())
        return path

    def _csv_text(self) -> str:
        rows = self.flat()
        columns = sorted({name for row in rows.values() for name in row})
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["step", *columns])
        for step, row in rows.items():
            writer.writerow([step, *(_csv_number(row.get(name)) for name in columns)])
        return buffer.getvalue()

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Analysis:
        """Read an analysis written by :meth:`save` (the directory, or its ``analysis.json``)."""
        file, data = _read_json(directory, JSON_NAME, "an analysis")
        try:
            return cls.from_dict(data)
        except AnalysisError as error:
            raise AnalysisError(f"{str(file)!r}: {error}") from error

    def write_tensorboard(self, log_dir: str | os.PathLike[str]) -> bool:
        """Write every flat name as a TensorBoard scalar at its step; False (and nothing written) when
        ``torch.utils.tensorboard`` or ``tensorboard`` is not installed."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return False
        writer = SummaryWriter(log_dir=str(log_dir))
        try:
            for step, row in self.flat().items():
                for name, value in row.items():
                    writer.add_scalar(name, value, global_step=step)
        finally:
            writer.close()
        return True


def _csv_number(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _read_json(directory: str | os.PathLike[str], name: str, what: str) -> tuple[Path, Any]:
    """The file a ``load`` reads (``directory/name``, or ``directory`` itself if a ``.json``) and its JSON."""
    path = Path(directory)
    file = path if path.suffix == ".json" else path / name
    if not file.exists():
        where = "directory does not exist" if not file.parent.exists() else f"no {file.name} in it"
        raise AnalysisError(f"cannot load {what} from {str(directory)!r}: {where}")
    try:
        return file, json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AnalysisError(f"{str(file)!r} is not valid JSON (corrupt or truncated): {error}") from error


# -- sensitivity ---------------------------------------------------------------------------------------

ALL = "*"
"""The gemm and operand of a site-level sensitivity key: ``(site, "*", "*")`` (all six operands)."""
SENSITIVITY_VERSION = 1
SENSITIVITY_JSON = "sensitivity.json"


@dataclass
class Sensitivity:
    """What quantizing one site (or one operand) at a time does to the loss and the gradient.

    Measured by :func:`numscope.sensitivity`. ``results`` maps a key to candidate → metric → value: the key
    is ``(site, "*", "*")`` when the whole site (all six operands) was quantized (``granularity="site"``)
    or ``(site, gemm, operand)`` for one operand (``granularity="operand"``). Metrics, each over the
    measured batches against the unquantized (FP32) model on the same batches:

    * ``loss``: mean loss with the target quantized; ``loss_change``: its difference to the FP32 mean loss
      (loss units; > 0 is worse); ``loss_change%``: that difference in percent of the FP32 mean loss;
    * ``grad_cosine``: mean over batches of the cosine similarity between the full parameter gradient
      (every parameter, flattened) and the FP32 one; ``grad_cosine_min``: its smallest value over the
      batches; ``grad_rel_error``: mean of ‖g − g_fp32‖ / ‖g_fp32‖.

    reference_loss: the FP32 loss of each batch. candidates: the labels measured (format names, and
    ``"plan"`` for the plan's own spec of each site).
    """

    candidates: tuple[str, ...] = ()
    granularity: str = "site"
    reference_loss: list[float] = field(default_factory=list)
    results: dict[OperandKey, dict[str, dict[str, float]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def lookup(self, key: OperandKey, candidate: str) -> dict[str, float] | None:
        """The metrics of ``candidate`` for an operand key: its own if measured per operand, else its
        site's; None if neither was measured."""
        for target in (key, (key[0], ALL, ALL)):
            found = self.results.get(target, {}).get(candidate)
            if found is not None:
                return found
        return None

    def flat(self) -> dict[str, float]:
        """``<site>/<gemm>/<operand>/sensitivity/<candidate>/<metric>`` → value (``*`` for a whole site)."""
        return {
            f"{operand_name(key)}/sensitivity/{candidate}/{metric}": value
            for key, per_candidate in sorted(self.results.items())
            for candidate, metrics in per_candidate.items()
            for metric, value in metrics.items()
        }

    def table(self) -> list[dict[str, str]]:
        """Rows (target, candidate, loss_change%, grad_cosine_min) for printing, most harmful first."""
        rows = [
            (metrics.get("loss_change%", math.nan), operand_name(key), candidate, metrics)
            for key, per_candidate in self.results.items()
            for candidate, metrics in per_candidate.items()
        ]
        rows.sort(key=lambda row: (-row[0] if not math.isnan(row[0]) else math.inf, row[1], row[2]))
        return [
            {
                "target": target,
                "candidate": candidate,
                "loss_change%": f"{change:+.4g}",
                "grad_cosine_min": f"{metrics.get('grad_cosine_min', math.nan):.6f}",
            }
            for change, target, candidate, metrics in rows
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "numscope_sensitivity": SENSITIVITY_VERSION,
            "candidates": list(self.candidates),
            "granularity": self.granularity,
            "reference_loss": list(self.reference_loss),
            "meta": self.meta,
            "results": [
                {"site": key[0], "gemm": key[1], "operand": key[2], "candidates": per_candidate}
                for key, per_candidate in sorted(self.results.items())
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sensitivity:
        version = data.get("numscope_sensitivity") if isinstance(data, Mapping) else None
        if version != SENSITIVITY_VERSION:
            raise AnalysisError(
                f"not a numscope sensitivity of version {SENSITIVITY_VERSION}: "
                f"'numscope_sensitivity' is {version!r}"
            )
        try:
            results = {
                (entry["site"], entry["gemm"], entry["operand"]): {
                    candidate: {name: float(value) for name, value in metrics.items()}
                    for candidate, metrics in entry["candidates"].items()
                }
                for entry in data["results"]
            }
            return cls(
                tuple(data["candidates"]),
                str(data["granularity"]),
                [float(v) for v in data["reference_loss"]],
                results,
                dict(data.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise AnalysisError(f"malformed sensitivity data: {type(error).__name__}: {error}") from error

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``sensitivity.json`` into ``directory`` (created), atomically; returns its path."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path / SENSITIVITY_JSON, json.dumps(self.to_dict(), indent=1, allow_nan=True))
        return path / SENSITIVITY_JSON

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Sensitivity:
        """Read a sensitivity written by :meth:`save` (the directory, or its ``sensitivity.json``)."""
        return cls.from_dict(_read_json(directory, SENSITIVITY_JSON, "a sensitivity")[1])


# -- merging (ranks, runs) -------------------------------------------------------------------------

Reduce = Callable[[str, list[tuple[float, int]]], float]


def default_reduce(name: str, values: list[tuple[float, int]]) -> float:
    """Combine one statistic or metric measured on several parts (ranks) of a tensor at one step.

    values: (value, sample size) per part. Maxima (``amax``, ``max``, names ending ``_max``) take the max,
    minima (``min``, ``min_nonzero``, names ending ``_min``) the min — both exact; everything else the
    sample-weighted mean, exact for fractions and means (``underflow%``, ``overflow%``, ``rel_error``,
    ``mean``) and an approximation for nonlinear summaries (``sqnr_db``, ``kurtosis``, ``student_t_dof``).
    """
    finite = [(v, n) for v, n in values if not math.isnan(v)]
    if not finite:
        return math.nan
    if name in _MAX_STATS or name.endswith("_max"):
        return max(v for v, _ in finite)
    if name in _MIN_STATS or name.endswith("_min"):
        return min(v for v, _ in finite)
    weight = sum(n for _, n in finite)
    if weight == 0:
        return sum(v for v, _ in finite) / len(finite)
    return sum(v * n for v, n in finite) / weight


def merge(analyses: Iterable[Analysis], reduce: Reduce = default_reduce) -> Analysis:
    """Combine analyses of the same model taken on different ranks (or parts of a batch).

    Histograms and element counts add; per step, statistics and metrics of the same operand combine through
    ``reduce`` (see :func:`default_reduce`), backward errors through :func:`merge_be_stats`.
    Steps present in only some analyses are kept as they are.
    """
    parts = list(analyses)
    if not parts:
        raise AnalysisError("merge needs at least one analysis")
    out = Analysis(
        candidates=tuple(dict.fromkeys(c for a in parts for c in a.candidates)),
        meta={**parts[0].meta, "merged": len(parts)},
        sensitivity=next((a.sensitivity for a in parts if a.sensitivity is not None), None),
    )
    for key in sorted({k for a in parts for k in a.operands}):
        steps = sorted({s for a in parts for s in a.operands.get(key, {})})
        merged_steps = {}
        for step in steps:
            records = [a.operands[key][step] for a in parts if step in a.operands.get(key, {})]
            merged_steps[step] = merge_records(records, reduce)
        out.operands[key] = merged_steps
        out.elements[key] = sum(a.elements.get(key, 0) for a in parts)
        hists = [a.histograms[key] for a in parts if key in a.histograms]
        if hists:
            total = hists[0]
            for hist in hists[1:]:
                total = total + hist
            out.histograms[key] = total
        formats = {a.plan_formats[key] for a in parts if key in a.plan_formats}
        if len(formats) > 1:
            raise AnalysisError(
                f"operand {operand_name(key)!r} ran under different plan formats: {sorted(formats)}"
            )
        if formats:
            out.plan_formats[key] = formats.pop()
    for gemm_key in sorted({k for a in parts for k in a.backward_errors}):
        pairs = sorted({p for a in parts for p in a.backward_errors.get(gemm_key, {})})
        for pair in pairs:
            per_step: dict[int, dict[str, float]] = {}
            steps = sorted({s for a in parts for s in a.backward_errors.get(gemm_key, {}).get(pair, {})})
            for step in steps:
                found = [
                    a.backward_errors[gemm_key][pair][step]
                    for a in parts
                    if step in a.backward_errors.get(gemm_key, {}).get(pair, {})
                ]
                per_step[step] = merge_be_stats(found, reduce)
            out.backward_errors.setdefault(gemm_key, {})[pair] = per_step
    return out


BE_COUNTS = ("count", "excluded")
"""Backward-error statistics that are counts of output entries (they add when parts merge)."""


def merge_be_stats(parts: list[Mapping[str, float]], reduce: Reduce = default_reduce) -> dict[str, float]:
    """Combine the backward-error statistics of one GEMM and pair at one step measured on several parts
    (ranks, or several calls of a site in one step).

    ``count`` and ``excluded`` add; every other statistic goes through ``reduce`` weighted by each part's
    ``count`` (entries measured): the mean exactly, ``p99`` approximately; ``max`` takes the max. A part
    without ``count`` (an analysis from before it was recorded) weighs 1.
    """
    out: dict[str, float] = {}
    for name in dict.fromkeys(n for part in parts for n in part):
        present = [part for part in parts if name in part]
        if name in BE_COUNTS:
            out[name] = float(sum(part[name] for part in present))
        else:
            out[name] = reduce(name, [(part[name], part.get("count", 1.0)) for part in present])
    return out


def merge_records(records: list[OperandRecord], reduce: Reduce = default_reduce) -> OperandRecord:
    """Combine records of one operand at one step (ranks, or several calls of a site in one step)."""
    if len(records) == 1:
        return records[0]
    stats = {
        name: reduce(name, [(r.stats[name], r.sampled) for r in records if name in r.stats])
        for name in dict.fromkeys(n for r in records for n in r.stats)
    }
    metrics: dict[str, dict[str, float]] = {}
    for candidate in dict.fromkeys(c for r in records for c in r.metrics):
        names = dict.fromkeys(n for r in records for n in r.metrics.get(candidate, {}))
        metrics[candidate] = {
            name: reduce(
                name,
                [
                    (r.metrics[candidate][name], r.sample_size(candidate))
                    for r in records
                    if name in r.metrics.get(candidate, {})
                ],
            )
            for name in names
        }
    apart = dict.fromkeys(c for r in records for c in r.sampled_by_candidate)
    return OperandRecord(
        stats,
        metrics,
        sum(r.sampled for r in records),
        sum(r.elements for r in records),
        {c: sum(r.sample_size(c) for r in records if c in r.metrics) for c in apart},
    )
