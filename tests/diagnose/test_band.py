"""The emulated gap band and the judgement of a user's pair of runs against it."""

from __future__ import annotations

import csv
import math
import random
import re
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from numscope.diagnose import Band, BandError, BandSettings
from numscope.diagnose.band import smooth, t_quantile


def _band(settings: BandSettings | None = None) -> Band:
    """Three seeds' gaps: a slow drift up to 0.1 nats with seed-to-seed offsets of ±0.01."""
    steps = list(range(1, 101))
    gaps = {seed: [0.001 * s + 0.01 * (seed - 1) * math.sin(s / 7) for s in steps] for seed in range(3)}
    return Band("fp8", steps, gaps, settings or BandSettings(window=5))


def test_the_band_is_the_prediction_interval_of_one_more_seed() -> None:
    band = _band()
    curves = [smooth(gaps, 5) for gaps in band.gaps.values()]
    at = 50
    values = [curve[at] for curve in curves]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    half = t_quantile(band.settings.level, 2) * sd * math.sqrt(1 + 1 / 3)
    assert band.mean[at] == pytest.approx(mean)
    assert (band.lower[at], band.upper[at]) == pytest.approx((mean - half, mean + half))
    wider = _band(BandSettings(window=5, tolerance=0.05))
    assert wider.upper[at] == pytest.approx(band.upper[at] + 0.05)
    step, half_width = band.widest()
    halves = [(u - lo) / 2 for lo, u in zip(band.lower, band.upper, strict=True)]
    assert half_width == max(halves) and band.steps.index(step) == halves.index(max(halves))
    assert wider.widest()[1] == pytest.approx(half_width + 0.05)
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    with pytest.raises(BandError, match="2 or more seeds"):
        Band("fp8", [1, 2], {0: [0.0, 0.0]}, BandSettings(window=1))


def test_a_gap_inside_stays_inside_and_a_jump_is_found_at_its_step() -> None:
    band = _band()
    reference = {s: 5.0 - 0.01 * s for s in band.steps}
    inside = {s: reference[s] + band.mean[s - 1] for s in band.steps}
    verdict = band.compare(reference, inside)
    assert verdict.inside and verdict.left_at is None and verdict.judged == (1, 100)
    jumped = {s: v + (0.3 if s >= 60 else 0.0) for s, v in inside.items()}
    verdict = band.compare(reference, jumped)
    assert not verdict.inside and verdict.direction == "above"
    assert 60 <= verdict.left_at <= 60 + 5 and verdict.onset == 60
    assert "leaves the band above it at step" in verdict.says()
    every_tenth = {s: v for s, v in jumped.items() if s % 10 == 0}
    verdict = band.compare({s: reference[s] for s in every_tenth}, every_tenth)
    assert not verdict.inside and verdict.left_at in (60, 70)
    beyond = {**{s: inside[s] for s in band.steps}, 150: 9.0}
    assert band.compare({**reference, 150: 1.0}, beyond).not_judged == 1


def test_settings_and_short_logs_are_refused_with_what_is_allowed() -> None:
    with pytest.raises(BandError, match=r"level must be one of 0\.95, 0\.99"):
        BandSettings(level=0.9)
    with pytest.raises(BandError, match="seeds must be an integer >= 2"):
        BandSettings(seeds=1)
    band = _band()
    with pytest.raises(BandError, match="share 2 steps"):
        band.compare({1: 1.0, 2: 1.0}, {1: 1.1, 2: 1.1})


def _shifted_log(source: Path, target: Path, from_step: int, by: float) -> Path:
    with source.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        if int(row["step"]) >= from_step:
            row["loss"] = f"{float(row['loss']) + by:.5f}"
    with target.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return target


