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
from typing import Any

import torch
from torch import nn

from numscope._callable import make_callable as _make_callable
from numscope.formats import native
from numscope.formats.fast import reduced_tensor_amax
from numscope.formats.path import (
    QuantizerPath,
    compiled_wanted,
    native_covers,
    packs_block_codes,
    quantizer_paths,
)
from numscope.formats.quantize import Encoded, as_float32, encode, quantize, tile_quantize
from numscope.formats.scaling import DelayedScaler, Scaling, element_scale
from numscope.formats.spec import BlockFormat, FloatFormat
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


class _Quantizer:
    """The operand handler of :func:`convert`."""

    def __init__(
        self,
        plan: Plan,
        generator: torch.Generator | None,
        compiled: bool | None = None,
        low_memory: bool = False,
    ) -> None:
        self._last_codes: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.plan = plan
        self.generator = generator
        self.compiled = compiled
        self.low_memory = low_memory
        self.scalers: dict[str, DelayedScaler] = {}
        self._specs: dict[str, SiteSpec] = {}
        self._weights: dict[str, tuple[weakref.ref, tuple, torch.Tensor]] = {}
        self._grad: tuple[torch.Tensor, tuple, torch.Tensor] | None = None
        # a gradient announced for both dgrad and wgrad (announce_gradient), then wgrad's block-format copy
        # of it, made with dgrad's in one pass
        self._announced: tuple[torch.Tensor, tuple] | None = None
        self._grad_columns: tuple[torch.Tensor, tuple, torch.Tensor] | None = None
        # quantized fprop inputs that wgrad reuses: their codes and descale, for the site to keep instead
        self._codes: dict[int, tuple[weakref.ref, torch.Tensor, torch.Tensor | None]] = {}
        # wgrad inputs quantized in forward, by the input they came from (see pack_wgrad_input)
        self._prequantized: dict[tuple, tuple[weakref.ref, Any]] = {}
        # activation checkpointing: the forward's stateful quantizations (delayed scaling, stochastic
        # rounding), replayed when the forward is recomputed in backward (see forward_begins)
        self._records: dict[str, list[_Record]] = {}
        self._recomputing = False
        self._cursor: dict[str, int] = {}
        self._override: DelayedScaler | None = None
        # fresh Hadamard signs drawn by a GEMM call's first operand, for its second (see _fresh_signs)
        self._fresh: dict[str, tuple[torch.Tensor, set[str]]] = {}
        self._factors = False  # the operand being quantized enters a promoting GEMM (see __call__)

    def forward_begins(self, recompute: bool, grad_enabled: bool) -> None:
        """``numscope.sites`` says a forward starts: a forward of the model, or (``recompute``) activation
        checkpointing's recomputation of a part of it in backward. A forward with gradients forgets the
        records of the previous one; a recomputation replays them (:meth:`_quantize_operand`)."""
        self._recomputing = recompute
        self._cursor = {}
        if not recompute and grad_enabled:
            self._records.clear()

    def prequantizes_wgrad_input(self, site: Site) -> bool:
        """Whether wgrad's input is quantized in forward and kept for backward in a compact form: block
        formats rounded to nearest, whose quantization of the input along the token axis depends on nothing
        that changes between forward and backward (as Transformer Engine keeps a column-wise copy). MX
        with the native quantizers on: in its codes, natively; with ``low_memory`` (MX and NVFP4) in its
        codes, encoded eagerly; through the compiled quantizers (MX only) as bfloat16 values, which hold
        every MX value exactly (checked each time)."""
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
        element codes (one byte each) and block scales, encoded eagerly; else, compiled, its values as
        bfloat16 (an MX value has at most 4 significant bits and an E8M0-scaled exponent: bfloat16 holds it
        unless it lies below bfloat16's subnormal grid; then, or with a NaN, None: the site keeps the input
        and quantizes it in backward)."""
        spec = self.spec(site).operand(Gemm.WGRAD, Operand.INPUT)
        # one input entering several sites (Q, K and V's projections) is packed once for all of them
        base = tensor if tensor._base is None else tensor._base
        key = (id(base), base._version, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), spec)
        found = self._prequantized.get(key)
        if found is not None and found[0]() is base:
            return found[1]
        packed = self._pack_wgrad_input(spec, tensor)
        forget = weakref.ref(base, lambda _, key=key: self._prequantized.pop(key, None))
        self._prequantized[key] = (forget, packed)
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
            kept = values.to(torch.bfloat16)
            if not torch.equal(kept.float(), values):
                return None
            return (kept,), _unpack  # bfloat16 → float32, no descale
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
        found = self._codes.pop(id(tensor), None)
        if found is None or found[0]() is not tensor:
            return None
        _, codes, descale = found
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

    def scaler(self, key: str, scaling: Scaling) -> DelayedScaler:
        scaler = self.scalers.get(key)
        if scaler is None:
            scaler = self.scalers[key] = DelayedScaler(scaling)
        return scaler

    def _delayed(self, key: str, scaling: Scaling) -> DelayedScaler:
        """The delayed scaler of ``key``, or the one replaying a recorded scale (``_quantize_operand``)."""
        return self._override if self._override is not None else self.scaler(key, scaling)

    def announce_gradient(self, site: Site, tensor: torch.Tensor) -> None:
        """``numscope.sites.gemm`` says that dgrad (blocks along the rows) and then wgrad (down the columns)
        will take this 2-D gradient: where both want the same MX format, dgrad's call makes both copies in
        one pass over it (:func:`numscope.formats.native.block_both`) and wgrad's takes the second."""
        self._announced = (tensor, _identity(tensor)) if self._both_directions(site, tensor) else None

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
        if operand == Operand.GRAD_OUTPUT:
            announced, self._announced = self._announced, None
            fresh = announced is not None and announced[0] is tensor and announced[1] == _identity(tensor)
            if gemm == Gemm.DGRAD and fresh and axis in (-1, 1):
                fmt = operand_spec.format_spec()
                both = native.block_both(tensor.detach(), fmt)  # type: ignore[arg-type]
                if both is not None:
                    self._grad_columns = (tensor, _identity(tensor), both[1])
                    return both[0]
            if gemm == Gemm.WGRAD and self._grad_columns is not None:
                cached, self._grad_columns = self._grad_columns, None
                if axis == 0 and cached[0] is tensor and cached[1] == _identity(tensor):
                    return cached[2]
        reusable = (
            operand == Operand.WEIGHT
            and isinstance(tensor, nn.Parameter)
            and _axis_independent(operand_spec)
            and spec.operand(Gemm.FPROP, Operand.WEIGHT) == spec.operand(Gemm.DGRAD, Operand.WEIGHT)
        )
        if reusable and gemm == Gemm.DGRAD:
            cached = self._weights.get(site.name)
            if cached is not None and cached[0]() is tensor and cached[1] == _identity(tensor):
                return cached[2]
        shared_grad = (
            operand == Operand.GRAD_OUTPUT
            and _axis_independent(operand_spec)
            and spec.operand(Gemm.DGRAD, Operand.GRAD_OUTPUT) == spec.operand(Gemm.WGRAD, Operand.GRAD_OUTPUT)
        )
        if shared_grad and gemm == Gemm.WGRAD:
            cached = self._grad
            if cached is not None and cached[0] is tensor and cached[1] == _identity(tensor):
                self._grad = None
                return cached[2]
        # a GEMM that applies the scales at each promotion takes the codes and scales (register_factors)
        self._factors = spec.accumulate_for(gemm) == "fp22_promote128"
        try:
            result = self._quantize_operand(site.key(gemm, operand), gemm, operand_spec, tensor, axis)
        finally:
            self._factors = False
        kept_for_backward = gemm == Gemm.FPROP and (
            (operand == Operand.INPUT and self.shares_input(site))
            or (
                operand == Operand.WEIGHT
                and not isinstance(tensor, nn.Parameter)
                and self.shares_weight(site)
            )
        )
        if kept_for_backward and self._last_codes is not None:  # the site keeps these codes instead
            key = id(result)
            forget = weakref.ref(result, lambda _, key=key: self._codes.pop(key, None))
            self._codes[key] = (forget, *self._last_codes)
        self._last_codes = None
        if reusable and gemm == Gemm.FPROP:
            self._weights[site.name] = (weakref.ref(tensor), _identity(tensor), result)
        if shared_grad and gemm == Gemm.DGRAD:
            self._grad = (tensor, _identity(tensor), result)
        return result

    def _quantize_operand(
        self, key: str, gemm: str, spec: OperandSpec, tensor: torch.Tensor, axis: int
    ) -> torch.Tensor:
        """:meth:`quantize` of one operand, exactly as the forward did it when activation checkpointing
        recomputes the forward in backward.

        Only a forward operand with state needs it: delayed scaling (the amax history has moved on since)
        and stochastic rounding with the quantizer's own generator (the global generator is restored by the
        checkpoint itself, which keeps its state by default). The forward records its scale and generator
        state under the operand's key and its fingerprint (shape and amax); a recomputation takes the
        latest unused record with that fingerprint (backward recomputes the last checkpointed part first),
        then the following ones in order, and leaves the history and the generator as they were.
        """
        fresh = spec.transform is not None and spec.rotation().fresh  # type: ignore[union-attr]
        # a fresh transform's signs come from the generator too: replayed with it
        stochastic = (spec.rounding == "stochastic" or fresh) and self.generator is not None
        scaling = spec.effective_scaling()
        delayed = scaling is not None and scaling.kind == "delayed"
        if gemm != Gemm.FPROP or not (stochastic or delayed):
            return self.quantize(key, spec, tensor, axis)
        amax = _amax(tensor.detach().float()).view(torch.int32).item() if tensor.numel() else 0
        fingerprint = (tuple(tensor.shape), amax)
        if not self._recomputing:
            record = _Record(fingerprint, self.generator.get_state() if stochastic else None, None)  # type: ignore[union-attr]
            self._records.setdefault(key, []).append(record)
            self._override = _ReplayScaler(self.scaler(key, scaling), None) if delayed else None  # type: ignore[arg-type]
            try:
                return self.quantize(key, spec, tensor, axis)
            finally:
                if self._override is not None:
                    record.scale = self._override.used  # type: ignore[attr-defined]
                self._override = None
        record = self._replay_record(key, fingerprint)
        kept = self.generator.get_state() if stochastic else None  # type: ignore[union-attr]
        if stochastic:
            self.generator.set_state(record.state)  # type: ignore[union-attr,arg-type]
        self._override = _ReplayScaler(self.scaler(key, scaling), record.scale) if delayed else None  # type: ignore[arg-type]
        try:
            return self.quantize(key, spec, tensor, axis)
        finally:
            self._override = None
            if stochastic:
                self.generator.set_state(kept)  # type: ignore[union-attr,arg-type]

    def _replay_record(self, key: str, fingerprint: tuple) -> _Record:
        records = self._records.get(key, [])
        following = self._cursor.get(key)
        index = None
        if following is not None and following + 1 < len(records):
            candidate = records[following + 1]
            if not candidate.used and candidate.fingerprint == fingerprint:
                index = following + 1
        if index is None:
            unused = [i for i, record in enumerate(records) if not record.used]
            index = next((i for i in reversed(unused) if records[i].fingerprint == fingerprint), None)
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

    def quantize(self, key: str, spec: OperandSpec, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        """``tensor`` in ``spec``, as float32 values (not rounded to an fp16/bf16 operand's dtype: a site
        that multiplies in float32 takes them as they are, any other casts them to its operand's dtype).
        An operand with a transform is quantized rotated along ``axis`` and rotated back."""
        rotation = spec.rotation()
        if rotation is not None and rotation.fresh:
            rotation = rotation.with_signs(self._fresh_signs(key, rotation))
        if rotation is not None:
            return rotation.quantized(
                tensor, axis, lambda rotated, last: self._quantize(key, spec, rotated, last)
            )
        return self._quantize(key, spec, tensor, axis)

    def _fresh_signs(self, key: str, rotation: Any) -> torch.Tensor:
        """The signs of a fresh Hadamard transform for the GEMM call ``key`` (``site/gemm/operand``)
        belongs to: drawn by the call's first operand (from the quantizer's generator, else torch's
        default one), taken by its other operand, so that both rotate alike and the product is kept."""
        pair, operand = key.rsplit("/", 1)
        pending = self._fresh.get(pair)
        if pending is not None and operand not in pending[1] and len(pending[0]) == rotation.size:
            self._fresh.pop(pair)
            return pending[0]
        signs = rotation.draw_signs(self.generator)
        self._fresh[pair] = (signs, {operand})
        return signs

    def _quantize(self, key: str, spec: OperandSpec, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        fmt = spec.format_spec()
        scaling = spec.effective_scaling()
        cast = spec.cast()
        xf = as_float32(tensor.detach(), fmt)  # as quantize() takes it (float64: rounded to odd)
        paths = quantizer_paths(cast, xf, compiled=self.compiled, codes=True)
        self._last_codes = None
        if QuantizerPath.DTYPE in paths and tensor.numel() > 0:  # codes in a torch dtype
            dtype = cast.torch_dtype()
            # fp8: the native quantizers write the codes (torch's fp8 conversion is scalar code; its
            # fp16/bf16 conversions are single vector instructions, faster than any rounding arithmetic)
            by_library = paths[0] is QuantizerPath.NATIVE
            amax = None
            if scaling is not None or (spec.overflow == "saturate" and not by_library):
                amax = native.abs_amax(xf.reshape(1, -1), "tensor") if by_library else _amax(xf)
            scale = None
            if scaling is not None:
                delayed = self._delayed(key, scaling) if scaling.kind == "delayed" else None
                scale = element_scale(xf, fmt, scaling, delayed, local_amax=amax)  # type: ignore[arg-type]
            done = native.element_codes(xf, fmt, spec.overflow, dtype, scale) if by_library else None
            if done is None:
                done = _fake_cast(xf, dtype, fmt, scale, amax, spec.overflow)  # type: ignore[arg-type]
            values, codes = done
            self._last_codes = (codes, None if scale is None else 1.0 / scale)
            return values
        tiles = scaling is not None and scaling.kind == "block" and not isinstance(fmt, BlockFormat)
        if tiles and self._factors and tensor.numel() > 0:
            values, codes, decode = tile_quantize(
                xf,
                fmt,  # type: ignore[arg-type]
                scaling,  # type: ignore[arg-type]
                spec.rounding,
                spec.overflow,
                spec.flush_subnormals,
                self.generator,
                factors=True,
            )
            values = values.clone()  # a tensor of its own, which views of it lead back to
            register_factors(values, codes, decode)  # type: ignore[arg-type]
            return values
        if isinstance(fmt, BlockFormat):
            reduce = scaling is None or scaling.reduce_amax
            scaling_arg: Any = Scaling("block", axis=axis, reduce_amax=reduce)
        elif scaling is not None and scaling.kind == "delayed":
            scaling_arg = self._delayed(key, scaling)
        else:
            scaling_arg = scaling
        return quantize(
            xf,
            fmt,  # type: ignore[arg-type]
            scaling=scaling_arg,
            rounding=spec.rounding,
            overflow=spec.overflow,
            flush_subnormals=spec.flush_subnormals,
            generator=self.generator,
            compiled=QuantizerPath.COMPILED in paths,
        )


class _Record:
    """One stateful forward quantization kept for activation checkpointing's recomputation."""

    __slots__ = ("fingerprint", "scale", "state", "used")

    def __init__(self, fingerprint: tuple, state: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        self.fingerprint = fingerprint
        self.state = state
        self.scale = scale
        self.used = False


class _ReplayScaler(DelayedScaler):
    """A delayed scaler standing in for ``real``: with ``fixed`` None it asks ``real`` (which records the
    amax) and keeps the scale it gave in ``used``; else it gives ``fixed`` and records nothing."""

    def __init__(self, real: DelayedScaler, fixed: torch.Tensor | None) -> None:
        super().__init__(real.scaling)
        self.real = real
        self.fixed = fixed
        self.used: torch.Tensor | None = None

    def scale_for(self, x: torch.Tensor, fmt_max: float, amax: torch.Tensor | None = None) -> torch.Tensor:
        if self.fixed is not None:
            return self.fixed
        self.used = self.real.scale_for(x, fmt_max, amax)
        return self.used


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
    and for E4M3 whether ``2⁸ / scale`` is finite, are read to the host together, once per call.
    """
    scaled = values if scale is None else values * scale
    descale = None if scale is None else 1.0 / scale
    saturate = overflow == "saturate"
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
    return _Quantizer(Plan(SiteSpec.uniform(spec)), generator).quantize("operand", spec, tensor, axis)


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
    quantizer.plan = plan
    quantizer._specs.clear()
    quantizer._weights.clear()
    quantizer._grad = quantizer._announced = quantizer._grad_columns = None
    quantizer._prequantized.clear()
    quantizer._records.clear()
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
