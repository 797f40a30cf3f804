"""Contexts opened around each forward of a root model, which a Ctrl-C inside the forward cannot leak.

:mod:`numscope.sites` (its interception mode), :func:`numscope.keep_fp32_ops` (a ``TorchFunctionMode``) and
:func:`numscope.store_activations` (saved-tensor hooks) each need a context for exactly the duration of a
model's forward. They register it here: one root pre-hook opens every registered context, in a fixed order
(``order``, lowest first: the context opened first is the outermost, so its torch-function mode is
the lowest on torch's stack), and one root post-hook closes them in reverse.

torch runs ``always_call`` forward hooks when the forward raises an ``Exception``, but not for a
``KeyboardInterrupt`` (Ctrl-C) or ``SystemExit``: their contexts stay open. So each :class:`RootCall`
remembers the Python frame it runs in; contexts ask :meth:`RootCall.is_live` and pass through when their
call has ended, and the next forward of the model closes the contexts of every call whose frame is gone
(a torch-function mode or saved-tensor hook pair is taken from wherever it sits on its stack).

Activation checkpointing (``torch.utils.checkpoint`` in either mode, transformers'
``gradient_checkpointing_enable``) runs a part of the model's forward again during backward, outside any
forward of the root. A submodule whose forward starts while no forward of the root runs and autograd is
running a backward is such a recomputation: it gets a :class:`RootCall` of its own (``recompute`` is that
submodule), so that the registered contexts (the sites' interception, the fp32 ops) see the recomputed
forward as they saw the first one. Contexts registered with ``recompute=False`` (saved-tensor hooks, which
would take the saved tensors from the checkpoint's own hooks) are not opened for it.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: the order of :func:`numscope.keep_fp32_ops`: outside the sites' mode, so that sites see the
#: parameters themselves and GEMMs that are no site still reach the fp32 rules
OUTSIDE_SITES = -1
#: the order of the :mod:`numscope.sites` interception mode
SITES = 0
#: the order of contexts that need not see anything sites do (saved-tensor hooks)
INSIDE_SITES = 1

MakeContext = Callable[["RootCall", tuple, dict], AbstractContextManager[Any]]


class RootCall:
    """One running forward of a root model: where it runs, its grad mode, the contexts opened for it."""

    __slots__ = ("caller", "grad_enabled", "opened", "recompute")

    def __init__(self, caller: Any, grad_enabled: bool, recompute: nn.Module | None = None) -> None:
        self.caller = caller
        self.grad_enabled = grad_enabled
        self.opened: dict[int, AbstractContextManager[Any]] = {}  # registration id -> context, in order
        #: the submodule whose forward activation checkpointing runs again in backward (None: a forward)
        self.recompute = recompute

    def is_live(self) -> bool:
        """Whether this forward is still running (its frame is on the Python stack of the caller)."""
        caller, frame = self.caller, sys._getframe(1)
        while frame is not None:
            if frame is caller:
                return True
            frame = frame.f_back
        return False

    def context(self, key: int) -> AbstractContextManager[Any] | None:
        """The context that registration ``key`` opened for this call (``None``: not opened)."""
        return self.opened.get(key)


class RootHandle:
    """One registered context; :meth:`remove` unregisters it (the last removal removes the hooks)."""

    def __init__(self, calls: RootCalls, key: int) -> None:
        self._calls = calls
        self.key = key

    def remove(self) -> None:
        self._calls.unregister(self.key)


_REGISTRY: weakref.WeakKeyDictionary[nn.Module, RootCalls] = weakref.WeakKeyDictionary()


class RootCalls:
    """The root forward hooks of one model and the contexts registered to open around each forward."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)
        self.calls: list[RootCall] = []
        self._contexts: list[tuple[int, int, MakeContext, bool]] = []  # (order, key, make, recompute), sorted
        self._next_key = 0
        self._hooks = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._exit, always_call=True),
        ]
        for module in model.modules():
            if module is not model:
                self._hooks.append(module.register_forward_pre_hook(self._enter_part, prepend=True))
                self._hooks.append(module.register_forward_hook(self._exit_part, always_call=True))

    @staticmethod
    def of(model: nn.Module) -> RootCalls:
        """The registry of ``model``, created with its hooks on first use."""
        calls = _REGISTRY.get(model)
        if calls is None:
            calls = _REGISTRY[model] = RootCalls(model)
        return calls

    def register(self, make: MakeContext, order: int, recompute: bool = True) -> RootHandle:
        """Open ``make(call, args, kwargs)`` around each forward, after contexts of lower ``order``;
        ``recompute``: also around a checkpointed part's recomputation (see the module docstring)."""
        key = self._next_key
        self._next_key += 1
        self._contexts.append((order, key, make, recompute))
        self._contexts.sort(key=lambda entry: (entry[0], entry[1]))
        return RootHandle(self, key)

    def unregister(self, key: int) -> None:
        self._contexts = [entry for entry in self._contexts if entry[1] != key]
        if not self._contexts:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            model = self.model()
            if model is not None and _REGISTRY.get(model) is self:
                del _REGISTRY[model]

    def innermost(self) -> RootCall | None:
        """The innermost forward now running (``None`` outside a forward, or after one was aborted)."""
        if not self.calls:
            return None
        call = self.calls[-1]
        return call if call.is_live() else None

    def _enter(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        self._open(RootCall(sys._getframe(1), torch.is_grad_enabled()), args, kwargs)

    def _open(self, call: RootCall, args: tuple, kwargs: dict) -> None:
        # pushed first: should anything below raise, the always_call exit hook pops this very call
        self.calls.append(call)
        self._drop_aborted(call.caller)
        for _, key, make, recompute in list(self._contexts):
            if call.recompute is not None and not recompute:
                continue
            context = make(call, args, kwargs)
            context.__enter__()
            call.opened[key] = context

    def _exit(self, model: nn.Module, args: Any, output: Any) -> None:
        if self.calls:
            _close(self.calls.pop())

    def _enter_part(self, module: nn.Module, args: tuple) -> None:
        """A submodule's forward: a recomputation of activation checkpointing where no forward of the root
        runs and autograd runs a backward (both checkpoint modes recompute inside the backward)."""
        if self.calls or torch._C._current_graph_task_id() == -1:
            return
        self._open(RootCall(sys._getframe(1), torch.is_grad_enabled(), recompute=module), args, {})

    def _exit_part(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.calls and self.calls[-1].recompute is module:
            _close(self.calls.pop())

    def _drop_aborted(self, caller: Any) -> None:
        """Close the calls below the newest one whose frames are gone (forwards aborted by Ctrl-C)."""
        live = set()
        frame = caller
        while frame is not None:
            live.add(id(frame))
            frame = frame.f_back
        while len(self.calls) > 1 and id(self.calls[-2].caller) not in live:
            _close(self.calls.pop(-2))


def _close(call: RootCall) -> None:
    """Close ``call``'s contexts, innermost first (a mode leaves torch's stack wherever it sits)."""
    for context in reversed(list(call.opened.values())):
        if isinstance(context, TorchFunctionMode):
            remove_mode(context)
        else:
            context.__exit__(None, None, None)
    call.opened.clear()


def remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off torch's function-mode stack wherever it sits (the modes above keep their order)."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


class SavedTensorHooks:
    """``torch.autograd.graph.saved_tensors_hooks`` whose exit takes its own pair off the stack wherever
    it sits (the plain one pops whatever is on top)."""

    def __init__(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> None:
        self.pack = pack
        self.unpack = unpack

    def __enter__(self) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)

    def __exit__(self, *exc: object) -> None:
        above = []
        while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            if top[0] is self.pack and top[1] is self.unpack:
                break
            above.append(top)
        for pack, unpack in reversed(above):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


_EXACT = "_numscope_saved_exactly"


def save_exactly(*tensors: torch.Tensor | None) -> None:
    """Mark tensors that a site saves for backward in the exact form its handlers made them (a quantized
    operand, its codes, its scales): saved-tensor hooks that store activations in fewer bits keep these as
    they are (rounding them again would change the plan's values, and a scale rounded to fp16 every value
    it multiplies)."""
    for tensor in tensors:
        if tensor is not None:
            setattr(tensor, _EXACT, True)


def saved_exactly(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` was marked by :func:`save_exactly`."""
    return getattr(tensor, _EXACT, False)
