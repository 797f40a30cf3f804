"""Loss scaling: keep small gradients representable in a low-precision format.

Micikevicius et al., "Mixed Precision Training" (2018): many activation gradients are smaller than the
smallest fp16 subnormal (2**-24) and flush to zero. Multiplying the loss by a factor ``S`` before backward
shifts every gradient up by ``log2(S)`` binades; dividing the gradients by ``S`` before the optimizer step
restores their true values. Too large an ``S`` overflows; a step whose gradients hold inf/NaN is skipped and
``S`` is reduced (dynamic loss scaling).

:class:`LossScaler` follows ``torch.amp.GradScaler``'s interface, argument names and scale trajectory, and
adds

* gradients in fp16/bf16 (unscaled in fp32 and written back), not only fp32;
* static loss scaling (``dynamic=False``) and bounds on the scale (``min_scale``, ``max_scale``);
* :attr:`LossScaler.last_overflow`: which parameters held inf/NaN on the last skipped step;
* one pluggable reduction of the found-inf flag across ranks (:attr:`LossScaler.found_inf_reduce`).

:func:`underflow_report` measures, per parameter, how much of the gradient a working format flushes to zero
with and without a given scale.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

__all__ = [
    "LossScaler",
    "SkippedStep",
    "UnderflowRow",
    "all_reduce_max_if_distributed",
    "underflow_report",
]

_Outputs = TypeVar("_Outputs", Tensor, list[Tensor], tuple[Tensor, ...])


def all_reduce_max_if_distributed(found_inf: Tensor) -> Tensor:
    """Default :attr:`LossScaler.found_inf_reduce`: the largest found-inf flag over all ranks.

    When ``torch.distributed`` is initialised, all-reduces (MAX) the one-element flag in place over the
    default process group, so that every rank skips the same steps: one all-reduce of 4 bytes per
    optimizer per step. This matters whenever ranks hold different gradients (sharded optimizers such as
    ZeRO/FSDP, tensor or pipeline parallelism); with plain data parallelism the gradients are already
    identical after their all-reduce and the flag agrees anyway. Under FSDP2 each rank checks only its own
    shards (the gradients' local tensors), so this is the step's only collective. Outside distributed runs
    returns the flag unchanged. The flag must live on a device the backend accepts (CUDA for NCCL); it lives
    on the gradients' device.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
    return found_inf


def _local_shard(grad: Tensor) -> Tensor:
    """This rank's part of a gradient: the local tensor of a ``DTensor`` (FSDP2's sharded gradients), else
    ``grad``. Unscaling and checking it in place touch only local memory; on the ``DTensor`` itself every
    parameter's finiteness check would be a collective of its own, and the reduced flag a ``DTensor`` that
    ``all_reduce`` rejects."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


@dataclass(frozen=True)
class SkippedStep:
    """A skipped step: where the gradients held inf/NaN.

    ``iteration`` counts :meth:`LossScaler.update` calls before this step (0 for the first step);
    ``scale`` is the loss scale the gradients were multiplied by; ``parameters`` names every parameter
    whose gradient held inf/NaN after unscaling, in optimizer order. Names come from
    :meth:`LossScaler.track`; untracked parameters are named by position, ``"param_groups[g][i]"``. The
    tuple is empty when only another rank overflowed (see :attr:`LossScaler.found_inf_reduce`).
    """

    iteration: int
    scale: float
    parameters: tuple[str, ...]


class _Stage(enum.Enum):
    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass
class _OptimizerIteration:
    stage: _Stage = _Stage.READY
    found_inf: bool = False


def _to_float32(value: float) -> float:
    """Round a Python float to the nearest float32 (inf when out of range), as GradScaler stores its scale."""
    return torch.tensor(value, dtype=torch.float64).float().item()


class LossScaler:
    """Static or dynamic loss scaling, a drop-in for ``torch.amp.GradScaler``.

    Typical use (``model`` may hold fp32, fp16 or bf16 parameters)::

        scaler = LossScaler().track(model)
        for batch in data:
            optimizer.zero_grad()
            loss = loss_fn(model(batch))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)                      # optional: only to clip/inspect true gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)                          # skipped if any gradient holds inf/NaN
            scaler.update()

    Dynamic scaling (the default) multiplies the scale by ``backoff_factor`` after a skipped step and by
    ``growth_factor`` after ``growth_interval`` consecutive good steps, clamped to
    ``[min_scale, max_scale]``; the scale is stored as float32 and its trajectory equals GradScaler's when
    no bound is hit. Static scaling (``dynamic=False``) keeps ``init_scale`` for good but still skips steps
    with inf/NaN gradients. With ``enabled=False`` every method is a pass-through (scale 1.0, no skipping).

    Gradient accumulation needs nothing special: call ``scale(loss).backward()`` on every micro-batch, then
    ``unscale_``/``step``/``update`` once; the summed gradients are divided by the scale once.

    Args:
        init_scale: initial loss scale, > 0 (a multiplier; 2**16 shifts gradients up by 16 binades).
        growth_factor: multiplier applied after ``growth_interval`` good steps, > 1.
        backoff_factor: multiplier applied after a skipped step, in (0, 1).
        growth_interval: number of consecutive good steps before growing, >= 1.
        enabled: ``False`` turns the scaler into a pass-through.
        dynamic: ``False`` for static loss scaling.
        min_scale, max_scale: optional bounds on the dynamic scale, > 0, ``min_scale <= init_scale <=
            max_scale``.
        found_inf_reduce: called on a one-element float32 tensor (1.0 if this rank found inf/NaN in the
            optimizer's gradients, else 0.0) before deciding whether to skip; nonzero in the result skips.
            Default :func:`all_reduce_max_if_distributed`; ``None`` lets each rank decide alone.
        device: GradScaler's first argument, accepted by keyword so that ``GradScaler(device="cuda", ...)``
            becomes ``LossScaler(device="cuda", ...)`` unchanged; it must name a device, and changes
            nothing: the scaler works on whatever device the loss and gradients are on.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        dynamic: bool = True,
        min_scale: float | None = None,
        max_scale: float | None = None,
        *,
        found_inf_reduce: Callable[[Tensor], Tensor] | None = all_reduce_max_if_distributed,
        device: str | torch.device | None = None,
    ) -> None:
        if device is not None:
            try:
                torch.device(device)
            except (RuntimeError, TypeError) as error:
                raise ValueError(
                    f"device must name a torch device such as 'cpu' or 'cuda', got {device!r}"
                ) from error
        _check_factors(growth_factor, backoff_factor, growth_interval)
        if not (
            isinstance(init_scale, (int, float))
            and init_scale > 0
            and math.isfinite(_to_float32(float(init_scale)))
        ):
            raise ValueError(f"init_scale must be a number > 0 that float32 can hold, got {init_scale!r}")
        for bound_name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
            if bound is not None and not (math.isfinite(bound) and bound > 0):
                raise ValueError(f"{bound_name} must be None or a finite number > 0, got {bound!r}")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(
                f"min_scale must be <= max_scale, got min_scale={min_scale}, max_scale={max_scale}"
            )
        if (min_scale is not None and init_scale < min_scale) or (
            max_scale is not None and init_scale > max_scale
        ):
            raise ValueError(
                f"init_scale must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}], "
                f"got {init_scale}"
            )
        self._enabled = enabled
        self._dynamic = dynamic
        self._scale = _to_float32(float(init_scale))
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._growth_tracker = 0
        self._iteration = 0
        self._skipped_steps = 0
        self.found_inf_reduce = found_inf_reduce
        self.last_overflow: SkippedStep | None = None
        self._names: dict[int, tuple[weakref.ref[Tensor], str]] = {}
        self._per_optimizer: dict[int, _OptimizerIteration] = {}

    # ------------------------------------------------------------------ naming for diagnostics
    def track(self, model_or_named_parameters: nn.Module | Iterable[tuple[str, Tensor]]) -> LossScaler:
        """Learn parameter names for :attr:`last_overflow`; returns ``self`` so it chains.

        Accepts a module (its ``named_parameters()``) or any iterable of ``(name, tensor)`` pairs, e.g.
        ``MasterWeights.named_master_params()`` when the optimizer holds master copies. Parameters are held
        by weak reference: tracking keeps nothing alive. Calling it again adds or renames.
        """
        pairs = (
            model_or_named_parameters.named_parameters()
            if isinstance(model_or_named_parameters, nn.Module)
            else model_or_named_parameters
        )
        for name, param in pairs:
            self._names[id(param)] = (weakref.ref(param), name)
        return self

    def _name_of(self, param: Tensor, group_index: int, param_index: int) -> str:
        entry = self._names.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return f"param_groups[{group_index}][{param_index}]"

    # ------------------------------------------------------------------ the GradScaler state machine
    def scale(self, outputs: _Outputs) -> _Outputs:
        """Multiply a loss (or a list/tuple of tensors, e.g. several losses) by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return outputs * torch.full((), self._scale, dtype=torch.float32, device=outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(output) for output in outputs)
        raise TypeError(f"scale() takes a Tensor or a list/tuple of Tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and check them for inf/NaN.

        Optional: :meth:`step` calls it when it has not been called. Call it yourself to clip or inspect
        true gradients between backward and :meth:`step`. Gradients in fp16/bf16 are divided in fp32 and
        rounded back; inf/NaN are looked for in the result. Allowed once per optimizer per iteration
        (between :meth:`update` calls); a second call raises ``RuntimeError``.
        """
        if not self._enabled:
            return
        state = self._per_optimizer.setdefault(id(optimizer), _OptimizerIteration())
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                "call it at most once per optimizer per iteration"
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call it before step() or not at all")
        # The reciprocal in float64 then float32, as GradScaler, so fp32 results match it bit for bit; made
        # once per device and dtype the gradients live on (not copied to a GPU once per parameter)
        reciprocal = torch.tensor(self._scale, dtype=torch.float64).reciprocal().float()
        inverses: dict[tuple[torch.device, torch.dtype], Tensor] = {}

        def inv_scale(device: torch.device, dtype: torch.dtype) -> Tensor:
            key = (device, dtype)
            if key not in inverses:
                inverses[key] = reciprocal.to(device=device, dtype=dtype)
            return inverses[key]

        positions: list[tuple[Tensor, int, int]] = []
        nonfinite: list[Tensor] = []
        with torch.no_grad():
            for group_index, group in enumerate(optimizer.param_groups):
                for param_index, param in enumerate(group["params"]):
                    if param.grad is None:
                        continue
                    if param.grad.is_sparse:
                        param.grad = param.grad.coalesce()
                        grad = param.grad.values()
                    else:
                        grad = _local_shard(param.grad)
                    if grad.dtype in (torch.float32, torch.float64):
                        grad.mul_(inv_scale(grad.device, grad.dtype))
                    else:
                        grad.copy_(grad.float().mul_(inv_scale(grad.device, torch.float32)))
                    positions.append((param, group_index, param_index))
                    nonfinite.append(~torch.isfinite(grad).all())
            device = nonfinite[0].device if nonfinite else torch.device("cpu")
            flags = torch.stack([flag.to(device) for flag in nonfinite]) if nonfinite else torch.zeros(0)
            found_inf = flags.any().float().reshape(1).to(device)
            if self.found_inf_reduce is not None:
                found_inf = self.found_inf_reduce(found_inf)
            state.found_inf = bool(found_inf.item())
        state.stage = _Stage.UNSCALED
        if state.found_inf:
            names = tuple(
                self._name_of(param, group_index, param_index)
                for (param, group_index, param_index), bad in zip(positions, flags.tolist(), strict=True)
                if bad
            )
            previous = self.last_overflow
            if previous is not None and previous.iteration == self._iteration:
                names = previous.parameters + names
            self.last_overflow = SkippedStep(self._iteration, self._scale, names)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then ``optimizer.step(*args, **kwargs)`` unless a gradient holds inf/NaN.

        Returns what ``optimizer.step`` returns, or ``None`` when the step is skipped. A skipped step leaves
        parameters and optimizer state untouched. Closures are not supported (as in GradScaler).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("closure use is not supported by LossScaler.step (as in torch.amp.GradScaler)")
        state = self._per_optimizer.setdefault(id(optimizer), _OptimizerIteration())
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update()")
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        state.stage = _Stage.STEPPED
        if state.found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """End the iteration: set ``new_scale`` if given, else grow or back off the scale (dynamic mode).

        Call once per iteration after :meth:`step` for every optimizer. In static mode only an explicit
        ``new_scale`` changes the scale. The result is clamped to ``[min_scale, max_scale]``.
        """
        if not self._enabled:
            return
        # As GradScaler: every optimizer whose gradients were checked this iteration votes on the scale.
        checked = [state for state in self._per_optimizer.values() if state.stage is not _Stage.READY]
        if new_scale is None and not checked:
            raise RuntimeError("update() was called before step(optimizer) in this iteration")
        found_inf = any(state.found_inf for state in checked)
        if new_scale is not None:
            value = float(new_scale.item()) if isinstance(new_scale, Tensor) else float(new_scale)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"new_scale must be a finite number > 0, got {value!r}")
            self._scale = self._clamp(_to_float32(value))
        elif self._dynamic:
            self._advance(found_inf)
        self._skipped_steps += int(found_inf)
        self._iteration += 1
        self._per_optimizer = {}

    def _advance(self, found_inf: bool) -> None:
        # The rule of torch._amp_update_scale_: products in float64, stored as float32.
        if found_inf:
            self._scale = self._clamp(_to_float32(self._scale * self._backoff_factor))
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self._growth_interval:
            grown = _to_float32(self._scale * self._growth_factor)
            if math.isfinite(grown):
                self._scale = self._clamp(grown)
            self._growth_tracker = 0

    def _clamp(self, scale: float) -> float:
        if self._min_scale is not None and scale < self._min_scale:
            return _to_float32(self._min_scale)
        if self._max_scale is not None and scale > self._max_scale:
            return _to_float32(self._max_scale)
        return scale

    # ------------------------------------------------------------------ accessors
    def get_scale(self) -> float:
        """The current loss scale (a multiplier), or 1.0 when disabled."""
        return self._scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether scaling is on (``enabled`` at construction)."""
        return self._enabled

    def is_dynamic(self) -> bool:
        """Whether the scale adapts to overflows (``dynamic`` at construction)."""
        return self._dynamic

    @property
    def skipped_steps(self) -> int:
        """Number of iterations whose optimizer step was skipped for inf/NaN gradients."""
        return self._skipped_steps

    def get_growth_factor(self) -> float:
        """Multiplier applied to the scale after ``growth_interval`` good steps."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Change the growth factor (> 1)."""
        _check_factors(new_factor, self._backoff_factor, self._growth_interval)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        """Multiplier applied to the scale after a skipped step."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Change the backoff factor (in (0, 1))."""
        _check_factors(self._growth_factor, new_factor, self._growth_interval)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        """Number of consecutive good steps before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Change the growth interval (>= 1 steps)."""
        _check_factors(self._growth_factor, self._backoff_factor, new_interval)
        self._growth_interval = int(new_interval)

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python numbers; empty when disabled (as GradScaler).

        Holds GradScaler's five keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``), so ``torch.amp.GradScaler.load_state_dict`` accepts it, plus ``dynamic``,
        ``min_scale``, ``max_scale``, ``iteration`` and ``skipped_steps``. Take it after :meth:`update`.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
            "dynamic": self._dynamic,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "iteration": self._iteration,
            "skipped_steps": self._skipped_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output, or a ``torch.amp.GradScaler`` state dict; no-op when disabled.

        Keys GradScaler does not write keep this scaler's current values.
        """
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError(
                "the scaler state dict is empty, probably saved from a disabled scaler (enabled=False)"
            )
        missing = sorted(
            {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
            - set(state_dict)
        )
        if missing:
            raise KeyError(f"scaler state dict lacks {missing}; has {sorted(state_dict)}")
        _check_factors(
            state_dict["growth_factor"], state_dict["backoff_factor"], state_dict["growth_interval"]
        )
        self._scale = _to_float32(float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
        self._dynamic = bool(state_dict.get("dynamic", self._dynamic))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._iteration = int(state_dict.get("iteration", self._iteration))
        self._skipped_steps = int(state_dict.get("skipped_steps", self._skipped_steps))
        self._per_optimizer = {}


def _check_factors(growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    if not (math.isfinite(growth_factor) and growth_factor > 1.0):
        raise ValueError(f"growth_factor must be a finite number > 1.0, got {growth_factor!r}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1 (steps), got {growth_interval!r}")


# ---------------------------------------------------------------------- underflow diagnostics
@dataclass(frozen=True)
class UnderflowRow:
    """How one parameter's gradient fares in a working format, with and without the loss scale.

    Percentages are of the gradient's nonzero values (0.0 when it has none). ``underflow_percent_unscaled``:
    nonzero values that round to zero when the true gradient is cast to the working format;
    ``underflow_percent_scaled``: the same for gradient × scale; ``overflow_percent_scaled``: values of
    gradient × scale that become inf/NaN or saturate at the format's largest finite value.
    ``min_abs_nonzero`` and ``max_abs`` are of the true gradient: a scale keeps every value in range when
    ``min_abs_nonzero × scale`` is at least the format's smallest subnormal and ``max_abs × scale`` at most
    its largest finite value.
    """

    parameter: str
    numel: int
    nonzero: int
    underflow_percent_unscaled: float
    underflow_percent_scaled: float
    overflow_percent_scaled: float
    min_abs_nonzero: float
    max_abs: float

    def as_dict(self) -> dict[str, str | int | float]:
        """The row with log-legible keys (``underflow%`` …), for tables and CSV."""
        return {
            "parameter": self.parameter,
            "numel": self.numel,
            "nonzero": self.nonzero,
            "underflow% unscaled": self.underflow_percent_unscaled,
            "underflow% scaled": self.underflow_percent_scaled,
            "overflow% scaled": self.overflow_percent_scaled,
            "min|g|>0": self.min_abs_nonzero,
            "max|g|": self.max_abs,
        }


def underflow_report(
    model_or_named_grads: nn.Module | Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    scale: float,
    working_dtype: torch.dtype,
) -> list[UnderflowRow]:
    """Per parameter, the share of gradient values a working format loses with and without loss scaling.

    Pass the *true* (unscaled) gradients: a module whose ``.grad`` hold them (parameters without a gradient
    are left out), or ``name -> gradient`` pairs. The most faithful source is an fp32 backward of the same
    batch; fp32 master gradients after :meth:`LossScaler.unscale_` show what the current scale still lets
    through. The cast is torch's round-to-nearest-even conversion to ``working_dtype`` (any floating dtype:
    ``torch.float16``, ``torch.bfloat16``, ``torch.float8_e5m2`` …) of the gradient in fp32 — a model of
    where the backward pass would produce these values, not a replay of it.
    """
    if not (isinstance(working_dtype, torch.dtype) and working_dtype.is_floating_point):
        raise ValueError(
            f"working_dtype must be a floating torch.dtype such as torch.float16, got {working_dtype!r}"
        )
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if isinstance(model_or_named_grads, nn.Module):
        pairs: Iterable[tuple[str, Tensor]] = (
            (name, param.grad)
            for name, param in model_or_named_grads.named_parameters()
            if param.grad is not None
        )
    elif isinstance(model_or_named_grads, Mapping):
        pairs = model_or_named_grads.items()
    else:
        pairs = model_or_named_grads
    largest = torch.finfo(working_dtype).max
    rows = []
    with torch.no_grad():
        for name, grad in pairs:
            values = (grad.coalesce().values() if grad.is_sparse else grad).detach().float().flatten()
            finite_nonzero = (values != 0) & torch.isfinite(values)
            scaled = values * scale
            scaled_cast = scaled.to(working_dtype)
            underflow_unscaled = int(((values.to(working_dtype) == 0) & finite_nonzero).sum())
            underflow_scaled = int(((scaled_cast == 0) & finite_nonzero).sum())
            saturated = (scaled_cast.float().abs() == largest) & (scaled.abs() > largest)
            overflow_scaled = int(((~torch.isfinite(scaled_cast) | saturated) & torch.isfinite(values)).sum())
            nonzero = int(finite_nonzero.sum())
            magnitudes = values[finite_nonzero].abs()
            rows.append(
                UnderflowRow(
                    parameter=name,
                    numel=values.numel(),
                    nonzero=nonzero,
                    underflow_percent_unscaled=_percent(underflow_unscaled, nonzero),
                    underflow_percent_scaled=_percent(underflow_scaled, nonzero),
                    overflow_percent_scaled=_percent(overflow_scaled, nonzero),
                    min_abs_nonzero=float(magnitudes.min()) if nonzero else 0.0,
                    max_abs=float(magnitudes.max()) if nonzero else 0.0,
                )
            )
    return rows


def _percent(count: int, total: int) -> float:
    return 100.0 * count / total if total else 0.0
