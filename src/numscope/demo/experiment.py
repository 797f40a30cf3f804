"""One training run of a language model under a precision plan, resumable and logged.

The loop is the Micikevicius et al. recipe made switchable: the plan quantizes each GEMM operand (FP32
accumulation, FP32 master weights: the model's parameters stay FP32 and only GEMM operands are rounded),
softmax/layer norm/loss run in FP32, and an optional loss scaler protects small gradients. Every run writes
``log.csv`` (one row per step), ``checkpoint.pt`` (atomic) and, once finished, ``result.json``; a run whose
``result.json`` exists is not repeated, and an interrupted one resumes from its checkpoint bit for bit.

The model is the demo's BERT (a :class:`ModelConfig`) or any ``transformers``-style language model from a
factory; the *objective* is masked LM (BERT's 15% masking) or causal LM (next token). When
``torch.distributed`` is initialised with more than one rank the run is data-parallel (DDP): every rank
builds the same global batch and trains on its slice, the loss is weighted so that the gradient equals one
process's on the whole batch, and only rank 0 writes files.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from numscope import distributed
from numscope._atomic import atomic_write_text
from numscope.convert import convert, load_numerics_state_dict, numerics_state_dict, site_sizes
from numscope.demo.data import IGNORE_INDEX, MLMEvaluation, batches, derive_seed, evaluate_mlm, num_batches
from numscope.demo.tokenizer import TokenizerInfo
from numscope.plan import Plan
from numscope.sites import sites
from numscope.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from numscope.train.loss_scaler import LossScaler

if TYPE_CHECKING:  # the model module imports transformers; train_run imports it when it needs it
    from numscope.demo.model import ModelConfig

LOSS_SCALING = ("none", "static", "dynamic")


@dataclass(frozen=True)
class RunSpec:
    """What differs between the demo's runs: the plan and the loss scaling."""

    name: str
    plan: str  # a preset or recipe name (Plan.named) or a path to a plan YAML
    loss_scaling: str = "none"
    init_scale: float = 2.0**16
    description: str = ""

    def __post_init__(self) -> None:
        if self.loss_scaling not in LOSS_SCALING:
            raise ValueError(
                f"loss_scaling {self.loss_scaling!r} unknown; allowed: {', '.join(LOSS_SCALING)}"
            )

    def load_plan(self, sites: Iterable[str] | None = None) -> Plan:
        """The plan: a YAML file, else a preset or named recipe (given the model's ``sites`` where the
        recipe's layer choice needs them)."""
        if self.plan.endswith((".yaml", ".yml")):
            return Plan.load(self.plan)
        return Plan.named(self.plan, sites)


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
    avg_bits: float | None = None  # bits per GEMM operand element, weighted by a training step's sizes
    world_size: int = 1  # data-parallel ranks that trained the run
    rank_divergence: float | None = None  # largest parameter difference between ranks at the end (DDP only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunError(ValueError):
    """A run folder whose files cannot be used: a corrupt or foreign ``result.json`` or ``log.csv``."""


