"""The interception runtime: a ``TorchFunctionMode`` that finds sites in a model's forward, names them, and
routes their operands through the attached handlers."""

from __future__ import annotations

import math
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

from numscope._rng import fork_rng
from numscope._root_call import SITES, RootCall, RootCalls, remove_mode
from numscope.sites.conv import _CONV_FUNCS, SiteConv, _ConvParams
from numscope.sites.gemm import _LOW, ACCUMULATORS, Site, SiteGemm, _Call, _fold_strides
from numscope.sites.rnn import CELLS, recurrent_reference
from numscope.sites.sdpa import _sdpa_arguments, _sdpa_kv_heads, _sdpa_sizes, _sizes, sdpa_reference
from numscope.vocab import GEMMS

_LINEAR_FUNCS = {F.linear}


def _accumulate_text(accumulate: tuple[str, ...]) -> str:
    """``'bf16'``, or ``'fp22/fp32/fp32' (fprop/dgrad/wgrad)`` where the GEMMs differ."""
    if len(set(accumulate)) == 1:
        return repr(accumulate[0])
    return f"{'/'.join(accumulate)!r} (fprop/dgrad/wgrad)"


_MM_FUNCS = {torch.mm, torch.Tensor.mm}
_ADDMM_FUNCS = {torch.addmm, torch.Tensor.addmm}
_BADDBMM_FUNCS = {torch.baddbmm, torch.Tensor.baddbmm}
_MATMUL_FUNCS = {torch.matmul, torch.Tensor.matmul, torch.linalg.matmul, torch.bmm, torch.Tensor.bmm}
_RMATMUL_FUNCS = {torch.Tensor.__rmatmul__}
_SDPA_FUNCS = {F.scaled_dot_product_attention}
_GEMM_FUNCS = (
    _LINEAR_FUNCS
    | _MM_FUNCS
    | _ADDMM_FUNCS
    | _BADDBMM_FUNCS
    | _MATMUL_FUNCS
    | _RMATMUL_FUNCS
    | _SDPA_FUNCS
    | set(_CONV_FUNCS)
)
_SOFTMAX_FUNCS = {torch.softmax, torch.Tensor.softmax, F.softmax, torch._softmax}


#: GEMMs numscope does not intercept: running one inside an attached model's forward warns, once per module
#: and op, that it stays unquantized and unobserved (never silently)
_UNINTERCEPTED: dict[Callable[..., Any], str] = {
    torch.einsum: "an einsum that is not one matmul",
    torch.bilinear: "a bilinear product",
    F.bilinear: "a bilinear product",
    torch.tensordot: "a tensordot",
    torch.addbmm: "an addbmm (a sum of batched products)",
    torch.Tensor.addbmm: "an addbmm (a sum of batched products)",
    torch.linalg.multi_dot: "a multi_dot chain",
    torch.chain_matmul: "a chain_matmul",
    torch.mv: "a matrix-vector product",
    torch.Tensor.mv: "a matrix-vector product",
    torch.addmv: "a matrix-vector product",
    torch.Tensor.addmv: "a matrix-vector product",
    torch.inner: "an inner product",
}
#: grouped GEMMs (mixture-of-experts experts): a 2-D input whose rows are sorted by expert times a 3-D
#: stack of expert weights, ``offs`` the cumulative row counts; each expert is a site of its own
_GROUPED_FUNCS = {
    func for func in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if func is not None
}

_WEIGHT_AXES: dict[tuple[str, str], tuple[int, int]] = {
    ("conv", "conv"): (1, 0),  # a convolution's own axes: _ConvParams.weight_axes
    ("linear", "linear"): (-1, 0),
    ("matmul", "linear"): (-1, 0),
    ("conv1d", "mm"): (0, -1),
    ("linear", "mm"): (0, -1),
    ("linear", "fold"): (-2, -1),  # x @ W.T with x of 3 or more axes (a Linear's weight, transposed)
    ("matmul", "mm"): (0, -1),
    ("matmul", "fold"): (-2, -1),
    ("matmul", "batched"): (-2, -1),
    ("sdpa", "batched"): (-2, -1),
}


