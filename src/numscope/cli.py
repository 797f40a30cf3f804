"""``numscope`` on the command line: a thin face over the Python API."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence

from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat, formats


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def _number(value: float) -> str:
    if value == 0 or math.isinf(value):
        return str(value)
    exponent = math.log2(value)
    if exponent == int(exponent) and abs(exponent) > 12:
        return f"2^{int(exponent)}"
    return f"{value:.6g}"


def formats_table() -> list[dict[str, str]]:
    """One row per registered format: the facts ``numscope formats`` prints."""
    rows = []
    for fmt in formats():
        rows.append(
            {
                "format": fmt.name,
                "kind": _kind(fmt),
                "bits": f"{fmt.bits_per_element:g}",
                "max": _number(fmt.max),
                "min normal": _number(fmt.min_normal),
                "min subnormal": _number(fmt.min_subnormal),
                "binades": f"{fmt.binades:.1f}",
                "inf": "yes" if fmt.has_inf else "no",
                "NaN": "yes" if fmt.has_nan else "no",
            }
        )
    return rows


def _kind(fmt: Format) -> str:
    if isinstance(fmt, BlockFormat):
        scale = "+fp32" if fmt.tensor_scale else ""
        return f"block {fmt.block_size}×{fmt.element.name}, {fmt.scale_format.name}{scale} scale"
    if isinstance(fmt, IntFormat):
        return "int"
    assert isinstance(fmt, FloatFormat)
    return f"float e{fmt.exponent_bits}m{fmt.mantissa_bits} ({fmt.special})"


def render_table(rows: Sequence[dict[str, str]]) -> str:
    """A plain fixed-width text table (Markdown-compatible pipes)."""
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["| " + " | ".join(c.ljust(widths[c]) for c in columns) + " |"]
    lines.append("|" + "|".join("-" * (widths[c] + 2) for c in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(str(row[c]).ljust(widths[c]) for c in columns) + " |")
    return "\n".join(lines)


def _cmd_formats(args: argparse.Namespace) -> int:
    print(render_table(formats_table()))
    print(
        "\nbits: per element, block-scale overhead included. Block formats: max/min through the block scale; "
        "within one block the element's range applies.\nAny eXmY (e.g. e3m4) is also accepted: IEEE-like, "
        "with inf and NaN."
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="numscope",
        description="Measured, not guessed: exact low-precision formats and per-GEMM precision plans.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("formats", help="print every number format with its range facts")
    p.set_defaults(func=_cmd_formats)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as error:
        print(f"numscope {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"numscope {args.command}: interrupted; finished work is kept on disk", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
