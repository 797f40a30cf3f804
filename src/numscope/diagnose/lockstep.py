"""FP32 and a plan trained in lockstep: the same initialisation, batches, masks and dropout draws, step by
step, with every site's operands compared between the two models (:func:`lockstep`).

Per site and recorded step it keeps four relative figures (each ``‖a − b‖ / ‖b‖``, ``b`` the reference):

* ``input`` — the site's forward input in the plan's model against FP32's (drift carried in from below);
* ``grad_output`` — the gradient arriving at the site (drift carried in from above);
* ``weight`` — the site's weight (parameter drift, or for an attention product its second activation);
* ``local`` — the largest relative error the plan's own casts put on one of the site's operands at that
  step (what this site adds, whatever it was handed), and ``flushed``: the largest share of an operand's
  nonzero elements its cast set to zero; None at a site the plan keeps high.

A site called more than once in a step (a module applied twice) is compared at its first call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from numscope._device import model_device, to_device
from numscope._rng import restore_rng, rng_snapshot
from numscope.plan import Plan
from numscope.sites import attach
from numscope.sites.gemm import Site
from numscope.vocab import Operand

#: the drift figures of :class:`Drift`, in the order a report shows them
FIGURES = ("input", "grad_output", "weight", "local", "flushed")


@dataclass
class Drift:
    """What :func:`lockstep` recorded: per figure (:data:`FIGURES`) a list over recorded steps of a list
    over ``sites`` (None where a site did not run that step); the training losses of both models."""

    sites: list[str]
    steps: list[int] = field(default_factory=list)
    figures: dict[str, list[list[float | None]]] = field(default_factory=lambda: {f: [] for f in FIGURES})
    operand_local: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per site, per operand: the mean over recorded steps of the relative error the plan's cast put on
    it (the operand whose error ``local`` took)."""
    loss_reference: list[float] = field(default_factory=list)
    loss_plan: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sites": self.sites,
            "steps": self.steps,
            "figures": self.figures,
            "operand_local": self.operand_local,
            "loss_reference": self.loss_reference,
            "loss_plan": self.loss_plan,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Drift:
        return cls(
            list(data["sites"]),
            list(data["steps"]),
            {k: list(v) for k, v in data["figures"].items()},
            dict(data["operand_local"]),
            list(data["loss_reference"]),
            list(data["loss_plan"]),
        )

    def mean(self, figure: str) -> dict[str, float]:
        """Per site, the mean of ``figure`` over the recorded steps where it ran."""
        out = {}
        for k, site in enumerate(self.sites):
            values = [row[k] for row in self.figures[figure] if row[k] is not None]
            out[site] = sum(values) / len(values) if values else 0.0
        return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    reference = float(torch.linalg.vector_norm(b))
    difference = float(torch.linalg.vector_norm(a - b))
    if reference == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / reference


