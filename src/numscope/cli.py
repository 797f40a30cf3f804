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


def _cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from numscope.demo.corpus import CorpusError, CorpusNotFoundError
    from numscope.demo.main import DemoConfig, quick_config, run_demo, summary_table

    config = quick_config(args.steps) if args.quick else DemoConfig()
    if args.steps and not args.quick:
        from dataclasses import replace

        config = replace(config, train=replace(config.train, steps=args.steps))
    out = Path(args.out or ("runs/demo-quick" if args.quick else "runs/demo"))
    for path in args.text or ():
        if not Path(path).is_file():
            raise CLIError(f"--text {path}: no such file")
    try:
        summary = run_demo(out, config, text_paths=[Path(p) for p in args.text] if args.text else None)
    except (CorpusNotFoundError, CorpusError) as error:
        raise CLIError(str(error)) from error
    print()
    print(render_table(summary_table(summary)))
    print(f"\nreport: {summary['report']}")
    return 0


def _register_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="BERT masked LM end to end: fp32, bf16, fp16 (±loss scaling), fp8, mxfp4, "
        "and numscope's recommended plan, with report.html",
    )
    p.add_argument("--quick", action="store_true", help="the same stages with fewer steps (about 2 minutes)")
    p.add_argument("--out", help="output folder (default runs/demo or runs/demo-quick); reruns resume there")
    p.add_argument("--steps", type=int, help="training steps per run (default 300, quick 40)")
    p.add_argument(
        "--text", nargs="+", metavar="PATH", help="your own text files instead of the Wikipedia corpus"
    )
    p.set_defaults(func=_cmd_demo)


_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_register_demo]


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
