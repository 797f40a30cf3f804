"""What every export shares: :class:`Export`, :class:`ExportError`, the Linear sites a target converts and
the shapes its kernels take.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from numscope._atomic import atomic_write_text
from numscope._names import layer_index
from numscope.errors import NumscopeError
from numscope.formats.spec import BlockFormat
from numscope.plan.plan import Plan
from numscope.plan.spec import OperandSpec, SiteSpec
from numscope.vocab import OPERAND_KEYS

TARGETS: tuple[str, ...] = ("torchao", "te", "megatron")


class ExportError(NumscopeError, ValueError):
    """A plan that cannot be exported as asked (no sites given, an unknown target)."""


@dataclass
class Export:
    """What an export writes: ``files`` (name → text) and the lines of what the target cannot express."""

    target: str
    files: dict[str, str]
    unexpressed: list[str] = field(default_factory=list)

    def save(self, folder: str | os.PathLike[str]) -> list[Path]:
        """Write every file into ``folder`` (created), atomically; returns their paths."""
        directory = Path(folder)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in self.files.items():
            atomic_write_text(directory / name, text)
            written.append(directory / name)
        return written


def grouped(lines: Sequence[str]) -> list[str]:
    """``where: reason`` lines with each reason said once, its places listed after it (in the order first
    met), e.g. ``only Linear layers are converted; …: a.scores (matmul), a.context (matmul)``; a line
    without a place stays as it is."""
    places: dict[str, list[str]] = {}
    for line in lines:
        where, colon, reason = line.partition(": ")
        key = reason if colon else line
        places.setdefault(key, [])
        if colon:
            places[key].append(where)
    out = []
    for reason, where in places.items():
        if not where:
            out.append(reason)
        elif len(where) == 1:
            out.append(f"{where[0]}: {reason}")
        else:
            out.append(f"{reason} ({len(where)}: {', '.join(where)})")
    return out


def _linear_sites(
    plan: Plan,
    sites: Iterable[tuple[str, str]],
    target: str | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[dict[str, SiteSpec], list[str]]:
    """The Linear sites' specs, and one line for each other quantized site (no target converts those).

    With ``shapes`` (a Linear site's weight shape, out × in features), a module the target's kernels cannot
    quantize at that shape (:func:`shape_problem`) is listed; for torchao and TE it stays in high precision
    (Megatron cannot keep one module high: the line says so; its flags cover the transformer layers only)."""
    linear, others = {}, []
    for name, kind in sites:
        spec = plan.for_site(name)
        if kind in ("linear", "conv1d"):
            shape = (shapes or {}).get(name)
            checked = target is not None and shape is not None
            if checked and (target != "megatron" or layer_index(name) is not None):
                quantized = [spec.operand(g, o) for g, o in OPERAND_KEYS if not _high(spec.operand(g, o))]
                problem = shape_problem(shape, [q.format for q in quantized], target)  # type: ignore[arg-type]
                if problem is not None:
                    kept = (
                        "Megatron cannot keep one module high: pad it, or TE leaves it unquantized"
                        if target == "megatron"
                        else "the module stays in high precision"
                    )
                    others.append(f"{name}: {problem}; {kept}")
                    if target != "megatron":
                        spec = SiteSpec()
            linear[name] = spec
        elif not all(_high(spec.operand(g, o)) for g, o in OPERAND_KEYS):
            others.append(f"{name} ({kind}): only Linear layers are converted; it stays in high precision")
    return linear, others


def shape_problem(shape: Sequence[int], formats: Sequence[str], target: str) -> str | None:
    """Why ``target``'s kernels cannot quantize a module whose weight has ``shape`` and whose quantized
    operands are in ``formats`` (``weight N x K: ... in multiples of M``); None where they can, or where
    nothing is quantized. The one shape check of export, ``recommend --target`` and the target's recipes."""
    if not formats:
        return None
    multiple, why = shape_multiple(formats, target)
    if not any(int(d) % multiple for d in shape):
        return None
    return f"weight {' x '.join(str(int(d)) for d in shape)}: {why} in multiples of {multiple}"


def shape_multiple(formats: Sequence[str], target: str) -> tuple[int, str]:
    """``(multiple, what needs it)`` for a module whose quantized operands are in ``formats`` on
    ``target`` (torchao, te, megatron): both weight dimensions (and the tokens of a batch) must be
    multiples of it."""
    specs = [OperandSpec(name).format_spec() for name in formats]
    block = any(isinstance(f, BlockFormat) for f in specs)
    if target == "torchao":
        if block:
            return (
                32,
                "torchao's MX cast needs the blocked dimension (torchao/prototype/mx_formats/mx_tensor.py)",
            )
        return 16, "torchao's float8 GEMM needs in and out features (torchao/float8/float8_linear_utils.py)"
    if any(f is not None and f.name.startswith("nvfp4") for f in specs):
        return (
            16,
            "TE's NVFP4 quantizer needs both dimensions (NVFP4Quantizer.is_quantizable, nvfp4_tensor.py)",
        )
    if block:
        return (
            32,
            "TE's MXFP8 quantizer needs both dimensions (MXFP8Quantizer.is_quantizable, mxfp8_tensor.py)",
        )
    return (
        16,
        "TE's FP8 Linear needs both dimensions (te.autocast's note, transformer_engine/pytorch/"
        "quantization.py)",
    )


#: formats a target runs in the model's own dtype (no scaling, no quantization kernel)
_WIDE = ("fp32", "tf32", "bf16", "fp16")


def _high(spec: OperandSpec) -> bool:
    """Whether a target keeps the operand in high precision: unquantized, or a plain wide IEEE cast (which
    a bf16/fp16 model computes in anyway)."""
    return spec.is_high or (spec.format in _WIDE and spec.scaling is None and spec.rounding == "nearest")


def _describe(spec: OperandSpec) -> str:
    return f"{spec.format} ({spec.describe_scaling()}, {spec.rounding})"


#: numscope's FP8 formats by the libraries' dtype names
_FP8_DTYPES = {"fp8_e4m3": "E4M3", "fp8_e5m2": "E5M2"}


def _enum_name(value: object) -> str:
    return str(getattr(value, "name", value)).upper()
