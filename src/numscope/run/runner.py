"""One training run into its folder: :func:`analyze` (FP32, every GEMM operand observed) and :func:`train`
(under a plan), the functions behind ``numscope analyze`` and ``numscope train``.

**Run folders.** Each call writes one folder: ``run.json`` (the settings), ``plan.yaml``, ``log.csv`` (one
row per step), ``checkpoint.pt`` while running (atomic; a rerun with the same settings resumes from it),
``result.json`` when finished (a finished run is not repeated), ``analysis/`` (analyze) and ``model.pt``
(train: the trained parameters). Under ``torchrun`` with more than one process both run data-parallel (DDP
over gloo on CPU) and only rank 0 writes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from numscope import __version__, distributed
from numscope._atomic import atomic_write_text
from numscope._device import backend_for, model_device, resolve_device, to_device
from numscope._names import exact_pattern
from numscope._progress import progress as progress_bar
from numscope._rng import fork_rng
from numscope.analysis import Analysis
from numscope.convert import convert
from numscope.errors import SettingsError
from numscope.formats.spec import get_format
from numscope.observe import DEFAULT_CANDIDATES as OBSERVED_BY_DEFAULT
from numscope.plan import Plan
from numscope.run.config import (
    LOSS_SCALING,
    RunData,
    RunResult,
    RunSpec,
    SensitivitySettings,
    TrainConfig,
)
from numscope.run.folders import check_output_folder, check_run_settings, finished_result, stored_run_name
from numscope.run.loop import train_run
from numscope.run.objectives import get_objective
from numscope.run.sources import (
    DataSettings,
    WorkflowError,
    Workload,
    check_interface,
    check_positive,
    check_train_config,
    corpus_digest,
    first_line,
    model_path,
    resolve_model,
    resolve_workload,
    run_model,
)
from numscope.sites import sites as list_sites
from numscope.train.adaptive import AdaptiveConfig
from numscope.train.checkpoint import save_checkpoint

__all__ = [
    "DEFAULT_CANDIDATES",
    "REFERENCE_FORMAT",
    "analyze",
    "evaluate",
    "plan_and_source",
    "prepare",
    "train",
]


DEFAULT_CANDIDATES: tuple[str, ...] = OBSERVED_BY_DEFAULT
"""Formats ``analyze`` measures by default: :data:`numscope.observe.DEFAULT_CANDIDATES`."""

REFERENCE_FORMAT = "bf16"
"""The advisor's reference format, always measured."""


def _prepare_run(
    work: Workload, config: TrainConfig, plan: Plan
) -> tuple[RunData, Callable[[], nn.Module], str]:
    """Data, the model factory (its models on ``config.device``) and objective, after one probing forward
    that checks model and plan."""
    model = work.model
    if work.source is None:
        resolve_model(model, work.objective)  # raises what kept it from resolving
    prepared = work.prepared()
    check_train_config(config, prepared)
    built, resolved = work.build()
    device = resolve_device(config.device, field="TrainConfig.device")

    def factory() -> nn.Module:
        return built().to(device)

    if resolved == "mlm" and prepared.tokenizer.mask_id is None:
        raise WorkflowError(
            f"`model` {model}: the tokenizer has no mask token, which the masked LM needs; train it as a "
            "causal LM (`objective` clm) or give a tokenizer with one"
        )
    try:
        objective_for_training = get_objective(resolved).for_training(config.mask_probability)
    except ValueError as error:
        raise WorkflowError(f"`mask_probability`: {error}") from None
    example = to_device(
        next(
            objective_for_training.batches(prepared.train_blocks[:2], 2, prepared.tokenizer, config.seed, 0)
        ),
        device,
    )
    with fork_rng():
        probe = factory()
        if work.source is not None and work.source.factory is not None:
            check_interface(model, probe, example)
        convert(probe, plan, example_inputs={k: v for k, v in example.items() if k != "labels"})
    return prepared, factory, resolved


