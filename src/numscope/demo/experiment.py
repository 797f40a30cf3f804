"""One training run of the BERT masked-LM demo under a precision plan, resumable and logged.

The loop is the Micikevicius et al. recipe made switchable: the plan quantizes each GEMM operand (FP32
accumulation, FP32 master weights: the model's parameters stay FP32 and only GEMM operands are rounded),
softmax/layer norm/loss run in FP32, and an optional loss scaler protects small gradients. Every run writes
``log.csv`` (one row per step), ``checkpoint.pt`` (atomic) and, once finished, ``result.json``; a run whose
``result.json`` exists is not repeated, and an interrupted one resumes from its checkpoint bit for bit.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from numscope.convert import convert, load_numerics_state_dict, numerics_state_dict
from numscope.demo.data import batches, evaluate_mlm, num_batches
from numscope.demo.model import ModelConfig, bert_mlm_from_config
from numscope.demo.tokenizer import TokenizerInfo
from numscope.plan import Plan
from numscope.train.checkpoint import load_checkpoint, save_checkpoint
from numscope.train.loss_scaler import LossScaler

LOSS_SCALING = ("none", "static", "dynamic")


@dataclass(frozen=True)
class RunSpec:
    """What differs between the demo's runs: the plan and the loss scaling."""

    name: str
    plan: str  # a preset name (Plan.uniform) or a path to a plan YAML
    loss_scaling: str = "none"
    init_scale: float = 2.0**16
    description: str = ""

    def __post_init__(self) -> None:
        if self.loss_scaling not in LOSS_SCALING:
            raise ValueError(
                f"loss_scaling {self.loss_scaling!r} unknown; allowed: {', '.join(LOSS_SCALING)}"
            )

    def load_plan(self) -> Plan:
        if self.plan.endswith((".yaml", ".yml")):
            return Plan.load(self.plan)
        return Plan.uniform(self.plan)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings shared by every run of one experiment (units: steps, tokens, nats)."""

    steps: int = 300
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 50
    checkpoint_every: int = 50
    seed: int = 0

    def lr_at(self, step: int) -> float:
        """Linear warm-up then cosine decay to 10% of ``lr``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class RunResult:
    name: str
    plan: str
    loss_scaling: str
    val_loss: float
    val_accuracy: float
    skipped_steps: int
    wall_seconds: float
    steps: int
    curve: list[dict[str, float]] = field(default_factory=list)  # eval points: step, val_loss, val_accuracy
    final_scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DemoData:
    train_blocks: torch.Tensor
    val_blocks: torch.Tensor
    tokenizer: TokenizerInfo


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


class _Batches:
    """The batch of a global step: a pure function of (seed, step), so a resumed run sees the same data.

    One epoch of masked batches is built at a time and kept until the next epoch starts.
    """

    def __init__(self, data: DemoData, cfg: TrainConfig) -> None:
        self.data, self.cfg = data, cfg
        self.per_epoch = num_batches(data.train_blocks.shape[0], cfg.batch_size, drop_last=True)
        self.epoch, self.batches = -1, []

    def at(self, step: int) -> dict[str, torch.Tensor]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.batches = list(
                batches(
                    self.data.train_blocks,
                    self.cfg.batch_size,
                    self.data.tokenizer,
                    seed=self.cfg.seed,
                    epoch=epoch,
                    drop_last=True,
                )
            )
        return self.batches[index]


def _atomic_write_text(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8"
    ) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)


LOG_FIELDS = ["step", "lr", "loss", "scale", "skipped", "val_loss", "val_accuracy", "seconds"]