@pytest.mark.slow
def test_a_genuine_seed_stays_inside_and_a_planted_jump_leaves_at_its_step(tmp_path: Path) -> None:
    """Three seeds of FP32 and fp8 on the tiny BERT make the band; a fourth seed's real pair of runs (through
    the command line, its logs as the user has them) stays inside it; the same logs with the fp8 run's loss
    raised by 0.3 nats from step 30 on (a software bug) leave it there (its onset found at step 30)."""
    from checkpoints import cli, write_text

    text = write_text(tmp_path / "text.txt", paragraphs=150)
    run = ["--model", "tiny-bert", "--text", text, "--seq-len", 32, "--batch-size", 8, "--steps", 40]
    run += ["--warmup-steps", 5, "--eval-every", 40, "--val-blocks", 16, "--vocab-size", 200]
    run += ["--cache", tmp_path / "cache", "--no-progress"]
    code, out, err = cli("band", *run, "--plan", "fp8", "--out", tmp_path / "band")
    assert code == 0, err
    assert "fp8 against FP32 over 3 seeds" in out
    assert re.search(r"widest at step \d+: ±\d+\.\d{4} nats", out), out
    assert (tmp_path / "band" / "band.png").stat().st_size > 10_000
    for name, plan in (("fp32", "fp32"), ("fp8", "fp8")):
        code, _, err = cli("train", *run, "--plan", plan, "--seed", 3, "--out", tmp_path / "mine" / name)
        assert code == 0, err
    high, low = tmp_path / "mine" / "fp32" / "log.csv", tmp_path / "mine" / "fp8" / "log.csv"
    code, out, err = cli("band", *run, "--plan", "fp8", "--out", tmp_path / "band", "--compare", high, low)
    assert code == 0, err
    assert "the gap stays inside the band over steps 1–40" in out
    bug = _shifted_log(low, tmp_path / "bug.csv", from_step=30, by=0.3)
    code, out, err = cli("band", *run, "--plan", "fp8", "--out", tmp_path / "band", "--compare", high, bug)
    assert code == 1, err
    left = re.search(r"leaves the band above it at step (\d+) \(the change began near step (\d+)", out)
    assert left is not None, out
    assert (
        30 <= int(left.group(1)) <= 32 and int(left.group(2)) == 30
    )  # the trailing mean takes a step or two
    assert (tmp_path / "band" / "band_compared.png").is_file()
    saved = Band.load(tmp_path / "band")
    assert saved.compare(high, low).inside and sorted(saved.gaps) == [0, 1, 2]
    stricter = Band.load(tmp_path / "band", replace(BandSettings(), window=1, persist=1))
    assert stricter.settings.window == 1 and stricter.settings.seeds == 3


def _ar_curves(
    rng: random.Random, seeds: int, steps: int, phi: float, scale: float
) -> dict[int, list[float]]:
    """Gap curves whose seed-to-seed deviations follow an AR(1) process over the steps (correlation ``phi``
    from one step to the next) around a common drift."""
    curves = {}
    for seed in range(seeds):
        value, curve = rng.gauss(0, 1), []
        for step in range(steps):
            value = phi * value + math.sqrt(1 - phi * phi) * rng.gauss(0, 1)
            curve.append(0.001 * step + scale * value)
        curves[seed] = curve
    return curves


def test_the_pooled_band_earns_degrees_of_freedom_only_where_the_deviations_decorrelate() -> None:
    rng = random.Random(0)
    steps = list(range(1, 401))
    pooled = BandSettings(window=1, variance="pooled")
    loose = Band("fp8", steps, _ar_curves(rng, 3, 400, 0.0, 0.01), pooled)
    pointwise = Band("fp8", steps, loose.gaps, BandSettings(window=1))
    assert min(loose.dofs) > 20 and pointwise.dofs == [2.0] * 400

    def median_half(band: Band) -> float:
        return statistics.median((u - lo) / 2 for lo, u in zip(band.lower, band.upper, strict=True))

    assert median_half(loose) < median_half(pointwise) / 2  # t 9.9 with 2 dof against about 2.6
    offsets = {seed: [0.01 * (seed - 1) + 1e-6 * rng.gauss(0, 1) for _ in steps] for seed in range(3)}
    persistent = Band("fp8", steps, offsets, pooled)
    assert max(persistent.dofs) <= 3  # seeds that stay apart all run long are three seeds, not 1,200 points


@pytest.mark.parametrize("phi", [0.0, 0.9, 0.99])
def test_the_pooled_band_covers_one_more_seed_as_its_level_says(phi: float) -> None:
    """Bands of 3 seeds from an AR(1) process hold a fourth seed's curve at a step about as often as their
    level says (Monte Carlo over 400 bands), from white deviations to ones that persist for 100 steps."""
    rng = random.Random(1)
    settings = BandSettings(window=1, variance="pooled", level=0.95)
    steps = list(range(1, 201))
    inside = 0
    for _ in range(400):
        curves = _ar_curves(rng, 4, 200, phi, 0.01)
        held_out = curves.pop(3)
        made = Band("fp8", steps, curves, settings)
        inside += made.lower[150] <= held_out[150] <= made.upper[150]
    assert 0.92 <= inside / 400 <= 0.99, inside / 400
