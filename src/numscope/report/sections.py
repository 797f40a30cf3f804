"""The report's sections as HTML: the headline table, loss curves, the plan, heatmap, histograms, fp16
underflow, notes and set-up."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numscope.report import plots
from numscope.report.plots import Histogram
from numscope.report.views import (
    OVERFLOW,
    REFERENCE_RUN,
    SQNR,
    UNDERFLOW,
    UNDERFLOW_FORMAT,
    WITHIN_PERCENT,
    AnalysisView,
    OperandView,
    fmt_loss,
    fmt_number,
    fmt_percent,
    fmt_seconds,
    gap_to_reference,
    operand_ranges,
    short_site_names,
)
from numscope.vocab import OPERAND_KEYS, Gemm, Operand

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#1d2430;
 max-width:1180px;margin:0 auto;padding:24px 28px 60px;background:#fbfbfa}
h1{font-size:26px;margin:0 0 4px}
h2{font-size:19px;margin:38px 0 8px;padding-top:8px;border-top:1px solid #e2e2e0}
h3{font-size:15px;margin:22px 0 6px}.sub{color:#5b6472;margin:0 0 10px}
nav{background:#fff;border:1px solid #e2e2e0;border-radius:8px;padding:10px 18px;margin-top:12px;
 width:fit-content}
nav ol{margin:4px 0;padding-left:20px}
nav a{color:#2a5db0;text-decoration:none}nav a:hover{text-decoration:underline}
table{border-collapse:collapse;margin:8px 0 4px;background:#fff;font-size:13px}
th,td{border:1px solid #e1e1df;padding:4px 9px;text-align:left;vertical-align:top}
th{background:#f1f2f4;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.good td{background:#e7f6ea}tr.ref td{background:#eef1f7;font-weight:600}tr.bad td.gap{color:#b3261e}
td.site{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.fmt{display:inline-block;padding:0 6px;border-radius:4px;font-family:ui-monospace,Menlo,monospace;
 font-size:12px}
figure{margin:12px 0 18px}figure img{max-width:100%;height:auto;border:1px solid #e6e6e4;background:#fff}
figcaption{color:#4a5361;font-size:13px;margin-top:4px;max-width:980px}
.legend{color:#4a5361;font-size:13px}.note{background:#fff8e1;border-left:4px solid #f0b400;padding:8px 12px;
 margin:8px 0;border-radius:0 6px 6px 0}
.note.held{background:#eaf6ec;border-left-color:#2e9a4a}.note.not-held{background:#fdecea;
 border-left-color:#c62828}.badge{display:inline-block;font-size:11px;font-weight:600;text-transform:uppercase;
 letter-spacing:.04em;padding:0 6px;margin-right:8px;border-radius:3px;background:#fff;color:#444}
.held .badge{color:#1e7a36}.not-held .badge{color:#b3261e}
.callout{background:#fff8e1;border:1px solid #f3d27a;border-radius:6px;
 padding:6px 12px;margin:12px 0 0;width:fit-content}
tr.first td{border-top:2px solid #c9ccd2}
table.matrix td{text-align:center}table.matrix td.site{text-align:left}
details{margin:8px 0}summary{cursor:pointer;color:#2a5db0}
footer{margin-top:46px;padding-top:10px;border-top:1px solid #e2e2e0;color:#5b6472;font-size:12.5px}
"""


@dataclass
class _Section:
    anchor: str
    title: str
    body: list[str]


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}">'


def _figure(png: bytes | None, alt: str, caption: str) -> str:
    if png is None:
        return ""
    return f"<figure>{_img(png, alt)}<figcaption>{caption}</figcaption></figure>"


