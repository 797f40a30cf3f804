"""Precision plans as data: which format, scaling and rounding every operand of every GEMM site uses.

A *site* is one GEMM-bearing call in a model (an ``nn.Linear``, a transformers ``Conv1D``, a matmul in
forward code). Each site has three GEMMs, each with two operands:

========  =========================  ============================
gemm      product                    operands
========  =========================  ============================
fprop     y  = x · Wᵀ                ``input``, ``weight``
dgrad     dx = dy · W                ``grad_output``, ``weight``
wgrad     dW = dyᵀ · x               ``grad_output``, ``input``
========  =========================  ============================

For a matmul site ``y = a @ b`` the same names are used with ``input`` = a and ``weight`` = b, so dgrad
is ``da = dy · bᵀ`` and wgrad is ``db = aᵀ · dy``.

A :class:`Plan` holds a default :class:`SiteSpec` and an ordered list of :class:`Rule` s, each a glob
pattern over site names with its own complete :class:`SiteSpec`. :meth:`Plan.for_site` returns the spec of
the **last** rule whose pattern matches, else the default. A rule replaces the default for the sites it
matches; it does not merge with it: an operand a rule does not name stays ``high`` (unquantized).

Plan files are YAML (version key ``numscope_plan: 1``)::

    numscope_plan: 1
    default:                                  # TE "hybrid": E4M3 for x and W, E5M2 for dy
      input: fp8_e4m3
      weight: fp8_e4m3
      grad_output: fp8_e5m2
      accumulate: fp32
    rules:
      - match: "*.attention.self.scores"      # fnmatch glob over site names
        all: high                             # every operand of every GEMM
      - match: "bert.encoder.layer.*.output.dense"
        fprop: {input: {format: mxfp8_e4m3, rounding: nearest}, weight: mxfp8_e4m3}
        wgrad: {grad_output: {format: fp8_e5m2, scaling: {kind: delayed, history_len: 16}}}
        reasons: {fprop/input: "backward error 1.2e-3 <= 2x bf16"}

Keys of a site spec (``default`` or a rule), applied broadest first, later ones overriding earlier ones
operand by operand: ``all`` (the six operands) → ``forward`` (fprop) / ``backward`` (dgrad and wgrad) →
``input`` / ``weight`` / ``grad_output`` (that operand in every GEMM that takes it) → ``fprop`` /
``dgrad`` / ``wgrad`` (a mapping operand → spec, or one spec for both operands). Besides: ``accumulate``
(``fp32``, ``bf16``, ``fp16``, ``fp22``, ``fp22_promote128``; default ``fp32``), ``reasons``
(``"gemm/operand"`` → text) and, in a rule, ``match`` and ``optional`` (``true``: the rule may match no
site; :meth:`Plan.check_sites` reports only the others). An operand spec is a format name, ``high``, or a
mapping with ``format`` and optionally ``scaling`` (a kind name or a mapping of :class:`numscope.Scaling`
fields), ``rounding``, ``overflow``, ``flush_subnormals``, ``transform`` (``rht16``: a random Hadamard
transform of blocks of 16 along the GEMM's contraction axis before the cast, undone after it;
``rht32:7`` blocks of 32 with sign seed 7).
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from numscope._atomic import atomic_write_text
from numscope._names import exact_pattern
from numscope.formats.cast import OVERFLOWS, ROUNDINGS
from numscope.formats.scaling import KINDS, Scaling, default_scaling
from numscope.formats.spec import BlockFormat, Format
from numscope.formats.spec import format as get_format
from numscope.formats.transform import Rotation
from numscope.vocab import GEMMS, OPERAND_KEYS, OPERAND_NAMES, OPERANDS

#: the accumulators of :data:`numscope.sites.ACCUMULATORS`
ACCUMULATE: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp22", "fp22_promote128")
HIGH = "high"
PLAN_VERSION = 1
VERSION_KEY = "numscope_plan"

#: bits of one float32 scale, as stored next to tile-scaled element formats
SCALE_BITS = 32

_ROLE_KEYS: tuple[str, ...] = OPERAND_NAMES
_GROUP_KEYS: dict[str, tuple[str, ...]] = {"forward": ("fprop",), "backward": ("dgrad", "wgrad")}
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
}


_A_TYPE: dict[type, str] = {str: "a string", int: "an int", bool: "a bool", list: "a list", float: "a number"}


class PlanError(ValueError):
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
    rounding: ``nearest``, ``nearest_away``, ``stochastic`` or ``zero``. overflow: ``saturate`` or
        ``propagate`` (element formats; block formats always saturate). flush_subnormals: element formats
        only.
    transform: ``None``, or a random Hadamard transform along the GEMM's contraction axis applied before
        the cast and undone after it (``"rht16"``, ``"rht32:7"``: size and sign seed; see
        :class:`numscope.formats.transform.Rotation`), as NVFP4's and MXFP4's recipes do for wgrad.
    """

    format: str
    scaling: Scaling | None = None
    rounding: str = "nearest"
    overflow: str = "saturate"
    flush_subnormals: bool = False
    transform: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.format, str):
            raise PlanError(f"format must be a string, got {_type_name(self.format)}")
        if not isinstance(self.rounding, str) or self.rounding not in ROUNDINGS:
            raise PlanError(_unknown("rounding", str(self.rounding), ROUNDINGS))
        if not isinstance(self.overflow, str) or self.overflow not in OVERFLOWS:
            raise PlanError(_unknown("overflow", str(self.overflow), OVERFLOWS))
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