def read_result(path: Path) -> RunResult:
    """The :class:`RunResult` a finished run wrote to ``path`` (its ``result.json``); RunError if unusable."""
    try:
        return RunResult(**json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RunError(
            f"{path}: not a readable run result ({reason}); delete it to run the run again"
        ) from error


@dataclass(frozen=True)
class DemoData:
    train_blocks: torch.Tensor
    val_blocks: torch.Tensor
    tokenizer: TokenizerInfo


class Objective:
    """What a language model learns from token blocks: its batches, its loss's label count, its evaluation."""

    name = ""
    description = ""

    def batches(
        self, blocks: torch.Tensor, batch_size: int, tokenizer: TokenizerInfo, seed: int, epoch: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch of ``input_ids``, ``attention_mask``, ``labels`` batches, a function of (seed, epoch)."""
        raise NotImplementedError

    def label_count(self, batch: dict[str, torch.Tensor]) -> int:
        """How many tokens of ``batch`` the model's mean loss averages over."""
        raise NotImplementedError

    def evaluate(
        self, model: torch.nn.Module, val_blocks: torch.Tensor, tokenizer: TokenizerInfo, seed: int
    ) -> MLMEvaluation:
        """Mean loss (nats per scored token) and top-1 accuracy on the same validation tokens every call."""
        raise NotImplementedError


class MaskedLM(Objective):
    """BERT's masked LM: 15% of tokens selected (80% [MASK], 10% random, 10% kept) and predicted."""

    name = "mlm"
    description = "masked language modelling (BERT: predict 15% masked tokens)"

    def batches(
        self, blocks: torch.Tensor, batch_size: int, tokenizer: TokenizerInfo, seed: int, epoch: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        return batches(blocks, batch_size, tokenizer, seed=seed, epoch=epoch, drop_last=True)

    def label_count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def evaluate(
        self, model: torch.nn.Module, val_blocks: torch.Tensor, tokenizer: TokenizerInfo, seed: int
    ) -> MLMEvaluation:
        return evaluate_mlm(model, val_blocks, tokenizer, batch_size=64, seed=seed)


class CausalLM(Objective):
    """GPT's causal LM: every token predicts the next one; [PAD] positions are neither input nor target."""

    name = "clm"
    description = "causal language modelling (GPT: predict each next token)"

    def batches(
        self, blocks: torch.Tensor, batch_size: int, tokenizer: TokenizerInfo, seed: int, epoch: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(derive_seed(seed, "epoch", epoch))
        order = torch.randperm(blocks.shape[0], generator=generator)
        count = num_batches(blocks.shape[0], batch_size, drop_last=True)
        for start in range(0, count * batch_size, batch_size):
            input_ids = blocks[order[start : start + batch_size]].long()
            padding = input_ids == tokenizer.pad_id
            yield {
                "input_ids": input_ids,
                "attention_mask": (~padding).long(),
                "labels": input_ids.masked_fill(padding, IGNORE_INDEX),
            }

    def label_count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())  # transformers shifts labels by one

    def evaluate(
        self, model: torch.nn.Module, val_blocks: torch.Tensor, tokenizer: TokenizerInfo, seed: int
    ) -> MLMEvaluation:
        device = next(model.parameters()).device
        total_loss, correct, count = 0.0, 0, 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for start in range(0, val_blocks.shape[0], 64):
                    input_ids = val_blocks[start : start + 64].long().to(device)
                    attention_mask = (input_ids != tokenizer.pad_id).long()
                    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
                    targets = input_ids[:, 1:]
                    scored = targets != tokenizer.pad_id
                    chosen, wanted = logits[scored].float(), targets[scored]
                    total_loss += torch.nn.functional.cross_entropy(chosen, wanted, reduction="sum").item()
                    correct += int((chosen.argmax(dim=-1) == wanted).sum())
                    count += int(scored.sum())
        finally:
            model.train(was_training)
        if count == 0:
            raise ValueError(f"the {val_blocks.shape[0]} validation blocks hold no token to predict")
        return MLMEvaluation(loss=total_loss / count, accuracy=correct / count, masked_tokens=count)


OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in (MaskedLM(), CausalLM())}


def get_objective(name: str | Objective) -> Objective:
    """The objective called ``name`` (``mlm`` or ``clm``); raises ValueError naming the known ones."""
    if isinstance(name, Objective):
        return name
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


class _Batches:
    """The batch of a global step: a pure function of (seed, step), so a resumed run sees the same data.

    One epoch of batches is built at a time and kept until the next epoch starts.
    """

    def __init__(self, data: DemoData, cfg: TrainConfig, objective: Objective) -> None:
        self.data, self.cfg, self.objective = data, cfg, objective
        self.per_epoch = num_batches(data.train_blocks.shape[0], cfg.batch_size, drop_last=True)
        if self.per_epoch == 0:
            raise ValueError(
                f"batch size {cfg.batch_size} exceeds the {data.train_blocks.shape[0]} training blocks; "
                "use a smaller batch size or more text"
            )
        self.epoch, self.batches = -1, []

    def at(self, step: int) -> dict[str, torch.Tensor]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.batches = list(
                self.objective.batches(
                    self.data.train_blocks, self.cfg.batch_size, self.data.tokenizer, self.cfg.seed, epoch
                )
            )
        return self.batches[index]


LOG_FIELDS = ["step", "lr", "loss", "scale", "skipped", "val_loss", "val_accuracy", "seconds"]


def train_run(
    spec: RunSpec,
    model_config: ModelConfig | Callable[[], torch.nn.Module],
    cfg: TrainConfig,
    data: DemoData,
    out_dir: Path,
    on_step: Callable[[int, float], None] | None = None,
    observer_factory: Callable[[torch.nn.Module], Any] | None = None,
    *,
    objective: str | Objective = "mlm",
    save_model: bool = False,
    compiled: bool | str = "auto",
) -> RunResult:
    """Train one run (or resume it, or return its finished result) and write its files to ``out_dir``.

    model_config: the demo BERT's :class:`ModelConfig`, or a factory returning a freshly initialised
        ``transformers``-style model (``model(input_ids=…, attention_mask=…, labels=…)`` returns ``.loss``
        and ``.logits``); it is called after ``torch.manual_seed(cfg.seed)``.
    on_step(step, loss) is called after every step (for progress bars).
    observer_factory(model) may return an entered observer (``numscope.observe``) whose ``step()`` is called
    once per optimizer step and whose ``analysis()`` is saved to ``out_dir/analysis`` at the end.
    objective: ``mlm`` (masked LM), ``clm`` (causal LM) or an :class:`Objective`.
    save_model: also write the trained parameters to ``out_dir/model.pt`` (atomically).
    compiled: whether the plan's quantizers run compiled (:func:`numscope.convert`'s ``compiled``).

    Under ``torch.distributed`` with more than one rank the run is DDP over the default group (``batch_size``
    is the global batch and must divide evenly); every rank returns the result, only rank 0 writes. An
    observer merges each sampled step across the ranks at ``step()`` (its default ``reduce_ranks``), so rank
    0's analysis is that of the whole batch.
    """
    objective = get_objective(objective)
    world, rank = distributed.world_size(), distributed.rank()
    writer = rank == 0
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} does not divide evenly over {world} ranks")
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    result_path, checkpoint_path, log_path = (
        out_dir / "result.json",
        out_dir / "checkpoint.pt",
        out_dir / "log.csv",
    )
    if result_path.is_file():
        return read_result(result_path)

    from numscope.demo.model import ModelConfig, bert_mlm_from_config

    torch.manual_seed(cfg.seed)
    model = bert_mlm_from_config(model_config) if isinstance(model_config, ModelConfig) else model_config()
    plan = spec.load_plan(site.name for site in sites(model))
    if writer:
        plan.save(out_dir / "plan.yaml")
    # the observer attaches first, so that it sees each operand before the plan quantizes it
    observer = observer_factory(model) if observer_factory is not None else None
    convert(model, plan, generator=torch.Generator().manual_seed(cfg.seed), compiled=compiled)
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
        set_rng_state(state["rng"])
        if observer is not None:
            observer.load_state_dict(state["observer"])
        start, curve, elapsed = state["step"], state["curve"], state["elapsed"]
        if writer:
            _truncate_log(log_path, start)
    elif writer and log_path.exists():
        log_path.unlink()
    if world > 1:
        dist.barrier()  # every rank has read the checkpoint before rank 0 may replace it
    trained = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model

    new_log = not log_path.exists()
    avg_bits = None
    with log_path.open("a", newline="") if writer else open(os.devnull, "w") as log_file:
        log = csv.DictWriter(log_file, fieldnames=LOG_FIELDS)
        if new_log:
            log.writeheader()
        began = time.perf_counter() - elapsed
        data_batches = _Batches(data, cfg, objective)
        rows = cfg.batch_size // world
        model.train()
        for step in range(start, cfg.steps):
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr_at(step)
            batch = data_batches.at(step)
            if world > 1:
                whole = objective.label_count(batch)
                batch = {name: value[rank * rows : (rank + 1) * rows] for name, value in batch.items()}
                # the model's loss is a mean over this rank's labels; weighted so that DDP's average over
                # ranks is the mean over the whole batch's labels, as one process would compute it
                loss = trained(**batch).loss * (objective.label_count(batch) * world / max(1, whole))
            else:
                loss = trained(**batch).loss
            scaler.scale(loss).backward()
            if avg_bits is None:
                avg_bits = plan.average_bits(site_sizes(model))
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            skipped_before = scaler.skipped_steps
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if observer is not None:
                observer.step()
            loss_value = loss.item()
            if world > 1:
                reported = loss.detach().clone()
                dist.all_reduce(reported)
                loss_value = reported.item() / world
            row: dict[str, Any] = {
                "step": step + 1,
                "lr": f"{cfg.lr_at(step):.3e}",
                "loss": f"{loss_value:.5f}",
                "scale": scale,
                "skipped": int(scaler.skipped_steps > skipped_before),
                "val_loss": "",
                "val_accuracy": "",
            }
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                # every rank evaluates (amax reductions are collectives): same data, same result
                evaluation = objective.evaluate(model, data.val_blocks, data.tokenizer, cfg.seed)
                row["val_loss"], row["val_accuracy"] = f"{evaluation.loss:.5f}", f"{evaluation.accuracy:.5f}"
                curve.append(
                    {"step": step + 1, "val_loss": evaluation.loss, "val_accuracy": evaluation.accuracy}
                )
            row["seconds"] = f"{time.perf_counter() - began:.2f}"
            log.writerow(row)
            if on_step is not None:
                on_step(step + 1, loss_value)
            if writer and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                log_file.flush()
                save_checkpoint(
                    checkpoint_path,
                    {
                        "step": step + 1,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(),
                        "numerics": numerics_state_dict(model),
                        "rng": rng_state(),
                        **({"observer": observer.state_dict()} if observer is not None else {}),
                        "curve": curve,
                        "elapsed": time.perf_counter() - began,
                    },
                )
    if observer is not None:
        if writer:
            observer.analysis().save(out_dir / "analysis")
        observer.__exit__(None, None, None)
    divergence = distributed.parameter_divergence(model) if world > 1 else None  # a collective
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
        avg_bits=avg_bits,
        world_size=world,
        rank_divergence=divergence,
    )
    if writer:
        if save_model:
            save_checkpoint(out_dir / "model.pt", {"model": model.state_dict()})
        atomic_write_text(result_path, json.dumps(result.to_dict(), indent=1))
        if checkpoint_path.exists():
            checkpoint_path.unlink()
    if world > 1:
        dist.barrier()  # no rank leaves before rank 0 has written the result
    return result


