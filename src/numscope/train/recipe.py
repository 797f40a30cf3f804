"""The mixed-precision training recipe on one model, every part a switch.

Micikevicius et al., "Mixed Precision Training" (ICLR 2018): compute and store in FP16, keep FP32 master
weights, keep the ops that need range or long sums in FP32, store activations in FP16, scale the loss.
FP8 and MX training add a per-GEMM, per-operand plan. :class:`Recipe` ties the five parts together, each
switched off by one argument, so that each one's effect can be measured in the same training loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from numscope.convert import convert, load_numerics_state_dict, numerics_state_dict, unconvert
from numscope.plan import Plan
from numscope.train import allocator
from numscope.train.activations import STORAGE_DTYPES, ActivationStore, store_activations
from numscope.train.fp32_ops import keep_fp32_ops, resolve_ops
from numscope.train.loss_scaler import LossScaler
from numscope.train.master import DEFAULT_FP32_MODULES, MasterWeights

__all__ = ["Recipe"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Recipe:
    """Mixed-precision training of ``model``: plan, master weights, fp32 ops, activation storage, loss scale.

    Use it in a plain training loop::

        recipe = numscope.Recipe(model)                   # the paper's recipe, every part on
        optimizer = torch.optim.AdamW(recipe.parameters(), lr=1e-3)
        for batch in data:
            loss = model(**batch).loss                    # the model now runs in fp16
            recipe.backward(loss)                         # backward of the scaled loss
            recipe.step(optimizer)                        # fp32 masters: unscale, skip on inf/NaN,
                                                          # step, update the scale, zero the gradients

    To clip: ``recipe.unscale_(optimizer)``, clip ``recipe.parameters()``, then ``recipe.step(optimizer)``.

    The switches (each part is off with the value in brackets):

    * ``plan`` — a :class:`numscope.Plan`, a preset or a recipe name (``"fp8"``, ``"te_mxfp8"``…): the
      format of every GEMM operand (:func:`numscope.convert`) [``None``: GEMMs as the model computes them].
    * ``dtype`` — the working dtype, ``torch.float16`` or ``torch.bfloat16``: the model's parameters and
      computation, with fp32 master weights for the optimizer and normalisation modules kept in fp32
      (:class:`numscope.MasterWeights`) [``torch.float32``].
    * ``fp32_ops`` — softmax, normalisation, losses, large reductions, exp/log/pow… run in fp32 while the
      model computes in ``dtype``, and GEMMs multiply ``dtype`` values with fp32 accumulation
      (:mod:`numscope.train.fp32_ops`; an iterable of torch callables picks your own list of kept ops);
      nothing to do when ``dtype`` is fp32 [``False``: every op in ``dtype``, torch's own kernels].
    * ``activations`` — the dtype in which every float32 activation autograd saves for backward is kept
      (:mod:`numscope.train.activations`), among them the fp32 results of kept ops and the fp32 copies
      GEMMs compute on: ``torch.float16``/``"fp16"`` or ``torch.bfloat16``/``"bf16"``; ``"working"`` is
      ``dtype``; ``torch.float32``/``"fp32"`` keeps them as they are, as ``None`` does [``None``].
    * ``loss_scale`` — ``"dynamic"`` (GradScaler's defaults), a number (static scale), or a
      :class:`numscope.LossScaler` of your own [``None``].
    * ``return_freed_memory`` — fix glibc's mmap threshold at 128 KiB for this process, so that a freed
      tensor leaves the process at once and the peak memory follows what the step keeps
      (:mod:`numscope.train.allocator`; process-wide, changes no value; nothing off glibc or when
      ``MALLOC_MMAP_THRESHOLD_`` is set). ``None`` does it when the recipe stores anything in fp16/bf16
      (``dtype`` or ``activations``): under glibc's moving threshold the freed float32 temporaries of the
      casts and fp32 ops stay in the heap, and the recipe peaked above fp32 (``bench_memory.py``) [``None``].

    With every part off the model trains bit for bit as without the recipe. The model is converted in
    place, for good (build a fresh model to compare settings). ``generator`` is the random source of the
    plan's stochastic rounding; ``example_inputs`` lets the plan be checked against every site now;
    ``keep_fp32`` overrides the modules :class:`MasterWeights` keeps in fp32; ``compiled`` chooses the
    plan's quantizers as :func:`numscope.convert` does (the same bits either way).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        plan: Plan | str | None = None,
        dtype: torch.dtype = torch.float16,
        fp32_ops: bool | Iterable[Callable[..., Any]] = True,
        activations: torch.dtype | str | None = "working",
        loss_scale: str | float | LossScaler | None = "dynamic",
        generator: torch.Generator | None = None,
        example_inputs: Any = None,
        keep_fp32: Sequence[type[nn.Module] | str] = DEFAULT_FP32_MODULES,
        compiled: bool | str = "auto",
        return_freed_memory: bool | None = None,
    ) -> None:
        # every argument is checked before the model is touched: a bad one leaves it as it was
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
        if return_freed_memory not in (None, True, False):
            raise ValueError(f"return_freed_memory must be True, False or None; got {return_freed_memory!r}")
        self.model = model
        self.dtype = dtype
        self.scaler = _loss_scaler(loss_scale)
        resolved_plan = _plan(plan)
        storage = _activation_storage(activations, dtype)
        if fp32_ops is not True and fp32_ops is not False:
            resolve_ops(fp32_ops)  # type: ignore[arg-type]
        self.plan = resolved_plan
        self._plan_label = plan if isinstance(plan, str) else "custom"
        if resolved_plan is not None:  # checks the plan against the sites; undoes itself if it fails
            convert(
                model, resolved_plan, example_inputs=example_inputs, generator=generator, compiled=compiled
            )
        try:
            self.master = MasterWeights(model, dtype=dtype, keep_fp32=keep_fp32)  # checks, then casts
        except Exception:
            if resolved_plan is not None:
                unconvert(model)
            raise
        self.fp32_ops = dtype != torch.float32 and fp32_ops is not False
        self._handles: list[Any] = []
        if self.fp32_ops:
            ops = None if fp32_ops is True else fp32_ops
            self._handles.append(keep_fp32_ops(model, dtype, ops))  # type: ignore[arg-type]
        self.activations: ActivationStore | None = None
        if storage is not None:
            handle, self.activations = store_activations(model, storage)
            self._handles.append(handle)
        self.scaler.track(self.master.named_master_params())
        if return_freed_memory is None:
            return_freed_memory = dtype != torch.float32 or storage is not None
        #: whether this recipe fixed glibc's mmap threshold (False where it was not asked to, off glibc, or
        #: with ``MALLOC_MMAP_THRESHOLD_`` set: then glibc fixed it at start)
        self.returns_freed_memory = bool(return_freed_memory) and allocator.return_freed_memory()

    # ------------------------------------------------------------------ the training loop
    def parameters(self) -> list[Tensor]:
        """What the optimizer updates: the fp32 master weights (the parameters themselves under fp32)."""
        return self.master.master_params()

    def backward(self, loss: Tensor) -> None:
        """``loss`` times the loss scale, then backward (gradients land on the model's parameters)."""
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients to the fp32 masters, divided by the loss scale: call before clipping or inspecting."""
        self.master.copy_grads_to_master()
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> Any:
        """One optimizer step on the masters (skipped on inf/NaN), scale update, masters → model, zero grads.

        Returns what ``optimizer.step`` returned (``None`` for a skipped step); ``self.scaler.last_overflow``
        names the parameters whose gradients overflowed.
        """
        return self.master.step(optimizer, self.scaler)

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Master weights, loss scaler and the plan's numerics (amax histories, rounding generator).

        Save it with the optimizer's state and :func:`numscope.train.rng_state` (dropout and data order)
        through :func:`numscope.save_checkpoint`; a run resumed from them equals the uninterrupted one.
        """
        return {
            "master": self.master.state_dict(),
            "scaler": self.scaler.state_dict(),
            "numerics": None if self.plan is None else numerics_state_dict(self.model),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` into a recipe built with the same settings on the same architecture."""
        missing = {"master", "scaler", "numerics"} - set(state)
        if missing:
            raise ValueError(f"recipe state lacks {sorted(missing)}; expected keys: master, scaler, numerics")
        if (state["numerics"] is None) != (self.plan is None):
            raise ValueError(
                "recipe state was saved " + ("without" if state["numerics"] is None else "with")
                + " a plan, but this recipe has " + ("one" if self.plan is not None else "none")
            )  # fmt: skip
        self.master.load_state_dict(state["master"])
        self.scaler.load_state_dict(state["scaler"])
        if state["numerics"] is not None:
            load_numerics_state_dict(self.model, state["numerics"])

    def __repr__(self) -> str:
        scale = (
            "off" if not self.scaler.is_enabled()
            else f"{'dynamic' if self.scaler.is_dynamic() else 'static'} ({self.scaler.get_scale():g})"
        )  # fmt: skip
        parts = {
            "plan": "none" if self.plan is None else self._plan_label,
            "dtype": str(self.dtype).removeprefix("torch."),
            "fp32_ops": "on" if self.fp32_ops else "off",
            "activations": "as computed"
            if self.activations is None
            else str(self.activations.dtype).removeprefix("torch."),
            "loss_scale": scale,
        }
        return "Recipe(" + ", ".join(f"{key}={value}" for key, value in parts.items()) + ")"


def _activation_storage(activations: torch.dtype | str | None, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype activations are stored in (``None``: as computed), from ``Recipe(activations=...)``."""
    resolved = dtype if activations == "working" else activations
    if isinstance(resolved, str):
        resolved = {**STORAGE_DTYPES, "fp32": torch.float32}.get(resolved, resolved)
    if resolved is None or resolved == torch.float32:
        return None
    if resolved not in STORAGE_DTYPES.values():
        raise ValueError(
            f"activations must be 'working', fp16, bf16, fp32 (torch.float16, torch.bfloat16, torch.float32) "
            f"or None, got {activations!r}"
        )
    return resolved  # type: ignore[return-value]


def _plan(plan: Plan | str | None) -> Plan | None:
    if plan is None:
        return None
    if isinstance(plan, str):
        return Plan.named(plan)
    if not isinstance(plan, Plan):
        raise TypeError(
            f"plan must be a numscope.Plan, a preset or recipe name, or None, got {type(plan).__name__}"
        )
    return plan


def _loss_scaler(loss_scale: str | float | LossScaler | None) -> LossScaler:
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if loss_scale is None:
        return LossScaler(enabled=False)
    if loss_scale == "dynamic":
        return LossScaler()
    if isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool):
        return LossScaler(init_scale=float(loss_scale), dynamic=False)
    raise ValueError(
        f"loss_scale must be 'dynamic', a number (static scale), a numscope.LossScaler or None, "
        f"got {loss_scale!r}"
    )