def prepare(
    model: str | Workload, data: DataSettings | None, config: TrainConfig, objective: str = "auto"
) -> tuple[RunData, Callable[[], nn.Module], str]:
    """What a run on ``model`` trains with, checked as :func:`train` checks it: the data (with the
    tokenizer a checkpoint folder brings), a factory of the model and the objective resolved. ``model``:
    a spec with its ``data``, or a :class:`Workload` (``data`` None) resolved once for several runs."""
    work = resolve_workload(model, data, objective)
    return _prepare_run(work, config, Plan.uniform("fp32"))


def _settings(kind: str, work: Workload, config: TrainConfig, **extra: Any) -> dict:
    model, objective, data = work.model, work.objective, work.data
    return {
        "numscope": __version__,
        "kind": kind,
        "model": model,
        **({"model_path": path} if (path := model_path(model)) is not None else {}),
        "objective": objective,
        "text": [str(Path(p).resolve()) for p in data.text],
        "corpus_sha256": work.digest(),
        "data": {"vocab_size": data.vocab_size, "seq_len": data.seq_len, "val_blocks": data.val_blocks}
        | ({"tokenizer_sha256": _file_digest(data.tokenizer)} if data.tokenizer else {})
        | ({"train_tokenizer": True} if data.train_tokenizer else {}),
        **({"tokenizer_path": str(Path(data.tokenizer).resolve())} if data.tokenizer else {}),
        # where and how many processes train it: recorded, not compared (a run resumes anywhere)
        "train": {key: value for key, value in asdict(config).items() if key not in ("device", "parallel")},
        **extra,
        "world_size": distributed.world_size(),
        "device": config.device,
        "parallel": config.parallel,
    }


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _progress(
    total: int, name: str, enabled: bool
) -> tuple[Callable[[int, float], None], Callable[[], None]]:
    bar = progress_bar(total=total, desc=name, enabled=enabled)

    def on_step(step: int, loss: float) -> None:
        bar.n = step
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        bar.refresh()

    return on_step, bar.close


DEFAULT_SENSITIVITY = SensitivitySettings()
"""``analyze``'s sensitivity settings by default (``numscope analyze`` without ``--sensitivity*`` flags)."""


