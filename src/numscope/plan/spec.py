"""What a plan says about one operand (:class:`OperandSpec`), one site (:class:`SiteSpec`) and one glob
rule (:class:`Rule`), with the checks and error messages every plan entry point shares."""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from numscope.errors import NumscopeError
from numscope.formats.cast import OVERFLOWS, ROUNDINGS
from numscope.formats.path import Cast
from numscope.formats.scaling import Scaling, default_scaling
from numscope.formats.spec import BlockFormat, Format, get_format
from numscope.formats.transform import Rotation
from numscope.sites.gemm import ACCUMULATORS
from numscope.vocab import GEMMS, OPERAND_KEYS, OPERAND_NAMES, OPERANDS, Gemm, Overflow, Rounding

#: the accumulators a plan may name: those of :data:`numscope.sites.ACCUMULATORS`, in its order
ACCUMULATE: tuple[str, ...] = tuple(ACCUMULATORS)
HIGH = "high"
PLAN_VERSION = 1
VERSION_KEY = "numscope_plan"

#: bits of one float32 scale, as stored next to tile-scaled element formats
SCALE_BITS = 32

_ROLE_KEYS: tuple[str, ...] = OPERAND_NAMES
_GROUP_KEYS: dict[str, tuple[str, ...]] = {"forward": (Gemm.FPROP,), "backward": (Gemm.DGRAD, Gemm.WGRAD)}
_OPERAND_FIELDS: tuple[str, ...] = (
    "format",
    "scaling",
    "rounding",
    "overflow",
    "flush_subnormals",
    "transform",
)
_SCALING_TYPES: dict[str, type] = {
    "kind": str,
    "margin": int,
    "power_of_two": bool,
    "block_shape": list,
    "history_len": int,
    "amax_compute": str,
    "reduce_amax": bool,
    "amax_epsilon": float,
    "scale_from_decode": bool,
}


_A_TYPE: dict[type, str] = {str: "a string", int: "an int", bool: "a bool", list: "a list", float: "a number"}


class PlanError(NumscopeError, ValueError):
    """An invalid plan: the message names the file (when there is one), the key path and what is allowed."""


def _names(values: Iterable[str]) -> str:
    return ", ".join(values)


