"""``numscope demo``: BERT masked-LM trained under the classic recipes and under a measured plan.

Stages (each skipped when its output exists, so an interrupted demo resumes):

1. data — corpus split, WordPiece tokenizer (cached), token blocks;
2. ``fp32`` — the reference run, observed every few steps: the *analysis* of every GEMM operand;
3. ``recommended`` — :func:`numscope.advisor.advise` on that analysis (asked as :class:`AdvisorRequest`
   says) writes ``plan.yaml``, then a run under it;
4. the baselines — ``bf16``, ``fp16`` with dynamic loss scaling, the loss-scaling pair (every GEMM's
   gradient in FP8 E5M2 with no scale of its own, without and with dynamic loss scaling), ``fp8`` (hybrid
   E4M3/E5M2, per-tensor scaling), ``mxfp8`` (E4M3 in blocks of 32), ``int8`` (per-tensor scaling),
   ``mxfp4``; then ``fp32`` and the recommended plan again from other seeds (``fp32-seedN``,
   ``recommended-seedN``): the seed noise, and the plan's comparison with FP32 seed by seed;
5. ``report.html``, ``summary.json`` and the final table, with each claim checked against the numbers.

Every run keeps its folder ``runs/NAME/``: ``log.csv``, ``plan.yaml``, ``result.json`` and its final model,
``model.pt`` (:data:`MODEL_FILE`).
"""

from __future__ import annotations

import html
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from numscope._atomic import atomic_write_text
from numscope._names import seed_run_name
from numscope._progress import progress as progress_bar
from numscope.demo.claims import (
    E5M2_SCALED,
    HEURISTIC,
    RECOMMENDED,
    REFERENCE,
    _claims,
)
from numscope.errors import NumscopeError
from numscope.plan import Plan
from numscope.run.config import RunData, RunResult, RunSpec
from numscope.run.data import unigram_loss
from numscope.run.experiment import Experiment, experiment_observer
from numscope.run.folders import read_settings, setting_changes
from numscope.run.loop import read_log
from numscope.run.model import ModelConfig
from numscope.run.pool import RunPool, default_jobs
from numscope.vocab import Gemm, Operand