def analyze(
    model: str | Workload,
    data: DataSettings | None,
    out: str | os.PathLike[str],
    *,
    config: TrainConfig | None = None,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    every: int = 25,
    objective: str = "auto",
    progress: bool = False,
    tensorboard: str | os.PathLike[str] | None = None,
    sensitivity: SensitivitySettings = DEFAULT_SENSITIVITY,
    keep_optimizer: bool = False,
) -> RunResult:
    """Train ``model`` in FP32 on ``data`` and observe every GEMM operand every ``every`` steps.

    Writes the run folder ``out`` (run name ``fp32``) with ``out/analysis``, from which
    :func:`recommend_plan` recommends a plan. ``bf16`` (the advisor's reference) is always measured.
    ``tensorboard``: also write the analysis there as TensorBoard scalars (needs ``tensorboard``).
    The defaults are ``numscope analyze``'s (a test holds them equal): the same experiment from Python and
    from the command line.
    ``sensitivity``: how the sensitivity is measured after training (:class:`SensitivitySettings`; its
    ``batches`` > 0, by default :data:`AUTO_SENSITIVITY_BATCHES` in one process): each operand's (or site's)
    effect on the loss and gradient of the trained model in the candidates on that many validation batches
    (:func:`numscope.sensitivity`), stored with the analysis for ``recommend``'s sensitivity objective and
    its ``max_loss_increase_pct`` / ``min_grad_cosine``; the trained model is kept as ``out/model.pt``. One
    process only. An early step (``sensitivity.early``) keeps that model too (``out/model_early.pt``) and
    measures it as well; docs/results/plan-study.md says what it changed.
    ``keep_optimizer``: keep the trained model and the optimizer's final state in ``out/model.pt`` (what
    the forecast weighs gradient errors with).
    Under ``torchrun`` with ``WORLD_SIZE`` > 1 it trains with DDP over gloo, as :func:`train`; the observer
    merges each sampled step across the ranks (:mod:`numscope.distributed`), and rank 0 writes.
    """
    from numscope.observe import observe

    if not isinstance(sensitivity, SensitivitySettings):
        raise SettingsError(
            "analyze(sensitivity=)",
            f"a numscope.run.SensitivitySettings (e.g. SensitivitySettings(batches=2)); got {sensitivity!r}",
        )
    config = config if config is not None else TrainConfig()
    work = resolve_workload(model, data, objective)
    if tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise WorkflowError("`tensorboard` needs the tensorboard package: pip install tensorboard")
    check_positive("`every`", every)
    names = list(dict.fromkeys([REFERENCE_FORMAT, *candidates]))
    for name in names:
        try:
            get_format(name)
        except ValueError as error:
            raise WorkflowError(f"`candidates`: {error}") from error
    auto = sensitivity.batches is None
    sensitivity_batches = sensitivity.batches
    if sensitivity_batches is None:
        sensitivity_batches = AUTO_SENSITIVITY_BATCHES if _env_world_size() <= 1 else 0
    if sensitivity_batches and _env_world_size() > 1:
        raise SettingsError(
            "SensitivitySettings.batches", "the sensitivity runs in one process; analyze without torchrun"
        )
    measured_formats = _sensitivity_formats(sensitivity.formats, names)
    sensitivity_granularity, sensitivity_method = sensitivity.granularity, sensitivity.resolved_method
    sensitivity_early = sensitivity.early
    if sensitivity_early == "auto":
        long_enough = config.steps >= AUTO_EARLY_MIN_STEPS
        sensitivity_early = AUTO_SENSITIVITY_EARLY if sensitivity_batches and long_enough else None
    if sensitivity_early is not None:
        if not sensitivity_batches:
            raise SettingsError(
                "SensitivitySettings.early",
                "it measures the sensitivity: it needs SensitivitySettings.batches >= 1",
            )
        if not 1 <= sensitivity_early < config.steps:  # type: ignore[operator]
            raise SettingsError(
                "SensitivitySettings.early",
                f"{sensitivity_early}: a step from 1 to {config.steps - 1} (TrainConfig.steps "
                f"{config.steps}): the model after that many steps is measured beside the trained one",
            )
    out_dir = check_output_folder(out)
    with _process_group(config):
        extra: dict[str, Any] = (
            {"sensitivity_batches": "auto" if auto else sensitivity_batches} if sensitivity_batches else {}
        )
        if sensitivity_early is not None:
            extra["sensitivity_early"] = sensitivity_early
        if sensitivity_batches and sensitivity_granularity != "site":
            extra["sensitivity_granularity"] = sensitivity_granularity
        if sensitivity_batches and measured_formats != names:
            extra["sensitivity_formats"] = measured_formats
        if sensitivity_batches and sensitivity_method != "one_at_a_time":
            extra["sensitivity_method"] = sensitivity_method
        settings = _settings("analyze", work, config, candidates=names, every=every, plan="fp32", **extra)
        check_run_settings(out_dir, settings)
        writer = distributed.is_rank_zero()
        result = finished_result(out_dir)
        # a finished run is not trained again, but an earlier call may have stopped before its sensitivity
        if result is None or sensitivity_batches:
            prepared, factory, resolved = _prepare_run(work, config, Plan.uniform("fp32"))
            if auto:  # as many of the default's batches as the validation split holds
                available = len(_validation_split(prepared, config, resolved))
                sensitivity_batches = min(sensitivity_batches, available)
        if result is None:
            settings["objective_resolved"] = resolved
            settings["vocab_size_built"] = prepared.tokenizer.vocab_size  # a small corpus may give fewer
            if sensitivity_batches:  # too few validation batches: say so before training, not after
                _sensitivity_batches(prepared, config, resolved, sensitivity_batches)
            if writer:
                out_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out_dir / "run.json", json.dumps(settings, indent=1))

            trained: list[nn.Module] = []

            def observer(module: nn.Module) -> Any:
                trained.append(module)
                return observe(module, candidates=names, every=every).__enter__()

            on_step, close = _progress(config.steps, "fp32 (observed)", progress and writer)

            def step_done(step: int, loss: float) -> None:
                on_step(step, loss)
                if step == sensitivity_early and writer:  # the early checkpoint the sensitivity measures
                    save_checkpoint(out_dir / EARLY_MODEL, {"model": trained[-1].state_dict(), "step": step})

            try:
                result = train_run(
                    RunSpec("fp32", "fp32", description="FP32, observed"),
                    factory,
                    config,
                    prepared,
                    out_dir,
                    step_done,
                    observer,
                    objective=resolved,
                    save_model=bool(sensitivity_batches) or keep_optimizer,
                    save_optimizer=keep_optimizer,
                )
            finally:
                close()
        if sensitivity_batches:
            measure_sensitivity(
                out_dir,
                factory,
                prepared,
                config,
                resolved,
                measured_formats,
                sensitivity_batches,
                sensitivity_granularity,
                progress and writer,
                early=sensitivity_early is not None,
                method=sensitivity_method,
                kinds=sensitivity.kinds,
                stacks=sensitivity.stacks,
            )
        if writer:
            _write_tensorboard(out_dir, tensorboard)
        return result


