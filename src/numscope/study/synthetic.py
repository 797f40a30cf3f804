"""The synthetic study of Rasquinha & Tabak (2024): backward error of quantized products vs tail weight.

Two independent size×size matrices with i.i.d. Student-t(ν) entries (ν = inf: Gaussian) are multiplied
exactly (float64) and after quantizing both in a format; the componentwise backward error
(:func:`numscope.metrics.backward_error`) is averaged over output entries and trials. Heavy tails (small
ν) stretch the dynamic range a per-tensor scale must cover, which INT8's uniform grid pays for in
underflow, while a float format's relative precision does not depend on magnitude. Formats are named as
``numscope.get_format`` names them, with ``:row`` for per-channel scaling along the contraction dimension
(``int8:row``: one scale per row of a and per column of b). Every trial uses the same matrices for every
format (common random numbers), seeded from ``(seed, trial, ν)``.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from numscope._atomic import atomic_write_text
from numscope.formats.quantize import quantize
from numscope.formats.scaling import Scaling
from numscope.formats.spec import get_format
from numscope.metrics.backward_error import backward_error_from, product_reference
from numscope.metrics.stats import student_t_dof

DOFS: tuple[float, ...] = (1.5, 2, 3, 4, 5, 6, 8, 12, 20, 50, math.inf)
FORMATS: tuple[str, ...] = ("int8", "int8:row", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp4_e2m1", "nvfp4")
SCALINGS: tuple[str, ...] = ("tensor", "row")


@dataclass(frozen=True)
class StudyFormat:
    """One line of the study: a format and how each operand is scaled (blocks and channels along k)."""

    label: str
    format: str
    scaling_a: Scaling
    scaling_b: Scaling

    @classmethod
    def parse(cls, spec: str) -> StudyFormat:
        """``name`` (per-tensor or own block scaling) or ``name:row`` (per channel along k)."""
        name, _, scaling = spec.partition(":")
        fmt = get_format(name)
        if scaling not in ("", *SCALINGS):
            raise ValueError(f"unknown study scaling {scaling!r} in {spec!r}; allowed: {', '.join(SCALINGS)}")
        if fmt.kind == "block":
            if scaling:
                raise ValueError(
                    f"block format {fmt.name!r} brings its own scaling; drop ':{scaling}' from {spec!r}"
                )
            return cls(fmt.name, fmt.name, Scaling("block", axis=1), Scaling("block", axis=0))
        if scaling == "row":
            return cls(f"{fmt.name} per row", fmt.name, Scaling("row"), Scaling("column"))
        label = f"{fmt.name} per tensor" if fmt.kind == "int" else fmt.name
        return cls(label, fmt.name, Scaling("tensor"), Scaling("tensor"))


@dataclass(frozen=True)
class StudyRow:
    """The backward error of one format at one ν, averaged over trials (dimensionless).

    mean, median, p99: averages over trials of the per-trial statistic over output entries; max: the
    largest over all trials. fitted_dof: :func:`numscope.metrics.student_t_dof` of the operands, averaged
    over trials (a check of the sampler and of the fit).
    """

    dof: float
    format: str
    mean: float
    median: float
    p99: float
    max: float
    trials: int
    size: int
    fitted_dof: float


def _sample(dof: float, size: int, seed: int, trial: int, operand: int) -> torch.Tensor:
    key = 10**9 if math.isinf(dof) else round(dof * 1000)
    rng = np.random.default_rng([seed, trial, key, operand])
    values = rng.standard_normal((size, size)) if math.isinf(dof) else rng.standard_t(dof, (size, size))
    return torch.from_numpy(values).float()


def backward_error_study(
    dofs: Sequence[float] = DOFS,
    formats: Sequence[str] = FORMATS,
    *,
    size: int = 512,
    seed: int = 0,
    trials: int = 2,
) -> list[StudyRow]:
    """Backward error of size×size products of Student-t(ν) matrices, each format on both operands.

    Returns one :class:`StudyRow` per (ν, format), ν in the order given. Cost: per ν and trial two float64
    reference products plus, per format, two quantizations and one float64 product.
    """
    if size < 1 or trials < 1:
        raise ValueError(f"size and trials must be >= 1, got size={size}, trials={trials}")
    for dof in dofs:
        if not dof > 0:
            raise ValueError(f"degrees of freedom must be > 0 (inf for Gaussian), got {dof}")
    lines = [StudyFormat.parse(spec) for spec in formats]
    rows: list[StudyRow] = []
    for dof in dofs:
        per_format: dict[str, list] = {line.label: [] for line in lines}
        fits = []
        for trial in range(trials):
            a, b = _sample(dof, size, seed, trial, 0), _sample(dof, size, seed, trial, 1)
            fits.append(student_t_dof(torch.cat([a.reshape(-1), b.reshape(-1)])))
            reference = product_reference(a, b)
            for line in lines:
                qa = quantize(a, line.format, scaling=line.scaling_a)
                qb = quantize(b, line.format, scaling=line.scaling_b)
                per_format[line.label].append(backward_error_from(reference, qa, qb))
        fitted = float(np.mean(fits))
        for line in lines:
            results = per_format[line.label]
            rows.append(
                StudyRow(
                    float(dof),
                    line.label,
                    float(np.mean([r.mean for r in results])),
                    float(np.mean([r.median for r in results])),
                    float(np.mean([r.p99 for r in results])),
                    float(max(r.max for r in results)),
                    trials,
                    size,
                    fitted,
                )
            )
    return rows


def _formats_of(rows: Sequence[StudyRow]) -> list[str]:
    return list(dict.fromkeys(row.format for row in rows))


def _dofs_of(rows: Sequence[StudyRow]) -> list[float]:
    return list(dict.fromkeys(row.dof for row in rows))


def crossover(rows: Sequence[StudyRow], first: str, second: str) -> float | None:
    """The ν at which the mean backward errors of two formats cross (first is better above it).

    Interpolated linearly in (log ν, log BE) between the two ν of the study that bracket the first
    sign change of log(BE_first / BE_second) from positive to negative, scanning from heavy to light
    tails; ``None`` when the curves do not cross that way. A crossover next to ν = inf is reported as inf.
    """
    table = {(row.dof, row.format): row.mean for row in rows}
    known = set(_formats_of(rows))
    for name in (first, second):
        if name not in known:
            raise ValueError(f"format {name!r} is not in the study; present: {', '.join(sorted(known))}")
    dofs = sorted(_dofs_of(rows))
    gaps = [math.log(table[(d, first)] / table[(d, second)]) for d in dofs]
    for i in range(len(dofs) - 1):
        (d0, g0), (d1, g1) = (dofs[i], gaps[i]), (dofs[i + 1], gaps[i + 1])
        if g0 > 0 >= g1:
            if math.isinf(d1):
                return math.inf
            t = g0 / (g0 - g1)
            return math.exp(math.log(d0) + t * (math.log(d1) - math.log(d0)))
    return None


def _dof_label(dof: float) -> str:
    return "inf" if math.isinf(dof) else f"{dof:g}"


def study_table(rows: Sequence[StudyRow]) -> str:
    """A plain-text table: one line per ν, the mean backward error of each format, and the best one."""
    names = _formats_of(rows)
    table = {(row.dof, row.format): row for row in rows}
    width = max(10, *(len(n) for n in names))
    header = f"{'ν':>6} {'fit ν':>7}  " + " ".join(f"{n:>{width}}" for n in names) + "  best"
    lines = [header, "-" * len(header)]
    for dof in _dofs_of(rows):
        cells = [table[(dof, n)] for n in names]
        best = min(cells, key=lambda row: row.mean).format
        fit = cells[0].fitted_dof
        lines.append(
            f"{_dof_label(dof):>6} {_dof_label(fit) if math.isinf(fit) else f'{fit:.3g}':>7}  "
            + " ".join(f"{row.mean:>{width}.3e}" for row in cells)
            + f"  {best}"
        )
    size, trials = rows[0].size, rows[0].trials
    lines.append(f"mean backward error of {size}×{size} products of Student-t(ν) matrices, {trials} trial(s)")
    return "\n".join(lines)


def plot_study(rows: Sequence[StudyRow], path: str | Path) -> Path:
    """Save a PNG: mean backward error (log y) vs ν (log x, Gaussian at the right), one line per format."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dofs = _dofs_of(rows)
    finite = [d for d in dofs if not math.isinf(d)]
    gaussian_x = (max(finite) * 2.5) if finite else 1.0
    position = {d: (gaussian_x if math.isinf(d) else d) for d in dofs}
    table = {(row.dof, row.format): row for row in rows}
    figure = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name in _formats_of(rows):
        xs = [position[d] for d in dofs]
        axes.plot(xs, [table[(d, name)].mean for d in dofs], marker="o", label=name)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks([position[d] for d in dofs])
    axes.set_xticklabels(["∞\n(Gaussian)" if math.isinf(d) else f"{d:g}" for d in dofs])
    axes.minorticks_off()
    axes.set_xlabel("Student-t degrees of freedom ν  (heavy tails ← → light tails)")
    axes.set_ylabel("mean backward error  |ab − Q(a)Q(b)| / |a||b|")
    size, trials = rows[0].size, rows[0].trials
    axes.set_title(f"Quantized {size}×{size} products of Student-t(ν) matrices ({trials} trial(s))")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out


