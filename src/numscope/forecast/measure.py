"""What a plan does to a trained FP32 model, measured on a few batches: the loss it adds to the model's
forward (evaluated as a run under the plan evaluates, on the same tokens) and the noise it adds to the
optimizer's update (its parameter-gradient error weighted by Adam's preconditioner), the two terms of
:mod:`numscope.forecast.predict`.

Every plan is applied to the same trained model in turn (:func:`numscope.convert`, then undone), so a
plan's effect is a paired difference against FP32 on identical weights and data: no training run is
needed to measure it, and its cost is a forward-backward pass per training batch and a forward pass per
validation block, per plan (:func:`measure_plans`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from numscope import _sums as sums
from numscope._device import model_device, to_device
from numscope._rng import fork_rng
from numscope.convert import convert, unconvert
from numscope.plan import Plan


@dataclass(frozen=True)
class PlanEffect:
    """One plan's measured effect on the trained model (per batch, so that its spread is known).

    loss_change: per validation chunk, the plan's loss minus FP32's on the same tokens (nats).
    update_noise: per training batch, Σ_i P_i (ĝ_i − g_i)² c², the power of the gradient error in Adam's
        preconditioned metric (P_i = 1 / (√v̂_i + ε), c the gradient clipping factor FP32's gradient gets),
        in nats per unit learning rate (what :mod:`numscope.forecast.predict` turns into loss).
    grad_rel_error: per training batch, ‖ĝ − g‖ / ‖g‖ (unweighted, for reference).
    """

    loss_change: tuple[float, ...]
    update_noise: tuple[float, ...]
    grad_rel_error: tuple[float, ...] = ()
    seconds: float = 0.0
    retained: float = 1.0
    """The smallest share of its gradient any parameter tensor keeps under the plan, ⟨ĝ, g⟩ / ‖g‖² of the
    tensor (mean over the batches; tensors holding less than a millionth of the gradient's power are not
    counted): about 1 where the plan only adds noise, near 0 where it destroys a tensor's gradient (a
    gradient flushed to zero), which the noise model of :mod:`numscope.forecast.predict` does not cover."""
    retained_by: str = ""
    """The parameter tensor that keeps the share :attr:`retained`."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "loss_change": list(self.loss_change),
            "update_noise": list(self.update_noise),
            "grad_rel_error": list(self.grad_rel_error),
            "seconds": self.seconds,
            "retained": self.retained,
            "retained_by": self.retained_by,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanEffect:
        return cls(
            tuple(float(v) for v in data["loss_change"]),
            tuple(float(v) for v in data["update_noise"]),
            tuple(float(v) for v in data.get("grad_rel_error", ())),
            float(data.get("seconds", 0.0)),
            float(data.get("retained", 1.0)),
            str(data.get("retained_by", "")),
        )


def adam_preconditioner(
    parameters: Sequence[nn.Parameter], optimizer_state: Mapping[str, Any], eps: float = 1e-8
) -> list[torch.Tensor]:
    """Adam's per-element preconditioner 1 / (√v̂ + ε) for each of ``parameters``, from a
    ``torch.optim.AdamW`` state dict whose ``state`` is keyed by the parameters' positions (as
    ``optimizer.state_dict()`` writes it); v̂ = v / (1 − β₂^step). A parameter without state (never
    updated) gets zeros: its update carries no noise."""
    state = optimizer_state.get("state", {})
    groups = optimizer_state.get("param_groups", [{}])
    beta2 = float(groups[0].get("betas", (0.9, 0.999))[1])
    eps = float(groups[0].get("eps", eps))
    out = []
    for index, parameter in enumerate(parameters):
        entry = state.get(index)
        if entry is None or "exp_avg_sq" not in entry:
            out.append(torch.zeros_like(parameter, dtype=torch.float32))
            continue
        step = float(entry["step"])
        corrected = entry["exp_avg_sq"].float() / (1.0 - beta2**step)
        out.append(1.0 / (corrected.sqrt() + eps))
    return out


Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**to_device(batch, model_device(model))).loss


def _gradients(
    model: nn.Module, parameters: list[nn.Parameter], batches: Sequence[Batch], loss_fn: LossFn
) -> list[torch.Tensor]:
    """One flat float32 gradient per batch (eval mode: the only difference between passes is the plan)."""
    out = []
    for batch in batches:
        for parameter in parameters:
            parameter.grad = None
        with fork_rng():
            loss_fn(model, batch).backward()
        out.append(
            torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                    for p in parameters
                ]
            )
        )
    for parameter in parameters:
        parameter.grad = None
    return out