def _table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    classes: Sequence[str] | None = None,
    numeric: Sequence[bool] | None = None,
    row_classes: Sequence[str] | None = None,
) -> str:
    """Cells are HTML already (escape before passing)."""
    numeric = numeric or [False] * len(headers)
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = []
    for index, row in enumerate(rows):
        cls = f' class="{row_classes[index]}"' if row_classes and row_classes[index] else ""
        cells = []
        for col, cell in enumerate(row):
            names = [n for n in ("num" if numeric[col] else "", classes[col] if classes else "") if n]
            attr = f' class="{" ".join(names)}"' if names else ""
            cells.append(f"<td{attr}>{cell}</td>")
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _headline(runs: Sequence[Mapping[str, Any]], loss_label: str = "MLM loss") -> _Section:
    reference = next((r for r in runs if r["name"] == REFERENCE_RUN), None)
    ref_loss = float(reference["val_loss"]) if reference is not None else None
    rows, row_classes = [], []
    for run in runs:
        val_loss = float(run.get("val_loss", math.nan))
        gap = gap_to_reference(val_loss, ref_loss)
        if run["name"] == REFERENCE_RUN:
            row_classes.append("ref")
        elif gap is not None and gap <= WITHIN_PERCENT:
            row_classes.append("good")
        else:
            row_classes.append("bad" if gap is not None else "")
        accuracy = run.get("val_accuracy")
        rows.append(
            [
                f"<b>{_esc(run['name'])}</b>",
                _esc(_plan_label(str(run.get("plan", "")))),
                _esc(run.get("loss_scaling", "none")),
                fmt_loss(val_loss),
                fmt_percent(100 * float(accuracy)) if accuracy is not None else "—",
                "reference" if run["name"] == REFERENCE_RUN else fmt_percent(gap, signed=True),
                fmt_number(run.get("avg_bits")),
                fmt_number(int(run.get("skipped_steps", 0))),
                fmt_seconds(run.get("wall_seconds")),
            ]
        )
    headers = [
        "run",
        "plan",
        "loss scaling",
        f"val {loss_label} (nats)",
        "val accuracy",
        "gap to FP32",
        "avg bits / GEMM operand",
        "skipped steps",
        "wall time",
    ]
    numeric = [False, False, False, True, True, True, True, True, True]
    classes = ["", "", "", "", "", "gap", "", "", ""]
    body = [_table(headers, rows, classes, numeric, row_classes)]
    if reference is None:
        body.append('<p class="legend">No run is named <code>fp32</code>, so no gap to FP32 is shown.</p>')
    else:
        body.append(
            '<p class="legend">Gap to FP32 = (val loss − FP32 val loss) / FP32 val loss; green rows are '
            f"within {WITHIN_PERCENT:g}% of the FP32 run ({fmt_loss(ref_loss)} nats). Average bits are "
            "storage bits per GEMM operand element, weighted by operand size, block scales included "
            "(— where not known)."
            "</p>"
        )
    return _Section("runs", "Runs", body)


def _plan_label(plan: str) -> str:
    """A preset name as is; a plan file by its file name (the folder is the report's own)."""
    return Path(plan).name if plan.endswith((".yaml", ".yml")) else plan


def _curves(
    runs: Sequence[Mapping[str, Any]], context_free_loss: float | None = None, loss_label: str = "MLM loss"
) -> _Section | None:
    reference = ""
    if context_free_loss is not None:
        reference = (
            f" The dashed line ({fmt_loss(context_free_loss)} nats) is the loss of a model that ignores "
            "context and predicts the training set's token frequencies: a run below it has learned "
            "from context."
        )
    body = [
        _figure(
            plots.loss_curves(runs, context_free_loss=context_free_loss, loss_label=loss_label),
            "training and validation loss",
            f"Left: training {loss_label} per step, smoothed with an exponential moving average. "
            f"Middle: validation {loss_label} at each evaluation. Right: each run's validation loss relative "
            "to FP32's at the same step, in percent (green: within ±1%; a logarithmic scale beyond ±2%). "
            "Every run starts from the same seed and sees the same batches, except a run named NAME-seedN: "
            "the same run from seed N (dashed or dotted, in NAME's colour), compared with fp32-seedN where "
            f"there is one.{reference}",
        ),
        _loss_scales(runs),
    ]
    body = [part for part in body if part]
    return _Section("curves", "Loss curves", body) if body else None


