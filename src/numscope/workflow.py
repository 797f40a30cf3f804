"""Users' own work, end to end: analyze → recommend → train → compare → report, and the synthetic study.

These are the functions behind ``numscope analyze``, ``recommend``, ``train``, ``compare``, ``report`` and
``study``; the command line only parses flags and prints. A typical flow::

    from numscope import workflow
    from numscope.run.config import TrainConfig

    data = workflow.DataSettings(text=("notes.txt",))
    steps = TrainConfig(steps=200, batch_size=16)
    workflow.analyze("tiny-bert", data, "runs/fp32", config=steps)         # FP32, observed
    plan, rows = workflow.recommend_plan("runs/fp32", "plan.yaml")          # per-operand formats + reasons
    workflow.train("tiny-bert", data, "runs/planned", plan="plan.yaml", config=steps)
    workflow.train("tiny-bert", data, "runs/fp8", plan="fp8", config=steps)
    workflow.compare(["runs/fp32", "runs/planned", "runs/fp8"])            # table rows
    workflow.report(["runs/fp32", "runs/planned", "runs/fp8"], "report.html")

**Models** (:func:`resolve_model`): a built-in tiny config (:data:`BUILTIN_MODELS`), a directory holding a
``transformers`` ``config.json`` or such a ``.json`` file, a ``module:factory`` (or ``file.py:factory``)
whose callable returns an ``nn.Module`` or a ``transformers`` config, or — with network access — a
Hugging Face hub name (only its config is fetched; weights are never loaded: every run starts from a
fresh, seeded initialisation). Configs are trained as masked LMs when ``transformers`` has a masked-LM
head for them (BERT-like), else as causal LMs (GPT-2-like); their vocabulary is resized to the tokenizer's.

**Data** (:class:`DataSettings`): UTF-8 text files; each blank-line-separated paragraph is a document. A
WordPiece tokenizer is trained on the training split and cached, as in ``numscope demo``.

**Run folders.** ``analyze`` and ``train`` write one folder each: ``run.json`` (the settings), ``plan.yaml``,
``log.csv`` (one row per step), ``checkpoint.pt`` while running (atomic; a rerun with the same settings
resumes from it), ``result.json`` when finished (a finished run is not repeated), ``analysis/`` (analyze)
and ``model.pt`` (train: the trained parameters). Under ``torchrun`` with more than one process ``train``
runs data-parallel (DDP over gloo on CPU) and only rank 0 writes.

Every user mistake raises :class:`WorkflowError` (or the library's own ``PlanError``, ``AdvisorError``,
``AnalysisError``) with a message that names the bad value and what is allowed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from numscope import __version__, distributed
from numscope._atomic import atomic_write_text
from numscope._rng import fork_rng
from numscope.analysis import Analysis
from numscope.convert import convert
from numscope.formats.spec import format as get_format
from numscope.observe import DEFAULT_CANDIDATES as OBSERVED_BY_DEFAULT
from numscope.plan import Plan
from numscope.run.config import LOSS_SCALING, RunData, RunResult, RunSpec, TrainConfig, read_result
from numscope.run.folders import (
    check_output_file,
    check_output_folder,
    check_run_settings,
    finished_result,
    flat_settings,
    short_value,
    stored_run_name,
)
from numscope.run.loop import read_log, train_run
from numscope.run.objectives import get_objective
from numscope.run.sources import (
    BUILTIN_MODELS,
    DataSettings,
    ModelSource,
    WorkflowError,
    check_interface,
    check_positive,
    check_train_config,
    corpus_digest,
    first_line,
    prepare_data,
    resolve_model,
)

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_CANDIDATES",
    "DataSettings",
    "ModelSource",
    "WorkflowError",
    "analysis_average_bits",
    "analyze",
    "compare",
    "find_analysis",
    "load_run",
    "prepare_data",
    "recommend_plan",
    "report",
    "resolve_model",
    "study",
    "train",
]


DEFAULT_CANDIDATES: tuple[str, ...] = OBSERVED_BY_DEFAULT
"""Formats ``analyze`` measures by default: :data:`numscope.observe.DEFAULT_CANDIDATES`."""

REFERENCE_FORMAT = "bf16"
"""The advisor's reference format, always measured."""