@dataclass(frozen=True)
class AdvisorRequest:
    """How the demo asks the advisor for its plan (see :mod:`numscope.advisor` for the criteria).

    By default the plan is for a training stack (``target``, Transformer Engine: :mod:`numscope.plan.targets`)
    and chosen by the objective that tied the best heuristics in the plan study (``objective="sensitivity"``:
    each operand quantized alone on the trained FP32 model, on ``sensitivity_batches`` validation batches,
    its gradient error squared summed over the plan, GEMM roles weighed alike: the demo fits no gap model),
    within a bit budget. ``bit_budget`` None takes the budget **midway between the target's cheapest recipe
    and its uniform FP8** on this model (both with what the stack does not convert kept high): a rule fixed
    before any outcome was seen, so that the plan costs fewer bits than the stack's own 8-bit recipe by
    construction and its loss is what is tested. ``objective="noise"`` (with ``target=None``) is the
    earlier request: the advisor's limits and, with a budget, the least total noise.
    """

    bit_budget: float | None = None
    criteria: tuple[tuple[str, float | None], ...] = ()
    target: str | None = "te"
    objective: str = "sensitivity"
    sensitivity_batches: int = 2

    def __post_init__(self) -> None:
        if self.objective not in ("sensitivity", "noise"):
            raise ValueError(f"AdvisorRequest.objective {self.objective!r}: allowed: sensitivity, noise")
        if self.objective == "sensitivity" and self.target is None and self.bit_budget is None:
            raise ValueError("the sensitivity objective chooses within a bit budget: give one or a target")

    @property
    def measured(self) -> bool:
        """Whether the request needs the FP32 model's sensitivity (measured after the fp32 run)."""
        return self.objective == "sensitivity"

    @property
    def heuristic(self) -> bool:
        """Whether the demo trains the last-layers heuristic beside the plan: for a stack's target, whose
        recipe gives "high" and "low" a meaning (emulation's per-operand formats have no such rule)."""
        return self.measured and self.target not in (None, "emulation")

    def budget(self, analysis: Any = None) -> float | None:
        """The bit budget: the request's own, or midway between the target's cheapest recipe and its FP8
        recipe over the analysis's operands (see the class docstring)."""
        if self.bit_budget is not None or self.target is None or self.objective == "noise":
            return self.bit_budget
        low, fp8 = self.recipe_range(analysis)
        # never below the cheapest recipe (rounded up): where the two coincide (a model whose shapes leave
        # the stack one recipe) rounding to two decimals must not make the budget impossible
        return max(round((low + fp8) / 2, 2), math.ceil(low * 100) / 100)

    def recipe_range(self, analysis: Any) -> tuple[float, float]:
        """(the target's cheapest recipe everywhere, its FP8 recipe everywhere) in average bits."""
        from numscope.advisor.target import recipe_bits
        from numscope.plan.targets import get_target

        bits = recipe_bits(analysis, get_target(str(self.target)), analysis.candidates)
        if "fp8" not in bits:
            raise DemoError(f"target {self.target}: its FP8 recipe was not measured (candidates)")
        return min(bits.values()), bits["fp8"]

    def kwargs(self, analysis: Any = None, objective: Any = None) -> dict[str, Any]:
        """The advisor's keyword arguments; ``objective`` replaces the measured one (a heuristic's order)."""
        extra: dict[str, Any] = {"target": self.target} if self.target is not None else {}
        if self.objective == "noise":
            return {"bit_budget": self.bit_budget, **extra, **dict(self.criteria)}
        from numscope.advisor import sensitivity_objective

        if objective is None:
            if analysis is None or analysis.sensitivity is None:
                raise DemoError("the sensitivity objective needs the analysis's measured sensitivity")
            objective = sensitivity_objective(analysis.sensitivity)
        limits: dict[str, Any] = dict.fromkeys(_BASIC_LIMITS, None)  # the noise objective's guards: off
        limits.update(dict(self.criteria))
        return {"bit_budget": self.budget(analysis), "objective": objective, **extra, **limits}

    def rationale(
        self, example: str | None = None, default_bits: float | None = None, analysis: Any = None
    ) -> str:
        """How the plan was asked for and why, as a paragraph for the report (plain text), built from this
        request's own criteria. ``example``: a measured case of a format whose flushed values the backward
        error judges (shown where the underflow share is off and the backward-error limit on);
        ``default_bits``: the average bits under the advisor's default limits."""
        from numscope.advisor import Limits

        if self.measured:
            return (
                f"The advisor made a plan for {self.target} ({self.describe(analysis)}): each Linear module "
                "runs one of the stack's recipes, any of its GEMMs may stay high, and the budget goes where "
                "the measured gradient error is largest. The heuristic beside it (last-layers) is the same "
                "solver at the same budget, keeping the last layers high instead."
            )
        defaults, effective = Limits(), self.limits()
        limits = {name: getattr(effective, name) for name in self._shown()}
        if self.bit_budget is None:
            how = "gave each GEMM operand the cheapest candidate format that met every limit"
        else:
            how = (
                "chose, among the candidate formats that met every limit, the assignment with the least "
                f"total quantization noise within {self.bit_budget:g} average bits per element"
            )
        text = [
            f"The advisor read the FP32 run's analysis and {how} on every sampled step ({self.describe()})."
        ]
        errors = []
        if limits.get("max_be_ratio") is not None:
            errors.append(f"the GEMM's backward error at most {limits['max_be_ratio']:g}× bf16's")
        if limits.get("min_sqnr_db") is not None:
            errors.append(f"an SQNR of at least {limits['min_sqnr_db']:g} dB")
        text.append(f"It judged formats by their error: {' and '.join(errors) or 'no error limit was set'}.")
        for name, value in limits.items():
            default = getattr(defaults, name)
            if name not in ("max_underflow_pct", "max_overflow_pct") and value != default:
                shown = "off" if value is None else f"{value:g}"
                text.append(f"{name} is {shown}; the advisor's default is {_limit_text(default)}.")
        text.append(self._underflow_text(limits, defaults, example))
        text.append(self._overflow_text(limits, defaults))
        if default_bits is not None:
            text.append(f"Under the advisor's default limits the plan would average {default_bits:.2f} bits.")
        return " ".join(part for part in text if part)

    @staticmethod
    def _underflow_text(limits: dict[str, float | None], defaults: Any, example: str | None) -> str:
        value, default = (
            limits.get("max_underflow_pct", defaults.max_underflow_pct),
            defaults.max_underflow_pct,
        )
        if value == default:
            cited = f"; the backward error weighs flushed values by their size ({example})" if example else ""
            return f"The underflow share (values that become 0) is limited to {value:g}%, the default{cited}."
        if value is not None:
            return f"The underflow share (values that become 0) may reach {value:g}% instead of {default:g}%."
        if limits.get("max_be_ratio") is None:
            return "The underflow share (values that become 0) is not limited."
        return (
            "The underflow share, which counts flushed values whatever their size, is off: where flushed "
            "values matter the backward error sees them"
            + (f" ({example})" if example else "")
            + ", and where they lie many binades under the block's or tensor's maximum it does not."
        )

    @staticmethod
    def _overflow_text(limits: dict[str, float | None], defaults: Any) -> str:
        value, default = limits.get("max_overflow_pct", defaults.max_overflow_pct), defaults.max_overflow_pct
        if value is None:
            return "The overflow share (values that saturate) is not limited."
        if value == default:
            return f"The overflow share (values that saturate) is limited to {value:g}%, the default."
        if value < default:
            return (
                f"The overflow share (values that saturate) is limited to {value:g}% instead of {default:g}%."
            )
        return (
            f"The overflow share may reach {value:g}% instead of {default:g}%: in MX formats it counts the "
            "OCP scale rule clamping the top of each block's largest binade, an error of at most 25% of the "
            "value for E2M1, 12.5% for E3M2 and 6.25% for E2M3 that SQNR and the backward error already "
            "count, while saturation beyond that share stays rejected."
        )

    def limits(self) -> Any:
        """The advisor's :class:`~numscope.advisor.Limits` under this request (its defaults where the
        request sets nothing)."""
        from numscope.advisor import Limits

        return Limits().replace(dict(self.criteria), " (AdvisorRequest)")

    def _shown(self) -> list[str]:
        """The limits a reader is told of: the four count and error limits, and any other the request sets."""
        basic = ["max_be_ratio", "max_underflow_pct", "max_overflow_pct", "min_sqnr_db"]
        return basic + [name for name, _ in self.criteria if name not in basic]

    def describe(self, analysis: Any = None) -> str:
        if self.measured:
            budget = self.budget(analysis) if analysis is not None else self.bit_budget
            rule = (
                f"at most {budget:g} bits per element"
                if budget is not None
                else "a budget midway between the target's cheapest recipe and its FP8"
            )
            if self.bit_budget is None and analysis is not None:
                low, fp8 = self.recipe_range(analysis)
                rule += f" (midway between {low:.2f}, its cheapest recipe everywhere, and {fp8:.2f}, its FP8)"
            return (
                f"target {self.target}; objective: measured sensitivity (each operand's gradient error when "
                f"quantized alone, {self.sensitivity_batches} validation batches, GEMM roles weighed alike); "
                f"{rule}; limits off"
            )
        effective = self.limits()
        limits = ", ".join(f"{name} {_limit_text(getattr(effective, name))}" for name in self._shown())
        budget = "no bit cap" if self.bit_budget is None else f"at most {self.bit_budget:g} bits per element"
        return f"{limits}; {budget}" + (f"; target {self.target}" if self.target else "")


