"""Apply a :class:`numscope.Plan` to a model: every site operand quantized as the plan says, in place.

``convert(model, plan)`` attaches one quantizing handler (:mod:`numscope.sites`): for each (site, gemm,
operand) whose :class:`OperandSpec` is not ``high`` the operand becomes ``numscope.quantize(tensor,
format, scaling=..., rounding=..., overflow=..., flush_subnormals=...)``; block formats get
``Scaling("block", axis=<the GEMM's contraction axis>)``; delayed scaling keeps one
:class:`numscope.DelayedScaler` per (site, gemm, operand), exported with the stochastic-rounding generator
state by :func:`numerics_state_dict`. Products accumulate as the site spec's ``accumulate`` says.

A weight quantized for fprop is reused for dgrad when both use the same spec, the spec's result does not
depend on the axis (no scaling or per-tensor current scaling) and the rounding is deterministic, and the
parameter has not changed since (same object, same version); likewise a grad_output quantized for dgrad
is reused for wgrad of the same backward, and an input quantized for fprop is kept for wgrad (instead of
the raw input) under the same conditions. Each reuse is bit-identical to quantizing again. Element casts
with nearest rounding go through torch's native fp16/bf16/fp8 conversion, which equals
``numscope.quantize`` bit for bit (checked in the tests); with the ``torch.compile`` fast path on (by
default for plans with block formats, ``convert(..., compiled=...)`` to choose, or ``NUMSCOPE_FAST``) they
go through ``numscope.quantize`` and its fused kernels instead, the same bits. Which path computes an
operand is :func:`numscope.formats.path.quantizer_paths`'s decision, as for ``quantize`` and the metrics.

``unconvert(model)`` detaches it; parameters and ``state_dict`` are never touched.
"""

from __future__ import annotations

import math
import os
import re
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from numscope._callable import make_callable as _make_callable
from numscope.formats import native
from numscope.formats.blocks import tile_shape
from numscope.formats.fast import reduced_tensor_amax
from numscope.formats.path import (
    QuantizerPath,
    compiled_wanted,
    host_path,
    native_covers,
    packs_block_codes,
    quantizer_paths,
)
from numscope.formats.quantize import Encoded, as_float32, encode, quantize, tile_quantize
from numscope.formats.scaling import DelayedScaler, Scaling, element_scale
from numscope.formats.spec import BlockFormat, FloatFormat, IntFormat
from numscope.formats.transform import Rotation
from numscope.plan import OperandSpec, Plan, PlanError, SiteSpec
from numscope.sites import (
    Handle,
    Site,
    attach,
    is_discovered,
    on_discovered,
    operand_sizes,
    refresh,
    register_factors,
    sites,
)
from numscope.vocab import Gemm, Operand

HANDLER_NAME = "numscope.convert"
_HANDLES: dict[int, tuple[Any, Handle, _Quantizer]] = {}


class QuantizedOperand(NamedTuple):
    """One operand's cast: its float32 values and, where the cast wrote them as codes in a torch dtype (the
    fp8/fp16/bf16 element casts), those codes and the descale they decode with: ``codes.float() · descale``
    (``codes.float()`` with no descale) equals ``values`` bit for bit."""

    values: torch.Tensor
    codes: torch.Tensor | None = None
    descale: torch.Tensor | None = None


def cast_operand(
    spec: OperandSpec,
    tensor: torch.Tensor,
    axis: int,
    *,
    delayed: DelayedScaler | None = None,
    generator: torch.Generator | None = None,
    compiled: bool | None = None,
    factors: bool = False,
    signs: torch.Tensor | None = None,
) -> QuantizedOperand:
    """``tensor`` (an operand in its GEMM's layout, contracted along ``axis``) cast as ``spec`` says, with
    no state of its own: what the cast needs that outlives one call comes in as arguments.

    delayed: the operand's :class:`DelayedScaler` (required for delayed scaling; it records this amax).
    generator: the random source of stochastic rounding (None: torch's default generator).
    compiled: the ``torch.compile`` kernels for what the native quantizers do not cover (as :func:`convert`).
    factors: the operand enters a GEMM that applies the scales at each promotion (``fp22_promote128``):
        tile-scaled values are registered with their codes and scales
        (:func:`numscope.sites.register_factors`).
    signs: a fresh Hadamard transform's signs for this GEMM call (required for a fresh transform).
    An operand with a transform is quantized rotated along ``axis`` and rotated back (no codes then).
    """
    rotation = spec.rotation()
    if rotation is None:
        return _cast(spec, tensor, axis, delayed, generator, compiled, factors)
    if rotation.fresh and signs is None:
        raise ValueError(f"a fresh transform ({spec.transform}) needs this call's signs")
    return QuantizedOperand(
        rotation.quantized(
            tensor,
            axis,
            lambda rotated, last: _cast(spec, rotated, last, delayed, generator, compiled, factors).values,
            signs if rotation.fresh else None,
        )
    )