def _prepare_run(
    model: str, data: DataSettings, config: TrainConfig, objective: str, plan: Plan
) -> tuple[RunData, Callable[[], nn.Module], str]:
    """Data, the model factory and objective, after one probing forward that checks model and plan."""
    source = resolve_model(model, objective)
    prepared = prepare_data(data)
    check_train_config(config, prepared)
    factory, resolved = source.build(prepared.tokenizer, data.seq_len)
    example = next(
        get_objective(resolved).batches(prepared.train_blocks[:2], 2, prepared.tokenizer, config.seed, 0)
    )
    with fork_rng():
        probe = factory()
        if source.factory is not None:
            check_interface(model, probe, example)
        convert(probe, plan, example_inputs={k: v for k, v in example.items() if k != "labels"})
    return prepared, factory, resolved


def _settings(
    kind: str, model: str, objective: str, data: DataSettings, config: TrainConfig, **extra: Any
) -> dict:
    return {
        "numscope": __version__,
        "kind": kind,
        "model": model,
        "objective": objective,
        "text": [str(Path(p).resolve()) for p in data.text],
        "corpus_sha256": corpus_digest(data),
        "data": {"vocab_size": data.vocab_size, "seq_len": data.seq_len, "val_blocks": data.val_blocks},
        "train": asdict(config),
        **extra,
        "world_size": distributed.world_size(),
    }


def _progress(
    total: int, name: str, enabled: bool
) -> tuple[Callable[[int, float], None], Callable[[], None]]:
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=name, disable=not enabled, leave=True)

    def on_step(step: int, loss: float) -> None:
        bar.n = step
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        bar.refresh()

    return on_step, bar.close


def analyze(
    model: str,
    data: DataSettings,
    out: str | os.PathLike[str],
    *,
    config: TrainConfig | None = None,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    every: int = 5,
    objective: str = "auto",
    progress: bool = False,
    tensorboard: str | os.PathLike[str] | None = None,
    sensitivity_batches: int = 0,
    sensitivity_granularity: str = "site",
) -> RunResult:
    """Train ``model`` in FP32 on ``data`` and observe every GEMM operand every ``every`` steps.

    Writes the run folder ``out`` (run name ``fp32``) with ``out/analysis``, from which
    :func:`recommend_plan` recommends a plan. ``bf16`` (the advisor's reference) is always measured.
    ``tensorboard``: also write the analysis there as TensorBoard scalars (needs ``tensorboard``).
    ``sensitivity_batches`` > 0: then quantize one site at a time in each candidate and measure the loss and
    gradient change of the trained model on that many validation batches (:func:`numscope.sensitivity`),
    stored with the analysis for ``recommend``'s ``max_loss_increase_pct`` / ``min_grad_cosine``; the
    trained model is kept as ``out/model.pt``. One process only. ``sensitivity_granularity="operand"``
    quantizes one operand at a time instead (six times the passes), what ``recommend``'s sensitivity
    objective and a sensitivity gap model need.
    Under ``torchrun`` with ``WORLD_SIZE`` > 1 it trains with DDP over gloo, as :func:`train`; the observer
    merges each sampled step across the ranks (:mod:`numscope.distributed`), and rank 0 writes.
    """
    from numscope.observe import observe

    config = config if config is not None else TrainConfig()
    if tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise WorkflowError("--tensorboard needs the tensorboard package: pip install tensorboard")
    check_positive("--every", every)
    names = list(dict.fromkeys([REFERENCE_FORMAT, *candidates]))
    for name in names:
        try:
            get_format(name)
        except ValueError as error:
            raise WorkflowError(f"--candidates: {error}") from error
    if (
        isinstance(sensitivity_batches, bool)
        or not isinstance(sensitivity_batches, int)
        or sensitivity_batches < 0
    ):
        raise WorkflowError(f"--sensitivity must be a number of batches >= 0; got {sensitivity_batches!r}")
    if sensitivity_batches and _env_world_size() > 1:
        raise WorkflowError("--sensitivity runs in one process; run analyze without torchrun to measure it")
    if sensitivity_granularity not in ("site", "operand"):
        raise WorkflowError(f"--sensitivity-granularity {sensitivity_granularity!r}: allowed: site, operand")
    out_dir = check_output_folder(out)
    with _process_group():
        extra: dict[str, Any] = {"sensitivity_batches": sensitivity_batches} if sensitivity_batches else {}
        if sensitivity_batches and sensitivity_granularity != "site":
            extra["sensitivity_granularity"] = sensitivity_granularity
        settings = _settings(
            "analyze", model, objective, data, config, candidates=names, every=every, plan="fp32", **extra
        )
        check_run_settings(out_dir, settings)
        writer = distributed.is_rank_zero()
        result = finished_result(out_dir)
        # a finished run is not trained again, but an earlier call may have stopped before its sensitivity
        if result is None or sensitivity_batches:
            prepared, factory, resolved = _prepare_run(model, data, config, objective, Plan.uniform("fp32"))
        if result is None:
            settings["objective_resolved"] = resolved
            if sensitivity_batches:  # too few validation batches: say so before training, not after
                _sensitivity_batches(prepared, config, resolved, sensitivity_batches)
            if writer:
                out_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out_dir / "run.json", json.dumps(settings, indent=1))

            def observer(module: nn.Module) -> Any:
                return observe(module, candidates=names, every=every).__enter__()

            on_step, close = _progress(config.steps, "fp32 (observed)", progress and writer)
            try:
                result = train_run(
                    RunSpec("fp32", "fp32", description="FP32, observed"),
                    factory,
                    config,
                    prepared,
                    out_dir,
                    on_step,
                    observer,
                    objective=resolved,
                    save_model=bool(sensitivity_batches),
                )
            finally:
                close()
        if sensitivity_batches:
            _measure_sensitivity(
                out_dir,
                factory,
                prepared,
                config,
                resolved,
                names,
                sensitivity_batches,
                sensitivity_granularity,
            )
        if writer:
            _write_tensorboard(out_dir, tensorboard)
        return result