_BASIC_LIMITS = ("max_be_ratio", "max_underflow_pct", "max_overflow_pct", "min_sqnr_db")


def _limit_text(value: float | None) -> str:
    return "off" if value is None else f"{value:g}"


@dataclass(frozen=True)
class DemoConfig(Experiment):
    """Everything that sizes the demo: the experiment (:class:`numscope.run.experiment.Experiment`, whose
    defaults are the demo's, with the measurements behind them) and how the demo runs it. ``quick()`` keeps
    every stage with fewer steps.

    fast: runs whose plan uses block formats (MX, NVFP4) may compile with ``torch.compile`` what the
        native quantizers do not cover (``convert``'s ``compiled``; bit-identical to the eager reference);
        every run quantizes through the native quantizers where they cover an operand, whatever this says
        (``NUMSCOPE_NATIVE=0`` turns them off). ``python benchmarks/bench_train_step.py`` measures the paths
        on your machine.
    noise_seeds: the FP32 run is trained again from these seeds (other initialisation, batch order and
        evaluation masks): the standard deviation of FP32's validation loss over all its seeds is the seed
        noise every claim is measured against (a difference counts only beyond twice it). The recommended
        plan is trained from them too (``recommended-seedN``), so that its claim compares it with FP32
        seed by seed (paired: the same initialisation, batches and masks on both sides).
    threads: torch's intra-op threads while the demo runs (None leaves torch's setting). One by default:
        when other processes compete for the cores, threads waiting for each other spin and steps slow
        down; on an idle machine more threads are faster. ``bench_train_step.py --threads N`` measures both.
    jobs: runs trained at once, each in its own process (:class:`numscope.run.pool.RunPool`); None gives
        one per ``threads`` free cores. A run's result does not depend on it (tested bit for bit); 1 trains
        every run in this process, one after the other.
    """

    advisor: AdvisorRequest = field(default_factory=AdvisorRequest)
    fast: bool = True
    threads: int | None = 1
    noise_seeds: tuple[int, ...] = (1, 2)
    jobs: int | None = None

    @classmethod
    def quick(cls) -> DemoConfig:
        # the defaults' training (batch, learning rate, masking) in fewer steps
        train = replace(cls().train, steps=40, warmup_steps=4, eval_every=20, checkpoint_every=20)
        return cls(
            train=train,
            observe_every=10,
            fast=False,
        )


