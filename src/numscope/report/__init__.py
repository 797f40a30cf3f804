"""The numscope report: one self-contained HTML file (embedded PNGs, no network, no scripts).

``write_report(path, title=..., runs=[...], analysis=..., plan=..., notes=[...])`` writes it; see
:func:`numscope.report.html.write_report` for the inputs and :mod:`numscope.report.plots` for the figures.
"""

from numscope.report.html import (
    AnalysisView,
    OperandView,
    analysis_tables,
    gap_to_reference,
    plan_table,
    render_report,
    write_report,
)

__all__ = [
    "AnalysisView",
    "OperandView",
    "analysis_tables",
    "gap_to_reference",
    "plan_table",
    "render_report",
    "write_report",
]
