"""Run a context manager around every forward of a root model (entered first thing, left last thing)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn


class ForwardContext:
    """Enter ``make()`` when ``model``'s forward starts and leave it when that forward ends (or raises).

    The pre-hook is appended and the post-hook prepended, so the context sits inside every context that
    other root hooks open (the :mod:`numscope.sites` interception mode among them) and is left before
    theirs, whatever the order of construction. A forward nested in another forward of the same model
    gets its own context. :meth:`remove` takes the hooks away.
    """

    def __init__(self, model: nn.Module, make: Callable[[], AbstractContextManager[Any]]) -> None:
        self._make = make
        self._open: list[AbstractContextManager[Any]] = []
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, prepend=True, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: Any) -> None:
        context = self._make()
        context.__enter__()
        self._open.append(context)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
