"""The words numscope's code, plan files, analyses and reports share, defined once.

A *gemm* is one of the three GEMMs of a linear layer (fprop y = x·Wᵀ, dgrad dx = dy·W, wgrad dW = dyᵀ·x);
an *operand* is a tensor entering one (``input``, ``weight``, ``grad_output``); a *metric* is a what-if
statistic the observer records per operand and candidate format. The enums are ``str`` enums, equal to
their values, so files and plain-string callers keep working; the tuples hold plain strings, in the
canonical order used for files and tables.
"""

from __future__ import annotations

from enum import StrEnum as _StrEnum  # members are their string values, printed and formatted as them

import yaml as _yaml


class _Word(_StrEnum):
    """A word of the vocabulary: equal to, printed, formatted and repr'd as its string value (a message or
    a key in a message reads ``'wgrad'``, never ``<Gemm.WGRAD: 'wgrad'>``)."""

    def __repr__(self) -> str:
        return repr(self.value)


class Gemm(_Word):
    """The three GEMMs of a linear layer."""

    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


class Operand(_Word):
    """The tensors that enter a GEMM."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


class Metric(_Word):
    """Per-operand, per-candidate statistics as the observer records them (units in the name)."""

    SQNR = "sqnr_db"  # signal-to-quantization-noise ratio, dB
    UNDERFLOW = "underflow%"  # nonzeros that become 0, %
    OVERFLOW = "overflow%"  # elements that saturate or become inf, %
    MSE = "mse"  # mean squared quantization error
    BE_RATIO = "be_ratio"  # backward error relative to a reference format's (advisor)


class Rounding(_Word):
    """How a value between two codes of a format is rounded: to the nearest code, ties to even
    (``nearest``) or away from zero (``nearest_away``); up or down with probabilities given by its distance
    to each (``stochastic``); toward zero (``zero``)."""

    NEAREST = "nearest"
    NEAREST_AWAY = "nearest_away"
    STOCHASTIC = "stochastic"
    ZERO = "zero"


class Overflow(_Word):
    """What a value beyond a format's largest finite magnitude becomes: that magnitude (``saturate``), or
    inf, NaN where the format has none (``propagate``)."""

    SATURATE = "saturate"
    PROPAGATE = "propagate"


class ScalingKind(_Word):
    """Where a cast's scale comes from: none; one per tensor from its current amax (``tensor``) or from an
    amax history (``delayed``); one per row or column; one per block (a block format's own, or tiles of an
    element format)."""

    NONE = "none"
    TENSOR = "tensor"
    DELAYED = "delayed"
    ROW = "row"
    COLUMN = "column"
    BLOCK = "block"


# written to plan files and JSON as their plain string values
for _enum in (Gemm, Operand, Metric, Rounding, Overflow, ScalingKind):
    _yaml.SafeDumper.add_representer(_enum, lambda dumper, value: dumper.represent_str(value.value))

GEMMS: tuple[str, ...] = tuple(gemm.value for gemm in Gemm)
OPERAND_NAMES: tuple[str, ...] = tuple(operand.value for operand in Operand)
#: the two operands of each GEMM, left (the one contracted along its last axis in fprop/dgrad) first
OPERANDS: dict[str, tuple[str, str]] = {
    Gemm.FPROP.value: (Operand.INPUT.value, Operand.WEIGHT.value),
    Gemm.DGRAD.value: (Operand.GRAD_OUTPUT.value, Operand.WEIGHT.value),
    Gemm.WGRAD.value: (Operand.GRAD_OUTPUT.value, Operand.INPUT.value),
}
#: the operands whose contraction axis is their first, as numscope hands them to handlers (the others, the
#: fprop operands and dgrad's grad_output, contract along their last)
CONTRACTION_FIRST: frozenset[tuple[str, str]] = frozenset(
    {(Gemm.DGRAD.value, Operand.WEIGHT.value), (Gemm.WGRAD.value, Operand.GRAD_OUTPUT.value),
     (Gemm.WGRAD.value, Operand.INPUT.value)}
)  # fmt: skip
#: every (gemm, operand) pair, in the canonical order used for files and tables
OPERAND_KEYS: tuple[tuple[str, str], ...] = tuple((g, o) for g in GEMMS for o in OPERANDS[g])
