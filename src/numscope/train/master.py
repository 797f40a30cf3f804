"""FP32 master weights behind a low-precision working copy of a model (Apex "O2" style).

Micikevicius et al., "Mixed Precision Training" (2018): an fp16 weight cannot absorb an update smaller than
half its unit in the last place (for a weight of 1.0, about 2**-11 ≈ 4.9e-4), so plain fp16 training stalls
once updates become small. Keeping an fp32 *master* copy that the optimizer updates, and rounding it to the
working format for each forward/backward, lets tiny updates accumulate.

:class:`MasterWeights` converts a model in place: parameters and floating buffers become the working dtype
(fp16 or bf16), except those of normalisation modules (and anything matched by ``keep_fp32``), which stay
fp32 and run in fp32 on inputs cast up. Forward hooks cast floating inputs to the dtype of each module's
parameters and the model's outputs back to fp32, so the loss is computed in fp32. The optimizer is given the
fp32 master copies (:meth:`MasterWeights.master_params`); parameters that are fp32 in the model serve as
their own master.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from numscope.train.loss_scaler import LossScaler

__all__ = ["DEFAULT_FP32_MODULES", "MasterWeights"]

DEFAULT_FP32_MODULES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)
"""Module types kept in fp32 by default: normalisations, whose statistics need fp32 (paper §3, Apex O2)."""

_WORKING_DTYPES = (torch.float16, torch.bfloat16)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor inside (tuples, lists, dicts, model outputs) cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple):
        items = [_cast_floating(item, dtype) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_cast_floating(item, dtype) for item in value]
    if type(value) is dict:
        return {key: _cast_floating(item, dtype) for key, item in value.items()}
    if isinstance(value, dict):
        # dict subclasses such as transformers' ModelOutput are updated in place to keep their type.
        for key, item in list(value.items()):
            value[key] = _cast_floating(item, dtype)
        return value
    return value


class _CastInputs:
    """Forward pre-hook: floating positional and keyword inputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return _cast_floating(args, self.dtype), _cast_floating(kwargs, self.dtype)


