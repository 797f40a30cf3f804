"""``numscope localize``: which GEMMs made a plan's loss gap to FP32, and is the gap beyond FP32's seed noise.

Stages (each reports progress):

1. **Lockstep** (first seed): FP32 and the plan trained side by side on identical initialisation, batches,
   masks and dropout draws (:func:`numscope.diagnose.lockstep.lockstep`): per site and step, how far its
   input, its incoming gradient and its weight have drifted from FP32's, and the error the plan's own casts
   add there. The sites the plan quantizes are ranked by the error they add (mean over steps).
2. **Attribution**, on every seed: FP32, the plan, and the plan with one candidate site at a time put back
   in FP32 (the highest-ranked ``candidates`` sites; every quantized site with ``candidates=0``), each a
   ``numscope train`` run. A site's effect on a seed is the plan's validation loss minus that of the plan
   without it (the gap it closes); over the seeds its mean, sd and 95% interval (Student's t).
3. A site is **named** when its interval lies above zero and its mean effect exceeds FP32's seed noise (the
   sd of FP32's validation loss over the seeds): a cause beyond what another seed changes. One whose interval
   lies above zero but whose effect is smaller is **measurable**: a cost the seeds agree on, smaller than a
   change of seed. With one seed nothing can be judged (no interval); FP32 against FP32 names nothing (every
   effect is exactly zero).

Cost: 2 runs for the lockstep (in one process) plus ``seeds × (2 + candidates)`` training runs; the result
states it as a multiple of one FP32 run's wall time.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from numscope._atomic import atomic_write_bytes, atomic_write_text
from numscope._names import exact_pattern
from numscope._settings import setting
from numscope.diagnose.band import t_quantile
from numscope.diagnose.lockstep import Drift, lockstep
from numscope.errors import NumscopeError
from numscope.plan import Plan, SiteSpec


class LocalizeError(NumscopeError, ValueError):
    """A localization that cannot run as asked (bad settings)."""


@dataclass(frozen=True)
class LocalizeSettings:
    """What a localization runs besides the training it shares with ``numscope train``."""

    seeds: int = setting(
        3,
        "seeds of the attribution (FP32, the plan and each put-back on every seed; the first also runs the "
        "lockstep); 2 or more give intervals",
        minimum=1,
    )
    candidates: int = setting(
        6,
        "sites put back in FP32 one at a time, those where the plan adds the most error first; 0: every site "
        "the plan quantizes",
        minimum=0,
        flag="--top-sites",
    )
    every: int = setting(
        1,
        "record the lockstep's drift every this many steps (and at the last)",
        minimum=1,
        flag="--drift-every",
    )

    def __post_init__(self) -> None:
        for name, minimum in (("seeds", 1), ("candidates", 0), ("every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise LocalizeError(f"{name} must be an integer >= {minimum}; got {value!r}")


@dataclass
class Attribution:
    """One site's effect on the final validation loss: the plan's loss minus the plan's without it, by
    seed; ``mean``, ``sd`` and the 95% interval ``low``–``high`` over the seeds (``sd`` and the interval
    None with one seed)."""

    site: str
    per_seed: list[float]
    local_error: float
    named: bool = False
    measurable: bool = False
    """Its interval lies above zero: a cost the seeds agree on, whether or not it exceeds FP32's noise."""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_seed)

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.per_seed) if len(self.per_seed) > 1 else None

    @property
    def interval(self) -> tuple[float, float] | None:
        if self.sd is None:
            return None
        half = t_quantile(0.95, len(self.per_seed) - 1) * self.sd / math.sqrt(len(self.per_seed))
        return self.mean - half, self.mean + half

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site,
            "mean": self.mean,
            "sd": self.sd,
            "interval": self.interval,
            "per_seed": self.per_seed,
            "local_error": self.local_error,
            "measurable": self.measurable,
            "named": self.named,
        }