def _measure_sensitivity(
    out_dir: Path,
    factory: Callable[[], nn.Module],
    prepared: RunData,
    config: TrainConfig,
    objective: str,
    candidates: Sequence[str],
    count: int,
    granularity: str = "site",
) -> None:
    """The trained model's sensitivity on ``count`` validation batches, stored in ``out_dir/analysis``;
    skipped when the analysis already holds it (a finished run asked again)."""
    from numscope.sensitivity import sensitivity
    from numscope.train.checkpoint import load_checkpoint

    analysis = Analysis.load(out_dir / "analysis")
    if analysis.sensitivity is not None:
        return
    batches = _sensitivity_batches(prepared, config, objective, count)
    model = factory()
    model.load_state_dict(load_checkpoint(out_dir / "model.pt")["model"])
    analysis.sensitivity = sensitivity(model, batches, candidates=list(candidates), granularity=granularity)
    analysis.save(out_dir / "analysis")


def _sensitivity_batches(prepared: RunData, config: TrainConfig, objective: str, count: int) -> list[Any]:
    """The first ``count`` validation batches (of ``config.batch_size``), or a clear error if fewer exist."""
    split = get_objective(objective).batches(
        prepared.val_blocks, config.batch_size, prepared.tokenizer, config.seed, 0
    )
    batches = list(split)[:count]
    if len(batches) < count:
        raise WorkflowError(
            f"--sensitivity {count}: the validation split holds {len(batches)} batch(es) of "
            f"{config.batch_size}; ask for fewer (or more --val-blocks)"
        )
    return batches


def _write_tensorboard(out_dir: Path, log_dir: str | os.PathLike[str] | None) -> None:
    """The run's analysis as TensorBoard scalars in ``log_dir`` (nothing when None)."""
    if log_dir is not None and not Analysis.load(out_dir / "analysis").write_tensorboard(log_dir):
        raise WorkflowError("--tensorboard needs the tensorboard package: pip install tensorboard")