BASELINES: tuple[RunSpec, ...] = (
    RunSpec("bf16", "bf16", description="every GEMM operand in bf16"),
    RunSpec("fp16+scaling", "fp16", "dynamic", description="fp16 with dynamic loss scaling (init 2^16)"),
    RunSpec(
        "e5m2-grads",
        "e5m2_grads",
        description="every GEMM's gradient in FP8 E5M2, no scale of its own, the rest FP32; no loss scaling",
    ),
    RunSpec(
        "e5m2-grads+scaling",
        "e5m2_grads",
        "dynamic",
        description="the same with dynamic loss scaling (init 2^16)",
    ),
    RunSpec("fp8", "fp8", description="TE hybrid: E4M3 forward, E5M2 gradients, per-tensor scaling"),
    RunSpec(
        "mxfp8", "mxfp8", description="every GEMM operand in MXFP8: 32 × E4M3, E8M0 scale, gradients too"
    ),
    RunSpec("int8", "int8", description="every GEMM operand in int8 (±127), per-tensor current scaling"),
    RunSpec("mxfp4", "mxfp4", description="every GEMM operand in MXFP4: 32 × E2M1, E8M0 scale"),
)
RECOMMENDED_DESCRIPTION = "numscope's plan from the fp32 analysis (plan.yaml)"
MODEL_FILE = "model.pt"
"""Each run's final parameters, in its folder: ``numscope.load_checkpoint(path)["model"]`` is the state dict
of a ``transformers.BertForMaskedLM`` (the plan that trained it is ``plan.yaml`` beside it)."""


def prepare_demo_data(
    config: DemoConfig,
    text_paths: Sequence[Path] | None = None,
    cache_dir: Path | None = None,
    progress: bool = False,
) -> RunData:
    """Corpus → train/validation split → WordPiece tokenizer (cached) → token blocks (cached)."""
    return config.data(text_paths, cache_dir, progress)


def model_config(config: DemoConfig, data: RunData) -> ModelConfig:
    return config.model_config(data)


training_observer = experiment_observer


