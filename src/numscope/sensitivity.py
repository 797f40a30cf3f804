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

from numscope import _sums as sums
from numscope._callable import make_callable as _make_callable
from numscope._device import model_device, to_device
from numscope._names import exact_pattern, layer_role
from numscope._rng import fork_rng
from numscope.analysis import ALL, OperandKey, Sensitivity
from numscope.convert import convert, quantize_operand, unconvert
from numscope.formats.spec import get_format
from numscope.plan import HIGH, OperandSpec, Plan, Rule, SiteSpec
from numscope.sites import attach, attached, operand_sizes
from numscope.sites import sites as find_sites
from numscope.vocab import OPERANDS, Gemm, Operand

__all__ = [
    "GRANULARITIES",
    "METHODS",
    "combine_sensitivities",
    "default_loss",
    "local_sensitivity",
    "sensitivity",
]

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
        output = model(**to_device(batch, model_device(model)))
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
    prediction and twice what one chosen from the trained and the step-20 model cost
    (docs/results/plan-study.md,
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
        power, reference_power, inner, error_power = sums.moments(grad, reference_grad)
        norm, reference_norm = math.sqrt(power), math.sqrt(reference_power)
        if norm == 0 or reference_norm == 0:
            cosines.append(1.0 if norm == reference_norm else 0.0)
        else:
            cosines.append(inner / (norm * reference_norm))
        errors.append(_ratio(math.sqrt(error_power), reference_norm))
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


# -- the local method: every operand and format from a few passes per batch ---------------------------------

METHODS = ("local", "one_at_a_time")
"""How :func:`local_sensitivity` and :func:`sensitivity` measure an operand's sensitivity."""

#: site kinds whose operands the local method measures at their GEMM (the others: one at a time)
LOCAL_KINDS = ("linear", "conv1d", "matmul", "sdpa")
#: site kinds whose wgrad output is a weight's gradient (its error changes that gradient and nothing else)
WEIGHT_KINDS = ("linear", "conv1d")


def _mm(x: torch.Tensor, x_axis: int, y: torch.Tensor, y_axis: int) -> torch.Tensor:
    """The GEMM of two operands in numscope's layout: contracted along their given axes."""
    return torch.matmul(x.movedim(x_axis, -1).float(), y.movedim(y_axis, -2).float())


def _power(x: torch.Tensor) -> float:
    return sums.power(x)


class _LocalErrors:
    """An operand handler that measures, for every candidate, each operand's error at its own GEMM.

    Per site and batch, in backward (every operand of the site is then at hand): fprop's input and weight
    by Σ over the output's rows of ⟨dY, ΔY⟩² (ΔY: the output's change when the operand alone is quantized,
    dY: the output's gradient; the loss change's second moment), dgrad's and wgrad's operands by ‖ΔOut‖²
    (the change of the input gradient, or of the weight gradient, that their GEMM computes). Returns every
    operand unchanged."""

    def __init__(self, specs: Mapping[str, OperandSpec], sites: set[str]) -> None:
        self.specs = dict(specs)
        self.sites = sites
        self.pending: dict[str, dict[tuple[str, str], tuple[torch.Tensor, int]]] = {}
        self.values: dict[OperandKey, dict[str, float]] = {}

    def wants(self, site: Any) -> bool:
        return site.name in self.sites

    def __call__(self, site: Any, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        entry = self.pending.setdefault(site.name, {})
        entry[(gemm, operand)] = (tensor.detach(), axis)
        partner = next(o for o in OPERANDS[gemm] if o != operand)
        if gemm != Gemm.FPROP and (gemm, partner) in entry:
            self._backward(site.name, gemm, entry)
        return tensor

    def _quantized(self, label: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return quantize_operand(self.specs[label], tensor, axis)

    def _add(self, key: OperandKey, label: str, value: float) -> None:
        per = self.values.setdefault(key, {})
        per[label] = per.get(label, 0.0) + value

    def _backward(self, site: str, gemm: str, entry: dict) -> None:
        first, second = OPERANDS[gemm]
        (a, a_axis), (b, b_axis) = entry.pop((gemm, first)), entry.pop((gemm, second))
        for label in self.specs:
            change = _mm(self._quantized(label, a, a_axis) - a.float(), a_axis, b, b_axis)
            self._add((site, gemm, first), label, _power(change))
            change = _mm(a, a_axis, self._quantized(label, b, b_axis) - b.float(), b_axis)
            self._add((site, gemm, second), label, _power(change))
        # fprop's operands, once its output's gradient is known (grad_output: `first` of both backward GEMMs)
        if (Gemm.FPROP, Operand.INPUT) in entry and (Gemm.FPROP, Operand.WEIGHT) in entry:
            gradient = a.float() if gemm == Gemm.DGRAD or a.dim() == 2 else None
            x, x_axis = entry.pop((Gemm.FPROP, Operand.INPUT))
            w, w_axis = entry.pop((Gemm.FPROP, Operand.WEIGHT))
            if gradient is None:
                return
            for label in self.specs:
                for operand, change in (
                    (Operand.INPUT, _mm(self._quantized(label, x, x_axis) - x.float(), x_axis, w, w_axis)),
                    (Operand.WEIGHT, _mm(x, x_axis, self._quantized(label, w, w_axis) - w.float(), w_axis)),
                ):
                    if change.numel() != gradient.numel():
                        continue
                    rows = (change * gradient.reshape(change.shape)).sum(-1)
                    self._add((site, Gemm.FPROP, operand), label, _power(rows))

    def end_batch(self) -> dict[OperandKey, dict[str, float]]:
        """This batch's values, and a fresh start for the next one."""
        values, self.values = self.values, {}
        self.pending.clear()
        return values


def _group(kind: str, gemm: str) -> str:
    """The group an operand's gain is measured for: its GEMM role, and whether its site has a weight."""
    return f"{'weight' if kind in WEIGHT_KINDS else 'activation'}:{gemm}"


def _groups(
    targets: Sequence[OperandKey], local_sites: set[str], kinds: Mapping[str, str], depth_bins: int
) -> dict[str, list[OperandKey]]:
    """The operands of the local sites by group: their GEMM role and whether their site has a weight
    (:func:`_group`), the role their site plays in its layer (``layer_role``: every layer's ``down_proj``
    together, a site outside the layers alone) and, within that, ``depth_bins`` consecutive runs of its sites
    in call order (``weight:dgrad|model.layers.*.mlp.down_proj@0`` the first). An error's reach depends on
    what its GEMM's output feeds (a projection entering a branch from a normalisation, or one leaving it for
    the residual stream) and on where it enters."""
    by_role: dict[str, list[OperandKey]] = {}
    for key in targets:
        if key[0] in local_sites:
            role = f"{_group(kinds[key[0]], key[1])}|{layer_role(key[0])}"
            by_role.setdefault(role, []).append(key)
    groups: dict[str, list[OperandKey]] = {}
    for role, keys in by_role.items():
        names = list(dict.fromkeys(key[0] for key in keys))
        bins = max(1, min(depth_bins, len(names)))
        for index, name in enumerate(names):
            group = f"{role}@{index * bins // len(names)}"
            groups.setdefault(group, []).extend(key for key in keys if key[0] == name)
    return groups


def local_sensitivity(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    candidates: Sequence[str],
    loss_fn: LossFn | None = None,
    sites: Sequence[str] | None = None,
    gain_format: str | None = None,
    depth_bins: int = 2,
    gain_batches: int = 1,
    seed: int = 0,
    on_progress: Callable[[int, int], None] | None = None,
) -> Sensitivity:
    """Every operand's sensitivity in every candidate, at a cost that does not grow with the operand count.

    One forward and backward pass per batch measures, for every operand of every site and every candidate,
    the operand's error where it enters its GEMM (:class:`_LocalErrors`): an fprop operand by the second
    moment of the loss change its output error makes, Σ over output rows of ⟨dY, ΔY⟩²; a dgrad or wgrad
    operand by the power of the gradient error its GEMM's output carries, ‖ΔOut‖². A wgrad operand of a
    weight's site changes that weight's gradient and nothing else: its ‖ΔOut‖² *is* the parameter gradient's
    error. The others travel on through the model; how far is measured, not assumed: one more pass per
    group of operands quantizes the whole group in ``gain_format`` (default: the candidate with the fewest
    bits, whose errors are the largest) and gives the group's **gain**, the parameter gradient's error power
    over the sum of the group's local values. A group is a GEMM role (fprop, dgrad, wgrad) at the sites of
    one role in their layers (every layer's ``down_proj``; a site outside the layers alone; weight sites and
    activation products apart), cut into ``depth_bins`` runs of those sites in call order: an error's reach
    depends on what its GEMM's output feeds (a projection entering a branch from a normalisation, one
    leaving it for the residual stream) and on where it enters. An operand's estimate is its local value
    times its group's gain, as ``grad_rel_error`` = √(estimate / ‖g‖²): the metric :func:`sensitivity`
    measures one operand at a time, which the advisor's sensitivity objective reads (docs/results/forecast.md
    compares them on four models).

    Cost: 2 passes per batch, plus one pass per group on ``gain_batches`` batches (the number of groups
    grows with the kinds of sites in a layer and ``depth_bins``, not with the layers or operands), plus the
    measurement's own GEMMs (five per site and candidate, each the size of one of the site's GEMMs); sites
    of other kinds (convolutions, recurrent cells) are measured one at a time (:func:`sensitivity`). Run in
    eval mode (no dropout); the model, its gradients and its training flags are left as they were."""
    labels = tuple(dict.fromkeys(get_format(c).name for c in candidates))
    if not labels:
        raise ValueError("local_sensitivity needs at least one candidate format")
    if gain_format is None:
        gain_format = min(labels, key=lambda name: (get_format(name).bits_per_element, labels.index(name)))
    elif get_format(gain_format).name not in labels:
        raise ValueError(f"gain_format {gain_format!r} is not among the candidates ({', '.join(labels)})")
    gain_format = get_format(gain_format).name
    data = list(batches)
    if not data:
        raise ValueError("local_sensitivity needs at least one batch")
    if attached(model):
        raise ValueError(
            "local_sensitivity needs a model without numscope handlers attached (it converts the model "
            f"itself); attached: {', '.join(attached(model))}"
        )
    loss_fn = loss_fn or default_loss
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        raise ValueError("the model has no parameters that require gradients")
    saved_grads = [p.grad for p in parameters]
    training = {name: module.training for name, module in model.named_modules()}
    model.train(False)
    run = _Runner(model, parameters, data, loss_fn, False, seed)
    gain_run = _Runner(model, parameters, data[:gain_batches], loss_fn, False, seed)
    keeper = attach(model, _KeepSites(), name=HANDLER_NAME)  # the site table, found once for every pass
    try:
        reference = run()
        targets = _targets(model, sites, "operand")
        kinds = {site.name: site.kind for site in find_sites(model)}
        local_sites = {name for name, _, _ in targets if kinds.get(name) in LOCAL_KINDS}
        others = sorted({name for name, _, _ in targets if name not in local_sites})
        specs = {label: OperandSpec(label) for label in labels}
        measuring = _LocalErrors(specs, local_sites)
        handle = attach(model, measuring, name=HANDLER_NAME + ".local")
        per_batch: list[dict[OperandKey, dict[str, float]]] = []
        try:
            for batch in data:
                _Runner(model, parameters, [batch], loss_fn, False, seed)()
                per_batch.append(measuring.end_batch())
        finally:
            handle.remove()
        groups = _groups(targets, local_sites, kinds, depth_bins)
        gains: dict[str, float] = {g: 1.0 for g in groups if g.startswith(_group("linear", Gemm.WGRAD))}
        passes = [g for g in groups if g not in gains]
        total = len(passes) + len(others)
        for done, group in enumerate(passes):
            rules = []
            for site, gemm, operand in groups[group]:
                spec = SiteSpec().with_operand(gemm, operand, OperandSpec(gain_format))
                rules.append((site, spec))
            plan = Plan(SiteSpec(), tuple(_merged_rules(rules)))
            convert(model, plan)
            try:
                measured = gain_run()
            finally:
                unconvert(model)
            pairs = zip(measured, reference, strict=False)
            error = sum(sums.distance_power(grad, ref) for (_, grad), (_, ref) in pairs)
            local = sum(
                values.get(key, {}).get(gain_format, 0.0)
                for values in per_batch[:gain_batches]
                for key in groups[group]
            )
            gains[group] = error / local if local > 0 else 0.0
            if on_progress is not None:
                on_progress(done + 1, total)
    finally:
        keeper.remove()
        for name, module in model.named_modules():
            module.training = training.get(name, module.training)
        for parameter, grad in zip(parameters, saved_grads, strict=True):
            parameter.grad = grad
    gradient_power = sum(sums.power(ref) for _, ref in reference) / len(reference)
    results: dict[OperandKey, dict[str, dict[str, float]]] = {}
    for group, keys in groups.items():
        for key in keys:
            for label in labels:
                estimate = gains[group] * sum(v.get(key, {}).get(label, 0.0) for v in per_batch) / len(data)
                results.setdefault(key, {})[label] = {
                    "grad_rel_error": math.sqrt(estimate / gradient_power) if gradient_power > 0 else 0.0,
                    "local": estimate,
                }
    meta: dict[str, Any] = {
        "batches": len(data),
        "train_mode": False,
        "targets": len(targets),
        "method": "local",
        "gain_format": gain_format,
        "gains": gains,
        "passes_per_batch": 2 + len(passes) * min(gain_batches, len(data)) / len(data),
        "gain_passes": len(passes),
    }
    if others:  # sites the local method does not read: one operand at a time
        measured_alone = sensitivity(
            model,
            data,
            candidates=list(labels),
            loss_fn=loss_fn,
            sites=others,
            granularity="operand",
            seed=seed,
            on_progress=(lambda d, t: on_progress(len(passes) + d, len(passes) + t)) if on_progress else None,
        )
        results.update(measured_alone.results)
        meta["one_at_a_time_sites"] = others
    return Sensitivity(
        candidates=labels,
        granularity="operand",
        reference_loss=[loss for loss, _ in reference],
        results=results,
        meta=meta,
    )


def _merged_rules(rules: list[tuple[str, SiteSpec]]) -> list[Rule]:
    """One exact rule per site, its operands' specs merged (a group may hold several operands of a site)."""
    merged: dict[str, SiteSpec] = {}
    for site, spec in rules:
        current = merged.get(site, SiteSpec())
        for (gemm, operand), operand_spec in spec.operands.items():
            if operand_spec.format != HIGH:
                current = current.with_operand(gemm, operand, operand_spec)
        merged[site] = current
    return [Rule(exact_pattern(site), spec) for site, spec in merged.items()]