def _sensitivity_formats(asked: Sequence[str] | str | None, names: list[str]) -> list[str]:
    """The candidates the sensitivity measures: all (None), the cheapest one (``"auto"``), or those asked for,
    each among the observed candidates."""
    if asked is None:
        return list(names)
    if asked == "auto":
        return [min(names, key=lambda name: (get_format(name).bits_per_element, names.index(name)))]
    chosen = []
    for name in [asked] if isinstance(asked, str) else asked:
        try:
            label = get_format(name).name
        except ValueError as error:
            raise SettingsError("SensitivitySettings.formats", str(error)) from error
        if label not in names:
            raise SettingsError(
                "SensitivitySettings.formats",
                f"{name}: not among the observed candidates ({', '.join(names)})",
            )
        chosen.append(label)
    return list(dict.fromkeys(chosen)) or list(names)


AUTO_SENSITIVITY_EARLY = 20
"""The step whose model ``--sensitivity-early auto`` measures the sensitivity on beside the trained one: the
one step tried in plans, each time inside the 30-step warm-up (a GQA Llama, 20 of 300 steps; the pretrained
MiniLM, 20 of 250; the demo's BERT, 20 of 1,000: docs/results/plan-study.md)."""

AUTO_EARLY_MIN_STEPS = 100
"""The fewest steps a run needs for ``sensitivity_early="auto"`` to measure an early model: the step then lies
in the run's first fifth (the three families' runs had 250 to 1,000 steps; shorter runs were not tried)."""

EARLY_MODEL = "model_early.pt"
"""The model after ``sensitivity_early`` steps, kept in the run folder for the sensitivity measured on it."""

AUTO_SENSITIVITY_BATCHES = 2
"""Validation batches ``numscope analyze`` measures each operand's sensitivity on by default: the plan
study's setting (its sensitivity plans were made from 2 batches) and what ``numscope calibrate`` uses
(its cost on the demo's model: docs/results/status-history.md)."""


SENSITIVITY_TIME = "sensitivity_time.json"
"""The file of a run folder that says how long its sensitivity took to measure (wall seconds)."""