@dataclass(frozen=True)
class SiteSpec:
    """The numerics of one site: an :class:`OperandSpec` for each operand of its three GEMMs.

    operands: keys ``(gemm, operand)`` (``"gemm/operand"`` strings and bare format names are accepted);
        missing keys mean ``high``. ``high`` entries are dropped, so equal numerics compare equal.
    accumulate: the precision the GEMM's products are summed in: ``fp32`` (default), ``bf16``, ``fp16``,
        ``fp22`` (E8M13, an FP8 tensor core's accumulator) or ``fp22_promote128`` (fp22 promoted to an
        fp32 sum every 128 products, as DeepSeek-V3); see :data:`numscope.sites.ACCUMULATORS`.
    """

    operands: Mapping[tuple[str, str], OperandSpec] = field(default_factory=dict)
    accumulate: str = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.operands, Mapping):
            raise PlanError(f"operands must be a mapping, got {_type_name(self.operands)}")
        given = {_split_key(k): _operand_spec(v) for k, v in self.operands.items()}
        canonical = {k: given[k] for k in OPERAND_KEYS if k in given and not given[k].is_high}
        object.__setattr__(self, "operands", _FrozenDict(canonical))
        if not isinstance(self.accumulate, str) or self.accumulate not in ACCUMULATE:
            raise PlanError(_unknown("accumulate", str(self.accumulate), ACCUMULATE))

    @classmethod
    def uniform(cls, spec: OperandSpec | str, accumulate: str = "fp32") -> SiteSpec:
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


