"""Sensitivity: quantize one site (or one operand) at a time and measure the loss and the gradient.

::

    result = numscope.sensitivity(model, batches, candidates=["fp8_e4m3", "mxfp4_e2m1"])
    for row in result.table():                  # most harmful first
        print(row)
    analysis.sensitivity = result               # saved with the analysis (analysis.json)
    plan = numscope.recommend(analysis, max_loss_increase_pct=0.5, min_grad_cosine=0.999)

For every target — a site (all six operands of its three GEMMs) or, with ``granularity="operand"``, one
operand of one GEMM — and every candidate, the model is converted with :func:`numscope.convert` to a plan
that quantizes only that target (in the candidate format with its default scaling; the candidate
``"plan"`` uses the spec a given plan has for it) and leaves every other operand high. Each batch is run
forward and backward; the loss and the full parameter gradient are compared with those of the
unconverted model on the same batch (metrics: :class:`numscope.analysis.Sensitivity`). The model is run
in eval mode (no dropout: the only difference is the quantization) unless ``train_mode=True``, in which
case every pass of a batch starts from the same random state. Parameters are never updated; the
gradients the model held before are restored, and so are its training flags.

Cost: ``len(batches) × (1 + targets × candidates)`` forward and backward passes; restrict ``sites`` (glob
patterns over site names) or the candidates to spend fewer. The FP32 gradients of every batch are kept
(one float32 copy of the parameters per batch).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from numscope._callable import make_callable as _make_callable
from numscope._names import exact_pattern
from numscope._rng import fork_rng
from numscope.analysis import ALL, OperandKey, Sensitivity
from numscope.convert import convert, unconvert
from numscope.formats.spec import get_format
from numscope.plan import HIGH, OperandSpec, Plan, Rule, SiteSpec
from numscope.sites import attach, attached, operand_sizes
from numscope.sites import sites as find_sites
from numscope.vocab import OPERANDS

PLAN_LABEL = "plan"
GRANULARITIES = ("site", "operand")
HANDLER_NAME = "numscope.sensitivity"

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class _KeepSites:
    """A handler that is never wanted: it keeps the model's site table (found once) between the converts."""

    def wants(self, site: Any) -> bool:
        return False

    def __call__(self, site: Any, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return tensor


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's own loss: ``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, else
    ``model(batch)``; the output's ``loss`` (attribute or key), or the output itself if it is a scalar."""
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, tuple | list):
        output = model(*batch)
    else:
        output = model(batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            f"the model's output ({type(output).__name__}) has no scalar loss; pass "
            "loss_fn=lambda model, batch: <a scalar loss tensor>"
        )
    return loss


