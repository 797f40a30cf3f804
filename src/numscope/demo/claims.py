"""The demo's claims, each checked against what its runs measured and printed as held or not held, and its
summary table; the thresholds they are judged by and the names of the runs they compare."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from numscope._names import parse_seed_run, seed_run_name
from numscope.run.config import RunSpec

WITHIN_PERCENT = 1.0
"""A run "reaches FP32's validation loss" when its loss is at most this many percent above FP32's."""

LEARNED_MARGIN_NATS = 0.05
"""FP32 "learned from context" when its validation loss is at least this far below the context-free loss."""

NOISE_SIGMAS = 2.0
"""A difference between two runs counts ("A falls behind B") only beyond this many standard deviations of
FP32's seed-to-seed validation loss."""

FLUSH_CLAIM_PERCENT = 1.0
""""fp16 alone loses gradient information" when, at some site, it flushes at least this share (%) of the
nonzero gradient values entering the GEMM."""


REFERENCE = RunSpec("fp32", "fp32", description="the reference: every GEMM in fp32")
RECOMMENDED = "recommended"


E5M2_UNSCALED, E5M2_SCALED = "e5m2-grads", "e5m2-grads+scaling"
"""The loss-scaling pair: gradients in FP8 E5M2 with no scale of their own, without and with loss scaling."""


UNIFORM_8BIT = ("fp8", "mxfp8", "int8")
"""The uniform 8-bit baselines the recommended plan is compared with (FP8 is the claim's bar)."""


def recommended_pairs(rows: Sequence[dict[str, Any]]) -> list[tuple[str, float]]:
    """(seed, recommended − fp32 validation loss in nats) for every seed both were trained from: the main
    runs (``"main"``: the config's seed) and each ``recommended-seedN`` with its ``fp32-seedN``."""
    by = {r["name"]: r for r in rows}
    pairs = []
    if RECOMMENDED in by and REFERENCE.name in by:
        pairs.append(("main", by[RECOMMENDED]["val_loss"] - by[REFERENCE.name]["val_loss"]))
    for name, row in by.items():
        seeded = parse_seed_run(name)
        if seeded is not None and seeded[0] == RECOMMENDED:
            fp32 = by.get(seed_run_name(REFERENCE.name, seeded[1]))
            if fp32 is not None:
                pairs.append((f"seed{seeded[1]}", row["val_loss"] - fp32["val_loss"]))
    return pairs


HEURISTIC = "last-layers"


def _scale_text(scale: float) -> str:
    """A loss scale as 2^k when it is a power of two, else as a number."""
    if scale > 0 and math.isfinite(scale) and math.log2(scale).is_integer():
        return f"2^{int(math.log2(scale))}"
    return f"{scale:g}"


