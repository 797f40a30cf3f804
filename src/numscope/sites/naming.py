"""Site names: which GEMM of a model is which site, named for the module it belongs to.

A Linear, transformers' Conv1D or a convolution is its module's site wherever its weight is multiplied
(also transposed, by a parent module, or parametrized); a ``MultiheadAttention`` projection, an expert of
a stacked-expert module and a recurrent layer's ``ih``/``hh`` GEMMs get names of their own; any other
GEMM is named by the discovery pass, which runs the model once and follows the dataflow: the product
feeding a softmax is ``scores``, the one fed by it ``context``, the rest ``matmulN`` and ``convN`` in the
order of calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

from numscope.sites.calls import _GEMM_FUNCS, _SOFTMAX_FUNCS, _parse
from numscope.sites.gemm import Site


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


class SiteNames:
    """The site table of one model: the modules' own sites, the named ones and those the discovery pass
    found, with the order the model runs them in."""

    def __init__(self, model: nn.Module) -> None:
        self.static: dict[int, Site] = {}
        self.named: dict[str, Site] = {}  # sites named for what they compute (MultiheadAttention projections)
        self.table: dict[tuple[str, int], tuple[Site, ...]] = {}
        self.order: list[str] = []
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

    def kind_of(self, module: nn.Module) -> str | None:
        """``linear``, ``conv`` or ``conv1d`` for a module with a site of its own, else None."""
        static = self.static.get(id(module))
        return None if static is None else static.kind

    def clear_found(self) -> None:
        """Forget what a discovery pass found, before another."""
        self.table.clear()
        self.order.clear()

    def ran(self, name: str) -> None:
        """A named site ran while finding sites: it takes its place in the order of calls."""
        if name not in self.order:
            self.order.append(name)

    def named_site(self, name: str, module: str, kind: str = "linear") -> Site:
        """The site named ``name`` of the module ``module`` (one object per name)."""
        return self.named.setdefault(name, Site(name, module, kind))

    def all_sites(self, discovered: bool) -> list[Site]:
        """The sites in the order the model ran them; before a forward has found them (``discovered``
        False), also every Linear/Conv1D/convolution module, as a guess."""
        found: dict[str, Site] = {}
        for entry in self.table.values():
            for site in entry:
                found[site.name] = site
        static = {site.name: site for site in self.static.values()} | self.named
        names = [n for n in self.order if n in found or n in static]
        if not discovered:  # before a forward: every Linear/Conv1D/convolution module, as a guess
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

    def site_for(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site:
        named = self.named_by_weight(frame, layout, weight)
        return named if named is not None else self.anonymous(frame, "matmul")[0]

    def named_by_weight(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
        """The named site a GEMM by ``weight`` belongs to (its module's, an attention projection's, a
        module's own weight, one expert's), or ``None``: an anonymous GEMM, named by its call order."""
        return (
            self.module_site(frame, layout, weight)
            or self.projection(frame, layout, weight)
            or self.own_weight(frame, layout, weight)
            or (self.expert(frame, weight) if layout in ("linear", "mm") else None)
        )

    def module_site(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
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

    def projection(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
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
        return self.named_site(qualified, frame.name)

    def expert(self, frame: _Frame, weight: torch.Tensor, index: int | None = None) -> Site | None:
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
            return self.named_site(name, frame.name)
        return None

    def own_weight(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
        """A module's own ``weight`` in ``F.linear`` (a router, a custom projection): the module's site."""
        if layout != "linear" or getattr(frame.module, "weight", None) is not weight or not frame.name:
            return None
        return self.named_site(frame.name, frame.name)

    def conv_is_static(self, frame: _Frame, weight: torch.Tensor) -> bool:
        """Whether a convolution is its module's own (a Conv/ConvTranspose layer with this weight)."""
        static = self.static.get(id(frame.module))
        return (
            static is not None and static.kind == "conv" and getattr(frame.module, "weight", None) is weight
        )

    def conv_site(self, frame: _Frame, weight: torch.Tensor) -> Site:
        if self.conv_is_static(frame, weight):
            return self.static[id(frame.module)]
        return self.anonymous(frame, "conv")[0]

    def discovered_call(self, func, args: tuple, kwargs: dict, frame: _Frame | None, discovery: _Discovery):
        """Run ``func`` as the discovery pass does: computed plainly, its GEMM (if it is one) entered in the
        order of calls and its output tagged with the dataflow that names attention's two products."""
        inputs = _pytree.tree_leaves((args, kwargs))
        out = func(*args, **kwargs)
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
        if layout in ("sdpa", "conv") and not (layout == "conv" and self.conv_is_static(frame, b)):
            discovery.entries.append({"module": frame.name, "index": frame.calls, "role": layout})
            self.order.append(f"@{len(discovery.entries) - 1}")
            frame.calls += 1
            return None
        static = self.static.get(id(frame.module))
        allowed = (
            ("linear", "mm", "conv") if static is not None and static.kind == "conv" else ("linear", "mm")
        )
        if static is None or layout not in allowed or getattr(frame.module, "weight", None) is not b:
            static = self.named_by_weight(frame, layout, b)
        if static is not None:
            self.ran(static.name)
            return None
        context = ("softmax", frame.name) in discovery.tags_of([a])
        discovery.entries.append(
            {"module": frame.name, "index": frame.calls, "role": "context" if context else None}
        )
        self.order.append(f"@{len(discovery.entries) - 1}")
        frame.calls += 1
        return len(discovery.entries) - 1

    def name_entries(self, discovery: _Discovery) -> None:
        """Name the anonymous GEMMs the discovery pass entered (``scores``/``context``, ``matmulN``,
        ``convN``) and put every site in the order of calls."""
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