def _cast(
    spec: OperandSpec,
    tensor: torch.Tensor,
    axis: int,
    delayed: DelayedScaler | None,
    generator: torch.Generator | None,
    compiled: bool | None,
    factors: bool,
) -> QuantizedOperand:
    """:func:`cast_operand` without a transform."""
    fmt = spec.format_spec()
    scaling = spec.effective_scaling()
    if scaling is not None and scaling.kind == "delayed" and delayed is None:
        raise ValueError("delayed scaling needs the operand's DelayedScaler (delayed=)")
    cast = spec.cast()
    xf = as_float32(tensor.detach(), fmt)  # as quantize() takes it (float64: rounded to odd)
    paths = quantizer_paths(cast, xf, compiled=compiled, codes=True)
    if QuantizerPath.DTYPE in paths and tensor.numel() > 0:  # codes in a torch dtype
        assert isinstance(fmt, FloatFormat)
        dtype = cast.torch_dtype()
        assert dtype is not None
        # fp8: the native quantizers write the codes (torch's fp8 conversion is scalar code; its
        # fp16/bf16 conversions are single vector instructions, faster than any rounding arithmetic)
        by_library = paths[0] is QuantizerPath.NATIVE
        amax = None
        if scaling is not None or (spec.overflow == "saturate" and not by_library):
            amax = native.abs_amax(xf.reshape(1, -1), "tensor") if by_library else _amax(xf)
        scale = None
        if scaling is not None:
            scale = element_scale(
                xf, fmt, scaling, delayed if scaling.kind == "delayed" else None, local_amax=amax
            )
        done = native.element_codes(xf, fmt, spec.overflow, dtype, scale) if by_library else None
        if done is None:
            done = _fake_cast(xf, dtype, fmt, scale, amax, spec.overflow)
        values, codes = done
        return QuantizedOperand(values, codes, None if scale is None else 1.0 / scale)
    tiles = scaling is not None and scaling.kind == "block" and not isinstance(fmt, BlockFormat)
    if tiles and factors and tensor.numel() > 0:
        assert isinstance(fmt, FloatFormat | IntFormat) and scaling is not None
        values, codes, decode = tile_quantize(
            xf,
            fmt,
            scaling,
            spec.rounding,
            spec.overflow,
            spec.flush_subnormals,
            generator,
            factors=True,
        )
        values = values.clone()  # a tensor of its own, which views of it lead back to
        register_factors(values, codes, decode, tile_shape(xf, fmt, scaling))  # type: ignore[arg-type]
        return QuantizedOperand(values)
    scaling_arg: Scaling | DelayedScaler | None
    if isinstance(fmt, BlockFormat):
        reduce = scaling is None or scaling.reduce_amax
        scaling_arg = Scaling("block", axis=axis, reduce_amax=reduce)
    elif scaling is not None and scaling.kind == "delayed":
        scaling_arg = delayed
    else:
        scaling_arg = scaling
    return QuantizedOperand(
        quantize(
            xf,
            fmt,  # type: ignore[arg-type]
            scaling=scaling_arg,
            rounding=spec.rounding,
            overflow=spec.overflow,
            flush_subnormals=spec.flush_subnormals,
            generator=generator,
            compiled=QuantizerPath.COMPILED in paths,
        )
    )


