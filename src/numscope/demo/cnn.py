"""``numscope demo --workload cnn``: the first seed's breadth, a convolutional image classifier.

Micikevicius et al. (ICLR 2018) report mixed precision on CNNs first. This demo trains a small CNN (three
convolutions with BatchNorm, a linear head) on scikit-learn's bundled handwritten digits (1,797 images of
8×8 pixels, 10 classes; ``sklearn.datasets.load_digits``, no download) under fp32 (observed), fp16 without
and with dynamic loss scaling, fp8 (TE's hybrid) and the plan numscope recommends from the fp32 analysis,
each over several seeds, so that every gap is read against the seed noise of fp32 itself.

Outputs in the folder: ``runs/NAME-sSEED/`` (``result.json``, the curve), ``analysis/``, ``plan.yaml``,
``summary.json`` and ``report.html`` (loss curves, the plan, the analysis's views).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from numscope._atomic import atomic_write_text
from numscope.convert import convert, site_sizes
from numscope.plan import Plan
from numscope.train.loss_scaler import LossScaler

#: name, plan (a preset, or the recommended plan's file), loss scaling
RUNS: tuple[tuple[str, str, str], ...] = (
    ("fp32", "fp32", "none"),
    ("fp16", "fp16", "none"),
    ("fp16+scaling", "fp16", "dynamic"),
    ("fp8", "fp8", "none"),
    ("recommended", "plan.yaml", "dynamic"),
)
CANDIDATES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "int8", "mxfp4_e2m1")


@dataclass(frozen=True)
class CNNConfig:
    """The CNN demo's settings (steps of ``batch_size`` images; ``seeds`` per run; observe ``every``)."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    seeds: tuple[int, ...] = (0, 1, 2)
    eval_every: int = 25
    every: int = 10
    width: int = 16

    @classmethod
    def quick(cls) -> CNNConfig:
        return cls(steps=60, seeds=(0, 1), eval_every=20, every=10)


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and validation images (N, 1, 8, 8), standardised, and labels: 80% / 20% of a fixed shuffle."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise RuntimeError("the CNN demo's data ships with scikit-learn: pip install scikit-learn") from error

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    split = int(0.8 * len(labels))
    mean, std = images[:split].mean(), images[:split].std()
    images = (images - mean) / std
    return images[:split], labels[:split], images[split:], labels[split:]


def small_cnn(width: int = 16) -> nn.Module:
    """Three 3×3 convolutions with BatchNorm and ReLU, one 2×2 max-pool, a linear head over 10 classes."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Flatten(), nn.Linear(2 * width * 16, 10),
    )  # fmt: skip


def evaluate_images(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Validation cross-entropy (nats) and accuracy (0–1), in evaluation mode."""
    training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(images)
    model.train(training)
    return F.cross_entropy(logits, labels).item(), (logits.argmax(-1) == labels).float().mean().item()