def _loss_scales(runs: Sequence[Mapping[str, Any]]) -> str:
    """The loss-scale trajectories as a figure, or one sentence per run when a scale never moved."""
    scaled = [run for run in runs if run.get("loss_scaling", "none") not in ("none", None, "")]
    logged = [run for run in scaled if run.get("train_log")]
    if not logged:
        return ""
    steady = []
    for run in logged:
        scales = {float(row["scale"]) for row in run["train_log"]}
        if len(scales) == 1:
            (scale,) = scales
            power = math.log2(scale) if scale > 0 else math.nan
            value = f"2<sup>{power:g}</sup>" if power.is_integer() else fmt_number(scale)
            why = (
                "static loss scaling keeps it there"
                if run["loss_scaling"] == "static"
                else "no gradient overflowed (no step was skipped), and the run had fewer clean steps than "
                "the scaler's growth interval"
            )
            steady.append(
                f"<b>{_esc(run['name'])}</b> ({_esc(run['loss_scaling'])} loss scaling): the loss scale "
                f"stayed at {value} for all {len(run['train_log'])} steps: {why}."
            )
    if len(steady) == len(logged):
        return "".join(f'<p class="legend">{sentence}</p>' for sentence in steady)
    return _figure(
        plots.loss_scale_trajectory(runs),
        "loss scale",
        "Loss scale of the runs with loss scaling, on a log2 axis: dynamic scaling halves the scale "
        "on a step whose gradients overflow (that step is skipped) and doubles it after a run of "
        "clean steps.",
    )


def _plan_section(
    rows: Sequence[Mapping[str, Any]], view: AnalysisView | None, intro: str | None = None
) -> _Section | None:
    if not rows:
        return None
    by_site: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_site.setdefault(str(row["site"]), []).append(row)
    with_metrics = view is not None
    headers = ["site", "gemm", "operand", "format", "scaling", "bits", "reason"]
    if with_metrics:
        headers[6:6] = ["SQNR (dB)", "underflow", "overflow"]
    table_rows, row_classes = [], []
    for site, site_rows in by_site.items():
        for index, row in enumerate(site_rows):
            metrics: Mapping[str, float] = {}
            if view is not None:
                operand_view = view.operand(site, row["gemm"], row["operand"])
                if operand_view is not None:
                    metrics = operand_view.metrics.get(row["format"], {})
            cells = [
                _esc(site) if index == 0 else "",
                _esc(row["gemm"]),
                _esc(row["operand"]),
                _format_chip(str(row["format"]), row.get("bits")),
                _esc(row.get("scaling", "")),
                fmt_number(row.get("bits")),
                _esc(row.get("reason", "")),
            ]
            if with_metrics:
                cells[6:6] = [
                    fmt_number(metrics.get(SQNR)),
                    fmt_percent(metrics.get(UNDERFLOW)),
                    fmt_percent(metrics.get(OVERFLOW)),
                ]
            table_rows.append(cells)
            row_classes.append("first" if index == 0 else "")
    numeric = [False] * len(headers)
    numeric[5] = True
    if with_metrics:
        numeric[6:9] = [True, True, True]
    column_classes = ["site", *[""] * (len(headers) - 1)]
    legend = (
        "One row per GEMM operand of each site: the format the plan gives it, its storage bits "
        "per element (block scales included, 32 for <code>high</code> = left unquantized) and the "
        "advisor's reason (deciding metric and value)."
    )
    if with_metrics:
        legend += (
            " SQNR, underflow and overflow are the observer's measurements of that format on that "
            "operand (mean over sampled steps; — where it was not a candidate)."
        )
    detail = _table(headers, table_rows, column_classes, numeric, row_classes)
    body = [f'<p class="legend">{intro}</p>'] if intro else []
    shares = _format_shares(rows, view)
    if shares:
        body.append(f'<p class="legend">Share of all GEMM operand elements per format: {shares}.</p>')
    body += [
        _plan_matrix(by_site),
        f'<h3>Per operand, with the reasons</h3><p class="legend">{legend}</p>',
        f"<details><summary>show the {len(table_rows)} operands</summary>{detail}</details>",
    ]
    return _Section("plan", "Recommended plan per site", body)