def train(
    model: str,
    data: DataSettings,
    out: str | os.PathLike[str],
    *,
    plan: str,
    loss_scaling: str = "none",
    init_scale: float = 2.0**16,
    config: TrainConfig | None = None,
    objective: str = "auto",
    name: str | None = None,
    progress: bool = False,
) -> RunResult:
    """Train ``model`` under ``plan`` (a YAML path, a preset of :meth:`numscope.Plan.uniform` or a named
    recipe of :meth:`numscope.Plan.recipe`, which gets the model's sites).

    loss_scaling: ``none``, ``static`` (``init_scale`` throughout) or ``dynamic`` (halve on overflow, grow
    after :class:`numscope.LossScaler`'s growth interval of clean steps). Writes the run folder ``out``
    (see the module docstring) and the trained parameters to ``out/model.pt``; rerun with the same
    settings to resume. Under ``torchrun`` with ``WORLD_SIZE`` > 1 it initialises a gloo process group and
    trains with DDP (``config.batch_size`` is the global batch), rank 0 writing; every rank returns the
    result.
    """
    config = config if config is not None else TrainConfig()
    if loss_scaling not in LOSS_SCALING:
        raise WorkflowError(f"unknown loss scaling {loss_scaling!r}; allowed: {', '.join(LOSS_SCALING)}")
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise WorkflowError(f"--init-scale must be a positive number; got {init_scale}")
    loaded, plan_source = _load_plan(plan)
    out_dir = check_output_folder(out)
    # a folder's recorded name wins over its current folder name: a copied or moved run resumes as itself
    run_name = name or stored_run_name(out_dir) or out_dir.resolve().name
    with _process_group():
        settings = _settings(
            "train",
            model,
            objective,
            data,
            config,
            plan=loaded.to_dict(),
            plan_source=plan_source,
            loss_scaling=loss_scaling,
            init_scale=init_scale,
            name=run_name,
        )
        check_run_settings(out_dir, settings)
        if (finished := finished_result(out_dir)) is not None:
            return finished
        prepared, factory, resolved = _prepare_run(model, data, config, objective, loaded)
        settings["objective_resolved"] = resolved
        writer = distributed.is_rank_zero()
        if writer:
            out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out_dir / "run.json", json.dumps(settings, indent=1))
        on_step, close = _progress(config.steps, run_name, progress and writer)
        try:  # convert compiles the quantizers of block-format plans (NUMSCOPE_FAST, when set, decides)
            return train_run(
                RunSpec(run_name, plan_source, loss_scaling, init_scale),
                factory,
                config,
                prepared,
                out_dir,
                on_step,
                objective=resolved,
                save_model=True,
            )
        finally:
            close()


def _load_plan(plan: str) -> tuple[Plan, str]:
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
def _process_group() -> Iterator[None]:
    """Under torchrun (``WORLD_SIZE`` > 1, no group yet): the gloo group for the block's duration, destroyed
    when it ends (:func:`numscope.distributed.destroyed_on_exit`; train_run, which builds the DDP wrapper,
    has returned by then)."""
    with distributed.destroyed_on_exit() if _init_distributed() else nullcontext():
        yield


def _init_distributed() -> bool:
    """Join the torchrun world (gloo) when ``WORLD_SIZE`` > 1 and no group exists; True if this call did."""
    world = _env_world_size()
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    distributed.use_loopback_on_one_node()
    try:
        dist.init_process_group("gloo")
    except (ValueError, RuntimeError) as error:
        raise WorkflowError(
            f"WORLD_SIZE={world} but the process group cannot start ({first_line(error)}); launch with "
            "torchrun --nproc-per-node N"
        ) from error
    return True


# ========================================================================================= recommend
def find_analysis(path: str | os.PathLike[str]) -> Path:
    """The analysis folder ``path`` names: itself, or the ``analysis/`` of a run folder."""
    candidate = Path(path)
    if (candidate / "analysis").is_dir() and not (candidate / "analysis.json").is_file():
        return candidate / "analysis"
    return candidate


