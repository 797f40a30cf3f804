"""One self-contained HTML report: tables, figures as embedded PNGs, no external assets, no scripts.

:func:`write_report` takes plain run dicts and, optionally, a :class:`numscope.Analysis` and a
:class:`numscope.Plan`. Everything the report reads from those two goes through the adapters in this
module (:func:`analysis_tables`, :func:`plan_table`), so when their internals move only the adapters change;
the figures (:mod:`numscope.report.plots`) see lists and dicts only.

Sections, each left out when its input is missing: 1 headline table of runs, 2 loss curves and loss-scale
trajectories, 3 the recommended plan per site, 4 backward-error heatmaps, 5 log2 histograms against format
ranges, 6 underflow per layer, further figures, notes, and a footer saying how the report was made.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numscope
from numscope._atomic import atomic_write_text
from numscope.report.sections import (
    _CSS,
    Note,
    _curves,
    _esc,
    _extra,
    _headline,
    _heatmap,
    _histograms,
    _note_parts,
    _notes,
    _plan_section,
    _Section,
    _setup,
    _underflow,
)
from numscope.report.views import AnalysisView, analysis_tables, plan_table


def render_report(
    *,
    title: str,
    runs: Sequence[Mapping[str, Any]],
    analysis: Any = None,
    plan: Any = None,
    plan_rows: Sequence[Mapping[str, Any]] | None = None,
    notes: Sequence[Note] = (),
    extra_images: Sequence[Any] = (),
    command: str | None = None,
    context_free_loss: float | None = None,
    setup: Mapping[str, Any] | None = None,
    plan_intro: str | None = None,
    progress: bool = False,
    loss_label: str = "MLM loss",
) -> str:
    """The report as one HTML string (see :func:`write_report` for the arguments)."""
    from numscope._progress import progress as progress_bar

    view = None
    if analysis is not None:
        view = analysis if isinstance(analysis, AnalysisView) else analysis_tables(analysis)
    if plan_rows is None and plan is not None:
        plan_rows = plan_table(plan, view.sites if view is not None else ())
    makers: list[Callable[[], _Section | None]] = [
        lambda: _headline(runs, loss_label) if runs else None,
        lambda: _notes(notes),
        lambda: _curves(runs, context_free_loss, loss_label) if runs else None,
        lambda: _plan_section(plan_rows or [], view, plan_intro),
        lambda: _underflow(view, runs),
        lambda: _heatmap(view) if view is not None else None,
        lambda: _histograms(view) if view is not None else None,
        lambda: _extra(extra_images),
        lambda: _setup(setup),
    ]
    sections = []
    for make in progress_bar(makers, desc=f"{'report':>13}", enabled=progress, unit="section"):
        sections.append(make())
    present = [section for section in sections if section is not None]
    toc = "".join(f'<li><a href="#{s.anchor}">{_esc(s.title)}</a></li>' for s in present)
    made = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    subtitle = f"{len(runs)} run{'s' if len(runs) != 1 else ''}"
    if view is not None:
        subtitle += f" · analysis of {len(view.sites)} sites × {len(view.candidates)} candidate formats"
    verdicts = [_note_parts(note)[1] for note in notes]
    checked = [held for held in verdicts if held is not None]
    callout = ""
    if checked:
        callout = (
            f'<div class="callout">{sum(checked)} of {len(checked)} claims held in this run, '
            f'{len(checked) - sum(checked)} did not: see <a href="#claims">What this run shows</a></div>'
        )
    elif notes:
        plural = "s" if len(notes) != 1 else ""
        callout = (
            f'<div class="callout">{len(notes)} note{plural}: see '
            '<a href="#claims">What this run shows</a></div>'
        )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
        f'<header><h1>{_esc(title)}</h1><p class="sub">{_esc(subtitle)} · made {made}</p>',
        f"{callout}<nav><b>Contents</b><ol>{toc}</ol></nav></header>",
        "<main>",
    ]
    for section in present:
        parts.append(
            f'<section id="{section.anchor}"><h2>{_esc(section.title)}</h2>{"".join(section.body)}</section>'
        )
    how = f"<code>{_esc(command)}</code>" if command else "the Python API"
    parts += [
        "</main>",
        f"<footer>Made by {how} with numscope {_esc(numscope.__version__)} on {made}. "
        "One self-contained file: figures are embedded PNGs, nothing is loaded from the network.</footer>",
        "</body></html>",
    ]
    return "\n".join(parts)


def write_report(
    path: str | os.PathLike[str],
    *,
    title: str,
    runs: Sequence[Mapping[str, Any]],
    analysis: Any = None,
    plan: Any = None,
    plan_rows: Sequence[Mapping[str, Any]] | None = None,
    notes: Sequence[Note] = (),
    extra_images: Sequence[Any] = (),
    command: str | None = None,
    context_free_loss: float | None = None,
    setup: Mapping[str, Any] | None = None,
    plan_intro: str | None = None,
    progress: bool = False,
    loss_label: str = "MLM loss",
) -> Path:
    """Write the HTML report to ``path`` atomically (a temporary file, then ``os.replace``) and return it.

    runs: dicts with ``name, plan, loss_scaling, val_loss`` (nats), ``val_accuracy`` (fraction 0..1),
        ``skipped_steps, wall_seconds, avg_bits`` (float or None), ``curve`` (``[{step, val_loss,
        val_accuracy}]``), ``train_log`` (``[{step, loss, scale, skipped}]``) and optionally ``underflow``
        (``[{site, before%, after%}]``). The run named ``fp32`` is the reference of the gap column.
    analysis: a :class:`numscope.Analysis` (or an :class:`AnalysisView`) for the per-site sections.
    plan: a :class:`numscope.Plan`, tabulated per site of the analysis (or per rule without one);
        ``plan_rows`` (dicts ``site, gemm, operand, format, scaling, bits, reason``) replaces that table.
    notes: sentences shown prominently, right after the runs table (what held, what did not, with
        numbers); a ``(text, held)`` pair marks a checked claim as held (True) or not (False).
    extra_images: PNG files or ``(caption, png bytes or path)`` pairs appended as further figures.
    command: the command line that made the report, for the footer.
    context_free_loss: the validation loss of a model that ignores context (e.g. token frequencies), in
        nats, drawn as a reference line under the loss curves.
    setup: ``label → description`` of how the runs were made (model, data, training…), shown last.
    plan_intro: HTML shown at the top of the plan section (e.g. how the advisor was asked and why).
    progress: show a progress bar while the sections are drawn.
    loss_label: what the runs' loss is, as the table and figures name it (``"MLM loss"``, ``"causal LM
        loss"``…).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = render_report(
        title=title,
        runs=runs,
        analysis=analysis,
        plan=plan,
        plan_rows=plan_rows,
        notes=notes,
        extra_images=extra_images,
        command=command,
        context_free_loss=context_free_loss,
        setup=setup,
        plan_intro=plan_intro,
        progress=progress,
        loss_label=loss_label,
    )
    return atomic_write_text(target, text)
