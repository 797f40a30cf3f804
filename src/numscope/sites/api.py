"""The public face of sites: list a model's sites, attach handlers, ask about an attached model."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from numscope.sites.gemm import STORAGE_DTYPES, OperandHandler, Site
from numscope.sites.runtime import _Attachment, _Runtime

_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, _Runtime] = weakref.WeakKeyDictionary()


def _runtime(model: nn.Module) -> _Runtime | None:
    return _RUNTIMES.get(model)


class Handle:
    """An attached handler; :meth:`remove` detaches it (the last removal restores the model exactly)."""

    def __init__(self, model: nn.Module, attachment: _Attachment) -> None:
        self._model = weakref.ref(model)
        self._attachment = attachment
        self.name = attachment.name

    @property
    def attached(self) -> bool:
        model = self._model()
        runtime = None if model is None else _RUNTIMES.get(model)
        return runtime is not None and self._attachment in runtime.attachments

    def remove(self) -> None:
        model = self._model()
        runtime = None if model is None else _RUNTIMES.get(model)
        if runtime is None or self._attachment not in runtime.attachments:
            return
        runtime.attachments.remove(self._attachment)
        runtime.invalidate()
        if not runtime.attachments:
            runtime.remove()
            del _RUNTIMES[model]


def _example_call(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple | list):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def sites(model: nn.Module, example_inputs: dict | tuple | torch.Tensor | None = None) -> list[Site]:
    """Every GEMM site of ``model``, in call order where a forward pass was seen.

    Without ``example_inputs`` only Linear/Conv1D sites are listed (and matmul sites already found by an
    attached model's first forward). With them, one forward runs without gradients in eval mode (the RNG
    state and training flags restored) to find the matmul sites: a dict is passed as keyword arguments, a
    tuple as positional ones, anything else as the one argument.
    """
    runtime = _runtime(model)
    if example_inputs is None:
        if runtime is not None:
            return runtime.all_sites()
        runtime = _Runtime(model)
        runtime.remove()
        return runtime.all_sites()
    temporary = runtime is None
    runtime = _Runtime(model) if runtime is None else runtime
    try:
        args, kwargs = _example_call(example_inputs)
        return runtime.discover(args, kwargs)
    finally:
        if temporary:
            runtime.remove()


def attach(
    model: nn.Module,
    handler: OperandHandler | Callable[..., torch.Tensor],
    *,
    name: str,
    storage: str | None = None,
) -> Handle:
    """Route every site operand of ``model`` through ``handler`` (after handlers attached before it).

    name: identifies the attachment (unique per model). storage: ``"fp16"``/``"bf16"``/``"fp32"``: the
    dtype in which site activations saved for backward are kept (parameters are kept as they are); the
    latest attachment that sets one wins. Parameters and ``state_dict`` keys are untouched; removing the
    last handle removes every hook.
    """
    if not callable(handler):
        raise TypeError(
            f"handler must be callable(site, gemm, operand, tensor, axis), got {type(handler).__name__}"
        )
    if storage is not None and storage not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage {storage!r}; allowed: None, {', '.join(STORAGE_DTYPES)}")
    runtime = _runtime(model)
    if runtime is None:
        runtime = _Runtime(model)
        _RUNTIMES[model] = runtime
    if any(a.name == name for a in runtime.attachments):
        raise ValueError(
            f"a handler named {name!r} is already attached to this model; attached: "
            f"{', '.join(a.name for a in runtime.attachments)}"
        )
    attachment = _Attachment(name, handler, STORAGE_DTYPES[storage] if storage is not None else None)
    runtime.attachments.append(attachment)
    runtime.invalidate()
    return Handle(model, attachment)


def attached(model: nn.Module) -> list[str]:
    """Names of the handlers attached to ``model``, in chain order."""
    runtime = _runtime(model)
    return [] if runtime is None else [a.name for a in runtime.attachments]


def operand_sizes(model: nn.Module) -> dict[str, dict[tuple[str, str], int]]:
    """Per site, ``(gemm, operand)`` → element count, from the latest forward of an attached model."""
    runtime = _runtime(model)
    if runtime is None:
        return {}
    return {name: dict(sizes) for name, sizes in runtime.sizes.items()}


def on_discovered(model: nn.Module, callback: Callable[[list[Site]], None]) -> None:
    """Call ``callback(sites)`` whenever an attached ``model``'s matmul sites are (re)discovered."""
    runtime = _runtime(model)
    if runtime is None:
        raise ValueError("on_discovered needs a model with an attached handler (numscope.sites.attach)")
    runtime.on_discovered.append(callback)


def is_discovered(model: nn.Module) -> bool:
    """Whether an attached ``model``'s matmul sites have been found by a forward pass."""
    runtime = _runtime(model)
    return runtime is not None and runtime.discovered


def active_handlers(model: nn.Module) -> list[str]:
    """Names of the handlers attached to ``model`` that take part in the forward now running: those that do
    not define ``active()``, say True to it, or set a storage dtype (an observer between its sampled steps,
    or in an evaluation, does not). Asked inside a forward (e.g. from a module's hook); outside one, of a
    forward that would start now."""
    runtime = _runtime(model)
    return [] if runtime is None else runtime.active_names()


def forward_has_grad(model: nn.Module) -> bool:
    """Whether the forward of ``model`` now running began with gradients enabled (a training forward;
    evaluation runs under ``torch.no_grad()``). Handlers are called inside an autograd function, where
    ``torch.is_grad_enabled()`` is always False, so they ask here. True outside a forward."""
    runtime = _runtime(model)
    calls = [] if runtime is None else runtime.root.calls
    return not calls or calls[-1].grad_enabled


def recomputing(model: nn.Module) -> bool:
    """Whether the forward of ``model`` now running is activation checkpointing's recomputation of a part
    of it during backward (see :mod:`numscope._root_call`): its operands were handled once already, in the
    forward (an observer does not count them again; a quantizer gives them the same bits)."""
    runtime = _runtime(model)
    calls = [] if runtime is None else runtime.root.calls
    return bool(calls) and calls[-1].recompute is not None


def refresh(model: nn.Module) -> None:
    """Ask the attached handlers' ``wants(site)`` again at the next site call (answers are cached per site;
    a handler whose answer changes, such as an observer between sampled and skipped steps, calls this)."""
    runtime = _runtime(model)
    if runtime is not None:
        runtime.invalidate()
