"""The interception mode: the ``TorchFunctionMode`` that a model's forward pushes (one
:class:`_Interception` per root call) and its dispatch of each torch call to the runtime's per-op
handlers, kept out of ``torch.compile``'s tracing."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from numscope._root_call import RootCall, remove_mode
from numscope.sites.calls import (
    _ADDMM_FUNCS,
    _BADDBMM_FUNCS,
    _COMPOSITE_FUNCS,
    _GEMM_FUNCS,
    _GROUPED_FUNCS,
    _UNINTERCEPTED,
    _einsum_as_matmul,
    _scaled_product,
)
from numscope.sites.rnn import CELLS


class RuntimeView(Protocol):
    """What the interception asks of a model's runtime (:class:`numscope.sites.runtime._Runtime` has it): the
    frames of the modules being called, the site discovery's state, the attached handlers and the per-op
    handlers the mode dispatches to. This module knows the runtime through it alone."""

    stack: list[Any]
    discovery: Any
    discovered: bool
    attachments: list[Any]
    mode: _Mode
    root: Any
    key: Any

    def in_forward(self) -> bool: ...
    def active(self) -> bool: ...
    def discover(self, args: tuple, kwargs: dict) -> Any: ...
    def discover_call(self, func: Any, args: tuple, kwargs: dict) -> Any: ...
    def gemm_call(self, func: Any, args: tuple, kwargs: dict) -> Any: ...
    def grouped_call(self, func: Any, args: tuple, kwargs: dict) -> Any: ...
    def recurrent_call(self, func: Any, args: tuple, kwargs: dict) -> Any: ...
    def unintercepted(self, frame: Any, func: Any, what: str) -> None: ...


class _Mode(TorchFunctionMode):
    def __init__(self, runtime: RuntimeView) -> None:
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        runtime = self.runtime
        unfused = _COMPOSITE_FUNCS.get(func)
        if unfused is not None and runtime.stack:
            with self:  # this mode stays on for the GEMMs inside
                return unfused(*args, **kwargs)
        if (func in _ADDMM_FUNCS or func in _BADDBMM_FUNCS) and runtime.stack:
            scaled = _scaled_product(func, args, kwargs)
            if scaled is not None:  # alpha or beta not 1: the product a site, the scalings around it
                with self:
                    return scaled()
        if func in CELLS and runtime.stack and (runtime.discovery is not None or runtime.in_forward()):
            return runtime.recurrent_call(func, args, kwargs)
        if func is torch.einsum and runtime.stack:
            product = _einsum_as_matmul(args, kwargs)
            if product is not None:  # two operands: the matmul it amounts to, a site like any other
                with self:
                    return product()
        if func in _UNINTERCEPTED and runtime.stack:
            runtime.unintercepted(runtime.stack[-1], func, _UNINTERCEPTED[func])
            return func(*args, **kwargs)
        if (
            func in _GROUPED_FUNCS
            and runtime.stack
            and (runtime.discovery is not None or runtime.in_forward())
        ):
            return runtime.grouped_call(func, args, kwargs)
        if runtime.discovery is not None:
            return runtime.discover_call(func, args, kwargs)
        if func not in _GEMM_FUNCS or not runtime.stack or not runtime.in_forward():
            return func(*args, **kwargs)
        return runtime.gemm_call(func, args, kwargs)


_DYNAMO_DISABLED = False


def _outside_dynamo() -> None:
    """Keep ``torch.compile`` out of the interception: :class:`_Mode`'s ``__torch_function__`` runs as it
    is (dynamo does not trace it). Traced, each site's quantizers were compiled once per site name until
    the limit of recompilations (the first step of a one-layer Llama took 57 s, each later one 5× eager's);
    so a converted model under ``torch.compile`` computes as in eager, the same bits, at about eager's speed.
    Done when the first model is attached, not at import (``torch._dynamo`` takes a second to import)."""
    global _DYNAMO_DISABLED
    if not _DYNAMO_DISABLED:
        import torch._dynamo

        _Mode.__torch_function__ = torch._dynamo.disable(_Mode.__torch_function__)  # type: ignore[method-assign]
        _DYNAMO_DISABLED = True


class _Interception:
    """The sites' context of one root call (see :mod:`numscope._root_call`).

    Finds the model's matmul sites first where a handler is attached and no forward has found them, then
    pushes the interception mode, unless an enclosing forward of the same model already intercepts (a
    forward nested in another) or no handler is active.
    """

    def __init__(self, runtime: RuntimeView, call: RootCall, args: tuple, kwargs: dict) -> None:
        self.runtime = runtime
        self.call: RootCall | None = call
        self.inputs: tuple[tuple, dict] | None = (args, kwargs)
        self.on = False

    def __enter__(self) -> None:
        runtime, call = self.runtime, self.call
        args, kwargs = self.inputs  # type: ignore[misc]
        self.inputs = None
        if runtime.discovery is None and not runtime.discovered and runtime.attachments:
            runtime.discover(args, kwargs)
        calls = runtime.root.calls
        index = calls.index(call) if call in calls else 0
        outer = calls[index - 1].context(runtime.key) if index > 0 else None
        if getattr(outer, "on", False) or not runtime.active():
            return
        runtime.mode.__enter__()
        self.on = True
        for attachment in runtime.attachments:
            begins = getattr(attachment.handler, "forward_begins", None)
            if begins is not None:
                begins(call.recompute is not None, call.grad_enabled)

    def __exit__(self, *exc: object) -> None:
        self.call = None
        if self.on:
            self.on = False
            remove_mode(self.runtime.mode)
            self.runtime.stack.clear()