def run_demo(
    out_dir: Path,
    config: DemoConfig,
    text_paths: Sequence[Path] | None = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every stage into ``out_dir``; returns the summary that ``summary.json`` holds."""
    was_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _run_demo(out_dir, config, text_paths, log, progress)
    finally:
        torch.set_num_threads(was_threads)


class DemoError(NumscopeError, ValueError):
    """A demo that cannot run as asked (e.g. its folder holds runs made with other settings)."""


SETTINGS_FILE = "demo.json"
# settings that do not change what the runs compute (noise_seeds only adds runs of their own)
_RESULT_NEUTRAL = ("threads", "jobs", "fast", "noise_seeds")


def _check_settings(out_dir: Path, config: DemoConfig, text_paths: Sequence[Path] | None) -> None:
    """Refuse to resume in a folder whose finished runs were made with other settings (their results would
    be reused as if they were this configuration's); record the settings of a new folder."""
    settings = {k: v for k, v in asdict(config).items() if k not in _RESULT_NEUTRAL}
    settings["text"] = [str(Path(p).resolve()) for p in text_paths] if text_paths else None
    settings = json.loads(json.dumps(settings))  # tuples as lists, as stored
    stored = read_settings(out_dir / SETTINGS_FILE)
    if stored is not None:
        changes = setting_changes(stored, settings)
        if changes:
            raise DemoError(
                f"{out_dir} holds demo runs made with other settings ({'; '.join(changes[:3])}); "
                "resume with the same flags, or choose another `out`"
            )
        return
    if any(out_dir.glob("runs/*/result.json")):
        raise DemoError(
            f"{out_dir} holds demo runs but no {SETTINGS_FILE} to tell which settings made them; "
            "choose another `out`"
        )
    atomic_write_text(out_dir / SETTINGS_FILE, json.dumps(settings, indent=1))


def _run_demo(
    out_dir: Path,
    config: DemoConfig,
    text_paths: Sequence[Path] | None,
    log: Callable[[str], None],
    progress: bool,
) -> dict[str, Any]:
    from numscope.advisor import advise
    from numscope.analysis import Analysis

    out_dir.mkdir(parents=True, exist_ok=True)
    _check_settings(out_dir, config, text_paths)
    data = prepare_demo_data(config, text_paths, progress=progress)
    if data.train_blocks.shape[0] < config.train.batch_size:
        raise DemoError(
            f"the text makes {data.train_blocks.shape[0]} training blocks of {config.seq_len} tokens, fewer "
            f"than one batch of {config.train.batch_size}: give more text"
        )
    # the loss of a context-free model on the evaluation's masked tokens (fails now, not after training,
    # when the validation text holds no masked token)
    unigram = unigram_loss(data.train_blocks, data.val_blocks, data.tokenizer, config.train.seed)
    mcfg = model_config(config, data)
    # the model's transformers config beside the runs: `numscope export plan.yaml --model OUT` reads it
    mcfg.to_bert_config().to_json_file(out_dir / "config.json")
    log(
        f"[data] {data.train_blocks.shape[0]} training and {data.val_blocks.shape[0]} validation blocks of "
        f"{config.seq_len} tokens; BERT {config.layers}×{config.hidden} (FFN {config.intermediate}), "
        f"{config.train.steps} steps of {config.train.batch_size} blocks per run"
    )
    results: dict[str, RunResult] = {}
    plan_path = out_dir / "plan.yaml"
    jobs = config.jobs if config.jobs is not None else default_jobs(config.threads)
    bars: dict[str, Any] = {}

    def start(name: str) -> None:
        bars[name] = progress_bar(total=config.train.steps, desc=f"{name:>13}", enabled=progress)

    def step(name: str, at: int, loss: float) -> None:
        bar = bars.get(name)
        if bar is not None:  # a worker's last report may arrive after its run ended
            bar.n = at
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.refresh()

    def end(name: str) -> None:
        bar = bars.pop(name, None)
        if bar is not None:
            bar.close()

    def queue(pool: RunPool, spec: RunSpec, observed: bool = False, seed: int | None = None) -> None:
        # torch.compile pays for its compilation only on block formats the native quantizers leave to it
        compiled = config.fast and not observed and spec.load_plan().uses_block_formats()
        train, model = config.train, mcfg
        if seed is not None:
            train, model = replace(config.train, seed=seed), replace(mcfg, seed=seed)
        pool.add(
            spec.name,
            first=spec.name == RECOMMENDED,  # the run the demo is about starts as soon as it can
            spec=spec,
            model_config=model,
            cfg=train,
            out_dir=out_dir / "runs" / spec.name,
            observer_factory=partial(training_observer, config=config) if observed else None,
            save_model=True,
            compiled=compiled,
            replace_changed=True,  # e.g. the recommended plan of another numscope version: train it again
        )

    analysis, recommendation, default_bits = None, None, None
    with RunPool(data, jobs, config.threads, on_start=start, on_step=step, on_end=end) as pool:
        queue(pool, REFERENCE, observed=True)
        for spec in BASELINES:
            queue(pool, spec)
        for seed in config.noise_seeds:
            queue(pool, noise_spec(seed), seed=seed)
        try:
            while pool:
                name, result = pool.next_finished()
                results[name] = result
                if not (out_dir / "runs" / name / MODEL_FILE).is_file():  # an earlier demo kept no models
                    log(
                        f"[{name}] finished without {MODEL_FILE} (an earlier demo did not keep models); "
                        f"delete {out_dir / 'runs' / name} to train it again with its model"
                    )
                if name != REFERENCE.name:
                    continue
                analysis_dir = out_dir / "runs" / REFERENCE.name / "analysis"
                analysis = Analysis.load(analysis_dir)
                if config.advisor.measured and analysis.sensitivity is None:
                    analysis.sensitivity = demo_sensitivity(
                        out_dir, config, data, mcfg, analysis, log, progress
                    )
                # deterministic: what plan.yaml holds
                recommendation = advise(analysis, **config.advisor.kwargs(analysis))
                if not plan_path.exists():
                    recommendation.plan.save(plan_path)
                    log(
                        f"[plan] {recommendation.average_bits:.2f} average bits per operand element "
                        f"({config.advisor.describe(analysis)})"
                    )
                # the default limits' bits, said only where the demo's request departs from them
                departs = bool(config.advisor.criteria) or config.advisor.bit_budget is not None
                if not config.advisor.measured:
                    default_bits = _default_limits_bits(analysis) if departs else None
                recommended = RunSpec(RECOMMENDED, str(plan_path), description=RECOMMENDED_DESCRIPTION)
                queue(pool, recommended)
                for seed in config.noise_seeds:  # paired with fp32-seedN: the plan's own seed-to-seed test
                    queue(pool, recommended_seed_spec(seed, str(plan_path)), seed=seed)
                if config.advisor.heuristic:  # the best heuristic of the plan study, at the same budget
                    heuristic_path = out_dir / HEURISTIC_PLAN
                    if not heuristic_path.exists():
                        heuristic_plan(analysis, config.advisor).plan.save(heuristic_path)
                    queue(pool, heuristic_spec(None, str(heuristic_path)))
                    for seed in config.noise_seeds:
                        queue(pool, heuristic_spec(seed, str(heuristic_path)), seed=seed)
        finally:
            for name in list(bars):
                end(name)
    heuristic = [HEURISTIC] if config.advisor.heuristic else []
    order = [REFERENCE.name, RECOMMENDED, *heuristic, *(spec.name for spec in BASELINES)]
    order += [noise_spec(seed).name for seed in config.noise_seeds]
    order += [recommended_seed_spec(seed).name for seed in config.noise_seeds]
    order += [heuristic_spec(seed).name for seed in config.noise_seeds if heuristic]
    results = {name: results[name] for name in order}  # the table's order, whichever finished first
    assert analysis is not None  # loaded when the fp32 run finished

    sizes = analysis.operand_sizes()
    rows = []
    for result in results.values():
        row = result.to_dict()
        # every run weighted by the fp32 analysis's operand sizes, as the [plan] line (a run's own figure
        # weighs its first batch: a masked-only head's operands change size with each batch's masks)
        row["avg_bits"] = RunSpec(result.name, result.plan).load_plan().average_bits(sizes)
        row["train_log"] = read_log(out_dir / "runs" / result.name / "log.csv")
        model = out_dir / "runs" / result.name / MODEL_FILE
        row["model"] = str(model) if model.is_file() else None
        rows.append(row)
    scaled = next(r for r in rows if r["name"] == "fp16+scaling")
    underflow = fp16_underflow_by_site(analysis, scaled["final_scale"])
    scaled["underflow"] = underflow
    scaled["underflow_scale"] = scaled["final_scale"]
    scaled["underflow_source"] = (
        "per site, the share of nonzero grad_output values (the gradient flowing into the GEMM's output) "
        f"that fp16 rounds to zero (below 2^{_flush_binade()}), unscaled and multiplied by the run's "
        "final loss scale; "
        "read from the FP32 run's log2 histograms of those tensors, all sampled steps together"
    )
    noise = fp32_seed_noise(rows)
    e5m2 = next(r for r in rows if r["name"] == E5M2_SCALED)
    e5m2_underflow = fp16_underflow_by_site(analysis, e5m2["final_scale"], "fp8_e5m2")
    target_fp8 = None  # the bar for the plan's bits: the stack's own uniform FP8 (emulation has none)
    if config.advisor.measured and config.advisor.target not in (None, "emulation"):
        target_fp8 = (config.advisor.target, config.advisor.recipe_range(analysis)[1])
    claims = _claims(rows, underflow, unigram, default_bits, noise, e5m2_underflow, target_fp8)

    from numscope.report import write_report

    report = write_report(
        out_dir / "report.html",
        title="numscope demo: BERT masked LM",
        runs=rows,
        analysis=analysis,
        plan=Plan.load(plan_path),
        notes=claims,
        command="numscope demo",
        context_free_loss=unigram,
        setup=_setup(config, data),
        plan_intro=html.escape(
            config.advisor.rationale(_flush_example(recommendation, analysis), default_bits, analysis)
        ),
        progress=progress,
    )
    summary = {
        "runs": rows,
        "unigram_loss": unigram,
        "fp32_seed_sd": noise,
        "default_limits_avg_bits": default_bits,
        "claims": [{"text": text, "held": held} for text, held in claims],
        "config": _setup(config, data),
        "out_dir": str(out_dir),
        "report": str(report),
    }
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=1, default=str))
    return summary