def recommend_plan(
    analysis: str | os.PathLike[str] | Analysis,
    output: str | os.PathLike[str] | None = None,
    **criteria: Any,
) -> tuple[Plan, list[dict[str, str]]]:
    """The plan :func:`numscope.recommend` makes from an analysis, its table of choices and reasons.

    analysis: an :class:`~numscope.Analysis`, its folder, or a run folder of :func:`analyze`.
    criteria: passed by keyword to :func:`numscope.recommend` (``max_be_ratio``, ``max_underflow_pct``,
    ``max_overflow_pct``, ``min_sqnr_db``, ``bit_budget``, ``candidates``, ``reference``, ``per_operand``
    and any it gains). The plan is saved to ``output`` when given.
    """
    from numscope.advisor import recommend, recommend_table

    if output is not None:
        check_output_file(output, "--output")
    loaded = analysis if isinstance(analysis, Analysis) else Analysis.load(find_analysis(analysis))
    plan = recommend(loaded, **criteria)
    if output is not None:
        _save_plan(plan, Path(output))
    return plan, recommend_table(plan)


def _save_plan(plan: Plan, path: Path) -> None:
    check_output_file(path, "--output")
    try:
        plan.save(path)
    except OSError as error:
        raise WorkflowError(f"--output {path}: cannot write the plan ({error.strerror or error})") from error


def export_plan(
    plan: str, target: str, model: str, out: str | os.PathLike[str], objective: str = "auto"
) -> tuple[list[Path], list[str]]:
    """Write ``plan`` (a YAML path, preset or recipe) for ``target`` (torchao, te, megatron) for the Linear
    sites of ``model`` (as ``--model`` takes it; built once, untrained, to list its sites) into ``out``.
    Returns the files written and what the target cannot express (:mod:`numscope.plan.export`)."""
    from numscope.plan.export import TARGETS, ExportError, export
    from numscope.run.tokenizer import TokenizerInfo
    from numscope.sites import sites

    if target not in TARGETS:
        raise WorkflowError(f"--to {target}: unknown target; allowed: {', '.join(TARGETS)}")
    folder = check_output_folder(out)
    loaded, source = _load_plan(plan)
    resolved = resolve_model(model, objective)
    vocab = int(getattr(resolved.config, "vocab_size", 0) or 1000)
    tokenizer = TokenizerInfo(vocab_size=vocab, pad_id=0, unk_id=1, cls_id=2, sep_id=3, mask_id=4)
    positions = getattr(resolved.config, "max_position_embeddings", None) or getattr(
        resolved.config, "n_positions", None
    )
    factory, _ = resolved.build(tokenizer, min(int(positions or 8), 8))
    with fork_rng():
        found = [(site.name, site.kind) for site in sites(factory())]
    names = [name for name, _ in found]
    if plan in Plan.recipes():  # a recipe's layer choice (NVFP4's BF16 layers) needs the model's sites
        loaded = Plan.recipe(plan, names)
    loaded.check_sites(names)
    try:
        result = export(loaded, target, found, f"{Path(source).name} on {model}")
    except ExportError as error:
        raise WorkflowError(str(error)) from error
    return result.save(folder), result.unexpressed


def analysis_average_bits(plan: Plan, analysis: Analysis) -> float:
    """Average bits per operand element of ``plan`` over the analysis's operands, weighted by their size."""
    sizes: dict[str, dict[tuple[str, str], int]] = {}
    for (site, gemm, operand), count in analysis.elements.items():
        sizes.setdefault(site, {})[(gemm, operand)] = count
    return plan.average_bits(sizes)


