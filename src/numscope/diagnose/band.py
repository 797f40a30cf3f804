"""``numscope band``: the loss gap a recipe's numerics leave to FP32, step by step, over seeds in emulation —
and whether a real pair of runs stays inside it (:func:`band`, :meth:`Band.compare`).

Each seed trains FP32 and the plan (``numscope train`` runs: the same initialisation, batches and masks
within a seed). The gap of a step is the plan's training loss minus FP32's; each seed's gap curve is
smoothed by a trailing mean over ``window`` steps. At every step the band is the prediction interval of one
more seed's smoothed gap: ``mean ± t · sd · √(1 + 1/n)`` over the ``n`` seeds (Student's t at ``level``),
widened by ``tolerance`` nats on both sides.

:meth:`Band.compare` reads the loss logs of a user's two runs (high and low precision; CSV or TensorBoard),
smooths their gap over the same number of steps and says whether it stays inside the band, or from which
step it leaves it for ``persist`` logged points in a row; ``onset`` then estimates where the change began
(the split of the window before the excursion whose means differ most). A gap that leaves the band is not
what the recipe's numerics do on this model and data: look for another cause (a software bug, another
configuration). The band holds for runs like its own: the same model, data, training settings and steps.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from numscope._atomic import atomic_write_bytes, atomic_write_text
from numscope._settings import setting
from numscope.diagnose.logs import read_loss_log
from numscope.errors import NumscopeError
from numscope.plan import Plan

#: two-sided Student's t quantiles by level, by degrees of freedom 1–30 (beyond: the normal's)
_T = {
    0.95: (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
           2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
           2.045, 2.042),
    0.99: (63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169, 3.106, 3.055, 3.012, 2.977,
           2.947, 2.921, 2.898, 2.878, 2.861, 2.845, 2.831, 2.819, 2.807, 2.797, 2.787, 2.779, 2.771, 2.763,
           2.756, 2.750),
}  # fmt: skip
_NORMAL = {0.95: 1.960, 0.99: 2.576}
LEVELS = tuple(_T)


def t_quantile(level: float, dof: int) -> float:
    """Student's t two-sided quantile at ``level`` (0.95 or 0.99) for ``dof`` ≥ 1 degrees of freedom."""
    table = _T[level]
    return table[dof - 1] if dof <= len(table) else _NORMAL[level]


VARIANCES = ("step", "pooled")
POOL_SPAN = 0.05
"""The pooled variance's neighbourhood: the steps within this share of the run on either side (at least the
smoothing window)."""


def pooled_half_widths(
    curves: Sequence[Sequence[float]], window: int, level: float
) -> tuple[list[float], list[float]]:
    """Per step the half-width of the prediction interval of one more seed's smoothed gap, before any
    tolerance, with the seeds' variance pooled over the steps within :data:`POOL_SPAN` of the run on either
    side, and the degrees of freedom that pooling earns: ``(n − 1) · m / (1 + 2 Σ ρ(k)²)`` for ``m`` steps
    pooled, ρ the autocorrelation of the seeds' standardised deviations from their mean (summed while
    positive), so that steps whose deviations move together count as one. Returns the half-widths and the
    degrees of freedom."""
    n, length = len(curves), len(curves[0])
    mean = [statistics.fmean(values) for values in zip(*curves, strict=True)]
    deviations = [[c[k] - mean[k] for k in range(length)] for c in curves]
    variance = [sum(d[k] ** 2 for d in deviations) / (n - 1) for k in range(length)]
    scaled = [
        [d[k] / math.sqrt(variance[k]) if variance[k] > 0 else 0.0 for k in range(length)] for d in deviations
    ]
    reach = max(window, round(POOL_SPAN * length))
    power = sum(z * z for row in scaled for z in row)
    penalty = 1.0
    for lag in range(1, min(2 * reach, length - 1) + 1):
        products = sum(row[k] * row[k + lag] for row in scaled for k in range(length - lag))
        rho = products / power * length / (length - lag) if power > 0 else 0.0
        if rho <= 0:
            break
        penalty += 2 * rho * rho
    halves, dofs = [], []
    for k in range(length):
        pooled = variance[max(0, k - reach) : k + reach + 1]
        dof = max(n - 1, math.floor((n - 1) * len(pooled) / penalty))
        dofs.append(float(dof))
        halves.append(t_quantile(level, dof) * math.sqrt(statistics.fmean(pooled)) * math.sqrt(1 + 1 / n))
    return halves, dofs