def _claims(
    rows: list[dict[str, Any]],
    underflow: list[dict[str, Any]],
    unigram: float | None = None,
    default_bits: float | None = None,
    noise: float | None = None,
    e5m2_underflow: list[dict[str, Any]] | None = None,
    target_fp8: tuple[str, float] | None = None,
) -> list[tuple[str, bool]]:
    """The demo's claims, each checked against what this run measured and stated either way.

    underflow, e5m2_underflow: per site, the share of gradient values fp16 (FP8 E5M2) flushes, without and
    with the loss scale of the scaled fp16 (E5M2) run (:func:`fp16_underflow_by_site`).

    noise: FP32's seed-to-seed standard deviation of the validation loss (nats). With it, every
    comparison says where it stands against the noise, and "A falls behind B" needs the difference to
    exceed :data:`NOISE_SIGMAS` times it.

    target_fp8: (the plan's target, the average bits of that stack's uniform FP8 recipe on this model): the
    bar the plan's bits are held to; without it, the uniform fp8 run's."""
    by = {r["name"]: r for r in rows}
    fp32 = by["fp32"]["val_loss"]

    def gap(name: str) -> float:
        return 100.0 * (by[name]["val_loss"] - fp32) / fp32

    def beyond(a: str, b: str) -> bool:
        """a's loss exceeds b's by more than the noise (any amount when the noise is unknown)."""
        margin = NOISE_SIGMAS * noise if noise is not None else 0.0
        return by[a]["val_loss"] - by[b]["val_loss"] > margin

    def against_noise(a: str, b: str) -> str:
        if noise is None:
            return ""
        diff = by[a]["val_loss"] - by[b]["val_loss"]
        sigmas = abs(diff) / noise if noise > 0 else math.inf
        where = "beyond" if sigmas > NOISE_SIGMAS else "within"
        return f"{a} − {b} {diff:+.4f} nats = {sigmas:.1f} sd, {where} the seed noise"

    def verdict(held: bool) -> str:
        return "holds" if held else "does NOT hold"

    claims: list[tuple[str, bool]] = []
    if unigram is not None:
        learned = fp32 <= unigram - LEARNED_MARGIN_NATS
        claims.append(
            (
                f"FP32 learned from context: validation loss {fp32:.3f} nats against {unigram:.3f} for a "
                f"model that ignores context (the training set's token frequencies), {fp32 - unigram:+.3f} "
                f"nats — the claim (at least {LEARNED_MARGIN_NATS:g} nats below) {verdict(learned)}; the "
                "gaps below mean something only when it does.",
                learned,
            )
        )
    rec, fp8 = by[RECOMMENDED], by["fp8"]
    paired = recommended_pairs(rows)
    if len(paired) >= 3 and noise is not None:
        # paired with FP32 seed by seed: not behind beyond 2 sd of the paired differences, and no single
        # seed behind by more than 2 sd of FP32's (unpaired) seed noise: a run stuck on one seed counts
        diffs = [d for _, d in paired]
        mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
        held = mean <= NOISE_SIGMAS * sd and max(diffs) <= NOISE_SIGMAS * noise
        bar = (
            f"like FP32 paired seed by seed (mean difference within {NOISE_SIGMAS:g} sd of the paired "
            f"differences, and no seed behind by more than {NOISE_SIGMAS:g} sd of FP32's seed noise)"
        )
    elif noise is not None:  # the plan trains like FP32: its loss within the seed noise of FP32's
        held = not beyond(RECOMMENDED, "fp32")
        bar = f"within {NOISE_SIGMAS:g} sd of FP32's seed noise"
    else:
        held = gap(RECOMMENDED) <= WITHIN_PERCENT
        bar = f"within {WITHIN_PERCENT:g}% of FP32"
    bar_name, bar_bits = "uniform FP8", fp8["avg_bits"]
    if target_fp8 is not None:
        bar_name, bar_bits = f"{target_fp8[0]}'s own uniform FP8", target_fp8[1]
    fewer = "fewer" if rec["avg_bits"] < bar_bits else "no fewer"
    default = ""
    if default_bits is not None:
        default = f" (under the advisor's default limits the plan would need {default_bits:.2f} bits)"
    others = [name for name in UNIFORM_8BIT if name != "fp8" and name in by]
    also = ""
    if others:
        also = "; the other uniform 8-bit runs: " + ", ".join(
            f"{name.upper()} {gap(name):+.2f}% at {by[name]['avg_bits']:.2f} bits" for name in others
        )
    noise_text = ""
    seeds = 1 + sum(name.startswith("fp32-seed") for name in by)
    if noise is not None:
        noise_text = (
            f"; FP32's seed noise is {noise:.4f} nats (sd over {seeds} seeds): "
            f"{against_noise(RECOMMENDED, 'fp32')}, {against_noise(RECOMMENDED, 'fp8')}"
        )
    if len(paired) >= 3 and noise is not None:
        per_seed = ", ".join(f"{seed} {d:+.4f}" for seed, d in paired)
        noise_text += (
            f"; paired with FP32 on {len(paired)} seeds (same initialisation, batches and masks), "
            f"recommended − fp32 = {mean:+.4f} ± {sd:.4f} nats ({per_seed})"
        )
    claims.append(
        (
            f"Recommended plan: gap to FP32 {gap(RECOMMENDED):+.2f}% at {rec['avg_bits']:.2f} average bits "
            f"per GEMM operand element, against {bar_name}'s {bar_bits:.2f} bits"
            + (" (attention products high in both)" if target_fp8 is not None else "")
            + f" (the uniform fp8 run: {fp8['avg_bits']:.2f} bits, gap {gap('fp8'):+.2f}%{also})"
            f"{default}{noise_text} — the claim, the plan trains {bar} with fewer bits, "
            f"{verdict(held and fewer == 'fewer')}; it uses {fewer} bits than {bar_name}.",
            held and fewer == "fewer",
        )
    )
    if HEURISTIC in by:
        claims.append(_heuristic_claim(rows))
    if underflow:
        worst = max(underflow, key=lambda r: r["before%"])
        mean_before = sum(r["before%"] for r in underflow) / len(underflow)
        mean_after = sum(r["after%"] for r in underflow) / len(underflow)
        loses = worst["before%"] >= FLUSH_CLAIM_PERCENT
        scale = by["fp16+scaling"]["final_scale"]
        claims.append(
            (
                f"FP16 without loss scaling flushes to zero {mean_before:.2f}% of the gradient values "
                f"entering a GEMM, averaged over the {len(underflow)} sites "
                f"(worst {worst['before%']:.2f}% at {worst['site']}); at the loss scale "
                f"{_scale_text(scale)} it is {mean_after:.2f}% — the claim that fp16 alone loses "
                f"gradient information (at least {FLUSH_CLAIM_PERCENT:g}% flushed at some site) "
                f"{verdict(loses)}.",
                loses,
            )
        )
    bar = f"{WITHIN_PERCENT:g}%" if noise is None else f"{NOISE_SIGMAS:g} sd of FP32's seed noise"
    if noise is not None:
        recovered = not beyond("fp16+scaling", "fp32")
    else:
        recovered = gap("fp16+scaling") <= WITHIN_PERCENT
    claims.append(
        (
            f"FP16 with dynamic loss scaling (the 2018 paper's recipe for the GEMMs): gap to FP32 "
            f"{gap('fp16+scaling'):+.2f}% ({by['fp16+scaling']['skipped_steps']} skipped steps"
            + (f"; {against_noise('fp16+scaling', 'fp32')}" if noise is not None else "")
            + f") — the claim that it trains like FP32 (within {bar}) "
            f"{verdict(recovered)}.",
            recovered,
        )
    )
    if E5M2_UNSCALED in by and E5M2_SCALED in by:
        if noise is not None:
            fails, trains = beyond(E5M2_UNSCALED, "fp32"), not beyond(E5M2_SCALED, "fp32")
        else:
            fails, trains = gap(E5M2_UNSCALED) > WITHIN_PERCENT, gap(E5M2_SCALED) <= WITHIN_PERCENT
        flushed = ""
        if e5m2_underflow:
            before = sum(r["before%"] for r in e5m2_underflow) / len(e5m2_underflow)
            after = sum(r["after%"] for r in e5m2_underflow) / len(e5m2_underflow)
            flushed = (
                f"; unscaled, E5M2 flushes to zero {before:.2f}% of the gradient values entering a GEMM "
                f"(averaged over the {len(e5m2_underflow)} sites), at the run's final loss scale "
                f"{_scale_text(by[E5M2_SCALED]['final_scale'])} {after:.2f}%"
            )
        scaled_row = by[E5M2_SCALED]
        claims.append(
            (
                "Loss scaling where gradients underflow: every GEMM's gradient in FP8 E5M2 with no scale of "
                "its own (fp16's exponent range, smallest subnormal 2^-16), the rest FP32: without loss "
                f"scaling gap to FP32 {gap(E5M2_UNSCALED):+.2f}%"
                + (f" ({against_noise(E5M2_UNSCALED, 'fp32')})" if noise is not None else "")
                + f", with dynamic loss scaling {gap(E5M2_SCALED):+.2f}% ({scaled_row['skipped_steps']} "
                "skipped steps"
                + (f"; {against_noise(E5M2_SCALED, 'fp32')}" if noise is not None else "")
                + f"){flushed} — the claim that loss scaling is what lets these gradients train (unscaled "
                f"behind FP32 by more than {bar}, scaled not) "
                f"{verdict(fails and trains)}.",
                fails and trains,
            )
        )
    behind = gap("mxfp4") > max(WITHIN_PERCENT, gap(RECOMMENDED)) and beyond("mxfp4", RECOMMENDED)
    margin = f" by more than {NOISE_SIGMAS:g} sd of seed noise" if noise is not None else ""
    claims.append(
        (
            f"Uniform MXFP4: gap to FP32 {gap('mxfp4'):+.2f}% at {by['mxfp4']['avg_bits']:.2f} bits, against "
            f"the per-site plan's {gap(RECOMMENDED):+.2f}% at {rec['avg_bits']:.2f} bits"
            + (f" ({against_noise('mxfp4', RECOMMENDED)})" if noise is not None else "")
            + f" — the claim that uniform low bits fall behind per-site choice (a gap above both "
            f"{WITHIN_PERCENT:g}% and the plan's{margin}) {verdict(behind)}.",
            behind,
        )
    )
    return claims