def sensitivity(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    candidates: Sequence[str] = (),
    plan: Plan | None = None,
    loss_fn: LossFn | None = None,
    sites: Sequence[str] | None = None,
    granularity: str = "site",
    train_mode: bool = False,
    seed: int = 0,
    on_progress: Callable[[int, int], None] | None = None,
) -> Sensitivity:
    """Quantize one target at a time and measure the loss change and gradient similarity against FP32.

    candidates: format names (each target quantized in the format with its default scaling).
    plan: also measure ``"plan"``: each target quantized as this plan says (targets the plan leaves high
        are skipped). At least one candidate or a plan is needed.
    loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (default: :func:`default_loss`).
    sites: fnmatch patterns over site names (default: every site the model calls); each must match.
    granularity: ``"site"`` (all six operands of a site together) or ``"operand"`` (each operand alone).
    train_mode: run in training mode (dropout on, the same random state for every pass of a batch).
    seed: the random state of each batch's passes in train mode (``seed + batch index``).
    on_progress: called as ``on_progress(done, total)`` after each (target, candidate) measured, for a
        progress bar (a measurement of every operand in several formats takes minutes).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; allowed: {', '.join(GRANULARITIES)}")
    labels = tuple(dict.fromkeys(get_format(c).name for c in candidates))
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a numscope.Plan, got {type(plan).__name__}")
    if not labels and plan is None:
        raise ValueError("sensitivity needs at least one candidate format or a plan")
    data = list(batches)
    if not data:
        raise ValueError("sensitivity needs at least one batch")
    if attached(model):
        raise ValueError(
            "sensitivity needs a model without numscope handlers attached (it converts the model itself); "
            f"attached: {', '.join(attached(model))}"
        )
    loss_fn = loss_fn or default_loss
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        raise ValueError("the model has no parameters that require gradients")
    saved_grads = [p.grad for p in parameters]
    training = {name: module.training for name, module in model.named_modules()}
    model.train(train_mode)
    handle = attach(model, _KeepSites(), name=HANDLER_NAME)
    try:
        run = _Runner(model, parameters, data, loss_fn, train_mode, seed)
        reference = run()
        targets = _targets(model, sites, granularity)
        results: dict[OperandKey, dict[str, dict[str, float]]] = {}
        done, total = 0, len(targets) * (len(labels) + (plan is not None))
        for target in targets:
            specs = {label: _spec(target, OperandSpec(label)) for label in labels}
            if plan is not None:
                plan_spec = _plan_spec(target, plan)
                if plan_spec is not None:
                    specs[PLAN_LABEL] = plan_spec
            for label, spec in specs.items():
                convert(model, Plan(SiteSpec(), (Rule(exact_pattern(target[0]), spec),)))
                try:
                    results.setdefault(target, {})[label] = _compare(run(), reference)
                finally:
                    unconvert(model)
                done += 1
                if on_progress is not None:
                    on_progress(done, total)
    finally:
        handle.remove()
        for name, module in model.named_modules():
            module.training = training.get(name, module.training)
        for parameter, grad in zip(parameters, saved_grads, strict=True):
            parameter.grad = grad
    return Sensitivity(
        candidates=labels + ((PLAN_LABEL,) if plan is not None else ()),
        granularity=granularity,
        reference_loss=[loss for loss, _ in reference],
        results=results,
        meta={"batches": len(data), "train_mode": train_mode, "targets": len(targets)},
    )


class _Runner:
    """Runs every batch forward and backward: (loss, flattened float32 gradient) per batch."""

    def __init__(
        self,
        model: nn.Module,
        parameters: list[nn.Parameter],
        data: list[Any],
        loss_fn: LossFn,
        train_mode: bool,
        seed: int,
    ) -> None:
        self.model, self.parameters, self.data = model, parameters, data
        self.loss_fn, self.train_mode, self.seed = loss_fn, train_mode, seed

    def __call__(self) -> list[tuple[float, torch.Tensor]]:
        out = []
        for index, batch in enumerate(self.data):
            for parameter in self.parameters:
                parameter.grad = None
            # torch.manual_seed reseeds every CUDA generator too: fork those with the CPU's, so that a
            # user's GPU run does not see its random stream reset or shifted by the measurement
            with fork_rng():
                if self.train_mode:
                    torch.manual_seed(self.seed + index)
                loss = self.loss_fn(self.model, batch)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(f"loss_fn must return a scalar tensor, got {_describe(loss)}")
                loss.backward()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
            out.append((float(loss.detach()), torch.cat([g.detach().reshape(-1).float() for g in grads])))
        return out


def combine_sensitivities(measured: Sequence[Sensitivity], label: str) -> Sensitivity:
    """One sensitivity from the same targets measured on several checkpoints of a training run (the trained
    model and an early one): each checkpoint's squared ``grad_rel_error`` divided by its total over the
    targets in ``label`` (so that every checkpoint weighs alike, whatever its gradients' size), summed over
    the checkpoints; ``grad_rel_error`` is the square root of that sum. The other metrics are the first
    checkpoint's. Why: on a GQA Llama a plan chosen from the trained model's sensitivity alone cost 4× its
    prediction and twice what one chosen from the trained and the step-20 model cost (docs/plan-study.md,
    "When the sensitivity is measured")."""
    if not measured:
        raise ValueError("combine_sensitivities needs at least one measured sensitivity")
    first = measured[0]
    for other in measured[1:]:
        if set(other.results) != set(first.results) or other.granularity != first.granularity:
            raise ValueError("the sensitivities to combine must measure the same targets at one granularity")
    totals = []
    for one in measured:
        if label not in one.candidates:
            raise ValueError(f"{label!r} was not measured (measured: {', '.join(one.candidates)})")
        total = sum(float(metrics[label]["grad_rel_error"]) ** 2 for metrics in one.results.values())
        totals.append(total if total > 0 else 1.0)
    results: dict[OperandKey, dict[str, dict[str, float]]] = {}
    for key, by_label in first.results.items():
        results[key] = {}
        for name, metrics in by_label.items():
            power = sum(
                float(one.results[key][name]["grad_rel_error"]) ** 2 / total
                for one, total in zip(measured, totals, strict=True)
                if name in one.results[key]
            )
            results[key][name] = {**metrics, "grad_rel_error": math.sqrt(power)}
    meta = {**first.meta, "checkpoints": len(measured), "normalized_by": label}
    return Sensitivity(
        candidates=first.candidates,
        granularity=first.granularity,
        reference_loss=first.reference_loss,
        results=results,
        meta=meta,
    )


def _compare(run: list[tuple[float, torch.Tensor]], reference: list[tuple[float, torch.Tensor]]) -> dict:
    losses = [loss for loss, _ in run]
    reference_losses = [loss for loss, _ in reference]
    cosines, errors = [], []
    for (_, grad), (_, reference_grad) in zip(run, reference, strict=True):
        grad, reference_grad = grad.double(), reference_grad.double()
        norm, reference_norm = float(grad.norm()), float(reference_grad.norm())
        if norm == 0 or reference_norm == 0:
            cosines.append(1.0 if norm == reference_norm else 0.0)
        else:
            cosines.append(float(grad @ reference_grad) / (norm * reference_norm))
        difference = float((grad - reference_grad).norm())
        errors.append(_ratio(difference, reference_norm))
    mean_loss = sum(losses) / len(losses)
    mean_reference = sum(reference_losses) / len(reference_losses)
    change = mean_loss - mean_reference
    return {
        "loss": mean_loss,
        "loss_change": change,
        "loss_change%": 100.0 * _ratio(change, abs(mean_reference)),
        "grad_cosine": sum(cosines) / len(cosines),
        "grad_cosine_min": min(cosines),
        "grad_rel_error": sum(errors) / len(errors),
    }


def _targets(model: nn.Module, patterns: Sequence[str] | None, granularity: str) -> list[OperandKey]:
    """The sites the model called in its last forward, in call order, filtered by ``patterns``."""
    called = operand_sizes(model)
    names = [site.name for site in find_sites(model) if site.name in called]
    names += [name for name in called if name not in names]
    if patterns is not None:
        if isinstance(patterns, str):
            patterns = [patterns]
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                shown = ", ".join(names[:5]) + (", …" if len(names) > 5 else "")
                raise ValueError(f"sites pattern {pattern!r} matches no site; sites: {shown or '(none)'}")
        names = [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    if granularity == "site":
        return [(name, ALL, ALL) for name in names]
    return [(name, gemm, operand) for name in names for gemm, ops in OPERANDS.items() for operand in ops]


def _spec(target: OperandKey, operand_spec: OperandSpec) -> SiteSpec:
    _, gemm, operand = target
    if gemm == ALL:
        return SiteSpec.uniform(operand_spec)
    return SiteSpec().with_operand(gemm, operand, operand_spec)


def _plan_spec(target: OperandKey, plan: Plan) -> SiteSpec | None:
    """The plan's spec of the target alone (None where the plan leaves it high)."""
    site, gemm, operand = target
    site_spec = plan.for_site(site)
    if gemm == ALL:
        return None if site_spec.is_high else site_spec
    operand_spec = site_spec.operand(gemm, operand)
    return None if operand_spec.format == HIGH else SiteSpec().with_operand(gemm, operand, operand_spec)


def _ratio(value: float, base: float) -> float:
    """value / base, with 0/0 = 0 and x/0 = ±inf."""
    if base:
        return value / base
    return 0.0 if value == 0 else math.copysign(math.inf, value)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


_make_callable(__name__, "sensitivity")