class _CastOutputs:
    """Forward hook: floating outputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return _cast_floating(output, self.dtype)


class MasterWeights:
    """Train ``model`` in fp16/bf16 while the optimizer updates fp32 master copies of its parameters.

    Typical use::

        master = MasterWeights(model, dtype=torch.float16)         # converts model in place
        optimizer = torch.optim.AdamW(master.master_params(), lr=1e-3)
        scaler = LossScaler()
        for batch in data:
            loss = loss_fn(model(batch))                           # model runs in fp16, returns fp32
            scaler.scale(loss).backward()                          # fp16 gradients on the model
            master.step(optimizer, scaler)                         # grads -> master, unscale, step, update,
                                                                   # master -> model, zero all grads

    To clip, use the pieces: ``copy_grads_to_master()``, ``scaler.unscale_(optimizer)``, clip
    ``master_params()``, then ``step(optimizer, scaler)`` (which does not copy the gradients again).

    Args:
        model: converted in place; build the optimizer afterwards, from :meth:`master_params`.
        dtype: working dtype, ``torch.float16`` or ``torch.bfloat16``; ``torch.float32`` disables the
            mechanism (parameters made fp32, no hooks, masters are the parameters) so experiments can
            switch it off without changing the training loop.
        keep_fp32: modules kept in fp32 with their whole subtree: module types (``isinstance``) and
            glob patterns over qualified module names (``"classifier"``, ``"*.norm"``). Default
            :data:`DEFAULT_FP32_MODULES`. A pattern that matches no module is an error.
    """

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype = torch.float16,
        keep_fp32: Sequence[type[nn.Module] | str] = DEFAULT_FP32_MODULES,
    ) -> None:
        if dtype not in (*_WORKING_DTYPES, torch.float32):
            raise ValueError(
                f"dtype must be torch.float16 or torch.bfloat16 (or torch.float32 to disable), got {dtype!r}"
            )
        for spec in keep_fp32:
            if not (isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, nn.Module))):
                raise TypeError(f"keep_fp32 takes nn.Module subclasses and glob strings, got {spec!r}")
        self.model = model
        self.dtype = dtype
        self.enabled = dtype != torch.float32
        fp32_modules = self._fp32_modules(keep_fp32)
        fp32_param_ids = {id(param) for module in fp32_modules for param in module.parameters(recurse=False)}
        self._pairs: list[tuple[str, nn.Parameter, Tensor]] = []
        with torch.no_grad():
            for name, param in model.named_parameters():
                if not param.is_floating_point():
                    continue
                if not self.enabled or id(param) in fp32_param_ids:
                    param.data = param.data.float()
                    master: Tensor = param
                else:
                    master = nn.Parameter(param.detach().float().clone(), requires_grad=param.requires_grad)
                    param.data = param.data.to(dtype)
                self._pairs.append((name, param, master))
            if self.enabled:
                for module in model.modules():
                    buffer_dtype = torch.float32 if module in fp32_modules else dtype
                    for buffer_name, buffer in module.named_buffers(recurse=False):
                        if buffer.is_floating_point():
                            setattr(module, buffer_name, buffer.to(buffer_dtype))
        if self.enabled:
            self._install_hooks(fp32_modules)
        self._grads_on_master = False

    def _fp32_modules(self, keep_fp32: Sequence[type[nn.Module] | str]) -> set[nn.Module]:
        types = tuple(spec for spec in keep_fp32 if isinstance(spec, type))
        patterns = [spec for spec in keep_fp32 if isinstance(spec, str)]
        names = [name for name, _ in self.model.named_modules()]
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                raise ValueError(f"keep_fp32 pattern {pattern!r} matches no module; module names: {names}")
        kept: set[nn.Module] = set()
        for name, module in self.model.named_modules():
            if (types and isinstance(module, types)) or any(fnmatch.fnmatchcase(name, p) for p in patterns):
                kept.update(module.modules())
        return kept

    def _install_hooks(self, fp32_modules: set[nn.Module]) -> None:
        self.model.register_forward_pre_hook(_CastInputs(self.dtype), with_kwargs=True)
        parents = {child: parent for parent in self.model.modules() for child in parent.children()}
        for module in self.model.modules():
            in_fp32 = module in fp32_modules
            if in_fp32 and parents.get(module) not in fp32_modules:
                # the top of an fp32 subtree: compute in fp32, hand the working dtype on
                module.register_forward_pre_hook(_CastInputs(torch.float32), with_kwargs=True)
                module.register_forward_hook(_CastOutputs(self.dtype))
            elif any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(
                    _CastInputs(torch.float32 if in_fp32 else self.dtype), with_kwargs=True
                )
        self.model.register_forward_hook(_CastOutputs(torch.float32))

    # ------------------------------------------------------------------ parameters
    def named_master_params(self) -> Iterator[tuple[str, Tensor]]:
        """``(model parameter name, fp32 master)`` pairs, e.g. to build parameter groups or name overflows."""
        for name, _, master in self._pairs:
            yield name, master

    def master_params(self) -> list[Tensor]:
        """The fp32 master tensors to hand to the optimizer."""
        return [master for _, _, master in self._pairs]

    def copy_grads_to_master(self) -> None:
        """Model gradients (working dtype, possibly loss-scaled) → master ``.grad`` in fp32, exactly."""
        for _, param, master in self._pairs:
            if master is param:
                continue
            master.grad = None if param.grad is None else param.grad.detach().float()
        self._grads_on_master = True

    def copy_master_to_model(self) -> None:
        """Round the fp32 masters (nearest-even) into the model's working-dtype parameters."""
        with torch.no_grad():
            for _, param, master in self._pairs:
                if master is not param:
                    param.copy_(master)

    def zero_grad(self) -> None:
        """Drop the gradients of model and masters (set to ``None``)."""
        for _, param, master in self._pairs:
            param.grad = None
            master.grad = None
        self._grads_on_master = False

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: LossScaler | torch.amp.GradScaler | None = None
    ) -> Any:
        """One optimizer step on the masters: grads → master, step (through ``scaler``), master → model.

        With a scaler: ``scaler.step(optimizer)`` (which unscales the fp32 master gradients unless
        already done, and skips the step on inf/NaN) then ``scaler.update()``; a :class:`LossScaler` is
        also told the parameter names for its overflow diagnostics. Gradients are copied only if
        :meth:`copy_grads_to_master` was not called since the last step. Ends with :meth:`zero_grad`.
        Returns what ``optimizer.step`` returned (``None`` for a skipped step).
        """
        if not self._grads_on_master:
            self.copy_grads_to_master()
        if scaler is None:
            result = optimizer.step()
        else:
            if isinstance(scaler, LossScaler):
                scaler.track(self.named_master_params())
            result = scaler.step(optimizer)
            scaler.update()
        self.copy_master_to_model()
        self.zero_grad()
        return result

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Tensor]:
        """The fp32 masters by model parameter name (references, as ``nn.Module.state_dict``)."""
        return {name: master.detach() for name, _, master in self._pairs}

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy saved masters in and round them into the model; names must match exactly."""
        expected = {name for name, _, _ in self._pairs}
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise KeyError(f"master weights state dict mismatch: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name, _, master in self._pairs:
                saved = state_dict[name]
                if saved.shape != master.shape:
                    raise ValueError(
                        f"master weight {name!r} has shape {tuple(saved.shape)} in the state dict, "
                        f"{tuple(master.shape)} in the model"
                    )
                master.copy_(saved)
        self.copy_master_to_model()
