"""``numscope formats`` and ``numscope recipes``: what numscope knows, as tables."""

from __future__ import annotations

import argparse

from numscope.cli.common import CLIError, _number, render_table
from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat, formats


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


def _cmd_formats(args: argparse.Namespace) -> int:
    print(render_table(formats_table()))
    print(
        "\nbits: per element, block-scale overhead included. Block formats: max/min through the block scale; "
        "within one block the element's range applies.\nAny eXmY (e.g. e3m4) is also accepted: IEEE-like, "
        "with inf and NaN."
    )
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from numscope.plan.recipes import recipes

    found = recipes()
    if args.name is not None:
        found = [recipe for recipe in found if recipe.name == args.name]
        if not found:
            from numscope.plan import Plan

            raise CLIError(f"unknown recipe {args.name!r}; known: {', '.join(Plan.recipes())}")
    rows = [{"recipe": r.name, "what": r.summary, "source": r.source} for r in found]
    print(render_table(rows))
    if args.name is not None:
        from numscope.plan import Plan

        recipe = found[0]
        print(f"\nemulated: {recipe.notes}")
        if recipe.code:
            print(f"code: {recipe.code}")
        print()
        print(render_table([row._asdict() for row in Plan.recipe(recipe.name).describe()]))
    else:
        print(
            "\nTrain under one with 'numscope train --plan NAME'; 'numscope recipes NAME' shows its plan and "
            "what numscope emulates of it."
        )
    return 0
