"""numscope: measured, not guessed, low-precision numerics for training.

Formats are exact (``get_format``, ``formats``, ``quantize``); every GEMM of a model is a *site* whose
operands pass through one interception point that both observes and quantizes; a *plan* (data, YAML) says
which format and scaling each operand uses; an *observer* measures candidate formats on real tensors and the
*advisor* turns that analysis into a plan.

The public names are resolved lazily so that ``import numscope`` stays cheap and lower layers never pull in
higher ones.
"""

from __future__ import annotations

from numscope._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # formats
    "Format": "numscope.formats.spec",
    "FloatFormat": "numscope.formats.spec",
    "IntFormat": "numscope.formats.spec",
    "BlockFormat": "numscope.formats.spec",
    "get_format": "numscope.formats.spec",
    "format": "numscope.formats.spec",  # get_format's first name, kept (not in __all__: it shadows a builtin)
    "Scaling": "numscope.formats.scaling",
    "DelayedScaler": "numscope.formats.scaling",
    "quantize": "numscope.formats.quantize",
    "encode": "numscope.formats.quantize",
    "Encoded": "numscope.formats.quantize",
    "NumscopeError": "numscope.errors",  # the base of every error about numscope's input
    # runtime
    "Site": "numscope.sites",
    "sites": "numscope.sites",
    "Plan": "numscope.plan",
    "PlanError": "numscope.plan",
    "OperandSpec": "numscope.plan",
    "SiteSpec": "numscope.plan",
    "Rule": "numscope.plan",
    "convert": "numscope.convert",
    "unconvert": "numscope.convert",
    "LossScaler": "numscope.train.loss_scaler",
    "MasterWeights": "numscope.train.master",
    "save_checkpoint": "numscope.train.checkpoint",
    "load_checkpoint": "numscope.train.checkpoint",
    "CheckpointError": "numscope.train.checkpoint",
    "underflow_report": "numscope.train.loss_scaler",
    "Recipe": "numscope.train.recipe",
    "FP32_OPS": "numscope.train.fp32_ops",
    "keep_fp32_ops": "numscope.train.fp32_ops",
    "store_activations": "numscope.train.activations",
    # measurement
    "observe": "numscope.observe",
    "Observer": "numscope.observe",
    "Analysis": "numscope.analysis",
    "recommend": "numscope.advisor",
    "Sensitivity": "numscope.analysis",
    "sensitivity": "numscope.sensitivity",
    "local_sensitivity": "numscope.sensitivity",
    # diagnosis
    "localize": "numscope.diagnose",
    "band": "numscope.diagnose",
}

_CALLABLE_MODULES = ("formats", "sites", "convert", "observe", "sensitivity", "forecast")
for _name in _CALLABLE_MODULES:
    _EXPORTS.pop(_name, None)
#: public subpackages and modules reachable as attributes after ``import numscope`` (imported on first use)
_SUBMODULES = (
    "advisor",
    "analysis",
    "diagnose",
    "distributed",
    "forecast",
    "metrics",
    "plan",
    "report",
    "run",
    "study",
    "train",
    "workflow",
)

#: modules that live inside a package, reachable as ``numscope.<name>`` too
_NESTED = {"recipes": "numscope.plan.recipes", "export": "numscope.plan.export"}

__all__ = [
    "LossScaler",
    "NumscopeError",
    "Plan",
    "Recipe",
    "Scaling",
    "band",
    "convert",
    "encode",
    "export",
    "forecast",
    "formats",
    "get_format",
    "load_checkpoint",
    "localize",
    "observe",
    "quantize",
    "recommend",
    "save_checkpoint",
    "sensitivity",
    "unconvert",
]
"""The names a user's training script needs: formats (``formats``, ``get_format``, ``quantize``, ``encode``,
``Scaling``), plans and training (``Plan``, ``convert``, ``unconvert``, ``Recipe``, ``LossScaler``,
checkpoints), measuring and choosing (``observe``, ``sensitivity``, ``recommend``), the forecast and the
diagnosis (``forecast``, ``localize``, ``band``) and ``export``. Every other name lives in its subpackage's
``__all__`` (``numscope.formats``, ``numscope.plan``, ``numscope.train``, ...); the names this package
exported before stay reachable as attributes."""


# callable modules (see numscope._callable), public subpackages and the nested modules, each imported on use
__getattr__, __dir__ = lazy_exports(
    __name__,
    _EXPORTS,
    {**{name: f"numscope.{name}" for name in (*_CALLABLE_MODULES, *_SUBMODULES)}, **_NESTED},
)