def read_log(path: Path) -> list[dict[str, float]]:
    """The training rows of a run's ``log.csv``: ``step, loss, scale, skipped`` as numbers (RunError if
    the file is not such a log)."""
    try:
        with Path(path).open(newline="", encoding="utf-8") as f:
            return [
                {
                    "step": int(r["step"]),
                    "loss": float(r["loss"]),
                    "scale": float(r["scale"]),
                    "skipped": int(r["skipped"]),
                }
                for r in csv.DictReader(f)
            ]
    except (UnicodeDecodeError, KeyError, TypeError, ValueError) as error:
        raise RunError(f"{path}: not a numscope training log ({type(error).__name__}: {error})") from error


def _truncate_log(log_path: Path, step: int) -> None:
    """Drop log rows after ``step`` (written after the last checkpoint of an interrupted run), and a last
    row that a crash cut off (no line end: "1" of "105" would otherwise pass for step 1)."""
    if not log_path.exists():
        return
    raw = log_path.read_text(encoding="utf-8")
    if raw and not raw.endswith("\n"):
        raw = raw[: raw.rfind("\n") + 1]
    rows = [
        row
        for row in csv.DictReader(io.StringIO(raw, newline=""))
        if None not in row.values() and row["step"].isdigit() and int(row["step"]) <= step
    ]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=LOG_FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(log_path, text.getvalue())  # a crash mid-rewrite must not lose the run's log