def _matmul_layout(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Which decomposition ``at::matmul`` uses for ``a @ b`` (``None``: a 1-D operand, not a site)."""
    if a.dim() < 2 or b.dim() < 2:
        return None
    if a.dim() == 2 and b.dim() == 2:
        return "mm"
    if a.dim() >= 3 and b.dim() == 2:
        if b.requires_grad or a.numel() == 0:
            return "fold"
        shape, strides = a.shape, a.stride()
        foldable = all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(a.dim() - 2))
        return "fold" if foldable else "batched"
    return "batched"


def _parse(func, args: tuple, kwargs: dict) -> tuple[str, Any, Any, Any] | None:
    """(layout, a, b, bias) of a GEMM call, or ``None`` where the call is not a site (1-D, out=, alpha…)."""
    if func in _SDPA_FUNCS:
        return ("sdpa", None, None, None)
    if func in _CONV_FUNCS:
        return ("conv", None, None, None)
    if "out" in kwargs:
        return None
    if func in _LINEAR_FUNCS:
        weight = args[1] if len(args) > 1 else kwargs["weight"]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return ("linear", args[0], weight, bias) if weight.dim() == 2 else None
    if func in _ADDMM_FUNCS or func in _BADDBMM_FUNCS:
        # as torch parses them: addmm(input, mat1, mat2, *, beta, alpha), baddbmm(input, batch1, batch2, ...)
        names = ("input", "mat1", "mat2") if func in _ADDMM_FUNCS else ("input", "batch1", "batch2")
        given = dict(zip(names, args[:3], strict=False)) | kwargs
        extra = dict(zip(("beta", "alpha"), args[3:], strict=False)) | kwargs
        bias, a, b = (given.get(name) for name in names)
        if not all(isinstance(t, torch.Tensor) for t in (bias, a, b)):
            return None
        rank = 2 if func in _ADDMM_FUNCS else 3
        if extra.get("beta", 1) != 1 or extra.get("alpha", 1) != 1 or a.dim() != rank or b.dim() != rank:
            return None
        return ("mm" if rank == 2 else "batched", a, b, bias)
    a, b = (args[1], args[0]) if func in _RMATMUL_FUNCS else (args[0], args[1])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    layout = _matmul_layout(a, b)
    return None if layout is None else (layout, a, b, None)


def _scaled_product(func, args: tuple, kwargs: dict) -> Callable[[], torch.Tensor] | None:
    """``addmm``/``baddbmm`` with ``alpha`` or ``beta`` other than 1, as ``beta · input + alpha · (a @ b)``
    with the product a site (``mm``/``bmm``, run under the mode); ``beta = 0`` ignores ``input``, as torch
    does (a NaN there does not propagate). ``None`` where the call is a plain one (or writes into ``out=``).
    The same value as torch's fused kernel up to float32 rounding (it scales and adds after the product)."""
    names = ("input", "mat1", "mat2") if func in _ADDMM_FUNCS else ("input", "batch1", "batch2")
    given = dict(zip(names, args[:3], strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    extra = dict(zip(("beta", "alpha"), args[3:], strict=False)) | kwargs
    beta, alpha = extra.get("beta", 1), extra.get("alpha", 1)
    if "out" in kwargs or (beta == 1 and alpha == 1):
        return None
    bias, a, b = (given.get(name) for name in names)
    if not all(isinstance(t, torch.Tensor) for t in (bias, a, b)):
        return None
    product = torch.mm if func in _ADDMM_FUNCS else torch.bmm

    def scaled() -> torch.Tensor:
        out = product(a, b)
        if alpha != 1:
            out = out * alpha
        return out if beta == 0 else out + (bias if beta == 1 else bias * beta)

    return scaled


def _upcast(*operands: torch.Tensor | None) -> torch.dtype | None:
    """The working dtype in which a mode below the interception mode has GEMMs computed on float32 values.

    A ``TorchFunctionMode`` (such as :class:`numscope.train.fp32_ops.Fp32Ops`) opts in by defining
    ``fp32_gemm_dtype() -> torch.dtype | None``; where one of ``operands`` has that dtype the site function
    computes on float32 copies of its fp16/bf16 operands and returns that dtype, as the mode would have.
    """
    if not any(t is not None and t.dtype in _LOW for t in operands):
        return None
    for index in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        ask = getattr(torch._C._get_function_stack_at(index), "fp32_gemm_dtype", None)
        dtype = None if ask is None else ask()
        if dtype is not None:
            return dtype if any(t is not None and t.dtype == dtype for t in operands) else None
    return None


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes a GEMM on ``tensor``'s device in, where it is on there.

    A site under autocast does what autocast does to a GEMM (its floating operands cast to that dtype,
    float64 excepted; the product in that dtype, accumulated in float32) with the plan's quantizers on the
    cast operands: it multiplies float32 copies of them with autocast off inside and returns that dtype.
    """
    device = tensor.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(device) if enabled else None


def _autocast_cast(
    dtype: torch.dtype | None, *tensors: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` as autocast casts a GEMM's arguments to ``dtype`` (float32 and the other 16-bit
    floating dtypes; float64 and integers stay)."""
    if dtype is None:
        return tensors
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


class _AutocastOff:
    """``torch.autocast(device, enabled=False)`` where ``dtype`` (a site under autocast) says so."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype | None) -> None:
        self.context = torch.autocast(tensor.device.type, enabled=False) if dtype is not None else None

    def __enter__(self) -> None:
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)


def _out_numel(layout: str, a: torch.Tensor, b: torch.Tensor) -> int:
    if layout == "linear":
        return a.numel() // max(a.shape[-1], 1) * b.shape[0]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return math.prod(batch) * a.shape[-2] * b.shape[-1]


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _static_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    return None


def _parametrized(module: nn.Module) -> bool:
    """Whether ``module.weight`` is computed by ``torch.nn.utils.parametrize`` (``weight_norm`` and kin)."""
    return "weight" in getattr(module, "parametrizations", {})


def _weight_shape(module: nn.Module, layout: str) -> tuple[int, ...] | None:
    """The shape a parametrized Linear's computed weight has in ``F.linear`` (None: not a Linear)."""
    if isinstance(module, nn.Linear) and layout == "linear":
        return (module.out_features, module.in_features)
    return None


@dataclass
class _Frame:
    name: str
    module: nn.Module
    kind: str | None
    calls: int = 0


@dataclass
class _Attachment:
    name: str
    handler: Callable[..., torch.Tensor]
    storage: torch.dtype | None


@dataclass
class _Discovery:
    """Per-call dataflow tags of the discovery pass (names matmul roles)."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    tags: dict[int, frozenset] = field(default_factory=dict)
    alive: list[torch.Tensor] = field(default_factory=list)

    def tags_of(self, values: Iterable[Any]) -> frozenset:
        found: frozenset = frozenset()
        for value in values:
            if isinstance(value, torch.Tensor):
                found = found | self.tags.get(id(value), frozenset())
        return found

    def tag(self, outputs: Any, tags: frozenset) -> None:
        if not tags:
            return
        for value in _pytree.tree_leaves(outputs):
            if isinstance(value, torch.Tensor):
                self.tags[id(value)] = tags
                self.alive.append(value)


def _einsum_as_matmul(args: tuple, kwargs: dict) -> Callable[[], torch.Tensor] | None:
    """A two-operand ``torch.einsum`` as the one ``torch.matmul`` it amounts to, or None where the call is
    not of that kind (sublist form, ``...``, a repeated index in one operand, broadcasting, ≠ 2 operands).

    Indices in both operands and the output are batch axes, in both but not the output contracted, in one
    operand and the output free (rows of the left, columns of the right); an index in one operand only
    and not in the output is summed away first. Implicit output (no ``->``): the indices that occur once,
    in alphabetical order, as torch.einsum does. The result equals torch.einsum's in value (both reduce
    to a batched GEMM; the bits may differ where torch picks another operand order).
    """
    if kwargs or len(args) < 2 or not isinstance(args[0], str):
        return None
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) != 2 or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != 2 or not all(term.isalpha() for term in terms) or (output and not output.isalpha()):
        return None
    left, right = terms
    if not arrow:
        output = "".join(sorted(c for c in set(left + right) if (left + right).count(c) == 1))
    a, b = operands
    if (a.dim(), b.dim()) != (len(left), len(right)):
        return None
    if any(len(set(t)) != len(t) for t in (left, right, output)):
        return None  # a diagonal or a repeated output index
    if not set(output) <= set(left) | set(right):
        return None
    size = dict(zip(left, a.shape, strict=True))
    if any(size.get(c, n) != n for c, n in zip(right, b.shape, strict=True)):
        return None  # broadcasting a size-1 axis: left to torch.einsum
    size.update(zip(right, b.shape, strict=True))
    batch = [c for c in output if c in left and c in right]
    rows = [c for c in output if c in left and c not in right]
    cols = [c for c in output if c in right and c not in left]
    contracted = [c for c in left if c in right and c not in output]

    def operand(
        x: torch.Tensor, term: str, other: str, order: list[str], shape: tuple[int, ...]
    ) -> torch.Tensor:
        lonely = [i for i, c in enumerate(term) if c not in other and c not in output]
        if lonely:
            x = x.sum(dim=lonely)
        kept = [c for c in term if c in other or c in output]
        return x.permute([kept.index(c) for c in order]).reshape(shape)

    def product() -> torch.Tensor:
        m, k, n = (math.prod(size[c] for c in axes) for axes in (rows, contracted, cols))
        batch_size = (math.prod(size[c] for c in batch),) if batch else ()
        x = operand(a, left, right, [*batch, *rows, *contracted], (*batch_size, m, k))
        y = operand(b, right, left, [*batch, *contracted, *cols], (*batch_size, k, n))
        z = torch.matmul(x, y).reshape(tuple(size[c] for c in (*batch, *rows, *cols)))
        order = [*batch, *rows, *cols]
        return z.permute([order.index(c) for c in output])

    return product


def _unfused(function: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of a composite ``torch.nn.functional`` function that does not hand itself to torch-function
    modes as a whole (its ``has_torch_function`` check answers False), so that the GEMMs it issues reach the
    interception mode one by one, as the original computes them."""
    namespace = {**function.__globals__, "has_torch_function": lambda *args: False}
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


#: ``nn.MultiheadAttention`` (and ``nn.Transformer*`` through it) computes in one functional call, which a
#: torch-function mode would receive whole: it runs unfused, its in- and out-projections and its two
#: attention products each a site. Under the mode its fast path (``torch._native_multi_head_attention``) is
#: never taken: ``MultiheadAttention.forward`` leaves it wherever a torch function mode is active.
_COMPOSITE_FUNCS: dict[Callable[..., Any], Callable[..., Any]] = {
    F.multi_head_attention_forward: _unfused(F.multi_head_attention_forward)
}


class _Mode(TorchFunctionMode):
    def __init__(self, runtime: _Runtime) -> None:
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

    def __init__(self, runtime: _Runtime, call: RootCall, args: tuple, kwargs: dict) -> None:
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
        self.table: dict[tuple[str, int], tuple[Site, ...]] = {}
        self.order: list[str] = []
        self.sizes: dict[str, dict[tuple[str, str], int]] = {}
        self.on_discovered: list[Callable[[list[Site]], None]] = []
        self.static: dict[int, Site] = {}
        self.named: dict[str, Site] = {}  # sites named for what they compute (MultiheadAttention projections)
        self.skipped: set[tuple[str, str]] = set()  # (module, op) of GEMMs that ran past the handlers
        self._wanted: dict[str, tuple] = {}
        self.hooks: list[Any] = []
        #: the weight Parameter of each Linear/Conv1D module → the module and its site: a GEMM
        #: on that weight (or its transpose) runs as the module's site wherever it runs (a module that
        #: multiplies with its own weight outside F.linear, or a parent that uses a child's weight)
        self.weights: dict[int, tuple[nn.Module, Site]] = {}
        for qualname, module in model.named_modules():
            kind = _static_kind(module)
            if kind is not None:
                self.static[id(module)] = Site(qualname, qualname, kind)
                weight = module._parameters.get("weight")
                if kind != "conv" and isinstance(weight, nn.Parameter):
                    self.weights.setdefault(id(weight), (module, self.static[id(module)]))
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
        return any(
            a.storage is not None or getattr(a.handler, "active", None) is None or a.handler.active()
            for a in self.attachments
        )

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

    # sites
    def all_sites(self) -> list[Site]:
        found: dict[str, Site] = {}
        for entry in self.table.values():
            for site in entry:
                found[site.name] = site
        static = {site.name: site for site in self.static.values()} | self.named
        names = [n for n in self.order if n in found or n in static]
        if not self.discovered:  # before a forward: every Linear/Conv1D/convolution module, as a guess
            names += [n for n in static if n not in names]
        names += [n for n in found if n not in names]
        return [found.get(n) or static[n] for n in names]

    def anonymous(self, frame: _Frame, kind: str) -> tuple[Site, ...]:
        index = frame.calls
        frame.calls += 1
        entry = self.table.get((frame.name, index))
        if entry is None:
            prefix = f"{frame.name}." if frame.name else ""
            if kind == "sdpa":
                entry = (
                    Site(f"{prefix}call{index}.scores", frame.name, kind),
                    Site(f"{prefix}call{index}.context", frame.name, kind),
                )
            else:
                entry = (Site(f"{prefix}call{index}", frame.name, kind),)
            self.table[(frame.name, index)] = entry
        return entry

    def _site_for(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site:
        named = self._module_site(frame, layout, weight) or (
            self._projection(frame, layout, weight)
            or self._own_weight(frame, layout, weight)
            or (self._expert(frame, weight) if layout in ("linear", "mm") else None)
        )
        return named if named is not None else self.anonymous(frame, "matmul")[0]

    def _module_site(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
        """The site of the Linear/Conv1D module whose weight this GEMM multiplies by, wherever it runs: the
        module's own ``F.linear`` (or Conv1D's ``addmm``); its weight parameter, or that parameter
        transposed (``x @ self.weight.T``, as transformers' FalconLinear), in any frame (a parent module
        using a child's weight); a parametrized weight (``weight_norm``) in its module's own forward."""
        static = self.static.get(id(frame.module))
        if static is not None and layout in ("linear", "mm"):
            own = frame.module._parameters.get("weight")
            if own is weight or getattr(frame.module, "weight", None) is weight:
                return static
            if _parametrized(frame.module) and tuple(weight.shape) == _weight_shape(frame.module, layout):
                return static
        found = self.weights.get(id(weight))
        if found is not None and layout in ("linear", "mm"):
            return found[1] if (found[1].kind == "conv1d") == (layout == "mm") else None
        base = weight._base
        found = self.weights.get(id(base)) if base is not None else None
        transposed = (
            found is not None
            and found[1].kind == "linear"
            and layout in ("mm", "fold")
            and weight.dim() == 2
            and tuple(weight.shape) == tuple(base.shape)[::-1]  # type: ignore[union-attr]
            and weight.stride() == base.stride()[::-1]  # type: ignore[union-attr]
        )
        return found[1] if transposed else None  # type: ignore[index]  # (in, out): mm's right operand

    def _projection(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
        """The named site of a ``MultiheadAttention`` projection: ``out_proj`` (its Linear's own site),
        ``in_proj`` (the packed weight: self-attention), ``in_proj_q``/``in_proj_kv``/``in_proj_k``/
        ``in_proj_v`` (its slices: cross-attention), ``q_proj``/``k_proj``/``v_proj`` (separate weights)."""
        module = frame.module
        if layout != "linear" or not isinstance(module, nn.MultiheadAttention):
            return None
        if weight is module.out_proj.weight:
            return self.static[id(module.out_proj)]
        name = None
        for attribute in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            if weight is getattr(module, attribute, None):
                name = attribute[:6]
        packed = module.in_proj_weight
        if packed is not None and weight is packed:
            name = "in_proj"
        elif packed is not None and weight._base is packed:
            rows = weight.shape[0] // module.embed_dim
            first = (weight.storage_offset() - packed.storage_offset()) // (
                module.embed_dim * packed.shape[1]
            )
            name = "in_proj_kv" if rows == 2 else f"in_proj_{'qkv'[first]}"
        if name is None:
            return None
        qualified = f"{frame.name}.{name}" if frame.name else name
        return self.named.setdefault(qualified, Site(qualified, frame.name, "linear"))

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
        site = self._site_for(frame, layout, b)
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

    def _expert(self, frame: _Frame, weight: torch.Tensor, index: int | None = None) -> Site | None:
        """The site of one expert of a module that keeps its experts' weights stacked in one parameter
        (``experts.gate_up_proj`` of shape (E, …)): named ``<module>.<parameter>.<expert>``, stable from batch
        to batch whatever order the experts are hit in. ``weight`` is the stack (with ``index``) or one
        expert's slice of it."""
        for attribute, parameter in frame.module.named_parameters(recurse=False):
            if parameter.dim() != 3:
                continue
            stack = weight if weight is parameter else weight._base
            if stack is not parameter:
                continue
            if index is None:
                offset = weight.storage_offset() - parameter.storage_offset()
                index = offset // parameter[0].numel()
            prefix = f"{frame.name}." if frame.name else ""
            name = f"{prefix}{attribute}.{index}"
            return self.named.setdefault(name, Site(name, frame.name, "linear"))
        return None

    def _own_weight(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
        """A module's own ``weight`` in ``F.linear`` (a router, a custom projection): the module's site."""
        if layout != "linear" or getattr(frame.module, "weight", None) is not weight or not frame.name:
            return None
        return self.named.setdefault(frame.name, Site(frame.name, frame.name, "linear"))

    def linear_site(self, site: Site, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """``F.linear(a, weight, bias)`` as ``site`` (computed plainly while finding sites)."""
        if self.discovery is not None:
            if site.name not in self.order:
                self.order.append(site.name)
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
            site = self.named.setdefault(prefix + name, Site(prefix + name, frame.name, "linear"))
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
        sites = [self._expert(frame, b, index) for index in range(b.shape[0])] if b.dim() == 3 else []
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
                    if site.name not in self.order:
                        self.order.append(site.name)
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
        site = self._conv_site(frame, weight)
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

    def _conv_is_static(self, frame: _Frame, weight: torch.Tensor) -> bool:
        """Whether a convolution is its module's own (a Conv/ConvTranspose layer with this weight)."""
        static = self.static.get(id(frame.module))
        return (
            static is not None and static.kind == "conv" and getattr(frame.module, "weight", None) is weight
        )

    def _conv_site(self, frame: _Frame, weight: torch.Tensor) -> Site:
        if self._conv_is_static(frame, weight):
            return self.static[id(frame.module)]
        return self.anonymous(frame, "conv")[0]

    def sdpa_call(self, frame: _Frame, func, args: tuple, kwargs: dict):
        scores_site, context_site = self.anonymous(frame, "sdpa")
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
        self.table.clear()
        self.order.clear()
        try:
            with fork_rng(), torch.no_grad():
                model.eval()
                model(*args, **kwargs)
        finally:
            for name, module in model.named_modules():
                module.training = training.get(name, module.training)
            discovery, self.discovery = self.discovery, None
        self._name_entries(discovery)
        self.discovered = True
        self.invalidate()
        found = self.all_sites()
        for callback in list(self.on_discovered):
            callback(found)
        return found

    def discover_call(self, func, args: tuple, kwargs: dict):
        discovery = self.discovery
        assert discovery is not None
        inputs = _pytree.tree_leaves((args, kwargs))
        out = func(*args, **kwargs)
        frame = self.stack[-1] if self.stack else None
        if frame is None:
            return out
        if func in _SOFTMAX_FUNCS:
            for tag in discovery.tags_of(inputs):
                if tag[0] == "gemm" and discovery.entries[tag[1]]["module"] == frame.name:
                    discovery.entries[tag[1]]["role"] = "scores"
            discovery.tag(out, frozenset({("softmax", frame.name)}))
            return out
        gemm = self._discover_gemm(func, args, kwargs, frame, discovery)
        if gemm is None:
            discovery.tag(out, discovery.tags_of(inputs))
            return out
        discovery.tag(out, frozenset({("gemm", gemm)}))
        return out

    def _discover_gemm(self, func, args, kwargs, frame: _Frame, discovery: _Discovery) -> int | None:
        parsed = _parse(func, args, kwargs) if func in _GEMM_FUNCS else None
        if parsed is None:
            return None
        layout, a, b, _ = parsed
        if layout == "conv":
            b = args[1] if len(args) > 1 else kwargs.get("weight")
        if layout in ("sdpa", "conv") and not (layout == "conv" and self._conv_is_static(frame, b)):
            discovery.entries.append({"module": frame.name, "index": frame.calls, "role": layout})
            self.order.append(f"@{len(discovery.entries) - 1}")
            frame.calls += 1
            return None
        static = self.static.get(id(frame.module))
        allowed = (
            ("linear", "mm", "conv") if static is not None and static.kind == "conv" else ("linear", "mm")
        )
        if static is None or layout not in allowed or getattr(frame.module, "weight", None) is not b:
            static = self._module_site(frame, layout, b) or (
                self._projection(frame, layout, b)
                or self._own_weight(frame, layout, b)
                or (self._expert(frame, b) if layout in ("linear", "mm") else None)
            )
        if static is not None:
            if static.name not in self.order:
                self.order.append(static.name)
            return None
        context = ("softmax", frame.name) in discovery.tags_of([a])
        discovery.entries.append(
            {"module": frame.name, "index": frame.calls, "role": "context" if context else None}
        )
        self.order.append(f"@{len(discovery.entries) - 1}")
        frame.calls += 1
        return len(discovery.entries) - 1

    def _name_entries(self, discovery: _Discovery) -> None:
        per_module: dict[str, list[dict[str, Any]]] = {}
        for entry in discovery.entries:
            per_module.setdefault(entry["module"], []).append(entry)
        names: dict[int, tuple[Site, ...]] = {}
        for module, entries in per_module.items():
            prefix = f"{module}." if module else ""
            counts = {"scores": 0, "context": 0}
            for entry in entries:
                if entry["role"] == "sdpa":
                    counts["scores"] += 1
                    counts["context"] += 1
                elif entry["role"] in counts:
                    counts[entry["role"]] += 1
            seen = {"scores": 0, "context": 0}
            anonymous = convolutions = 0

            def role_name(role: str, prefix: str = prefix, counts: dict = counts, seen: dict = seen) -> str:
                suffix = str(seen[role]) if counts[role] > 1 else ""
                seen[role] += 1
                return f"{prefix}{role}{suffix}"

            for entry in entries:
                key = (module, entry["index"])
                if entry["role"] == "sdpa":
                    site = (
                        Site(role_name("scores"), module, "sdpa"),
                        Site(role_name("context"), module, "sdpa"),
                    )
                elif entry["role"] == "conv":
                    site = (Site(f"{prefix}conv{convolutions}", module, "conv"),)
                    convolutions += 1
                elif entry["role"] in counts:
                    site = (Site(role_name(entry["role"]), module, "matmul"),)
                else:
                    site = (Site(f"{prefix}matmul{anonymous}", module, "matmul"),)
                    anonymous += 1
                self.table[key] = site
                names[id(entry)] = site
        order: list[str] = []
        for item in self.order:
            if item.startswith("@"):
                order.extend(s.name for s in names[id(discovery.entries[int(item[1:])])])
            elif item not in order:
                order.append(item)
        self.order = order