# ===================================================================================== compare, report
def load_run(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A finished run folder as a dict: ``result.json``'s fields, ``settings`` (run.json), ``train_log``,
    ``dir``."""
    path = Path(directory)
    if not path.is_dir():
        raise WorkflowError(f"{directory}: no such run folder")
    result = path / "result.json"
    if not result.is_file():
        if (path / "checkpoint.pt").is_file() or (path / "log.csv").is_file():
            raise WorkflowError(
                f"{directory}: the run has not finished (no result.json); rerun its numscope train/analyze "
                "command to resume it"
            )
        raise WorkflowError(f"{directory}: not a numscope run folder (no result.json)")
    try:
        run = read_result(result).to_dict()
        settings_file = path / "run.json"
        settings = json.loads(settings_file.read_text(encoding="utf-8")) if settings_file.is_file() else {}
        run["train_log"] = read_log(path / "log.csv") if (path / "log.csv").is_file() else []
    except (OSError, ValueError, KeyError) as error:
        raise WorkflowError(f"{directory}: unreadable run files ({error})") from error
    if not isinstance(settings, dict):
        raise WorkflowError(f"{directory}: run.json does not hold the run's settings (a JSON object)")
    run["settings"], run["dir"] = settings, str(path)
    return run


_LOSS_LABELS = {"mlm": "MLM loss", "clm": "causal LM loss"}


def _load_runs(directories: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    if not directories:
        raise WorkflowError("give at least one run folder")
    runs = [load_run(d) for d in directories]
    names = [r["name"] for r in runs]
    for run in runs:
        if names.count(run["name"]) > 1:
            run["name"] = f"{run['name']} ({run['dir']})"
    return runs


#: what must match for a gap between two runs to mean anything: (settings key, what a person calls it)
_COMPARABLE = (
    ("train.steps", "steps"),
    ("train.seed", "seed"),
    ("corpus_sha256", "training text"),
    ("data.vocab_size", "vocabulary size"),
    ("data.seq_len", "sequence length"),
    ("train.batch_size", "batch size"),
    ("train.lr", "learning rate"),
)


def comparability(runs: Sequence[Mapping[str, Any]], baseline: Mapping[str, Any]) -> list[str]:
    """Where runs differ from the baseline in what makes a loss gap meaningful, one line each.

    Runs of different models have no meaningful gap: that raises :class:`WorkflowError`. Runs whose folders
    lack the settings (``run.json``) are not checked.
    """
    base = flat_settings(baseline.get("settings") or {})
    notes = []
    for run in runs:
        if run is baseline or not run.get("settings") or not base:
            continue
        settings = flat_settings(run["settings"])
        if "model" in base and settings.get("model") != base["model"]:
            raise WorkflowError(
                f"{run['name']} trained the model {settings.get('model')!r}, the baseline "
                f"{baseline['name']} {base['model']!r}: a loss gap between different models means nothing; "
                "compare runs of one model"
            )
        differ = [
            f"{label} {short_value(settings.get(key))} vs {short_value(base.get(key))}"
            for key, label in _COMPARABLE
            if key in base and settings.get(key) != base.get(key)
        ]
        if differ:
            notes.append(
                f"{run['name']} differs from the baseline {baseline['name']} in {'; '.join(differ)}: its gap "
                "mixes that difference with the numerics"
            )
    return notes


def compare(
    directories: Sequence[str | os.PathLike[str]], baseline: str | None = None
) -> list[dict[str, str]]:
    """One row per run: validation loss and accuracy, gap to the baseline, average bits, skipped steps.

    baseline: a run name or folder; default the run named ``fp32`` (as :func:`analyze` names its run), else
    the first. Gap = (val loss − baseline val loss) / baseline val loss, in percent. Runs that differ from
    the baseline in steps, seed, data or optimisation settings are reported as a ``UserWarning`` (see
    :func:`comparison` for the rows and those lines together); runs of another model are refused.
    """
    rows, notes = comparison(directories, baseline)
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=2)
    return rows


def comparison(
    directories: Sequence[str | os.PathLike[str]], baseline: str | None = None
) -> tuple[list[dict[str, str]], list[str]]:
    """:func:`compare`'s rows and the lines of :func:`comparability` (what makes a gap misleading)."""
    runs = _load_runs(directories)
    reference = _baseline(runs, baseline)
    notes = comparability(runs, reference)
    base = float(reference["val_loss"])
    rows = []
    for run in runs:
        loss = float(run["val_loss"])
        gap = 100 * (loss - base) / base if math.isfinite(loss) and base else math.nan
        bits = run.get("avg_bits")
        rows.append(
            {
                "run": run["name"],
                "plan": Path(run["plan"]).name if run["plan"].endswith((".yaml", ".yml")) else run["plan"],
                "loss scaling": run["loss_scaling"],
                "val loss": f"{loss:.4f}",
                "val acc": f"{100 * float(run['val_accuracy']):.2f}%",
                f"gap to {reference['name']}": "baseline" if run is reference else f"{gap:+.2f}%",
                "avg bits": "—" if bits is None else f"{bits:.2f}",
                "skipped": str(run["skipped_steps"]),
                "steps": str(run["steps"]),
                "wall": f"{run['wall_seconds']:.0f}s",
            }
        )
    return rows, notes


def _baseline(runs: list[dict[str, Any]], baseline: str | None) -> dict[str, Any]:
    if baseline is None:
        return next((r for r in runs if r["name"] == "fp32"), runs[0])
    for run in runs:
        if baseline == run["name"] or Path(baseline).resolve() == Path(run["dir"]).resolve():
            return run
    raise WorkflowError(
        f"--baseline {baseline}: no such run; runs: {', '.join(r['name'] for r in runs)} (or their folders)"
    )


def report(
    directories: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    analysis: str | os.PathLike[str] | None = None,
    plan: str | os.PathLike[str] | None = None,
    title: str = "numscope report",
    command: str | None = None,
) -> Path:
    """Write one self-contained HTML report of the runs (:func:`numscope.report.write_report`).

    analysis: an analysis folder (or run folder); default the first run folder holding ``analysis/``.
    plan: a plan YAML to show per site; default the plan of the first run trained from a plan file.
    The gap column is relative to the run named ``fp32``.
    """
    from numscope.report import write_report

    check_output_file(output, "--output")
    runs = _load_runs(directories)
    if analysis is not None:
        analysis_dir = find_analysis(analysis)
    else:
        analysis_dir = next(
            (Path(r["dir"]) / "analysis" for r in runs if (Path(r["dir"]) / "analysis").is_dir()), None
        )
    loaded = Analysis.load(analysis_dir) if analysis_dir is not None else None
    if plan is not None:
        shown, _ = _load_plan(str(plan))
    else:
        planned = next((r for r in runs if r["plan"].endswith((".yaml", ".yml"))), None)
        shown = Plan.load(Path(planned["dir"]) / "plan.yaml") if planned is not None else None
    rows = []
    for run in runs:
        row = {k: v for k, v in run.items() if k not in ("settings", "dir")}
        if row.get("avg_bits") is None and loaded is not None:  # a run from before runs recorded it
            row["avg_bits"] = analysis_average_bits(Plan.load(Path(run["dir"]) / "plan.yaml"), loaded)
        rows.append(row)
    labels = {_LOSS_LABELS.get(run["settings"].get("objective_resolved"), "loss") for run in runs}
    loss_label = labels.pop() if len(labels) == 1 else "loss"
    return write_report(
        output,
        title=title,
        runs=rows,
        analysis=loaded,
        plan=shown,
        command=command,
        loss_label=loss_label,
    )


# ================================================================================================ study
@dataclass
class StudyResult:
    """The synthetic study's rows, its files, and the INT8/E4M3 crossover ν (None when not bracketed)."""

    rows: list[Any]
    png: Path
    csv: Path
    table: str
    crossover: float | None = None
    formats: list[str] = field(default_factory=list)


def load_gap_model(path: str | os.PathLike[str], features: str = "noise") -> Any:
    """A :class:`numscope.study.GapModel` of ``features`` (noise or sensitivity) from a file; a clear error if
    it is not one."""
    from numscope.study import GapModel, StudyError

    try:
        return GapModel.load(path, features)
    except StudyError as error:
        raise WorkflowError(f"--gap-model: {error}") from error


def sensitivity_objective(analysis: Analysis, gap_model: Any = None) -> Callable[[Any, str], float]:
    """The advisor's sensitivity objective from the analysis's operand sensitivity, its GEMM roles weighted
    by a sensitivity ``gap_model``'s coefficients (equal without one); a clear error if not measured."""
    from numscope.advisor import sensitivity_objective as objective

    sensitivity = analysis.sensitivity
    if sensitivity is None or sensitivity.granularity != "operand":
        measured = "none" if sensitivity is None else f"per {sensitivity.granularity}"
        raise WorkflowError(
            f"--objective sensitivity needs the sensitivity of every operand (measured: {measured}); run "
            "numscope analyze ... --sensitivity N --sensitivity-granularity operand"
        )
    return objective(sensitivity, gap_model.role_weights() if gap_model is not None else None)


def predicted_gap(gap_model: Any, analysis: Analysis, plan: Plan) -> float:
    from numscope.study import StudyError

    try:
        return gap_model.predict_plan(analysis, plan)
    except StudyError as error:
        raise WorkflowError(f"--gap-model: {error}") from error


def calibrate(
    model: str,
    data: DataSettings,
    out: str | os.PathLike[str],
    config: TrainConfig,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    low: str = "mxfp4_e2m1",
    objective: str = "auto",
    sensitivity_batches: int = 2,
) -> Any:
    """:func:`numscope.study.calibrate` into ``out``, with clear errors for bad settings."""
    from numscope.study import StudyError
    from numscope.study import calibrate as run

    try:
        name = get_format(low).name
    except ValueError as error:
        raise WorkflowError(f"--low: {error}") from error
    try:
        return run(
            model,
            data,
            check_output_folder(out),
            config,
            seeds=seeds,
            low=name,
            objective=objective,
            sensitivity_batches=sensitivity_batches,
        )
    except StudyError as error:
        raise WorkflowError(str(error)) from error


def plan_study(
    out: str | os.PathLike[str],
    *,
    quick: bool = False,
    budgets: Sequence[float] | None = None,
    seeds: Sequence[int] | None = None,
    random_plans: int | None = None,
    steps: int | None = None,
    jobs: int | None = None,
    text: Sequence[str] | None = None,
) -> Any:
    """The plan study (:func:`numscope.study.run_plan_study`) into ``out``; ``quick`` starts from
    :meth:`PlanStudyConfig.quick`, the other arguments override the configuration."""
    from dataclasses import replace

    from numscope.study import PlanStudyConfig, StudyError, run_plan_study

    config = PlanStudyConfig.quick() if quick else PlanStudyConfig()
    changes = {
        "budgets": tuple(budgets) if budgets else None,
        "seeds": tuple(seeds) if seeds else None,
        "random_plans": random_plans,
        "steps": steps,
        "jobs": jobs,
    }
    config = replace(config, **{k: v for k, v in changes.items() if v is not None})
    for path in text or ():
        if not Path(path).is_file():
            raise WorkflowError(f"--text: {path} is not a readable file")
    try:
        config.check()
        return run_plan_study(check_output_folder(out), config, text)
    except StudyError as error:
        raise WorkflowError(str(error)) from error


def study(
    out: str | os.PathLike[str],
    *,
    dofs: Sequence[float] | None = None,
    formats: Sequence[str] | None = None,
    size: int = 512,
    trials: int = 2,
    seed: int = 0,
) -> StudyResult:
    """Backward error of ``size``×``size`` Student-t(ν) products per format, as
    :func:`numscope.study.run_study`: ``backward_error_study.png`` and ``.csv`` written into ``out``."""
    from numscope.study import DOFS, FORMATS, StudyFormat, crossover, run_study, study_table

    dofs = tuple(DOFS if dofs is None else dofs)
    formats = tuple(FORMATS if formats is None else formats)
    check_positive("--size", size)
    check_positive("--trials", trials)
    if not dofs or not formats:
        raise WorkflowError("the study needs at least one --dofs value and one --formats name")
    for dof in dofs:
        if not dof > 0:
            raise WorkflowError(f"--dofs: degrees of freedom must be > 0 (inf for Gaussian); got {dof}")
    labels = []
    for spec in formats:
        try:
            labels.append(StudyFormat.parse(spec).label)
        except ValueError as error:
            raise WorkflowError(f"--formats: {error}") from error
    rows, png, table = run_study(
        check_output_folder(out), dofs=dofs, formats=formats, size=size, seed=seed, trials=trials
    )
    cross = None
    if "int8 per tensor" in labels and "fp8_e4m3" in labels and len(dofs) > 1:
        cross = crossover(rows, "int8 per tensor", "fp8_e4m3")
    return StudyResult(rows, png, table, study_table(rows), cross, labels)
