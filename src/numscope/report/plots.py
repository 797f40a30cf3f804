"""The report's figures, drawn with matplotlib (Agg) from plain data and returned as PNG bytes.

Every function takes lists, dicts and the small dataclasses below (never an Analysis or a Plan), so the
figures do not depend on how the observer or the advisor store things; :mod:`numscope.report.html` turns
those into these inputs. Units: steps, nats (MLM loss), percent, binades (log2 of a magnitude).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import colors as mcolors
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from numscope._names import parse_seed_run, seed_run_name

DPI = 110
REFERENCE_RUN = "fp32"
_REFERENCE_COLOUR = "#222222"
_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
)
_UNDERFLOW_COLOUR = "#d62728"
_SUBNORMAL_COLOUR = "#f2b134"
_BAR_COLOUR = "#3b6ea8"

plt.rcParams.update(
    {
        "font.size": 9,
        "axes.titlesize": 10,
        "axes.labelsize": 9,
        "legend.fontsize": 8,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": True,
        "grid.alpha": 0.25,
    }
)


def run_colours(names: Sequence[str]) -> dict[str, str]:
    """A fixed colour per run name: the FP32 reference dark grey, the others from a 10-colour palette; a
    run from another seed (``NAME-seedN``) takes the colour of ``NAME`` where that run is present."""
    colours: dict[str, str] = {}
    present = set(names)

    def base_of(name: str) -> str | None:
        base = parse_seed_run(name)
        return base[0] if base is not None and base[0] in present else None

    others = [name for name in names if name != REFERENCE_RUN and base_of(name) is None]
    for index, name in enumerate(others):
        colours[name] = _PALETTE[index % len(_PALETTE)]
    if REFERENCE_RUN in names:
        colours[REFERENCE_RUN] = _REFERENCE_COLOUR
    for name in names:
        base = base_of(name)
        if base is not None:
            colours[name] = colours[base]
    return colours


def _line_style(name: str) -> str:
    """Solid for a run, dashed or dotted for the same run from another seed."""
    base = parse_seed_run(name)
    return "-" if base is None else ("--", ":", "-.")[(base[1] - 1) % 3]


def _png(fig: Figure, tight: bool = True) -> bytes:
    """The figure as PNG bytes; ``tight=False`` keeps the figure's own margins (one draw instead of two)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight" if tight else None, facecolor="white")
    plt.close(fig)
    return buffer.getvalue()