HEURISTIC_PLAN = "last_layers.yaml"


def heuristic_plan(analysis: Any, request: AdvisorRequest) -> Any:
    """The plan study's best heuristic, "keep the last layers high" (the NVFP4 recipe's rule: its format
    everywhere else, so the target's cheapest recipe), for the request's target and budget: the same solver
    as the recommended plan, its objective the layers' call order instead of the measured sensitivity
    (:func:`numscope.study.plans.order_objective`)."""
    from numscope.advisor import advise
    from numscope.advisor.target import recipe_bits
    from numscope.plan.targets import get_target
    from numscope.study.operands import Operands
    from numscope.study.plans import order_last_layers, order_objective

    objective = order_objective(order_last_layers(Operands.from_analysis(analysis)))
    kwargs = request.kwargs(analysis, objective=objective)
    if request.target is not None and request.target != "emulation":  # the recipe's rule: its own format
        bits = recipe_bits(analysis, get_target(request.target), analysis.candidates)
        cheapest = next(r for r in get_target(request.target).recipes if r.name == min(bits, key=bits.get))
        kwargs["candidates"] = list(cheapest.measured)
    return advise(analysis, **kwargs, objective_name="last-layers order (2^-position)")


def heuristic_spec(seed: int | None, plan: str = HEURISTIC_PLAN) -> RunSpec:
    """The heuristic's run (``last-layers``), or its run from another seed, paired with ``fp32-seedN``."""
    if seed is None:
        return RunSpec(HEURISTIC, plan, description="keep the last layers high, at the plan's budget")
    return RunSpec(seed_run_name(HEURISTIC, seed), plan, description=f"the last-layers plan from seed {seed}")