def measure_sensitivity(
    out_dir: Path,
    factory: Callable[[], nn.Module],
    prepared: RunData,
    config: TrainConfig,
    objective: str,
    candidates: Sequence[str],
    count: int,
    granularity: str = "site",
    progress: bool = False,
    sites: Sequence[str] | None = None,
    early: bool = False,
    method: str = "one_at_a_time",
    kinds: Sequence[str] | None = None,
    stacks: Sequence[str] | None = None,
) -> Analysis:
    """The trained model's (``out_dir/model.pt``) sensitivity on ``count`` validation batches, stored in
    ``out_dir/analysis`` and returned with it (a progress bar of the (target, format) measurements with
    ``progress``; ``sites``: glob patterns of the sites measured, default all; ``early``: measure the early
    checkpoint ``out_dir/model_early.pt`` too and combine the two with
    :func:`numscope.sensitivity.combine_sensitivities`, normalised by the candidate with the fewest bits;
    ``method``: ``"local"`` (:func:`numscope.sensitivity.local_sensitivity`, per operand) or
    ``"one_at_a_time"``; ``kinds``: only the sites of these kinds, as the analysis found them, among
    ``sites``; ``stacks``: only the sites one of these training stacks can quantize at their weight shape,
    :attr:`SensitivitySettings.stacks`); skipped when the analysis already holds it (a finished run asked
    again)."""
    from numscope.sensitivity import WEIGHT_KINDS, combine_sensitivities, local_sensitivity, sensitivity
    from numscope.train.checkpoint import load_checkpoint

    analysis = Analysis.load(out_dir / "analysis")
    if analysis.sensitivity is not None:
        return analysis
    if kinds is not None or stacks is not None:
        from numscope.advisor.target import site_kinds

        recorded = site_kinds(analysis)
        found = [
            name
            for name, kind in recorded.items()
            if (kinds is None or kind in kinds)
            and (sites is None or any(fnmatch.fnmatchcase(name, p) for p in sites))
        ]
        if not found and kinds is not None:
            raise SettingsError(
                "SensitivitySettings.kinds",
                f"no site of kind {', '.join(kinds)} in the model (its kinds: "
                f"{', '.join(sorted(set(recorded.values()))) or 'none'})",
            )
        if stacks is not None:
            shapes = analysis.weight_shapes()
            found = [
                n for n in found if recorded[n] not in WEIGHT_KINDS or _stack_takes(shapes.get(n), stacks)
            ]
            if not found:
                raise SettingsError(
                    "SensitivitySettings.stacks",
                    f"{', '.join(stacks)} can quantize none of the model's sites at its weight shapes "
                    "(numscope.plan.export.shape_problem)",
                )
        sites = [exact_pattern(name) for name in found]

    checkpoints = [out_dir / "model.pt"] + ([out_dir / EARLY_MODEL] if early else [])
    for path in checkpoints:
        if not path.is_file():
            raise WorkflowError(
                f"{path}: missing, so the sensitivity cannot be measured on it (a run resumed past the "
                "early step keeps none); analyze into a new `out`"
            )
    batches = _sensitivity_batches(prepared, config, objective, count)
    measured = []
    began = time.perf_counter()
    for path in checkpoints:
        model = factory()
        model.load_state_dict(load_checkpoint(path)["model"])
        which = "" if path.name == "model.pt" else f", {path.stem}"
        how = "local, per operand" if method == "local" else f"per {granularity}"
        desc = f"sensitivity ({how}, {count} batches{which})"
        bar = progress_bar(desc=desc, enabled=progress)

        def advance(done: int, total: int, bar: Any = bar) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        try:
            if method == "local":
                measured.append(
                    local_sensitivity(
                        model, batches, candidates=list(candidates), sites=sites, on_progress=advance
                    )
                )
            else:
                measured.append(
                    sensitivity(
                        model,
                        batches,
                        candidates=list(candidates),
                        granularity=granularity,
                        sites=sites,
                        on_progress=advance,
                    )
                )
        finally:
            bar.close()
    if len(measured) == 1:
        analysis.sensitivity = measured[0]
    else:
        cheapest = _sensitivity_formats("auto", list(candidates))[0]  # the fewest bits
        analysis.sensitivity = combine_sensitivities(measured, cheapest)
    analysis.save(out_dir / "analysis")
    # how long the measurement took (wall), for the verbs that report their stages' cost; beside the
    # analysis, which stays the same bytes whatever the machine's speed
    timing = {"seconds": time.perf_counter() - began, "batches": count, "method": method}
    atomic_write_text(out_dir / SENSITIVITY_TIME, json.dumps(timing))
    return analysis