def write_csv(rows: Sequence[StudyRow], path: str | Path) -> Path:
    """Write the rows as CSV (one line per ν and format; ν = inf written as ``inf``)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=[f.name for f in fields(StudyRow)])
    writer.writeheader()
    for row in rows:
        writer.writerow(asdict(row))
    atomic_write_text(out, text.getvalue())
    return out


def read_csv(path: str | Path) -> list[StudyRow]:
    """Read rows written by :func:`write_csv`."""
    with Path(path).open(newline="") as handle:
        return [
            StudyRow(
                float(r["dof"]),
                r["format"],
                float(r["mean"]),
                float(r["median"]),
                float(r["p99"]),
                float(r["max"]),
                int(r["trials"]),
                int(r["size"]),
                float(r["fitted_dof"]),
            )
            for r in csv.DictReader(handle)
        ]


def run_study(
    out_dir: str | Path,
    *,
    dofs: Sequence[float] = DOFS,
    formats: Sequence[str] = FORMATS,
    size: int = 512,
    seed: int = 0,
    trials: int = 2,
) -> tuple[list[StudyRow], Path, Path]:
    """Run :func:`backward_error_study` and write ``backward_error_study.png`` and ``.csv`` in out_dir."""
    rows = backward_error_study(dofs, formats, size=size, seed=seed, trials=trials)
    directory = Path(out_dir)
    png = plot_study(rows, directory / "backward_error_study.png")
    table = write_csv(rows, directory / "backward_error_study.csv")
    return rows, png, table
