"""The numscope report: one self-contained HTML file (embedded PNGs, no network, no scripts).

``write_report(path, title=..., runs=[...], analysis=..., plan=..., notes=[...])`` writes it; see
:func:`numscope.report.html.write_report` for the inputs. ``views`` turns analyses and plans into the data the
report shows, ``sections`` renders each section, ``plots`` draws the figures.
"""

from numscope.report.html import render_report, write_report
from numscope.report.views import AnalysisView, OperandView, analysis_tables, gap_to_reference, plan_table

__all__ = [
    "AnalysisView",
    "OperandView",
    "analysis_tables",
    "gap_to_reference",
    "plan_table",
    "render_report",
    "write_report",
]