def _stack_takes(shape: Sequence[int] | None, stacks: Sequence[str]) -> bool:
    """Whether one of ``stacks`` can quantize a Linear module whose weight has ``shape`` in one of its
    recipes (the check ``numscope.advisor.recipe_bits`` makes per recipe; an unknown shape: assumed so)."""
    from numscope.plan.export import shape_problem
    from numscope.plan.targets import get_target

    if shape is None:
        return True
    return any(
        shape_problem(shape, recipe.measured, stack) is None
        for stack in stacks
        for recipe in get_target(stack).recipes
    )


def _validation_split(prepared: RunData, config: TrainConfig, objective: str) -> list[Any]:
    split = get_objective(objective).batches
    return list(split(prepared.val_blocks, config.batch_size, prepared.tokenizer, config.seed, 0))


def _sensitivity_batches(prepared: RunData, config: TrainConfig, objective: str, count: int) -> list[Any]:
    """The first ``count`` validation batches (of ``config.batch_size``), or a clear error if fewer exist."""
    batches = _validation_split(prepared, config, objective)[:count]
    if len(batches) < count:
        raise WorkflowError(
            f"`SensitivitySettings.batches` {count}: the validation split holds {len(batches)} batch(es) of "
            f"{config.batch_size}; ask for fewer (or more `val_blocks`)"
        )
    return batches


def _write_tensorboard(out_dir: Path, log_dir: str | os.PathLike[str] | None) -> None:
    """The run's analysis as TensorBoard scalars in ``log_dir`` (nothing when None)."""
    if log_dir is not None and not Analysis.load(out_dir / "analysis").write_tensorboard(log_dir):
        raise WorkflowError("`tensorboard` needs the tensorboard package: pip install tensorboard")