class BandError(NumscopeError, ValueError):
    """A band that cannot be built or compared as asked."""


@dataclass(frozen=True)
class BandSettings:
    """How the band is built and judged (steps, nats)."""

    seeds: int = setting(
        3, "seeds, each an FP32 run and a plan run (the band's width is their spread)", minimum=2
    )
    window: int = setting(10, "steps of the trailing mean that smooths each gap curve", minimum=1)
    level: float = setting(
        0.99,
        "the band's coverage of one more seed's gap at one step: 0.95 or 0.99",
        positive=True,
    )
    persist: int = setting(
        5, "logged points in a row outside the band before a gap is said to leave it", minimum=1
    )
    tolerance: float = setting(
        0.0, "nats added to both sides of the band (e.g. your hardware's own run-to-run spread)"
    )
    variance: str = setting(
        "step",
        "the seeds' spread at each step alone (step), or pooled over the steps around it with the degrees "
        "of freedom their autocorrelation leaves (pooled)",
        choices=VARIANCES,
    )

    def __post_init__(self) -> None:
        for name, minimum in (("seeds", 2), ("window", 1), ("persist", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise BandError(f"{name} must be an integer >= {minimum}; got {value!r}")
        if self.variance not in VARIANCES:
            raise BandError(f"variance must be one of {', '.join(VARIANCES)}; got {self.variance!r}")
        if self.level not in LEVELS:
            raise BandError(f"level must be one of {', '.join(map(str, LEVELS))}; got {self.level!r}")
        if not (
            isinstance(self.tolerance, int | float) and math.isfinite(self.tolerance) and self.tolerance >= 0
        ):
            raise BandError(f"tolerance must be a finite number of nats >= 0; got {self.tolerance!r}")


def smooth(values: Sequence[float], window: int) -> list[float]:
    """The trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for k, value in enumerate(values):
        total += value
        if k >= window:
            total -= values[k - window]
        out.append(total / min(k + 1, window))
    return out


@dataclass
class Verdict:
    """What :meth:`Band.compare` found: whether the gap stayed inside, and if not from which step."""

    inside: bool
    left_at: int | None
    onset: int | None
    direction: str | None
    judged: tuple[int, int]
    largest_excess: float
    not_judged: int = 0
    steps: list[int] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    """The steps both logs share within the band's, and the smoothed gap there (what was judged)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def says(self) -> str:
        first, last = self.judged
        if self.inside:
            text = f"the gap stays inside the band over steps {first}–{last}"
        else:
            text = (
                f"the gap leaves the band {self.direction} it at step {self.left_at} (the change began near "
                f"step {self.onset}; largest excess {self.largest_excess:.3f} nats): not what the recipe's "
                "numerics do here; look for another cause (a software bug, another configuration)"
            )
        if self.not_judged:
            text += f"; {self.not_judged} logged steps beyond the band's last step were not judged"
        return text


@dataclass
class Band:
    """A recipe's emulated gap band (see the module docstring): per step the mean and the band's edges of the
    smoothed gap, and each seed's raw gap."""

    plan: str
    steps: list[int]
    gaps: dict[int, list[float]]
    settings: BandSettings
    fp32_losses: dict[int, list[float]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.curves = {seed: smooth(g, self.settings.window) for seed, g in self.gaps.items()}
        curves = list(self.curves.values())
        n = len(curves)
        if n < 2:
            raise BandError(f"a band needs gap curves of 2 or more seeds; got {n}")
        t = t_quantile(self.settings.level, n - 1)
        self.mean = [statistics.fmean(values) for values in zip(*curves, strict=True)]
        if self.settings.variance == "pooled":
            halves, self.dofs = pooled_half_widths(curves, self.settings.window, self.settings.level)
        else:
            halves = [
                t * statistics.stdev(values) * math.sqrt(1 + 1 / n) for values in zip(*curves, strict=True)
            ]
            self.dofs = [float(n - 1)] * len(self.mean)
        tolerance = self.settings.tolerance
        self.lower = [m - h - tolerance for m, h in zip(self.mean, halves, strict=True)]
        self.upper = [m + h + tolerance for m, h in zip(self.mean, halves, strict=True)]

    def widest(self) -> tuple[int, float]:
        """The step where the band is widest and its half-width there, in nats: a change of the gap smaller
        than that can stay inside the band at that step (more seeds narrow it)."""
        halves = [(upper - lower) / 2 for lower, upper in zip(self.lower, self.upper, strict=True)]
        index = max(range(len(halves)), key=halves.__getitem__)
        return self.steps[index], halves[index]

    def edges_at(self, step: int) -> tuple[float, float]:
        """The band's lower and upper edge at ``step`` (linear between the band's steps)."""
        steps = self.steps
        if step <= steps[0]:
            return self.lower[0], self.upper[0]
        for k in range(1, len(steps)):
            if step <= steps[k]:
                w = (step - steps[k - 1]) / (steps[k] - steps[k - 1])
                return (
                    self.lower[k - 1] + w * (self.lower[k] - self.lower[k - 1]),
                    self.upper[k - 1] + w * (self.upper[k] - self.upper[k - 1]),
                )
        return self.lower[-1], self.upper[-1]

    def compare(
        self,
        reference: str | os.PathLike[str] | Mapping[int, float],
        low: str | os.PathLike[str] | Mapping[int, float],
        key: str | None = None,
    ) -> Verdict:
        """Judge a user's pair of runs: ``reference`` (FP32 or BF16) and ``low`` (the recipe), each a loss log
        path (:func:`numscope.diagnose.logs.read_loss_log`; ``key`` its column or tag) or a mapping step →
        loss. Steps logged by both are compared; the gap is smoothed over as many logged points as span
        ``window`` steps."""
        high_log = reference if isinstance(reference, Mapping) else read_loss_log(reference, key)
        low_log = low if isinstance(low, Mapping) else read_loss_log(low, key)
        common = sorted(set(high_log) & set(low_log))
        judged = [s for s in common if self.steps[0] <= s <= self.steps[-1]]
        if len(judged) < self.settings.persist:
            raise BandError(
                f"the two logs share {len(common)} steps, {len(judged)} of them within the band's steps "
                f"{self.steps[0]}–{self.steps[-1]}; at least {self.settings.persist} (persist) are needed"
            )
        spacing = statistics.median(b - a for a, b in itertools.pairwise(judged)) if len(judged) > 1 else 1
        points = max(1, round(self.settings.window / max(1, spacing)))
        raw = [low_log[s] - high_log[s] for s in judged]
        gap = smooth(raw, points)
        run, first_out, direction, excess = 0, None, None, 0.0
        for k, (step, value) in enumerate(zip(judged, gap, strict=True)):
            lower, upper = self.edges_at(step)
            outside = value > upper or value < lower or not math.isfinite(value)
            if outside:
                excess = max(excess, value - upper if value > upper else lower - value, 0.0)
                run += 1
                if run == self.settings.persist:
                    first_out = k - run + 1
                    direction = "above" if gap[first_out] > self.edges_at(judged[first_out])[1] else "below"
                    break
            else:
                run = 0
        not_judged = len([s for s in common if s > self.steps[-1]])
        if first_out is None:
            return Verdict(True, None, None, None, (judged[0], judged[-1]), excess, not_judged, judged, gap)
        return Verdict(
            False,
            judged[first_out],
            judged[_onset(raw, first_out, points)],
            direction,
            (judged[0], judged[-1]),
            excess,
            not_judged,
            judged,
            gap,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "settings": asdict(self.settings),
            "steps": self.steps,
            "mean": self.mean,
            "lower": self.lower,
            "upper": self.upper,
            "gaps": {str(seed): gaps for seed, gaps in self.gaps.items()},
            "curves": {str(seed): curve for seed, curve in self.curves.items()},
            "fp32_losses": {str(seed): losses for seed, losses in self.fp32_losses.items()},
        }

    def save(self, folder: str | os.PathLike[str]) -> None:
        """``band.json`` into ``folder``."""
        atomic_write_text(Path(folder) / "band.json", json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike[str], settings: BandSettings | None = None) -> Band:
        """The band a folder's ``band.json`` (or that file) holds; ``settings`` judge it anew (the window,
        level, persistence and tolerance; the seeds are those it has)."""
        p = Path(path)
        p = p / "band.json" if p.is_dir() else p
        if not p.is_file():
            raise BandError(f"{path}: no band.json (build one with numscope band)")
        data = json.loads(p.read_text(encoding="utf-8"))
        stored = BandSettings(**data["settings"])
        chosen = replace(settings, seeds=stored.seeds) if settings is not None else stored
        return cls(
            data["plan"],
            list(data["steps"]),
            {int(seed): gaps for seed, gaps in data["gaps"].items()},
            chosen,
            {int(seed): losses for seed, losses in data.get("fp32_losses", {}).items()},
        )


def _onset(raw: Sequence[float], first_out: int, points: int) -> int:
    """Where a change that the smoothed gap shows at ``first_out`` began: the split ``j`` within the window
    before it whose means of ``raw`` before and from ``j`` on (each over ``points`` values) differ most."""
    best, best_at = -1.0, first_out
    for j in range(max(1, first_out - points - 1), first_out + 1):
        before = raw[max(0, j - points) : j]
        after = raw[j : j + points]
        if before and after:
            difference = abs(statistics.fmean(after) - statistics.fmean(before))
            if difference > best:
                best, best_at = difference, j
    return best_at


def band(
    model: str,
    data: Any,
    out: str | os.PathLike[str],
    *,
    plan: str | Plan,
    config: Any = None,
    settings: BandSettings | None = None,
    objective: str = "auto",
    progress: bool = False,
    log: Callable[[str], None] = lambda line: None,
) -> Band:
    """Train FP32 and ``plan`` on ``settings.seeds`` seeds (from ``config.seed``) and build the band of their
    gap (see the module docstring). model, data, config, objective: as :func:`numscope.run.train` takes
    them; plan: a preset, recipe, YAML path or :class:`Plan`. Writes ``runs/seed<k>/{fp32,plan}`` (finished
    runs reused on a rerun), ``band.json`` and ``band.png`` (with matplotlib) into ``out``."""
    from numscope.run import runner
    from numscope.run.config import TrainConfig
    from numscope.run.loop import read_log
    from numscope.run.sources import resolve_workload

    settings = settings or BandSettings()
    config = config if config is not None else TrainConfig()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(plan, Plan):
        plan_file = folder / "plan.yaml"
        plan.save(plan_file)
        plan_spec, label = str(plan_file), "custom plan"
    else:
        plan_spec, label = str(plan), str(plan)
    work = resolve_workload(model, data, objective)  # the model, tokenizer and blocks: once for every run
    gaps, fp32 = {}, {}
    for k in range(settings.seeds):
        seed = config.seed + k
        runs = folder / "runs" / f"seed{seed}"
        curves = {}
        for name, spec in (("fp32", "fp32"), ("plan", plan_spec)):
            log(f"[band] seed {seed} ({k + 1}/{settings.seeds}): {name if name == 'fp32' else label}")
            runner.train(
                work,
                None,
                runs / name,
                plan=spec,
                config=replace(config, seed=seed),
                objective=objective,
                name=name,
                progress=progress,
            )
            curves[name] = {row["step"]: row["loss"] for row in read_log(runs / name / "log.csv")}
        steps = sorted(curves["fp32"])
        gaps[seed] = [curves["plan"][s] - curves["fp32"][s] for s in steps]
        fp32[seed] = [curves["fp32"][s] for s in steps]
    result = Band(label, steps, gaps, settings, fp32)
    result.save(folder)
    result.files = {"json": str(folder / "band.json")}
    try:
        from numscope.report.plots import band_figure
    except ImportError:  # matplotlib is the report's extra
        return result
    atomic_write_bytes(folder / "band.png", band_figure(result.to_dict(), f"{label}: loss gap to FP32"))
    result.files["figure"] = str(folder / "band.png")
    return result
