"""Users' own work, end to end: analyze → recommend → train → compare → report, and the synthetic study.

These are the functions behind ``numscope analyze``, ``recommend``, ``train``, ``compare``, ``report`` and
``study``; the command line only parses flags and prints. A typical flow::

    from numscope import workflow
    from numscope.run.config import SensitivitySettings, TrainConfig

    data = workflow.DataSettings(text=("notes.txt",))
    steps = TrainConfig(steps=200, batch_size=16)
    workflow.analyze("tiny-bert", data, "runs/fp32", config=steps)         # FP32, observed
    plan, rows = workflow.recommend_plan("runs/fp32", "plan.yaml")          # per-operand formats + reasons
    workflow.train("tiny-bert", data, "runs/planned", plan="plan.yaml", config=steps)
    workflow.train("tiny-bert", data, "runs/fp8", plan="fp8", config=steps)
    workflow.compare(["runs/fp32", "runs/planned", "runs/fp8"])            # table rows
    workflow.report(["runs/fp32", "runs/planned", "runs/fp8"], "report.html")

**Models** (:func:`resolve_model`): a built-in config (:data:`BUILTIN_MODELS`), a directory holding a
``transformers`` ``config.json`` or such a ``.json`` file, a ``module:factory`` (or ``file.py:factory``)
whose callable returns an ``nn.Module`` or a ``transformers`` config, or — with network access — a
Hugging Face hub name (only its config is fetched; weights are never loaded: every run starts from a
fresh, seeded initialisation). Configs are trained as masked LMs when ``transformers`` has a masked-LM
head for them (BERT-like), else as causal LMs (GPT-2-like); their vocabulary is resized to the tokenizer's.

**Data** (:class:`DataSettings`): UTF-8 text files; each blank-line-separated paragraph is a document. A
WordPiece tokenizer is trained on the training split and cached, as in ``numscope demo``.

**Where each verb lives.** ``analyze`` and ``train`` (one run into its folder: what a run folder holds,
resuming, torchrun) are :mod:`numscope.run.runner`'s; ``compare`` and ``load_run`` (finished runs side by
side, and whether a gap between them means anything) :mod:`numscope.run.compare`'s; this module adds the
verbs that read runs and analyses (recommend, export, report) and the studies' front ends.

Every user mistake raises :class:`WorkflowError` (or the library's own ``PlanError``, ``AdvisorError``,
``AnalysisError``) with a message that names the bad value and what is allowed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numscope._rng import fork_rng
from numscope.analysis import Analysis
from numscope.formats.spec import get_format
from numscope.plan import Plan
from numscope.run.compare import LOSS_LABELS, comparability, compare, comparison, load_run, load_runs
from numscope.run.config import SensitivitySettings, TrainConfig
from numscope.run.folders import check_output_file, check_output_folder
from numscope.run.runner import (
    DEFAULT_CANDIDATES,
    REFERENCE_FORMAT,
    analyze,
    evaluate,
    plan_and_source,
    train,
)
from numscope.run.sources import (
    BUILTIN_MODELS,
    DataSettings,
    ModelSource,
    WorkflowError,
    check_positive,
    prepare_data,
    resolve_model,
)

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_CANDIDATES",
    "REFERENCE_FORMAT",
    "DataSettings",
    "ModelSource",
    "WorkflowError",
    "analysis_average_bits",
    "analyze",
    "comparability",
    "compare",
    "comparison",
    "evaluate",
    "find_analysis",
    "load_run",
    "prepare_data",
    "recommend_plan",
    "report",
    "resolve_model",
    "study",
    "train",
]


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
    *,
    max_gap: float | None = None,
    gap_model: Any = None,
    **criteria: Any,
) -> tuple[Plan, list[dict[str, str]]]:
    """The plan :func:`numscope.recommend` makes from an analysis, its table of choices and reasons.

    analysis: an :class:`~numscope.Analysis`, its folder, or a run folder of :func:`analyze`.
    criteria: passed by keyword to :func:`numscope.recommend` (``max_be_ratio``, ``max_underflow_pct``,
    ``max_overflow_pct``, ``min_sqnr_db``, ``bit_budget``, ``candidates``, ``reference``, ``per_operand``
    and any it gains). max_gap: instead of a bit budget, the cheapest plan whose gap to FP32 ``gap_model``
    (a :class:`numscope.study.GapModel`) predicts within ``max_gap`` nats
    (:func:`numscope.advisor.advise_within_gap`). The plan is saved to ``output`` when given.
    """
    from numscope.advisor import advise_within_gap, recommend, recommend_table

    if output is not None:
        check_output_file(output, "--output")
    loaded = analysis if isinstance(analysis, Analysis) else Analysis.load(find_analysis(analysis))
    if max_gap is None:
        plan = recommend(loaded, **criteria)
    else:
        if gap_model is None:
            raise WorkflowError(
                "--max-gap needs --gap-model (gap_model.json of 'numscope calibrate') to predict gaps"
            )
        if criteria.get("bit_budget") is not None:
            raise WorkflowError(
                "--max-gap chooses the bit budget itself: give --max-gap or --bit-budget, not both"
            )
        criteria.pop("bit_budget", None)
        plan = advise_within_gap(
            loaded,
            predict=lambda candidate: predicted_gap(gap_model, loaded, candidate),
            max_gap=max_gap,
            **criteria,
        )[0].plan
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
    """Write ``plan`` (a YAML path, preset or recipe) for ``target`` (torchao, te, megatron) for the sites
    of ``model`` (as ``--model`` takes it) into ``out``. The model is built once, untrained, and run forward
    on an example batch, as ``analyze`` runs it, so that every site a plan can name is found: the Linear
    layers and the products in forward code (attention's scores and context). Returns the files written
    and what the target cannot express (:mod:`numscope.plan.export`)."""
    from numscope.plan.export import TARGETS, ExportError, export

    if target not in TARGETS:
        raise WorkflowError(f"--to {target}: unknown target; allowed: {', '.join(TARGETS)}")
    folder = check_output_folder(out)
    loaded, source = plan_and_source(plan)
    shapes: dict[str, tuple[int, ...]] = {}
    found = model_sites(model, objective, shapes=shapes)
    names = [name for name, _ in found]
    if plan in Plan.recipes():  # a recipe's layer choice (NVFP4's BF16 layers) needs the model's sites
        loaded = Plan.recipe(plan, names)
    loaded.check_sites(names)
    try:
        result = export(loaded, target, found, f"{Path(source).name} on {model}", shapes)
    except ExportError as error:
        raise WorkflowError(str(error)) from error
    return result.save(folder), result.unexpressed


def model_sites(
    model: str, objective: str = "auto", seq_len: int = 8, shapes: dict[str, tuple[int, ...]] | None = None
) -> list[tuple[str, str]]:
    """``(site name, kind)`` of every site of ``model`` (as ``--model`` takes it, or a run folder: the model
    that run trained, at its tokenizer's vocabulary) in call order: the model is built untrained and run
    forward once, without gradients, on a batch of ``seq_len`` random tokens (what its objective feeds it:
    input ids, attention mask). ``shapes``, when given, receives each Linear
    site's weight shape (out × in features), for the export's shape rules."""
    import torch

    from numscope.run.objectives import get_objective
    from numscope.run.sources import run_model
    from numscope.run.tokenizer import TokenizerInfo
    from numscope.sites import sites

    trained = run_model(model)
    if trained is not None:  # a run folder: the model it trained, at its tokenizer's vocabulary
        model, objective, vocab = trained
        resolved = resolve_model(model, objective)
    else:
        resolved = resolve_model(model, objective)
        vocab = int(getattr(resolved.config, "vocab_size", 0) or 1000)
    tokenizer = TokenizerInfo(vocab_size=vocab, pad_id=0, unk_id=1, cls_id=2, sep_id=3, mask_id=4)
    positions = getattr(resolved.config, "max_position_embeddings", None) or getattr(
        resolved.config, "n_positions", None
    )
    length = min(int(positions or seq_len), seq_len)
    factory, kind = resolved.build(tokenizer, length, weights=False)
    with fork_rng():
        torch.manual_seed(0)
        blocks = torch.randint(5, max(vocab, 6), (2, length))
        example = next(get_objective(kind).batches(blocks, 2, tokenizer, 0, 0))
        inputs = {key: value for key, value in example.items() if key != "labels"}
        built = factory()
        found = [(site.name, site.kind) for site in sites(built, inputs)]
    if shapes is not None:
        modules = dict(built.named_modules())
        for name, kind in found:
            weight = getattr(modules.get(name), "weight", None)
            if kind in ("linear", "conv1d") and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                shapes[name] = tuple(weight.shape)
    return found


def analysis_average_bits(plan: Plan, analysis: Analysis) -> float:
    """Average bits per operand element of ``plan`` over the analysis's operands, weighted by their size."""
    sizes: dict[str, dict[tuple[str, str], int]] = {}
    for (site, gemm, operand), count in analysis.elements.items():
        sizes.setdefault(site, {})[(gemm, operand)] = count
    return plan.average_bits(sizes)


# ===================================================================================== compare, report
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
    runs = load_runs(directories)
    if analysis is not None:
        analysis_dir = find_analysis(analysis)
    else:
        analysis_dir = next(
            (Path(r["dir"]) / "analysis" for r in runs if (Path(r["dir"]) / "analysis").is_dir()), None
        )
    loaded = Analysis.load(analysis_dir) if analysis_dir is not None else None
    if plan is not None:
        shown, _ = plan_and_source(str(plan))
    else:
        planned = next((r for r in runs if r["plan"].endswith((".yaml", ".yml"))), None)
        shown = Plan.load(Path(planned["dir"]) / "plan.yaml") if planned is not None else None
    rows = []
    for run in runs:
        row = {k: v for k, v in run.items() if k not in ("settings", "dir")}
        if row.get("avg_bits") is None and loaded is not None:  # a run from before runs recorded it
            row["avg_bits"] = analysis_average_bits(Plan.load(Path(run["dir"]) / "plan.yaml"), loaded)
        rows.append(row)
    labels = {LOSS_LABELS.get(run["settings"].get("objective_resolved"), "loss") for run in runs}
    loss_label = labels.pop() if len(labels) == 1 else "loss"
    return write_report(
        output,
        title=title,
        runs=rows,
        analysis=loaded,
        plan=shown,
        command=command,
        loss_label=loss_label,
        extra_images=[_plan_history(run) for run in runs if (Path(run["dir"]) / "adaptive.json").is_file()],
    )


def _plan_history(run: dict) -> tuple[str, bytes]:
    """An adaptive run's plan history as a report figure (caption, PNG)."""
    from numscope.report.plots import plan_history_figure
    from numscope.train.adaptive import read_history

    folder = Path(run["dir"])
    summary = json.loads((folder / "adaptive.json").read_text(encoding="utf-8"))
    history = read_history(folder / "plan_history.csv")
    causes = ", ".join(f"{n} {cause}" for cause, n in sorted(summary["changes"].items())) or "no change"
    caption = (
        f"{run['name']}: the adaptive plan over training ({causes}; {summary['average_bits']:.2f} average "
        "bits over training; every change in plan_history.csv)"
    )
    png = plan_history_figure([c.row() for c in history], summary["bits_from_step"], int(run["steps"]))
    return caption, png


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


def has_sensitivity_model(path: str | os.PathLike[str]) -> bool:
    """Whether the gap model file also holds the model fitted on sensitivities (a calibration that measured
    them); False also for a file that is no gap model (loading it then says what is wrong)."""
    from numscope.study import GapModel, StudyError

    try:
        GapModel.load(path, "sensitivity")
    except StudyError:
        return False
    return True


OBJECTIVE_WHY = {
    "sensitivity": "the analysis measured every operand's sensitivity and a bit budget or gap is given",
    "sensitivity default budget": "the analysis measured every operand's sensitivity; with no --bit-budget "
    "or --max-gap the budget is the bits of FP8 everywhere (the stack's FP8 recipe with --target): the same "
    "cost as uniform FP8, spent where the measurement says",
    "noise limits": "limits or candidates are given without a --bit-budget or --max-gap: the cheapest format "
    "within them per operand",
    "noise gap model": "the gap model was fitted without sensitivities, so it weighs noise; a 'numscope "
    "calibrate' that measures them (its default) fits both",
    "noise": "the analysis holds no operand sensitivity, or no bit budget or gap is given; 'numscope "
    "analyze' measures it by default (--sensitivity N --sensitivity-granularity operand)",
}


def default_objective(analysis: Analysis, bit_budget: float | None, max_gap: float | None = None) -> str:
    """``sensitivity`` where the analysis measured every operand's sensitivity (the objective that tied the
    best heuristics in the plan study; without a bit budget or a gap target it takes
    :func:`default_budget`), else ``noise``."""
    measured = analysis.sensitivity is not None and analysis.sensitivity.granularity == "operand"
    return "sensitivity" if measured else "noise"


def default_budget(analysis: Analysis, target: str | None = None) -> float:
    """The bit budget ``recommend`` takes with the sensitivity objective when none is given: the average bits
    of FP8 everywhere (``fp8_e4m3`` on every measured operand; for a training stack, its FP8 recipe on
    everything it converts, the rest high), so that the plan costs what uniform FP8 costs."""
    from numscope.advisor.target import recipe_bits
    from numscope.plan.targets import get_target

    if target and target != "emulation":
        bits = recipe_bits(analysis, get_target(target), analysis.candidates)
        if "fp8" not in bits:
            raise WorkflowError(
                f"--target {target}: its FP8 recipe's formats were not observed; give --bit-budget"
            )
        return round(bits["fp8"], 2)
    return round(analysis_average_bits(Plan.uniform("fp8_e4m3"), analysis), 2)


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
    return objective(sensitivity, gap_model.role_weights() if gap_model is not None else None, analysis)


def predicted_gap(gap_model: Any, analysis: Analysis, plan: Plan) -> float:
    from numscope.study import StudyError

    try:
        return gap_model.predict_plan(analysis, plan)
    except StudyError as error:
        raise WorkflowError(f"--gap-model: {error}") from error


def extrapolation(gap_model: Any, analysis: Analysis, plan: Plan) -> str:
    """'' where the gap model was calibrated on every format the plan uses, else one sentence naming the
    formats its prediction extrapolates to and how to calibrate them."""
    outside = gap_model.uncalibrated(analysis, plan)
    if not outside:
        return ""
    return (
        f"an extrapolation: calibrated on {', '.join(gap_model.formats)} only, the plan also uses "
        f"{', '.join(outside)} ('numscope calibrate --also {' '.join(outside)}' calibrates them)"
    )


def calibrate(
    model: str,
    data: DataSettings,
    out: str | os.PathLike[str],
    config: TrainConfig,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    low: str = "mxfp4_e2m1",
    also: Sequence[str] = (),
    objective: str = "auto",
    sensitivity: SensitivitySettings | None = None,
    jobs: int = 1,
) -> Any:
    """:func:`numscope.study.calibrate` into ``out``, with clear errors for bad settings."""
    from numscope.study import StudyError
    from numscope.study import calibrate as run

    try:
        name = get_format(low).name
    except ValueError as error:
        raise WorkflowError(f"--low: {error}") from error
    try:
        extra = [get_format(label).name for label in also]
    except ValueError as error:
        raise WorkflowError(f"--also: {error}") from error
    try:
        return run(
            model,
            data,
            check_output_folder(out),
            config,
            seeds=seeds,
            low=name,
            also=extra,
            objective=objective,
            sensitivity=sensitivity,
            jobs=jobs,
        )
    except StudyError as error:
        raise WorkflowError(str(error)) from error


def plan_study(
    out: str | os.PathLike[str],
    *,
    quick: bool = False,
    demo_model: bool = False,
    budgets: Sequence[float] | None = None,
    seeds: Sequence[int] | None = None,
    random_plans: int | None = None,
    steps: int | None = None,
    jobs: int | None = None,
    text: Sequence[str] | None = None,
    target: str | None = None,
) -> Any:
    """The plan study (:func:`numscope.study.run_plan_study`) into ``out``; ``quick`` starts from
    :meth:`PlanStudyConfig.quick`, ``demo_model`` from :meth:`PlanStudyConfig.demo_model`, the other
    arguments override the configuration (``target``: numscope's plan also made for that stack)."""
    from dataclasses import replace

    from numscope.study import PlanStudyConfig, StudyError, run_plan_study

    if quick and demo_model:
        raise WorkflowError("--quick and --demo-model: choose one (a small model, or the demo's)")
    start = PlanStudyConfig.quick if quick else PlanStudyConfig.demo_model if demo_model else PlanStudyConfig
    config = start()
    changes = {
        "budgets": tuple(budgets) if budgets else None,
        "seeds": tuple(seeds) if seeds else None,
        "random_plans": random_plans,
        "steps": steps,
        "jobs": jobs,
        "target": target,
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
