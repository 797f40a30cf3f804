"""``numscope forecast``: one short FP32 fine-tune, observed, then every recipe of a training stack and
numscope's own plans at two budgets, each with its average bits and its gap to FP32 predicted from that run
alone (:mod:`numscope.forecast.predict`), in one table, a JSON file and a figure.

Stages (each reports progress): (1) FP32, observed, on the first seed: the analysis, the local
sensitivity (:func:`numscope.sensitivity.local_sensitivity`) of every operand of the sites the stacks
convert (the only ones their plans choose among), the trained model and Adam's state; (2) FP32 on the
other seeds, unobserved: the seed noise the gaps are judged against; (3) numscope's plans for the stack
at two budgets (the sensitivity objective); (4) every plan's effect on the trained model
(:func:`numscope.forecast.measure.measure_plans`); (5) the predictions."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from numscope._atomic import atomic_write_bytes, atomic_write_text
from numscope.analysis import Analysis
from numscope.errors import NumscopeError, SettingsError
from numscope.forecast.measure import PlanEffect, adam_preconditioner, measure_plans
from numscope.forecast.predict import ACCURACY, LR_RULES, effective_lr, predict, signal_lost, table_row
from numscope.forecast.stacks import StackPlan, stack_plans
from numscope.plan import HIGH, OperandSpec, Plan
from numscope.plan.targets import LINEAR_KINDS, STACKS, get_target

MEASURED_TOKENS = 2048
"""The scored validation tokens a plan's forward loss change is measured on by default (masked tokens of a
masked LM, every predicted token of a causal one): the per-token loss changes a quantized forward makes are
noisy; docs/results/forecast.md ("What it runs") shows the standard errors that set it."""


def measured_blocks(settings_blocks: int | None, seq_len: int, objective: str, available: int) -> int:
    """The validation blocks the forecast measures: as asked, or as many as score :data:`MEASURED_TOKENS`
    tokens (15% of a masked LM's), at most ``available``."""
    if settings_blocks is not None:
        return min(settings_blocks, available)
    scored = seq_len * (0.15 if objective == "mlm" else 1.0)
    return max(1, min(available, math.ceil(MEASURED_TOKENS / scored)))


AROUND = ("bf16", "fp32")
"""What may run around a plan's quantized GEMMs (:attr:`ForecastSettings.around`)."""


class ForecastError(NumscopeError, ValueError):
    """A forecast that cannot be made in the folder given (its settings' errors are
    :class:`numscope.errors.SettingsError`, naming the :class:`ForecastSettings` field)."""


@dataclass(frozen=True)
class ForecastSettings:
    """What a forecast measures besides the FP32 run's training (counts of batches, blocks and seeds)."""

    target: str = "te"
    seeds: int = 2
    """FP32 runs, the first observed: with 2 or more the seed noise is measured and each gap judged
    against it."""
    batches: int = 2
    """Training batches each plan's gradient error is measured on."""
    val_blocks: int | None = None
    """Validation blocks each plan's forward loss change is measured on (the run's own evaluation, on the
    same tokens for every plan); None: as many as score :data:`MEASURED_TOKENS` tokens (the split
    permitting)."""
    sensitivity_batches: int = 2
    """Validation batches the local sensitivity (numscope's plans) is measured on."""
    every: int = 25
    """The observer's sampling interval (steps)."""
    lr_rule: str = "mean"
    """How the run's learning rates weigh the update noise
    (:func:`numscope.forecast.predict.effective_lr`)."""
    around: str = "bf16"
    """What runs around the GEMMs a plan quantizes, and the GEMMs it keeps high: ``bf16``, as Transformer
    Engine, torchao and Megatron-LM train (the model under BF16 autocast; attention products, the LM head
    and the layers a recipe keeps high in BF16 with FP32 accumulation, softmax, norms and the loss in FP32),
    counted as 16 bits; ``fp32``: as the named recipes train in numscope (``--plan te_current``), the rest
    in FP32, counted as 32."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.target not in STACKS:
            raise SettingsError(
                f"{name}.target", f"{self.target!r} is not a training stack ({', '.join(STACKS)})"
            )
        for counted, minimum in (
            ("seeds", 1),
            ("batches", 1),
            ("val_blocks", 1),
            ("sensitivity_batches", 1),
            ("every", 1),
        ):
            value = getattr(self, counted)
            if counted == "val_blocks" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise SettingsError(f"{name}.{counted}", f"an integer >= {minimum}; got {value!r}")
        if self.around not in AROUND:
            raise SettingsError(f"{name}.around", f"{self.around!r}; allowed: {', '.join(AROUND)}")
        if self.lr_rule not in LR_RULES:
            raise SettingsError(f"{name}.lr_rule", f"{self.lr_rule!r}; allowed: {', '.join(LR_RULES)}")


def _candidates() -> list[str]:
    """The formats the observed FP32 run measures: the default candidates and every format any stack's
    recipes use, whichever stack is forecast, so that one pair of FP32 runs serves every stack's forecast
    (for Transformer Engine's, the list its own formats give: its recipes use every stack's formats)."""
    from numscope.run.runner import DEFAULT_CANDIDATES

    formats = [f for stack in STACKS for recipe in get_target(stack).recipes for f in recipe.measured]
    return list(dict.fromkeys([*DEFAULT_CANDIDATES, *formats]))


def forecast_folder(out: str | os.PathLike[str], target: str, around: str = "bf16") -> Path:
    """Where one stack's forecast writes its table, JSON, figure, plans and measured effects inside ``out``:
    ``out/<target>`` (``out/<target>-fp32`` with ``around="fp32"``), beside the FP32 runs every forecast
    into ``out`` shares."""
    return Path(out) / (target if around == "bf16" else f"{target}-{around}")


def _high_summary(plan: Plan, sites: Sequence[tuple[str, str]]) -> str:
    """Which GEMMs a plan keeps high (16 bits or more), in a few words: whole sites by kind (attention
    products; linear sites, the first two named), then single GEMMs by role."""
    whole_linear, whole_other, gemms = [], 0, {}
    for name, kind in sites:
        spec = plan.for_site(name)
        high = {key for key, operand in spec.operands.items() if _is_high(operand)}
        if len(high) == len(spec.operands):
            if kind in LINEAR_KINDS:
                whole_linear.append(name)
            else:
                whole_other += 1
            continue
        for gemm, _ in high:
            gemms.setdefault(gemm, set()).add(name)
    parts = []
    if whole_other:
        parts.append(f"{whole_other} attention/matmul sites")
    if whole_linear:
        shown = ", ".join(".".join(n.split(".")[-2:]) for n in whole_linear[:2])
        more = f" +{len(whole_linear) - 2}" if len(whole_linear) > 2 else ""
        plural = "s" if len(whole_linear) > 1 else ""
        parts.append(f"{len(whole_linear)} linear site{plural} ({shown}{more})")
    for gemm, names in gemms.items():
        parts.append(f"{gemm} of {len(names)} site{'s' if len(names) > 1 else ''}")
    return "; ".join(parts) or "none"


def _is_high(spec: Any) -> bool:
    """An operand left high or given 16 bits or more (BF16, FP16: what a stack's 'high precision' runs)."""
    return spec.format == HIGH or spec.bits_per_element() >= 16


def _budgets(analysis: Analysis, target: str, high_bits: float = 32.0) -> tuple[float, float]:
    """numscope's two budgets for ``target``: a third and two thirds of the way from the stack's cheapest
    recipe (everything it converts in it, the rest counted as ``high_bits``) to its costliest (or, where
    the two lie within a bit, as torchao's FP8 recipes do, to everything high)."""
    from numscope.advisor.target import recipe_bits

    bits = recipe_bits(analysis, get_target(target), analysis.candidates, high_bits)
    low = min(bits.values())
    high = max(bits.values())
    if high - low < 1.0:
        high = high_bits
    return low + (high - low) / 3, low + 2 * (high - low) / 3


def _numscope_plans(
    analysis: Analysis, target: str, budgets: Sequence[float], high_bits: float = 32.0
) -> list[StackPlan]:
    from numscope.advisor import recommend, sensitivity_objective

    objective = sensitivity_objective(analysis.sensitivity, None, analysis)
    out = []
    for budget in budgets:
        plan = recommend(
            analysis,
            objective=objective,
            bit_budget=budget,
            target=target,
            max_be_ratio=None,
            max_underflow_pct=None,
            max_overflow_pct=None,
            min_sqnr_db=None,
            high_bits=high_bits,
        )
        out.append(
            StackPlan(
                f"numscope@{budget:.1f}", f"numscope's plan for {target} within {budget:.2f} bits", plan
            )
        )
    return out


@dataclass
class Forecast:
    """What :func:`forecast` found: per plan its row (bits, prediction, high GEMMs), and the run's facts."""

    target: str
    rows: list[dict[str, Any]]
    fp32_losses: list[float]
    noise: float | None
    lr: float
    files: dict[str, str]
    seconds: dict[str, float]
    around: str = "bf16"
    """What ran around the quantized GEMMs (:attr:`ForecastSettings.around`)."""

    def table(self) -> list[dict[str, str]]:
        return [table_row(row["name"], row) for row in self.rows]

    def limits(self) -> list[str]:
        """What the table cannot say on this model, in a sentence each: that seed noise was not measured,
        or which plans' predicted gaps lie inside it (their order is not a prediction: the validation in
        docs/results/forecast.md found the ranks of such gaps uncorrelated with trained runs, whose own
        gaps the noise orders too)."""
        if self.noise is None:
            return ["Seed noise not measured (one FP32 seed): whether a gap is beyond it is not said."]
        inside = [row["name"] for row in self.rows if not row.get("lost") and not row.get("beyond_noise")]
        if not inside:
            return []
        names = ", ".join(inside[:4]) + (f" and {len(inside) - 4} more" if len(inside) > 4 else "")
        return [
            f"{len(inside)} of {len(self.rows)} plans ({names}) are predicted inside 2 sd of FP32's seed "
            f"noise ({2 * self.noise:.4f} nats): their order in the table is not a prediction, and trained "
            "runs would not tell them apart on this many seeds."
        ]


def forecast(
    model: str,
    data: Any,
    out: str | os.PathLike[str],
    *,
    config: Any = None,
    settings: ForecastSettings | None = None,
    objective: str = "auto",
    progress: bool = False,
    log: Callable[[str], None] = lambda line: None,
) -> Forecast:
    """Forecast every recipe of ``settings.target`` and numscope's plans on ``model`` (see the module
    docstring); writes into ``out``: ``fp32/`` (the observed run) and ``fp32-seed<k>/``, which every stack's
    forecast into ``out`` shares, and the stack's own folder (:func:`forecast_folder`: ``out/te``, or
    ``out/te-fp32`` with ``around="fp32"``) with ``forecast.json``, ``forecast.md``, ``forecast.png``,
    ``plans/<name>.yaml`` and the measured ``effects.json``. Finished runs and measurements are reused on a
    rerun: a second stack costs stages 3–5 only."""
    from numscope.run import runner
    from numscope.run.config import TrainConfig
    from numscope.run.sources import resolve_workload

    settings = settings or ForecastSettings()
    config = config if config is not None else TrainConfig()
    folder = Path(out)
    began = time.perf_counter()
    work = resolve_workload(model, data, objective)  # the model, tokenizer and blocks: once for every run
    prepared, factory, resolved = runner.prepare(work, None, config)
    # the batches each plan's gradient is measured on, drawn before any run: too few is said at once
    train_batches = _gradient_batches(prepared, config, resolved, settings.batches)
    stage = _Stage(folder, config, settings, progress, log)
    losses = stage.fp32_runs(work)
    noise = statistics.stdev(losses) if len(losses) > 1 else None
    stack = stage.plans(factory, train_batches)
    stored, blocks = stage.measure(stack, prepared, resolved, train_batches)
    log("[forecast] 5/5 predictions")
    lr = effective_lr([config.lr_at(step) for step in range(config.steps)], settings.lr_rule)
    rows = _predictions(stack, stored, lr, noise)
    stage.seconds["total"] = time.perf_counter() - began
    result = Forecast(settings.target, rows, losses, noise, lr, {}, stage.seconds, settings.around)
    payload = {
        "model": model,
        "target": settings.target,
        "settings": asdict(settings),
        "train": asdict(config),
        "fp32_val_loss": losses,
        "fp32_seed_sd": noise,
        "lr_effective": lr,
        "accuracy_factor": ACCURACY,
        "budgets": list(stack.budgets),
        "measured_blocks": blocks,
        "rows": rows,
        "seconds": stage.seconds,
    }
    name = model if len(model) < 40 else Path(model).name
    title = f"{settings.target}: predicted gap to FP32 ({name})"
    result.files = _write_forecast(stack.own, result, payload, title)
    return result


def _gradient_batches(prepared: Any, config: Any, resolved: str, count: int) -> list[dict[str, Any]]:
    """The ``count`` training batches every plan's gradient error is measured on (a stream of its own seed,
    apart from the runs' batches)."""
    from numscope.run.objectives import get_objective

    stream = (
        get_objective(resolved)
        .for_training(config.mask_probability)
        .batches(prepared.train_blocks, config.batch_size, prepared.tokenizer, config.seed + 7919, 0)
    )
    batches = [batch for _, batch in zip(range(count), stream, strict=False)]
    if len(batches) < count:
        raise SettingsError(
            "ForecastSettings.batches",
            f"{count} training batches asked; the training split holds {len(batches)}",
        )
    return batches


@dataclass
class _Stack:
    """Stage 3's output: the FP32-trained model with Adam's state, its sites, and the plans measured."""

    analysis: Analysis
    trained: torch.nn.Module
    optimizer_state: dict[str, Any]
    found: list[tuple[str, str]]
    budgets: tuple[float, ...]
    candidates: list[StackPlan]
    own: Path


@dataclass
class _Stage:
    """The forecast's stages 1–4, each a method, timed into ``seconds`` and announced through ``log``."""

    folder: Path
    config: Any
    settings: ForecastSettings
    progress: bool
    log: Callable[[str], None]
    seconds: dict[str, float] = field(default_factory=dict)

    def reused(self, run: Path) -> str:  # a finished run of the same settings is read, not trained again
        return ": finished before, reused" if (run / "result.json").is_file() else ""

    def fp32_runs(self, work: Any) -> list[float]:
        """1. FP32 observed on the first seed (with the local sensitivity of the sites the stacks convert
        and Adam's final state); 2. FP32 on the other seeds: the validation losses, seed by seed."""
        from numscope.run import runner
        from numscope.run.config import SensitivitySettings

        config, settings, folder = self.config, self.settings, self.folder
        # its FP32 runs are read for their final validation loss only: evaluated after the last step alone
        # (an evaluation changes no state of the run, so the loss is the one every config.eval_every gives)
        fp32_config = replace(config, eval_every=config.steps)
        began = time.perf_counter()
        self.log(
            f"[forecast] 1/5 FP32, observed (seed {config.seed}, {config.steps} steps)"
            f"{self.reused(folder / 'fp32')}"
        )
        observed = runner.analyze(
            work,
            None,
            folder / "fp32",
            config=fp32_config,
            candidates=_candidates(),
            every=settings.every,
            progress=self.progress,
            # numscope's plans for a stack choose only among the sites the stacks convert, at weight shapes
            # their kernels take (an LM head of 30,527 rows stays high in every stack): those alone
            sensitivity=SensitivitySettings(
                settings.sensitivity_batches,
                "operand",
                "auto",
                method="local",
                kinds=LINEAR_KINDS,
                stacks=tuple(STACKS),
            ),
            keep_optimizer=True,
        )
        self.seconds["fp32 observed"] = time.perf_counter() - began
        timing = folder / "fp32" / runner.SENSITIVITY_TIME
        if timing.is_file():  # the sensitivity's part of the stage (when it was measured)
            self.seconds["of which sensitivity"] = float(json.loads(timing.read_text())["seconds"])
        losses = [observed.val_loss]
        for k in range(1, settings.seeds):
            began = time.perf_counter()
            seed = config.seed + k
            self.log(f"[forecast] 2/5 FP32, seed {seed}{self.reused(folder / f'fp32-seed{seed}')}")
            other = runner.train(
                work,
                None,
                folder / f"fp32-seed{seed}",
                plan="fp32",
                config=replace(fp32_config, seed=seed),
                name="fp32",
                progress=self.progress,
            )
            losses.append(other.val_loss)
            self.seconds[f"fp32 seed {seed}"] = time.perf_counter() - began
        return losses

    def plans(self, factory: Callable[[], torch.nn.Module], batches: list[dict[str, Any]]) -> _Stack:
        """3. The stack's recipes and numscope's plans for it at two budgets, on the trained model's sites
        (what runs around them as ``settings.around`` says), each saved as YAML."""
        from numscope.sites import sites as list_sites
        from numscope.train.checkpoint import load_checkpoint

        settings, folder = self.settings, self.folder
        began = time.perf_counter()
        self.log("[forecast] 3/5 numscope's plans")
        analysis = Analysis.load(folder / "fp32" / "analysis")
        state = load_checkpoint(folder / "fp32" / "model.pt")
        if "optimizer" not in state:
            raise ForecastError(
                f"{folder / 'fp32'}: its model.pt holds no optimizer state (a run not made by a forecast); "
                "forecast into a new folder"
            )
        trained = factory()
        trained.load_state_dict(state["model"])
        example = {k: v for k, v in batches[0].items() if k != "labels"}
        found = [(site.name, site.kind) for site in list_sites(trained, example)]
        high_bits = 16.0 if settings.around == "bf16" else 32.0
        budgets = _budgets(analysis, settings.target, high_bits)
        candidates = stack_plans(settings.target, found, analysis.weight_shapes())
        candidates += _numscope_plans(analysis, settings.target, budgets, high_bits)
        if settings.around == "bf16":
            around = OperandSpec("bf16", overflow="propagate")
            candidates = [replace(c, plan=c.plan.with_high_as(around)) for c in candidates]
        own = forecast_folder(folder, settings.target, settings.around)
        (own / "plans").mkdir(parents=True, exist_ok=True)
        for entry in candidates:
            entry.plan.save(_plan_file(own, entry.name))
        self.seconds["numscope plans"] = time.perf_counter() - began
        return _Stack(analysis, trained, state["optimizer"], found, budgets, candidates, own)

    def measure(
        self, stack: _Stack, prepared: Any, resolved: str, batches: list[dict[str, Any]]
    ) -> tuple[dict[str, dict[str, Any]], int]:
        """4. Every plan applied to the trained model and undone: its forward's loss on the validation
        blocks and its gradient error's power in Adam's metric (kept in ``effects.json``; a rerun measures
        only plans not measured on the same batches and blocks). Returns the effects and the blocks."""
        from numscope.run.objectives import get_objective

        config, settings = self.config, self.settings
        began = time.perf_counter()
        self.log(f"[forecast] 4/5 {len(stack.candidates)} plans measured on the trained model")
        blocks = measured_blocks(
            settings.val_blocks, prepared.val_blocks.shape[1], resolved, len(prepared.val_blocks)
        )
        val = prepared.val_blocks[:blocks]
        chunk = max(1, min(16, len(val)))
        task = get_objective(resolved)

        def evaluate(model_: torch.nn.Module) -> list[float]:
            return [
                task.evaluate(model_, part, prepared.tokenizer, config.seed).loss
                for part in torch.split(val, chunk)
            ]

        parameters = [p for p in stack.trained.parameters() if p.requires_grad]
        preconditioner = adam_preconditioner(parameters, stack.optimizer_state)
        stack.optimizer_state = {}  # Adam's moments: 0.9 GB on MPNet-110M, held for nothing from here
        entries = {c.name: c.plan for c in stack.candidates}
        effects_path = stack.own / "effects.json"
        measured_on = {"batches": settings.batches, "blocks": blocks, "seed": config.seed}
        saved = json.loads(effects_path.read_text()) if effects_path.is_file() else {}
        # effects measured on other batches or blocks are measured again, and the plans by their YAML
        stored = saved.get("plans", {}) if saved.get("measured_on") == measured_on else {}
        stored = {name: e for name, e in stored.items() if e.get("plan") == _plan_key(entries.get(name))}
        missing = {c.name: c.plan for c in stack.candidates if c.name not in stored}
        if missing:
            from numscope._progress import progress as progress_bar

            bar = progress_bar(total=len(missing), desc="plans measured", enabled=self.progress)

            def advance(done: int, total: int) -> None:
                bar.n = done
                bar.refresh()

            try:
                measured = measure_plans(
                    stack.trained,
                    missing,
                    batches,
                    evaluate,
                    preconditioner,
                    clip=config.grad_clip,
                    seed=config.seed,
                    on_progress=advance,
                )
            finally:
                bar.close()
            stored.update(
                {
                    name: {**effect.to_dict(), "plan": _plan_key(missing[name])}
                    for name, effect in measured.items()
                }
            )
            payload = {"measured_on": measured_on, "plans": stored}
            atomic_write_text(effects_path, json.dumps(payload, indent=1))
        self.seconds["plans measured"] = time.perf_counter() - began
        return stored, blocks


def _plan_file(own: Path, name: str) -> Path:
    return own / "plans" / f"{name.replace('@', '_at_')}.yaml"


def _predictions(
    stack: _Stack, stored: dict[str, dict[str, Any]], lr: float, noise: float | None
) -> list[dict[str, Any]]:
    """5. Each plan's predicted gap from its measured effect, a row each."""
    sizes = stack.analysis.operand_sizes()
    rows = []
    for entry in stack.candidates:
        effect = PlanEffect.from_dict(stored[entry.name])
        prediction = predict(effect, lr, lost=signal_lost(stack.analysis, entry.plan))
        rows.append(
            {
                "name": entry.name,
                "label": entry.label,
                "numscope": entry.name.startswith("numscope@"),
                "bits": entry.plan.average_bits(sizes),
                **prediction.to_dict(),
                "beyond_noise": prediction.beyond(noise),
                "high_summary": _high_summary(entry.plan, stack.found),
                "plan": str(_plan_file(stack.own, entry.name)),
                "effect": {k: v for k, v in stored[entry.name].items() if k != "plan"},
            }
        )
    return rows


def _write_forecast(own: Path, result: Forecast, payload: dict[str, Any], title: str) -> dict[str, str]:
    """``forecast.json``, ``forecast.md`` and (with matplotlib) ``forecast.png`` into ``own``."""
    json_path, table_path, figure_path = own / "forecast.json", own / "forecast.md", own / "forecast.png"
    atomic_write_text(json_path, json.dumps(payload, indent=1, default=_plain))
    atomic_write_text(table_path, _markdown(result) + "\n")
    files = {"json": str(json_path), "table": str(table_path)}
    try:
        from numscope.report.plots import forecast_figure

        atomic_write_bytes(figure_path, forecast_figure(result.rows, result.noise, title))
        files["figure"] = str(figure_path)
    except ImportError:  # matplotlib is the report's extra
        pass
    return files


def _plan_key(plan: Plan | None) -> str:
    """A plan's identity for the effects cache: its YAML text."""
    return "" if plan is None else json.dumps(plan.to_dict(), sort_keys=True)


def _plain(value: Any) -> Any:
    """JSON for what json cannot write (sets, paths)."""
    return sorted(value) if isinstance(value, set) else str(value)


_AROUND_SAYS = {
    "bf16": "Around the quantized GEMMs, and in the GEMMs kept high: BF16 (as the stacks train under BF16 "
    "autocast; counted as 16 bits).",
    "fp32": "Around the quantized GEMMs, and in the GEMMs kept high: FP32 (counted as 32 bits).",
}


def _markdown(result: Forecast) -> str:
    rows = result.table()
    columns = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in rows]
    noise = "not measured (one seed)" if result.noise is None else f"{result.noise:.4f} nats"
    lines += [
        "",
        f"FP32 validation loss per seed: {', '.join(f'{v:.4f}' for v in result.fp32_losses)}; "
        f"seed sd {noise}; update noise weighed with lr {result.lr:.3g}",
        "",
        _AROUND_SAYS[result.around],
        *(f"\n{line}" for line in result.limits()),
    ]
    return "\n".join(lines)
