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

**Models** (:func:`resolve_model`): a checkpoint folder (``config.json`` beside ``model.safetensors`` or
``pytorch_model.bin``: runs start from its weights, with its own tokenizer), a built-in config
(:data:`BUILTIN_MODELS`), a directory holding a ``transformers`` ``config.json`` alone or such a ``.json``
file (a fresh, seeded initialisation), a ``module:factory`` (or ``file.py:factory``) whose callable
returns an ``nn.Module`` or a ``transformers`` config, or — with network access — a Hugging Face hub name
(only its config is fetched). Configs are trained as masked LMs when ``transformers`` has a masked-LM
head for them (BERT-like), else as causal LMs (GPT-2-like); their vocabulary is resized to the tokenizer's.

**Data** (:class:`DataSettings`): UTF-8 text files; each blank-line-separated paragraph is a document. A
WordPiece tokenizer is trained on the training split and cached, as in ``numscope demo``.

**Where each verb lives.** ``analyze`` and ``train`` (one run into its folder: what a run folder holds,
resuming, torchrun) are :mod:`numscope.run.runner`'s; ``compare`` and ``load_run`` (finished runs side by
side, and whether a gap between them means anything) :mod:`numscope.run.compare`'s; this package adds
one module per verb that reads runs and analyses — :mod:`numscope.workflow.advice` (recommend),
:mod:`numscope.workflow.export`, :mod:`numscope.workflow.reports` — and :mod:`numscope.workflow.studies`
(the studies' front ends), and re-exports their functions here.

Every user mistake raises :class:`WorkflowError` (or the library's own ``PlanError``, ``AdvisorError``,
``AnalysisError``) with a message that names the bad value and what is allowed.
"""

from numscope.errors import WorkflowError
from numscope.run.compare import comparability, compare, comparison, load_run
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
    check_positive,
    prepare_data,
    resolve_model,
)
from numscope.workflow.advice import (
    OBJECTIVE_WHY,
    analysis_average_bits,
    analysis_objective,
    default_budget,
    default_objective,
    extrapolation,
    find_analysis,
    has_sensitivity_model,
    load_gap_model,
    predicted_gap,
    recommend_plan,
    unmeasured_operands,
)
from numscope.workflow.export import export_plan, model_sites
from numscope.workflow.reports import report
from numscope.workflow.studies import StudyResult, calibrate_gap_model, plan_study, study

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_CANDIDATES",
    "OBJECTIVE_WHY",
    "REFERENCE_FORMAT",
    "DataSettings",
    "ModelSource",
    "StudyResult",
    "WorkflowError",
    "analysis_average_bits",
    "analysis_objective",
    "analyze",
    "calibrate_gap_model",
    "check_positive",
    "comparability",
    "compare",
    "comparison",
    "default_budget",
    "default_objective",
    "evaluate",
    "export_plan",
    "extrapolation",
    "find_analysis",
    "has_sensitivity_model",
    "load_gap_model",
    "load_run",
    "model_sites",
    "plan_and_source",
    "plan_study",
    "predicted_gap",
    "prepare_data",
    "recommend_plan",
    "report",
    "resolve_model",
    "study",
    "train",
    "unmeasured_operands",
]