def _format_shares(rows: Sequence[Mapping[str, Any]], view: AnalysisView | None) -> str:
    """``fmt 78.3%, …`` by element count (from the analysis), largest first; empty without counts."""
    if view is None:
        return ""
    totals: dict[str, int] = {}
    for row in rows:
        operand = view.operand(str(row["site"]), row["gemm"], row["operand"])
        if operand is not None and operand.elements:
            totals[str(row["format"])] = totals.get(str(row["format"]), 0) + operand.elements
    whole = sum(totals.values())
    if not whole:
        return ""
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    return ", ".join(
        f"{_format_chip(name, _bits_of(rows, name))} {100 * count / whole:.1f}%" for name, count in ranked
    )


def _bits_of(rows: Sequence[Mapping[str, Any]], name: str) -> Any:
    return next((row.get("bits") for row in rows if str(row["format"]) == name), None)


def _plan_matrix(by_site: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Sites × the six GEMM operands, each cell the chosen format as a chip coloured by its bits."""
    headers = ["site", *(f"{gemm} {operand}" for gemm, operand in OPERAND_KEYS)]
    labels = short_site_names(list(by_site))
    rows = []
    for site, site_rows in by_site.items():
        chosen = {(row["gemm"], row["operand"]): row for row in site_rows}
        cells = [f'<span title="{_esc(site)}">{_esc(labels.get(site, site))}</span>']
        for key in OPERAND_KEYS:
            row = chosen.get(key)
            cells.append(_format_chip(str(row["format"]), row.get("bits")) if row is not None else "—")
        rows.append(cells)
    table = _table(headers, rows, ["site", *[""] * len(OPERAND_KEYS)])
    key = " ".join(
        f'<span class="fmt" style="background:{colour}">{_esc(label)}</span>'
        for _, colour, label in BIT_COLOURS
    )
    return (
        table.replace("<table>", '<table class="matrix">', 1) + f'<p class="legend">Colour by bits: {key}</p>'
    )


BIT_COLOURS: tuple[tuple[float, str, str], ...] = (
    (5.0, "#f6b39a", "≤ 5 bits (4-bit formats)"),
    (7.0, "#fcd98c", "6–7 bits"),
    (9.0, "#d3ebad", "8–9 bits"),
    (17.0, "#c9ddf2", "16 bits"),
    (math.inf, "#e3e3e3", "32 bits (high)"),
)
"""Background of a format chip by its storage bits per element: upper bound, colour, legend label."""


def _format_chip(name: str, bits: Any) -> str:
    """A format name on the background :data:`BIT_COLOURS` gives its bits (none when bits are unknown)."""
    try:
        value = float(bits)
    except (TypeError, ValueError):
        return f'<span class="fmt">{_esc(name)}</span>'
    colour = next(colour for bound, colour, _ in BIT_COLOURS if value <= bound)
    return f'<span class="fmt" style="background:{colour}">{_esc(name)}</span>'


def _heatmap(view: AnalysisView) -> _Section | None:
    if not view.backward_errors:
        return None
    sites = [s for s in view.sites if any(s in cells for cells in view.backward_errors.values())]
    png = plots.backward_error_heatmap(
        view.backward_errors, sites, view.backward_error_columns, short_site_names(sites)
    )
    if png is None:
        return None
    return _Section(
        "backward-error",
        "Backward error per site and format",
        [
            _figure(
                png,
                "backward error heatmap",
                "Mean over output elements (and sampled steps) of the backward error of each GEMM, "
                "BE = |L·R − Q(L)·Q(R)| / (|L|·|R|), with both operands quantized to the column's format "
                "(fp32, bf16 and fp16 as plain casts, other element formats with per-tensor scaling, block "
                "formats with their own block scales); colour on a log10 scale, lower is better. Rows are "
                "sites (Lk = layer k).",
            )
        ],
    )


def _representative_sites(view: AnalysisView) -> list[OperandView]:
    """First and last site's wgrad/grad_output, and the one fp16 flushes most of, when that is another."""
    grads = [
        v for v in view.operands if v.gemm == Gemm.WGRAD and v.operand == Operand.GRAD_OUTPUT and v.histogram
    ]
    if not grads:
        grads = [v for v in view.operands if v.operand == Operand.GRAD_OUTPUT and v.histogram]
    if not grads:
        return []
    chosen = [grads[0], grads[-1]]
    measured = [v for v in grads if UNDERFLOW in v.metrics.get(UNDERFLOW_FORMAT, {})]
    if measured:
        chosen.append(max(measured, key=lambda v: v.metrics[UNDERFLOW_FORMAT][UNDERFLOW]))
    unique: dict[tuple[str, str, str], OperandView] = {}
    for v in chosen:
        unique.setdefault((v.site, v.gemm, v.operand), v)
    return list(unique.values())


def _histograms(view: AnalysisView) -> _Section | None:
    representative = _representative_sites(view)
    body = []
    fp16_present = UNDERFLOW_FORMAT in view.candidates
    for operand_view in representative:
        png = plots.operand_histogram(
            operand_view.histogram, operand_ranges(operand_view, view.candidates), UNDERFLOW_FORMAT
        )
        caption = (
            f"<code>{_esc(operand_view.site)}</code> {operand_view.gemm}/{operand_view.operand}: "
            "distribution of log2|x| (all sampled steps together), exact zeros on the left."
        )
        body.append(_figure(png, f"histogram {operand_view.site}", caption))
    for role in (Operand.GRAD_OUTPUT, Operand.INPUT, Operand.WEIGHT):
        gemm = Gemm.WGRAD if role != Operand.WEIGHT else Gemm.FPROP
        items = [
            (v.histogram, operand_ranges(v, view.candidates))
            for v in view.operands
            if v.operand == role and v.gemm == gemm and v.histogram is not None
        ]
        labels = short_site_names([v.site for v in view.operands if v.operand == role and v.gemm == gemm])
        items = [
            (Histogram(f"{labels.get(h.title.split('  ·  ')[0], h.title)}", h.counts, h.zeros), r)
            for h, r in items
        ]
        png = plots.histogram_grid(items)
        if png is not None:
            body.append(
                f"<details><summary>every site: {gemm}/{role} ({len(items)} histograms)</summary>"
                f"{_figure(png, f'{role} histograms', f'{gemm}/{role} of every site, same layout.')}"
                "</details>"
            )
    if not body:
        return None
    intro = (
        "Like Micikevicius et al. (2018), Fig. 3: bars are the fraction of an operand's values per binade "
        "(bin e holds 2<sup>e</sup> ≤ |x| &lt; 2<sup>e+1</sup>); below, one lane per candidate format shows "
        "the magnitudes it can hold — dark: normal numbers, light: subnormals. Unscaled formats (fp32, bf16, "
        "fp16) have a fixed range; per-tensor-scaled formats (fp8, int8…) are drawn after scaling, with "
        "their largest value mapped onto the tensor's amax (median over sampled steps), so the lane shows "
        "which binades below the amax survive; block formats (MX, NVFP4) are drawn for one block whose "
        "amax equals the tensor's — every block shifts this window to its own amax, so a block format "
        "loses only what lies too far below its block's largest value. Underflow % is the share of nonzero "
        "values that become 0, overflow % the share that saturate or become inf."
    )
    if fp16_present:
        intro += (
            " The red region is what fp16 flushes to zero without loss scaling: gradients there are "
            "lost, which is why FP16 training needs a loss scale."
        )
    return _Section(
        "histograms", "Operand histograms against format ranges", [f'<p class="legend">{intro}</p>', *body]
    )


def _underflow(view: AnalysisView | None, runs: Sequence[Mapping[str, Any]]) -> _Section | None:
    """A run's before/after-loss-scaling underflow per layer when one carries it (it includes the unscaled
    shares), else the analysis's fp16 underflow of every site's grad_output."""
    body = []
    for run in runs:
        rows = run.get("underflow")
        if not rows:
            continue
        labels = short_site_names([str(row["site"]) for row in rows])
        scale = run.get("underflow_scale")
        scale_label = "× loss scale" if scale is None else f"× loss scale 2^{math.log2(float(scale)):g}"
        title = (
            None if scale is None else f"{UNDERFLOW_FORMAT} underflow per layer: unscaled vs {scale_label}"
        )
        png = plots.underflow_before_after(rows, run["name"], labels, scale_label, title)
        source = run.get("underflow_source") or (
            "per parameter gradient, the share of nonzero values lost to underflow when cast unscaled and "
            "when multiplied by the loss scale first (the loss scaler's underflow report)"
        )
        body.append(
            _figure(
                png,
                f"underflow before and after loss scaling, {run['name']}",
                f"{_esc(run['name'])}: {_esc(source)}.",
            )
        )
    if not body and view is not None:
        per_site: dict[str, float] = {}
        for v in view.operands:
            value = v.metrics.get(UNDERFLOW_FORMAT, {}).get(UNDERFLOW)
            usable = v.operand == Operand.GRAD_OUTPUT and value is not None and not math.isnan(value)
            if usable and (v.gemm == Gemm.WGRAD or v.site not in per_site):
                per_site[v.site] = value
        if per_site:
            sites = [site for site in view.sites if site in per_site]
            png = plots.underflow_by_site(
                sites, [per_site[s] for s in sites], UNDERFLOW_FORMAT, short_site_names(sites)
            )
            body.append(
                _figure(
                    png,
                    "fp16 underflow per site",
                    "Share of each site's nonzero grad_output values (the incoming activation gradient dy) "
                    f"that round to 0 in {UNDERFLOW_FORMAT} with no loss scale, mean over the sampled steps "
                    "of the analysis run.",
                )
            )
    return _Section("underflow", "Gradient underflow per layer", body) if body else None


def _extra(images: Sequence[Any]) -> _Section | None:
    body = []
    for item in images:
        caption, source = item if isinstance(item, tuple) else (Path(item).stem, item)
        png = source if isinstance(source, bytes) else Path(source).read_bytes()
        body.append(_figure(png, caption, _esc(caption)))
    return _Section("figures", "More figures", body) if body else None


Note = str | tuple[str, bool | None]
"""A sentence for the report; ``(text, held)`` marks a checked claim as held (True) or not held (False)."""


def _note_parts(note: Note) -> tuple[str, bool | None]:
    return (note, None) if isinstance(note, str) else (str(note[0]), note[1])


def _notes(notes: Sequence[Note]) -> _Section | None:
    if not notes:
        return None
    body = []
    for note in notes:
        text, held = _note_parts(note)
        kind = {True: " held", False: " not-held"}.get(held, "")
        badge = {True: '<span class="badge">held</span>', False: '<span class="badge">not held</span>'}.get(
            held, ""
        )
        body.append(f'<div class="note{kind}">{badge}{_esc(text)}</div>')
    return _Section("claims", "What this run shows", body)


def _setup(setup: Mapping[str, Any] | None) -> _Section | None:
    if not setup:
        return None
    rows = [[f"<b>{_esc(key)}</b>", _esc(value)] for key, value in setup.items()]
    return _Section(
        "setup",
        "How it was run",
        [_table(["", ""], rows).replace("<thead><tr><th></th><th></th></tr></thead>", "", 1)],
    )


# ========================================================================================== the writer