def train_one(
    plan: Plan,
    loss_scaling: str,
    config: CNNConfig,
    seed: int,
    data: tuple[torch.Tensor, ...],
    observer: Callable[[nn.Module], Any] | None = None,
) -> dict[str, Any]:
    """One run: the CNN from ``seed``, converted to ``plan``, AdamW over shuffled batches; its result."""
    train_x, train_y, val_x, val_y = data
    torch.manual_seed(seed)
    model = small_cnn(config.width)
    watching = observer(model) if observer is not None else None
    convert(model, plan, generator=torch.Generator().manual_seed(seed), compiled=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    scaler = LossScaler(enabled=loss_scaling != "none", dynamic=loss_scaling == "dynamic")
    order = torch.Generator().manual_seed(1000 + seed)
    curve, log, start = [], [], time.perf_counter()
    for step in range(1, config.steps + 1):
        batch = torch.randint(0, len(train_y), (config.batch_size,), generator=order)
        loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if watching is not None:
            watching.step()
        log.append({"step": step, "loss": loss.item(), "scale": scaler.get_scale()})
        if step % config.eval_every == 0 or step == config.steps:
            val_loss, val_accuracy = evaluate_images(model, val_x, val_y)
            curve.append({"step": step, "val_loss": val_loss, "val_accuracy": val_accuracy})
    sizes = site_sizes(model)
    result = {
        "plan": plan,
        "val_loss": curve[-1]["val_loss"],
        "val_accuracy": curve[-1]["val_accuracy"],
        "skipped_steps": scaler.skipped_steps,
        "wall_seconds": time.perf_counter() - start,
        "steps": config.steps,
        "curve": curve,
        "train_log": log,
        "avg_bits": plan.average_bits(sizes) if sizes else None,
    }
    if watching is not None:
        watching.__exit__(None, None, None)
        result["analysis"] = watching.analysis()
    return result


def _spread(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def run_cnn_demo(out: Path, config: CNNConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run of the CNN demo into ``out``; returns the summary (also ``out/summary.json``)."""
    from numscope.advisor import recommend
    from numscope.observe import observe
    from numscope.report import write_report

    data = digits()
    log(f"[data] {len(data[1])} training and {len(data[3])} validation digits (8x8); "
        f"{config.steps} steps of {config.batch_size}, seeds {list(config.seeds)}")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    observed = train_one(
        Plan.uniform("fp32"), "none", config, config.seeds[0], data,
        lambda model: observe(model, candidates=CANDIDATES, every=config.every).__enter__(),
    )  # fmt: skip
    analysis = observed.pop("analysis")
    analysis.save(out / "analysis")
    plan = recommend(analysis)
    plan.save(out / "plan.yaml")
    results: dict[str, list[dict[str, Any]]] = {}
    for name, plan_name, scaling in RUNS:
        run_plan = plan if plan_name == "plan.yaml" else Plan.uniform(plan_name)
        for seed in config.seeds:
            result = observed if (name, seed) == ("fp32", config.seeds[0]) else train_one(
                run_plan, scaling, config, seed, data
            )  # fmt: skip
            result.update(name=name, plan=plan_name, loss_scaling=scaling, seed=seed)
            folder = out / "runs" / f"{name}-s{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(
                folder / "result.json",
                json.dumps({k: v for k, v in result.items() if k != "train_log"}, default=str),
            )
            results.setdefault(name, []).append(result)
            loss, accuracy = result["val_loss"], result["val_accuracy"]
            log(f"[{name} seed {seed}] val loss {loss:.4f}, accuracy {accuracy:.2%}")
    reference_losses = [r["val_loss"] for r in results["fp32"]]
    noise = _spread(reference_losses)[1]
    rows = []
    for name, runs in results.items():
        loss, loss_sd = _spread([r["val_loss"] for r in runs])
        accuracy, accuracy_sd = _spread([r["val_accuracy"] for r in runs])
        gap = loss - statistics.fmean(reference_losses)
        beyond = abs(gap) > 2 * noise if noise > 0 else gap != 0
        rows.append({
            "run": name, "val loss": f"{loss:.4f} ± {loss_sd:.4f}",
            "val acc": f"{accuracy:.2%} ± {accuracy_sd:.2%}",
            "gap to fp32": f"{gap:+.4f}" + (" (beyond 2σ)" if beyond and name != "fp32" else ""),
            "avg bits": "—" if runs[0]["avg_bits"] is None else f"{runs[0]['avg_bits']:.2f}",
            "skipped": str(sum(r["skipped_steps"] for r in runs)),
        })  # fmt: skip
    summary = {
        "config": asdict(config),
        "seeds": list(config.seeds),
        "fp32_seed_noise_nats": noise,
        "rows": rows,
        "runs": {name: [{k: v for k, v in r.items() if k not in ("train_log", "plan")} for r in runs]
                 for name, runs in results.items()},
    }  # fmt: skip
    report_runs = []
    for runs in results.values():
        first = dict(runs[0])
        first["val_loss"] = statistics.fmean(r["val_loss"] for r in runs)
        first["val_accuracy"] = statistics.fmean(r["val_accuracy"] for r in runs)
        first["avg_bits"] = runs[0]["avg_bits"]
        report_runs.append({k: v for k, v in first.items() if k != "plan"} | {"plan": runs[0]["plan"]})
    report = write_report(
        out / "report.html",
        title="numscope CNN demo: handwritten digits",
        runs=report_runs,
        analysis=analysis,
        plan=plan,
        loss_label="cross-entropy",
        command="numscope demo --workload cnn",
    )
    summary["report"] = str(report)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1, default=str))
    return summary


def noise_note(summary: dict[str, Any]) -> str:
    """One line: the seed noise every gap is read against."""
    seeds = len(summary["seeds"])
    return (
        f"fp32's validation loss varies by {summary['fp32_seed_noise_nats']:.4f} nats (standard deviation "
        f"over {seeds} seeds); a gap is marked 'beyond 2σ' only when it exceeds twice that"
        + ("" if math.isfinite(summary["fp32_seed_noise_nats"]) else " (not measured)")
    )
