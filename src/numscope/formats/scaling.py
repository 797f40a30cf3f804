"""Scaling schemes: how a tensor is mapped into a format's range before it is cast.

An element format is applied to ``x · s`` and the result descaled by ``1/s`` (both in float32, as FP8
hardware and Transformer Engine do: the cast sees ``x·scale``, the GEMM multiplies by ``scale_inv``).
The scale maps the amax of the scaled unit onto the format's max: ``s = max / amax / 2^margin``.

kinds: ``none``; ``tensor`` (current amax of the whole tensor); ``delayed`` (amax history, stateful:
see :class:`DelayedScaler`); ``row`` (one scale per slice along the last axis); ``column`` (one scale per
index of the last axis); ``block`` (element formats: tiles of ``block_shape`` over the last two axes,
e.g. ``(1, 128)`` or ``(128, 128)``; block formats: their own block scale, blocks along ``axis``).
A zero or non-finite amax gives the scale 1, so all-zero tensors and blocks quantize to zero. A tiny but
nonzero amax whose ``max / amax`` overflows float32 gives the largest float32 (as Transformer Engine clamps
it), so the unit still maps as far up into the format as float32 allows instead of to zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat
from numscope.vocab import ScalingKind

KINDS: tuple[str, ...] = tuple(kind.value for kind in ScalingKind)
AMAX_COMPUTE: tuple[str, ...] = ("max", "most_recent")


@dataclass(frozen=True)
class Scaling:
    """A scaling scheme (frozen; the state of delayed scaling lives in :class:`DelayedScaler`).

    margin: headroom in binades (the scale is divided by 2^margin).
    power_of_two: round the scale down to a power of two, so that scaling itself is exact.
    block_shape: tile shape for ``kind="block"`` with an element format: ``(1, N)`` or ``(M, N)``.
    axis: for block formats, the axis along which blocks of consecutive elements run (the GEMM's
        contraction axis).
    history_len, amax_compute: delayed scaling's amax history length and rule (``max`` of the history or
        ``most_recent``), as Transformer Engine's ``DelayedScaling``.
    amax_epsilon: a floor under the amax before the scale is computed (Transformer Engine's
        ``amax_epsilon``): ``max(amax, amax_epsilon)``, so that a near-zero unit is not scaled up to the
        format's max; 0 (the default) leaves the amax as it is.
    scale_from_decode: tile scaling (``kind="block"`` with an element format) as DeepGEMM's casts compute
        it: the decode scale sf = amax / max first (rounded up to a power of two with ``power_of_two``, as
        its UE8M0 option), elements x · (1 / sf), decoded as code · sf; by default the scale max / amax,
        decoded by its reciprocal (Transformer Engine's order). The two differ in float32 ulps.
    reduce_amax: under ``torch.distributed``, take the amax over the default process group so that every
        rank quantizes identically (as Transformer Engine's ``reduce_amax``): the per-tensor amax (current,
        delayed, NVFP4's tensor scale) and the per-column amax, whose columns run over the batch's rows
        that data parallelism splits. Row and tile scales stay local (a row lives on one rank).
    """

    kind: ScalingKind = ScalingKind.TENSOR
    margin: int = 0
    power_of_two: bool = False
    block_shape: tuple[int, ...] | None = None
    axis: int = -1
    history_len: int = 16
    amax_compute: Literal["max", "most_recent"] = "max"
    reduce_amax: bool = True
    amax_epsilon: float = 0.0
    scale_from_decode: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ValueError(f"unknown scaling {self.kind!r}; allowed: {', '.join(KINDS)}")
        object.__setattr__(self, "kind", ScalingKind(self.kind))
        if not isinstance(self.margin, int) or isinstance(self.margin, bool):
            raise TypeError(f"scaling margin must be an int (binades), got {self.margin!r}")
        if isinstance(self.amax_epsilon, bool) or not isinstance(self.amax_epsilon, int | float):
            raise TypeError(f"scaling amax_epsilon must be a float >= 0, got {self.amax_epsilon!r}")
        if not (math.isfinite(self.amax_epsilon) and self.amax_epsilon >= 0):
            raise ValueError(f"scaling amax_epsilon must be a finite float >= 0, got {self.amax_epsilon!r}")
        object.__setattr__(self, "amax_epsilon", float(self.amax_epsilon))
        if self.history_len < 1:
            raise ValueError(f"scaling history_len must be >= 1, got {self.history_len}")
        if self.amax_compute not in AMAX_COMPUTE:
            raise ValueError(
                f"unknown amax_compute {self.amax_compute!r}; allowed: {', '.join(AMAX_COMPUTE)}"
            )
        if self.scale_from_decode and (self.kind != "block" or self.margin):
            raise ValueError("scale_from_decode applies to tile scaling (kind='block') without a margin")
        if self.block_shape is not None:
            shape = tuple(self.block_shape)
            if self.kind != "block":
                raise ValueError(
                    f"block_shape {shape} given for scaling kind {self.kind!r}; use kind='block'"
                )
            if len(shape) not in (1, 2) or any((not isinstance(n, int)) or n < 1 for n in shape):
                raise ValueError(
                    f"block_shape must be (N,) or (M, N) of positive ints, got {self.block_shape!r}"
                )
            object.__setattr__(self, "block_shape", shape)

    @classmethod
    def parse(cls, spec: str | Scaling | dict[str, Any] | None) -> Scaling | None:
        """Accept ``None``, a kind name, a dict of fields, or a :class:`Scaling`."""
        if spec is None or isinstance(spec, Scaling):
            return spec
        if isinstance(spec, str):
            return cls(kind=spec)  # type: ignore[arg-type]
        if isinstance(spec, dict):
            unknown = set(spec) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(
                    f"unknown scaling key(s) {sorted(unknown)}; allowed: {sorted(cls.__dataclass_fields__)}"
                )
            args = dict(spec)
            if args.get("block_shape") is not None:
                args["block_shape"] = tuple(args["block_shape"])
            return cls(**args)
        raise TypeError(f"scaling must be None, a kind name, a dict or a Scaling, got {type(spec).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """Only the fields that differ from the defaults (for legible plan files)."""
        default = Scaling()
        out: dict[str, Any] = {"kind": self.kind.value}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name != "kind" and value != getattr(default, name):
                out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> Scaling:
        return replace(self, **changes)

    def decode(self, amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
        """``scale_from_decode``'s decode scale of a unit whose amax is ``amax``: amax / max, float32
        (after the ``amax_epsilon`` floor; with ``power_of_two`` rounded up to a power of two); 1 where the
        amax is zero or not finite."""
        amax = amax.float()
        if self.amax_epsilon:
            amax = torch.clamp(amax, min=self.amax_epsilon)
        decode = torch.div(amax, torch.full_like(amax, fmt_max))
        if self.power_of_two:
            mantissa, exponent = torch.frexp(decode)
            decode = torch.ldexp(torch.where(mantissa == 0.5, 0.5, 1.0) * torch.ones_like(decode), exponent)
        usable = (amax > 0) & torch.isfinite(amax) & (decode > 0)
        return torch.where(usable, decode, torch.ones_like(decode))

    def scale(self, amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
        """The multiplier this scaling gives a unit whose amax is ``amax`` (see :func:`scale_from_amax`)."""
        return scale_from_amax(amax, fmt_max, self.margin, self.power_of_two, self.amax_epsilon)


def reduces_across_ranks(enabled: bool = True) -> bool:
    """Whether an amax is reduced over the ranks: ``enabled`` (``Scaling.reduce_amax``) and a
    ``torch.distributed`` process group is initialised."""
    return enabled and torch.distributed.is_available() and torch.distributed.is_initialized()


def reduce_amax_(amax: torch.Tensor, enabled: bool = True) -> torch.Tensor:
    """All-reduce (max) ``amax`` in place over the default process group when one is initialised."""
    if reduces_across_ranks(enabled):
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    return amax


FLOAT32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(
    amax: torch.Tensor,
    fmt_max: float,
    margin: int = 0,
    power_of_two: bool = False,
    amax_epsilon: float = 0.0,
) -> torch.Tensor:
    """The multiplier that maps ``amax`` onto ``fmt_max / 2^margin``, float32.

    ``amax`` is first raised to ``amax_epsilon``. 1 where the amax is zero or not finite; the largest
    float32 where ``fmt_max / amax`` overflows (a tiny nonzero amax), as Transformer Engine's current
    scaling clamps it; ``power_of_two`` then rounds the scale down to a power of two (2^127 at most).
    """
    amax = amax.float()
    if amax_epsilon:
        amax = torch.clamp(amax, min=amax_epsilon)
    # a true division (``fmt_max / amax`` would be ``amax.reciprocal() * fmt_max``: rounded twice)
    scale = torch.div(torch.full_like(amax, fmt_max), amax) / float(2**margin)
    scale = torch.clamp(scale, max=FLOAT32_MAX)  # inf (tiny amax) -> the largest float32; NaN stays NaN
    if power_of_two:
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.full_like(scale, 0.5), exponent)
        del mantissa
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, scale, torch.ones_like(scale))


@dataclass
class DelayedScaler:
    """Delayed (amax history) scaling state for one tensor role, as Transformer Engine's ``DelayedScaling``.

    Each call of :meth:`scale_for` returns the scale computed from the history *before* this tensor, then
    records the tensor's amax. On the very first call, with an empty history, the current amax is used
    (TE would use scale 1 there), so the first step does not overflow. A non-finite amax is not recorded.
    A tensor without elements has no amax to record; where amaxes are reduced across ranks it takes part
    with 0 and records the reduced amax, as the other ranks do.

    The history and the count of recorded amaxes are tensors on the device of the tensors scaled (moved
    there by the first call): a call reads nothing back to the host, so a GPU step runs without a
    synchronisation per GEMM.
    """

    scaling: Scaling = field(default_factory=lambda: Scaling(kind="delayed"))
    #: where the state starts (``None``: the CPU); it follows the scaled tensors either way
    device: torch.device | str | None = None
    amax_history: torch.Tensor = field(init=False)
    recorded: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.scaling, str | dict):
            self.scaling = Scaling.parse(self.scaling)  # type: ignore[assignment]
        if self.scaling.kind != "delayed":
            self.scaling = self.scaling.replace(kind="delayed")
        self.amax_history = torch.zeros(self.scaling.history_len, dtype=torch.float32, device=self.device)
        self.recorded = torch.zeros((), dtype=torch.int64, device=self.device)

    @property
    def steps(self) -> int:
        """How many amaxes have been recorded (read from the device: a synchronisation there)."""
        return int(self.recorded)

    def _follow(self, device: torch.device) -> None:
        """Keep the state on ``device``, where the scaled tensors are."""
        if self.amax_history.device != device:
            self.amax_history = self.amax_history.to(device)
            self.recorded = self.recorded.to(device)

    def history_amax(self) -> torch.Tensor:
        if self.scaling.amax_compute == "most_recent":
            return self.amax_history.select(0, 0)
        return self.amax_history.max()

    def scale_for(self, x: torch.Tensor, fmt_max: float, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The scale to use for ``x`` now; records ``amax(x)`` into the history.

        amax: ``amax(|x|)`` where the caller has it already (this rank's; it is reduced here).
        """
        self._follow(x.device)
        started = self.recorded > 0
        if amax is None:
            amax = x.detach().abs().amax() if x.numel() else torch.zeros((), device=x.device)
            if not x.numel() and not reduces_across_ranks(self.scaling.reduce_amax):
                return self.scaling.scale(torch.where(started, self.history_amax(), amax), fmt_max)
        current = reduce_amax_(amax.float().reshape(1).clone(), self.scaling.reduce_amax)
        now = current.reshape(())
        scale = self.scaling.scale(torch.where(started, self.history_amax(), now), fmt_max)
        finite = torch.isfinite(now)
        rolled = torch.cat([current, self.amax_history.narrow(0, 0, self.scaling.history_len - 1)])
        self.amax_history = torch.where(finite, rolled, self.amax_history)
        self.recorded = self.recorded + finite.to(self.recorded.dtype)
        return scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "scaling": self.scaling.to_dict(),
            "amax_history": self.amax_history.clone(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history = state["amax_history"]
        if history.shape != self.amax_history.shape:
            raise ValueError(
                f"amax history of length {history.shape[0]} does not fit "
                f"history_len {self.scaling.history_len}"
            )
        device = self.amax_history.device
        self.amax_history = history.clone().float().to(device)
        self.recorded = torch.tensor(int(state["steps"]), dtype=torch.int64, device=device)


def log2_floor(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) as int32 for positive finite float32 (subnormals included); -127 for zero.

    Read from the exponent field (subnormals after an exact scaling by 2^64), so it fuses under
    ``torch.compile``.
    """
    field = (x.view(torch.int32) >> 23) & 0xFF
    lifted = ((x * 2.0**64).view(torch.int32) >> 23) & 0xFF
    small = torch.where(x > 0, lifted - (127 + 64), torch.full_like(lifted, -127))
    return torch.where(field > 0, field - 127, small)


def exact_pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float32, exactly, for int32 exponents in [-149, 127], built from its bit pattern."""
    exponent = exponent.to(torch.int32)
    normal = ((exponent.clamp(-126, 127) + 127) << 23).view(torch.float32)
    subnormal = (1 << (exponent + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(exponent >= -126, normal, subnormal)


def is_power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


#: element formats that are used without scaling unless a plan says otherwise
UNSCALED_FORMATS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")


def default_scaling(fmt: Format | BlockFormat) -> Scaling | None:
    """The scaling a format gets when a plan names none.

    Block formats: their own block scale (``Scaling("block")``; the runtime sets the block axis to the
    GEMM's contraction axis). fp32, tf32, bf16, fp16: none (they are plain element casts). Every other
    element format (fp8, fp6, fp4, int, eXmY): ``Scaling("tensor")``, the current amax of the tensor.
    """
    if isinstance(fmt, BlockFormat):
        return Scaling("block")
    if fmt.name in UNSCALED_FORMATS:
        return None
    return Scaling("tensor")


def tensor_amax(
    x: torch.Tensor,
    amax: torch.Tensor | float | None = None,
    *,
    reduce: bool = True,
    local: torch.Tensor | None = None,
) -> torch.Tensor:
    """A float32 scalar: ``amax`` where given (a whole tensor's max|·|, already reduced across ranks, for
    ``x`` a sample of it), else ``x``'s own max|·| (``local`` where the caller has it) reduced across ranks
    as ``reduce`` says. What per-tensor scales and NVFP4's tensor scale derive from."""
    if amax is not None:
        return torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(())
    own = x.abs().amax() if local is None else local
    return reduce_amax_(own.float().reshape(1).clone(), reduce).reshape(())


def element_scale(
    x: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    scaling: Scaling,
    delayed: DelayedScaler | None = None,
    *,
    amax: torch.Tensor | float | None = None,
    local_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The multiplier of ``x`` (broadcastable to it) under per-tensor (current, or ``delayed`` with its amax
    history), row or column ``scaling``: ``scaling.scale(amax, fmt.max)``. The one place where an element
    format's scale is decided: :func:`numscope.quantize`, :func:`numscope.formats.encode`,
    ``numscope.convert``'s quantizer and the metrics' quantization of samples all take it from here.

    amax: for per-tensor scaling of ``x`` a sample of a larger tensor, that tensor's max|·|, already reduced
    across ranks (the sample is then scaled as it is inside the whole tensor). local_amax: this process's
    max|x| where the caller has it already (reduced across ranks here, as ``scaling`` says).
    """
    if delayed is not None:
        return delayed.scale_for(x, fmt.max, amax=local_amax)
    if scaling.kind == "tensor":
        amax = tensor_amax(x, amax, reduce=scaling.reduce_amax, local=local_amax)
    elif scaling.kind == "row":
        amax = x.abs().amax(dim=-1, keepdim=True) if x.dim() else x.abs()
    elif scaling.kind == "column":  # its amax runs over every row: data parallelism splits the rows
        dims = tuple(range(x.dim() - 1))
        amax = reduce_amax_(x.abs().amax(dim=dims, keepdim=True), scaling.reduce_amax) if dims else x.abs()
    else:
        raise ValueError(f"scaling {scaling.kind!r} has no per-element scale (tensor, delayed, row, column)")
    return scaling.scale(amax, fmt.max)