class _FreshSigns:
    """Fresh Hadamard signs per GEMM call: drawn by the call's first operand, taken by its other one, so
    that both rotate alike and the product is kept."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[torch.Tensor, set[str]]] = {}

    def take(
        self, key: str, rotation: Rotation, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor:
        """The signs for operand ``key`` (``site/gemm/operand``) on ``device``: its partner's pending draw,
        else a new one (from ``generator``, else the device's default generator) left pending for the
        partner."""
        pair, operand = key.rsplit("/", 1)
        pending = self._pending.get(pair)
        if pending is not None and operand not in pending[1] and len(pending[0]) == rotation.size:
            self._pending.pop(pair)
            return pending[0]
        signs = rotation.draw_signs(generator, device)
        self._pending[pair] = (signs, {operand})
        return signs


class _Fingerprint(NamedTuple):
    """What tells one forward operand from another: its shape and the bits of its amax (int32, on the
    operand's device; None for an empty tensor)."""

    shape: tuple[int, ...]
    amax: torch.Tensor | None

    def matches(self, other: _Fingerprint) -> bool:
        """The same shape and amax bits (the amax read back: only a recomputation asks)."""
        if self.shape != other.shape or (self.amax is None) != (other.amax is None):
            return False
        return self.amax is None or torch.equal(self.amax, other.amax.to(self.amax.device))  # type: ignore[union-attr]


class _Record:
    """One stateful forward quantization kept for activation checkpointing's recomputation."""

    __slots__ = ("fingerprint", "scale", "state", "used")

    def __init__(self, fingerprint: _Fingerprint, state: torch.Tensor | None) -> None:
        self.fingerprint = fingerprint
        self.state = state
        self.scale: torch.Tensor | None = None
        self.used = False


class _Replay:
    """Activation checkpointing's replay of the forward's stateful quantizations (delayed scaling, stochastic
    rounding): the forward records each one's scale and generator state under the operand's key and its
    fingerprint (shape and amax); a recomputation in backward takes the latest unused record with that
    fingerprint (backward recomputes the last checkpointed part first), then the following ones in order."""

    def __init__(self) -> None:
        self.recomputing = False
        self._records: dict[str, list[_Record]] = {}
        self._cursor: dict[str, int] = {}

    def begin(self, recompute: bool, grad_enabled: bool) -> None:
        """A forward starts: a forward with gradients forgets the previous one's records."""
        self.recomputing = recompute
        self._cursor = {}
        if not recompute and grad_enabled:
            self._records.clear()

    def clear(self) -> None:
        self._records.clear()
        self._cursor = {}

    def record(self, key: str, fingerprint: _Fingerprint, state: torch.Tensor | None) -> _Record:
        record = _Record(fingerprint, state)
        self._records.setdefault(key, []).append(record)
        return record

    def take(self, key: str, fingerprint: _Fingerprint) -> _Record:
        records = self._records.get(key, [])
        following = self._cursor.get(key)
        index = None
        if following is not None and following + 1 < len(records):
            candidate = records[following + 1]
            if not candidate.used and candidate.fingerprint.matches(fingerprint):
                index = following + 1
        if index is None:
            unused = [i for i, record in enumerate(records) if not record.used]
            index = next((i for i in reversed(unused) if records[i].fingerprint.matches(fingerprint)), None)
        if index is None:
            raise RuntimeError(
                f"activation checkpointing recomputes operand {key!r} (delayed scaling or stochastic "
                "rounding), but the forward did not quantize this tensor since the last forward with "
                "gradients: numscope replays the forward's scale and random bits from that forward only; "
                "run each backward before the next training forward, or use current scaling and nearest "
                "rounding in forward"
            )
        records[index].used = True
        self._cursor[key] = index
        return records[index]


class _ReplayScaler(DelayedScaler):
    """A delayed scaler standing in for ``real``: with ``fixed`` None it asks ``real`` (which records the
    amax) and keeps the scale it gave in ``used``; else it gives ``fixed`` and records nothing."""

    def __init__(self, real: DelayedScaler, fixed: torch.Tensor | None) -> None:  # no state of its own
        self.scaling = real.scaling
        self.real = real
        self.fixed = fixed
        self.used: torch.Tensor | None = None

    def scale_for(self, x: torch.Tensor, fmt_max: float, amax: torch.Tensor | None = None) -> torch.Tensor:
        if self.fixed is not None:
            return self.fixed
        self.used = self.real.scale_for(x, fmt_max, amax)
        return self.used


class _Kept:
    """What one quantization leaves for a later GEMM, each reuse bit-identical to quantizing again (see the
    module docstring): a weight quantized in fprop for dgrad, a gradient quantized in dgrad for wgrad (or
    both of an MX gradient's copies made in one pass), the codes of quantized fprop inputs for the site to
    keep instead, and wgrad inputs quantized in forward. A kept tensor is taken only by the same object at
    the same shape, strides and version (:func:`_identity`)."""

    def __init__(self) -> None:
        self.weights: dict[str, tuple[weakref.ref, tuple, torch.Tensor]] = {}
        self.grad: tuple[torch.Tensor, tuple, torch.Tensor] | None = None
        self.announced: tuple[torch.Tensor, tuple] | None = None
        self.grad_columns: tuple[torch.Tensor, tuple, torch.Tensor] | None = None
        self.codes: dict[int, tuple[weakref.ref, torch.Tensor, torch.Tensor | None]] = {}
        self.prequantized: dict[tuple, tuple[weakref.ref, Any]] = {}

    def clear(self) -> None:
        """Forget everything (a new plan)."""
        self.weights.clear()
        self.grad = self.announced = self.grad_columns = None
        self.prequantized.clear()

    def take_announced(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the gradient last announced for both dgrad and wgrad (once)."""
        announced, self.announced = self.announced, None
        return announced is not None and announced[0] is tensor and announced[1] == _identity(tensor)

    def take_columns(self, tensor: torch.Tensor, axis: int) -> torch.Tensor | None:
        """wgrad's copy of ``tensor`` (contracted along axis 0) made with dgrad's; forgotten either way."""
        cached, self.grad_columns = self.grad_columns, None
        if axis == 0 and cached is not None and cached[0] is tensor and cached[1] == _identity(tensor):
            return cached[2]
        return None

    def weight(self, site: str, tensor: torch.Tensor) -> torch.Tensor | None:
        cached = self.weights.get(site)
        if cached is not None and cached[0]() is tensor and cached[1] == _identity(tensor):
            return cached[2]
        return None

    def take_grad(self, tensor: torch.Tensor) -> torch.Tensor | None:
        cached = self.grad
        if cached is not None and cached[0] is tensor and cached[1] == _identity(tensor):
            self.grad = None
            return cached[2]
        return None

    def keep_codes(self, values: torch.Tensor, codes: torch.Tensor, descale: torch.Tensor | None) -> None:
        """Keep the codes of ``values`` for the site to store instead of them (taken by :meth:`codes_of`)."""
        key = id(values)
        forget = weakref.ref(values, lambda _, key=key: self.codes.pop(key, None))
        self.codes[key] = (forget, codes, descale)

    def codes_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        found = self.codes.pop(id(tensor), None)
        if found is None or found[0]() is not tensor:
            return None
        return found[1], found[2]


class _Quantizer:
    """The operand handler of :func:`convert`: the plan's spec per operand, the delayed scalers (part of the
    numerics state), and the small stateful parts around :func:`cast_operand` (what is kept for reuse, the
    checkpoint replay, fresh transform signs)."""

    def __init__(
        self,
        plan: Plan,
        generator: torch.Generator | None,
        compiled: bool | None = None,
        low_memory: bool = False,
    ) -> None:
        self.plan = plan
        self.generator = generator
        self.compiled = compiled
        self.low_memory = low_memory
        self.scalers: dict[str, DelayedScaler] = {}
        self._specs: dict[str, SiteSpec] = {}
        self._kept = _Kept()
        self._replay = _Replay()
        self._signs = _FreshSigns()

    def switch(self, plan: Plan) -> None:
        """Run under ``plan`` from now on, dropping what the previous plan kept (:func:`switch_plan`)."""
        self.plan = plan
        self._specs.clear()
        self._kept.clear()
        self._replay.clear()

    def forward_begins(self, recompute: bool, grad_enabled: bool) -> None:
        """``numscope.sites`` says a forward starts: a forward of the model, or (``recompute``) activation
        checkpointing's recomputation of a part of it in backward. A forward with gradients forgets the
        records of the previous one; a recomputation replays them (:meth:`_quantize_operand`)."""
        self._replay.begin(recompute, grad_enabled)

    def prequantizes_wgrad_input(self, site: Site) -> bool:
        """Whether wgrad's input is quantized in forward and kept for backward in a compact form: block
        formats rounded to nearest, whose quantization of the input along the token axis depends on nothing
        that changes between forward and backward (as Transformer Engine keeps a column-wise copy). MX
        with the native quantizers on: in its codes, natively; with ``low_memory`` (MX and NVFP4) in its
        codes, encoded eagerly; through the compiled quantizers (MX only) as float32 values."""
        spec = self.spec(site).operand(Gemm.WGRAD, Operand.INPUT)
        fmt = spec.format_spec()
        if not (isinstance(fmt, BlockFormat) and spec.rounding == "nearest" and spec.transform is None):
            return False
        # MX and NVFP4 with float elements: their codes, natively
        native_codes = packs_block_codes(spec.cast())
        return self.low_memory or native_codes or (compiled_wanted(self.compiled) and not fmt.tensor_scale)

    def pack_wgrad_input(self, site: Site, tensor: torch.Tensor):
        """wgrad's input (tokens, features) quantized along the token axis now, decoded in backward to
        exactly what quantizing it there gives: MX with float elements, by the native quantizers, as its
        element codes and E8M0 scale codes (1 + 1/32 bytes per element); else with ``low_memory`` its
        element codes (one byte each) and block scales, encoded eagerly; else, compiled, its float32 values
        (the memory of the input they replace; bfloat16 would hold most MX values, but telling which would
        read back to the host: a synchronisation per GEMM on a GPU)."""
        spec = self.spec(site).operand(Gemm.WGRAD, Operand.INPUT)
        # one input entering several sites (Q, K and V's projections) is packed once for all of them
        base = tensor if tensor._base is None else tensor._base
        key = (id(base), base._version, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), spec)
        prequantized = self._kept.prequantized
        found = prequantized.get(key)
        if found is not None and found[0]() is base:
            return found[1]
        packed = self._pack_wgrad_input(spec, tensor)
        forget = weakref.ref(base, lambda _, key=key: prequantized.pop(key, None))
        prequantized[key] = (forget, packed)
        return packed

    def _pack_wgrad_input(self, spec: OperandSpec, tensor: torch.Tensor):
        scaling = spec.effective_scaling()
        reduce = scaling is None or scaling.reduce_amax
        along_tokens = Scaling("block", axis=0, reduce_amax=reduce)
        fmt = spec.format_spec()
        if tensor.dim() == 2 and packs_block_codes(spec.cast()):
            # element and scale codes, 1 + 1/32 (MX) or 1 + 1/16 (NVFP4) bytes per element
            x = tensor.detach().float()
            tensor_amax = reduced_tensor_amax(x, fmt, reduce)  # type: ignore[arg-type]
            packed = native.block_pack_columns(x, fmt, tensor_amax)  # type: ignore[arg-type]
            if packed is not None:
                return packed
        if not self.low_memory and not compiled_wanted(self.compiled):
            return None  # the site keeps the input and quantizes it in backward
        if not self.low_memory:
            values = quantize(tensor.float(), spec.format_spec(), scaling=along_tokens, compiled=True)  # type: ignore[arg-type]
            return (values,), _unpack  # float32, as the input it replaces
        if not bool(torch.isfinite(tensor).all()):  # integer elements have no NaN code: quantize later
            return None
        encoded = encode(tensor.float(), spec.format_spec(), scaling=along_tokens)  # type: ignore[arg-type]
        layout = (encoded.fmt, encoded.shape, encoded.axis, encoded.length)
        tensors = (encoded.codes, encoded.scales)
        if encoded.tensor_scale is not None:
            tensors += (encoded.tensor_scale,)

        def unpack(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None = None):
            fmt, shape, axis, length = layout
            return Encoded(fmt, codes, scales, tensor_scale, shape, axis, length).decode()

        return tensors, unpack

    def pack(self, site: Site, tensor: torch.Tensor):
        """The codes of a quantized fprop input (or activation weight) this quantizer produced
        (``numscope.sites.gemm._Call.pack`` asks): kept in the format's own torch dtype (1 or 2 bytes) with
        its descale, unpacked bit for bit."""
        found = self._kept.codes_of(tensor)
        if found is None:
            return None
        codes, descale = found
        if descale is None:
            return (codes,), _unpack
        return (codes, descale), _unpack

    def spec(self, site: Site) -> SiteSpec:
        found = self._specs.get(site.name)
        if found is None:
            if self.plan.rule_for(site.name) is None:
                _refuse_unplanned_step(self.plan, site.name)
            found = self._specs[site.name] = self.plan.for_site(site.name)
        return found

    def wants(self, site: Site) -> bool:
        spec = self.spec(site)
        return not spec.is_high or spec.accumulate != "fp32"

    def accumulate(self, site: Site) -> str:
        return self.spec(site).accumulate

    def shares_input(self, site: Site) -> bool:
        """Whether wgrad's input is fprop's, quantized the same whatever the axis (then it is kept)."""
        spec = self.spec(site)
        fprop = spec.operand(Gemm.FPROP, Operand.INPUT)
        return fprop == spec.operand(Gemm.WGRAD, Operand.INPUT) and (
            fprop.is_high or _axis_independent(fprop)
        )

    def shares_weight(self, site: Site) -> bool:
        """Whether dgrad's weight is fprop's, quantized the same whatever the axis: a weight that is an
        activation (the right operand of a product of activations) is then kept in its codes for dgrad."""
        spec = self.spec(site)
        fprop = spec.operand(Gemm.FPROP, Operand.WEIGHT)
        return (
            fprop == spec.operand(Gemm.DGRAD, Operand.WEIGHT)
            and not fprop.is_high
            and _axis_independent(fprop)
        )

    def scaler(self, key: str, scaling: Scaling, device: torch.device | None = None) -> DelayedScaler:
        """The delayed scaler of operand ``key``, made on ``device`` (the operand's) on first use."""
        scaler = self.scalers.get(key)
        if scaler is None:
            scaler = self.scalers[key] = DelayedScaler(scaling, device=device)
        return scaler

    def announce_gradient(self, site: Site, tensor: torch.Tensor) -> None:
        """``numscope.sites.gemm`` says that dgrad (blocks along the rows) and then wgrad (down the columns)
        will take this 2-D gradient: where both want the same MX format, dgrad's call makes both copies in
        one pass over it (:func:`numscope.formats.native.block_both`) and wgrad's takes the second."""
        both = self._both_directions(site, tensor)
        self._kept.announced = (tensor, _identity(tensor)) if both else None

    def _both_directions(self, site: Site, tensor: torch.Tensor) -> bool:
        spec = self.spec(site)
        dgrad = spec.operand(Gemm.DGRAD, Operand.GRAD_OUTPUT)
        if dgrad != spec.operand(Gemm.WGRAD, Operand.GRAD_OUTPUT) or dgrad.is_high or tensor.dim() != 2:
            return False
        fmt = dgrad.format_spec()
        return (
            isinstance(fmt, BlockFormat)
            and not fmt.tensor_scale
            and dgrad.rotation() is None
            and dgrad.rounding == "nearest"
            and not dgrad.flush_subnormals
            and tensor.shape[1] % fmt.block_size == 0
            and native_covers(dgrad.cast(), tensor.detach())  # a float32 CPU tensor, the native code on
        )

    def __call__(self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        spec = self.spec(site)
        operand_spec = spec.operand(gemm, operand)
        if operand_spec.is_high:
            return tensor
        kept = self._kept
        if operand == Operand.GRAD_OUTPUT:
            fresh = kept.take_announced(tensor)
            if gemm == Gemm.DGRAD and fresh and axis in (-1, 1):
                fmt = operand_spec.format_spec()
                assert isinstance(fmt, BlockFormat)
                both = native.block_both(tensor.detach(), fmt)
                if both is not None:
                    kept.grad_columns = (tensor, _identity(tensor), both[1])
                    return both[0]
            if gemm == Gemm.WGRAD:
                columns = kept.take_columns(tensor, axis)
                if columns is not None:
                    return columns
        reusable = (
            operand == Operand.WEIGHT
            and isinstance(tensor, nn.Parameter)
            and _axis_independent(operand_spec)
            and spec.operand(Gemm.FPROP, Operand.WEIGHT) == spec.operand(Gemm.DGRAD, Operand.WEIGHT)
        )
        if reusable and gemm == Gemm.DGRAD:
            weight = kept.weight(site.name, tensor)
            if weight is not None:
                return weight
        shared_grad = (
            operand == Operand.GRAD_OUTPUT
            and _axis_independent(operand_spec)
            and spec.operand(Gemm.DGRAD, Operand.GRAD_OUTPUT) == spec.operand(Gemm.WGRAD, Operand.GRAD_OUTPUT)
        )
        if shared_grad and gemm == Gemm.WGRAD:
            grad = kept.take_grad(tensor)
            if grad is not None:
                return grad
        # a GEMM that applies the scales at each promotion takes the codes and scales (register_factors)
        factors = spec.accumulate_for(gemm) == "fp22_promote128"
        result = self._quantize_operand(site.key(gemm, operand), gemm, operand_spec, tensor, axis, factors)
        kept_for_backward = gemm == Gemm.FPROP and (
            (operand == Operand.INPUT and self.shares_input(site))
            or (
                operand == Operand.WEIGHT
                and not isinstance(tensor, nn.Parameter)
                and self.shares_weight(site)
            )
        )
        if kept_for_backward and result.codes is not None:  # the site keeps these codes instead
            kept.keep_codes(result.values, result.codes, result.descale)
        if reusable and gemm == Gemm.FPROP:
            kept.weights[site.name] = (weakref.ref(tensor), _identity(tensor), result.values)
        if shared_grad and gemm == Gemm.DGRAD:
            kept.grad = (tensor, _identity(tensor), result.values)
        return result.values

    def _quantize_operand(
        self, key: str, gemm: str, spec: OperandSpec, tensor: torch.Tensor, axis: int, factors: bool
    ) -> QuantizedOperand:
        """:meth:`_cast` of one operand, exactly as the forward did it when activation checkpointing
        recomputes the forward in backward (:class:`_Replay`).

        Only a forward operand with state needs it: delayed scaling (the amax history has moved on since)
        and stochastic rounding with the quantizer's own generator (the global generator is restored by the
        checkpoint itself, which keeps its state by default). A recomputation leaves the history and the
        generator as they were.
        """
        rotation = spec.rotation()
        fresh = rotation is not None and rotation.fresh
        # a fresh transform's signs come from the generator too: replayed with it
        stochastic = (spec.rounding == "stochastic" or fresh) and self.generator is not None
        scaling = spec.effective_scaling()
        delayed = scaling is not None and scaling.kind == "delayed"
        scaler = self.scaler(key, scaling, tensor.device) if delayed else None  # type: ignore[arg-type]
        if gemm != Gemm.FPROP or not (stochastic or scaler is not None):
            return self._cast(key, spec, tensor, axis, scaler, factors)
        # the amax's bits stay on the tensor's device: compared only when a recomputation looks it up
        amax = _amax(tensor.detach().float()).view(torch.int32) if tensor.numel() else None
        fingerprint = _Fingerprint(tuple(tensor.shape), amax)
        generator = self.generator if stochastic else None
        if not self._replay.recomputing:
            state = generator.get_state() if generator is not None else None
            record = self._replay.record(key, fingerprint, state)
            stand_in = _ReplayScaler(scaler, None) if scaler is not None else None
            result = self._cast(key, spec, tensor, axis, stand_in, factors)
            if stand_in is not None:
                record.scale = stand_in.used
            return result
        record = self._replay.take(key, fingerprint)
        before = None
        if generator is not None and record.state is not None:
            before = generator.get_state()
            generator.set_state(record.state)
        try:
            stand_in = _ReplayScaler(scaler, record.scale) if scaler is not None else None
            return self._cast(key, spec, tensor, axis, stand_in, factors)
        finally:
            if generator is not None and before is not None:
                generator.set_state(before)

    def _cast(
        self,
        key: str,
        spec: OperandSpec,
        tensor: torch.Tensor,
        axis: int,
        delayed: DelayedScaler | None,
        factors: bool,
    ) -> QuantizedOperand:
        rotation = spec.rotation()
        signs = None
        if rotation is not None and rotation.fresh:
            signs = self._signs.take(key, rotation, self.generator, tensor.device)
        return cast_operand(
            spec,
            tensor,
            axis,
            delayed=delayed,
            generator=self.generator,
            compiled=self.compiled,
            factors=factors,
            signs=signs,
        )


def _cast_native(values: torch.Tensor, dtype: torch.dtype, fmt: FloatFormat) -> torch.Tensor:
    """The saturating cast's codes in ``dtype`` (±inf kept where the format has inf, else NaN)."""
    clamped = values.clamp(-fmt.max, fmt.max)
    infinite = values if fmt.has_inf else torch.full_like(values, float("nan"))
    return torch.where(values.isinf(), infinite, clamped).to(dtype)


def _unpack(codes: torch.Tensor, descale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values from codes in a torch dtype and a descale: what :func:`_fake_cast` returned (fp8
    codes through the native quantizers' decoder where it is on: the same bits, vectorized)."""
    decoded = native.decode(codes, descale) if codes.element_size() == 1 else None
    if decoded is not None:
        return decoded
    return codes.float() if descale is None else codes.float() * descale


def _amax(values: torch.Tensor) -> torch.Tensor:
    """max |values| in one pass without a temporary (NaN if any value is NaN), as ``abs().amax()``."""
    low, high = torch.aminmax(values)
    return torch.maximum(low.abs(), high.abs())


def _rounds_to_max(fmt: FloatFormat) -> float:
    """The least magnitude that nearest-even rounding takes beyond ``fmt.max``: max + ulp(max) / 2."""
    return fmt.max + 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits - 1)


def _host_floats(*values: torch.Tensor | float | None) -> tuple[float | None, ...]:
    """``values`` as Python floats (None stays None), every 0-d tensor among them read in one transfer.

    One device-to-host read (a synchronisation on an accelerator) instead of one per value; the read is
    exact (``tolist`` of a float32 or float64 tensor).
    """
    tensors = [value.reshape(()) for value in values if isinstance(value, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else ())
    return tuple(next(read) if isinstance(value, torch.Tensor) else value for value in values)


def _fake_cast(
    values: torch.Tensor,
    dtype: torch.dtype,
    fmt: FloatFormat,
    scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    overflow: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cast(values · scale) · (1 / scale)`` through torch's ``dtype`` (see
    :meth:`numscope.formats.path.Cast.torch_dtype`), and the codes in ``dtype`` it was decoded from
    (``codes.float() · (1 / scale)`` gives it bit for bit).

    ``amax`` bounds ``|values|`` (saturation needs it; ``None`` otherwise): where ``amax · scale`` is below
    the format's max plus half its unit in the last place (every scaled value then rounds to at most the
    max: rounding is monotone), the clamp of saturation changes nothing and the scaled copy is cast and
    descaled in place: one fresh float32 buffer instead of one per operation, the same bits. That bound,
    and for E4M3 whether ``2⁸ / scale`` is finite, are read to the host together, once per call, on the
    CPU's path only (:func:`numscope.formats.path.host_path`); the device path always clamps.
    """
    scaled = values if scale is None else values * scale
    descale = None if scale is None else 1.0 / scale
    saturate = overflow == "saturate"
    if not host_path(values):  # the device path: no value read back, the same bits
        codes = _cast_native(scaled, dtype, fmt) if saturate else scaled.to(dtype)
        return (codes.float() if descale is None else codes.float() * descale), codes
    bound = None if amax is None or not saturate else amax if scale is None else amax * scale
    redescale = None  # E4M3 decodes through fp16 as q / 2⁸ (see _e4m3_as_fp16), multiplied by 2⁸ · descale
    if saturate and dtype == torch.float8_e4m3fn:  # no NaN code on this path
        redescale = 256.0 if descale is None else 256.0 * descale  # exact unless it overflows
    bound_value, redescale_value = _host_floats(bound, redescale)
    if saturate and not (
        bound_value is not None and math.isfinite(bound_value) and bound_value < _rounds_to_max(fmt)
    ):
        codes = _cast_native(scaled, dtype, fmt)
        return _unpack(codes, descale), codes
    rounded = scaled.to(dtype)
    if redescale is not None and math.isfinite(redescale_value):  # type: ignore[arg-type]
        halves = _e4m3_as_fp16(rounded)
        decoded = halves.float() if scale is None else scaled.copy_(halves)
        return decoded.mul_(redescale), rounded
    if descale is None:
        return rounded.float(), rounded
    return scaled.copy_(rounded).mul_(descale), rounded


def _e4m3_as_fp16(codes: torch.Tensor) -> torch.Tensor:
    """Finite ``float8_e4m3fn`` values divided by 2⁸, exactly, as float16.

    E4M3's exponent and mantissa fields moved into fp16's (sign to bit 15, the other seven bits to 7–13)
    give fp16 the same exponent field under a bias 8 larger and subnormals on subnormals, so the fp16 value
    is the E4M3 one over 2⁸. The caller multiplies 2⁸ back in with its descale: ``(q / 2⁸) · (2⁸ · d)``
    rounds once to the same float32 as ``q · d`` wherever ``2⁸ · d`` is finite (a power of two times a
    float32 is exact short of overflow). The integer moves and fp16 → float32 are vectorized in torch, its
    E4M3 → float32 conversion is not. The NaN code would decode to 480: only finite codes may come here.
    """
    bits = codes.view(torch.uint8).to(torch.int16)
    sign = (bits & 0x80).mul_(-256)  # 0x80 → 0x8000 as an int16 (-32768), without overflowing a shift
    return bits.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign).view(torch.float16)


_NUMBERED = re.compile(r"^(.*?)(matmul|call)(\d+)$")


def _refuse_unplanned_step(plan: Plan, name: str) -> None:
    """Refuse a numbered GEMM site of a module (``<module>.matmulN``, the Nth unnamed GEMM of its forward;
    ``<module>.callN`` where it first ran after the sites were found) that the plan has no rule for while
    it names that module's GEMMs ``matmul0`` … ``matmulK`` one by one (K ≥ 2): a module that runs a GEMM per
    step of its input (Mamba's scan) has one site per step, so a plan made per site at one input length
    would leave the steps past it at the default without a word."""
    found = _NUMBERED.match(name)
    if found is None:
        return
    module, kind, index = found.group(1), found.group(2), int(found.group(3))
    numbered = re.compile(re.escape(module + "matmul") + r"(\d+)")
    planned = {int(m.group(1)) for rule in plan.rules if (m := numbered.fullmatch(rule.pattern))}
    last = len(planned) - 1
    if last >= 2 and planned == set(range(last + 1)) and (kind == "call" or index > last):
        raise PlanError(
            f"site {name!r} has no rule, while the plan names {module}matmul0 … {module}matmul{last} one by "
            "one: the module runs one GEMM per step of its input (e.g. a scan over the sequence) and the "
            f"plan was made at an input with {last + 1} such GEMMs; make the plan at this input length, or "
            f"give the steps one rule ('{module}*')"
        )


def _axis_independent(spec: OperandSpec) -> bool:
    if (
        spec.rounding == "stochastic"
        or spec.transform is not None
        or isinstance(spec.format_spec(), BlockFormat)
    ):
        return False
    scaling = spec.effective_scaling()
    return scaling is None or scaling.kind == "tensor"


def rows_independent(model: nn.Module, site: str) -> bool:
    """Whether :func:`convert`'s plan on ``model`` computes the fprop of ``site`` row by row: each row of
    its output from that row of its input alone, so that the GEMM on some of the rows gives those rows'
    outputs. True where the model is not converted, or the plan leaves the site's input high, or casts it
    with round to nearest and no transform either element by element (no scale) or in blocks that lie in
    one row (an MX format's blocks along the contraction axis, 1 × N tiles); False where a per-tensor or
    delayed scale, NVFP4's tensor scale, 2-D blocks, a transform or stochastic rounding ties the rows
    together. (Other handlers are the caller's to ask: :func:`numscope.sites.active_handlers`.)"""
    entry = _entry(model)
    if entry is None:
        return True
    spec = entry[2].plan.for_site(site).operands.get((Gemm.FPROP, Operand.INPUT))
    if spec is None or spec.is_high:
        return True
    if spec.rounding != "nearest" or spec.transform is not None:
        return False
    fmt, scaling = spec.format_spec(), spec.effective_scaling()
    if isinstance(fmt, BlockFormat):
        return not fmt.tensor_scale and fmt.block_rows == 1 and (scaling is None or scaling.kind == "block")
    shape = None if scaling is None else scaling.block_shape
    return scaling is None or (
        scaling.kind == "block" and shape is not None and len(shape) == 2 and shape[0] == 1
    )


def _identity(tensor: torch.Tensor) -> tuple:
    """What must not change for a quantized tensor to be reused (callers also check it is the same object).

    Not its address: FSDP2 frees an unsharded parameter's storage after forward and gathers the same values
    into a new one for backward (keeping the version), and a reuse decided by the allocator would differ
    between ranks, and with it the number of amax all-reduces, which every rank must issue alike.
    """
    return (tuple(tensor.shape), tensor.stride(), tensor._version, tensor.dtype)


def _entry(model: nn.Module) -> tuple[Any, Handle, _Quantizer] | None:
    entry = _HANDLES.get(id(model))
    if entry is None or entry[0]() is not model or not entry[1].attached:
        return None
    return entry


def _quantizer(model: nn.Module) -> _Quantizer:
    entry = _entry(model)
    if entry is None:
        raise ValueError("the model is not converted (numscope.convert(model, plan) first)")
    return entry[2]


def convert(
    model: nn.Module,
    plan: Plan | str | os.PathLike[str],
    *,
    example_inputs: Mapping[str, Any] | tuple | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    storage: str | None = None,
    compiled: bool | str = "auto",
    low_memory: bool = False,
) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it (see the module docstring).

    plan: a :class:`~numscope.plan.Plan`, or what ``--plan`` takes (:meth:`Plan.resolve`): a preset
        (``"fp8"``), a named recipe (``"te_current"``; one that keeps layers high by their place, such as
        ``"te_nvfp4"``, needs ``example_inputs`` to find them) or a YAML file.
    example_inputs: used to find the matmul sites now (:func:`numscope.sites`), so that the plan is checked
        against every site before returning; without them the check runs at the first forward, which
        raises :class:`numscope.plan.PlanError` if a rule's pattern matches no site.
    generator: the random source of stochastic rounding (its state is part of :func:`numerics_state_dict`).
    storage: ``"fp16"``/``"bf16"``: the dtype site activations are kept in for backward (None: as they are).
        Only the GEMM inputs the site function saves; :func:`numscope.store_activations` (or
        ``numscope.Recipe(activations=...)``) keeps every activation autograd saves in 16 bits, as the paper.
    compiled: quantize what the native quantizers do not cover through the ``torch.compile`` kernels (the
        same bits, :mod:`numscope.formats.fast`): ``"auto"`` (default) for plans with block formats (MX,
        NVFP4: 2-D tiles and Four Over Six are not native), unless ``NUMSCOPE_FAST`` is set (then it
        decides); ``True`` or ``False`` to choose. The native quantizers (on by default,
        :mod:`numscope.formats.native`) take every operand they cover either way; with them off
        (``NUMSCOPE_NATIVE=0``) and ``compiled=False`` the quantizers are the eager reference.
    low_memory: also keep the input of a block-format wgrad (MX, NVFP4) in its codes, quantized along the
        token axis already in forward (``benchmarks/bench_memory.py`` measures it), at the cost of an eager
        encoding per Linear (the same bits). Without it, an MX plan's compiled quantizers also quantize that
        input in forward and keep it as bfloat16 values (exact; half of float32), at no cost in compute.
        Element formats (fp8, fp16, bf16) keep their quantized inputs in codes always: that is free.
    """
    if isinstance(plan, str | os.PathLike):
        if Plan.needs_sites(plan) and example_inputs is None:
            raise PlanError(
                f"convert(model, {str(plan)!r}): this recipe chooses the layers it keeps high by their place "
                "in the model; pass example_inputs= (one batch) so that its sites are found, or give "
                "Plan.resolve(name, site_names)"
            )
        found = [s.name for s in sites(model, example_inputs)] if example_inputs is not None else None
        plan = Plan.resolve(plan, found)
    if not isinstance(plan, Plan):
        raise TypeError(
            "convert expects a numscope.Plan, a preset or recipe name, or a YAML path; got "
            f"{type(plan).__name__}"
        )
    if compiled == "auto":
        compiled = None if "NUMSCOPE_FAST" in os.environ else plan.uses_block_formats()
    elif not isinstance(compiled, bool):
        raise ValueError(f"compiled must be 'auto', True or False, got {compiled!r}")
    if _entry(model) is not None:
        raise ValueError(
            "the model is already converted; call numscope.unconvert(model) before converting again"
        )
    quantizer = _Quantizer(plan, generator, compiled, low_memory)
    handle = attach(model, quantizer, name=HANDLER_NAME, storage=storage)
    try:
        if example_inputs is not None:
            plan.check_sites(s.name for s in sites(model, example_inputs))
        elif is_discovered(model):
            plan.check_sites(s.name for s in sites(model))
        on_discovered(
            model, lambda found: plan.check_sites(s.name for s in found) if handle.attached else None
        )
    except PlanError:
        handle.remove()
        raise
    _HANDLES[id(model)] = (weakref.ref(model), handle, quantizer)
    return model


def quantize_operand(
    spec: OperandSpec, tensor: torch.Tensor, axis: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``tensor``, an operand in its GEMM's layout contracted along ``axis``, quantized as :func:`convert`
    quantizes an operand of that spec (its scaling, blocks along ``axis``, rounding and transform), as
    float32 values; a spec with delayed scaling takes the current amax (a first step). For measuring what
    one operand's quantization does without converting a model."""
    if spec.is_high:
        return tensor.detach().float()
    scaling = spec.effective_scaling()
    delayed = None
    if scaling is not None and scaling.kind == "delayed":
        delayed = DelayedScaler(scaling, device=tensor.device)
    rotation = spec.rotation()
    signs = rotation.draw_signs(generator, tensor.device) if rotation is not None and rotation.fresh else None
    return cast_operand(spec, tensor, axis, delayed=delayed, generator=generator, signs=signs).values


def unconvert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert` (the model computes exactly as before it); returns the model."""
    entry = _entry(model)
    if entry is None:
        raise ValueError("the model is not converted; nothing to undo")
    entry[1].remove()
    del _HANDLES[id(model)]
    return model


def switch_plan(model: nn.Module, plan: Plan) -> Plan:
    """Run the converted ``model`` under ``plan`` from its next GEMM on; returns the plan it ran before.

    Call it between steps (after the optimizer step, before the next forward): what the previous plan
    kept for reuse (a weight quantized in fprop for dgrad, a gradient quantized in dgrad for wgrad, inputs
    kept in codes for wgrad) is dropped, and an operand whose scaling changes loses its delayed scaler (its
    amax history starts afresh under the new scaling; an operand whose delayed scaling stays keeps it). The
    stochastic-rounding generator goes on as it was. The result is bit for bit what converting a fresh
    model with ``plan`` and the same numerics state gives (tested). Adaptive training
    (:mod:`numscope.train.adaptive`) switches plans this way; :func:`numerics_state_dict` then records the
    new plan.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"switch_plan expects a numscope.Plan, got {type(plan).__name__}")
    quantizer = _quantizer(model)
    if is_discovered(model):
        plan.check_sites(s.name for s in sites(model))
    before = quantizer.plan
    for key in list(quantizer.scalers):
        site_name, gemm, operand = key.rsplit("/", 2)
        old = before.for_site(site_name).operand(gemm, operand)
        new = plan.for_site(site_name).operand(gemm, operand)
        if (old.format, old.effective_scaling()) != (new.format, new.effective_scaling()):
            del quantizer.scalers[key]
    quantizer.switch(plan)
    refresh(model)  # a site that was all high may now want the handler, and the reverse
    return before


def converted_plan(model: nn.Module) -> Plan:
    """The plan a converted model runs under."""
    return _quantizer(model).plan


def site_sizes(model: nn.Module) -> dict[str, dict[tuple[str, str], int]]:
    """Per site, ``(gemm, operand)`` → element count from the latest forward (for ``Plan.average_bits``)."""
    _quantizer(model)
    return operand_sizes(model)


def numerics_state_dict(model: nn.Module) -> dict[str, Any]:
    """The converted model's numerics state: plan, delayed-scaling amax histories, generator state."""
    quantizer = _quantizer(model)
    return {
        "plan": quantizer.plan.to_dict(),
        "scalers": {key: scaler.state_dict() for key, scaler in sorted(quantizer.scalers.items())},
        "generator": None if quantizer.generator is None else quantizer.generator.get_state(),
    }


def load_numerics_state_dict(model: nn.Module, state: Mapping[str, Any]) -> None:
    """Restore :func:`numerics_state_dict` into a model converted with the same plan."""
    quantizer = _quantizer(model)
    missing = {"plan", "scalers", "generator"} - set(state)
    if missing:
        raise ValueError(f"numerics state lacks {sorted(missing)}; expected keys: plan, scalers, generator")
    if Plan.from_dict(state["plan"]) != quantizer.plan:
        raise ValueError(
            "numerics state was saved under a different plan than the one this model is converted with"
        )
    for key, scaler_state in state["scalers"].items():
        site_name, gemm, operand = key.rsplit("/", 2)
        scaling = quantizer.plan.for_site(site_name).operand(gemm, operand).effective_scaling()
        if scaling is None or scaling.kind != "delayed":
            raise ValueError(
                f"numerics state has a delayed scaler for {key!r}, which the plan does not scale delayed"
            )
        quantizer.scaler(key, scaling).load_state_dict(scaler_state)
    generator_state = state["generator"]
    if generator_state is not None:
        if quantizer.generator is None:
            raise ValueError(
                "numerics state holds a generator state but the model was converted without a generator"
            )
        quantizer.generator.set_state(generator_state)


_make_callable(__name__, "convert")