class _Seen:
    """An operand handler that keeps each site operand's first tensor of a step (unchanged) while recording:
    a copy (``copy``: the reference's, whose step runs first; and every weight) or the tensor itself."""

    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.recording = True
        self.tensors: dict[tuple[str, str], torch.Tensor] = {}

    def __call__(self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        key = (site.name, operand)
        if self.recording and key not in self.tensors:
            # weights are updated in place by the optimizer step before the step's figures are taken
            keep = self.copy or operand == Operand.WEIGHT
            self.tensors[key] = tensor.detach().clone() if keep else tensor.detach()
        return tensor


class _CastError:
    """Attached after the plan's quantizer: the relative error and the flushed share of each cast,
    against what :class:`_Seen` (attached before it) kept of the same call."""

    def __init__(self, before: dict[tuple[str, str, str], torch.Tensor]) -> None:
        self.before = before
        self.errors: dict[tuple[str, str], tuple[float, float]] = {}
        self.recording = True

    def __call__(self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        original = self.before.pop((site.name, gemm, operand), None)
        if not self.recording:
            return tensor
        if original is None or (site.name, operand) in self.errors:
            return tensor
        nonzero = original != 0
        count = int(nonzero.sum())
        flushed = int((nonzero & (tensor == 0)).sum()) / count if count else 0.0
        self.errors[(site.name, operand)] = (_relative(tensor, original), flushed)
        return tensor


class _Before:
    """Attached before the plan's quantizer: hands each call's operand to :class:`_CastError`."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str, str], torch.Tensor] = {}
        self.recording = True

    def __call__(self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        if self.recording:
            self.calls[(site.name, gemm, operand)] = tensor
        return tensor


def lockstep(
    factory: Callable[[], nn.Module],
    plan: Plan,
    batch_at: Callable[[int], dict[str, torch.Tensor]],
    *,
    steps: int,
    seed: int,
    lr_at: Callable[[int], float],
    weight_decay: float,
    grad_clip: float,
    every: int = 1,
    on_step: Callable[[int, float], None] | None = None,
) -> Drift:
    """Train FP32 and ``plan`` side by side for ``steps`` steps and record their drift every ``every``
    steps (and at the last).

    factory: builds the model; called twice after ``torch.manual_seed(seed)`` (the two must be equal: a
        ValueError says so where they are not). batch_at(step): the batch of a step, the same for both.
    The plan's model trains as ``numscope train`` trains it (:func:`numscope.run.loop.run_recipe`, no loss
    scaling); both with AdamW at ``lr_at(step)`` and
    their gradients' global norm clipped to ``grad_clip``. The global random state (dropout) is set
    alike before each model's step. on_step(step, loss) is called after each step with the plan's loss.
    """
    from numscope.run.loop import run_recipe
    from numscope.sites import sites as list_sites
    from numscope.train.loss_scaler import LossScaler

    torch.manual_seed(seed)
    reference = factory()
    torch.manual_seed(seed)
    low = factory()
    ref_state, low_state = reference.state_dict(), low.state_dict()
    if ref_state.keys() != low_state.keys() or any(
        not torch.equal(ref_state[k], low_state[k]) for k in ref_state
    ):
        raise ValueError("the model factory does not build the same weights twice from one seed")
    seen_reference, seen_low, before = _Seen(copy=True), _Seen(copy=False), _Before()
    handles = [
        attach(reference, seen_reference, name="numscope.lockstep"),
        attach(low, seen_low, name="numscope.lockstep"),
    ]
    handles.append(attach(low, before, name="numscope.lockstep.before"))
    recipe = run_recipe(low, plan, LossScaler(enabled=False), seed)
    cast_error = _CastError(before.calls)
    handles.append(attach(low, cast_error, name="numscope.lockstep.after"))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr_at(0), weight_decay=weight_decay)
    low_optimizer = torch.optim.AdamW(recipe.parameters(), lr=lr_at(0), weight_decay=weight_decay)
    drift: Drift | None = None
    sums: dict[tuple[str, str], list[float]] = {}
    reference.train()
    low.train()
    try:
        for step in range(steps):
            batch = to_device(batch_at(step), model_device(reference))
            record = (step + 1) % every == 0 or step + 1 == steps
            for handler in (seen_reference, seen_low, before, cast_error):
                handler.recording = record
            for optimizer in (reference_optimizer, low_optimizer):
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
            rng = rng_snapshot()
            loss = reference(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), grad_clip)
            reference_optimizer.step()
            reference_optimizer.zero_grad(set_to_none=True)
            restore_rng(rng)
            low_loss = low(**batch).loss
            recipe.backward(low_loss)
            recipe.unscale_(low_optimizer)
            torch.nn.utils.clip_grad_norm_(recipe.parameters(), grad_clip)
            recipe.step(low_optimizer)
            if drift is None:
                drift = Drift([site.name for site in list_sites(low)])
            drift.loss_reference.append(float(loss.detach()))
            drift.loss_plan.append(float(low_loss.detach()))
            if record:
                drift.steps.append(step + 1)
                for figure in FIGURES:
                    drift.figures[figure].append(
                        _row(drift.sites, figure, seen_reference, seen_low, cast_error, plan)
                    )
                for (site, operand), (error, _) in cast_error.errors.items():
                    sums.setdefault((site, operand), []).append(error)
            seen_reference.tensors.clear()
            seen_low.tensors.clear()
            cast_error.errors.clear()
            before.calls.clear()
            if on_step is not None:
                on_step(step + 1, drift.loss_plan[-1])
    finally:
        for handle in handles:
            handle.remove()
    assert drift is not None  # steps >= 1
    for (site, operand), values in sums.items():
        drift.operand_local.setdefault(site, {})[operand] = sum(values) / len(values)
    return drift


def _row(
    names: list[str], figure: str, reference: _Seen, low: _Seen, cast_error: _CastError, plan: Plan
) -> list[float | None]:
    row: list[float | None] = []
    for name in names:
        if figure in ("local", "flushed") and not plan.for_site(name).operands:
            row.append(None)  # a site the plan keeps high casts nothing
        elif figure in ("local", "flushed"):
            found = [v for (site, _), v in cast_error.errors.items() if site == name]
            row.append(max(v[0 if figure == "local" else 1] for v in found) if found else None)
        else:
            operand = str(Operand(figure))
            a, b = low.tensors.get((name, operand)), reference.tensors.get((name, operand))
            row.append(None if a is None or b is None or a.shape != b.shape else _relative(a, b))
    return row