def _heuristic_claim(rows: Sequence[dict[str, Any]]) -> tuple[str, bool]:
    """numscope's plan against the last-layers heuristic at the same budget, paired seed by seed: it holds
    unless the plan is behind beyond 2 sd of the paired differences (a tie holds, and is called a tie)."""
    by = {r["name"]: r for r in rows}
    pairs = [("main", by[RECOMMENDED]["val_loss"] - by[HEURISTIC]["val_loss"])]
    for name, row in by.items():
        seeded = parse_seed_run(name)
        if seeded is not None and seeded[0] == RECOMMENDED:
            other = by.get(seed_run_name(HEURISTIC, seeded[1]))
            if other is not None:
                pairs.append((f"seed{seeded[1]}", row["val_loss"] - other["val_loss"]))
    diffs = [d for _, d in pairs]
    per_seed = ", ".join(f"{seed} {d:+.4f}" for seed, d in pairs)
    bits = f"{by[RECOMMENDED]['avg_bits']:.2f} and {by[HEURISTIC]['avg_bits']:.2f} bits"
    if len(diffs) < 3:
        return (
            f"Against the last-layers heuristic at the same budget ({bits}): recommended − last-layers "
            f"{per_seed} nats — fewer than 3 seeds, so the claim that the plan ties or beats it is not "
            "tested (NOT held).",
            False,
        )
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    if mean < -NOISE_SIGMAS * sd:
        standing = "beats it beyond the noise"
    elif mean > NOISE_SIGMAS * sd:
        standing = "is behind it beyond the noise"
    else:
        standing = "ties it (within the noise)"
    held = mean <= NOISE_SIGMAS * sd
    return (
        f"Against the plan study's best heuristic at the same budget, keep the last layers high ({bits}): "
        f"paired on {len(diffs)} seeds, recommended − last-layers = {mean:+.4f} ± {sd:.4f} nats "
        f"({per_seed}); the plan {standing} — the claim that the measured plan ties or beats the guess "
        f"{'holds' if held else 'does NOT hold'}.",
        held,
    )


def summary_table(summary: dict[str, Any]) -> list[dict[str, str]]:
    rows = summary["runs"]
    fp32 = next(r for r in rows if r["name"] == "fp32")["val_loss"]
    return [
        {
            "run": r["name"],
            "val loss": f"{r['val_loss']:.4f}",
            "val acc": f"{100 * r['val_accuracy']:.2f}%",
            "gap to fp32": f"{100 * (r['val_loss'] - fp32) / fp32:+.2f}%",
            "avg bits": "—" if r.get("avg_bits") is None else f"{r['avg_bits']:.2f}",
            "skipped": str(r["skipped_steps"]),
            "wall": f"{r['wall_seconds']:.0f}s",
        }
        for r in rows
    ]
