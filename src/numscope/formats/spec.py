"""Number formats as small frozen dataclasses whose range facts are derived, never stored.

Three kinds:

* :class:`FloatFormat` — sign, ``exponent_bits``, ``mantissa_bits``, a bias and one of four special-value
  conventions (``ieee``: inf and NaN in the top binade; ``fn``: OCP E4M3, no inf, only the all-ones code is
  NaN; ``finite``: no inf and no NaN (FP6, FP4); ``fnuz``: no inf, no negative zero, NaN at the −0 code).
  ``e8m0`` (the MX scale) is an unsigned exponent-only float.
* :class:`IntFormat` — symmetric two's complement integers, ±(2^(bits−1) − 1).
* :class:`BlockFormat` — an element format sharing one scale per block of consecutive elements (OCP MX,
  NVFP4).

Look formats up with :func:`get_format` and list them with :func:`formats`.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace
from typing import Literal

Special = Literal["ieee", "fn", "finite", "fnuz", "e8m0"]
ScaleRule = Literal["floor", "rceil", "ceil", "even"]
ScaleMath = Literal["multiply", "divide"]
#: the MX shared-scale rules (``floor`` is OCP MX v1.0's; see :class:`BlockFormat`)
SCALE_RULES: tuple[str, ...] = ("floor", "rceil", "ceil", "even")
#: the options a block format's name may carry after ``@``, per family, in canonical order
MX_OPTIONS: tuple[str, ...] = ("rceil", "ceil", "even", "full")
NVFP4_OPTIONS: tuple[str, ...] = ("2d", "row", "4over6", "mae", "divide", "nan")


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point element format.

    ``bias`` defaults to the IEEE bias 2^(exponent_bits−1) − 1 (fnuz formats use one more).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    special: Special = "ieee"
    bias: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.exponent_bits <= 8:
            raise ValueError(f"format {self.name!r}: exponent_bits must be in 1..8, got {self.exponent_bits}")
        if not 0 <= self.mantissa_bits <= 23:
            raise ValueError(
                f"format {self.name!r}: mantissa_bits must be in 0..23, got {self.mantissa_bits}"
            )
        if self.bias is None:
            default = 2 ** (self.exponent_bits - 1) - (0 if self.special == "fnuz" else 1)
            if self.special == "e8m0":
                default = 127
            object.__setattr__(self, "bias", default)

    # -- encoding facts ---------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return "float"

    @property
    def signed(self) -> bool:
        return self.special != "e8m0"

    @property
    def bits(self) -> int:
        """Storage bits of one element."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def bits_per_element(self) -> float:
        return float(self.bits)

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.special != "finite"

    @property
    def has_negative_zero(self) -> bool:
        return self.special not in ("fnuz", "e8m0")

    @property
    def has_subnormals(self) -> bool:
        return self.special != "e8m0" and self.mantissa_bits > 0

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite binade."""
        top = 2**self.exponent_bits - 1
        if self.special == "ieee":
            top -= 1
        if self.special == "e8m0":
            top -= 1  # 0xFF is NaN
        return top - int(self.bias)  # type: ignore[arg-type]

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        if self.special == "e8m0":
            return -int(self.bias)  # type: ignore[arg-type]
        return 1 - int(self.bias)  # type: ignore[arg-type]

    # -- range facts ------------------------------------------------------------------------------
    @property
    def max(self) -> float:
        """Largest finite value."""
        fraction = 2.0 - 2.0 ** (-self.mantissa_bits)
        if self.special == "fn":
            fraction = 2.0 - 2.0 ** (1 - self.mantissa_bits)  # all-ones mantissa at emax is NaN
        if self.special == "e8m0":
            fraction = 1.0
        return math.ldexp(fraction, self.emax)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (equal to ``min_normal`` where there are no subnormals)."""
        if not self.has_subnormals:
            return self.min_normal
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def binades(self) -> float:
        """Dynamic range in binades: log2(max / min_subnormal)."""
        return math.log2(self.max / self.min_subnormal)

    @property
    def ulp_at_max(self) -> float:
        return math.ldexp(1.0, self.emax - self.mantissa_bits)

    @property
    def overflow_threshold(self) -> float:
        """The midpoint between ``max`` and the next grid point: nearest rounding overflows above it."""
        return self.max + 0.5 * self.ulp_at_max

    @property
    def max_mantissa_is_odd(self) -> bool:
        """Whether a tie at :attr:`overflow_threshold` rounds away from ``max`` (ties go to even)."""
        if self.mantissa_bits == 0:
            return self.emax % 2 == 1 if self.special == "e8m0" else True
        return self.special != "fn"