@dataclass
class Localization:
    """What :func:`localize` found (also ``localize.json`` in its folder)."""

    plan: str
    drift: Drift
    fp32_losses: list[float]
    plan_losses: list[float]
    attributions: list[Attribution]
    not_tried: list[str]
    seconds: dict[str, float]
    fp32_run_seconds: float
    files: dict[str, str] = field(default_factory=dict)

    @property
    def noise(self) -> float | None:
        """FP32's seed noise: the sd of its validation loss over the seeds (None with one seed)."""
        return statistics.stdev(self.fp32_losses) if len(self.fp32_losses) > 1 else None

    @property
    def gaps(self) -> list[float]:
        """The plan's validation loss minus FP32's, by seed (paired: same seed, same data)."""
        return [p - f for p, f in zip(self.plan_losses, self.fp32_losses, strict=True)]

    @property
    def named(self) -> list[str]:
        """The sites whose effect lies beyond FP32's seed noise, largest effect first."""
        return [a.site for a in self.attributions if a.named]

    @property
    def cost(self) -> float:
        """The localization's compute, the lockstep and every run's training time (as measured when each
        ran, also where a rerun reused it), as a multiple of one FP32 run's (the mean over seeds)."""
        return self.seconds["total"] / self.fp32_run_seconds if self.fp32_run_seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "fp32_val_loss": self.fp32_losses,
            "plan_val_loss": self.plan_losses,
            "gaps": self.gaps,
            "fp32_seed_sd": self.noise,
            "named": self.named,
            "attributions": [a.to_dict() for a in self.attributions],
            "not_tried": self.not_tried,
            "seconds": self.seconds,
            "fp32_run_seconds": self.fp32_run_seconds,
            "cost_fp32_runs": self.cost,
            "drift": self.drift.to_dict(),
        }

    def table(self) -> list[dict[str, str]]:
        """The ranked attribution as rows of text (the CLI's and ``localize.md``'s table)."""
        rows = []
        for a in self.attributions:
            interval = a.interval
            rows.append(
                {
                    "site": a.site,
                    "error added": f"{a.local_error:.3g}",
                    "effect (nats)": f"{a.mean:+.4f}",
                    "95% interval": "—" if interval is None else f"{interval[0]:+.4f} … {interval[1]:+.4f}",
                    "per seed": " ".join(f"{v:+.4f}" for v in a.per_seed),
                    "beyond noise": "yes" if a.named else ("no (measurable)" if a.measurable else "no"),
                }
            )
        return rows


def _ranked(plan: Plan, drift: Drift) -> list[tuple[str, float]]:
    """The sites the plan quantizes (any operand not high), by the mean error its casts add there,
    largest first."""
    local = drift.mean("local")
    quantized = [s for s in drift.sites if plan.for_site(s).operands]
    return sorted(((s, local[s]) for s in quantized), key=lambda item: -item[1])


def _judge(attributions: list[Attribution], noise: float | None) -> None:
    for a in attributions:
        interval = a.interval
        a.measurable = interval is not None and interval[0] > 0
        a.named = a.measurable and noise is not None and a.mean > noise


