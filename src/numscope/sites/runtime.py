"""The interception runtime of one model: its module stack, its attached handlers and the per-op handlers
that route a site's operands through them (the mode that calls them: :mod:`numscope.sites.mode`; the site
names: :mod:`numscope.sites.naming`; how each torch call is read: :mod:`numscope.sites.calls`)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from numscope._rng import fork_rng
from numscope._root_call import SITES, RootCalls
from numscope.sites.calls import (
    _WEIGHT_AXES,
    _accumulate_text,
    _autocast_cast,
    _autocast_dtype,
    _AutocastOff,
    _out_numel,
    _parse,
    _upcast,
)
from numscope.sites.conv import SiteConv, _ConvParams
from numscope.sites.gemm import _LOW, ACCUMULATORS, Site, SiteGemm, _Call, _fold_strides
from numscope.sites.mode import _Interception, _Mode, _outside_dynamo
from numscope.sites.naming import SiteNames, _Discovery, _Frame
from numscope.sites.rnn import CELLS, recurrent_reference
from numscope.sites.sdpa import _sdpa_arguments, _sdpa_kv_heads, _sdpa_sizes, _sizes, sdpa_reference
from numscope.vocab import GEMMS


@dataclass
class _Attachment:
    name: str
    handler: Callable[..., torch.Tensor]
    storage: torch.dtype | None


class _Runtime:
    """The interception state of one model: hooks, module stack, site table, attached handlers."""

    def __init__(self, model: nn.Module) -> None:
        _outside_dynamo()
        self.model_ref = weakref.ref(model)
        self.attachments: list[_Attachment] = []
        self.stack: list[_Frame] = []
        self.mode = _Mode(self)
        self.discovery: _Discovery | None = None
        self.discovered = False
        self.names = SiteNames(model)
        self.sizes: dict[str, dict[tuple[str, str], int]] = {}
        self.on_discovered: list[Callable[[list[Site]], None]] = []
        self.skipped: set[tuple[str, str]] = set()  # (module, op) of GEMMs that ran past the handlers
        self._wanted: dict[str, tuple] = {}
        self.hooks: list[Any] = []
        for qualname, module in model.named_modules():
            kind = self.names.kind_of(module)
            self.hooks.append(module.register_forward_pre_hook(self._pre_hook(qualname, kind)))
            self.hooks.append(module.register_forward_hook(self._post_hook, always_call=True))
        self.root = RootCalls.of(model)
        self.root_handle = self.root.register(
            lambda call, args, kwargs: _Interception(self, call, args, kwargs), SITES
        )
        self.key = self.root_handle.key

    # hooks
    def intercepting(self) -> bool:
        """Whether the innermost forward of the model pushed the interception mode."""
        calls = self.root.calls
        return bool(calls) and getattr(calls[-1].context(self.key), "on", False)

    def _pre_hook(self, qualname: str, kind: str | None):
        def hook(module: nn.Module, args: Any) -> None:
            if self.intercepting():
                self.stack.append(_Frame(qualname, module, kind))

        return hook

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1].module is module and self.intercepting():
            self.stack.pop()

    def in_forward(self) -> bool:
        """Whether the innermost forward is still running (False after a forward was aborted)."""
        return self.root.innermost() is not None

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.root_handle.remove()

    # handlers
    def invalidate(self) -> None:
        self._wanted.clear()

    def active(self) -> bool:
        """Whether a forward starting now is intercepted: unless every attached handler defines
        ``active()`` and says False (and none sets a storage dtype); always while finding sites."""
        if self.discovery is not None or not self.attachments:
            return True
        return bool(self.active_names())

    def active_names(self) -> list[str]:
        """The attached handlers that take part in a forward starting now (or running): those that do not
        define ``active()``, say True to it, or set a storage dtype."""
        return [
            a.name
            for a in self.attachments
            if a.storage is not None or getattr(a.handler, "active", None) is None or a.handler.active()
        ]

    @property
    def storage(self) -> torch.dtype | None:
        for attachment in reversed(self.attachments):
            if attachment.storage is not None:
                return attachment.storage
        return None

    def handlers_for(self, site: Site) -> tuple[tuple, tuple[str, ...]]:
        cached = self._wanted.get(site.name)
        if cached is None:
            wanted = tuple(
                a.handler
                for a in self.attachments
                if getattr(a.handler, "wants", None) is None or a.handler.wants(site)
            )
            accumulate: tuple[str, ...] = ("fp32",) * len(GEMMS)
            for attachment in self.attachments:
                chooser = getattr(attachment.handler, "accumulate", None)
                choice = chooser(site) if chooser is not None else None
                if choice is not None:  # one name, or a mapping gemm -> name (missing: fp32)
                    accumulate = tuple(
                        choice if isinstance(choice, str) else choice.get(gemm, "fp32") for gemm in GEMMS
                    )
            for name in accumulate:
                if name not in ACCUMULATORS:
                    raise ValueError(
                        f"unknown accumulate {name!r} for site {site.name!r}; "
                        f"allowed: {', '.join(ACCUMULATORS)}"
                    )
            cached = (wanted, accumulate)
            self._wanted[site.name] = cached
        return cached

    # per-op handlers: each GEMM call as its site, through the handlers
    def _call(self, site: Site, layout: str, upcast: torch.dtype | None = None) -> _Call | None:
        handlers, accumulate = self.handlers_for(site)
        storage = self.storage
        if not handlers and storage is None:
            return None
        share_input = bool(handlers) and all(
            getattr(handler, "shares_input", None) is not None and handler.shares_input(site)
            for handler in handlers
        )
        share_weight = (
            bool(handlers)
            and layout in ("mm", "batched")
            and all(getattr(h, "shares_weight", lambda site: False)(site) for h in handlers)
        )
        prequantize = (
            bool(handlers)
            and not share_input
            and layout in ("linear", "fold", "mm")
            and all(getattr(h, "prequantizes_wgrad_input", lambda site: False)(site) for h in handlers)
        )
        axes = _WEIGHT_AXES[(site.kind, layout)]
        return _Call(
            site,
            layout,
            handlers,
            accumulate,
            storage,
            axes,
            share_input=share_input,
            share_weight=share_weight,
            upcast=upcast,
            prequantize=prequantize,
        )

    def gemm_call(self, func, args: tuple, kwargs: dict):
        frame = self.stack[-1]
        parsed = _parse(func, args, kwargs)
        if parsed is None:
            if "out" in kwargs:
                self.unintercepted(frame, func, "a GEMM writing into out=")
            return func(*args, **kwargs)
        layout, a, b, bias = parsed
        if layout == "sdpa":
            return self.sdpa_call(frame, func, args, kwargs)
        if layout == "conv":
            return self.conv_call(frame, func, args, kwargs)
        site = self.names.site_for(frame, layout, b)
        self.sizes[site.name] = _sizes(a.numel(), b.numel(), _out_numel(layout, a, b))
        autocast = _autocast_dtype(a)
        call = self._call(site, layout, autocast or _upcast(a, b, bias))
        if call is None:
            return func(*args, **kwargs)
        a, b, bias = _autocast_cast(autocast, a, b, bias)  # type: ignore[assignment]
        if layout in ("linear", "fold") and a.dim() != 2:
            call.meta["a_fold_strides"] = (
                _fold_strides(a) if a.is_contiguous() or layout == "fold" else (a.shape[-1], 1)
            )
        elif layout == "batched":
            call.meta["batch"] = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        with _AutocastOff(a, autocast):
            return SiteGemm.apply(call, a, b, bias)

    def linear_site(self, site: Site, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """``F.linear(a, weight, bias)`` as ``site`` (computed plainly while finding sites)."""
        if self.discovery is not None:
            self.names.ran(site.name)
            return F.linear(a, weight, bias)
        self.sizes[site.name] = _sizes(a.numel(), weight.numel(), _out_numel("linear", a, weight))
        autocast = _autocast_dtype(a)
        call = self._call(site, "linear", autocast or _upcast(a, weight, bias))
        if call is None:
            return F.linear(a, weight, bias)
        a, weight, bias = _autocast_cast(autocast, a, weight, bias)  # type: ignore[assignment]
        if a.dim() != 2:
            call.meta["a_fold_strides"] = _fold_strides(a) if a.is_contiguous() else (a.shape[-1], 1)
        with _AutocastOff(a, autocast):
            return SiteGemm.apply(call, a, weight, bias)

    def recurrent_call(self, func, args: tuple, kwargs: dict):
        """An ``nn.LSTM``/``GRU``/``RNN`` unrolled into its ``ih``/``hh`` GEMMs (see numscope.sites.rnn)."""
        frame = self.stack[-1]
        names = {id(p): name for name, p in frame.module.named_parameters(recurse=False)}
        unrolled = not kwargs and len(args) == 9 and isinstance(args[2], list | tuple)  # not packed
        if unrolled:
            inputs, hx, weights, has_biases, layers, dropout, training, bidirectional, batch_first = args
            expected = layers * (2 if bidirectional else 1) * (4 if has_biases else 2)
            unrolled = len(weights) == expected and all(id(w) in names for w in weights)  # no proj_size
        if not unrolled:
            self.unintercepted(frame, func, "a packed sequence or projected LSTM, fused")
            return func(*args, **kwargs)
        prefix = f"{frame.name}." if frame.name else ""

        def linear(name: str, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
            site = self.names.named_site(prefix + name, frame.name)
            return self.linear_site(site, a, weight, bias)

        return recurrent_reference(
            CELLS[func], [names[id(w)] for w in weights], inputs, hx, weights, has_biases, layers, dropout,
            training, bidirectional, batch_first, linear,
        )  # fmt: skip

    def grouped_call(self, func, args: tuple, kwargs: dict):
        """A grouped GEMM as one ``mm`` site per expert (see :data:`_GROUPED_FUNCS`)."""
        frame = self.stack[-1]
        bound = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), args, strict=False)) | kwargs
        a, b, offs = bound["mat_a"], bound["mat_b"], bound.get("offs")
        sites = [self.names.expert(frame, b, index) for index in range(b.shape[0])] if b.dim() == 3 else []
        usable = a.dim() == 2 and offs is not None and bound.get("bias") is None and None not in sites
        if not usable or bound.get("out_dtype") not in (None, a.dtype):
            self.unintercepted(frame, func, "a grouped GEMM of a layout numscope does not split")
            return func(*args, **kwargs)
        ends = offs.tolist()
        pieces, start = [], 0
        for index, end in enumerate(ends):
            if end > start:
                site, expert, rows = sites[index], b[index], a[start:end]
                self.sizes[site.name] = _sizes(rows.numel(), expert.numel(), rows.shape[0] * expert.shape[1])
                if self.discovery is not None:  # finding sites: in call order, computed as they are
                    self.names.ran(site.name)
                    call = None
                else:
                    call = self._call(site, "mm", _upcast(a, b))
                pieces.append(
                    torch.mm(rows, expert) if call is None else SiteGemm.apply(call, rows, expert, None)
                )
            start = max(start, end)
        if start < a.shape[0]:  # rows past the last offset: zeros, as the grouped kernel leaves them
            pieces.append(a.new_zeros(a.shape[0] - start, b.shape[-1]))
        return torch.cat(pieces) if pieces else a.new_zeros(a.shape[0], b.shape[-1])

    def unintercepted(self, frame: _Frame, func: Callable[..., Any], what: str) -> None:
        """Warn once per module and op that a GEMM runs past numscope (unquantized, unobserved)."""
        name = getattr(func, "__name__", str(func))
        key = (frame.name, name)
        if key in self.skipped:
            return
        self.skipped.add(key)
        where = frame.name or type(frame.module).__name__
        warnings.warn(
            f"numscope: {where} runs {what} ({name}), which numscope does not intercept: it is neither "
            "quantized by a plan nor observed",
            UserWarning,
            stacklevel=2,
        )

    def conv_call(self, frame: _Frame, func, args: tuple, kwargs: dict):
        parsed = _ConvParams.of(func, args, kwargs)
        if parsed is None:  # a string padding torch refuses: torch says so
            return func(*args, **kwargs)
        params, bound = parsed
        x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
        site = self.names.conv_site(frame, weight)
        self.sizes[site.name] = _sizes(x.numel(), weight.numel(), 0)
        autocast = _autocast_dtype(x)
        call = self._call(site, "conv", autocast or _upcast(x, weight, bias))
        if call is None:
            return func(*args, **kwargs)
        x, weight, bias = _autocast_cast(autocast, x, weight, bias)  # type: ignore[assignment]
        if set(call.accumulate) != {"fp32"}:
            raise ValueError(
                f"site {site.name!r}: accumulate {_accumulate_text(call.accumulate)} is not emulated for "
                "convolutions; "
                "give conv sites accumulate fp32 in the plan"
            )
        unbatched = x.dim() == params.dims + 1  # F.conv* accepts an input without a batch axis
        if unbatched:
            x = x.unsqueeze(0)
        with _AutocastOff(x, autocast):
            out = SiteConv.apply(call, params, x, weight, bias)
        self.sizes[site.name] = _sizes(x.numel(), weight.numel(), out.numel())
        return out.squeeze(0) if unbatched else out

    def sdpa_call(self, frame: _Frame, func, args: tuple, kwargs: dict):
        scores_site, context_site = self.names.anonymous(frame, "sdpa")
        bound = _sdpa_arguments(args, kwargs)
        q, k, v = bound["query"], *_sdpa_kv_heads(bound)
        self.sizes[scores_site.name], self.sizes[context_site.name] = _sdpa_sizes(q, k, v)
        calls = {"scores": self._call(scores_site, "batched"), "context": self._call(context_site, "batched")}
        if all(c is None for c in calls.values()):
            return func(*args, **kwargs)
        autocast = _autocast_dtype(q)
        if autocast is not None:  # as autocast would: the operands in its dtype (then float32 copies)
            for name in ("query", "key", "value"):
                bound[name] = _autocast_cast(autocast, bound[name])[0]
        upcast = autocast or _upcast(q, k, v)
        if (
            upcast is not None
        ):  # as the fp32 mode below would: float32 copies, the result in the working dtype
            for name in ("query", "key", "value"):
                if bound[name].dtype in _LOW:
                    bound[name] = bound[name].float()

        def matmul(role: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            call = calls[role]
            if call is None:
                return torch.matmul(a, b)
            call.meta["batch"] = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
            return SiteGemm.apply(call, a, b, None)

        with _AutocastOff(q, autocast):
            out = sdpa_reference(**bound, matmul=matmul)
        return out if upcast is None else out.to(upcast)

    # discovery
    def discover(self, args: tuple, kwargs: dict) -> list[Site]:
        """Run the model once without gradients, in eval mode, to find and name its matmul sites."""
        model = self.model_ref()
        if model is None:
            raise RuntimeError("the model of this runtime no longer exists")
        training = {name: module.training for name, module in model.named_modules()}
        self.discovery = _Discovery()
        self.names.clear_found()
        try:
            with fork_rng(), torch.no_grad():
                model.eval()
                model(*args, **kwargs)
        finally:
            for name, module in model.named_modules():
                module.training = training.get(name, module.training)
            discovery, self.discovery = self.discovery, None
        self.names.name_entries(discovery)
        self.discovered = True
        self.invalidate()
        found = self.all_sites()
        for callback in list(self.on_discovered):
            callback(found)
        return found

    def discover_call(self, func, args: tuple, kwargs: dict):
        assert self.discovery is not None
        frame = self.stack[-1] if self.stack else None
        return self.names.discovered_call(func, args, kwargs, frame, self.discovery)

    def all_sites(self) -> list[Site]:
        """The model's sites (see :meth:`SiteNames.all_sites`)."""
        return self.names.all_sites(self.discovered)