def _unknown(what: str, value: str, allowed: Iterable[str]) -> str:
    """``unknown key 'fprp'; did you mean 'fprop'? allowed: ...``"""
    allowed = list(allowed)
    close = difflib.get_close_matches(value, allowed, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown {what} {value!r}; {hint}allowed: {_names(allowed)}"


def _type_name(value: Any) -> str:
    return type(value).__name__


def _check_key(gemm: str, operand: str) -> None:
    if gemm not in OPERANDS:
        raise PlanError(_unknown("gemm", gemm, GEMMS))
    if operand not in OPERANDS[gemm]:
        raise PlanError(f"unknown operand {operand!r}; allowed for {gemm}: {_names(OPERANDS[gemm])}")


class _FrozenDict(Mapping):
    """A read-only, hashable mapping (equality ignores order, as a dict's does)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[Any, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_FrozenDict, (self._data,))


@dataclass(frozen=True)
class OperandSpec:
    """How one operand of one GEMM is quantized.

    format: a numscope format name (canonicalised: ``"mxfp8"`` is stored as ``"mxfp8_e4m3"``) or ``"high"``,
        which leaves the operand as it is (no cast, no scaling).
    scaling: ``None`` for the format's default (see :func:`default_scaling`); a :class:`numscope.Scaling`,
        a kind name or a dict of its fields are accepted. A scaling equal to the default is stored as
        ``None``, so that equal numerics compare equal. Block formats accept only ``Scaling("block")``
        without ``block_shape``; element formats accept ``block`` only with a ``block_shape``. ``axis`` is
        not a plan setting: the runtime passes the GEMM's contraction axis.
    rounding: a :class:`numscope.vocab.Rounding` or its name (``nearest``, ``nearest_away``,
        ``stochastic``, ``zero``). overflow: an :class:`numscope.vocab.Overflow` or its name (``saturate``,
        ``propagate``; element formats: block formats always saturate). Names become the enum's members,
        which equal them. flush_subnormals: element formats only.
    transform: ``None``, or a random Hadamard transform along the GEMM's contraction axis applied before
        the cast and undone after it (``"rht16"``, ``"rht32:7"``: size and sign seed; see
        :class:`numscope.formats.transform.Rotation`), as NVFP4's and MXFP4's recipes do for wgrad.
    """

    format: str
    scaling: Scaling | None = None
    rounding: Rounding = Rounding.NEAREST
    overflow: Overflow = Overflow.SATURATE
    flush_subnormals: bool = False
    transform: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.format, str):
            raise PlanError(f"format must be a string, got {_type_name(self.format)}")
        if not isinstance(self.rounding, str) or self.rounding not in ROUNDINGS:
            raise PlanError(_unknown("rounding", str(self.rounding), ROUNDINGS))
        if not isinstance(self.overflow, str) or self.overflow not in OVERFLOWS:
            raise PlanError(_unknown("overflow", str(self.overflow), OVERFLOWS))
        object.__setattr__(self, "rounding", Rounding(self.rounding))
        object.__setattr__(self, "overflow", Overflow(self.overflow))
        if not isinstance(self.flush_subnormals, bool):
            raise PlanError(f"flush_subnormals must be a bool, got {_type_name(self.flush_subnormals)}")
        if self.transform is not None:
            if not isinstance(self.transform, str):
                raise PlanError(
                    f"transform must be a string such as 'rht16', got {_type_name(self.transform)}"
                )
            try:
                object.__setattr__(self, "transform", Rotation.parse(self.transform).name)
            except ValueError as error:
                raise PlanError(str(error)) from None
        scaling = self.scaling
        if scaling is not None and not isinstance(scaling, Scaling):
            try:
                scaling = Scaling.parse(scaling)
            except (TypeError, ValueError) as error:
                raise PlanError(str(error)) from None
        if self.format.strip().lower() == HIGH:
            object.__setattr__(self, "format", HIGH)
            changed = [
                name
                for name in ("scaling", "rounding", "overflow", "flush_subnormals", "transform")
                if (scaling if name == "scaling" else getattr(self, name)) != _OPERAND_DEFAULTS[name]
            ]
            if changed:
                raise PlanError(
                    f"format 'high' leaves the operand unquantized; {_names(changed)} does not apply"
                )
            return
        try:
            fmt = get_format(self.format)
        except ValueError as error:
            raise PlanError(str(error)) from None
        object.__setattr__(self, "format", fmt.name)
        object.__setattr__(self, "scaling", _canonical_scaling(fmt, scaling))
        if isinstance(fmt, BlockFormat) and self.overflow != "saturate":
            raise PlanError(
                f"block format {fmt.name!r} always saturates its elements; overflow {self.overflow!r} "
                "does not apply (allowed: saturate)"
            )
        if isinstance(fmt, BlockFormat) and self.flush_subnormals:
            raise PlanError(f"block format {fmt.name!r}: flush_subnormals applies only to element formats")

    @property
    def is_high(self) -> bool:
        """Whether the operand is left unquantized."""
        return self.format == HIGH

    def format_spec(self) -> Format | None:
        """The format object (``None`` for ``high``)."""
        return None if self.is_high else get_format(self.format)

    def effective_scaling(self) -> Scaling | None:
        """The scaling to apply: the explicit one, else the format's default; ``None`` means no scaling.

        Delayed scaling (``kind="delayed"``) is returned as a :class:`Scaling`; the runtime keeps one
        :class:`numscope.DelayedScaler` per (site, gemm, operand).
        """
        fmt = self.format_spec()
        if fmt is None:
            return None
        scaling = self.scaling if self.scaling is not None else default_scaling(fmt)
        if scaling is not None and scaling.kind == "none":
            return None
        return scaling

    def cast(self) -> Cast:
        """The cast this operand asks of a quantizer (for :func:`numscope.formats.path.quantizer_paths`);
        ``high`` has none. Made once per spec (a quantized operand asks on every call)."""
        return _cast_of(self)

    def bits_per_element(self, high_bits: float = 32.0) -> float:
        """Storage bits per element: element bits plus the share of block or tile scales.

        ``high`` counts as ``high_bits``. Block formats include their block scale (mxfp8: 8 + 8/32 = 8.25);
        element formats under tile scaling (``block_shape`` M×N) add one float32 scale per tile; per-tensor,
        per-row and per-column scales depend on the tensor's shape and are not counted.
        """
        fmt = self.format_spec()
        if fmt is None:
            return float(high_bits)
        bits = fmt.bits_per_element
        scaling = self.effective_scaling()
        if not isinstance(fmt, BlockFormat) and scaling is not None and scaling.block_shape is not None:
            tile = 1
            for n in scaling.block_shape:
                tile *= n
            bits += SCALE_BITS / tile
        return bits

    def describe_scaling(self) -> str:
        """A short legible name of the effective scaling (``tensor``, ``block/32 e8m0``, ``delayed(...)``),
        with the transform where there is one (``block/16 fp8_e4m3 + fp32 tensor, rht16``)."""
        text = self._describe_scaling()
        return text if self.transform is None else f"{text}, {self.transform}"

    def _describe_scaling(self) -> str:
        fmt = self.format_spec()
        if fmt is None:
            return "-"
        if isinstance(fmt, BlockFormat):
            shape = f"{fmt.block_rows}x{fmt.block_size}" if fmt.block_rows > 1 else str(fmt.block_size)
            text = f"block/{shape} {fmt.scale_format.name}"
            return text + f" + fp32 {'row' if fmt.row_scale else 'tensor'}" if fmt.tensor_scale else text
        scaling = self.effective_scaling()
        if scaling is None:
            return "none"
        extra = {k: v for k, v in scaling.to_dict().items() if k != "kind"}
        if not extra:
            return scaling.kind
        return f"{scaling.kind}({', '.join(f'{k}={v}' for k, v in extra.items())})"

    def rotation(self) -> Rotation | None:
        """The random Hadamard transform of this operand, if any."""
        return None if self.transform is None else Rotation.parse(self.transform)


_OPERAND_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(OperandSpec) if f.name != "format"}


def _canonical_scaling(fmt: Format, scaling: Scaling | None) -> Scaling | None:
    """Validate that ``scaling`` fits ``fmt``; return ``None`` where it equals the format's default."""
    if scaling is None:
        return None
    if scaling.axis != -1:
        raise PlanError(
            f"scaling axis {scaling.axis} is not a plan setting: the runtime uses the GEMM's contraction "
            "axis; drop axis"
        )
    default = default_scaling(fmt)
    if isinstance(fmt, BlockFormat):
        if scaling.kind != "block":
            raise PlanError(
                f"scaling {scaling.kind!r} does not apply to the block format {fmt.name!r}, which brings its "
                "own block scale; allowed: omit scaling, or kind 'block'"
            )
        if scaling.block_shape is not None:
            raise PlanError(
                f"block format {fmt.name!r} has a fixed block of {fmt.block_size} elements; drop block_shape"
            )
        return None if scaling == default else scaling
    if scaling.kind == "block" and scaling.block_shape is None:
        raise PlanError(
            f"scaling 'block' of the element format {fmt.name!r} needs block_shape, e.g. [1, 128] "
            "or [128, 128]"
        )
    if scaling == default or (default is None and scaling.kind == "none"):
        return None
    return scaling


HIGH_SPEC = OperandSpec(HIGH)


def _operand_spec(value: OperandSpec | str) -> OperandSpec:
    if isinstance(value, OperandSpec):
        return value
    if isinstance(value, str):
        return OperandSpec(value)
    raise PlanError(f"an operand spec is an OperandSpec or a format name, got {_type_name(value)}")


def _split_key(key: tuple[str, str] | str) -> tuple[str, str]:
    if isinstance(key, str):
        gemm, sep, operand = key.partition("/")
        if not sep:
            raise PlanError(f"an operand key is 'gemm/operand' (e.g. 'fprop/input'), got {key!r}")
        key = (gemm, operand)
    if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
        raise PlanError(f"an operand key is a (gemm, operand) pair, got {key!r}")
    _check_key(*key)
    return key


def _accumulate(value: object) -> str | _FrozenDict:
    """A site's accumulation as stored: one name, or a GEMM → name mapping where the GEMMs differ."""
    if isinstance(value, str):
        if value not in ACCUMULATE:
            raise PlanError(_unknown("accumulate", value, ACCUMULATE))
        return value
    if not isinstance(value, Mapping):
        raise PlanError(
            f"accumulate is a name ({', '.join(ACCUMULATE)}) or a mapping gemm -> name, "
            f"got {_type_name(value)}"
        )
    per_gemm = {}
    for gemm, name in value.items():
        if gemm not in GEMMS:
            raise PlanError(f"accumulate: {_unknown('gemm', str(gemm), GEMMS)}")
        if not isinstance(name, str) or name not in ACCUMULATE:
            raise PlanError(f"accumulate for {gemm}: {_unknown('accumulate', str(name), ACCUMULATE)}")
        per_gemm[gemm] = name
    names = [per_gemm.get(gemm, "fp32") for gemm in GEMMS]
    if len(set(names)) == 1:
        return names[0]
    return _FrozenDict(dict(zip(GEMMS, names, strict=True)))


@dataclass(frozen=True)
class SiteSpec:
    """The numerics of one site: an :class:`OperandSpec` for each operand of its three GEMMs.

    operands: keys ``(gemm, operand)`` (``"gemm/operand"`` strings and bare format names are accepted);
        missing keys mean ``high``. ``high`` entries are dropped, so equal numerics compare equal.
    accumulate: the precision the GEMM's products are summed in: ``fp32`` (default), ``bf16``, ``fp16``,
        ``fp22`` (E8M13, an FP8 tensor core's accumulator without promotion: Hopper's "fast accumulation")
        or ``fp22_promote128`` (fp22 promoted to an fp32 sum every 128 products, as DeepSeek-V3); see
        :data:`numscope.sites.ACCUMULATORS`. One name for all three GEMMs, or a mapping GEMM → name
        (missing GEMMs: ``fp32``), e.g. ``{"fprop": "fp22"}`` for Transformer Engine's FP8 recipes, whose
        fprop GEMM runs without the split accumulator. Stored as the name where all three agree.
    """

    operands: Mapping[tuple[str, str], OperandSpec] = field(default_factory=dict)
    accumulate: str | Mapping[str, str] = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.operands, Mapping):
            raise PlanError(f"operands must be a mapping, got {_type_name(self.operands)}")
        given = {_split_key(k): _operand_spec(v) for k, v in self.operands.items()}
        canonical = {k: given[k] for k in OPERAND_KEYS if k in given and not given[k].is_high}
        object.__setattr__(self, "operands", _FrozenDict(canonical))
        object.__setattr__(self, "accumulate", _accumulate(self.accumulate))

    def accumulate_for(self, gemm: str) -> str:
        """The accumulator of one GEMM (``fprop``, ``dgrad`` or ``wgrad``)."""
        if gemm not in GEMMS:
            raise PlanError(_unknown("gemm", str(gemm), GEMMS))
        return self.accumulate if isinstance(self.accumulate, str) else self.accumulate[gemm]

    def describe_accumulate(self) -> str:
        """``fp32``, or per GEMM where they differ: ``fprop fp22, dgrad fp32, wgrad fp32``."""
        if isinstance(self.accumulate, str):
            return self.accumulate
        return ", ".join(f"{gemm} {self.accumulate[gemm]}" for gemm in GEMMS)

    @classmethod
    def uniform(cls, spec: OperandSpec | str, accumulate: str | Mapping[str, str] = "fp32") -> SiteSpec:
        """Every operand of every GEMM in ``spec``."""
        spec = _operand_spec(spec)
        return cls({key: spec for key in OPERAND_KEYS}, accumulate)

    def operand(self, gemm: str, operand: str) -> OperandSpec:
        """The spec of one operand (``high`` where none is set)."""
        _check_key(gemm, operand)
        return self.operands.get((gemm, operand), HIGH_SPEC)

    def with_operand(self, gemm: str, operand: str, spec: OperandSpec | str) -> SiteSpec:
        """A copy with one operand's spec replaced."""
        operands = dict(self.operands)
        operands[(gemm, operand)] = _operand_spec(spec)
        return SiteSpec(operands, self.accumulate)

    @property
    def is_high(self) -> bool:
        """Whether no operand of the site is quantized."""
        return not self.operands