def train(
    model: str | Workload,
    data: DataSettings | None,
    out: str | os.PathLike[str],
    *,
    plan: str,
    loss_scaling: str = "none",
    init_scale: float = 2.0**16,
    config: TrainConfig | None = None,
    objective: str = "auto",
    name: str | None = None,
    progress: bool = False,
    adaptive: AdaptiveConfig | None = None,
) -> RunResult:
    """Train ``model`` under ``plan`` (a YAML path, a preset of :meth:`numscope.Plan.uniform` or a named
    recipe of :meth:`numscope.Plan.recipe`, which gets the model's sites).

    loss_scaling: ``none``, ``static`` (``init_scale`` throughout) or ``dynamic`` (halve on overflow, grow
    after :class:`numscope.LossScaler`'s growth interval of clean steps). Writes the run folder ``out``
    (see the module docstring) and the trained parameters to ``out/model.pt``; rerun with the same
    settings to resume. Under ``torchrun`` with ``WORLD_SIZE`` > 1 it initialises a gloo process group and
    trains with DDP (``config.batch_size`` is the global batch), rank 0 writing; every rank returns the
    result. adaptive: train with adaptive precision from ``plan`` (:mod:`numscope.train.adaptive`; the run
    folder then also holds ``plan_history.csv``, ``plan.final.yaml`` and ``adaptive.json``).
    """
    config = config if config is not None else TrainConfig()
    work = resolve_workload(model, data, objective)
    if loss_scaling not in LOSS_SCALING:
        raise WorkflowError(f"unknown loss scaling {loss_scaling!r}; allowed: {', '.join(LOSS_SCALING)}")
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise WorkflowError(f"`init_scale` must be a positive number; got {init_scale}")
    loaded, plan_source = plan_and_source(plan)
    out_dir = check_output_folder(out)
    # a folder's recorded name wins over its current folder name: a copied or moved run resumes as itself
    run_name = name or stored_run_name(out_dir) or out_dir.resolve().name
    with _process_group(config):
        prepared = None
        if Plan.needs_sites(plan):  # resolved once, with the model's sites: what run.json records trains
            prepared, factory, resolved = _prepare_run(work, config, loaded)
            with fork_rng():  # building a model draws from the global generator
                names = [site.name for site in list_sites(factory())]
            loaded = Plan.resolve(plan, names)
        settings = _settings(
            "train",
            work,
            config,
            plan=loaded.to_dict(),
            plan_source=plan_source,
            loss_scaling=loss_scaling,
            init_scale=init_scale,
            name=run_name,
            **({"adaptive": adaptive.to_dict()} if adaptive is not None else {}),
        )
        check_run_settings(out_dir, settings)
        if (finished := finished_result(out_dir)) is not None:
            return finished
        if prepared is None:
            prepared, factory, resolved = _prepare_run(work, config, loaded)
        settings["objective_resolved"] = resolved
        settings["vocab_size_built"] = prepared.tokenizer.vocab_size  # a small corpus may give fewer
        writer = distributed.is_rank_zero()
        if writer:
            out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out_dir / "run.json", json.dumps(settings, indent=1))
        on_step, close = _progress(config.steps, run_name, progress and writer)
        try:  # convert compiles the quantizers of block-format plans (NUMSCOPE_FAST, when set, decides)
            return train_run(
                RunSpec(run_name, plan_source, loss_scaling, init_scale, resolved=loaded),
                factory,
                config,
                prepared,
                out_dir,
                on_step,
                objective=resolved,
                save_model=True,
                adaptive=adaptive,
            )
        finally:
            close()


EVALUATIONS = "evaluations.json"
"""A run folder's scores of its trained model on more validation blocks (:func:`evaluate`), by block count."""