def localize(
    model: str,
    data: Any,
    out: str | os.PathLike[str],
    *,
    plan: str | Plan,
    config: Any = None,
    settings: LocalizeSettings | None = None,
    objective: str = "auto",
    progress: bool = False,
    log: Callable[[str], None] = lambda line: None,
) -> Localization:
    """Localize the loss gap ``plan`` leaves to FP32 on ``model`` to its sites (see the module docstring).

    model, data, config, objective: as :func:`numscope.run.train` takes them (a checkpoint folder, a
    built-in, a config or a factory; a :class:`numscope.run.DataSettings`; a :class:`TrainConfig`, whose
    ``seed`` is the first seed). plan: a preset, a named recipe, a YAML path or a :class:`Plan` (e.g. one
    read by :func:`numscope.plan.export.from_transformer_engine`). Writes into ``out``: ``runs/`` (every
    training run; finished ones are reused on a rerun), ``plans/`` (each put-back plan), ``drift.json``,
    ``localize.json``, ``localize.md`` and ``localize.png`` (with matplotlib).
    """
    from numscope.run import runner
    from numscope.run.config import TrainConfig
    from numscope.run.loop import _Batches
    from numscope.run.objectives import get_objective
    from numscope.run.sources import resolve_workload
    from numscope.sites import sites as list_sites

    settings = settings or LocalizeSettings()
    config = config if config is not None else TrainConfig()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    seconds: dict[str, float] = {}
    work = resolve_workload(model, data, objective)  # the model, tokenizer and blocks: once for every run
    prepared, factory, resolved = runner.prepare(work, None, config)
    objective_ = get_objective(resolved).for_training(config.mask_probability)
    batches = _Batches(prepared, config, objective_)
    example = {k: v for k, v in batches.at(0).items() if k != "labels"}
    names = [site.name for site in list_sites(factory(), example)]
    if isinstance(plan, Plan):
        resolved_plan, label = plan, "custom plan"
    else:
        resolved_plan = Plan.resolve(plan, names)
        label = Path(plan).name if Path(plan).is_file() else str(plan)
    resolved_plan.check_sites(names)
    plans_dir = folder / "plans"
    plans_dir.mkdir(exist_ok=True)
    plan_file = plans_dir / "plan.yaml"
    resolved_plan.save(plan_file)

    drift_path = folder / "drift.json"
    stage = time.perf_counter()
    stored = json.loads(drift_path.read_text()) if drift_path.is_file() else None
    key = {
        "plan": resolved_plan.to_dict(),
        "train": asdict(config),
        "data": asdict(data),
        "every": settings.every,
        "model": model,
    }
    key = json.loads(json.dumps(key, default=str))
    if stored is not None and stored.get("key") == key:
        drift = Drift.from_dict(stored["drift"])
        seconds["lockstep"] = stored["seconds"]
    else:
        log(f"[localize] 1/2 FP32 and {label} in lockstep (seed {config.seed}, {config.steps} steps)")
        advance, close = runner._progress(config.steps, "lockstep", progress)
        try:
            drift = lockstep(
                factory,
                resolved_plan,
                batches.at,
                steps=config.steps,
                seed=config.seed,
                lr_at=config.lr_at,
                weight_decay=config.weight_decay,
                grad_clip=config.grad_clip,
                every=settings.every,
                on_step=advance,
            )
        finally:
            close()
        seconds["lockstep"] = time.perf_counter() - stage
        record = {"key": key, "seconds": seconds["lockstep"], "drift": drift.to_dict()}
        atomic_write_text(drift_path, json.dumps(record))
    ranked = _ranked(resolved_plan, drift)  # empty for a plan that quantizes nothing (FP32 against FP32)
    count = len(ranked) if settings.candidates == 0 else min(settings.candidates, len(ranked))
    candidates, not_tried = ranked[:count], [s for s, _ in ranked[count:]]
    put_back = {}
    for index, (site, _) in enumerate(candidates):
        path = plans_dir / f"without-{index:02d}.yaml"
        resolved_plan.with_rule(exact_pattern(site), SiteSpec()).save(path)
        put_back[site] = path

    fp32_losses, plan_losses, fp32_seconds, run_seconds = [], [], [], 0.0
    effects: dict[str, list[float]] = {site: [] for site, _ in candidates}
    total_runs = settings.seeds * (2 + len(candidates))
    done = 0

    def run(seed: int, name: str, plan_spec: str, out_name: str) -> Any:
        nonlocal done, run_seconds
        done += 1
        log(f"[localize] 2/2 run {done}/{total_runs}: seed {seed}, {name}")
        result = runner.train(
            work,
            None,
            folder / "runs" / f"seed{seed}" / out_name,
            plan=plan_spec,
            config=replace(config, seed=seed),
            objective=objective,
            name=name,
            progress=progress,
        )
        run_seconds += result.wall_seconds  # its own training time, also when a rerun reuses it
        return result

    for k in range(settings.seeds):
        seed = config.seed + k
        reference = run(seed, "fp32", "fp32", "fp32")
        fp32_seconds.append(reference.wall_seconds)
        low = run(seed, label if isinstance(plan, Plan) else str(plan), str(plan_file), "plan")
        fp32_losses.append(reference.val_loss)
        plan_losses.append(low.val_loss)
        for index, (site, _) in enumerate(candidates):
            without = run(seed, f"{site} in FP32", str(put_back[site]), f"without-{index:02d}")
            effects[site].append(low.val_loss - without.val_loss)
    local = dict(ranked)
    attributions = [Attribution(site, effects[site], local[site]) for site, _ in candidates]
    noise = statistics.stdev(fp32_losses) if len(fp32_losses) > 1 else None
    _judge(attributions, noise)
    attributions.sort(key=lambda a: -a.mean)
    seconds["runs"] = run_seconds
    seconds["total"] = seconds["lockstep"] + run_seconds
    seconds["this call"] = time.perf_counter() - began
    result = Localization(
        label,
        drift,
        fp32_losses,
        plan_losses,
        attributions,
        not_tried,
        seconds,
        statistics.fmean(fp32_seconds),
    )
    _write(folder, result, model)
    return result