def train_run(
    spec: RunSpec,
    model_config: ModelConfig,
    cfg: TrainConfig,
    data: DemoData,
    out_dir: Path,
    on_step: Callable[[int, float], None] | None = None,
    observer_factory: Callable[[torch.nn.Module], Any] | None = None,
) -> RunResult:
    """Train one run (or resume it, or return its finished result) and write its files to ``out_dir``.

    on_step(step, loss) is called after every step (for progress bars).
    observer_factory(model) may return an entered observer (``numscope.observe``) whose ``step()`` is called
    once per optimizer step and whose ``analysis()`` is saved to ``out_dir/analysis`` at the end.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    result_path, checkpoint_path, log_path = (
        out_dir / "result.json",
        out_dir / "checkpoint.pt",
        out_dir / "log.csv",
    )
    if result_path.is_file():
        return RunResult(**json.loads(result_path.read_text()))

    torch.manual_seed(cfg.seed)
    model = bert_mlm_from_config(model_config)
    plan = spec.load_plan()
    plan.save(out_dir / "plan.yaml")
    # the observer attaches first, so that it sees each operand before the plan quantizes it
    observer = observer_factory(model) if observer_factory is not None else None
    convert(model, plan, generator=torch.Generator().manual_seed(cfg.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = LossScaler(
        init_scale=spec.init_scale,
        enabled=spec.loss_scaling != "none",
        dynamic=spec.loss_scaling == "dynamic",
    )
    scaler.track(model)
    start, curve, elapsed = 0, [], 0.0
    if checkpoint_path.is_file():
        state = load_checkpoint(checkpoint_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        load_numerics_state_dict(model, state["numerics"])
        _set_rng_state(state["rng"])
        start, curve, elapsed = state["step"], state["curve"], state["elapsed"]
        _truncate_log(log_path, start)
    elif log_path.exists():
        log_path.unlink()

    new_log = not log_path.exists()
    with log_path.open("a", newline="") as log_file:
        log = csv.DictWriter(log_file, fieldnames=LOG_FIELDS)
        if new_log:
            log.writeheader()
        began = time.perf_counter() - elapsed
        data_batches = _Batches(data, cfg)
        model.train()
        for step in range(start, cfg.steps):
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr_at(step)
            loss = model(**data_batches.at(step)).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            skipped_before = scaler.skipped_steps
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if observer is not None:
                observer.step()
            row: dict[str, Any] = {
                "step": step + 1,
                "lr": f"{cfg.lr_at(step):.3e}",
                "loss": f"{loss.item():.5f}",
                "scale": scale,
                "skipped": int(scaler.skipped_steps > skipped_before),
                "val_loss": "",
                "val_accuracy": "",
            }
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                evaluation = evaluate_mlm(
                    model, data.val_blocks, data.tokenizer, batch_size=64, seed=cfg.seed
                )
                row["val_loss"], row["val_accuracy"] = f"{evaluation.loss:.5f}", f"{evaluation.accuracy:.5f}"
                curve.append(
                    {"step": step + 1, "val_loss": evaluation.loss, "val_accuracy": evaluation.accuracy}
                )
            row["seconds"] = f"{time.perf_counter() - began:.2f}"
            log.writerow(row)
            if on_step is not None:
                on_step(step + 1, loss.item())
            if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                log_file.flush()
                save_checkpoint(
                    checkpoint_path,
                    {
                        "step": step + 1,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(),
                        "numerics": numerics_state_dict(model),
                        "rng": _rng_state(),
                        "curve": curve,
                        "elapsed": time.perf_counter() - began,
                    },
                )
    if observer is not None:
        observer.analysis().save(out_dir / "analysis")
        observer.__exit__(None, None, None)
    last = curve[-1]
    result = RunResult(
        name=spec.name,
        plan=spec.plan,
        loss_scaling=spec.loss_scaling,
        val_loss=last["val_loss"],
        val_accuracy=last["val_accuracy"],
        skipped_steps=scaler.skipped_steps,
        wall_seconds=time.perf_counter() - began,
        steps=cfg.steps,
        curve=curve,
        final_scale=scaler.get_scale(),
    )
    _atomic_write_text(result_path, json.dumps(result.to_dict(), indent=1))
    if checkpoint_path.exists():
        checkpoint_path.unlink()
    return result


def _truncate_log(log_path: Path, step: int) -> None:
    """Drop log rows after ``step`` (written after the last checkpoint of an interrupted run)."""
    if not log_path.exists():
        return
    with log_path.open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if int(row["step"]) <= step]
    with log_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=LOG_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