def _reasons(reasons: Mapping[str, str] | None) -> _FrozenDict:
    if reasons is None:
        return _FrozenDict()
    if not isinstance(reasons, Mapping):
        raise PlanError(f"reasons must be a mapping 'gemm/operand' -> text, got {_type_name(reasons)}")
    out = {}
    for key, text in reasons.items():
        if not isinstance(key, str):
            raise PlanError(f"a reasons key is a 'gemm/operand' string, got {_type_name(key)}")
        gemm, operand = _split_key(key)
        if not isinstance(text, str):
            raise PlanError(f"reason for {key!r} must be a string, got {_type_name(text)}")
        out[f"{gemm}/{operand}"] = text
    return _FrozenDict(out)


@dataclass(frozen=True)
class Rule:
    """A glob pattern over site names (``fnmatch``, case-sensitive) with the site spec it assigns.

    reasons: why each operand got its spec, keyed ``"gemm/operand"`` (the advisor fills them).
    optional: a rule that may match no site (a named recipe's "attention products stay high" applies to
        models that have them); :meth:`Plan.check_sites` reports only the other rules that match nothing.
    """

    pattern: str
    spec: SiteSpec
    reasons: Mapping[str, str] = field(default_factory=dict)
    optional: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise PlanError(f"a rule pattern is a non-empty string, got {self.pattern!r}")
        if not isinstance(self.spec, SiteSpec):
            raise PlanError(f"a rule spec is a SiteSpec, got {_type_name(self.spec)}")
        if not isinstance(self.optional, bool):
            raise PlanError(f"a rule's optional must be a bool, got {_type_name(self.optional)}")
        object.__setattr__(self, "reasons", _reasons(self.reasons))

    def matches(self, site_name: str) -> bool:
        return fnmatch.fnmatchcase(site_name, self.pattern)


class PlanRow(NamedTuple):
    """One operand of one rule, as :meth:`Plan.describe` lists it."""

    pattern: str
    gemm: str
    operand: str
    format: str
    scaling: str
    reason: str
    rounding: str
    accumulate: str


DEFAULT_PATTERN = "(default)"


@functools.lru_cache(maxsize=1024)
def _cast_of(spec: OperandSpec) -> Cast:
    fmt = spec.format_spec()
    if fmt is None:
        raise ValueError("a 'high' operand is not cast")
    kind = None if (scaling := spec.effective_scaling()) is None else scaling.kind
    return Cast(fmt, kind, spec.rounding, spec.overflow, spec.flush_subnormals)
