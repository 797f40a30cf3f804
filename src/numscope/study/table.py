"""The plan study's verdicts and table: ranks, paired verdicts against numscope's plan, summaries."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from numscope.study.config import WIN_SIGMAS, PlanStudyConfig
from numscope.study.gap_models import GapModel


def _rank(rows: list[dict[str, Any]]) -> None:
    """Per budget: each plan's rank by mean gap, and its paired verdict against numscope's reference plan
    of that budget (:func:`reference_plan`)."""
    for budget in sorted({r["budget"] for r in rows if r["budget"] is not None}):
        group = sorted((r for r in rows if r["budget"] == budget), key=lambda r: r["gap_mean"])
        ours = reference_plan(group)
        for rank, row in enumerate(group, 1):
            row["rank"] = rank
            row["of"] = len(group)
            diff = np.array(row["gaps"]) - np.array(ours["gaps"])
            row["vs_numscope"] = paired_verdict(diff)


def factor_two_share(rows: Sequence[Mapping[str, Any]], field_name: str) -> str:
    """``k of n``: of the plans whose mean gap exceeds twice its paired standard deviation (a gap beyond
    the noise), how many have a prediction within a factor of 2 of it."""
    clear = [
        r
        for r in rows
        if r["gap_mean"] > 0 and math.isfinite(r["gap_sd"]) and r["gap_mean"] > 2 * r["gap_sd"]
    ]
    good = sum(1 for r in clear if 0.5 * r["gap_mean"] <= r[field_name] <= 2.0 * r["gap_mean"])
    return f"{good} of {len(clear)}"


def reference_plan(group: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The numscope plan the others of a budget are compared with: the sensitivity-driven one where the
    study made it (the advisor's best-informed choice), else the plain bit-budget one."""
    numscope = [r for r in group if r["family"] == "numscope"]
    return next((r for r in numscope if r["name"].startswith("numscope sensitivity@")), numscope[0])


def paired_verdict(differences: Sequence[float]) -> str:
    """``worse``/``better`` than the comparison when the paired differences' mean exceeds WIN_SIGMAS of
    their standard deviation over ≥ 3 seeds (positive = this plan's loss is higher), else ``tie``."""
    diff = np.asarray(differences, dtype=float)
    if len(diff) < 3:
        return "n/a (<3 seeds)"
    mean, sd = float(diff.mean()), float(diff.std(ddof=1))
    if sd == 0.0:
        return "same" if mean == 0.0 else ("worse" if mean > 0 else "better")
    if abs(mean) < WIN_SIGMAS * sd:
        return "tie"
    return "worse" if mean > 0 else "better"


def budget_summary(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per budget, where each numscope plan stands: its rank by mean gap and the paired verdicts of every
    other plan of that budget against it."""
    lines = []
    for budget in sorted({r["budget"] for r in rows if r["budget"] is not None}):
        group = [r for r in rows if r["budget"] == budget]
        for ours in (r for r in group if r["family"] == "numscope"):
            others = [r for r in group if r is not ours]
            counts = {"better": 0, "tie": 0, "worse": 0}
            for row in others:
                outcome = paired_verdict(np.array(row["gaps"]) - np.array(ours["gaps"]))
                if outcome in counts:
                    counts[outcome] += 1
            random = [r["gap_mean"] for r in group if r["family"] == "random"]
            random_text = f"; random plans {np.mean(random):+.4f} on average" if random else ""
            lines.append(
                f"- {budget:g} bits: {ours['name']} ranks {ours['rank']}/{ours['of']} "
                f"(gap {ours['gap_mean']:+.4f} ± {ours['gap_sd']:.4f}){random_text}; of the other "
                f"{len(others)} plans, {counts['worse']} are worse beyond the noise, {counts['tie']} tie and "
                f"{counts['better']} are better"
            )
    return lines


def plan_study_table(
    rows: Sequence[Mapping[str, Any]],
    noise: float,
    config: PlanStudyConfig,
    unigram: Mapping[int, float],
    fp32: Sequence[float],
    rho: float,
    gap_model: GapModel,
) -> str:
    n = len(config.seeds)
    lines = [
        f"FP32 validation loss {np.mean(fp32):.4f} ± {noise:.4f} nats (sd over {n} seeds; the context-free "
        f"loss is {np.mean(list(unigram.values())):.4f}); gaps are paired by seed, mean ± sd over {n} seeds.",
        f"low = {config.low}, high = {config.high}; 'vs numscope': this plan against numscope sensitivity "
        "(numscope's plain plan where the sensitivity one was not made), better/worse when the paired "
        "difference is beyond "
        f"{WIN_SIGMAS:g} sd counts (needs ≥ 3 seeds).",
        "",
        "| plan | family | avg bits | gap (nats) | predicted: noise | sensitivity | rank | vs numscope |",
        "|------|--------|----------|------------|------------------|-------------|------|-------------|",
    ]
    for row in sorted(rows, key=lambda r: (r["budget"] is not None, r["budget"] or 0, r["gap_mean"])):
        rank = f"{row['rank']}/{row['of']}" if "rank" in row else ""
        sd = "" if math.isnan(row["gap_sd"]) else f" ± {row['gap_sd']:.4f}"
        lines.append(
            f"| {row['name']} | {row['family']} | {row['bits']:.2f} | {row['gap_mean']:+.4f}{sd} | "
            f"{row['predicted_gap']:+.4f} | {row.get('predicted_gap_sensitivity', math.nan):+.4f} | {rank} | "
            f"{row.get('vs_numscope', '')} |"
        )
    lines += ["", *budget_summary(rows)]
    lines += [
        "",
        f"Predicted gap = {gap_model.formula()}, fitted on {gap_model.points} calibration runs; Spearman "
        f"rank correlation with the measured gap over the uniform and budget plans: {rho:.2f}.",
    ]
    return "\n".join(lines)