def measure_plans(
    model: nn.Module,
    plans: Mapping[str, Plan],
    train_batches: Sequence[Batch],
    evaluate: Callable[[nn.Module], Sequence[float]],
    preconditioner: Sequence[torch.Tensor],
    *,
    clip: float | None = None,
    loss_fn: LossFn | None = None,
    seed: int = 0,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, PlanEffect]:
    """Each plan's :class:`PlanEffect` on ``model`` (trained, FP32, unconverted; left as it was).

    evaluate(model) -> the loss of each validation chunk (the same tokens every call: a run's own
        evaluation restricted to a few blocks); called once without a plan and once per plan.
    preconditioner: one tensor per trainable parameter, in ``model.parameters()`` order
        (:func:`adam_preconditioner`).
    clip: the run's gradient clipping norm (None: none): FP32's gradient norm g on a batch gives the factor
        min(1, clip / ‖g‖) that the update noise is scaled by, as the run's optimizer would see it.
    seed: the stochastic-rounding generator of every plan starts from it.
    """
    import time

    loss_fn = loss_fn or _loss
    parameters = [p for p in model.parameters() if p.requires_grad]
    if len(preconditioner) != len(parameters):
        raise ValueError(
            f"the preconditioner has {len(preconditioner)} tensors for {len(parameters)} trainable parameters"
        )
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    bounds = torch.tensor([0] + [p.numel() for p in parameters]).cumsum(0).tolist()
    training = model.training
    model.eval()
    try:
        reference_losses = list(evaluate(model))
        reference = _gradients(model, parameters, train_batches, loss_fn)
        powers = [_powers(g, bounds) for g in reference]  # per parameter tensor, once per batch
        norms = [math.sqrt(sum(p)) for p in powers]
        factors = [1.0 if clip is None else min(1.0, clip / max(norm, 1e-30)) for norm in norms]
        results: dict[str, PlanEffect] = {}
        for done, (name, plan) in enumerate(plans.items()):
            began = time.perf_counter()
            convert(model, plan, generator=torch.Generator(model_device(model)).manual_seed(seed))
            try:
                losses = list(evaluate(model))
                grads = _gradients(model, parameters, train_batches, loss_fn)
            finally:
                unconvert(model)
            noise, relative = [], []
            shares = torch.zeros(len(parameters), dtype=torch.float64)
            for grad, ref, factor, norm, power_of in zip(
                grads, reference, factors, norms, powers, strict=True
            ):
                shares += _retained(grad, ref, bounds, power_of)
                power, error_power, finite = _error_powers(grad, ref, preconditioner, bounds)
                noise.append(power * factor**2 if finite else math.inf)
                relative.append(math.sqrt(error_power) / max(norm, 1e-30))
            shares /= len(grads)
            worst = int(shares.argmin())
            results[name] = PlanEffect(
                tuple(a - b for a, b in zip(losses, reference_losses, strict=True)),
                tuple(noise),
                tuple(relative),
                time.perf_counter() - began,
                float(shares[worst]),
                names[worst],
            )
            if on_progress is not None:
                on_progress(done + 1, len(plans))
    finally:
        model.train(training)
    return results


def _powers(flat: torch.Tensor, bounds: list[int]) -> list[float]:
    """Each parameter tensor's squared 2-norm in a flat gradient (``bounds``: its slice), summed in
    float64."""
    return [sums.power(flat[bounds[i] : bounds[i + 1]]) for i in range(len(bounds) - 1)]


def _error_powers(
    grad: torch.Tensor, reference: torch.Tensor, weight: Sequence[torch.Tensor], bounds: list[int]
) -> tuple[float, float, bool]:
    """Σ P_i (ĝ_i − g_i)² and Σ (ĝ_i − g_i)² in float64, and whether every error is finite (non-finite
    errors count as 0 in the sums), a slice of one parameter tensor at a time (``bounds``: its slice of
    the flat gradients; :mod:`numscope._sums`): the temporaries stay small (the whole model's in float64
    would be several GB on MPNet-110M)."""
    power, error_power, finite = 0.0, 0.0, True
    for index, preconditioner in enumerate(weight):
        part = slice(bounds[index], bounds[index + 1])
        for g, r, p in sums.slices(grad[part], reference[part], preconditioner):
            error = g - r
            if not bool(torch.isfinite(error).all()):
                finite = False
                error = torch.where(torch.isfinite(error), error, torch.zeros_like(error))
            squared = error.double().square_()
            error_power += float(squared.sum())
            power += float(squared.mul_(p).sum())
    return power, error_power, finite


def _retained(
    grad: torch.Tensor, reference: torch.Tensor, bounds: list[int], powers: Sequence[float]
) -> torch.Tensor:
    """Per parameter tensor (``bounds``: its slice of the flat gradients) ⟨ĝ, g⟩ / ‖g‖², given each
    tensor's ‖g‖² (``powers``, :func:`_powers`); 1 for a tensor holding less than a millionth of the
    gradient's power (its share is not measurable)."""
    total = sum(powers)
    out = torch.ones(len(bounds) - 1, dtype=torch.float64)
    for index, power in enumerate(powers):
        part = slice(bounds[index], bounds[index + 1])
        h = grad[part]
        if not bool(torch.isfinite(h).all()):
            out[index] = 0.0
        elif power > 1e-6 * total:
            # multiplied then summed as the powers are squared then summed: ĝ = g gives exactly 1
            inner = sum(float((a.double() * b.double()).sum()) for a, b in sums.slices(reference[part], h))
            out[index] = inner / power
    return out


def chunked(values: Iterable[Any], size: int) -> list[list[Any]]:
    """``values`` in consecutive lists of ``size``."""
    items = list(values)
    return [items[start : start + size] for start in range(0, len(items), size)]