def demo_sensitivity(
    out_dir: Path,
    config: DemoConfig,
    data: RunData,
    mcfg: ModelConfig,
    analysis: Any,
    log: Callable,
    progress: bool = False,
) -> Any:
    """The trained FP32 model's operand sensitivity (:func:`numscope.run.runner.measure_sensitivity`):
    every operand of every site the request's target converts, quantized alone in each of the target's
    measured formats, on the first validation batches; stored in the fp32 run's analysis."""
    import time

    from numscope._names import exact_pattern
    from numscope.advisor.target import site_kinds
    from numscope.plan.targets import LINEAR_KINDS, get_target
    from numscope.run.model import bert_mlm_from_config
    from numscope.run.runner import measure_sensitivity as measure

    request = config.advisor
    kinds = site_kinds(analysis)
    formats = list(analysis.candidates)
    sites = list(kinds)
    if request.target is not None:
        target = get_target(request.target)
        if not target.is_emulation:
            wanted = {f for recipe in target.recipes for f in recipe.measured}
            formats = [f for f in analysis.candidates if f in wanted]
            sites = [name for name, kind in kinds.items() if kind in LINEAR_KINDS]
    run_dir = out_dir / "runs" / REFERENCE.name
    if not (run_dir / MODEL_FILE).is_file():
        raise DemoError(
            f"{run_dir / MODEL_FILE} is missing (the fp32 run of an earlier demo kept no model), so its "
            f"sensitivity cannot be measured: delete {run_dir} to train it again, or choose another `out`"
        )
    count = request.sensitivity_batches
    log(
        f"[sensitivity] {len(sites)} sites × 6 operands × {len(formats)} formats ({', '.join(formats)}) on "
        f"{count} validation batches: {count * (1 + 6 * len(sites) * len(formats))} forward and backward "
        "passes"
    )
    start = time.perf_counter()
    measured = measure(
        run_dir,
        partial(bert_mlm_from_config, mcfg),
        data,
        config.train,
        "mlm",
        formats,
        count,
        granularity="operand",
        progress=progress,
        sites=[exact_pattern(name) for name in sites],
    )
    log(f"[sensitivity] done in {time.perf_counter() - start:.0f}s")
    return measured.sensitivity


def noise_spec(seed: int) -> RunSpec:
    return RunSpec(
        seed_run_name(REFERENCE.name, seed),
        "fp32",
        description=f"fp32 again from seed {seed}: the seed noise",
    )


def recommended_seed_spec(seed: int, plan: str = "plan.yaml") -> RunSpec:
    return RunSpec(
        seed_run_name(RECOMMENDED, seed),
        plan,
        description=f"the recommended plan from seed {seed}: paired with fp32-seed{seed}",
    )


def fp32_seed_noise(rows: Sequence[dict[str, Any]]) -> float | None:
    """The standard deviation (nats) of FP32's validation loss over its seeds (the main run and the noise
    runs); None with fewer than two."""
    losses = [r["val_loss"] for r in rows if r["name"] == REFERENCE.name or r["name"].startswith("fp32-seed")]
    return statistics.stdev(losses) if len(losses) >= 2 else None


def quick_config(steps: int | None = None) -> DemoConfig:
    config = DemoConfig.quick()
    if steps is not None:
        config = replace(config, train=replace(config.train, steps=steps))
    return config


def _flush_example(recommendation: Any, analysis: Any, fmt: str = "fp16") -> str | None:
    """The gradient operand ``fmt`` flushes most of, with its backward error over the reference's as the
    advisor measured it, and whether the backward-error limit rejected ``fmt`` there. Operands where it
    did are preferred; None when ``fmt`` was not judged by a backward-error limit."""
    cases = []
    for choice in recommendation.choices:
        checks = choice.checks.get(fmt, ())
        limit = next((check for check in checks if check.metric == "max_be_ratio"), None)
        if choice.operand != Operand.GRAD_OUTPUT or limit is None:
            continue
        share = max(analysis.metric_values(choice.key, fmt, "underflow%"))
        cases.append((not limit.passed, share, choice, limit))
    if not cases:
        return None
    rejected, share, choice, limit = max(cases, key=lambda case: (case[0], case[1]))
    verdict = (
        f"over the limit of {limit.limit:g}×: rejected"
        if rejected
        else f"within the limit of {limit.limit:g}×"
    )
    return (
        f"{fmt} flushes up to {share:.1f}% of the {choice.gemm} grad_output of {choice.site}, and its "
        f"backward error there reaches {limit.value:.3g}× {recommendation.reference}'s, {verdict}"
    )