def evaluate(
    out: str | os.PathLike[str], val_blocks: int, tokenizer: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Score a finished run's trained model (``model.pt``) on up to ``val_blocks`` blocks of its validation
    split, under the plan it trained with (``plan.final.yaml`` of an adaptive run, else ``plan.yaml``) and
    with the masks its seed gives, as its own evaluations were made (at the run's own ``--val-blocks`` it
    gives the loss in ``result.json`` bit for bit). A run's evaluations use few blocks to be quick; comparing
    plans needs more (a masked LM's 128 blocks of 32 tokens score about 600 tokens:
    docs/results/plan-study.md).

    Returns ``{"val_blocks", "blocks", "val_loss", "val_accuracy"}`` (``blocks``: how many the split held),
    also stored in ``out/evaluations.json`` and returned from there on a second call. ``tokenizer``: the
    tokenizer file of a run trained with ``--tokenizer`` (default: the path its run.json records)."""
    from numscope.run.folders import read_settings
    from numscope.train.checkpoint import load_checkpoint
    from numscope.train.recipe import Recipe

    check_positive("`val_blocks`", val_blocks)
    folder = Path(out)
    stored = read_settings(folder / "run.json")
    missing = [name for name in ("run.json", "result.json", "model.pt") if not (folder / name).is_file()]
    if stored is None or missing:
        raise WorkflowError(
            f"{folder}: not a finished run with its trained model (missing {', '.join(missing)}); give the "
            "folder of a finished 'numscope train' or 'numscope analyze' run"
        )
    cache_path = folder / EVALUATIONS
    try:
        cache = json.loads(cache_path.read_text(encoding="utf-8")) if cache_path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        cache = {}  # unreadable: scored again and rewritten whole
    if not isinstance(cache, dict):
        cache = {}
    if str(val_blocks) in cache:
        return cache[str(val_blocks)]
    stored_data = stored.get("data") or {}
    tokenizer = tokenizer if tokenizer is not None else stored.get("tokenizer_path")
    if stored_data.get("tokenizer_sha256") and tokenizer is None:
        raise WorkflowError(f"{folder}: the run used a tokenizer file; give it with `tokenizer` JSON")
    if tokenizer is not None and _file_digest(str(tokenizer)) != stored_data.get("tokenizer_sha256"):
        raise WorkflowError(f"`tokenizer` {tokenizer}: not the tokenizer {folder} was trained with")
    data = DataSettings(
        tuple(stored["text"]),
        vocab_size=stored_data["vocab_size"],
        seq_len=stored_data["seq_len"],
        val_blocks=val_blocks,
        tokenizer=None if tokenizer is None else str(tokenizer),
        train_tokenizer=bool(stored_data.get("train_tokenizer", False)),
    )
    if corpus_digest(data) != stored.get("corpus_sha256"):
        raise WorkflowError(f"{folder}: its text ({', '.join(data.text)}) changed since the run trained")
    fields = TrainConfig.__dataclass_fields__
    config = TrainConfig(**{k: v for k, v in stored["train"].items() if k in fields})
    final = folder / "plan.final.yaml"
    plan = Plan.load(final if final.is_file() else folder / "plan.yaml")
    model_spec, objective, _ = run_model(str(folder))  # type: ignore[misc]  # a run folder: never None
    work = resolve_workload(model_spec, data, objective)
    prepared, factory, resolved = _prepare_run(work, config, plan)
    with fork_rng():
        torch.manual_seed(config.seed)
        model = factory()
    model.load_state_dict(load_checkpoint(folder / "model.pt")["model"])
    # the plan's quantizers as the training loop sets them up for its evaluations
    generator = torch.Generator(model_device(model)).manual_seed(config.seed)
    Recipe(model, plan=plan, dtype=torch.float32, fp32_ops=False, activations=None, generator=generator)
    scored = get_objective(resolved).evaluate(model, prepared.val_blocks, prepared.tokenizer, config.seed)
    result = {
        "val_blocks": val_blocks,
        "blocks": int(prepared.val_blocks.shape[0]),
        "val_loss": float(scored.loss),
        "val_accuracy": float(scored.accuracy),
    }
    atomic_write_text(cache_path, json.dumps({**cache, str(val_blocks): result}, indent=1))
    return result


def plan_and_source(plan: str) -> tuple[Plan, str]:
    """The plan and how a run names it: a preset or recipe name, or the absolute path of a YAML file."""
    loaded = Plan.resolve(plan)
    return loaded, (str(Path(plan).resolve()) if Path(plan).is_file() else plan)


def _env_world_size() -> int:
    """The process count torchrun announces in ``WORLD_SIZE`` (1 without torchrun)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 1:
        raise WorkflowError(f"WORLD_SIZE={world!r} is not a number of processes; launch with torchrun")
    return int(world)


@contextmanager
def _process_group(config: TrainConfig) -> Iterator[None]:
    """Under torchrun (``WORLD_SIZE`` > 1, no group yet): the group for the block's duration (NCCL where the
    run trains on GPUs, else gloo), destroyed when it ends (:func:`numscope.distributed.destroyed_on_exit`;
    train_run, which builds the DDP wrapper, has returned by then)."""
    with distributed.destroyed_on_exit() if _init_distributed(config) else nullcontext():
        yield


def _init_distributed(config: TrainConfig) -> bool:
    """Join the torchrun world when ``WORLD_SIZE`` > 1 and no group exists; True if this call did."""
    world = _env_world_size()
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    device = resolve_device(config.device, field="TrainConfig.device")
    backend = backend_for(device)
    if backend == "gloo":
        distributed.use_loopback_on_one_node()
    else:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend)
    except (ValueError, RuntimeError) as error:
        raise WorkflowError(
            f"WORLD_SIZE={world} but the process group cannot start ({first_line(error)}); launch with "
            "torchrun --nproc-per-node N"
        ) from error
    return True