@dataclass(frozen=True)
class IntFormat:
    """A two's complement integer format, optionally times 2^−fraction_bits.

    Symmetric by default: codes ±(2^(bits−1) − 1), the most negative code unused (as OCP MX's MXINT8 and
    most int8 training kernels do). ``full_range=True`` also uses it: −2^(bits−1) (MXINT8's −2.0).
    """

    name: str
    int_bits: int
    fraction_bits: int = 0
    description: str = ""
    full_range: bool = False

    @property
    def kind(self) -> str:
        return "int"

    @property
    def bits(self) -> int:
        return self.int_bits

    @property
    def bits_per_element(self) -> float:
        return float(self.int_bits)

    @property
    def has_inf(self) -> bool:
        return False

    @property
    def has_nan(self) -> bool:
        return False

    @property
    def max_code(self) -> int:
        return 2 ** (self.int_bits - 1) - 1

    @property
    def min_code(self) -> int:
        """The most negative code used: −max_code, or −2^(bits−1) with ``full_range``."""
        return -self.max_code - int(self.full_range)

    @property
    def max(self) -> float:
        return math.ldexp(float(self.max_code), -self.fraction_bits)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, -self.fraction_bits)

    @property
    def min_subnormal(self) -> float:
        return self.min_normal

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two not above ``max`` (the MX ``emax_elem``)."""
        return math.floor(math.log2(self.max))

    @property
    def binades(self) -> float:
        return math.log2(self.max / self.min_subnormal)


ElementFormat = FloatFormat | IntFormat


@dataclass(frozen=True)
class BlockFormat:
    """Elements that share one scale per ``block_size`` consecutive values along an axis.

    OCP MX v1.0: 32 elements, an E8M0 scale X = 2^(e − emax_elem) with e = floor(log2 amax)
    (``scale_rule="floor"``, the spec's); ``"ceil"``: e = ceil(log2 amax); ``"even"``: e = floor(log2 of
    amax rounded, half up, to the element's mantissa bits) (torchao's EVEN: the scale steps up where amax
    passes the midpoint above the element's largest value); ``"rceil"``: X = 2^ceil(log2(amax / max_elem))
    (the round-up rule of Transformer Engine and NVIDIA's kernels). Elements are cast with saturation.

    NVFP4 (``tensor_scale=True``): 16 E2M1 elements, an E4M3 block scale and an FP32 per-tensor scale S
    (per row with ``row_scale``). ``scale_math="multiply"`` (the default) computes as Transformer
    Engine's NVFP4 quantizer: s_b = e4m3(amax_b · (S · (1/6))), elements e2m1(v · (1 / (s_b · (1/S))));
    ``"divide"`` as the formula is written: s_b = e4m3(amax_b / 6 · S), elements e2m1(v / (s_b / S)). The
    two differ in the last float32 bit of the scale, which moves a block scale across an E4M3 rounding
    tie now and then (1 in ~4M random blocks). ``block_rows=16``: 2-D blocks of 16 × 16 (NVFP4's weight
    recipe: the same scale serves a weight and its transpose). ``four_over_six``: each block maps its amax
    to 6 or to 4, whichever reconstructs the block with the smaller squared error ("Four Over Six", Cook
    et al. 2025); S then maps the tensor's amax to 256 · 6, so a block scaled to 4 keeps its E4M3 scale
    (≤ 256 · 1.5 = 384) within E4M3's 448. ``four_over_six_mae`` (``@4over6@mae``): Four Over Six as
    Transformer Engine computes it (``nvfp4_4over6``, its default error mode MAE): the map-to-4 scale is 1.5
    times the map-to-6 one, e4m3((amax_b / 6) · S), and each candidate's error the float32 sum, element by
    element, of its absolute errors (a 2-D tile sums its rows in TE's tree order). ``nan_scale`` (``@nan``):
    a NaN anywhere in the tensor makes the tensor scale NaN, so every element decodes to NaN, as Transformer
    Engine's NVFP4 quantizer does; by default a non-finite tensor amax gives the tensor scale 1 and only the
    NaN's block is NaN.
    """

    name: str
    element: ElementFormat
    block_size: int
    scale_format: FloatFormat
    scale_rule: ScaleRule = "floor"
    tensor_scale: bool = False
    description: str = ""
    scale_math: ScaleMath = "multiply"
    block_rows: int = 1
    row_scale: bool = False
    four_over_six: bool = False
    four_over_six_mae: bool = False
    nan_scale: bool = False

    @property
    def kind(self) -> str:
        return "block"

    @property
    def bits(self) -> int:
        return self.element.bits

    @property
    def bits_per_element(self) -> float:
        """Element bits plus the block scale's share (the per-tensor FP32 scale is negligible)."""
        return self.element.bits + self.scale_format.bits / (self.block_size * self.block_rows)

    @property
    def options(self) -> tuple[str, ...]:
        """The ``@`` options this format differs from its family's default by, in canonical order."""
        chosen = {
            "rceil": self.scale_rule == "rceil",
            "ceil": self.scale_rule == "ceil",
            "even": self.scale_rule == "even",
            "full": isinstance(self.element, IntFormat) and self.element.full_range,
            "2d": self.block_rows > 1,
            "row": self.row_scale,
            "4over6": self.four_over_six,
            "mae": self.four_over_six_mae,
            "divide": self.scale_math == "divide",
            "nan": self.nan_scale,
        }
        family = NVFP4_OPTIONS if self.tensor_scale else MX_OPTIONS
        return tuple(option for option in family if chosen[option])

    @property
    def has_inf(self) -> bool:
        return False

    @property
    def has_nan(self) -> bool:
        return self.scale_format.has_nan

    @property
    def max(self) -> float:
        """Largest finite value reachable through the block scale."""
        return self.element.max * self.scale_format.max

    @property
    def min_normal(self) -> float:
        return self.element.min_normal * self.scale_format.min_subnormal

    @property
    def min_subnormal(self) -> float:
        return self.element.min_subnormal * self.scale_format.min_subnormal

    @property
    def binades(self) -> float:
        return math.log2(self.max / self.min_subnormal)

    @property
    def block_binades(self) -> float:
        """Dynamic range within one block (the element format's), in binades."""
        return self.element.binades

    def with_scale_rule(self, rule: ScaleRule) -> BlockFormat:
        """This MX format with another shared-scale rule (see the class docstring)."""
        if rule not in SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {', '.join(map(repr, SCALE_RULES))}, got {rule!r}")
        kept = [option for option in self.options if option not in SCALE_RULES]
        return self.with_options(*kept, *([rule] if rule != "floor" else []))

    def with_options(self, *options: str) -> BlockFormat:
        """The family's default format (this one without options) with ``options`` (names after ``@``)."""
        family = NVFP4_OPTIONS if self.tensor_scale else MX_OPTIONS
        base = self.name.split("@")[0]
        for option in options:
            if option not in family:
                kind = "NVFP4" if self.tensor_scale else "MX"
                raise ValueError(
                    f"format {base!r}: unknown option {option!r}; "
                    f"the {kind} formats take: {', '.join(family)}"
                )
        chosen = set(options)
        rules = chosen & set(SCALE_RULES)
        if len(rules) > 1:
            raise ValueError(f"format {base!r}: one scale rule at most, got {', '.join(sorted(rules))}")
        if {"2d", "row"} <= chosen:
            raise ValueError(f"format {base!r}: '2d' blocks and a per-row scale ('row') exclude each other")
        if "mae" in chosen and ("4over6" not in chosen or chosen & {"row", "divide"}):
            raise ValueError(
                f"format {base!r}: 'mae' is Transformer Engine's Four Over Six: it takes '4over6' and "
                "neither 'row' nor 'divide' (TE's arithmetic)"
            )
        element = self.element
        if isinstance(element, IntFormat):
            element = replace(element, full_range="full" in chosen)
        elif "full" in chosen:
            raise ValueError(f"format {base!r}: option 'full' applies only to integer elements (mxint8)")
        ordered = [option for option in family if option in chosen]
        return replace(
            self,
            name="@".join([base, *ordered]),
            element=element,
            scale_rule=next(iter(rules), "floor"),  # type: ignore[arg-type]
            scale_math="divide" if "divide" in chosen else "multiply",
            block_rows=16 if "2d" in chosen else 1,
            row_scale="row" in chosen,
            four_over_six="4over6" in chosen,
            four_over_six_mae="mae" in chosen,
            nan_scale="nan" in chosen,
        )


Format = FloatFormat | IntFormat | BlockFormat


def _float(name: str, e: int, m: int, special: Special = "ieee", description: str = "") -> FloatFormat:
    return FloatFormat(name, e, m, special, description=description)


_E8M0 = _float("e8m0", 8, 0, "e8m0", "OCP MX shared scale: unsigned power of two 2^-127..2^127, 0xFF NaN")
_E4M3 = _float("fp8_e4m3", 4, 3, "fn", "OCP FP8 E4M3FN: no inf, NaN S.1111.111, max 448")
_E5M2 = _float("fp8_e5m2", 5, 2, "ieee", "OCP FP8 E5M2: IEEE-like with inf and NaN, max 57344")
_E3M2 = _float("fp6_e3m2", 3, 2, "finite", "OCP FP6 E3M2: no inf, no NaN, max 28")
_E2M3 = _float("fp6_e2m3", 2, 3, "finite", "OCP FP6 E2M3: no inf, no NaN, max 7.5")
_E2M1 = _float("fp4_e2m1", 2, 1, "finite", "OCP FP4 E2M1: no inf, no NaN, max 6")
_INT8 = IntFormat("int8", 8, description="symmetric int8, ±127")
_MXINT8_ELEMENT = IntFormat("int8_s6", 8, 6, "MXINT8 element: int8 with implicit scale 2^-6, ±127/64")

_REGISTRY: dict[str, Format] = {
    f.name: f
    for f in (
        _float("fp32", 8, 23, description="IEEE binary32"),
        _float("tf32", 8, 10, description="NVIDIA TensorFloat-32: fp32 range, 10 mantissa bits"),
        _float("bf16", 8, 7, description="bfloat16: fp32 range, 7 mantissa bits"),
        _float("fp16", 5, 10, description="IEEE binary16"),
        _E4M3,
        _E5M2,
        _float("fp8_e4m3fnuz", 4, 3, "fnuz", "E4M3FNUZ (AMD/Graphcore): bias 8, no inf, no -0, max 240"),
        _float("fp8_e5m2fnuz", 5, 2, "fnuz", "E5M2FNUZ (AMD/Graphcore): bias 16, no inf, no -0, max 57344"),
        _E3M2,
        _E2M3,
        _E2M1,
        _E8M0,
        _INT8,
        IntFormat("int4", 4, description="symmetric int4, ±7"),
        BlockFormat("mxfp8_e4m3", _E4M3, 32, _E8M0, description="OCP MXFP8: 32 × E4M3, E8M0 scale"),
        BlockFormat("mxfp8_e5m2", _E5M2, 32, _E8M0, description="OCP MXFP8: 32 × E5M2, E8M0 scale"),
        BlockFormat("mxfp6_e3m2", _E3M2, 32, _E8M0, description="OCP MXFP6: 32 × E3M2, E8M0 scale"),
        BlockFormat("mxfp6_e2m3", _E2M3, 32, _E8M0, description="OCP MXFP6: 32 × E2M3, E8M0 scale"),
        BlockFormat("mxfp4_e2m1", _E2M1, 32, _E8M0, description="OCP MXFP4: 32 × E2M1, E8M0 scale"),
        BlockFormat(
            "mxint8", _MXINT8_ELEMENT, 32, _E8M0, description="OCP MXINT8: 32 × int8·2^-6, E8M0 scale"
        ),
        BlockFormat(
            "nvfp4",
            _E2M1,
            16,
            _E4M3,
            tensor_scale=True,
            description="NVIDIA NVFP4: 16 × E2M1, E4M3 block scale, FP32 tensor scale",
        ),
    )
}

_ALIASES = {
    "float32": "fp32",
    "fp32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
    "e8m0fnu": "e8m0",
    "float8_e8m0fnu": "e8m0",
    "mxfp8": "mxfp8_e4m3",
    "mxfp6": "mxfp6_e3m2",
    "mxfp4": "mxfp4_e2m1",
}

_GENERIC = re.compile(r"^e(\d)m(\d{1,2})$")


def get_format(name: str | Format) -> Format:
    """Return the format called ``name`` (a format object is returned unchanged).

    Besides the registered names (see :func:`formats`), ``eXmY`` names an IEEE-like float with X exponent
    bits (2–8), Y mantissa bits (0–23), inf and NaN. A block format may carry options after ``@`` (see
    :class:`BlockFormat`): the MX formats a scale rule (``mxfp8_e4m3@rceil``, ``@ceil``, ``@even``) and
    MXINT8 ``@full`` (the −2.0 code); NVFP4 ``@2d`` (16 × 16 blocks), ``@row`` (a per-row FP32 scale),
    ``@4over6`` (with ``@mae``: as Transformer Engine computes it), ``@divide`` (the scale arithmetic as
    written instead of Transformer Engine's) and ``@nan`` (a NaN makes the whole tensor NaN, as TE), several
    at once in any order (``nvfp4@4over6@2d``; the name is kept in canonical order).
    """
    if isinstance(name, FloatFormat | IntFormat | BlockFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a format is named by a string, got {type(name).__name__}: {name!r}")
    key = name.strip().lower()
    base, *options = key.split("@")
    base = _ALIASES.get(base, base)
    found = _REGISTRY.get(base)
    if found is None:
        generic = _GENERIC.match(base)
        if generic:
            e, m = int(generic.group(1)), int(generic.group(2))
            if not (2 <= e <= 8 and 0 <= m <= 23):
                raise ValueError(
                    f"generic format {name!r}: exponent bits must be 2..8 and mantissa bits 0..23"
                )
            found = FloatFormat(base, e, m, "ieee", description=f"IEEE-like E{e}M{m} with inf and NaN")
    if found is None:
        known = sorted(_REGISTRY)
        names = sorted(set(known) | set(_ALIASES))
        # an alias stands for its format: each format is suggested once, by its own name
        matches = difflib.get_close_matches(base, names, n=3, cutoff=0.5)
        close = list(dict.fromkeys(_ALIASES.get(match, match) for match in matches))
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise ValueError(f"unknown format {name!r}; {hint}known: {', '.join(known)}, or eXmY (e.g. 'e3m4')")
    if options:
        if not isinstance(found, BlockFormat):
            raise ValueError(
                f"format {name!r}: options ('@{'@'.join(options)}') apply only to the block formats "
                "(MX: rceil, ceil, even, full; NVFP4: 2d, row, 4over6, mae, divide, nan)"
            )
        if not found.tensor_scale:  # '@floor' names the MX default rule
            options = [option for option in options if option != "floor"]
        found = found.with_options(*options)
    return found


def formats() -> list[Format]:
    """Every registered format, element formats first."""
    return list(_REGISTRY.values())


format = get_format
"""``numscope.format``: the name :func:`get_format` had first, kept for code that uses it (it shadows the
builtin ``format`` where imported, so numscope itself says ``get_format``; ``from numscope import *`` leaves
it out)."""