def verdict(result: Localization) -> str:
    """One paragraph: the gap, the noise, the named sites (or why none), and the cost."""
    gaps = result.gaps
    noise = result.noise
    said = [
        f"{result.plan}: validation loss gap to FP32 {statistics.fmean(gaps):+.4f} nats (per seed "
        f"{', '.join(f'{g:+.4f}' for g in gaps)}); FP32's seed noise "
        + ("not measured (one seed)" if noise is None else f"{noise:.4f} nats (sd over {len(gaps)} seeds)")
        + "."
    ]
    if not result.attributions and not result.not_tried:
        said.append("The plan quantizes no site: there is nothing to attribute.")
    elif result.named:
        said.append(f"Beyond the noise: {', '.join(result.named)}.")
    elif noise is None:
        said.append("No site can be judged with one seed: give 2 or more.")
    else:
        said.append("No site's effect lies beyond FP32's seed noise.")
    smaller = [a.site for a in result.attributions if a.measurable and not a.named]
    if smaller:
        said.append(f"Measurable on every seed but within that noise: {', '.join(smaller)}.")
    if result.not_tried:
        said.append(
            f"{len(result.not_tried)} quantized sites adding less error were not put back "
            "(`LocalizeSettings.candidates` 0 tries every one)."
        )
    said.append(
        f"Cost: {result.seconds['total']:.0f} s of training (the lockstep "
        f"{result.seconds['lockstep']:.0f} s and every run), {result.cost:.1f}× one FP32 run "
        f"({result.fp32_run_seconds:.1f} s)."
    )
    return " ".join(said)


def _write(folder: Path, result: Localization, model: str) -> None:
    atomic_write_text(folder / "localize.json", json.dumps({"model": model, **result.to_dict()}, indent=1))
    rows = result.table()
    columns = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in rows]
    atomic_write_text(folder / "localize.md", "\n".join([*lines, "", verdict(result), ""]))
    result.files = {"json": str(folder / "localize.json"), "table": str(folder / "localize.md")}
    try:
        from numscope.report.plots import localize_figure
    except ImportError:  # matplotlib is the report's extra
        return
    title = f"{result.plan} against FP32 ({model if len(model) < 40 else Path(model).name})"
    atomic_write_bytes(folder / "localize.png", localize_figure(result.to_dict(), title))
    result.files["figure"] = str(folder / "localize.png")