def ema(values: Sequence[float], alpha: float = 0.1) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard's smoothing); non-finite values are
    carried through as NaN without poisoning later points."""
    smoothed, average, weight = [], 0.0, 0.0
    for value in values:
        if not math.isfinite(value):
            smoothed.append(math.nan)
            continue
        average = (1 - alpha) * average + alpha * value
        weight = (1 - alpha) * weight + alpha
        smoothed.append(average / weight)
    return smoothed


# ------------------------------------------------------------------------------------------ loss curves
def loss_curves(
    runs: Sequence[Mapping],
    smoothing: float = 0.1,
    context_free_loss: float | None = None,
    loss_label: str = "MLM loss",
) -> bytes | None:
    """Three panels on shared step axes: training loss (EMA-smoothed, ``smoothing`` = EMA weight of a new
    step), validation loss, and each run's validation loss relative to the reference run's at the same
    step (percent; only when a run named ``fp32`` has evaluations). ``context_free_loss`` (nats) is drawn
    as a dashed reference line. None when no run has a training log or evaluations."""
    have_train = any(run.get("train_log") for run in runs)
    have_val = any(run.get("curve") for run in runs)
    if not (have_train or have_val):
        return None
    colours = run_colours([run["name"] for run in runs])
    reference = next((run for run in runs if run["name"] == REFERENCE_RUN and run.get("curve")), None)
    panels = 3 if reference is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.9), sharex=True)
    train_ax, val_ax = axes[0], axes[1]
    finite_losses: list[float] = []
    val_losses: list[float] = []
    # per panel and run: (name, colour, highest and last value drawn), to set the top and name runs above it
    train_drawn: list[tuple[str, str, float, float]] = []
    val_drawn: list[tuple[str, str, float, float]] = []
    for run in runs:
        colour = colours[run["name"]]
        width = 2.2 if run["name"] == REFERENCE_RUN else 1.3
        order = 3 if run["name"] == REFERENCE_RUN else 2
        log = run.get("train_log") or []
        if log:
            steps = [float(row["step"]) for row in log]
            losses = [float(row["loss"]) for row in log]
            smoothed = ema(losses, smoothing)
            train_ax.plot(
                steps,
                smoothed,
                color=colour,
                lw=width,
                ls=_line_style(run["name"]),
                label=run["name"],
                zorder=order,
            )
            finite = [v for v in losses if math.isfinite(v)]
            finite_losses += finite
            if finite:
                train_drawn.append((run["name"], colour, *_high_and_last(smoothed)))
        curve = run.get("curve") or []
        if curve:
            values = [float(p["val_loss"]) for p in curve]
            val_ax.plot(
                [float(p["step"]) for p in curve],
                values,
                color=colour,
                lw=width,
                ls=_line_style(run["name"]),
                marker="o",
                ms=3,
                label=run["name"],
                zorder=order,
            )
            finite = [v for v in values if math.isfinite(v)]
            val_losses += finite
            if finite:
                val_drawn.append((run["name"], colour, *_high_and_last(values)))
    train_ax.set_title(f"training loss (EMA, weight {smoothing:g} per step)")
    val_ax.set_title(f"validation {loss_label}")
    for ax in (train_ax, val_ax):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats)")
        if context_free_loss is not None and math.isfinite(context_free_loss):
            ax.axhline(
                context_free_loss,
                color="#888888",
                lw=1.0,
                ls="--",
                zorder=1,
                label="no context (token frequencies)",
            )
    # keep a diverging run from flattening everyone else's curve: the top leaves out the runs far above the
    # others (see _typical_top), and a run drawn above it is named with its last value
    if finite_losses:
        low = min(finite_losses)
        high = _typical_top(train_drawn, low)
        top = high + 0.05 * (high - low)
        train_ax.set_ylim(low - 0.05 * (high - low), top)
        _note_off_scale(train_ax, train_drawn, top)
    if val_losses:
        low = min(val_losses)
        high = _typical_top(val_drawn, low)
        if context_free_loss is not None and math.isfinite(context_free_loss):
            high = max(high, context_free_loss)
        top = high + 0.08 * (high - low)
        val_ax.set_ylim(low - 0.05 * (high - low), top)
        _note_off_scale(val_ax, val_drawn, top)
    if reference is not None:
        _gap_panel(axes[2], runs, reference, colours)
    handles, labels = _unique_legend(fig)
    rows = max(1, math.ceil(len(labels) / 9))
    fig.legend(
        handles,
        labels,
        loc="lower center",
        ncol=max(1, math.ceil(len(labels) / rows)),  # rows of equal length
        frameon=False,
        bbox_to_anchor=(0.5, -0.02),
    )
    fig.tight_layout(rect=(0, 0.04 + 0.03 * rows, 1, 1))
    return _png(fig)


def _high_and_last(values: Sequence[float]) -> tuple[float, float]:
    """The highest and the last finite value of a drawn series (NaN when it has none)."""
    finite = [v for v in values if math.isfinite(v)]
    return (max(finite), finite[-1]) if finite else (math.nan, math.nan)


def _typical_top(drawn: Sequence[tuple[str, str, float, float]], low: float) -> float:
    """The top of a loss axis: the highest value drawn by a run that is not far above the others, i.e. whose
    highest value lies at most half the typical range (``low`` to the median of the runs' highest values)
    above that median; the reference run always counts. ``drawn``: name, colour, highest and last value of
    each run with a finite value."""
    highs = [(name, high) for name, _, high, _ in drawn if math.isfinite(high)]
    if not highs:  # e.g. a smoothed curve that is NaN throughout
        return low
    median = float(np.median([high for _, high in highs]))
    limit = median + 0.5 * max(0.0, median - low)
    # never empty: the runs at or below the median count
    return max(high for name, high in highs if high <= limit or name == REFERENCE_RUN)


def _note_off_scale(ax, drawn: Sequence[tuple[str, str, float, float]], top: float) -> None:
    """Name, in the panel's top right corner and in its colour, every run drawn above ``top``, with its last
    value: its curve leaves the axis there."""
    off = [(name, colour, last) for name, colour, high, last in drawn if math.isfinite(high) and high > top]
    for index, (name, colour, last) in enumerate(off):
        ax.text(
            0.98,
            0.97 - 0.075 * index,
            f"↑ {name} above the axis, ends at {last:.2f}",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=7.5,
            color=colour,
            bbox={"facecolor": "white", "alpha": 0.85, "lw": 0, "pad": 1.5},
            zorder=5,
        )


def _gap_panel(ax, runs: Sequence[Mapping], reference: Mapping, colours: Mapping[str, str]) -> None:
    """Each run's validation loss over the reference run's at the same evaluation step, in percent (a
    symmetric-log axis beyond ±2%, so a run that falls far behind does not flatten the close ones)."""
    curves = {run["name"]: run.get("curve") or [] for run in runs}
    gaps: list[float] = []
    for run in runs:
        if run["name"] == REFERENCE_RUN:
            continue
        # a run from another seed against FP32 from that seed (paired), where there is one
        seed = parse_seed_run(run["name"])
        paired = (
            seed_run_name(REFERENCE_RUN, seed[1]) if seed is not None and seed[0] != REFERENCE_RUN else ""
        )
        against = curves.get(paired) or reference["curve"]
        base = {float(p["step"]): float(p["val_loss"]) for p in against}
        points = [(float(p["step"]), float(p["val_loss"])) for p in run.get("curve") or []]
        points = [
            (step, 100.0 * (value - base[step]) / base[step])
            for step, value in points
            if step in base and base[step] and math.isfinite(value)
        ]
        if not points:
            continue
        ax.plot(
            *zip(*points, strict=True),
            color=colours[run["name"]],
            lw=1.3,
            ls=_line_style(run["name"]),
            marker="o",
            ms=3,
            label=run["name"],
        )
        gaps += [gap for _, gap in points]
    ax.axhline(0.0, color=_REFERENCE_COLOUR, lw=2.2, label=REFERENCE_RUN)
    ax.axhspan(-1.0, 1.0, color="#2ca02c", alpha=0.08, lw=0, zorder=0)
    if gaps and max(abs(g) for g in gaps) > 2.0:
        ax.set_yscale("symlog", linthresh=2.0, linscale=1.5)
    ax.set_title("validation loss vs fp32 at the same step (NAME-seedN: vs fp32-seedN)", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gap to fp32 (%); green band ±1%")


def _unique_legend(fig: Figure) -> tuple[list, list[str]]:
    seen: dict[str, object] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    return list(seen.values()), list(seen)


def loss_scale_trajectory(runs: Sequence[Mapping]) -> bytes | None:
    """The loss scale per step (log2 axis) of every run with loss scaling, skipped steps marked with an x.
    None when no run scales its loss."""
    scaled = [
        run
        for run in runs
        if run.get("loss_scaling", "none") not in ("none", None, "") and run.get("train_log")
    ]
    if not scaled:
        return None
    colours = run_colours([run["name"] for run in runs])
    fig, ax = plt.subplots(figsize=(10.5, 3.2))
    for run in scaled:
        log = run["train_log"]
        steps = [float(row["step"]) for row in log]
        scales = [float(row["scale"]) for row in log]
        colour = colours[run["name"]]
        label = f"{run['name']} ({run['loss_scaling']})"
        ax.step(steps, scales, where="post", color=colour, lw=1.4, label=label)
        skipped = [(float(row["step"]), float(row["scale"])) for row in log if int(row.get("skipped", 0))]
        if skipped:
            ax.scatter(
                *zip(*skipped, strict=True),
                marker="x",
                color=_UNDERFLOW_COLOUR,
                s=28,
                zorder=3,
                label=f"{run['name']}: skipped step ({len(skipped)})",
            )
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale (log2 axis)")
    ax.set_title("loss-scale trajectory; × = step skipped because gradients held inf/NaN")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return _png(fig)


# ------------------------------------------------------------------------------------ backward error
def backward_error_heatmap(
    panels: Mapping[str, Mapping[str, Mapping[str, float]]],
    sites: Sequence[str],
    formats: Sequence[str],
    site_labels: Mapping[str, str] | None = None,
) -> bytes | None:
    """Heatmaps sites × formats of the mean backward error, one panel per GEMM, on a shared log10 colour
    scale, each cell annotated with its value.

    panels: gemm → site → format label → backward error (dimensionless, |LR − Q(L)Q(R)| / |L||R|).
    Missing cells are left blank (grey). None when there is no finite positive value.
    """
    values = [v for cells in panels.values() for row in cells.values() for v in row.values()]
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if not positive or not sites or not formats:
        return None
    labels = site_labels or {}
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    high = max(high, low + 1)
    norm = mcolors.Normalize(vmin=low, vmax=high)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#eeeeee")
    gemms = list(panels)
    cell_w, cell_h = 0.62, 0.27
    panel_w = max(2.6, cell_w * len(formats))
    panel_h = max(1.2, cell_h * len(sites))
    side_by_side = panel_w * len(gemms) + 3.2 <= 14.0
    if side_by_side:  # few formats: the GEMMs next to each other, sharing the site axis
        fig, grid = plt.subplots(
            1, len(gemms), figsize=(panel_w * len(gemms) + 3.2, panel_h + 1.6), sharey=True, squeeze=False
        )
        axes = list(grid[0])
    else:  # many formats: one GEMM under the other, sharing the format axis
        fig, grid = plt.subplots(
            len(gemms),
            1,
            figsize=(panel_w + 3.6, (panel_h + 0.5) * len(gemms) + 1.1),
            sharex=True,
            squeeze=False,
        )
        axes = list(grid[:, 0])
    image = None
    for index, (ax, gemm) in enumerate(zip(axes, gemms, strict=True)):
        grid_values = np.full((len(sites), len(formats)), np.nan)
        for i, site in enumerate(sites):
            for j, fmt in enumerate(formats):
                value = panels[gemm].get(site, {}).get(fmt)
                if value is not None and math.isfinite(value):
                    grid_values[i, j] = math.log10(max(value, 10.0**low))
        image = ax.imshow(np.ma.masked_invalid(grid_values), cmap=cmap, norm=norm, aspect="auto")
        for i in range(len(sites)):
            for j in range(len(formats)):
                if math.isnan(grid_values[i, j]):
                    continue
                shade = cmap(norm(grid_values[i, j]))
                luminance = 0.299 * shade[0] + 0.587 * shade[1] + 0.114 * shade[2]
                ax.text(
                    j,
                    i,
                    _short_sci(10.0 ** grid_values[i, j]),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if luminance > 0.5 else "white",
                )
        if side_by_side or index == len(gemms) - 1:
            ax.set_xticks(range(len(formats)), formats, rotation=50, ha="right", rotation_mode="anchor")
        else:
            ax.tick_params(labelbottom=False)
        ax.set_yticks(range(len(sites)), [labels.get(site, site) for site in sites])
        ax.set_title(gemm if side_by_side else f"{gemm}", loc="center" if side_by_side else "left")
        ax.grid(False)
        ax.tick_params(length=0)
    fig.tight_layout()
    if side_by_side:
        bar = fig.colorbar(image, ax=axes, fraction=0.025, pad=0.01)
    else:
        inches = fig.get_figheight()
        bar = fig.colorbar(image, ax=axes, location="top", fraction=0.5 / inches, pad=0.4 / inches, aspect=40)
    bar.set_label("log10 backward error (mean over outputs)")
    return _png(fig)


def _short_sci(value: float) -> str:
    """``4.6e-3`` style: two significant digits, compact exponent."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# ---------------------------------------------------------------------------------------- histograms
@dataclass(frozen=True)
class FormatRange:
    """One candidate format's representable magnitudes, in binades (log2) of the *tensor's* units.

    For an unscaled format these are log2 of its smallest subnormal, smallest normal and largest value;
    for per-tensor scaling the same range shifted so that ``high`` sits at the tensor's amax; for block
    formats the range of one block whose amax equals the tensor's (other blocks shift down with theirs).
    ``underflow_percent`` / ``overflow_percent``: the observer's measured shares (None when not measured).
    """

    name: str
    low: float
    low_normal: float
    high: float
    scaling: str
    underflow_percent: float | None = None
    overflow_percent: float | None = None


@dataclass(frozen=True)
class Histogram:
    """A log2 magnitude histogram: ``counts[e]`` values with 2^e ≤ |x| < 2^(e+1), plus exact ``zeros``."""

    title: str
    counts: Mapping[int, int]
    zeros: int = 0

    @property
    def total(self) -> int:
        return int(sum(self.counts.values())) + int(self.zeros)


def operand_histogram(
    histogram: Histogram,
    ranges: Sequence[FormatRange],
    highlight: str | None = "fp16",
) -> bytes | None:
    """Micikevicius et al. (2018), Fig. 3 style: the fraction of values per binade, zeros as a separate
    bar, and below it one lane per candidate format showing the magnitudes it represents (normal range
    dark, subnormal range light), annotated with the measured underflow/overflow %.

    highlight: a format (``fp16`` by default) whose flush-to-zero region is shaded red over the histogram
    and whose smallest subnormal is drawn as a line, when it is among ``ranges`` and unscaled.
    """
    if histogram.total == 0 or not histogram.counts:
        return None
    marked = _marked(ranges, highlight)
    view_low, view_high = _view(histogram, marked)
    binades = sorted(histogram.counts)
    total = histogram.total
    fig = plt.figure(figsize=(9.5, 2.8 + 0.24 * len(ranges)))
    grid = fig.add_gridspec(
        2,
        2,
        height_ratios=(2.8, max(0.6, 0.24 * len(ranges))),
        width_ratios=(0.6, 11),
        hspace=0.12,
        wspace=0.03,
    )
    zero_ax = fig.add_subplot(grid[0, 0])
    hist_ax = fig.add_subplot(grid[0, 1], sharey=zero_ax)
    lane_ax = fig.add_subplot(grid[1, 1], sharex=hist_ax)

    fractions = [histogram.counts[e] / total for e in binades]
    hist_ax.bar([e + 0.5 for e in binades], fractions, width=0.92, color=_BAR_COLOUR, zorder=3)
    zero_fraction = histogram.zeros / total
    zero_ax.bar([0], [zero_fraction], width=0.7, color="#777777")
    zero_ax.set_xticks([0], ["zeros"], fontsize=7.5)
    zero_ax.set_xlim(-0.6, 0.6)
    zero_ax.set_ylabel("fraction of values")
    zero_ax.grid(False)
    zero_ax.text(0, zero_fraction, f"{100 * zero_fraction:.1f}%", ha="center", va="bottom", fontsize=7)
    hist_ax.tick_params(labelleft=False, labelbottom=False)
    hist_ax.spines["left"].set_visible(False)
    hist_ax.set_xlim(view_low, view_high)
    hist_ax.set_title(histogram.title, loc="left")
    zero_ax.set_ylim(0, max(max(fractions), zero_fraction) * 1.35)
    if marked is not None:
        _shade_flush_region(hist_ax, marked, view_low)
        text = f"{marked.name}: values below 2^{marked.low - 1:g} (half its smallest subnormal) become 0"
        if marked.underflow_percent is not None:
            text += f"\nmeasured underflow: {marked.underflow_percent:.2f}% of nonzeros"
        else:
            lost = sum(histogram.counts[e] for e in binades if e + 1 <= marked.low - 1)
            text += f"\n≥ {100 * lost / max(1, total - histogram.zeros):.2f}% of nonzeros by the histogram"
        hist_ax.text(
            0.01,
            0.97,
            text,
            transform=hist_ax.transAxes,
            ha="left",
            va="top",
            fontsize=7.5,
            color=_UNDERFLOW_COLOUR,
            zorder=5,
            bbox={"facecolor": "white", "alpha": 0.9, "lw": 0, "pad": 2},
        )
    for lane, fmt in enumerate(ranges):
        _lane(lane_ax, lane, fmt, view_low, view_high, height=0.62)
        parts = []
        if fmt.underflow_percent is not None:
            parts.append(f"underflow {fmt.underflow_percent:.2f}%")
        if fmt.overflow_percent is not None:
            parts.append(f"overflow {fmt.overflow_percent:.2f}%")
        if parts:
            lane_ax.text(
                1.005,
                lane,
                "  ·  ".join(parts),
                transform=lane_ax.get_yaxis_transform(),
                va="center",
                fontsize=7,
                clip_on=False,
            )
    lane_ax.set_yticks(range(len(ranges)), [f"{r.name} ({r.scaling})" for r in ranges], fontsize=7.5)
    lane_ax.set_ylim(len(ranges) - 0.5, -0.5)
    lane_ax.grid(axis="y", visible=False)
    lane_ax.spines["left"].set_visible(False)
    lane_ax.set_xlabel("log2 |x|  (binades; bin e holds 2^e ≤ |x| < 2^(e+1))")
    fig.legend(
        handles=[
            Patch(color=_LANE_COLOURS["none"], label="unscaled: fixed range"),
            Patch(color=_LANE_COLOURS["tensor"], label="per-tensor scaled: top at tensor amax"),
            Patch(color=_LANE_COLOURS["block"], label="block scaled: one block whose amax = tensor amax"),
            Patch(color="#999999", alpha=0.35, label="light: subnormal range"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=4,
        frameon=False,
        fontsize=7.5,
    )
    return _png(fig)


_LANE_COLOURS = {"none": "#4c72b0", "tensor": "#55a868", "block": "#8172b2"}


def _marked(ranges: Sequence[FormatRange], highlight: str | None) -> FormatRange | None:
    return next((r for r in ranges if r.name == highlight and r.scaling == "none"), None)


def _view(histogram: Histogram, marked: FormatRange | None) -> tuple[float, float]:
    """The x range: the data ±3 binades, widened to show ``marked``'s underflow line (at most 16 binades)."""
    binades = sorted(histogram.counts)
    data_low, data_high = binades[0], binades[-1] + 1
    view_low, view_high = data_low - 3, data_high + 3
    if marked is not None:
        view_low = max(min(view_low, marked.low - 2), data_low - 16)
        view_high = min(max(view_high, marked.high + 1), data_high + 16)
    return view_low, view_high


def _shade_flush_region(ax, marked: FormatRange, view_low: float, ymin: float = 0.0) -> None:
    """Red: magnitudes ``marked`` rounds to zero (below half its smallest subnormal: round to nearest, ties
    to even); amber: the magnitudes it keeps only as subnormals (fewer significant bits); dashed: the edge."""
    flush = marked.low - 1
    ax.axvspan(view_low - 1, flush, ymin=ymin, color=_UNDERFLOW_COLOUR, alpha=0.12, lw=0, zorder=0)
    ax.axvspan(flush, marked.low_normal, ymin=ymin, color=_SUBNORMAL_COLOUR, alpha=0.15, lw=0, zorder=0)
    ax.axvline(flush, ymin=ymin, color=_UNDERFLOW_COLOUR, lw=1.2, ls="--", zorder=4)


def _lane(ax, y: float, fmt: FormatRange, view_low: float, view_high: float, height: float) -> None:
    """One format's range as a horizontal bar at ``y``: light over subnormals, dark over normals."""
    colour = _LANE_COLOURS.get(fmt.scaling, "#999999")
    low, low_normal, high = (
        min(max(v, view_low - 1), view_high + 1) for v in (fmt.low, fmt.low_normal, fmt.high)
    )
    ax.barh(y, low_normal - low, left=low, height=height, color=colour, alpha=0.35, lw=0)
    ax.barh(y, high - low_normal, left=low_normal, height=height, color=colour, alpha=0.85, lw=0)


def histogram_grid(
    items: Sequence[tuple[Histogram, Sequence[FormatRange]]], columns: int = 3, highlight: str | None = "fp16"
) -> bytes | None:
    """Small multiples of :func:`operand_histogram`, ``columns`` per row, one axes each: bars above the
    zero line (fraction of all values; exact zeros in the title), format lanes below it."""
    items = [item for item in items if item[0].total and item[0].counts]
    if not items:
        return None
    rows = math.ceil(len(items) / columns)
    lanes = max(len(r) for _, r in items)
    fig, axes = plt.subplots(
        rows, columns, figsize=(4.4 * columns, rows * (1.9 + 0.16 * lanes)), squeeze=False
    )
    for ax in axes.flat[len(items) :]:
        ax.axis("off")
    for ax, (histogram, ranges) in zip(axes.flat, items, strict=False):
        marked = _marked(ranges, highlight)
        view_low, view_high = _view(histogram, marked)
        binades = sorted(histogram.counts)
        fractions = [histogram.counts[e] / histogram.total for e in binades]
        peak = max(fractions)
        lane_step = peak * 0.14
        lane_centres = [-(index + 0.8) * lane_step for index in range(len(ranges))]
        bottom = -(len(ranges) + 0.3) * lane_step
        ax.bar([e + 0.5 for e in binades], fractions, width=0.92, color=_BAR_COLOUR, zorder=3)
        for centre, fmt in zip(lane_centres, ranges, strict=True):
            _lane(ax, centre, fmt, view_low, view_high, height=lane_step * 0.7)
        ax.set_xlim(view_low, view_high)
        ax.set_ylim(bottom, peak * 1.12)
        if marked is not None:
            _shade_flush_region(ax, marked, view_low, ymin=-bottom / (peak * 1.12 - bottom))
        ax.axhline(0, color="#444444", lw=0.6)
        ax.set_yticks([*lane_centres, 0, peak], [*(r.name for r in ranges), "0", f"{peak:.2f}"], fontsize=6.5)
        ax.grid(axis="y", visible=False)
        zeros = 100 * histogram.zeros / histogram.total
        ax.set_title(f"{histogram.title}  (zeros {zeros:.1f}%)", loc="left", fontsize=8.5)
        ax.set_xlabel("log2 |x|", fontsize=8)
    width, height = fig.get_size_inches()  # fixed margins in inches: small multiples are costly to lay out
    fig.subplots_adjust(
        left=0.75 / width,
        right=1 - 0.15 / width,
        bottom=0.5 / height,
        top=1 - 0.3 / height,
        wspace=0.3,
        hspace=0.45,
    )
    return _png(fig, tight=False)


# ---------------------------------------------------------------------------------------- underflow
def underflow_by_site(
    sites: Sequence[str],
    underflow_percent: Sequence[float],
    fmt: str = "fp16",
    site_labels: Mapping[str, str] | None = None,
) -> bytes | None:
    """Horizontal bars: the share (%) of each site's nonzero grad_output values that ``fmt`` flushes to 0."""
    if not sites:
        return None
    labels = site_labels or {}
    fig, ax = plt.subplots(figsize=(8.5, max(2.2, 0.26 * len(sites) + 1.0)))
    positions = np.arange(len(sites))
    ax.barh(positions, underflow_percent, color=_UNDERFLOW_COLOUR, alpha=0.8, height=0.7)
    for y, value in zip(positions, underflow_percent, strict=True):
        ax.text(value, y, f" {value:.2f}%", va="center", fontsize=7)
    ax.set_yticks(positions, [labels.get(site, site) for site in sites])
    ax.invert_yaxis()
    ax.set_xlabel(f"{fmt} underflow (% of nonzero grad_output values that become 0)")
    ax.set_title(f"grad_output underflow in {fmt} without loss scaling, per site")
    ax.set_xlim(0, max(1.0, max(underflow_percent) * 1.2))
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return _png(fig)


def underflow_before_after(
    rows: Sequence[Mapping[str, float | str]],
    run_name: str,
    labels: Mapping[str, str] | None = None,
    scale_label: str = "× loss scale",
    title: str | None = None,
) -> bytes | None:
    """Grouped bars per site/parameter: underflow % without (before) and with (after) loss scaling.

    rows: dicts with ``site``, ``before%`` and ``after%``; labels: optional short names for the sites;
    scale_label: the legend entry of the scaled bars (e.g. ``× loss scale 2^16``).
    """
    if not rows:
        return None
    names = [str(row["site"]) for row in rows]
    before = [float(row["before%"]) for row in rows]
    after = [float(row["after%"]) for row in rows]
    fig, ax = plt.subplots(figsize=(8.5, max(2.2, 0.3 * len(rows) + 1.2)))
    positions = np.arange(len(rows))
    ax.barh(positions - 0.2, before, height=0.38, color=_UNDERFLOW_COLOUR, alpha=0.8, label="unscaled")
    ax.barh(positions + 0.2, after, height=0.38, color="#2ca02c", alpha=0.85, label=scale_label)
    for offset, values in ((-0.2, before), (0.2, after)):
        for y, value in zip(positions, values, strict=True):
            if value > 0:
                ax.text(value, y + offset, f" {value:.2f}%", va="center", fontsize=6.5)
    ax.set_yticks(positions, [(labels or {}).get(name, name) for name in names])
    ax.invert_yaxis()
    ax.set_xlabel("underflow (% of nonzero gradient values that become 0)")
    ax.set_title(title or f"{run_name}: gradient underflow before vs after loss scaling")
    ax.set_xlim(0, max(1.0, max(before + after) * 1.15))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return _png(fig)


# ------------------------------------------------------------------------------------------ plan study
_FAMILY_STYLE = {
    "uniform": ("#7f7f7f", "s"),
    "calibration": ("#bcbd22", "v"),
    "numscope": ("#d62728", "*"),
    "heuristic": ("#1f77b4", "o"),
    "random": ("#9aa5b1", "."),
    "inverse": ("#8c564b", "x"),
}


def plan_study_pareto(rows: Sequence[Mapping], noise: float) -> bytes:
    """Left: average bits vs the validation-loss gap to FP32 (mean ± sd over seeds, paired with FP32) of
    the uniform formats and every budget plan (budget plans spread a little along x by family so that they
    do not hide each other). Right: per budget, every plan sorted by its gap, numscope's starred. The
    shaded band is ± twice FP32's seed-to-seed standard deviation (an unpaired comparison's noise)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    offsets = {"numscope": -0.09, "heuristic": -0.03, "random": 0.03, "inverse": 0.09}
    drawn = [r for r in rows if r["family"] in ("uniform", *offsets)]
    labelled: set[str] = set()

    def point(ax, x: float, row: Mapping) -> None:
        colour, marker = _FAMILY_STYLE.get(row["family"], ("#000000", "o"))
        label = None if row["family"] in labelled else row["family"]
        labelled.add(row["family"])
        sd = row["gap_sd"]
        ax.errorbar(
            x,
            row["gap_mean"],
            yerr=sd if math.isfinite(sd) else None,
            fmt=marker,
            color=colour,
            markersize=11 if row["family"] == "numscope" else 6,
            capsize=2,
            label=label,
            zorder=3 if row["family"] == "numscope" else 2,
        )

    for row in drawn:
        point(left, row["bits"] + offsets.get(row["family"], 0.0), row)
        if row["family"] == "uniform":
            left.annotate(row["name"], (row["bits"], row["gap_mean"]), fontsize=7, xytext=(4, 3),
                          textcoords="offset points")  # fmt: skip
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    ticks, names = [], []
    x = 0
    for budget in budgets:
        group = sorted((r for r in rows if r["budget"] == budget), key=lambda r: r["gap_mean"])
        for row in group:
            labelled.add(row["family"])  # one legend (the left panel's)
            point(right, x, row)
            if row["family"] in ("numscope", "heuristic", "inverse"):
                right.annotate(row["name"].split("@")[0], (x, row["gap_mean"]), fontsize=6, rotation=90,
                               xytext=(3, 6), textcoords="offset points")  # fmt: skip
            x += 1
        ticks.append(x - (len(group) + 1) / 2)
        names.append(f"{budget:g} bits")
        x += 2
    right.set_xticks(ticks, names)
    right.grid(axis="x", visible=False)
    for ax in (left, right):
        if math.isfinite(noise):
            ax.axhspan(-2 * noise, 2 * noise, color="#222222", alpha=0.06)
        ax.axhline(0.0, color=_REFERENCE_COLOUR, linewidth=0.8)
    left.set_xlabel("average bits per GEMM operand element")
    left.set_ylabel("validation-loss gap to FP32 (nats)")
    left.set_title("Bits vs loss gap (mean ± sd over seeds, paired)")
    right.set_title("Per budget, plans sorted by gap (band: ±2 sd FP32 seed noise)")
    left.legend(loc="upper right", fontsize=7)
    return _png(fig)


def predicted_vs_measured(rows: Sequence[Mapping], rho: float, rho_sensitivity: float | None = None) -> bytes:
    """The gap models' predicted gaps against the measured ones, per plan (mean ± sd over seeds): from
    tensor noise (left) and, where given, from measured sensitivities (right)."""
    panels = [("predicted_gap", "from tensor noise", rho)]
    if rho_sensitivity is not None:
        panels.append(("predicted_gap_sensitivity", "from sensitivities", rho_sensitivity))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, (field_name, what, value) in zip(axes[0], panels, strict=True):
        labelled: set[str] = set()
        for row in rows:
            colour, marker = _FAMILY_STYLE.get(row["family"], ("#000000", "o"))
            label = None if row["family"] in labelled else row["family"]
            labelled.add(row["family"])
            sd = row["gap_sd"]
            ax.errorbar(
                row[field_name],
                row["gap_mean"],
                yerr=sd if math.isfinite(sd) else None,
                fmt=marker,
                color=colour,
                capsize=2,
                label=label,
            )
        values = [v for r in rows for v in (r[field_name], r["gap_mean"]) if math.isfinite(v)]
        if values:
            low, high = min(values), max(values)
            ax.plot([low, high], [low, high], color="#222222", linewidth=0.8, linestyle="--", label="y = x")
        ax.set_xlabel(f"predicted gap (nats), {what}, before training")
        ax.set_ylabel("measured gap (nats)")
        ax.set_title(f"Predicted {what} (Spearman ρ = {value:.2f})")
        ax.legend(loc="upper left", fontsize=7)
    return _png(fig)


def plan_history_figure(
    changes: Sequence[Mapping],
    bits_from_step: Sequence[Sequence[float]],
    steps: int,
    title: str | None = None,
) -> bytes:
    """An adaptive run's plan over training (:mod:`numscope.train.adaptive`): its average bits per operand
    element from each change on (top), and below, the operands the guard holds in the fallback and the
    operands each re-plan moved. changes: rows with ``step`` and ``cause`` (``plan_history.csv``);
    bits_from_step: ``[first step, bits]`` per plan (``adaptive.json``)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.0, 4.2), sharex=True, height_ratios=(1, 1))
    spans = [(int(first), float(bits)) for first, bits in bits_from_step] or [(0, math.nan)]
    xs = [first for first, _ in spans] + [steps]
    ys = [bits for _, bits in spans] + [spans[-1][1]]
    top.step(xs, ys, where="post", color=_BAR_COLOUR)
    top.set_ylabel("average bits")
    top.set_title(title or "adaptive plan over training")
    held, fallen = [(0, 0)], set()
    replans: dict[int, int] = {}
    for change in sorted(changes, key=lambda c: int(c["step"])):
        step, key = int(change["step"]), (change.get("site"), change.get("gemm"), change.get("operand"))
        if change["cause"] == "guard":
            fallen.add(key)
        else:  # back by the guard, or given a new format by a re-plan (which ends its fallback)
            fallen.discard(key)
            if change["cause"] != "clear":
                replans[step] = replans.get(step, 0) + 1
        held.append((step, len(fallen)))
    held.append((steps, len(fallen)))
    bottom.step([s for s, _ in held], [n for _, n in held], where="post", color=_UNDERFLOW_COLOUR,
                label="operands in the fallback (guard)")  # fmt: skip
    if replans:
        bottom.bar(list(replans), list(replans.values()), width=max(1.0, steps / 200), color=_PALETTE[2],
                   label="operands moved by a re-plan")  # fmt: skip
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("operands")
    bottom.set_xlim(0, steps)
    bottom.legend(loc="upper right")
    return _png(fig)


def forecast_figure(rows: Sequence[Mapping], noise: float | None, title: str) -> bytes:
    """A forecast: every plan's average bits against its predicted gap to FP32 with its interval; the plans
    no other plan beats in both (fewer or equal bits and a smaller predicted gap) joined as the front and
    labelled in bold; numscope's own plans starred. The band is ± twice FP32's seed-to-seed standard
    deviation where it was measured. rows: ``name``, ``bits``, ``gap``, ``low``, ``high``, ``numscope``."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    finite = [r for r in rows if math.isfinite(r["gap"])]
    front = []
    for row in sorted(finite, key=lambda r: (r["bits"], r["gap"])):
        if not front or row["gap"] < front[-1]["gap"]:
            front.append(row)
    on_front = {id(r) for r in front}
    if front:
        ax.plot(
            [r["bits"] for r in front],
            [r["gap"] for r in front],
            color="#2ca02c",
            linewidth=1.2,
            alpha=0.6,
            label="front (fewest bits for its gap)",
            zorder=1,
        )
    for row in finite:
        ours = bool(row.get("numscope"))
        colour = "#d62728" if ours else _BAR_COLOUR
        low, high = row["gap"] - row["low"], row["high"] - row["gap"]
        ax.errorbar(
            row["bits"],
            row["gap"],
            yerr=[[max(low, 0.0)], [max(high, 0.0)]],
            fmt="*" if ours else "o",
            color=colour,
            markersize=11 if ours else 6,
            capsize=2,
            zorder=3,
        )
        ax.annotate(
            row["name"],
            (row["bits"], row["gap"]),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
            fontweight="bold" if id(row) in on_front else "normal",
        )
    if noise is not None and math.isfinite(noise):
        ax.axhspan(-2 * noise, 2 * noise, color="#222222", alpha=0.07, label="±2 sd FP32 seed noise")
    ax.axhline(0.0, color=_REFERENCE_COLOUR, linewidth=0.8)
    ax.set_xlabel("average bits per GEMM operand element")
    ax.set_ylabel("predicted validation-loss gap to FP32 (nats)")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=7)
    return _png(fig)


def _short_site(name: str) -> str:
    """A site name shortened for an axis: the path before a transformer layer's index dropped
    (``bert.encoder.layer.0.attention.self.query`` → ``L0.attention.self.query``); other names whole."""
    import re

    return re.sub(r"^.*?\b(?:layers|layer|h|blocks|block)\.(\d+)\.", r"L\1.", name)


def localize_figure(data: Mapping, title: str) -> bytes:
    """A localization (:mod:`numscope.diagnose.localize`): two heat maps, sites × recorded steps, of the error
    the plan's casts add at each site and of how far the gradient arriving at each site has drifted from
    FP32's (log colour scale), and the ranked attribution: each site's effect on the final validation loss
    with its 95% interval, the sites beyond FP32's seed noise in red, the noise shaded.
    data: :meth:`numscope.diagnose.Localization.to_dict`."""
    drift = data["drift"]
    sites, steps = drift["sites"], drift["steps"]
    fig, axes = plt.subplots(
        1,
        3,
        figsize=(16, max(4.0, 0.28 * len(sites) + 1.5)),
        gridspec_kw={"width_ratios": [1, 1, 1.1], "wspace": 0.35},
    )
    panels = (("local", "relative error the plan's casts add"), ("grad_output", "incoming gradient's drift"))
    for ax, (figure, label) in zip(axes[:2], panels, strict=True):
        rows = drift["figures"][figure]
        grid = np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=float).T
        positive = grid[np.isfinite(grid) & (grid > 0)]
        floor = float(positive.min()) if positive.size else 1e-6
        shown = np.where(np.isfinite(grid), np.maximum(grid, floor), np.nan)
        top = float(np.nanmax(shown)) if np.isfinite(shown).any() else 1.0
        image = ax.imshow(
            shown,
            aspect="auto",
            cmap="magma",
            norm=mcolors.LogNorm(vmin=floor, vmax=max(top, floor * 1.0001)),
            interpolation="nearest",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, len(sites) - 0.5, -0.5) if steps else None,
        )
        ax.grid(False)
        ax.set_yticks(range(len(sites)))
        ax.set_yticklabels([_short_site(s) for s in sites] if ax is axes[0] else [], fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.04)
    ax = axes[2]
    rows = data["attributions"]
    noise = data.get("fp32_seed_sd")
    y = np.arange(len(rows))
    for k, row in enumerate(rows):
        interval = row["interval"]
        low, high = interval if interval is not None else (row["mean"], row["mean"])
        ax.errorbar(
            row["mean"],
            k,
            xerr=[[max(row["mean"] - low, 0.0)], [max(high - row["mean"], 0.0)]],
            fmt="o",
            color="#d62728" if row["named"] else _BAR_COLOUR,
            capsize=3,
        )
    if noise is not None and math.isfinite(noise):
        ax.axvspan(-noise, noise, color="#222222", alpha=0.08, label="± FP32 seed sd")
        ax.legend(loc="lower right", fontsize=7)
    ax.axvline(0.0, color=_REFERENCE_COLOUR, linewidth=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels([_short_site(r["site"]) for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the largest effect on top
    ax.yaxis.tick_right()  # clear of the gradient map's colour bar
    ax.set_xlabel("effect on validation loss (nats): plan − plan with the site in FP32")
    ax.set_title("attribution (95% interval over seeds)", fontsize=9)
    fig.suptitle(title)
    return _png(fig)


def band_figure(data: Mapping, title: str, compared: Mapping | None = None) -> bytes:
    """A recipe's emulated gap band (:mod:`numscope.diagnose.band`): each seed's smoothed gap to FP32, the
    band's mean and edges; with ``compared`` (``steps`` and ``gap``, the smoothed gap of a user's runs, and
    ``left_at``) that gap over it, the step it leaves the band marked. data: ``Band.to_dict()`` (``curves``:
    each seed's smoothed gap)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = data["steps"]
    window = data["settings"]["window"]
    for k, curve in enumerate(data["curves"].values()):
        ax.plot(
            steps,
            curve,
            color=_BAR_COLOUR,
            linewidth=0.8,
            alpha=0.6,
            label="emulated seeds" if k == 0 else None,
        )
    ax.fill_between(steps, data["lower"], data["upper"], color="#1f77b4", alpha=0.15,
                    label=f"band ({int(data['settings']['level'] * 100)}% for one more seed)")  # fmt: skip
    ax.plot(steps, data["mean"], color="#1f77b4", linewidth=1.2, label="mean")
    if compared is not None:
        ax.plot(compared["steps"], compared["gap"], color="#d62728", linewidth=1.2, label="your runs")
        if compared.get("left_at") is not None:
            ax.axvline(compared["left_at"], color="#d62728", linestyle="--", linewidth=0.9,
                       label=f"leaves the band (step {compared['left_at']})")  # fmt: skip
    ax.axhline(0.0, color=_REFERENCE_COLOUR, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training-loss gap to FP32 (nats, mean of {window} steps)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=7)
    return _png(fig)