def _default_limits_bits(analysis: Any) -> float | None:
    """The average bits of the plan the advisor gives under its own default limits (None if it cannot)."""
    from numscope.advisor import AdvisorError, advise

    try:
        return advise(analysis).average_bits
    except AdvisorError:
        return None


def _flush_binade(fmt: str = "fp16") -> int:
    """log2 of half ``fmt``'s smallest subnormal: nearest rounding sends smaller magnitudes and ties to 0."""
    from numscope.formats.spec import get_format

    return round(math.log2(get_format(fmt).min_subnormal / 2))


def fp16_underflow_by_site(analysis: Any, loss_scale: float, fmt: str = "fp16") -> list[dict[str, Any]]:
    """Per site, the share (%) of nonzero ``grad_output`` values (the gradient flowing into the site's
    output) that fp16 (or ``fmt``, unscaled) flushes to zero: without loss scaling (``before%``) and
    multiplied by ``loss_scale`` first (``after%``), both from the FP32 run's log2 histograms (all sampled
    steps together). A value flushes when it lies below half the format's smallest subnormal (fp16: 2^-25),
    i.e. in a lower binade (that power of two itself, a tie, also rounds to 0 and is counted as kept: the
    estimate is low by at most that one binade's lowest value)."""
    shift = math.log2(loss_scale) if loss_scale > 0 else 0.0
    flush = _flush_binade(fmt)
    rows = []
    for site in analysis.sites():
        key = (site, Gemm.WGRAD, Operand.GRAD_OUTPUT)
        histogram = analysis.histograms.get(key)
        if histogram is None:
            continue
        nonzero = sum(histogram.counts) + histogram.below + histogram.above
        if nonzero == 0:
            continue

        def lost(threshold: float, histogram: Any = histogram) -> int:
            return histogram.below + sum(
                count
                for exponent, count in zip(histogram.exponents, histogram.counts, strict=True)
                if exponent < threshold
            )

        rows.append(
            {
                "site": site,
                "before%": 100.0 * lost(flush) / nonzero,
                "after%": 100.0 * lost(flush - shift) / nonzero,
            }
        )
    return rows


def _setup(config: DemoConfig, data: RunData) -> dict[str, Any]:
    heuristic = config.advisor.heuristic
    specs = (
        REFERENCE,
        RunSpec(RECOMMENDED, "plan.yaml", description=RECOMMENDED_DESCRIPTION),
        *((heuristic_spec(None),) if heuristic else ()),
        *BASELINES,
        *(noise_spec(seed) for seed in config.noise_seeds),
        *(recommended_seed_spec(seed) for seed in config.noise_seeds),
        *(heuristic_spec(seed) for seed in config.noise_seeds if heuristic),
    )
    return {
        "model": f"BertForMaskedLM, {config.layers} layers, hidden {config.hidden}, {config.heads} heads, "
        f"FFN {config.intermediate}, dropout {config.dropout:g}, vocabulary {data.tokenizer.vocab_size}",
        "data": f"{data.train_blocks.shape[0]} training / {data.val_blocks.shape[0]} validation blocks of "
        f"{config.seq_len} tokens, {config.train.mask_probability:.0%} masked in training, 15% in evaluation "
        "(80/10/10)",
        "training": f"{config.train.steps} steps × {config.train.batch_size} blocks, AdamW lr "
        f"{config.train.lr:g} (warm-up {config.train.warmup_steps}, cosine to 10%), clip "
        f"{config.train.grad_clip:g}, seed {config.train.seed}",
        "observer": f"every {config.observe_every} steps of the fp32 run; candidates "
        f"{', '.join(config.candidates)}",
        "advisor": config.advisor.describe(),
        "runs": "; ".join(f"{spec.name}: {spec.description}" for spec in specs),
        "outputs": f"runs/NAME/ per run: log.csv (every step), plan.yaml, result.json and {MODEL_FILE}, the "
        'final model (numscope.load_checkpoint(path)["model"], a BertForMaskedLM state dict); fp32 also '
        "analysis/; plan.yaml, summary.json and report.html beside runs/",
    }