@dataclass(frozen=True)
class Plan:
    """A precision plan: a default site spec and glob rules over site names (immutable, hashable).

    :meth:`for_site` returns the spec of the **last** rule whose pattern matches the site name, else
    ``default``; a matching rule's spec is used whole (operands it does not set are ``high``). Patterns are
    ``fnmatch`` globs, case-sensitive, matched against the whole name: ``*`` matches any run of characters,
    dots included (``*.attention.self.*`` matches every attention projection of every layer), ``?`` one
    character, ``[0-3]`` a character set. Put broad rules first and exceptions after them.

    source: the file the plan was loaded from (for error messages only; ignored by ``==`` and ``hash``).
    """

    default: SiteSpec = field(default_factory=SiteSpec)
    rules: tuple[Rule, ...] = ()
    default_reasons: Mapping[str, str] = field(default_factory=dict)
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.default, SiteSpec):
            raise PlanError(f"the default is a SiteSpec, got {_type_name(self.default)}")
        rules = tuple(self.rules)
        for index, rule in enumerate(rules):
            if not isinstance(rule, Rule):
                raise PlanError(f"rules[{index}] must be a Rule, got {_type_name(rule)}")
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "default_reasons", _reasons(self.default_reasons))

    # -- lookup -----------------------------------------------------------------------------------
    def rule_for(self, site_name: str) -> Rule | None:
        """The rule that decides ``site_name`` (the last one that matches), or ``None`` for the default."""
        for rule in reversed(self.rules):
            if rule.matches(site_name):
                return rule
        return None

    def for_site(self, site_name: str) -> SiteSpec:
        """The numerics of the site called ``site_name``: the last matching rule's spec, else the default."""
        rule = self.rule_for(site_name)
        return self.default if rule is None else rule.spec

    def check_sites(self, site_names: Iterable[str]) -> None:
        """Raise :class:`PlanError` naming every rule pattern that matches none of ``site_names``."""
        names = list(site_names)
        unmatched = []
        for index, rule in enumerate(self.rules):
            if rule.optional or any(rule.matches(name) for name in names):
                continue
            close = difflib.get_close_matches(rule.pattern, names, n=2, cutoff=0.6)
            hint = f" (closest: {_names(repr(c) for c in close)})" if close else ""
            unmatched.append(f"rules[{index}].match {rule.pattern!r}{hint}")
        if not unmatched:
            return
        shown = names[:5]
        more = f", … ({len(names) - len(shown)} more)" if len(names) > len(shown) else ""
        available = f"{_names(shown)}{more}" if names else "none (the model has no sites)"
        prefix = f"{self.source}: " if self.source else ""
        raise PlanError(
            f"{prefix}{len(unmatched)} pattern(s) match no site: {'; '.join(unmatched)}. "
            f"Sites ({len(names)}): {available}"
        )

    # -- derived views ----------------------------------------------------------------------------
    def describe(self) -> list[PlanRow]:
        """One row per operand of the default and of each rule, in plan order, ``high`` operands included."""
        rows = []
        entries = [(DEFAULT_PATTERN, self.default, self.default_reasons)]
        entries += [(rule.pattern, rule.spec, rule.reasons) for rule in self.rules]
        for pattern, spec, reasons in entries:
            for gemm, operand in OPERAND_KEYS:
                op = spec.operand(gemm, operand)
                rows.append(
                    PlanRow(
                        pattern,
                        gemm,
                        operand,
                        op.format,
                        op.describe_scaling(),
                        reasons.get(f"{gemm}/{operand}", ""),
                        "-" if op.is_high else op.rounding,
                        spec.accumulate,
                    )
                )
        return rows

    def uses_block_formats(self) -> bool:
        """Whether any operand is in a block format (MX, NVFP4): where numscope's compiled quantizers
        (:func:`numscope.formats.set_fast`) repay their compilation; element casts run as fast eagerly."""
        return any(
            row.format != HIGH and isinstance(get_format(row.format), BlockFormat) for row in self.describe()
        )

    def average_bits(
        self, site_sizes: Mapping[str, Mapping[tuple[str, str], int]], high_bits: float = 32.0
    ) -> float:
        """Average storage bits per operand element over the given sites, weighted by element counts.

        site_sizes: site name → ``(gemm, operand)`` → number of elements of that operand (e.g. from one
            step's shapes). Block-scale overhead is included (:meth:`OperandSpec.bits_per_element`);
            ``high`` operands count as ``high_bits`` (32 by default, e.g. 16 for a bf16 model).
        """
        total_bits = 0.0
        total_elements = 0
        for site_name, sizes in site_sizes.items():
            spec = self.for_site(site_name)
            for key, count in sizes.items():
                gemm, operand = _split_key(key)
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise PlanError(
                        f"element count of {site_name}/{gemm}/{operand} must be an int >= 0, got {count!r}"
                    )
                total_bits += count * spec.operand(gemm, operand).bits_per_element(high_bits)
                total_elements += count
        if total_elements == 0:
            raise PlanError("average_bits needs at least one operand element; site_sizes holds none")
        return total_bits / total_elements

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def per_operand(
        cls,
        formats: Mapping[tuple[str, str, str], str],
        reasons: Mapping[tuple[str, str, str], str] | None = None,
    ) -> Plan:
        """A plan giving each ``(site, gemm, operand)`` its format, one exact-name rule per site (glob
        characters in names escaped); operands and sites not listed stay high. ``reasons`` go to the rules."""
        per_site: dict[str, dict[tuple[str, str], OperandSpec]] = {}
        for (site, gemm, operand), label in formats.items():
            per_site.setdefault(site, {})[(gemm, operand)] = OperandSpec(label)
        reasons = reasons or {}
        rules = tuple(
            Rule(
                exact_pattern(site),
                SiteSpec(specs),
                {f"{g}/{o}": reasons[(site, g, o)] for g, o in specs if (site, g, o) in reasons},
            )
            for site, specs in per_site.items()
        )
        return cls(SiteSpec(), rules)

    def with_rule(
        self,
        pattern: str,
        spec: SiteSpec,
        reasons: Mapping[str, str] | None = None,
        optional: bool = False,
    ) -> Plan:
        """A new plan with a rule appended (it takes precedence over every earlier rule)."""
        rule = Rule(pattern, spec, reasons or {}, optional)
        return Plan(self.default, (*self.rules, rule), self.default_reasons)

    def with_default(self, spec: SiteSpec, reasons: Mapping[str, str] | None = None) -> Plan:
        """A new plan with another default site spec."""
        return Plan(spec, self.rules, reasons or {})

    @staticmethod
    def presets() -> tuple[str, ...]:
        """The names :meth:`uniform` knows."""
        return tuple(_PRESETS)

    @staticmethod
    def recipes() -> tuple[str, ...]:
        """The names :meth:`recipe` knows (the field's published recipes; see :mod:`numscope.recipes`)."""
        from numscope.recipes import RECIPES

        return tuple(RECIPES)

    @classmethod
    def recipe(cls, name: str, sites: Iterable[str] | None = None) -> Plan:
        """A named recipe of the field as a plan (``numscope recipes`` lists them with their sources).

        sites: the model's site names, for the recipes whose layer choice depends on the model (NVFP4's
        last ~15% of linear layers in BF16); without them such a choice is left out, as the recipe's
        notes say.
        """
        from numscope.recipes import recipe

        return recipe(name, sites)

    @classmethod
    def named(cls, name: str, sites: Iterable[str] | None = None) -> Plan:
        """A preset (:meth:`uniform`) or a named recipe (:meth:`recipe`, given ``sites``) by its name."""
        if isinstance(name, str) and name in _PRESETS:
            return cls.uniform(name)
        if isinstance(name, str) and name in cls.recipes():
            return cls.recipe(name, sites)
        raise PlanError(_unknown("preset or recipe", str(name), (*_PRESETS, *cls.recipes())))

    @classmethod
    def resolve(cls, spec: str | os.PathLike[str], sites: Iterable[str] | None = None) -> Plan:
        """The plan a ``--plan`` value names: a YAML file (a ``.yaml``/``.yml`` name, or any path that
        exists), else a preset or named recipe (:meth:`named`, given the model's ``sites`` where a recipe's
        layer choice needs them). The one rule every entry point reads plans by; PlanError says what was
        wrong and what is allowed."""
        path = Path(spec)
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.is_file():
                raise PlanError(
                    f"--plan {spec}: no such file (or give a preset: {', '.join(_PRESETS)}; or a recipe: "
                    f"{', '.join(cls.recipes())})"
                )
            if path.suffix not in (".yaml", ".yml"):
                raise PlanError(f"--plan {spec}: a plan file must be YAML (.yaml or .yml)")
            try:
                return cls.load(path)
            except (OSError, UnicodeDecodeError) as error:
                raise PlanError(f"--plan {spec}: cannot read it ({error})") from error
        return cls.named(str(spec), sites)

    @classmethod
    def uniform(cls, name: str) -> Plan:
        """A preset plan: one site spec for every site, accumulation in fp32.

        ===========  =========================================================================================
        preset       every site
        ===========  =========================================================================================
        fp32         every operand ``high`` (unquantized): a converted fp32 model equals the original
        bf16         every operand ``bf16``, element cast, no scaling
        fp16         every operand ``fp16``, element cast, no scaling (loss scaling is the LossScaler's job)
        fp8          Transformer Engine's ``Format.HYBRID`` with current (per-tensor) scaling, as
                     ``Float8CurrentScaling``: ``fp8_e4m3`` for fprop input and weight, dgrad weight and
                     wgrad input; ``fp8_e5m2`` for grad_output in dgrad and wgrad
        fp8_e4m3     every operand ``fp8_e4m3``, per-tensor current scaling (TE ``Format.E4M3``)
        mxfp8        every operand ``mxfp8_e4m3`` (32 × E4M3, E8M0 scale, OCP floor rule), gradients included
        mxfp6        every operand ``mxfp6_e3m2`` (32 × E3M2, E8M0 scale)
        mxfp4        every operand ``mxfp4_e2m1`` (32 × E2M1, E8M0 scale)
        nvfp4        every operand ``nvfp4`` (16 × E2M1, E4M3 block scale, fp32 tensor scale), nearest
        int8         every operand ``int8``, per-tensor current scaling
        ===========  =========================================================================================

        Block formats' blocks run along each GEMM's contraction axis (set by the runtime).
        """
        builder = _PRESETS.get(name) if isinstance(name, str) else None
        if builder is None:
            raise PlanError(_unknown("preset", str(name), _PRESETS))
        return cls(builder())

    # -- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The YAML shape (plain dicts, lists, strings); :meth:`from_dict` reads it back to an equal plan."""
        out: dict[str, Any] = {VERSION_KEY: PLAN_VERSION}
        out["default"] = _site_to_dict(self.default, self.default_reasons, always_accumulate=True)
        rules = []
        for rule in self.rules:
            optional = {"optional": True} if rule.optional else {}
            rules.append({"match": rule.pattern, **optional, **_site_to_dict(rule.spec, rule.reasons)})
        if rules:
            out["rules"] = rules
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> Plan:
        """Read and validate the YAML shape; errors name ``source`` (a file name), the key path and what
        is allowed."""
        try:
            return _plan_from_dict(data, source)
        except PlanError as error:
            if source is None:
                raise
            raise PlanError(f"{source}: {error}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str], site_names: Iterable[str] | None = None) -> Plan:
        """Read a plan file; with ``site_names``, also check that every rule pattern matches a site."""
        source = os.fspath(path)
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
        except PlanError as error:
            raise PlanError(f"{source}: {error}") from None
        except yaml.YAMLError as error:
            raise PlanError(f"{source}: not valid YAML: {error}") from None
        plan = cls.from_dict(data, source)
        if site_names is not None:
            plan.check_sites(site_names)
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as YAML, atomically: a temporary file in the same folder, then ``os.replace``."""
        target = Path(path)
        text = "# numscope precision plan (see numscope.plan for the keys)\n" + yaml.safe_dump(
            self.to_dict(), sort_keys=False, default_flow_style=None, width=110, allow_unicode=True
        )
        atomic_write_text(target, text)


# -- presets --------------------------------------------------------------------------------------------


def _hybrid_fp8() -> SiteSpec:
    # Transformer Engine recipe.Format.HYBRID: "FP8 tensors in the forward pass are in e4m3 format, FP8
    # tensors in the backward pass are in e5m2 format": x and W (also where the backward GEMMs reuse
    # them) in E4M3, dy in E5M2. Float8CurrentScaling defaults to HYBRID with per-tensor current scaling.
    e4m3, e5m2 = OperandSpec("fp8_e4m3"), OperandSpec("fp8_e5m2")
    return SiteSpec(
        {
            ("fprop", "input"): e4m3,
            ("fprop", "weight"): e4m3,
            ("dgrad", "grad_output"): e5m2,
            ("dgrad", "weight"): e4m3,
            ("wgrad", "grad_output"): e5m2,
            ("wgrad", "input"): e4m3,
        }
    )


_PRESETS: dict[str, Any] = {
    "fp32": SiteSpec,
    # IEEE formats overflow to inf as the hardware does (overflow="propagate"): a loss scale that is too
    # large must show up as inf/NaN gradients so that the loss scaler backs off, not be hidden by clamping.
    "bf16": lambda: SiteSpec.uniform(OperandSpec("bf16", overflow="propagate")),
    "fp16": lambda: SiteSpec.uniform(OperandSpec("fp16", overflow="propagate")),
    "fp8": _hybrid_fp8,
    "fp8_e4m3": lambda: SiteSpec.uniform("fp8_e4m3"),
    # E4M3 for every MXFP8 operand, gradients included: Transformer Engine's MXFP8BlockScaling defaults to
    # fp8_format=Format.E4M3 ("E4M3 is used by default for both forward and backward passes. The
    # finer-grained scaling provides sufficient dynamic range without requiring the E5M2 format", TE docs,
    # features/low_precision_training/mxfp8), and torchao's MXLinear uses float8_e4m3fn for all three GEMMs.
    # The scale uses the OCP MX v1.0 floor rule; TE and Mishra et al. 2025 ("Recipes for pre-training LLMs
    # with MXFP8") round the scale up instead: use `all: mxfp8_e4m3@rceil` in a plan file for that.
    "mxfp8": lambda: SiteSpec.uniform("mxfp8_e4m3"),
    # E3M2 (the wider-range MXFP6) for every operand, as Rouhani et al. 2023 ("Microscaling data formats
    # for deep learning") train with MXFP6 weights, activations and gradients.
    "mxfp6": lambda: SiteSpec.uniform("mxfp6_e3m2"),
    "mxfp4": lambda: SiteSpec.uniform("mxfp4_e2m1"),
    # Plain NVFP4 everywhere. NVIDIA's NVFP4 training recipe (TE NVFP4BlockScaling) adds stochastic
    # rounding of gradients, a random Hadamard transform for wgrad, 16×16 weight scales and keeps some
    # layers high; examples/plans/nvfp4_stochastic_grads.yaml shows the rounding part as a plan.
    "nvfp4": lambda: SiteSpec.uniform("nvfp4"),
    "int8": lambda: SiteSpec.uniform("int8"),
}


# -- YAML shape: writing --------------------------------------------------------------------------------


def _operand_to_value(spec: OperandSpec) -> str | dict[str, Any]:
    extra: dict[str, Any] = {}
    if spec.scaling is not None:
        scaling = spec.scaling.to_dict()
        extra["scaling"] = scaling["kind"] if len(scaling) == 1 else scaling
    for name in ("rounding", "overflow", "flush_subnormals", "transform"):
        if getattr(spec, name) != _OPERAND_DEFAULTS[name]:
            extra[name] = getattr(spec, name)
    return {"format": spec.format, **extra} if extra else spec.format


def _site_to_dict(
    spec: SiteSpec, reasons: Mapping[str, str], always_accumulate: bool = False
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    values = [spec.operand(g, o) for g, o in OPERAND_KEYS]
    if all(v == values[0] for v in values):
        out["all"] = _operand_to_value(values[0])
    else:
        for gemm in GEMMS:
            out[gemm] = {o: _operand_to_value(spec.operand(gemm, o)) for o in OPERANDS[gemm]}
    if always_accumulate or spec.accumulate != "fp32":
        out["accumulate"] = spec.accumulate
    if reasons:
        out["reasons"] = dict(reasons)
    return out


# -- YAML shape: reading --------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that rejects duplicate keys instead of keeping the last one silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise PlanError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _at(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _expect_mapping(value: Any, where: str, what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise PlanError(f"{where} must be a mapping ({what}), got {_type_name(value)}")
    for key in value:
        if not isinstance(key, str):
            raise PlanError(f"{where}: keys must be strings, got {_type_name(key)} {key!r}")
    return value


def _parse_scaling(value: Any, where: str) -> Scaling:
    if isinstance(value, str):
        if value not in KINDS:
            raise PlanError(f"{where}: {_unknown('scaling kind', value, KINDS)}")
        return Scaling(value)  # type: ignore[arg-type]
    data = _expect_mapping(value, where, "a kind name or Scaling fields")
    for key in data:
        if key == "axis":
            raise PlanError(
                f"{_at(where, key)}: axis is not a plan setting (the runtime uses the GEMM's "
                "contraction axis); drop it"
            )
        if key not in _SCALING_TYPES:
            raise PlanError(f"{where}: {_unknown('scaling key', key, _SCALING_TYPES)}")
    if "kind" not in data:
        raise PlanError(f"{where}: missing key 'kind'; allowed kinds: {_names(KINDS)}")
    for key, expected in _SCALING_TYPES.items():
        if key not in data:
            continue
        item = data[key]
        accepted = (int, float) if expected is float else expected  # YAML writes 0.0 as 0 only if asked
        wrong = not isinstance(item, accepted) or (expected in (int, float) and isinstance(item, bool))
        if wrong:
            raise PlanError(f"{_at(where, key)} must be {_A_TYPE[expected]}, got {_type_name(item)}")
    if data["kind"] not in KINDS:
        raise PlanError(f"{_at(where, 'kind')}: {_unknown('scaling kind', data['kind'], KINDS)}")
    try:
        return Scaling.parse(dict(data))  # type: ignore[return-value]
    except (TypeError, ValueError) as error:
        raise PlanError(f"{where}: {error}") from None


def _parse_operand(value: Any, where: str) -> OperandSpec:
    if isinstance(value, str):
        data: Mapping[str, Any] = {"format": value}
    elif isinstance(value, Mapping):
        data = _expect_mapping(value, where, "an operand spec")
        for key in data:
            if key not in _OPERAND_FIELDS:
                raise PlanError(f"{where}: {_unknown('operand spec key', key, _OPERAND_FIELDS)}")
        if "format" not in data:
            raise PlanError(f"{where}: missing key 'format' (a format name or 'high')")
    else:
        raise PlanError(f"{where} must be a format name or a mapping with 'format', got {_type_name(value)}")
    args: dict[str, Any] = {}
    for key in _OPERAND_FIELDS:
        if key not in data:
            continue
        item = data[key]
        if key == "scaling":
            args[key] = _parse_scaling(item, _at(where, key))
            continue
        expected = bool if key == "flush_subnormals" else str
        if key == "transform" and item is None:
            continue
        if not isinstance(item, expected):
            raise PlanError(f"{_at(where, key)} must be {_A_TYPE[expected]}, got {_type_name(item)}")
        args[key] = item
    fmt_where = where if isinstance(value, str) else _at(where, "format")
    if args["format"].strip().lower() != HIGH:
        try:
            get_format(args["format"])
        except ValueError as error:
            raise PlanError(f"{fmt_where}: {error}") from None
    try:
        return OperandSpec(**args)
    except PlanError as error:
        raise PlanError(f"{where}: {error}") from None


def _is_operand_value(value: Any) -> bool:
    """A GEMM entry that is one spec for both operands (a name, or a mapping with 'format')."""
    return isinstance(value, str) or (isinstance(value, Mapping) and "format" in value)


def _parse_site(data: Mapping[str, Any], where: str, extra_keys: tuple[str, ...]) -> tuple[SiteSpec, Any]:
    site_keys = ("all", *_GROUP_KEYS, *_ROLE_KEYS, *GEMMS)
    allowed = (*extra_keys, *site_keys, "accumulate", "reasons")
    for key in data:
        if key not in allowed:
            raise PlanError(f"{where}: {_unknown('key', key, allowed)}")
    operands: dict[tuple[str, str], OperandSpec] = {}
    if "all" in data:
        spec = _parse_operand(data["all"], _at(where, "all"))
        operands.update(dict.fromkeys(OPERAND_KEYS, spec))
    for group, gemms in _GROUP_KEYS.items():
        if group in data:
            spec = _parse_operand(data[group], _at(where, group))
            operands.update({(g, o): spec for g in gemms for o in OPERANDS[g]})
    for role in _ROLE_KEYS:
        if role in data:
            spec = _parse_operand(data[role], _at(where, role))
            operands.update({(g, o): spec for g, o in OPERAND_KEYS if o == role})
    for gemm in GEMMS:
        if gemm not in data:
            continue
        gemm_where, value = _at(where, gemm), data[gemm]
        if _is_operand_value(value):
            spec = _parse_operand(value, gemm_where)
            operands.update({(gemm, o): spec for o in OPERANDS[gemm]})
            continue
        entries = _expect_mapping(value, gemm_where, f"operand -> spec, operands: {_names(OPERANDS[gemm])}")
        for operand, item in entries.items():
            if operand not in OPERANDS[gemm]:
                raise PlanError(
                    f"{gemm_where}: unknown operand {operand!r}; allowed for {gemm}: {_names(OPERANDS[gemm])}"
                )
            operands[(gemm, operand)] = _parse_operand(item, _at(gemm_where, operand))
    accumulate = data.get("accumulate", "fp32")
    if not isinstance(accumulate, str):
        raise PlanError(f"{_at(where, 'accumulate')} must be a string, got {_type_name(accumulate)}")
    if accumulate not in ACCUMULATE:
        raise PlanError(f"{_at(where, 'accumulate')}: {_unknown('accumulate', accumulate, ACCUMULATE)}")
    return SiteSpec(operands, accumulate), _parse_reasons(data.get("reasons", {}), _at(where, "reasons"))


def _parse_reasons(value: Any, where: str) -> _FrozenDict:
    reasons = _expect_mapping(value, where, "'gemm/operand' -> text")
    for key, text in reasons.items():
        try:
            _split_key(key)
        except PlanError as error:
            raise PlanError(f"{where}: {error}") from None
        if not isinstance(text, str):
            raise PlanError(f"{_at(where, key)} must be a string, got {_type_name(text)}")
    return _reasons(reasons)


def _plan_from_dict(data: Any, source: str | None) -> Plan:
    if data is None:
        raise PlanError(f"the plan is empty; a plan starts with '{VERSION_KEY}: {PLAN_VERSION}'")
    data = _expect_mapping(data, "the plan", f"top-level keys {VERSION_KEY}, default, rules")
    allowed = (VERSION_KEY, "default", "rules")
    for key in data:
        if key not in allowed:
            raise PlanError(_unknown("top-level key", key, allowed))
    if VERSION_KEY not in data:
        raise PlanError(
            f"missing version key '{VERSION_KEY}' (this numscope reads plan version {PLAN_VERSION}); "
            f"start the file with '{VERSION_KEY}: {PLAN_VERSION}'"
        )
    version = data[VERSION_KEY]
    if isinstance(version, bool) or not isinstance(version, int):
        raise PlanError(f"{VERSION_KEY} must be an int, got {_type_name(version)}")
    if version > PLAN_VERSION:
        raise PlanError(
            f"plan version {version} is newer than this numscope reads ({PLAN_VERSION}); upgrade numscope"
        )
    if version < 1:
        raise PlanError(f"unknown plan version {version}; this numscope reads version {PLAN_VERSION}")
    default, default_reasons = SiteSpec(), _FrozenDict()
    if "default" in data:
        default_data = _expect_mapping(data["default"], "default", "a site spec")
        default, default_reasons = _parse_site(default_data, "default", ())
    rules_data = data.get("rules", [])
    if rules_data is None:
        rules_data = []
    if not isinstance(rules_data, list):
        raise PlanError(f"rules must be a list of rules, got {_type_name(rules_data)}")
    rules = []
    for index, item in enumerate(rules_data):
        where = _at("rules", index)
        rule_data = _expect_mapping(item, where, "a rule with 'match'")
        if "match" not in rule_data:
            raise PlanError(f"{where}: missing key 'match' (a glob over site names)")
        pattern = rule_data["match"]
        if not isinstance(pattern, str):
            raise PlanError(f"{where}.match must be a string, got {_type_name(pattern)}")
        if not pattern:
            raise PlanError(f"{where}.match must not be empty")
        optional = rule_data.get("optional", False)
        if not isinstance(optional, bool):
            raise PlanError(f"{where}.optional must be a bool, got {_type_name(optional)}")
        spec, reasons = _parse_site(rule_data, where, ("match", "optional"))
        rules.append(Rule(pattern, spec, reasons, optional))
    return Plan(default, tuple(rules), default_reasons, source=source)


__all__ = [
    "ACCUMULATE",
    "GEMMS",
    "HIGH",
    "OPERANDS",
    "OPERAND_KEYS",
    "OperandSpec",
    "Plan",
    "PlanError",
    "PlanRow",
    "Rule",
    "SiteSpec",
    "default_scaling",
]
